//! Reverse-mode autodiff: one VJP rule per primitive; produces the joint forward+backward graph
//! (docs/ARCHITECTURE.md "Graph IR" → Autodiff). The joint graph's outputs are the user outputs, then
//! `grad.<name>` for every float parameter and activation input, in input order.
//!
//! Seeding: a scalar output named `loss` is seeded with d loss = 1 inside the graph (the last stage
//! seeds itself); every other float output `o` gets a tangent input `grad.<o>`.

use crate::builder::GraphBuilder;
use crate::dtype::TensorType;
use crate::error::{GraphError, Result};
use crate::graph::{Graph, Phase, ValueId};
use crate::op::{BinaryOp, CollectiveKind, InputKind, Op, UnaryOp};
use crate::verify::{at, verify};

/// Name of the output that is seeded with gradient 1.
pub const LOSS: &str = "loss";

/// Name of the gradient of input or output `name` ([`crate::names::grad_of`]).
pub use crate::names::grad_of as grad_name;

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
    verify(fw)?;
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
            b.input_typed(&grad_name(&o.name), InputKind::Tangent, ty)?
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
                outs.push((grad_name(name), dv));
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

fn dual(kind: CollectiveKind) -> CollectiveKind {
    match kind {
        CollectiveKind::AllGather => CollectiveKind::ReduceScatter,
        CollectiveKind::ReduceScatter => CollectiveKind::AllGather,
        k => k,
    }
}

/// Vector-Jacobian product of node `y` given its output gradient `g`: one optional gradient per
/// operand (`None` = no gradient flows, e.g. into indices). Rules are the standard ones
/// (Griewank & Walther, "Evaluating Derivatives", ch. 3); broadcasting is undone by `sum_to`.
fn vjp(b: &mut GraphBuilder, fw: &Graph, y: ValueId, g: ValueId) -> Result<Vec<Option<ValueId>>> {
    let n = fw.node(y);
    let x = |i: usize| n.inputs[i];
    let shape = |v: ValueId| fw.node(v).ty.shape.clone();
    Ok(match &n.op {
        Op::Input { .. }
        | Op::Full { .. }
        | Op::TopK { .. }
        | Op::SortByExpert { .. }
        | Op::Bincount { .. }
        | Op::Binary { f: BinaryOp::Eq } => vec![None; n.inputs.len()],
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
                BinaryOp::Eq => unreachable!("handled above"),
            };
            vec![Some(b.sum_to(da, &shape(a))?), Some(b.sum_to(dc, &shape(c))?)]
        }
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
        // One node computes the three gradients (FlashAttention-2, Dao 2023, Algorithm 2); each is
        // a slice of its output along the heads (H of dq, then KV of dk and of dv). The mask (a
        // buffer) gets none.
        Op::Attention { scale } => {
            let st = b.attention_backward(x(0), x(1), x(2), x(3), y, g, *scale)?;
            let (h, kv) = (shape(x(0))[1], shape(x(1))[1]);
            vec![
                Some(b.slice(st, 1, 0, h)?),
                Some(b.slice(st, 1, h, h + kv)?),
                Some(b.slice(st, 1, h + kv, h + 2 * kv)?),
                None,
            ]
        }
        // y = x − ln Σ exp(x): dx = g − softmax(x) · Σ_axis g, softmax(x) = exp(y).
        Op::LogSoftmax { axis } => vec![Some(b.log_softmax_backward(y, g, *axis)?)],
        Op::SoftmaxBackward { .. } | Op::LogSoftmaxBackward { .. } | Op::AttentionBackward { .. } => {
            return Err(GraphError::Autodiff {
                at: at(fw, y),
                reason: format!("{} has no VJP (second derivatives of softmax)", n.op.mnemonic()),
            })
        }
        // rotate_half is a signed permutation R with Rᵀ = −R.
        Op::RotateHalf => {
            let r = b.rotate_half(g)?;
            vec![Some(b.neg(r)?)]
        }
        Op::Matmul => {
            let bt = b.transpose_last(x(1))?;
            let da = b.matmul(g, bt)?;
            let at = b.transpose_last(x(0))?;
            let db = b.matmul(at, g)?;
            vec![Some(da), Some(db)]
        }
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
        Op::Cast { .. } => vec![Some(b.cast(g, fw.node(x(0)).ty.dtype)?)],
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
                vec![Some(b.collective(dual(*kind), group, *axis, g)?)]
            }
        }
        Op::CollectiveStart { .. } => {
            let mut out = vec![None; n.inputs.len()];
            out[0] = Some(g);
            out
        }
    })
}

fn zeros(b: &mut GraphBuilder, like: &TensorType, shape: Vec<usize>) -> Result<ValueId> {
    b.add(Op::Full { value: 0.0, ty: TensorType::new(like.dtype, shape) }, &[])
}
