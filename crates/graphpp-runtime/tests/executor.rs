//! Executor behaviour: frees values after their last use (exact peak), per-node times, kernels
//! without gradients (top-k, eq), typed errors for bad inputs, and graph collectives over a
//! `Comm` (ranks as threads; groups resolved through the mesh; axes other than 0).

use std::time::Duration;

use graphpp_comm::{Comm, CommError, Mesh, MeshError, ThreadComm};
use graphpp_graph::MeshAxis;
use graphpp_graph::{CollectiveKind, CommGroup, DType, Graph, GraphBuilder, InputKind, TensorType};
use graphpp_runtime::exec::{
    peak_live_bytes, run, run_with, CollectiveError, ExecError, GraphComm, RunOptions,
};
use graphpp_runtime::kernels::tensor::{tensor_from_f64, tensor_u32, to_f64};

#[test]
fn values_are_freed_after_their_last_use() {
    // x → exp → neg: x dies when exp has run, exp when neg has run. Peak = two live [1000] f32.
    let mut b = GraphBuilder::new("chain", DType::F32);
    let x = b.input("x", InputKind::Activation, vec![1000]).unwrap();
    let w = b.input("w", InputKind::Parameter, vec![1000]).unwrap();
    let y = b.exp(x).unwrap();
    let y = b.mul(y, w).unwrap();
    let z = b.neg(y).unwrap();
    b.output("z", z);
    let g = b.finish().unwrap();
    let data: Vec<f64> = (0..1000).map(|i| i as f64 * 1e-3).collect();
    let t = tensor_from_f64(&data, &[1000], DType::F32).unwrap();
    let r = run(&g, &[t.clone(), t.clone()], &RunOptions { time_nodes: true, trace_peak: true }).unwrap();
    assert_eq!(r.peak_live_bytes, 2 * 4000, "parameters are not counted; x freed after exp");
    assert_eq!(peak_live_bytes(&g), 2 * 4000, "the static count is the same");
    assert_eq!(r.node_times.as_ref().unwrap().len(), g.nodes.len());
    // The peak is first reached while exp runs: its operand x is freed only after it.
    let live: Vec<usize> = r.live_at_peak.unwrap().iter().map(|v| v.0).collect();
    assert!(live.contains(&0) && live.contains(&2) && !live.contains(&3), "{live:?}");
    let out = to_f64(&r.outputs[0]).unwrap();
    assert!((out[500] + (0.5f64).exp() * 0.5).abs() < 1e-5);

    // Keeping x alive to the end (x is also an output) raises the peak by one tensor.
    let mut b = GraphBuilder::new("keep", DType::F32);
    let x = b.input("x", InputKind::Activation, vec![1000]).unwrap();
    let y = b.exp(x).unwrap();
    let z = b.neg(y).unwrap();
    b.output("z", z);
    b.output("x", x);
    let g = b.finish().unwrap();
    let r = run(&g, &[t], &RunOptions::default()).unwrap();
    assert_eq!(r.peak_live_bytes, 3 * 4000);
    assert_eq!(peak_live_bytes(&g), 3 * 4000);
    assert!(r.node_times.is_none());

    // A transposed weight is a view of the state: not counted.
    let mut b = GraphBuilder::new("state", DType::F32);
    let w = b.input("w", InputKind::Parameter, vec![10, 100]).unwrap();
    let x = b.input("x", InputKind::Activation, vec![1, 10]).unwrap();
    let wt = b.permute(w, vec![1, 0]).unwrap();
    let wtt = b.permute(wt, vec![1, 0]).unwrap();
    let y = b.matmul(x, wtt).unwrap();
    b.output("y", y);
    let g = b.finish().unwrap();
    let x = tensor_from_f64(&[1.0; 10], &[1, 10], DType::F32).unwrap();
    let w = tensor_from_f64(&[0.5; 1000], &[10, 100], DType::F32).unwrap();
    let r = run(&g, &[w, x], &RunOptions::default()).unwrap();
    assert_eq!(r.peak_live_bytes, 40 + 400);
    assert_eq!(peak_live_bytes(&g), 40 + 400);
    assert_eq!(to_f64(&r.outputs[0]).unwrap()[7], 5.0);
}

#[test]
fn topk_and_eq_kernels() {
    let mut b = GraphBuilder::new("k", DType::F32);
    let x = b.input("x", InputKind::Activation, vec![2, 5]).unwrap();
    let k = b.topk(x, 2).unwrap();
    let m = b.max(x, 1, true).unwrap();
    let e = b.eq(x, m).unwrap();
    b.output("k", k);
    b.output("e", e);
    let g = b.finish().unwrap();
    let data = [0.1, 0.9, -1.0, 0.5, 0.3, 2.0, -2.0, 1.0, 1.5, 0.0];
    let r = run(&g, &[tensor_from_f64(&data, &[2, 5], DType::F32).unwrap()], &RunOptions::default()).unwrap();
    assert_eq!(r.outputs[0].flatten_all().unwrap().to_vec1::<u32>().unwrap(), vec![1, 3, 0, 3]);
    assert_eq!(to_f64(&r.outputs[1]).unwrap(), vec![0., 1., 0., 0., 0., 1., 0., 0., 0., 0.]);
}

#[test]
fn bad_inputs_and_multi_rank_collectives_are_typed_errors() {
    let mut b = GraphBuilder::new("c", DType::F32);
    let x = b.input("x", InputKind::Activation, vec![2, 3]).unwrap();
    let g2 = CommGroup::new(MeshAxis::Fsdp, 2);
    let y = b.collective(CollectiveKind::AllGather, &g2, 0, x).unwrap();
    b.output("y", y);
    let g = b.finish().unwrap();
    let ok = tensor_from_f64(&[0.0; 6], &[2, 3], DType::F32).unwrap();
    match run(&g, &[ok], &RunOptions::default()) {
        Err(ExecError::Collective { group: Some(group), node: 1, source, .. })
            if matches!(*source, CollectiveError::NoComm) =>
        {
            assert_eq!(group, g2)
        }
        other => panic!("expected a collective error, got {other:?}"),
    }
    let wrong = tensor_u32(&[0; 6], &[2, 3]).unwrap();
    match run(&g, &[wrong], &RunOptions::default()) {
        Err(ExecError::Input { name, .. }) => assert_eq!(name, "x"),
        other => panic!("expected an input error, got {other:?}"),
    }
    assert!(matches!(run(&g, &[], &RunOptions::default()), Err(ExecError::Input { .. })));
    let _ = TensorType::new(DType::F32, vec![1]);
}

/// `x: f32[shape]` → one collective over `group` along `axis` (start, then wait) → output `y`.
fn one_collective(kind: CollectiveKind, group: &CommGroup, axis: usize, shape: &[usize]) -> Graph {
    let mut b = GraphBuilder::new("coll", DType::F32);
    let x = b.input("x", InputKind::Activation, shape.to_vec()).unwrap();
    let y = b.collective(kind, group, axis, x).unwrap();
    b.output("y", y);
    b.finish().unwrap()
}

/// Runs `graph` on every rank of `mesh` as threads over one `ThreadComm` world; rank r's input is
/// `input(r)`. Returns each rank's output (or error).
fn on_threads(
    graph: &Graph,
    mesh: Mesh,
    input: impl Fn(usize) -> Vec<f64> + Sync,
    shape: &[usize],
) -> Vec<Result<Vec<f64>, ExecError>> {
    let input = &input;
    std::thread::scope(|s| {
        let hs: Vec<_> = ThreadComm::world(mesh.world())
            .into_iter()
            .map(|comm| {
                let mesh = &mesh;
                s.spawn(move || {
                    let x = tensor_from_f64(&input(comm.rank()), shape, DType::F32).unwrap();
                    let gc = GraphComm { comm: &comm, mesh, timeout: Duration::from_secs(20) };
                    let r = run_with(graph, &[x], &RunOptions::default(), &gc)?;
                    Ok(to_f64(&r.outputs[0]).unwrap())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn all_reduce_over_two_ranks_gives_the_sum_on_both() {
    let dp = CommGroup::new(MeshAxis::DataParallel, 2);
    let g = one_collective(CollectiveKind::AllReduce, &dp, 0, &[2, 3]);
    let input = |r: usize| (0..6).map(|i| (10 * r + i) as f64).collect::<Vec<_>>();
    let out = on_threads(&g, Mesh::new(1, 2).unwrap(), input, &[2, 3]);
    let sum: Vec<f64> = (0..6).map(|i| (10 + 2 * i) as f64).collect();
    for (r, o) in out.into_iter().enumerate() {
        assert_eq!(o.unwrap(), sum, "rank {r}");
    }
}

#[test]
fn collectives_along_axis_1_move_it_to_dim_0_and_back() {
    // pp = 2, dp = 2: ranks 0 and 2 form dp[0,2], ranks 1 and 3 dp[1,3].
    let mesh = Mesh::new(2, 2).unwrap();
    let dp = CommGroup::new(MeshAxis::DataParallel, 2);
    // x_r = [[r, r+1, r+2], [r+3, r+4, r+5]] (rows of 3): all-gather along axis 1 puts the
    // members' rows side by side.
    let input = |r: usize| (0..6).map(|i| (r * 100 + i) as f64).collect::<Vec<_>>();
    let g = one_collective(CollectiveKind::AllGather, &dp, 1, &[2, 3]);
    let out: Vec<Vec<f64>> = on_threads(&g, mesh, input, &[2, 3]).into_iter().map(Result::unwrap).collect();
    let gathered = |a: usize, b: usize| {
        let (x, y) = (input(a), input(b));
        [&x[0..3], &y[0..3], &x[3..6], &y[3..6]].concat()
    };
    assert_eq!(out[0], gathered(0, 2));
    assert_eq!(out[2], gathered(0, 2));
    assert_eq!(out[1], gathered(1, 3));
    assert_eq!(out[3], gathered(1, 3));

    // Reduce-scatter along axis 1 of [2, 4]: group rank i keeps columns [2i, 2i+2) of the sum.
    let g = one_collective(CollectiveKind::ReduceScatter, &dp, 1, &[2, 4]);
    let input = |r: usize| (0..8).map(|i| (r * 100 + i) as f64).collect::<Vec<_>>();
    let out: Vec<Vec<f64>> = on_threads(&g, mesh, input, &[2, 4]).into_iter().map(Result::unwrap).collect();
    let sum =
        |a: usize, b: usize| -> Vec<f64> { input(a).iter().zip(input(b)).map(|(x, y)| x + y).collect() };
    let s02 = sum(0, 2);
    assert_eq!(out[0], vec![s02[0], s02[1], s02[4], s02[5]]);
    assert_eq!(out[2], vec![s02[2], s02[3], s02[6], s02[7]]);
    let s13 = sum(1, 3);
    assert_eq!(out[3], vec![s13[2], s13[3], s13[6], s13[7]]);

    // All-to-all along axis 1 of [2, 4]: member j gets every member's columns [2j, 2j+2), side by
    // side in group order.
    let g = one_collective(CollectiveKind::AllToAll, &dp, 1, &[2, 4]);
    let out: Vec<Vec<f64>> = on_threads(&g, mesh, input, &[2, 4]).into_iter().map(Result::unwrap).collect();
    let cols = |r: usize, j: usize, row: usize| input(r)[row * 4 + 2 * j..row * 4 + 2 * j + 2].to_vec();
    for (me, (a, b), j) in [(0, (0, 2), 0), (2, (0, 2), 1), (1, (1, 3), 0), (3, (1, 3), 1)] {
        let want = [cols(a, j, 0), cols(b, j, 0), cols(a, j, 1), cols(b, j, 1)].concat();
        assert_eq!(out[me], want, "rank {me}");
    }
}

#[test]
fn a_size_one_group_needs_no_communication_and_keeps_the_bits() {
    // A group the mesh does not know, of size 1: the identity, bitwise, with or without a Comm.
    let ep = CommGroup::new(MeshAxis::Expert, 1);
    let data = [0.1, -2.5e-7, 3.0, f64::from(f32::MAX), 1e-30, -0.0];
    let x = tensor_from_f64(&data, &[2, 3], DType::F32).unwrap();
    let bits = |t: &candle_core::Tensor| -> Vec<u32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
    };
    for kind in [CollectiveKind::AllReduce, CollectiveKind::AllGather, CollectiveKind::AllToAll] {
        let g = one_collective(kind, &ep, 1, &[2, 3]);
        let plain = run(&g, std::slice::from_ref(&x), &RunOptions::default()).unwrap();
        assert_eq!(bits(&plain.outputs[0]), bits(&x), "{kind:?}");
        let comm = ThreadComm::world(1).pop().unwrap();
        let mesh = Mesh::new(1, 1).unwrap();
        let gc = GraphComm { comm: &comm, mesh: &mesh, timeout: Duration::from_secs(1) };
        let with = run_with(&g, std::slice::from_ref(&x), &RunOptions::default(), &gc).unwrap();
        assert_eq!(bits(&with.outputs[0]), bits(&x), "{kind:?}");
    }
}

#[test]
fn graph_collective_errors_are_typed() {
    // A group the mesh does not resolve: the graph was built for another degree.
    let ep = CommGroup::new(MeshAxis::Expert, 2);
    let g = one_collective(CollectiveKind::AllReduce, &ep, 0, &[2]);
    let out = on_threads(&g, Mesh::new(1, 2).unwrap(), |_| vec![1.0, 2.0], &[2]);
    for o in out {
        match o {
            Err(ExecError::Collective { source, .. }) => match *source {
                CollectiveError::Group(MeshError::GroupSize { axis, graph_size: 2, .. }) => {
                    assert_eq!(axis, MeshAxis::Expert)
                }
                other => panic!("expected a group-size error, got {other:?}"),
            },
            other => panic!("expected a group-size error, got {other:?}"),
        }
    }
    // Another rank aborts while this one waits in the collective.
    let dp = CommGroup::new(MeshAxis::DataParallel, 2);
    let g = one_collective(CollectiveKind::AllReduce, &dp, 0, &[2]);
    let mesh = Mesh::new(1, 2).unwrap();
    let mut comms = ThreadComm::world(2);
    let c1 = comms.pop().unwrap();
    let c0 = comms.pop().unwrap();
    let e = std::thread::scope(|s| {
        let h = s.spawn(|| {
            let x = tensor_from_f64(&[1.0, 2.0], &[2], DType::F32).unwrap();
            let gc = GraphComm { comm: &c0, mesh: &mesh, timeout: Duration::from_secs(600) };
            run_with(&g, &[x], &RunOptions::default(), &gc)
        });
        c1.abort("rank 1 ran out of memory");
        h.join().unwrap().unwrap_err()
    });
    let ExecError::Collective { node: 1, source, .. } = e else {
        panic!("expected a collective error, got {e:?}")
    };
    match *source {
        CollectiveError::Comm(CommError::Aborted { failed_rank: 1, reason }) => {
            assert_eq!(reason, "rank 1 ran out of memory")
        }
        other => panic!("expected an abort naming rank 1, got {other:?}"),
    }
}

/// `all_to_all_v` over two ranks: rank r's rows go out in pieces of its send counts; each rank
/// gets its pieces in group order, then zero rows up to the static row count. A receive count
/// that differs from what the peer sends is a typed error on that rank.
#[test]
fn all_to_all_v_delivers_variable_pieces_padded() {
    let mesh = Mesh::new(1, 2).unwrap().with_ep(2).unwrap();
    let ep = CommGroup::new(MeshAxis::Expert, 2);
    // Rank 0 sends [1 row → 0, 2 rows → 1] of its 3; rank 1 sends [0 → 0, 1 → 1] (its third row
    // is padding, not sent).
    let sends = [[1u32, 2], [0, 1]];
    let run_rank = |recvs: [[u32; 2]; 2]| {
        std::thread::scope(|s| {
            let hs: Vec<_> = ThreadComm::world(2)
                .into_iter()
                .map(|comm| {
                    let mesh = &mesh;
                    s.spawn(move || {
                        let r = comm.rank();
                        let mut b = GraphBuilder::new("a2av", DType::F32);
                        let x = b.input("x", InputKind::Activation, vec![3, 2]).unwrap();
                        let ty = TensorType::new(DType::U32, vec![2]);
                        let send = b.input_typed("send", InputKind::Activation, ty.clone()).unwrap();
                        let recv = b.input_typed("recv", InputKind::Activation, ty).unwrap();
                        let y = b.all_to_all_v(&ep, x, send, recv, 4).unwrap();
                        b.output("y", y);
                        let g = b.finish().unwrap();
                        let x = tensor_from_f64(
                            &(0..6).map(|i| (10 * r + i) as f64).collect::<Vec<_>>(),
                            &[3, 2],
                            DType::F32,
                        )
                        .unwrap();
                        let counts =
                            |c: [u32; 2]| candle_core::Tensor::new(&c, &candle_core::Device::Cpu).unwrap();
                        let gc = GraphComm { comm: &comm, mesh, timeout: Duration::from_secs(20) };
                        let out = run_with(
                            &g,
                            &[x, counts(sends[r]), counts(recvs[r])],
                            &RunOptions::default(),
                            &gc,
                        )?;
                        Ok::<_, ExecError>(to_f64(&out.outputs[0]).unwrap())
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
        })
    };
    let out = run_rank([[1, 0], [2, 1]]);
    // Rank 0: its own row 0, nothing from rank 1, then 3 zero rows.
    assert_eq!(out[0].as_ref().unwrap(), &vec![0., 1., 0., 0., 0., 0., 0., 0.]);
    // Rank 1: rank 0's rows 1–2, its own row 0, then one zero row.
    assert_eq!(out[1].as_ref().unwrap(), &vec![2., 3., 4., 5., 10., 11., 0., 0.]);
    let out = run_rank([[1, 0], [1, 1]]);
    assert!(out[0].is_ok());
    let e = out[1].as_ref().unwrap_err().to_string();
    assert!(e.contains("received [2, 1] rows per member, the graph expected [1, 1]"), "{e}");
}
