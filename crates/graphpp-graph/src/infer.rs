//! Shape and dtype inference: the output type of an op from its operand types, with a reason when
//! the operands are invalid (docs/ARCHITECTURE.md "Graph IR": static shapes; broadcasting as in NumPy).

use crate::dtype::{broadcast_shapes, broadcasts_to, DType, TensorType};
use crate::op::{CollectiveKind, Op};

fn need(cond: bool, reason: impl FnOnce() -> String) -> Result<(), String> {
    if cond {
        Ok(())
    } else {
        Err(reason())
    }
}

fn arity(op: &Op, ins: &[&TensorType], n: usize) -> Result<(), String> {
    need(ins.len() == n, || format!("{} takes {n} operand(s), got {}", op.mnemonic(), ins.len()))
}

fn float(t: &TensorType) -> Result<(), String> {
    need(t.dtype.is_float(), || format!("needs a float operand, got {t}"))
}

fn axis_ok(t: &TensorType, axis: usize) -> Result<(), String> {
    need(axis < t.shape.len(), || format!("axis {axis} out of range for {t}"))
}

fn index(t: &TensorType) -> Result<(), String> {
    need(t.dtype == DType::U32, || format!("indices must be u32, got {t}"))
}

/// Output type of `op` applied to operands of types `ins`: one rule per op family.
///
/// Errors: a human-readable reason (wrong arity, dtype, rank, axis, incompatible shapes).
pub fn infer(op: &Op, ins: &[&TensorType]) -> Result<TensorType, String> {
    match op {
        Op::Input { ty, .. } | Op::Full { ty, .. } => infer_source(op, ins, ty),
        Op::Unary { .. } | Op::Affine { .. } | Op::Binary { .. } | Op::RotateHalf | Op::Cast { .. } => {
            infer_elementwise(op, ins)
        }
        Op::Sum { .. }
        | Op::Max { .. }
        | Op::Softmax { .. }
        | Op::LogSoftmax { .. }
        | Op::SoftmaxBackward { .. }
        | Op::LogSoftmaxBackward { .. } => infer_reduction(op, ins),
        Op::Attention { .. } | Op::AttentionBackward { .. } => infer_attention(op, ins),
        Op::Matmul => infer_matmul(op, ins),
        Op::Reshape { .. }
        | Op::Permute { .. }
        | Op::Broadcast { .. }
        | Op::Slice { .. }
        | Op::Concat { .. } => infer_layout(op, ins),
        Op::IndexSelect { .. } | Op::IndexAdd { .. } | Op::Gather { .. } | Op::ScatterAdd { .. } => {
            infer_indexing(op, ins)
        }
        Op::TopK { .. }
        | Op::SortByExpert { .. }
        | Op::Bincount { .. }
        | Op::SegmentMatmul { .. }
        | Op::SegmentOuter => infer_moe(op, ins),
        Op::CollectiveStart { .. } | Op::CollectiveWait => infer_collective(op, ins),
    }
}

/// A graph input or a constant ([`Op::Input`], [`Op::Full`]): no operands; its declared type `ty`.
fn infer_source(op: &Op, ins: &[&TensorType], ty: &TensorType) -> Result<TensorType, String> {
    arity(op, ins, 0)?;
    Ok(ty.clone())
}

/// Elementwise ops: unary and affine maps and rotate-half keep their float operand's type
/// (rotate-half needs an even last axis); a binary op broadcasts two float operands of one dtype
/// (NumPy rules); a cast keeps the shape and takes the new dtype.
fn infer_elementwise(op: &Op, ins: &[&TensorType]) -> Result<TensorType, String> {
    match op {
        Op::Unary { .. } | Op::Affine { .. } => {
            arity(op, ins, 1)?;
            float(ins[0])?;
            Ok(ins[0].clone())
        }
        Op::Binary { .. } => {
            arity(op, ins, 2)?;
            float(ins[0])?;
            need(ins[0].dtype == ins[1].dtype, || format!("dtype mismatch {} vs {}", ins[0], ins[1]))?;
            let shape = broadcast_shapes(&ins[0].shape, &ins[1].shape)
                .ok_or_else(|| format!("shapes {} and {} do not broadcast", ins[0], ins[1]))?;
            Ok(TensorType::new(ins[0].dtype, shape))
        }
        Op::RotateHalf => {
            arity(op, ins, 1)?;
            float(ins[0])?;
            let last = ins[0].shape.last().copied();
            need(last.is_some_and(|d| d % 2 == 0), || {
                format!("rotate_half needs a last axis of even length: {}", ins[0])
            })?;
            Ok(ins[0].clone())
        }
        Op::Cast { dtype } => {
            arity(op, ins, 1)?;
            Ok(TensorType::new(*dtype, ins[0].shape.clone()))
        }
        _ => unreachable!("infer dispatches only elementwise ops here"),
    }
}

/// Reductions over one axis and the softmax family: sum and max drop the axis (or keep it with
/// length 1 under `keepdim`; a sum may also count u32s); softmax (`x` or `(x, mask)`, the mask
/// of x's dtype broadcasting to x), log-softmax and their backwards (`(y, g)` alike) keep the
/// shape of their float operand.
fn infer_reduction(op: &Op, ins: &[&TensorType]) -> Result<TensorType, String> {
    match op {
        Op::Sum { axis, keepdim } | Op::Max { axis, keepdim } => {
            arity(op, ins, 1)?;
            // Integer sums count (expert-parallel send counts); they carry no gradient.
            if !(matches!(op, Op::Sum { .. }) && ins[0].dtype == DType::U32) {
                float(ins[0])?;
            }
            axis_ok(ins[0], *axis)?;
            let mut shape = ins[0].shape.clone();
            if *keepdim {
                shape[*axis] = 1;
            } else {
                shape.remove(*axis);
            }
            Ok(TensorType::new(ins[0].dtype, shape))
        }
        Op::Softmax { axis, .. } => {
            need((1..=2).contains(&ins.len()), || {
                format!("softmax takes x or (x, mask), got {} operands", ins.len())
            })?;
            float(ins[0])?;
            axis_ok(ins[0], *axis)?;
            if let Some(mask) = ins.get(1) {
                need(mask.dtype == ins[0].dtype, || format!("dtype mismatch {} vs mask {}", ins[0], mask))?;
                let fits = broadcast_shapes(&ins[0].shape, &mask.shape).is_some_and(|s| s == ins[0].shape);
                need(fits, || format!("mask {} does not broadcast to {}", mask, ins[0]))?;
            }
            Ok(ins[0].clone())
        }
        Op::LogSoftmax { axis } => {
            arity(op, ins, 1)?;
            float(ins[0])?;
            axis_ok(ins[0], *axis)?;
            Ok(ins[0].clone())
        }
        Op::SoftmaxBackward { axis, .. } | Op::LogSoftmaxBackward { axis } => {
            arity(op, ins, 2)?;
            float(ins[0])?;
            axis_ok(ins[0], *axis)?;
            need(ins[0] == ins[1], || {
                format!("{} needs y and g alike: {} vs {}", op.mnemonic(), ins[0], ins[1])
            })?;
            Ok(ins[0].clone())
        }
        _ => unreachable!("infer dispatches only reductions and softmaxes here"),
    }
}

/// Attention and its backward: `(q [B, H, T, E], k [B, KV, T, E], v [B, KV, T, E_v], mask
/// [T, T])` with KV dividing H and the mask of q's wide dtype gives `o [B, H, T, E_v]`; the
/// backward, which also reads `o` and `g` like `o`, gives the stacked gradients `[B, H + 2·KV, T,
/// max(E, E_v)]` (each narrower one zero-padded).
fn infer_attention(op: &Op, ins: &[&TensorType]) -> Result<TensorType, String> {
    arity(op, ins, if matches!(op, Op::Attention { .. }) { 4 } else { 6 })?;
    let q = ins[0];
    float(q)?;
    need(q.shape.len() == 4, || format!("{} needs q [B, H, T, E], got {q}", op.mnemonic()))?;
    let (h, t) = (q.shape[1], q.shape[2]);
    // k [B, KV, T, E] and v [B, KV, T, E_v] with KV dividing H (grouped-query attention: query
    // head h reads key/value head h / (H / KV)); v's width may differ (multi-head latent
    // attention's d_v against d_nope + d_rope).
    let kv = ins[1].shape.get(1).copied().unwrap_or(0);
    for (name, x, width) in [("k", ins[1], Some(q.shape.get(3))), ("v", ins[2], None)] {
        let fits = x.dtype == q.dtype
            && x.shape.len() == 4
            && x.shape[0] == q.shape[0]
            && x.shape[2] == t
            && width.is_none_or(|w| x.shape.get(3) == w)
            && x.shape[1] == kv
            && kv > 0
            && h.is_multiple_of(kv);
        need(fits, || {
            format!(
                "{} needs k [B, KV, T, E] (E q's) and v [B, KV, T, E_v] of q's dtype, KV dividing \
                 q's H: {name} {x} vs q {q}",
                op.mnemonic()
            )
        })?;
    }
    let ev = ins[2].shape[3];
    let o = TensorType::new(q.dtype, vec![q.shape[0], h, t, ev]);
    for (name, x) in [("o", ins.get(4)), ("g", ins.get(5))] {
        if let Some(x) = x {
            need(**x == o, || format!("{} needs {name} {o} (q's heads, v's width): {x}", op.mnemonic()))?;
        }
    }
    let mask = ins[3];
    need(mask.dtype == q.dtype.wide() && mask.shape == [t, t], || {
        format!("{} needs a mask [{t}, {t}] of {}, got {mask}", op.mnemonic(), q.dtype.wide())
    })?;
    Ok(match op {
        Op::Attention { .. } => o,
        _ => TensorType::new(q.dtype, vec![q.shape[0], h + 2 * kv, t, q.shape[3].max(ev)]),
    })
}

/// Batched matmul: `[..., m, k] × [..., k, n] → [..., m, n]`, float operands of one dtype, equal
/// ranks ≥ 2 and equal batch dims.
fn infer_matmul(op: &Op, ins: &[&TensorType]) -> Result<TensorType, String> {
    arity(op, ins, 2)?;
    float(ins[0])?;
    let (a, b) = (&ins[0].shape, &ins[1].shape);
    need(a.len() >= 2 && a.len() == b.len(), || {
        format!("matmul needs equal ranks ≥ 2: {} × {}", ins[0], ins[1])
    })?;
    let r = a.len();
    need(a[..r - 2] == b[..r - 2], || format!("batch dims differ: {} × {}", ins[0], ins[1]))?;
    need(a[r - 1] == b[r - 2], || format!("inner dims differ: {} × {}", ins[0], ins[1]))?;
    need(ins[0].dtype == ins[1].dtype, || format!("dtype mismatch {} vs {}", ins[0], ins[1]))?;
    let mut shape = a.clone();
    shape[r - 1] = b[r - 1];
    Ok(TensorType::new(ins[0].dtype, shape))
}

/// Shape ops, which keep the dtype: reshape (same element count), permute (a permutation of the
/// axes), broadcast (NumPy rules), slice (a non-empty range within the axis) and concat (one
/// dtype, shapes equal off the axis).
fn infer_layout(op: &Op, ins: &[&TensorType]) -> Result<TensorType, String> {
    match op {
        Op::Reshape { shape } => {
            arity(op, ins, 1)?;
            let n: usize = shape.iter().product();
            need(n == ins[0].numel(), || format!("cannot reshape {} to {shape:?}", ins[0]))?;
            Ok(TensorType::new(ins[0].dtype, shape.clone()))
        }
        Op::Permute { perm } => {
            arity(op, ins, 1)?;
            let r = ins[0].shape.len();
            let mut seen = vec![false; r];
            for &p in perm {
                need(p < r && !seen[p], || format!("{perm:?} is not a permutation of {r} axes"))?;
                seen[p] = true;
            }
            need(perm.len() == r, || format!("{perm:?} is not a permutation of {r} axes"))?;
            Ok(TensorType::new(ins[0].dtype, perm.iter().map(|&p| ins[0].shape[p]).collect::<Vec<_>>()))
        }
        Op::Broadcast { shape } => {
            arity(op, ins, 1)?;
            need(broadcasts_to(&ins[0].shape, shape), || {
                format!("{} does not broadcast to {shape:?}", ins[0])
            })?;
            Ok(TensorType::new(ins[0].dtype, shape.clone()))
        }
        Op::Slice { axis, start, end } => {
            arity(op, ins, 1)?;
            axis_ok(ins[0], *axis)?;
            need(start < end && *end <= ins[0].shape[*axis], || {
                format!("range {start}..{end} invalid for axis {axis} of {}", ins[0])
            })?;
            let mut shape = ins[0].shape.clone();
            shape[*axis] = end - start;
            Ok(TensorType::new(ins[0].dtype, shape))
        }
        Op::Concat { axis } => {
            need(!ins.is_empty(), || "concat needs at least one operand".into())?;
            axis_ok(ins[0], *axis)?;
            let mut shape = ins[0].shape.clone();
            for t in &ins[1..] {
                let mut s = t.shape.clone();
                need(s.len() == shape.len() && t.dtype == ins[0].dtype, || {
                    format!("concat of {} and {t}", ins[0])
                })?;
                s[*axis] = shape[*axis];
                need(s == shape, || format!("concat of {} and {t} along {axis}", ins[0]))?;
                shape[*axis] += t.shape[*axis];
            }
            Ok(TensorType::new(ins[0].dtype, shape))
        }
        _ => unreachable!("infer dispatches only shape ops here"),
    }
}

/// Indexing along an axis by u32 indices: index-select (`(src, ids[n])` → src with n rows along
/// the axis), index-add (`(dst, ids[n], src)` → dst), gather (`(src, idx)` → idx's shape, equal
/// to src's off the axis) and scatter-add (`(dst, idx, src)` → dst, idx and src alike).
fn infer_indexing(op: &Op, ins: &[&TensorType]) -> Result<TensorType, String> {
    match op {
        Op::IndexSelect { axis } => {
            arity(op, ins, 2)?;
            axis_ok(ins[0], *axis)?;
            index(ins[1])?;
            need(ins[1].shape.len() == 1, || format!("index_select ids must be 1-D, got {}", ins[1]))?;
            let mut shape = ins[0].shape.clone();
            shape[*axis] = ins[1].shape[0];
            Ok(TensorType::new(ins[0].dtype, shape))
        }
        Op::IndexAdd { axis } => {
            arity(op, ins, 3)?;
            axis_ok(ins[0], *axis)?;
            index(ins[1])?;
            let mut want = ins[0].shape.clone();
            need(ins[1].shape.len() == 1, || format!("index_add ids must be 1-D, got {}", ins[1]))?;
            want[*axis] = ins[1].shape[0];
            need(ins[2].shape == want && ins[2].dtype == ins[0].dtype, || {
                format!("index_add source {} should be {want:?}", ins[2])
            })?;
            Ok(ins[0].clone())
        }
        Op::Gather { axis } => {
            arity(op, ins, 2)?;
            axis_ok(ins[0], *axis)?;
            index(ins[1])?;
            let ok = ins[1].shape.len() == ins[0].shape.len()
                && ins[1].shape.iter().zip(&ins[0].shape).enumerate().all(|(i, (a, b))| i == *axis || a == b);
            need(ok, || format!("gather index {} does not match {} off axis {axis}", ins[1], ins[0]))?;
            Ok(TensorType::new(ins[0].dtype, ins[1].shape.clone()))
        }
        Op::ScatterAdd { axis } => {
            arity(op, ins, 3)?;
            axis_ok(ins[0], *axis)?;
            index(ins[1])?;
            need(ins[1].shape == ins[2].shape && ins[2].dtype == ins[0].dtype, || {
                format!("scatter_add index {} and source {} differ", ins[1], ins[2])
            })?;
            let ok = ins[1].shape.len() == ins[0].shape.len()
                && ins[1].shape.iter().zip(&ins[0].shape).enumerate().all(|(i, (a, b))| i == *axis || a == b);
            need(ok, || format!("scatter_add index {} does not match {} off axis {axis}", ins[1], ins[0]))?;
            Ok(ins[0].clone())
        }
        _ => unreachable!("infer dispatches only indexing ops here"),
    }
}

/// Mixture-of-experts ops: top-k (u32 indices, the last axis cut to k), sort-by-expert and
/// bincount (1-D u32 ids → a u32 permutation `[R]` or counts `[bins]`), segment matmul
/// (`(x [R, K], w [E, K, N] or [E, N, K], counts [E] or [G, E])` → `[R, N]`) and segment outer
/// (`(a [R, N], b [R, K], counts)` → `[E, N, K]`).
fn infer_moe(op: &Op, ins: &[&TensorType]) -> Result<TensorType, String> {
    match op {
        Op::TopK { k } => {
            arity(op, ins, 1)?;
            float(ins[0])?;
            let r = ins[0].shape.len();
            need(r >= 1 && *k >= 1 && *k <= ins[0].shape[r - 1], || format!("top-{k} of {}", ins[0]))?;
            let mut shape = ins[0].shape.clone();
            shape[r - 1] = *k;
            Ok(TensorType::new(DType::U32, shape))
        }
        Op::SortByExpert { .. } | Op::Bincount { .. } => {
            arity(op, ins, 1)?;
            index(ins[0])?;
            need(ins[0].shape.len() == 1, || format!("{} ids must be 1-D, got {}", op.mnemonic(), ins[0]))?;
            Ok(match op {
                Op::Bincount { bins } => TensorType::new(DType::U32, vec![*bins]),
                _ => ins[0].clone(),
            })
        }
        Op::SegmentMatmul { transpose } => {
            arity(op, ins, 3)?;
            float(ins[0])?;
            index(ins[2])?;
            let (x, w, c) = (&ins[0].shape, &ins[1].shape, &ins[2].shape);
            let ok = x.len() == 2
                && w.len() == 3
                && matches!(c.len(), 1 | 2)
                && c.last() == w.first()
                && ins[1].dtype == ins[0].dtype;
            let (k, n) = if *transpose { (w.get(2), w.get(1)) } else { (w.get(1), w.get(2)) };
            need(ok && k == x.get(1), || {
                format!(
                    "segment_matmul of {} by {} (transpose={transpose}) with counts {}",
                    ins[0], ins[1], ins[2]
                )
            })?;
            Ok(TensorType::new(ins[0].dtype, vec![x[0], *n.unwrap_or(&0)]))
        }
        Op::SegmentOuter => {
            arity(op, ins, 3)?;
            float(ins[0])?;
            index(ins[2])?;
            let (a, bb, c) = (&ins[0].shape, &ins[1].shape, &ins[2].shape);
            let ok = a.len() == 2
                && bb.len() == 2
                && a[0] == bb[0]
                && matches!(c.len(), 1 | 2)
                && ins[1].dtype == ins[0].dtype;
            need(ok, || format!("segment_outer of {} and {} with counts {}", ins[0], ins[1], ins[2]))?;
            Ok(TensorType::new(ins[0].dtype, vec![c[c.len() - 1], a[1], bb[1]]))
        }
        _ => unreachable!("infer dispatches only mixture-of-experts ops here"),
    }
}

/// Collectives: a start's result over a group of size n along `axis` (all-reduce and replicate
/// keep the shape, all-gather multiplies the axis by n, reduce-scatter divides it by n, all-to-all keeps
/// it but needs it divisible by n, all-to-all-v takes `rows` rows along axis 0 and reads u32
/// send and receive counts `[n]`); a wait yields its start's type.
fn infer_collective(op: &Op, ins: &[&TensorType]) -> Result<TensorType, String> {
    match op {
        Op::CollectiveStart { kind, group, axis } => {
            arity(op, ins, if matches!(kind, CollectiveKind::AllToAllV { .. }) { 3 } else { 1 })?;
            need(group.size >= 1, || format!("group {} has size 0", group.mesh_axis))?;
            let mut shape = ins[0].shape.clone();
            match kind {
                CollectiveKind::AllToAllV { rows } => {
                    need(*axis == 0 && !shape.is_empty(), || {
                        format!("all_to_all_v runs along axis 0 of a tensor, got axis {axis} of {}", ins[0])
                    })?;
                    for c in &ins[1..] {
                        index(c)?;
                        need(c.shape == [group.size], || {
                            format!("all_to_all_v counts must be [{}] (one per member), got {c}", group.size)
                        })?;
                    }
                    shape[0] = *rows;
                }
                CollectiveKind::AllReduce | CollectiveKind::Replicate => {}
                CollectiveKind::AllGather => {
                    axis_ok(ins[0], *axis)?;
                    shape[*axis] *= group.size;
                }
                CollectiveKind::ReduceScatter | CollectiveKind::AllToAll => {
                    axis_ok(ins[0], *axis)?;
                    need(shape[*axis].is_multiple_of(group.size), || {
                        format!("axis {axis} of {} not divisible by group size {}", ins[0], group.size)
                    })?;
                    if *kind == CollectiveKind::ReduceScatter {
                        shape[*axis] /= group.size;
                    }
                }
            }
            Ok(TensorType::new(ins[0].dtype, shape))
        }
        Op::CollectiveWait => {
            arity(op, ins, 1)?;
            Ok(ins[0].clone())
        }
        _ => unreachable!("infer dispatches only collectives here"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::BinaryOp;

    fn t(s: &[usize]) -> TensorType {
        TensorType::new(DType::F32, s.to_vec())
    }

    #[test]
    fn matmul_and_broadcast_shapes() {
        assert_eq!(infer(&Op::Matmul, &[&t(&[2, 3, 4]), &t(&[2, 4, 5])]).unwrap().shape, vec![2, 3, 5]);
        assert!(infer(&Op::Matmul, &[&t(&[2, 3, 4]), &t(&[2, 5, 5])]).unwrap_err().contains("inner"));
        let add = Op::Binary { f: BinaryOp::Add };
        assert_eq!(infer(&add, &[&t(&[4, 1]), &t(&[3])]).unwrap().shape, vec![4, 3]);
        assert!(infer(&add, &[&t(&[4, 2]), &t(&[3])]).is_err());
    }

    #[test]
    fn reductions_and_layout() {
        assert_eq!(infer(&Op::Sum { axis: 1, keepdim: false }, &[&t(&[2, 3, 4])]).unwrap().shape, vec![2, 4]);
        assert_eq!(
            infer(&Op::Max { axis: 2, keepdim: true }, &[&t(&[2, 3, 4])]).unwrap().shape,
            vec![2, 3, 1]
        );
        assert_eq!(
            infer(&Op::Permute { perm: vec![2, 0, 1] }, &[&t(&[2, 3, 4])]).unwrap().shape,
            vec![4, 2, 3]
        );
        assert!(infer(&Op::Permute { perm: vec![0, 0, 1] }, &[&t(&[2, 3, 4])]).is_err());
        assert!(infer(&Op::Reshape { shape: vec![5] }, &[&t(&[2, 3])]).is_err());
        assert!(infer(&Op::Slice { axis: 0, start: 1, end: 3 }, &[&t(&[2])]).is_err());
    }

    #[test]
    fn collective_shapes_follow_group_size() {
        let g = crate::op::CommGroup::new(crate::op::MeshAxis::Fsdp, 4);
        let ag = Op::CollectiveStart { kind: CollectiveKind::AllGather, group: g, axis: 0 };
        assert_eq!(infer(&ag, &[&t(&[2, 8])]).unwrap().shape, vec![8, 8]);
        let rs = Op::CollectiveStart { kind: CollectiveKind::ReduceScatter, group: g, axis: 0 };
        assert_eq!(infer(&rs, &[&t(&[8, 8])]).unwrap().shape, vec![2, 8]);
        assert!(infer(&rs, &[&t(&[6, 8])]).is_err());
    }
}
