//! IR basics: text form, DOT, JSON, typed shape errors, check_graph on builder output.

mod common;

use graphpp_graph::layers::linear;
use graphpp_graph::names::grad_of;
use graphpp_graph::print::{from_json, to_dot, to_json, to_text};
use graphpp_graph::{DType, GraphBuilder, GraphError, InputKind, TensorType};

#[test]
fn text_form_has_one_line_per_node_in_the_documented_format() {
    let mut b = GraphBuilder::new("fw", DType::F32);
    let x = b.input("x", InputKind::Activation, vec![4, 64, 128]).unwrap();
    let w = b.input("w", InputKind::Parameter, vec![4, 128, 256]).unwrap();
    b.push_scope("layers.0");
    b.push_scope("attn.q_proj");
    let y = b.matmul(x, w).unwrap();
    b.output("y", y);
    let g = b.finish().unwrap();
    let text = to_text(&g);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], "graph fw {");
    assert_eq!(lines[1], "%0 = input.activation(\"x\") : f32[4,64,128]");
    assert_eq!(lines[3], "%2 = matmul(%0, %1) : f32[4,64,256]  # layers.0.attn.q_proj");
    assert_eq!(lines[4], "return y=%2");
    assert_eq!(lines.len(), 2 + g.nodes.len() + 1);
}

#[test]
fn dot_and_json_cover_every_node_and_round_trip() {
    let g = common::block_stage(2, 4, 8, 12, 2);
    let dot = to_dot(&g);
    let edges = dot.matches(" -> n").count();
    let operand_edges: usize = g.nodes.iter().map(|n| n.inputs.len()).sum();
    assert_eq!(edges, operand_edges);
    assert!(dot.starts_with("digraph"));
    let back = from_json(&to_json(&g)).unwrap();
    assert_eq!(back, g);
}

#[test]
fn bad_shapes_give_typed_errors_naming_the_scope() {
    let mut b = GraphBuilder::new("fw", DType::F32);
    let x = b.input("x", InputKind::Activation, vec![3, 5]).unwrap();
    let w = b.input("w", InputKind::Parameter, vec![7, 6]).unwrap();
    b.push_scope("mlp.up_proj");
    let e = linear(&mut b, x, w).unwrap_err();
    assert!(matches!(e, GraphError::Shape { .. }), "{e}");
    let e = b.matmul(x, x).unwrap_err().to_string();
    assert!(e.contains("mlp.up_proj") && e.contains("inner dims"), "{e}");
    let ids = b.input_typed("ids", InputKind::Activation, TensorType::new(DType::F32, vec![3])).unwrap();
    let e = b.index_select(w, ids, 0).unwrap_err().to_string();
    assert!(e.contains("u32"), "{e}");
    assert!(b.input("x", InputKind::Activation, vec![1]).is_err(), "duplicate input name accepted");
}

#[test]
fn stats_count_matmul_flops() {
    let g = common::mlp_stage(8, &[16, 32, 4]);
    // 2·n·in·out per linear: 2·8·16·32 + 2·8·32·4.
    assert_eq!(g.matmul_flops(), 2 * 8 * 16 * 32 + 2 * 8 * 32 * 4);
}

#[test]
fn grouped_query_attention_shapes_are_checked() {
    let mut b = GraphBuilder::new("gqa", DType::F32);
    let q = b.input("q", InputKind::Activation, vec![2, 6, 4, 3]).unwrap();
    let kv = |b: &mut GraphBuilder, name: &str, heads: usize| {
        b.input(name, InputKind::Activation, vec![2, heads, 4, 3]).unwrap()
    };
    let mask = b.input("mask", InputKind::Buffer, vec![4, 4]).unwrap();
    let (k, v) = (kv(&mut b, "k", 2), kv(&mut b, "v", 2));
    let o = b.attention(q, k, v, mask, 0.5).unwrap();
    assert_eq!(b.shape(o), vec![2, 6, 4, 3]);
    let d = b.attention_backward(q, k, v, mask, o, o, 0.5).unwrap();
    assert_eq!(b.shape(d), vec![2, 6 + 2 * 2, 4, 3], "dq, dk, dv along the heads");
    // KV not dividing H, v unlike k: refused.
    let k4 = kv(&mut b, "k4", 4);
    let e = b.attention(q, k4, k4, mask, 0.5).unwrap_err().to_string();
    assert!(e.contains("KV dividing"), "{e}");
    let v3 = kv(&mut b, "v3", 3);
    assert!(b.attention(q, k, v3, mask, 0.5).is_err());
}

#[test]
fn attention_refuses_a_mask_that_needs_a_gradient() {
    let build = |mask_kind: InputKind| {
        let mut b = GraphBuilder::new("attn", DType::F32);
        let q = b.input("q", InputKind::Activation, vec![1, 2, 4, 3]).unwrap();
        let mask = b.input("mask", mask_kind, vec![4, 4]).unwrap();
        let o = b.attention(q, q, q, mask, 0.5).unwrap();
        let loss = b.sum(o, 3, false).unwrap();
        let loss = b.sum(loss, 2, false).unwrap();
        let loss = b.sum(loss, 1, false).unwrap();
        let loss = b.sum(loss, 0, false).unwrap();
        b.output("loss", loss);
        graphpp_graph::autodiff::autodiff(&b.finish().unwrap())
    };
    // A buffer mask: q's three uses get their gradients (one backward node, sliced).
    let joint = build(InputKind::Buffer).unwrap();
    let backward = joint.nodes.iter().filter(|n| n.op.mnemonic() == "attention_backward").count();
    assert_eq!(backward, 1);
    assert!(joint.output_by_name(&grad_of("q")).is_some());
    // A mask computed from an activation would silently get no gradient: refused, naming the
    // op and the operand.
    let err = build(InputKind::Activation).unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, GraphError::Autodiff { .. })
            && text.contains("attention gives its operand 3 no gradient"),
        "{text}"
    );
}
