//! Structure of the derived graphs: partition, recompute, dI/dW split, multiplexing, FSDP split.

mod common;

use graphpp_graph::autodiff::autodiff;
use graphpp_graph::names::{grad_of, GRAD};
use graphpp_graph::passes::{dce, is_comm, multiplex_fw_bw, split_fsdp_collectives, Multiplex};
use graphpp_graph::MeshAxis;
use graphpp_graph::{
    check_graph, partition, stage_graphs, CollectiveKind, CommGroup, DType, Graph, GraphBuilder, InputKind,
    Op, Phase, RecomputePolicy, Region, TensorType, ValueId,
};
use proptest::prelude::*;

fn matmul_shapes(g: &Graph, scope: &str) -> Vec<Vec<usize>> {
    g.nodes
        .iter()
        .filter(|n| matches!(n.op, Op::Matmul) && n.meta.scope == scope)
        .map(|n| n.ty.shape.clone())
        .collect()
}

#[test]
fn bw_di_holds_input_grad_matmuls_and_no_weight_grad_matmuls() {
    let (bsz, t, d, f) = (2, 3, 8, 12); // n = 6 ≠ d, so dX and dW shapes differ
    let fw = common::block_stage(bsz, t, d, f, 2);
    let sg = stage_graphs(&fw, &RecomputePolicy::SaveAll).unwrap();
    let (di, dw) = sg.di_dw.clone().expect("a middle stage splits");
    let n = bsz * t;
    for (scope, out, inn) in [
        ("attn.q_proj", d, d),
        ("attn.k_proj", d, d),
        ("attn.v_proj", d, d),
        ("attn.o_proj", d, d),
        ("mlp.gate_proj", f, d),
        ("mlp.up_proj", f, d),
        ("mlp.down_proj", d, f),
    ] {
        let input_grad = vec![n, inn]; // dX = dY · W
        let weight_grad = vec![inn, out]; // d(Wᵀ) = Xᵀ · dY
        let full = matmul_shapes(&sg.full_bw, scope);
        assert!(full.contains(&input_grad) && full.contains(&weight_grad), "{scope}: full_bw {full:?}");
        let in_di = matmul_shapes(&di, scope);
        assert!(in_di.contains(&input_grad), "{scope}: bw_di lacks dX matmul: {in_di:?}");
        assert!(!in_di.contains(&weight_grad), "{scope}: bw_di holds the dW matmul");
        let in_dw = matmul_shapes(&dw, scope);
        assert_eq!(in_dw, vec![weight_grad], "{scope}: bw_dw should hold only the dW matmul");
    }
    assert_eq!(di.output_names()[0], grad_of("input"));
    assert!(dw.output_names().iter().all(|n| n.starts_with(GRAD) && *n != grad_of("input")));
    assert_eq!(dw.outputs.len(), 9, "one gradient per parameter");
}

#[test]
fn first_stage_keeps_full_bw_only() {
    let mut b = GraphBuilder::new("s0", DType::F32);
    let emb = b.input("embed.weight", InputKind::Parameter, vec![10, 4]).unwrap();
    let ids = b.input_typed("tokens", InputKind::Activation, TensorType::new(DType::U32, vec![3])).unwrap();
    let x = graphpp_graph::layers::embedding(&mut b, emb, ids).unwrap();
    b.output("output", x);
    let sg = stage_graphs(&b.finish().unwrap(), &RecomputePolicy::SaveAll).unwrap();
    assert!(sg.di_dw.is_none());
    assert_eq!(sg.full_bw.output_names(), vec![grad_of("embed.weight")]);
}

#[test]
fn partition_interfaces_are_explicit() {
    let fw = common::block_stage(2, 4, 8, 12, 2);
    let joint = autodiff(&fw).unwrap();
    let p = partition(&joint, 1, &RecomputePolicy::SaveAll).unwrap();
    // fw: same inputs as the forward, outputs = output + saved.
    assert_eq!(p.fw.input_names(), fw.input_names());
    assert_eq!(p.fw.output_names()[0], "output");
    assert_eq!(p.fw.outputs.len(), 1 + p.saved.len());
    // bw: params/buffers/activation first, then saved in order, then the tangent last.
    let specs = p.full_bw.input_specs();
    assert_eq!(specs.last().unwrap().name, grad_of("output"));
    assert_eq!(specs.last().unwrap().kind, InputKind::Tangent);
    let saved: Vec<String> =
        specs.iter().filter(|s| s.kind == InputKind::Saved).map(|s| s.name.clone()).collect();
    assert_eq!(saved, p.saved);
    let kinds: Vec<InputKind> = specs.iter().map(|s| s.kind).collect();
    assert!(kinds.windows(2).all(|w| w[0] <= w[1]), "inputs not in interface order: {kinds:?}");
    // No weight transposes are saved: they are recomputed from the parameters.
    for o in &p.fw.outputs[1..] {
        assert!(
            !matches!(p.fw.node(o.value).op, Op::Permute { .. } if p.fw.node(p.fw.node(o.value).inputs[0]).op.mnemonic() == "input.parameter")
        );
    }
}

#[test]
fn recompute_saves_only_stage_inputs_and_recomputes_in_bw() {
    let fw = common::block_stage(2, 4, 8, 12, 2);
    let joint = autodiff(&fw).unwrap();
    let all = partition(&joint, 1, &RecomputePolicy::SaveAll).unwrap();
    let ckpt = partition(&joint, 1, &RecomputePolicy::SaveStageInputs).unwrap();
    let sel = partition(&joint, 1, &RecomputePolicy::SaveMatmuls).unwrap();
    assert!(ckpt.saved.is_empty());
    assert!(!all.saved.is_empty());
    assert!(sel.saved.len() < all.saved.len() && !sel.saved.is_empty());
    let rec = |g: &Graph| g.nodes.iter().filter(|n| n.meta.phase == Phase::Recompute).count();
    assert!(rec(&ckpt.full_bw) > rec(&sel.full_bw) && rec(&sel.full_bw) > rec(&all.full_bw));
    assert!(ckpt.full_bw.input_names().contains(&"input".to_string()));
}

/// A graph with two comm regions: `compute → all_to_all → compute → all_to_all → compute`.
fn comm_graph(name: &str, with_bw: bool) -> Graph {
    let mut b = GraphBuilder::new(name, DType::F32);
    let g = CommGroup::new(MeshAxis::Expert, 1);
    let grad_out = grad_of("output");
    let x = b.input(if with_bw { &grad_out } else { "input" }, InputKind::Activation, vec![4, 4]).unwrap();
    b.set_phase(if with_bw { Phase::Backward } else { Phase::Forward });
    let mut v = b.exp(x).unwrap();
    for k in 0..2 {
        b.set_region(Region::Comm(format!("ep.dispatch{k}")));
        let s = b.collective_start(CollectiveKind::AllToAll, &g, 0, v).unwrap();
        let w = b.wait(s).unwrap();
        b.set_region(Region::Compute);
        let c = b.exp(v).unwrap(); // independent compute the wait can overlap with
        let c = b.neg(c).unwrap();
        v = b.add2(w, c).unwrap();
    }
    b.output("y", v);
    b.finish().unwrap()
}

#[test]
fn comm_overlap_interleaves_compute_of_one_graph_with_comm_of_the_other() {
    let fw = comm_graph("fw", false);
    let bw = comm_graph("bw", true);
    let m = multiplex_fw_bw(&fw, &bw, Multiplex::CommOverlap).unwrap();
    check_graph(&m).unwrap();
    let is_bw = |v: ValueId| m.node(v).meta.phase == Phase::Backward;
    let users = m.users();
    let mut checked = 0;
    for (i, n) in m.nodes.iter().enumerate() {
        if !matches!(n.op, Op::CollectiveStart { .. }) {
            continue;
        }
        let wait = users[i][0].0;
        // Between a start and its wait, the other graph computes.
        let other_compute = (i + 1..wait).filter(|&j| {
            let v = ValueId(j);
            is_bw(v) != is_bw(ValueId(i))
                && !is_comm(&m, v)
                && !matches!(m.node(v).op, Op::CollectiveWait | Op::Input { .. })
        });
        assert!(other_compute.count() > 0, "start %{i} overlaps no compute of the other graph");
        // The wait sits right before its first user.
        assert_eq!(users[wait][0].0, wait + 1, "wait %{wait} not moved to its first use");
        checked += 1;
    }
    assert_eq!(checked, 4);
    // Segment order: the first non-input node is bw compute, then bw comm, then fw compute.
    let seq: Vec<(bool, bool)> = (0..m.nodes.len())
        .map(ValueId)
        .filter(|v| !matches!(m.node(*v).op, Op::Input { .. } | Op::CollectiveWait))
        .map(|v| (is_bw(v), is_comm(&m, v)))
        .collect();
    let mut runs: Vec<(bool, bool)> = Vec::new();
    for s in seq {
        if runs.last() != Some(&s) {
            runs.push(s);
        }
    }
    assert_eq!(&runs[..4], &[(true, false), (true, true), (false, false), (false, true)]);
    // Concat keeps fw entirely before bw.
    let c = multiplex_fw_bw(&fw, &bw, Multiplex::Concat).unwrap();
    let phases: Vec<bool> = c
        .nodes
        .iter()
        .filter(|n| !matches!(n.op, Op::Input { .. }))
        .map(|n| n.meta.phase == Phase::Backward)
        .collect();
    assert!(phases.windows(2).all(|w| w[0] <= w[1]));
    assert_eq!(c.input_names(), vec!["f.input", "b.grad.output"]);
    assert_eq!(c.output_names(), vec!["f.y", "b.y"]);
}

#[test]
fn fsdp_split_moves_all_gathers_and_reduce_scatters_out() {
    let mut b = GraphBuilder::new("fw", DType::F32);
    let group = CommGroup::new(MeshAxis::Fsdp, 2);
    let w = b.input("w", InputKind::Parameter, vec![3, 8]).unwrap();
    let x = b.input("input", InputKind::Activation, vec![5, 8]).unwrap();
    let wf = b.collective(CollectiveKind::AllGather, &group, 0, w).unwrap();
    let y = graphpp_graph::layers::linear(&mut b, x, wf).unwrap();
    b.output("output", y);
    let sg = stage_graphs(&b.finish().unwrap(), &RecomputePolicy::SaveAll).unwrap();
    let s = split_fsdp_collectives(&sg.fw, &sg.full_bw).unwrap();
    let colls = |g: &Graph| {
        g.nodes.iter().filter(|n| n.op.is_collective()).map(|n| n.op.mnemonic()).collect::<Vec<_>>()
    };
    assert_eq!(colls(&s.unshard), vec!["all_gather_start", "wait"]);
    assert_eq!(colls(&s.reduce_grad), vec!["reduce_scatter_start", "wait"]);
    assert!(colls(&s.fw).is_empty() && colls(&s.bw).is_empty());
    assert_eq!(s.unshard.output_names(), vec!["unshard.w".replace("unshard.", "unsharded.")]);
    assert_eq!(s.unshard.node(s.unshard.outputs[0].value).ty.shape, vec![6, 8]);
    assert!(s.fw.input_names().contains(&"unsharded.w".to_string()));
    assert!(!s.fw.input_names().contains(&"w".to_string()));
    assert!(s.bw.output_names().contains(&grad_of("unsharded.w")));
    assert_eq!(s.reduce_grad.output_names(), vec![grad_of("w")]);
    assert_eq!(s.reduce_grad.node(s.reduce_grad.outputs[0].value).ty.shape, vec![3, 8]);
}

/// Megatron's f and g (Shoeybi et al. 2019, §3): over the `tp` axis, whose members share one
/// loss, a replicate's gradient is all-reduced and an all-reduce's passes through (a replicate,
/// which moves nothing); over `dp`, where each member has its own loss, an all-reduce is its own
/// adjoint.
#[test]
fn all_reduce_and_replicate_are_adjoint_over_a_shared_loss() {
    let backward = |axis: MeshAxis, kind: CollectiveKind| {
        let mut b = GraphBuilder::new("fw", DType::F32);
        let group = CommGroup::new(axis, 2);
        let x = b.input("input", InputKind::Activation, vec![4, 8]).unwrap();
        let y = b.collective(kind, &group, 0, x).unwrap();
        let y = b.exp(y).unwrap();
        b.output("output", y);
        let sg = stage_graphs(&b.finish().unwrap(), &RecomputePolicy::SaveAll).unwrap();
        let colls: Vec<String> = sg
            .full_bw
            .nodes
            .iter()
            .filter(|n| matches!(n.op, graphpp_graph::Op::CollectiveStart { .. }))
            .map(|n| n.op.mnemonic())
            .collect();
        colls
    };
    assert_eq!(backward(MeshAxis::Tensor, CollectiveKind::Replicate), vec!["all_reduce_start"]);
    assert_eq!(backward(MeshAxis::Tensor, CollectiveKind::AllReduce), vec!["replicate_start"]);
    assert_eq!(backward(MeshAxis::DataParallel, CollectiveKind::AllReduce), vec!["all_reduce_start"]);
    assert_eq!(backward(MeshAxis::Tensor, CollectiveKind::AllGather), vec!["reduce_scatter_start"]);
}

#[test]
fn dce_removes_unused_nodes_but_keeps_inputs() {
    let mut b = GraphBuilder::new("g", DType::F32);
    let x = b.input("x", InputKind::Activation, vec![2]).unwrap();
    let _unused_in = b.input("z", InputKind::Activation, vec![2]).unwrap();
    let _dead = b.exp(x).unwrap();
    let y = b.neg(x).unwrap();
    b.output("y", y);
    let g = dce(&b.finish().unwrap()).unwrap();
    assert_eq!(g.nodes.len(), 3);
    assert_eq!(g.input_names(), vec!["x", "z"]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn split_covers_full_bw_exactly(widths in proptest::collection::vec(1usize..6, 2..6), n in 1usize..5) {
        let fw = common::mlp_stage(n, &widths);
        let sg = stage_graphs(&fw, &RecomputePolicy::SaveAll).unwrap();
        let (di, dw) = sg.di_dw.unwrap();
        for g in [&sg.fw, &sg.full_bw, &di, &dw] { check_graph(g).unwrap(); }
        // Every node of full_bw runs in I or W; W may redo cheap ones (the cut holds fewer
        // bytes), but each matmul runs exactly once.
        let compute = |g: &Graph| g.nodes.iter().filter(|n| !matches!(n.op, Op::Input { .. } | Op::Full { .. })).count();
        prop_assert!(compute(&di) + compute(&dw) >= compute(&sg.full_bw));
        let matmuls = |g: &Graph| g.nodes.iter().filter(|n| matches!(n.op, Op::Matmul)).count();
        prop_assert_eq!(matmuls(&di) + matmuls(&dw), matmuls(&sg.full_bw));
        let mut outs = di.output_names();
        outs.retain(|o| !o.starts_with("stash."));
        outs.extend(dw.output_names());
        let mut full = sg.full_bw.output_names();
        outs.sort(); full.sort();
        prop_assert_eq!(outs, full);
        // Stash = bw_di outputs read by bw_dw, same names on both sides.
        let stash_in: Vec<String> = dw.input_specs().into_iter().filter(|s| s.name.starts_with("stash.")).map(|s| s.name).collect();
        prop_assert_eq!(stash_in, sg.stash.clone());
        // dW inputs other than the stash are full_bw inputs.
        for s in dw.input_specs() {
            prop_assert!(s.name.starts_with("stash.") || sg.full_bw.input_by_name(&s.name).is_some());
        }
    }
}

/// A random chain of `ops` (0 = exp, 1 = all_to_all start+wait, 2 = neg of an earlier value).
fn random_comm_graph(name: &str, backward: bool, ops: &[u8]) -> Graph {
    let mut b = GraphBuilder::new(name, DType::F32);
    let g = CommGroup::new(MeshAxis::Expert, 1);
    let x = b.input("x", InputKind::Activation, vec![2, 2]).unwrap();
    b.set_phase(if backward { Phase::Backward } else { Phase::Forward });
    let mut vals = vec![x];
    for (k, op) in ops.iter().enumerate() {
        let last = *vals.last().unwrap();
        let v = match op {
            0 => b.exp(last).unwrap(),
            1 => {
                b.set_region(Region::Comm(format!("ep.{k}")));
                let s = b.collective_start(CollectiveKind::AllToAll, &g, 0, last).unwrap();
                let w = b.wait(s).unwrap();
                b.set_region(Region::Compute);
                w
            }
            _ => b.neg(vals[k / 2]).unwrap(),
        };
        vals.push(v);
    }
    let y = *vals.last().unwrap();
    b.output("y", y);
    b.finish().unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn comm_overlap_keeps_each_graphs_order_and_waits_before_use(
        fops in proptest::collection::vec(0u8..3, 1..12),
        bops in proptest::collection::vec(0u8..3, 1..12),
    ) {
        let fw = random_comm_graph("fw", false, &fops);
        let bw = random_comm_graph("bw", true, &bops);
        let m = multiplex_fw_bw(&fw, &bw, Multiplex::CommOverlap).unwrap();
        check_graph(&m).unwrap();
        prop_assert_eq!(m.nodes.len(), fw.nodes.len() + bw.nodes.len());
        // Non-wait nodes of each source keep their relative order (compare op sequences).
        for (src, backward) in [(&fw, false), (&bw, true)] {
            let keep = |n: &&graphpp_graph::Node| !matches!(n.op, Op::CollectiveWait | Op::Input { .. });
            let want: Vec<String> = src.nodes.iter().filter(keep).map(|n| n.op.mnemonic()).collect();
            let got: Vec<String> = m.nodes.iter()
                .filter(|n| (n.meta.phase == Phase::Backward) == backward && keep(n))
                .map(|n| n.op.mnemonic()).collect();
            prop_assert_eq!(got, want);
        }
        // Every wait that has a user sits right before its first user (dead waits go last).
        let users = m.users();
        for (i, n) in m.nodes.iter().enumerate() {
            if matches!(n.op, Op::CollectiveWait) {
                match users[i].first() {
                    Some(u) => prop_assert_eq!(u.0, i + 1),
                    None => prop_assert!(m.nodes[i + 1..].iter().all(|n| matches!(n.op, Op::CollectiveWait))),
                }
            }
        }
    }
}
