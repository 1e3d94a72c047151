//! One node's kernel: the op of a node applied to its operands' tensors, through candle or the
//! CPU kernels of [`crate::kernels`].

use crate::kernels::device::composed;
use candle_core::{DType as CDType, Device, Tensor};
use graphpp_graph::{BinaryOp, Graph, Op, UnaryOp};

use super::{ExecError, ExecResult};
use crate::kernels::matmul::matmul;
use crate::kernels::tensor::{candle_dtype, cast, read_f32};

/// σ(x) = 1 / (1 + e^(−x)) in one pass over a contiguous f32/f64 tensor (the same arithmetic as
/// the four-op form used otherwise: negate, exp, add 1, reciprocal). A bf16 operand never
/// reaches it: [`kernel`] widens every bf16 elementwise op's operands and rounds once.
fn sigmoid(x: &Tensor) -> candle_core::Result<Tensor> {
    if x.is_contiguous() && matches!(x.dtype(), CDType::F32 | CDType::F64) && !composed(x) {
        x.apply_op1_no_bwd(&SigmoidOp)
    } else {
        (x.neg()?.exp()? + 1.0)?.recip()
    }
}

/// The one-pass CPU sigmoid kernel of [`sigmoid`].
struct SigmoidOp;

impl candle_core::CustomOp1 for SigmoidOp {
    fn name(&self) -> &'static str {
        "sigmoid"
    }

    fn cpu_fwd(
        &self,
        storage: &candle_core::CpuStorage,
        layout: &candle_core::Layout,
    ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
        use candle_core::CpuStorage as S;
        let Some((lo, hi)) = layout.contiguous_offsets() else {
            candle_core::bail!("sigmoid kernel needs a contiguous input")
        };
        let out = match storage {
            S::F32(v) => S::F32(v[lo..hi].iter().map(|&x| 1.0 / ((-x).exp() + 1.0)).collect()),
            S::F64(v) => S::F64(v[lo..hi].iter().map(|&x| 1.0 / ((-x).exp() + 1.0)).collect()),
            _ => candle_core::bail!("sigmoid kernel takes f32 or f64"),
        };
        Ok((out, layout.shape().clone()))
    }
}

/// `a f b` with broadcasting for the arithmetic ops.
///
/// bf16 operands are widened to f32 by the caller and the f32 result rounded once: the same
/// values candle's bf16 kernels produce (they compute each element in f32 and round), but its
/// CPU bf16 add re-detects the CPU's bf16 instructions per 8 elements, which costs more than the
/// widening and the rounding (measured: docs/PERFORMANCE.md, "bf16").
fn arithmetic(f: BinaryOp, a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    match f {
        BinaryOp::Add => a.broadcast_add(b),
        BinaryOp::Sub => a.broadcast_sub(b),
        BinaryOp::Mul => a.broadcast_mul(b),
        BinaryOp::Div => a.broadcast_div(b),
        BinaryOp::Eq => a.broadcast_eq(b)?.to_dtype(a.dtype()),
    }
}

/// RoPE's rotate-half along the last axis ([`Op::RotateHalf`]): `[−x2, x1]` for halves `x1`,
/// `x2`. An f32 or bf16 CPU operand in one pass over its rows (negation and copies are exact:
/// the bits of the slice-negate-concatenate it replaces); others, and every [`composed`]
/// operand, through candle's narrow, neg and cat.
fn rotate_half(x: &Tensor) -> candle_core::Result<Tensor> {
    let Some(last) = x.rank().checked_sub(1) else { candle_core::bail!("rotate_half of a scalar") };
    let n = x.dims()[last];
    if !n.is_multiple_of(2) {
        candle_core::bail!("rotate_half needs a last axis of even length, got {:?}", x.dims())
    }
    let h = n / 2;
    match x.dtype() {
        _ if composed(x) || h == 0 => {
            let (x1, x2) = (x.narrow(last, 0, h)?, x.narrow(last, h, h)?);
            Tensor::cat(&[&x2.neg()?, &x1], last)
        }
        CDType::F32 => Tensor::from_vec(read_f32(x, |src| rotate_rows(src, n))?, x.dims(), &Device::Cpu),
        CDType::BF16 => {
            let x = x.contiguous()?;
            let (storage, layout) = x.storage_and_layout();
            let candle_core::Storage::Cpu(candle_core::CpuStorage::BF16(v)) = &*storage else {
                candle_core::bail!("rotate_half: expected a CPU bf16 tensor")
            };
            let src = &v[layout.start_offset()..layout.start_offset() + x.elem_count()];
            Tensor::from_vec(rotate_rows(src, n), x.dims(), &Device::Cpu)
        }
        _ => {
            let (x1, x2) = (x.narrow(last, 0, h)?, x.narrow(last, h, h)?);
            Tensor::cat(&[&x2.neg()?, &x1], last)
        }
    }
}

/// [`rotate_half`] of rows of `n` elements.
fn rotate_rows<T: Copy + Default + std::ops::Neg<Output = T>>(src: &[T], n: usize) -> Vec<T> {
    let h = n / 2;
    let mut out = vec![T::default(); src.len()];
    for (y, row) in out.chunks_exact_mut(n).zip(src.chunks_exact(n)) {
        let (y1, y2) = y.split_at_mut(h);
        for (o, &v) in y1.iter_mut().zip(&row[h..]) {
            *o = -v;
        }
        y2.copy_from_slice(&row[..h]);
    }
    out
}

/// Sum over `axis`. A bf16 operand is summed in f32 and the result rounded to bf16 once (candle's
/// CPU sum would accumulate in bf16, losing the small terms of a long sum; GPU reductions
/// accumulate in f32).
fn sum(x: &Tensor, axis: usize, keepdim: bool) -> candle_core::Result<Tensor> {
    let wide = if x.dtype() == CDType::BF16 { cast(x, CDType::F32)? } else { x.clone() };
    let s = if wide.dtype() == CDType::F32 && axis + 1 < x.rank() && !composed(x) {
        sum_rows(&wide, axis, keepdim)?
    } else if keepdim {
        wide.sum_keepdim(axis)?
    } else {
        wide.sum(axis)?
    };
    cast(&s, x.dtype())
}

/// The [`ExecError::Kernel`] of node `i`.
pub(super) fn kernel_error(graph: &Graph, i: usize, e: candle_core::Error) -> ExecError {
    let node = &graph.nodes[i];
    ExecError::Kernel {
        graph: graph.name.clone(),
        node: i,
        op: node.op.mnemonic(),
        scope: node.meta.scope.clone(),
        source: Box::new(e),
    }
}

/// Sum of an f32 tensor over a non-last `axis`, as whole rows: viewing `x` as `[A, K, B]` (`K` the
/// axis), `out[a] = Σ_k x[a, k]` with rows of `B` added in ascending `k` from 0.0 — each element's
/// additions in candle's order (its CPU sum visits the source in row-major order), so the same
/// bits, but a vectorised pass over rows instead of one index computation per element. The
/// RMSNorm weight gradients' sums over batch and sequence are such sums. (measured:
/// docs/PERFORMANCE.md, "Row sums over a non-last axis")
fn sum_rows(x: &Tensor, axis: usize, keepdim: bool) -> candle_core::Result<Tensor> {
    let dims = x.dims();
    let (a, k) = (dims[..axis].iter().product::<usize>(), dims[axis]);
    let b: usize = dims[axis + 1..].iter().product();
    let out = read_f32(x, |src| {
        let mut out = vec![0f32; a * b];
        for (o, block) in out.chunks_mut(b.max(1)).zip(src.chunks((k * b).max(1))) {
            for row in block.chunks(b.max(1)) {
                o.iter_mut().zip(row).for_each(|(o, &v)| *o += v);
            }
        }
        out
    })?;
    let mut shape = dims.to_vec();
    if keepdim {
        shape[axis] = 1;
    } else {
        shape.remove(axis);
    }
    Tensor::from_vec(out, shape, &Device::Cpu)
}

/// Node `i`'s value (its op `op`) from its operands `a`; an operand-less node (a constant)
/// is made on `device`, the run's.
pub(super) fn eval(graph: &Graph, i: usize, op: &Op, a: &[&Tensor], device: &Device) -> ExecResult<Tensor> {
    if let Op::CollectiveWait = op {
        // The start's value was completed when this node read it.
        return Ok(a[0].clone());
    }
    kernel(op, a, &graph.nodes[i].ty, device).map_err(|e| kernel_error(graph, i, e))
}

/// Node `op`'s value from its operands `a`; `ty` is the node's type. A bf16 elementwise op
/// (unary, affine, binary) runs on its operands widened to f32 and rounds its result to bf16
/// once, as a GPU's fused kernels and the compiled executor's bf16 groups do
/// ([`crate::exec::fusion`]): one rule for every such op instead of candle's per-op bf16
/// arithmetic (its bf16 affine rounds `mul` and `add` to bf16 and rounds twice).
fn kernel(
    op: &Op,
    a: &[&Tensor],
    ty: &graphpp_graph::TensorType,
    device: &Device,
) -> candle_core::Result<Tensor> {
    if op.is_pointwise() && a.first().is_some_and(|x| x.dtype() == CDType::BF16) {
        let wide = a.iter().map(|x| cast(x, CDType::F32)).collect::<candle_core::Result<Vec<_>>>()?;
        let wide: Vec<&Tensor> = wide.iter().collect();
        return cast(&kernel(op, &wide, ty, device)?, CDType::BF16);
    }
    Ok(match op {
        Op::Input { .. } | Op::CollectiveStart { .. } | Op::CollectiveWait => {
            unreachable!("handled by caller")
        }
        Op::Full { value, ty } => {
            (Tensor::zeros(ty.shape.clone(), candle_dtype(ty.dtype), device)? + *value)?
        }
        Op::Unary { f } => match f {
            UnaryOp::Neg => a[0].neg()?,
            UnaryOp::Exp => a[0].exp()?,
            UnaryOp::Log => a[0].log()?,
            UnaryOp::Sqrt => a[0].sqrt()?,
            UnaryOp::Recip => a[0].recip()?,
            UnaryOp::Sigmoid => sigmoid(a[0])?,
            UnaryOp::Erf => a[0].erf()?,
        },
        Op::Affine { mul, add } => a[0].affine(*mul, *add)?,
        Op::Binary { f } => arithmetic(*f, a[0], a[1])?,
        Op::Sum { axis, keepdim } => sum(a[0], *axis, *keepdim)?,
        Op::Max { axis, keepdim } => {
            if *keepdim {
                a[0].max_keepdim(*axis)?
            } else {
                a[0].max(*axis)?
            }
        }
        Op::Softmax { axis, scale } => {
            crate::kernels::softmax::softmax(a[0], a.get(1).copied(), *axis, *scale)?
        }
        Op::SoftmaxBackward { axis, scale } => {
            crate::kernels::softmax::softmax_backward(a[0], a[1], *axis, *scale)?
        }
        Op::Attention { scale } => crate::kernels::attention::attention(a[0], a[1], a[2], a[3], *scale)?,
        Op::AttentionBackward { scale } => {
            crate::kernels::attention::attention_backward(a[0], a[1], a[2], a[3], a[4], a[5], *scale)?
        }
        Op::RotateHalf => rotate_half(a[0])?,
        Op::LogSoftmax { axis } => crate::kernels::softmax::log_softmax(a[0], *axis)?,
        Op::LogSoftmaxBackward { axis } => crate::kernels::softmax::log_softmax_backward(a[0], a[1], *axis)?,
        Op::Matmul => matmul(a[0], a[1])?,
        Op::Reshape { shape } => a[0].contiguous()?.reshape(shape.clone())?,
        Op::Permute { perm } => a[0].permute(perm.clone())?,
        Op::Broadcast { shape } => a[0].broadcast_as(shape.clone())?,
        Op::Slice { axis, start, end } => a[0].narrow(*axis, *start, end - start)?,
        Op::Concat { axis } => Tensor::cat(a, *axis)?,
        Op::IndexSelect { axis } => a[0].contiguous()?.index_select(&a[1].contiguous()?, *axis)?,
        Op::IndexAdd { axis } => {
            a[0].contiguous()?.index_add(&a[1].contiguous()?, &a[2].contiguous()?, *axis)?
        }
        Op::Gather { axis } => a[0].contiguous()?.gather(&a[1].contiguous()?, *axis)?,
        Op::ScatterAdd { axis } => {
            a[0].contiguous()?.scatter_add(&a[1].contiguous()?, &a[2].contiguous()?, *axis)?
        }
        Op::TopK { k } => {
            let last = ty.shape.len() - 1;
            a[0].contiguous()?.arg_sort_last_dim(false)?.narrow(last, 0, *k)?.contiguous()?
        }
        Op::SortByExpert { experts } => crate::kernels::segment::sort_by_expert(a[0], *experts)?,
        Op::Bincount { bins } => crate::kernels::segment::bincount(a[0], *bins)?,
        Op::SegmentMatmul { transpose } => {
            crate::kernels::segment::segment_matmul(a[0], a[1], a[2], *transpose)?
        }
        Op::SegmentOuter => crate::kernels::segment::segment_outer(a[0], a[1], a[2])?,
        Op::Cast { dtype } => cast(a[0], candle_dtype(*dtype))?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotate_half_is_the_slices_negated_and_swapped() {
        let x = Tensor::arange(0f32, 2.0 * 3.0 * 6.0, &Device::Cpu).unwrap().reshape((2, 3, 6)).unwrap();
        let permuted = x.permute((1, 0, 2)).unwrap(); // read through .contiguous()
        let halves =
            x.affine(0.37, -3.1).unwrap().to_dtype(CDType::BF16).unwrap().permute((1, 0, 2)).unwrap();
        for t in [&x, &permuted, &halves] {
            let got = rotate_half(t).unwrap();
            let (x1, x2) = (t.narrow(2, 0, 3).unwrap(), t.narrow(2, 3, 3).unwrap());
            let want = Tensor::cat(&[&x2.neg().unwrap(), &x1], 2).unwrap();
            assert_eq!(got.dtype(), t.dtype());
            let bits = |t: &Tensor| t.to_dtype(CDType::F32).unwrap().to_vec3::<f32>().unwrap();
            assert_eq!(bits(&got), bits(&want));
        }
        // Row 0 of the contiguous operand: [0 1 2 3 4 5] → [−3 −4 −5 0 1 2].
        let row = rotate_half(&x).unwrap().get(0).unwrap().get(0).unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(row, [-3.0, -4.0, -5.0, 0.0, 1.0, 2.0]);
        assert!(rotate_half(&Tensor::zeros((2, 3), CDType::F32, &Device::Cpu).unwrap()).is_err());
    }

    #[test]
    fn sum_rows_gives_candles_bits() {
        // Values of mixed magnitude so that the order of the additions shows in the bits.
        let data: Vec<f32> = (0..2 * 5 * 3 * 4)
            .map(|i| ((i * 7919 % 113) as f32 - 56.0) * 1.37e-3 + (i % 3) as f32 * 1e3)
            .collect();
        let x = Tensor::from_vec(data, (2, 5, 3, 4), &Device::Cpu).unwrap();
        let permuted = x.permute((2, 0, 3, 1)).unwrap(); // not contiguous: read through .contiguous()
        for t in [&x, &permuted] {
            for axis in 0..3 {
                for keepdim in [false, true] {
                    let ours = sum_rows(t, axis, keepdim).unwrap();
                    let candle = if keepdim { t.sum_keepdim(axis) } else { t.sum(axis) }.unwrap();
                    assert_eq!(ours.dims(), candle.dims());
                    let (a, b) = (
                        ours.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                        candle.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    );
                    assert!(
                        a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "axis {axis}: {a:?} vs {b:?}"
                    );
                }
            }
        }
    }
}
