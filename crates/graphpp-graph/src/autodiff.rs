//! Reverse-mode autodiff: one VJP rule per primitive; produces the joint forward+backward graph
//! (docs/ARCHITECTURE.md "Graph IR" → Autodiff). The joint graph's outputs are the user outputs, then
//! `grad.<name>` for every float parameter and activation input, in input order.
//!
//! Seeding: a scalar output named `loss` is seeded with d loss = 1 inside the graph (the last stage
//! seeds itself); every other float output `o` gets a tangent input `grad.<o>`.

use crate::builder::GraphBuilder;
use crate::check::{at, check_graph};
use crate::dtype::TensorType;
use crate::error::{GraphError, Result};
use crate::graph::{Graph, Phase, ValueId};
use crate::names::grad_of;
use crate::op::{BinaryOp, CollectiveKind, InputKind, Op, UnaryOp};

/// Name of the output that is seeded with gradient 1.
pub const LOSS: &str = "loss";

/// Which forward values carry a gradient: float values reachable from float parameter/activation
/// inputs through differentiable ops.
fn requires_grad(g: &Graph) -> Vec<bool> {
    let mut rg = vec![false; g.nodes.len()];
    for (i, n) in g.nodes.iter().enumerate() {
        rg[i] = match &n.op {
            Op::Input { kind, ty, .. } => {
                ty.dtype.is_float() && matches!(kind, InputKind::Parameter | InputKind::Activation)
            }
            Op::Full { .. }
            | Op::TopK { .. }
            | Op::SortByExpert { .. }
            | Op::Bincount { .. }
            | Op::Binary { f: BinaryOp::Eq } => false,
            _ => n.ty.dtype.is_float() && n.inputs.iter().any(|x| rg[x.0]),
        };
    }
    rg
}

/// Builds the joint graph of `fw`. Errors: [`GraphError::Autodiff`] when an output named `loss` is
/// not a scalar, or a value needing a gradient has no float type.
pub fn autodiff(fw: &Graph) -> Result<Graph> {
    check_graph(fw)?;
    let rg = requires_grad(fw);
    let mut b = GraphBuilder::from_graph(fw.clone(), crate::dtype::DType::F32);
    b.set_phase(Phase::Backward);
    let mut grads: Vec<Option<ValueId>> = vec![None; fw.nodes.len()];
    b.set_scope("seed");
    for o in &fw.outputs {
        if !rg[o.value.0] {
            continue;
        }
        let ty = fw.node(o.value).ty.clone();
        let seed = if o.name == LOSS {
            if !ty.shape.is_empty() {
                return Err(GraphError::Autodiff {
                    at: o.name.clone(),
                    reason: format!("loss must be a scalar, got {ty}"),
                });
            }
            b.add(Op::Full { value: 1.0, ty }, &[])?
        } else {
            b.input_typed(&grad_of(&o.name), InputKind::Tangent, ty)?
        };
        accumulate(&mut b, &mut grads, o.value, seed)?;
    }
    for i in (0..fw.nodes.len()).rev() {
        let Some(g) = grads[i] else { continue };
        let node = fw.nodes[i].clone();
        if matches!(node.op, Op::Input { .. }) {
            continue;
        }
        b.set_scope(&node.meta.scope);
        b.set_region(node.meta.region.clone());
        let in_grads = vjp(&mut b, fw, ValueId(i), g)?;
        for (j, (x, dx)) in node.inputs.iter().zip(in_grads).enumerate() {
            match dx {
                Some(dx) if rg[x.0] => accumulate(&mut b, &mut grads, *x, dx)?,
                // A rule that gives no gradient where one is needed would leave it silently
                // zero (attention's mask, which must be a constant: a buffer).
                None if rg[x.0] => {
                    return Err(GraphError::Autodiff {
                        at: at(fw, ValueId(i)),
                        reason: format!(
                            "{} gives its operand {j} no gradient, but that operand needs one",
                            node.op.mnemonic()
                        ),
                    })
                }
                _ => {}
            }
        }
    }
    b.set_scope("grad");
    b.set_region(crate::graph::Region::Compute);
    let mut outs = Vec::new();
    for &v in &fw.inputs {
        if let Op::Input { name, kind, ty } = &fw.node(v).op {
            if rg[v.0] && matches!(kind, InputKind::Parameter | InputKind::Activation) {
                let dv = match grads[v.0] {
                    Some(d) => d,
                    None => b.add(Op::Full { value: 0.0, ty: ty.clone() }, &[])?,
                };
                outs.push((grad_of(name), dv));
            }
        }
    }
    for (name, v) in outs {
        b.output(&name, v);
    }
    let mut g = b.finish()?;
    g.name = format!("{}.joint", fw.name);
    Ok(g)
}

fn accumulate(b: &mut GraphBuilder, grads: &mut [Option<ValueId>], x: ValueId, dx: ValueId) -> Result<()> {
    grads[x.0] = Some(match grads[x.0] {
        None => dx,
        Some(prev) => b.add2(prev, dx)?,
    });
    Ok(())
}

/// Reshapes/broadcasts a reduced gradient back to the reduced operand's shape.
fn unreduce(
    b: &mut GraphBuilder,
    g: ValueId,
    x_shape: &[usize],
    axis: usize,
    keepdim: bool,
) -> Result<ValueId> {
    let mut kept = x_shape.to_vec();
    kept[axis] = 1;
    let g = if keepdim { g } else { b.reshape(g, kept)? };
    b.broadcast(g, x_shape.to_vec())
}

/// The collective that carries a gradient back through `kind` over `group`: all-gather ↔
/// reduce-scatter; over a group that shares one loss ([`crate::MeshAxis::shares_loss`], tensor
/// parallelism) all-reduce ↔ replicate (Megatron-LM's g and f), else an all-reduce is its own
/// adjoint (and a replicate passes the gradient through).
fn dual(kind: CollectiveKind, group: &crate::CommGroup) -> CollectiveKind {
    let shared = group.mesh_axis.shares_loss();
    match kind {
        CollectiveKind::AllGather => CollectiveKind::ReduceScatter,
        CollectiveKind::ReduceScatter => CollectiveKind::AllGather,
        CollectiveKind::AllReduce if shared => CollectiveKind::Replicate,
        CollectiveKind::Replicate if shared => CollectiveKind::AllReduce,
        k => k,
    }
}

/// Operand gradients of one node: one per operand, `None` where no gradient flows.
type OperandGrads = Vec<Option<ValueId>>;

/// Vector-Jacobian product of node `y` given its output gradient `g`: one optional gradient per
/// operand (`None` = no gradient flows, e.g. into indices), one rule per op family. Rules are the
/// standard ones (Griewank & Walther, "Evaluating Derivatives", ch. 3); broadcasting is undone
/// by `sum_to`.
fn vjp(b: &mut GraphBuilder, fw: &Graph, y: ValueId, g: ValueId) -> Result<OperandGrads> {
    let n = fw.node(y);
    match &n.op {
        Op::Input { .. }
        | Op::Full { .. }
        | Op::TopK { .. }
        | Op::SortByExpert { .. }
        | Op::Bincount { .. }
        | Op::Binary { f: BinaryOp::Eq } => Ok(vec![None; n.inputs.len()]),
        Op::SegmentMatmul { .. } | Op::SegmentOuter => vjp_segment(b, fw, y, g),
        Op::Unary { .. } | Op::Affine { .. } | Op::Binary { .. } | Op::RotateHalf | Op::Cast { .. } => {
            vjp_elementwise(b, fw, y, g)
        }
        Op::Sum { .. } | Op::Max { .. } | Op::Softmax { .. } | Op::LogSoftmax { .. } => {
            vjp_reduction(b, fw, y, g)
        }
        Op::Attention { scale } => vjp_attention(b, fw, y, g, *scale),
        Op::SoftmaxBackward { .. } | Op::LogSoftmaxBackward { .. } | Op::AttentionBackward { .. } => {
            Err(GraphError::Autodiff {
                at: at(fw, y),
                reason: format!("{} has no VJP (second derivatives of softmax)", n.op.mnemonic()),
            })
        }
        Op::Matmul => vjp_matmul(b, fw, y, g),
        Op::Reshape { .. }
        | Op::Permute { .. }
        | Op::Broadcast { .. }
        | Op::Slice { .. }
        | Op::Concat { .. } => vjp_layout(b, fw, y, g),
        Op::IndexSelect { .. } | Op::IndexAdd { .. } | Op::Gather { .. } | Op::ScatterAdd { .. } => {
            vjp_indexing(b, fw, y, g)
        }
        Op::CollectiveWait | Op::CollectiveStart { .. } => vjp_collective(b, fw, y, g),
    }
}

/// VJPs of the mixture-of-experts segment products ([`Op::SegmentMatmul`], [`Op::SegmentOuter`]):
/// segment products of `g` with the other operand; the counts get none.
fn vjp_segment(b: &mut GraphBuilder, fw: &Graph, y: ValueId, g: ValueId) -> Result<OperandGrads> {
    let n = fw.node(y);
    let x = |i: usize| n.inputs[i];
    Ok(match &n.op {
        // y = x·w[e]ᵀ (w [E,N,K]): dx = g·w[e], dw[e] = g_eᵀ·x_e; y = x·w[e] (w [E,K,N]): dx = g·w[e]ᵀ,
        // dw[e] = x_eᵀ·g_e.
        Op::SegmentMatmul { transpose } => {
            let (xv, w, counts) = (x(0), x(1), x(2));
            let dx = b.segment_matmul(g, w, counts, !transpose)?;
            let dw =
                if *transpose { b.segment_outer(g, xv, counts)? } else { b.segment_outer(xv, g, counts)? };
            vec![Some(dx), Some(dw), None]
        }
        // out[e] = a_eᵀ·b_e: da_e = b_e·g[e]ᵀ, db_e = a_e·g[e].
        Op::SegmentOuter => {
            let (a, c, counts) = (x(0), x(1), x(2));
            vec![
                Some(b.segment_matmul(c, g, counts, true)?),
                Some(b.segment_matmul(a, g, counts, false)?),
                None,
            ]
        }
        _ => unreachable!("vjp dispatches only segment products here"),
    })
}

/// VJPs of the elementwise ops: unary functions (by their derivative, from the operand or the
/// output `y`), affine maps (`g` scaled), binary ops (each operand's gradient summed to its
/// shape, undoing the broadcast), rotate-half (`−rotate_half(g)`) and casts (`g` cast back).
fn vjp_elementwise(b: &mut GraphBuilder, fw: &Graph, y: ValueId, g: ValueId) -> Result<OperandGrads> {
    let n = fw.node(y);
    let x = |i: usize| n.inputs[i];
    let shape = |v: ValueId| fw.node(v).ty.shape.clone();
    Ok(match &n.op {
        Op::Unary { f } => vec![Some(match f {
            UnaryOp::Neg => b.neg(g)?,
            UnaryOp::Exp => b.mul(g, y)?,
            UnaryOp::Log => b.div(g, x(0))?,
            UnaryOp::Sqrt => {
                let q = b.div(g, y)?;
                b.scale(q, 0.5)?
            }
            UnaryOp::Recip => {
                let yy = b.mul(y, y)?;
                let t = b.mul(g, yy)?;
                b.neg(t)?
            }
            UnaryOp::Sigmoid => {
                let one_minus = b.affine(y, -1.0, 1.0)?;
                let t = b.mul(g, y)?;
                b.mul(t, one_minus)?
            }
            UnaryOp::Erf => {
                // d erf(x)/dx = 2/√π · e^(−x²)
                let xx = b.mul(x(0), x(0))?;
                let e = b.affine(xx, -1.0, 0.0)?;
                let e = b.exp(e)?;
                let t = b.scale(e, std::f64::consts::FRAC_2_SQRT_PI)?;
                b.mul(g, t)?
            }
        })],
        Op::Affine { mul, .. } => vec![Some(b.scale(g, *mul)?)],
        Op::Binary { f } => {
            let (a, c) = (x(0), x(1));
            let (da, dc) = match f {
                BinaryOp::Add => (g, g),
                BinaryOp::Sub => (g, b.neg(g)?),
                BinaryOp::Mul => (b.mul(g, c)?, b.mul(g, a)?),
                BinaryOp::Div => {
                    let da = b.div(g, c)?;
                    let t = b.mul(da, y)?;
                    (da, b.neg(t)?)
                }
                BinaryOp::Eq => unreachable!("handled by vjp"),
            };
            vec![Some(b.sum_to(da, &shape(a))?), Some(b.sum_to(dc, &shape(c))?)]
        }
        // rotate_half is a signed permutation R with Rᵀ = −R.
        Op::RotateHalf => {
            let r = b.rotate_half(g)?;
            vec![Some(b.neg(r)?)]
        }
        Op::Cast { .. } => vec![Some(b.cast(g, fw.node(x(0)).ty.dtype)?)],
        _ => unreachable!("vjp dispatches only elementwise ops here"),
    })
}

/// VJPs of the reductions over one axis and the softmaxes: a sum's gradient is `g` broadcast
/// back over the axis, a max's flows only to the entries equal to the maximum; softmax and
/// log-softmax read only their output `y` (softmax also gives its mask a gradient, summed to
/// the mask's shape).
fn vjp_reduction(b: &mut GraphBuilder, fw: &Graph, y: ValueId, g: ValueId) -> Result<OperandGrads> {
    let n = fw.node(y);
    let x = |i: usize| n.inputs[i];
    let shape = |v: ValueId| fw.node(v).ty.shape.clone();
    Ok(match &n.op {
        Op::Sum { axis, keepdim } => vec![Some(unreduce(b, g, &shape(x(0)), *axis, *keepdim)?)],
        Op::Max { axis, keepdim } => {
            let xs = shape(x(0));
            let yb = unreduce(b, y, &xs, *axis, *keepdim)?;
            let mask = b.eq(x(0), yb)?;
            let gb = unreduce(b, g, &xs, *axis, *keepdim)?;
            vec![Some(b.mul(mask, gb)?)]
        }
        // y = softmax(scale·x + mask) over `axis`: the softmax Jacobian (diag(y) − y yᵀ) applied
        // to g is y ⊙ (g − Σ_axis g ⊙ y); x's gradient is that times scale, the mask's that
        // summed to its shape. Only y is read (PyTorch's `_softmax_backward_data`).
        Op::Softmax { axis, scale } => {
            let dx = b.softmax_backward(y, g, *axis, *scale)?;
            let mut out = vec![Some(dx)];
            if n.inputs.len() == 2 {
                let dz = if *scale == 1.0 { dx } else { b.softmax_backward(y, g, *axis, 1.0)? };
                out.push(Some(b.sum_to(dz, &shape(x(1)))?));
            }
            out
        }
        // y = x − ln Σ exp(x): dx = g − softmax(x) · Σ_axis g, softmax(x) = exp(y).
        Op::LogSoftmax { axis } => vec![Some(b.log_softmax_backward(y, g, *axis)?)],
        _ => unreachable!("vjp dispatches only reductions and softmaxes here"),
    })
}

/// VJP of attention `y = attention(q, k, v, mask)` with softmax scale `scale`: dq, dk and dv
/// `[B, H, T, E]`, `[B, KV, T, E]`, `[B, KV, T, E_v]`, sliced from one backward node; the mask (a
/// buffer) gets none.
fn vjp_attention(
    b: &mut GraphBuilder,
    fw: &Graph,
    y: ValueId,
    g: ValueId,
    scale: f64,
) -> Result<OperandGrads> {
    let n = fw.node(y);
    let x = |i: usize| n.inputs[i];
    let shape = |v: ValueId| fw.node(v).ty.shape.clone();
    // One node computes the three gradients (FlashAttention-2, Dao 2023, Algorithm 2); each is
    // a slice of its output along the heads (H of dq, then KV of dk and of dv), and along the
    // width where q·k's and v's widths differ (the narrower ones are zero-padded).
    let st = b.attention_backward(x(0), x(1), x(2), x(3), y, g, scale)?;
    let (h, kv, e, ev) = (shape(x(0))[1], shape(x(1))[1], shape(x(0))[3], shape(x(2))[3]);
    let width = e.max(ev);
    let mut part = |from: usize, to: usize, w: usize| -> Result<ValueId> {
        let heads = b.slice(st, 1, from, to)?;
        if w < width {
            b.slice(heads, 3, 0, w)
        } else {
            Ok(heads)
        }
    };
    Ok(vec![Some(part(0, h, e)?), Some(part(h, h + kv, e)?), Some(part(h + kv, h + 2 * kv, ev)?), None])
}

/// VJP of a batched matmul `y = a b`: `da = g bᵀ`, `db = aᵀ g` (transposes of the last two axes).
fn vjp_matmul(b: &mut GraphBuilder, fw: &Graph, y: ValueId, g: ValueId) -> Result<OperandGrads> {
    let n = fw.node(y);
    let x = |i: usize| n.inputs[i];
    let bt = b.transpose_last(x(1))?;
    let da = b.matmul(g, bt)?;
    let at = b.transpose_last(x(0))?;
    let db = b.matmul(at, g)?;
    Ok(vec![Some(da), Some(db)])
}

/// VJPs of the shape ops, each its inverse on `g`: reshape back, the inverse permutation, a sum
/// undoing the broadcast, zero padding around a slice, and a concat's gradient sliced per operand.
fn vjp_layout(b: &mut GraphBuilder, fw: &Graph, y: ValueId, g: ValueId) -> Result<OperandGrads> {
    let n = fw.node(y);
    let x = |i: usize| n.inputs[i];
    let shape = |v: ValueId| fw.node(v).ty.shape.clone();
    Ok(match &n.op {
        Op::Reshape { .. } => vec![Some(b.reshape(g, shape(x(0)))?)],
        Op::Permute { perm } => {
            let mut inv = vec![0; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inv[p] = i;
            }
            vec![Some(b.permute(g, inv)?)]
        }
        Op::Broadcast { .. } => vec![Some(b.sum_to(g, &shape(x(0)))?)],
        Op::Slice { axis, start, end } => {
            let xs = shape(x(0));
            let mut parts = Vec::new();
            if *start > 0 {
                let mut s = xs.clone();
                s[*axis] = *start;
                parts.push(zeros(b, &n.ty, s)?);
            }
            parts.push(g);
            if *end < xs[*axis] {
                let mut s = xs.clone();
                s[*axis] = xs[*axis] - end;
                parts.push(zeros(b, &n.ty, s)?);
            }
            vec![Some(if parts.len() == 1 { g } else { b.concat(&parts, *axis)? })]
        }
        Op::Concat { axis } => {
            let mut off = 0;
            let mut out = Vec::new();
            for &xi in &n.inputs {
                let len = shape(xi)[*axis];
                out.push(Some(b.slice(g, *axis, off, off + len)?));
                off += len;
            }
            out
        }
        _ => unreachable!("vjp dispatches only shape ops here"),
    })
}

/// VJPs of the indexing ops, each the other of its pair: index-select's gradient is index-added
/// into zeros, gather's scatter-added, and index-add's and scatter-add's source gradient is `g`
/// picked at the indices; the indices get none.
fn vjp_indexing(b: &mut GraphBuilder, fw: &Graph, y: ValueId, g: ValueId) -> Result<OperandGrads> {
    let n = fw.node(y);
    let x = |i: usize| n.inputs[i];
    Ok(match &n.op {
        Op::IndexSelect { axis } => {
            let z = b.full_like(0.0, x(0))?;
            vec![Some(b.index_add(z, x(1), g, *axis)?), None]
        }
        Op::IndexAdd { axis } => vec![Some(g), None, Some(b.index_select(g, x(1), *axis)?)],
        Op::Gather { axis } => {
            let z = b.full_like(0.0, x(0))?;
            vec![Some(b.scatter_add(z, x(1), g, *axis)?), None]
        }
        Op::ScatterAdd { axis } => vec![Some(g), None, Some(b.gather(g, x(1), *axis)?)],
        _ => unreachable!("vjp dispatches only indexing ops here"),
    })
}

/// VJPs of a collective: a wait's gradient is the dual collective of `g` ([`dual`]: all-gather
/// ↔ reduce-scatter, all-reduce ↔ replicate over a group sharing one loss; the reverse exchange
/// for an all-to-all-v); the start passes `g` through to its
/// tensor operand (counts get none). Errors: [`GraphError::Autodiff`] for a wait whose operand
/// is not a start.
fn vjp_collective(b: &mut GraphBuilder, fw: &Graph, y: ValueId, g: ValueId) -> Result<OperandGrads> {
    let n = fw.node(y);
    let x = |i: usize| n.inputs[i];
    let shape = |v: ValueId| fw.node(v).ty.shape.clone();
    Ok(match &n.op {
        Op::CollectiveWait => {
            let start = fw.node(x(0));
            let Op::CollectiveStart { kind, group, axis } = &start.op else {
                return Err(GraphError::Autodiff { at: at(fw, y), reason: "wait without start".into() });
            };
            // The dual collective runs in the backward; the start passes the result through.
            if let CollectiveKind::AllToAllV { .. } = kind {
                // The reverse exchange: what came from member j goes back to it.
                let (xv, send, recv) = (start.inputs[0], start.inputs[1], start.inputs[2]);
                vec![Some(b.all_to_all_v(group, g, recv, send, shape(xv)[0])?)]
            } else {
                vec![Some(b.collective(dual(*kind, group), group, *axis, g)?)]
            }
        }
        Op::CollectiveStart { .. } => {
            let mut out = vec![None; n.inputs.len()];
            out[0] = Some(g);
            out
        }
        _ => unreachable!("vjp dispatches only collectives here"),
    })
}

fn zeros(b: &mut GraphBuilder, like: &TensorType, shape: Vec<usize>) -> Result<ValueId> {
    b.add(Op::Full { value: 0.0, ty: TensorType::new(like.dtype, shape) }, &[])
}
