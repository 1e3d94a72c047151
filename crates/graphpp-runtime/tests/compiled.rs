//! The compiled executor ([`Program`]) against the interpreter, the reference path (issue 11
//! item 1): every model graph — tiny and small Llama (both stages of a 2-stage split), the MoE
//! preset — and the passes' outputs (fw, full_bw, bw_di, bw_dw, the multiplexed overlap graph)
//! give the interpreter's outputs within 1e-6 relative in f32 (bitwise, as the fused kernels
//! repeat candle's arithmetic) and the same peak live bytes; random elementwise chains over
//! broadcast and permuted operands (proptest) agree too.

mod common;

use candle_core::Tensor;
use graphpp_graph::passes::{multiplex_fw_bw, Multiplex};
use graphpp_graph::{stage_graphs, DType, Graph, GraphBuilder, InputKind, RecomputePolicy, StageGraphs};
use graphpp_models::moe::MoeConfig;
use graphpp_models::rng::Rng;
use graphpp_models::{build_stage, init_parameters, split_layers, stage_buffers, LlamaConfig, StageOptions};
use graphpp_runtime::executor::{run_named, tensor_from_f64, RunOptions};
use graphpp_runtime::Program;
use proptest::prelude::*;
use std::collections::HashMap;

type Env = HashMap<String, Tensor>;

/// Runs `g` both ways on `env` (inputs it lacks drawn at random); asserts equal outputs and
/// peaks; returns the outputs by name and the number of nodes fused.
fn both_ways(g: &Graph, env: &mut Env, rng: &mut Rng) -> (Env, usize) {
    for s in g.input_specs() {
        if !env.contains_key(&s.name) {
            let t = common::random_input(&s, rng, -1.0, 1.0, 8);
            env.insert(s.name.clone(), t);
        }
    }
    let program = Program::compile(g);
    let o = RunOptions::default();
    let a = run_named(g, env, &o).unwrap();
    let b = program.run_named_with(g, env, &o, None).unwrap();
    for (name, (x, y)) in g.output_names().iter().zip(a.outputs.iter().zip(&b.outputs)) {
        assert_eq!(x.dims(), y.dims(), "{} output {name}", g.name);
        let err = common::rel_err(y, x, 1e-30);
        assert!(err <= 1e-6, "{} output {name}: compiled vs interpreted relative error {err:e}", g.name);
    }
    assert_eq!(a.peak_live_bytes, b.peak_live_bytes, "{}: the peak report is the interpreter's", g.name);
    let fused = program.fusion().member_of.iter().flatten().count();
    (g.output_names().into_iter().zip(a.outputs).collect(), fused)
}

/// fw, full_bw, bw_di → bw_dw and the overlap graph of `sg`, on `state` and random data;
/// returns the nodes fused over all five.
fn check_stage(sg: &StageGraphs, state: &Env, rng: &mut Rng) -> usize {
    let mut env = state.clone();
    let (fo, mut fused) = both_ways(&sg.fw, &mut env, rng);
    env.extend(fo);
    let mut bw_env = env.clone();
    fused += both_ways(&sg.full_bw, &mut bw_env, rng).1;
    if let Some((di, dw)) = &sg.di_dw {
        let mut e = bw_env.clone();
        let (dio, n) = both_ways(di, &mut e, rng);
        e.extend(dio);
        fused += n + both_ways(dw, &mut e, rng).1;
    }
    let overlap = multiplex_fw_bw(&sg.fw, &sg.full_bw, Multiplex::CommOverlap).unwrap();
    let mut e: Env = env.iter().map(|(k, v)| (format!("f.{k}"), v.clone())).collect();
    e.extend(bw_env.iter().map(|(k, v)| (format!("b.{k}"), v.clone())));
    fused + both_ways(&overlap, &mut e, rng).1
}

/// Parameters (seed 0) and buffers of a Llama stage.
fn llama_state(cfg: &LlamaConfig, spec: &graphpp_models::StageSpec, opts: &StageOptions) -> Env {
    let mut env = Env::new();
    for (name, shape, data) in init_parameters(cfg, spec, 0) {
        env.insert(name, Tensor::from_vec(data, shape, &candle_core::Device::Cpu).unwrap());
    }
    for (name, shape, data) in stage_buffers(cfg, opts.seq) {
        env.insert(name, tensor_from_f64(&data, &shape, DType::F32).unwrap());
    }
    env
}

fn check_llama(cfg: &LlamaConfig, stages: usize, opts: &StageOptions) {
    let mut rng = Rng::new(7);
    for spec in split_layers(cfg.num_hidden_layers, stages, None).unwrap() {
        let fw = build_stage(cfg, &spec, opts).unwrap();
        let sg = stage_graphs(&fw, &RecomputePolicy::SaveAll).unwrap();
        let fused = check_stage(&sg, &llama_state(cfg, &spec, opts), &mut rng);
        // RMSNorm, RoPE, SwiGLU and their backward are elementwise chains: most of them fuse.
        let nodes = sg.fw.nodes.len() + sg.full_bw.nodes.len();
        assert!(fused * 5 > nodes, "{fused} of {nodes} nodes fused: fusion has stopped finding chains");
    }
}

#[test]
fn tiny_llama_graphs_compiled_equal_interpreted() {
    check_llama(&LlamaConfig::tiny(), 2, &StageOptions::new(2, 16));
}

#[test]
fn small_llama_graphs_compiled_equal_interpreted() {
    check_llama(&LlamaConfig::small(), 2, &StageOptions::new(1, 16));
}

#[test]
fn moe_graphs_compiled_equal_interpreted() {
    let cfg = MoeConfig::tiny();
    let opts = StageOptions::new(2, 8);
    let mut rng = Rng::new(3);
    for spec in split_layers(cfg.base.num_hidden_layers, 2, None).unwrap() {
        let fw = cfg.build_stage(&spec, &opts).unwrap();
        let sg = stage_graphs(&fw, &RecomputePolicy::SaveAll).unwrap();
        let mut state = Env::new();
        for s in fw.input_specs() {
            if matches!(s.kind, InputKind::Parameter | InputKind::Buffer) {
                state.insert(s.name.clone(), common::random_input(&s, &mut rng, -0.1, 0.1, 1));
            }
        }
        assert!(check_stage(&sg, &state, &mut rng) > 0);
    }
}

/// Builds `out = f_k(… f_1(x, y_1) …, y_k)` over `shape`, where each `y_i` is an input of a
/// shape that broadcasts (dims set to 1 by `mask_i`) or a permuted view of a `[.., b, a]` input,
/// with unary ops and affines in between.
fn chain(shape: &[usize], steps: &[(u8, u8)]) -> Graph {
    let mut b = GraphBuilder::new("chain", DType::F32);
    let mut x = b.input("x", InputKind::Activation, shape.to_vec()).unwrap();
    for (i, &(op, mask)) in steps.iter().enumerate() {
        let name = format!("y{i}");
        let y = if mask == 0xff && shape.len() >= 2 {
            let mut t = shape.to_vec();
            let r = t.len();
            t.swap(r - 1, r - 2);
            let raw = b.input(&name, InputKind::Activation, t).unwrap();
            b.transpose_last(raw).unwrap()
        } else {
            let s: Vec<usize> =
                shape.iter().enumerate().map(|(k, &d)| if mask >> k & 1 == 1 { 1 } else { d }).collect();
            b.input(&name, InputKind::Activation, s).unwrap()
        };
        x = match op % 9 {
            0 => b.add2(x, y),
            1 => b.sub(x, y),
            2 => b.mul(x, y),
            3 => b.div(x, y),
            4 => b.eq(x, y),
            5 => b.sigmoid(x).and_then(|s| b.mul(s, y)),
            6 => b.exp(x).and_then(|e| b.affine(e, 0.5, -0.25)),
            7 => b.neg(x).and_then(|n| b.add2(n, y)),
            _ => b.erf(x).and_then(|e| b.mul(e, y)),
        }
        .unwrap();
    }
    b.output("out", x);
    b.finish().unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn random_chains_compiled_equal_interpreted(
        shape in prop::collection::vec(1usize..7, 1..4),
        steps in prop::collection::vec((0u8..9, prop_oneof![0u8..8, Just(0xffu8)]), 1..6),
        big in any::<bool>(),
    ) {
        // `big` makes the output large enough (> 16k elements) to take the threaded path.
        let mut shape = shape;
        if big {
            shape.push(700);
            shape.push(25);
        }
        let g = chain(&shape, &steps);
        let program = Program::compile(&g);
        prop_assert_eq!(program.fusion().groups.len(), 1, "the whole chain is one group");
        let mut rng = Rng::new(shape.len() as u64);
        let mut env = Env::new();
        both_ways(&g, &mut env, &mut rng);
    }
}
