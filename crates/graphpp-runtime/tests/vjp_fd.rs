//! Finite-difference check of every VJP rule (and of the composite layers), in f64 on random
//! shapes: the gradient from autodiff → partition → executor must match central differences of
//! `loss = Σ op(x) ⊙ r` with a fixed random `r`.

mod common;

use candle_core::Tensor;
use graphpp_graph::layers;
use graphpp_graph::names::grad_of;
use graphpp_graph::MeshAxis;
use graphpp_graph::{
    partition, CollectiveKind, CommGroup, DType, Graph, GraphBuilder, InputKind, RecomputePolicy, TensorType,
    ValueId,
};
use graphpp_models::rng::Rng;
use graphpp_runtime::exec::{run_named, RunOptions};
use graphpp_runtime::kernels::tensor::{tensor_from_f64, to_f64};
use std::collections::HashMap;

/// Builds the op under test from float inputs and index inputs.
type OpFn = Box<dyn Fn(&mut GraphBuilder, &[ValueId], &[ValueId]) -> ValueId>;

/// One checked case: float input shapes, optional u32 index inputs (shape, bound), and the op.
struct Case {
    name: &'static str,
    floats: Vec<Vec<usize>>,
    indices: Vec<(Vec<usize>, u64)>,
    lo: f64,
    hi: f64,
    /// FD step and tolerance (relative to 1 + |FD|).
    eps: f64,
    tol: f64,
    op: OpFn,
}

fn case(
    name: &'static str,
    floats: Vec<Vec<usize>>,
    op: impl Fn(&mut GraphBuilder, &[ValueId], &[ValueId]) -> ValueId + 'static,
) -> Case {
    Case { name, floats, indices: vec![], lo: -1.0, hi: 1.0, eps: 1e-6, tol: 1e-6, op: Box::new(op) }
}

/// Forward graph: inputs `x0..` (activation), `i0..` (target, u32), `r` (buffer); `loss = Σ y ⊙ r`.
fn build(c: &Case) -> Graph {
    let mut b = GraphBuilder::new(c.name, DType::F64);
    let xs: Vec<ValueId> = c
        .floats
        .iter()
        .enumerate()
        .map(|(i, s)| b.input(&format!("x{i}"), InputKind::Activation, s.clone()).unwrap())
        .collect();
    let is: Vec<ValueId> = c
        .indices
        .iter()
        .enumerate()
        .map(|(i, (s, _))| {
            b.input_typed(&format!("i{i}"), InputKind::Target, TensorType::new(DType::U32, s.clone()))
                .unwrap()
        })
        .collect();
    let y = (c.op)(&mut b, &xs, &is);
    let ys = b.shape(y);
    let r = b.input("r", InputKind::Buffer, ys.clone()).unwrap();
    let p = b.mul(y, r).unwrap();
    let flat = b.reshape(p, vec![ys.iter().product()]).unwrap();
    let loss = b.sum(flat, 0, false).unwrap();
    b.output("loss", loss);
    b.finish().unwrap()
}

fn loss_of(fw: &Graph, env: &HashMap<String, Tensor>) -> f64 {
    let out = run_named(fw, env, &RunOptions::default()).unwrap();
    to_f64(&out.outputs[0]).unwrap()[0]
}

fn check(c: &Case, seed: u64) {
    let fw = build(c);
    let mut rng = Rng::new(seed);
    let mut env = HashMap::new();
    for s in fw.input_specs() {
        let bound = c
            .indices
            .get(s.name.strip_prefix('i').and_then(|k| k.parse::<usize>().ok()).unwrap_or(0))
            .map(|x| x.1)
            .unwrap_or(1);
        env.insert(s.name.clone(), common::random_input(&s, &mut rng, c.lo, c.hi, bound));
    }
    let joint = graphpp_graph::autodiff::autodiff(&fw).unwrap();
    let p = partition(&joint, 1, &RecomputePolicy::SaveAll).unwrap();
    let (_, grads, _, _) = common::fw_then_bw(&p.fw, &p.full_bw, &env, &HashMap::new());
    let eps = c.eps;
    for (i, shape) in c.floats.iter().enumerate() {
        let name = format!("x{i}");
        let x = to_f64(&env[&name]).unwrap();
        let got = to_f64(&grads[&grad_of(&name)]).unwrap();
        for k in 0..x.len() {
            let bump = |d: f64| {
                let mut xk = x.clone();
                xk[k] += d;
                let mut e = env.clone();
                e.insert(name.clone(), tensor_from_f64(&xk, shape, DType::F64).unwrap());
                loss_of(&fw, &e)
            };
            let fd = (bump(eps) - bump(-eps)) / (2.0 * eps);
            let tol = c.tol * (1.0 + fd.abs());
            assert!(
                (got[k] - fd).abs() <= tol,
                "{} seed {seed}: d/d{name}[{k}] autodiff {} vs FD {fd}",
                c.name,
                got[k]
            );
        }
    }
}

/// Random dimension in 1..=max.
fn dim(rng: &mut Rng, max: u64) -> usize {
    1 + rng.below(max) as usize
}

fn cases(seed: u64) -> Vec<Case> {
    let mut r = Rng::new(seed);
    let (a, b_, c, d) = (dim(&mut r, 3), dim(&mut r, 4), dim(&mut r, 4), dim(&mut r, 3) + 1);
    let g1 = CommGroup::new(MeshAxis::World, 1);
    let mut v = vec![
        case("neg", vec![vec![a, b_]], |b, x, _| b.neg(x[0]).unwrap()),
        case("exp", vec![vec![a, b_]], |b, x, _| b.exp(x[0]).unwrap()),
        case("sigmoid", vec![vec![a, b_, c]], |b, x, _| b.sigmoid(x[0]).unwrap()),
        case("erf", vec![vec![a, b_, c]], |b, x, _| b.erf(x[0]).unwrap()),
        case("affine", vec![vec![a, b_]], |b, x, _| b.affine(x[0], -1.5, 0.25).unwrap()),
        case("add_broadcast", vec![vec![a, b_, c], vec![b_, 1]], |b, x, _| b.add2(x[0], x[1]).unwrap()),
        case("sub_broadcast", vec![vec![c], vec![a, b_, c]], |b, x, _| b.sub(x[0], x[1]).unwrap()),
        case("mul_broadcast", vec![vec![a, 1, c], vec![a, b_, 1]], |b, x, _| b.mul(x[0], x[1]).unwrap()),
        case("sum_keepdim", vec![vec![a, b_, c]], |b, x, _| b.sum(x[0], 1, true).unwrap()),
        case("sum", vec![vec![a, b_, c]], |b, x, _| b.sum(x[0], 2, false).unwrap()),
        case("max", vec![vec![a, b_, c]], |b, x, _| b.max(x[0], 1, false).unwrap()),
        case("max_keepdim", vec![vec![a, b_, c]], |b, x, _| b.max(x[0], 2, true).unwrap()),
        case("matmul", vec![vec![a, b_, c], vec![a, c, d]], |b, x, _| b.matmul(x[0], x[1]).unwrap()),
        case("reshape", vec![vec![a, b_, c]], move |b, x, _| b.reshape(x[0], vec![a * b_, c]).unwrap()),
        case("permute", vec![vec![a, b_, c]], |b, x, _| b.permute(x[0], vec![2, 0, 1]).unwrap()),
        case("broadcast", vec![vec![b_, 1]], move |b, x, _| b.broadcast(x[0], vec![a, b_, c]).unwrap()),
        case("slice", vec![vec![a, d + 2]], move |b, x, _| b.slice(x[0], 1, 1, d + 1).unwrap()),
        case("concat", vec![vec![a, b_], vec![a, c]], |b, x, _| b.concat(&[x[0], x[1]], 1).unwrap()),
        case("all_gather", vec![vec![a, b_]], move |b, x, _| {
            let y = b.collective(CollectiveKind::AllGather, &g1, 0, x[0]).unwrap();
            b.exp(y).unwrap()
        }),
        case("reduce_scatter+all_reduce+all_to_all", vec![vec![a, b_]], {
            let g = CommGroup::new(MeshAxis::World, 1);
            move |b, x, _| {
                let y = b.collective(CollectiveKind::ReduceScatter, &g, 1, x[0]).unwrap();
                let y = b.collective(CollectiveKind::AllReduce, &g, 0, y).unwrap();
                let y = b.collective(CollectiveKind::AllToAll, &g, 0, y).unwrap();
                b.mul(y, y).unwrap()
            }
        }),
    ];
    let pos = |mut c: Case| {
        c.lo = 0.5;
        c.hi = 1.5;
        c
    };
    // Cast through f32: linear, so FD is exact up to f32 rounding (hence the larger step).
    let mut cast = case("cast", vec![vec![a, b_]], |b, x, _| {
        let y = b.cast(x[0], DType::F32).unwrap();
        b.cast(y, DType::F64).unwrap()
    });
    cast.eps = 1e-2;
    cast.tol = 1e-4;
    v.push(cast);
    v.push(pos(case("log", vec![vec![a, b_]], |b, x, _| b.log(x[0]).unwrap())));
    v.push(pos(case("sqrt", vec![vec![a, b_]], |b, x, _| b.sqrt(x[0]).unwrap())));
    v.push(pos(case("recip", vec![vec![a, b_]], |b, x, _| b.recip(x[0]).unwrap())));
    v.push(pos(case("div_broadcast", vec![vec![a, b_], vec![b_]], |b, x, _| b.div(x[0], x[1]).unwrap())));
    let mut with_idx = |name, floats, idx: Vec<(Vec<usize>, u64)>, op: OpFn| {
        v.push(Case { name, floats, indices: idx, lo: -1.0, hi: 1.0, eps: 1e-6, tol: 1e-6, op });
    };
    with_idx(
        "index_select",
        vec![vec![d, c]],
        vec![(vec![b_ + 2], d as u64)],
        Box::new(|b, x, i| b.index_select(x[0], i[0], 0).unwrap()),
    );
    with_idx(
        "index_add",
        vec![vec![d, c], vec![b_ + 2, c]],
        vec![(vec![b_ + 2], d as u64)],
        Box::new(|b, x, i| {
            let y = b.index_add(x[0], i[0], x[1], 0).unwrap();
            b.mul(y, y).unwrap()
        }),
    );
    with_idx(
        "gather",
        vec![vec![a, d]],
        vec![(vec![a, c], d as u64)],
        Box::new(|b, x, i| b.gather(x[0], i[0], 1).unwrap()),
    );
    // Mixture-of-experts segments: counts from 3 experts' ids; rows in segment order.
    let (rows, e) = (b_ + 3, 3usize);
    with_idx(
        "segment_matmul_transposed",
        vec![vec![rows, c], vec![e, d, c]],
        vec![(vec![rows], e as u64)],
        Box::new(move |b, x, i| {
            let counts = b.bincount(i[0], e).unwrap();
            b.segment_matmul(x[0], x[1], counts, true).unwrap()
        }),
    );
    with_idx(
        "segment_matmul",
        vec![vec![rows, c], vec![e, c, d]],
        vec![(vec![rows], e as u64)],
        Box::new(move |b, x, i| {
            let counts = b.bincount(i[0], e).unwrap();
            let y = b.segment_matmul(x[0], x[1], counts, false).unwrap();
            b.mul(y, y).unwrap()
        }),
    );
    with_idx(
        "segment_outer",
        vec![vec![rows, d], vec![rows, c]],
        vec![(vec![rows], e as u64)],
        Box::new(move |b, x, i| {
            let counts = b.bincount(i[0], e).unwrap();
            let y = b.segment_outer(x[0], x[1], counts).unwrap();
            b.mul(y, y).unwrap()
        }),
    );
    with_idx(
        "sort_by_expert",
        vec![vec![rows, c]],
        vec![(vec![rows], e as u64)],
        Box::new(move |b, x, i| {
            let perm = b.sort_by_expert(i[0], e).unwrap();
            b.index_select(x[0], perm, 0).unwrap()
        }),
    );
    with_idx(
        "scatter_add",
        vec![vec![a, d], vec![a, c]],
        vec![(vec![a, c], d as u64)],
        Box::new(|b, x, i| {
            let y = b.scatter_add(x[0], i[0], x[1], 1).unwrap();
            b.mul(y, y).unwrap()
        }),
    );
    v
}

#[test]
fn every_vjp_rule_matches_finite_differences() {
    for seed in [1, 2, 3] {
        for c in cases(seed) {
            check(&c, seed * 101);
        }
    }
}

#[test]
fn composite_layers_match_finite_differences() {
    let (bsz, t, d, heads, f, v) = (2, 3, 8, 2, 6, 5);
    let hd = d / heads;
    let mut cs = vec![
        case("rms_norm", vec![vec![bsz, t, d], vec![d]], |b, x, _| {
            layers::rms_norm(b, x[0], x[1], 1e-5).unwrap()
        }),
        case("softmax", vec![vec![bsz, t, d]], |b, x, _| b.softmax(x[0], 2).unwrap()),
        // A mask that takes a gradient (attention's is a buffer) and a scale other than 1.
        case("masked_softmax", vec![vec![bsz, t, d], vec![t, d]], |b, x, _| {
            b.softmax_masked(x[0], x[1], 0.7, 2).unwrap()
        }),
        case("rope", vec![vec![bsz, heads, t, hd], vec![t, hd], vec![t, hd]], |b, x, _| {
            layers::rope(b, x[0], x[1], x[2]).unwrap()
        }),
        case("swiglu", vec![vec![bsz, t, d], vec![f, d], vec![f, d], vec![d, f]], |b, x, _| {
            layers::swiglu_mlp(b, x[0], x[1], x[2], x[3]).unwrap()
        }),
        case(
            "attention",
            vec![vec![bsz, t, d], vec![d, d], vec![hd, d], vec![hd, d], vec![d, d], vec![t, hd], vec![t, hd]],
            move |b, x, _| {
                let mask = b.full(0.0, vec![t, t]).unwrap();
                let w = layers::AttentionWeights::new(x[1], x[2], x[3], x[4]);
                let dims = layers::AttentionDims { heads, kv_heads: 1 };
                layers::causal_attention(b, x[0], w, dims, x[5], x[6], mask).unwrap()
            },
        ),
    ];
    // HF `head_dim` 3 ≠ D/H = 4 (q_proj [H·3, D], o_proj [D, H·3]), biases on all four projections.
    let hd3 = 6;
    cs.push(case(
        "attention_head_dim_bias",
        vec![
            vec![bsz, t, d],
            vec![heads * hd3, d],
            vec![hd3, d],
            vec![hd3, d],
            vec![d, heads * hd3],
            vec![t, hd3],
            vec![t, hd3],
            vec![heads * hd3],
            vec![hd3],
            vec![hd3],
            vec![d],
        ],
        move |b, x, _| {
            let mask = b.full(0.0, vec![t, t]).unwrap();
            let w = layers::AttentionWeights {
                q_bias: Some(x[7]),
                k_bias: Some(x[8]),
                v_bias: Some(x[9]),
                o_bias: Some(x[10]),
                ..layers::AttentionWeights::new(x[1], x[2], x[3], x[4])
            };
            let dims = layers::AttentionDims { heads, kv_heads: 1 };
            layers::causal_attention(b, x[0], w, dims, x[5], x[6], mask).unwrap()
        },
    ));
    for (name, act) in [
        ("gated_mlp_gelu_bias", layers::Activation::Gelu),
        ("gated_mlp_gelu_tanh_bias", layers::Activation::GeluTanh),
    ] {
        cs.push(case(
            name,
            vec![vec![bsz, t, d], vec![f, d], vec![f, d], vec![d, f], vec![f], vec![f], vec![d]],
            move |b, x, _| {
                let w = layers::MlpWeights {
                    gate: x[1],
                    up: x[2],
                    down: x[3],
                    gate_bias: Some(x[4]),
                    up_bias: Some(x[5]),
                    down_bias: Some(x[6]),
                };
                layers::gated_mlp(b, x[0], w, act).unwrap()
            },
        ));
    }
    let mut wide = |name, op: fn(&mut GraphBuilder, ValueId) -> ValueId| {
        let mut c = case(name, vec![vec![bsz, t, d]], move |b, x, _| op(b, x[0]));
        c.lo = -3.0;
        c.hi = 3.0;
        cs.push(c);
    };
    wide("gelu", |b, x| layers::gelu(b, x).unwrap());
    wide("gelu_tanh", |b, x| layers::gelu_tanh(b, x).unwrap());
    cs.push(Case {
        name: "cross_entropy",
        floats: vec![vec![bsz * t, v]],
        indices: vec![(vec![bsz * t], v as u64)],
        lo: -2.0,
        hi: 2.0,
        eps: 1e-6,
        tol: 1e-6,
        op: Box::new(|b, x, i| layers::cross_entropy(b, x[0], i[0]).unwrap()),
    });
    for c in &cs {
        check(c, 7);
    }
}
