//! Small stage graphs for the pass tests.
#![allow(dead_code)]

use graphpp_graph::layers::{
    causal_attention, linear, rms_norm, swiglu_mlp, AttentionDims, AttentionWeights,
};
use graphpp_graph::names::{INPUT, OUTPUT};
use graphpp_graph::{DType, Graph, GraphBuilder, InputKind};

/// A one-block decoder stage (attention + MLP with residuals) on input `[b, t, d]`.
pub fn block_stage(b_: usize, t: usize, d: usize, f: usize, heads: usize) -> Graph {
    let mut b = GraphBuilder::new("block.fw", DType::F32);
    let hd = d / heads;
    let n1 = b.input("ln1.weight", InputKind::Parameter, vec![d]).unwrap();
    let q = b.input("attn.q_proj.weight", InputKind::Parameter, vec![d, d]).unwrap();
    let k = b.input("attn.k_proj.weight", InputKind::Parameter, vec![d, d]).unwrap();
    let v = b.input("attn.v_proj.weight", InputKind::Parameter, vec![d, d]).unwrap();
    let o = b.input("attn.o_proj.weight", InputKind::Parameter, vec![d, d]).unwrap();
    let n2 = b.input("ln2.weight", InputKind::Parameter, vec![d]).unwrap();
    let g = b.input("mlp.gate_proj.weight", InputKind::Parameter, vec![f, d]).unwrap();
    let u = b.input("mlp.up_proj.weight", InputKind::Parameter, vec![f, d]).unwrap();
    let dn = b.input("mlp.down_proj.weight", InputKind::Parameter, vec![d, f]).unwrap();
    let cos = b.input("rope.cos", InputKind::Buffer, vec![t, hd]).unwrap();
    let sin = b.input("rope.sin", InputKind::Buffer, vec![t, hd]).unwrap();
    let mask = b.input("mask", InputKind::Buffer, vec![t, t]).unwrap();
    let x = b.input(INPUT, InputKind::Activation, vec![b_, t, d]).unwrap();
    b.push_scope("ln1");
    let h = rms_norm(&mut b, x, n1, 1e-5).unwrap();
    b.pop_scope();
    b.push_scope("attn");
    let a = causal_attention(
        &mut b,
        h,
        AttentionWeights::new(q, k, v, o),
        AttentionDims { heads, kv_heads: heads },
        cos,
        sin,
        mask,
    )
    .unwrap();
    b.pop_scope();
    let x = b.add2(x, a).unwrap();
    b.push_scope("ln2");
    let h = rms_norm(&mut b, x, n2, 1e-5).unwrap();
    b.pop_scope();
    b.push_scope("mlp");
    let m = swiglu_mlp(&mut b, h, g, u, dn).unwrap();
    b.pop_scope();
    let y = b.add2(x, m).unwrap();
    b.output(OUTPUT, y);
    b.finish().unwrap()
}

/// A chain of `widths.len() - 1` linear layers with sigmoid between, on input `[n, widths[0]]`.
pub fn mlp_stage(n: usize, widths: &[usize]) -> Graph {
    let mut b = GraphBuilder::new("mlp.fw", DType::F32);
    let ws: Vec<_> = (0..widths.len() - 1)
        .map(|i| {
            b.input(&format!("l{i}.weight"), InputKind::Parameter, vec![widths[i + 1], widths[i]]).unwrap()
        })
        .collect();
    let mut x = b.input(INPUT, InputKind::Activation, vec![n, widths[0]]).unwrap();
    for (i, w) in ws.iter().enumerate() {
        b.push_scope(&format!("l{i}"));
        x = linear(&mut b, x, *w).unwrap();
        if i + 1 < ws.len() {
            x = b.sigmoid(x).unwrap();
        }
        b.pop_scope();
    }
    b.output(OUTPUT, x);
    b.finish().unwrap()
}
