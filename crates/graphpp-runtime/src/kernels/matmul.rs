//! Matrix products on candle CPU tensors: the interpreter's [`matmul`] and the compiled
//! executor's [`compiled_matmul`], which runs gemm on the operands' own strides with the same bits.

use super::bf16_gemm::{self, Strided};
use candle_core::{CpuStorage, DType as CDType, Device, Tensor};

use super::device::composed;
use rayon::prelude::*;

/// Batched matmul on the lhs's own strides and a row-major rhs: a rhs whose rows are not
/// contiguous (a transposed weight) is copied first, as gemm reads it faster so and a compiled
/// program reads its kept copy ([`crate::exec::kept`]: the same bits); operands whose layout
/// candle's matmul cannot take (e.g. a permuted 4-D view) are made contiguous first. An operand
/// [`composed`] names goes to candle's product as it is. bf16 operands run on the process's bf16
/// path ([`bf16_gemm::chosen`]), as a bf16 run computes them (the hardware probe times this).
///
/// # Errors
/// candle's, for operands it cannot multiply; the bf16 path's [`bf16_gemm::PathError`] as a
/// candle error.
pub fn matmul(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    if composed(a) {
        // candle's product on the operands' device (cuBLAS on a GPU; bf16 sums in f32 there).
        // Its CUDA backend refuses views it cannot stride through with its own error
        // (`MatMulNonContiguous`, not the CPU's `MatMulUnexpectedStriding`): any refusal of a
        // view is retried on contiguous copies.
        return match a.matmul(b) {
            Err(e) if is_striding(&e) || !a.is_contiguous() || !b.is_contiguous() => {
                a.contiguous()?.matmul(&b.contiguous()?)
            }
            r => r,
        };
    }
    if let Some(product) = bf16_matmul(a, b, Threads::Pool)? {
        return Ok(product);
    }
    let copied;
    let b = if b.rank() >= 2 && b.stride()[b.rank() - 1] != 1 && b.dims()[b.rank() - 1] > 1 {
        copied = b.contiguous()?;
        &copied
    } else {
        b
    };
    match a.matmul(b) {
        Err(e) if is_striding(&e) => a.contiguous()?.matmul(&b.contiguous()?),
        r => r,
    }
}

/// The threads a compiled matmul runs on.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Threads {
    /// The current pool's (gemm's split, batch elements split): a product on its own.
    Pool,
    /// One (gemm unthreaded, batch elements in turn): one product of a pair ([`crate::exec::pairs`]).
    One,
}

/// The compiled executor's matmul: an f32 product of rank 2–4 runs as [`batched_gemm`]
/// on the operands [`batched_operands`] picks — each read in place where that gives the bits of
/// its copy; every other product is the interpreter's [`matmul`]. The same bits as [`matmul`]
/// (`matmul_tests`, `tests/compiled.rs`).
pub(crate) fn compiled_matmul(a: &Tensor, b: &Tensor, threads: Threads) -> candle_core::Result<Tensor> {
    if composed(a) {
        return matmul(a, b);
    }
    if let Some(product) = bf16_matmul(a, b, threads)? {
        return Ok(product);
    }
    // A dim of 1 sends gemm down a path whose sums depend on the strides (a 2 × 3 · 3 × 1
    // product of a transposed lhs differed from its copy's): those are left to `matmul`.
    let (da, db) = (a.dims(), b.dims());
    let unit = da.len() < 2 || db.len() < 2 || da[da.len() - 2..].contains(&1) || db[db.len() - 1] == 1;
    match if unit { None } else { batched_operands(a, b)? } {
        Some((a, b)) => batched_gemm(&a, &b, threads),
        None => matmul(a, b),
    }
}

/// The f32 cast of the transpose of a rank-2 bf16 product, `cast(transpose(a · b), f32)`, in
/// one pass: the `[n, m]` f32 tensor of [`compiled_matmul`]'s bf16 values, transposed and
/// widened (`bf16_gemm::Out::WidenedTransposed`: the same bits as the three steps). `None` for
/// any other product (the caller takes [`compiled_matmul`]).
///
/// # Errors
/// The bf16 path's [`bf16_gemm::PathError`], as a candle error.
pub(crate) fn compiled_matmul_transposed_widened(
    a: &Tensor,
    b: &Tensor,
    threads: Threads,
) -> candle_core::Result<Option<Tensor>> {
    let bf16s = a.dtype() == CDType::BF16 && b.dtype() == CDType::BF16;
    let rank2 = a.rank() == 2 && b.rank() == 2;
    let Some((m, k, n)) = batched_shape(a.dims(), b.dims()).filter(|_| bf16s && rank2 && !composed(a)) else {
        return Ok(None);
    };
    let out = with_bf16_operands(a, b, |path, (va, la), (vb, lb)| {
        let mut out: Vec<f32> = Vec::with_capacity(m * n);
        let (lhs, rhs) = (operand(va, la, &[], 0), operand(vb, lb, &[], 0));
        let parallel = matches!(threads, Threads::Pool);
        let dst = &mut out.spare_capacity_mut()[..m * n];
        bf16_gemm::gemm(path, (m, n, k), (lhs, rhs), bf16_gemm::Out::WidenedTransposed(dst), parallel);
        // SAFETY: the product wrote all m · n elements.
        unsafe { out.set_len(m * n) };
        out
    })?;
    Tensor::from_vec(out, (n, m), &Device::Cpu).map(Some)
}

/// `f` of the process's bf16 path and bf16 CPU tensors `a` and `b`'s elements and layouts.
///
/// # Errors
/// The bf16 path's [`bf16_gemm::PathError`] (as a candle error); an operand that is not a CPU
/// bf16 tensor.
fn with_bf16_operands<R>(
    a: &Tensor,
    b: &Tensor,
    f: impl FnOnce(
        bf16_gemm::Bf16Gemm,
        (&[half::bf16], &candle_core::Layout),
        (&[half::bf16], &candle_core::Layout),
    ) -> R,
) -> candle_core::Result<R> {
    let path = bf16_gemm::chosen().map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    let (sa, la) = a.storage_and_layout();
    let (sb, lb) = b.storage_and_layout();
    let (candle_core::Storage::Cpu(CpuStorage::BF16(va)), candle_core::Storage::Cpu(CpuStorage::BF16(vb))) =
        (&*sa, &*sb)
    else {
        candle_core::bail!("bf16 matmul takes CPU bf16 tensors")
    };
    Ok(f(path, (va, la), (vb, lb)))
}

/// The operands [`batched_gemm`] reads for `a · b`, each as it is or its contiguous copy, or
/// `None` for a product it does not take — not f32 of rank 2–4, an empty dim, batch or inner
/// dims that do not match, or a stride-0 batch dim (an operand broadcast over the batch: left to
/// candle, which folds a batch-invariant rhs into one product). A rhs whose rows are not
/// contiguous is copied, as [`matmul`] copies it (kᵀ: gemm's sums change with a transposed
/// rhs's layout, a 2 × 3 · 3 × 2 product differed by 1 ulp). Where candle refuses the operands
/// (batch dims that do not collapse into one stride: heads-split q, k, v in an attention composed
/// of matmuls) and
/// [`matmul`] copies both, this keeps every operand whose layout gives its copy's bits — a lhs
/// candle can step through (softmax's transposed Pᵀ: beside a rhs with contiguous rows, the
/// only kind passed here, gemm's sums do not depend on the lhs's orientation) and any operand
/// whose rows are contiguous (a permuted q, k or v: its copy differs only in the row stride,
/// which gemm's sums do not depend on). A rank-2 lhs is kept as it is, on any strides, as
/// candle's matmul takes it (a weight gradient's transposed activations).
fn batched_operands(a: &Tensor, b: &Tensor) -> candle_core::Result<Option<(Tensor, Tensor)>> {
    let (da, db) = (a.dims(), b.dims());
    let r = da.len();
    let f32s = a.dtype() == CDType::F32 && b.dtype() == CDType::F32;
    let batch_ok = |t: &Tensor| t.stride()[..r - 2].iter().all(|&s| s > 0);
    if batched_shape(da, db).is_none()
        || !f32s
        || da.iter().chain(db).any(|&d| d == 0)
        || !batch_ok(a)
        || !batch_ok(b)
    {
        return Ok(None);
    }
    let rows_contiguous = |t: &Tensor| t.stride()[r - 1] == 1;
    let a = if r == 2 || batch_skip(a).is_some() || rows_contiguous(a) { a.clone() } else { a.contiguous()? };
    let b = if rows_contiguous(b) { b.clone() } else { b.contiguous()? };
    Ok(Some((a, b)))
}

/// `(m, k, n)` of a batched product `[.., m, k] · [.., k, n]`: ranks 2–4, equal, with equal batch
/// dims; `None` for any other pair of shapes.
fn batched_shape(da: &[usize], db: &[usize]) -> Option<(usize, usize, usize)> {
    let r = da.len();
    ((2..=4).contains(&r) && db.len() == r && da[..r - 2] == db[..r - 2] && da[r - 1] == db[r - 2])
        .then(|| (da[r - 2], da[r - 1], db[r - 1]))
}

/// The stride between consecutive batch elements of a rank-3 or rank-4 operand, where its batch
/// dims collapse into one stride — candle's rule for the operands its matmul takes; `None` where
/// they do not.
fn batch_skip(t: &Tensor) -> Option<usize> {
    let (dims, strides) = (t.dims(), t.stride());
    match (&dims[..dims.len() - 2], &strides[..strides.len() - 2]) {
        ([_], &[s]) => Some(s),
        ([_, d1], &[s0, s1]) if s0 == s1 * d1 => Some(s1),
        ([1, _], &[_, s1]) => Some(s1),
        ([_, 1], &[s0, _]) => Some(s0),
        _ => None,
    }
}

/// A batched f32 product `[.., m, k] · [.., k, n]` (rank 2–4, the operands' batch dims equal:
/// those [`batched_operands`] passes) on the operands' own strides: per batch element the gemm call candle's matmul makes (same
/// sizes, strides within the element, and parallelism, so the same bits), each element's
/// operands found from its batch index through each batch dim's stride (candle needs the batch
/// dims to collapse into one). On a pool of two or more threads the elements are split over
/// it: per-head products (64 × 64 × 32 and alike) are each too small for gemm to split.
fn batched_gemm(a: &Tensor, b: &Tensor, threads: Threads) -> candle_core::Result<Tensor> {
    let (da, db) = (a.dims(), b.dims());
    let r = da.len();
    let Some((m, k, n)) = batched_shape(da, db) else {
        candle_core::bail!("batched_gemm: operands {da:?} · {db:?} are not a batched product")
    };
    let batch_dims = &da[..r - 2];
    let batch: usize = batch_dims.iter().product();
    let (sa, la) = a.storage_and_layout();
    let (sb, lb) = b.storage_and_layout();
    let (candle_core::Storage::Cpu(CpuStorage::F32(va)), candle_core::Storage::Cpu(CpuStorage::F32(vb))) =
        (&*sa, &*sb)
    else {
        candle_core::bail!("batched_gemm takes CPU f32 tensors")
    };
    let (lhs, rhs) = (&va[la.start_offset()..], &vb[lb.start_offset()..]);
    let (ls, rs) = (la.stride(), lb.stride());
    let offset = |s: &[usize], i: usize| batch_offset(batch_dims, s, i);
    // The last element an operand's strides reach must lie in its storage.
    let reach = |s: &[usize], rows: usize, cols: usize| {
        offset(s, batch - 1) + (rows - 1) * s[r - 2] + (cols - 1) * s[r - 1] + 1
    };
    if reach(ls, m, k) > lhs.len() || reach(rs, k, n) > rhs.len() {
        candle_core::bail!("batched_gemm: operands {da:?} · {db:?} reach outside their storage")
    }
    let pool = matches!(threads, Threads::Pool);
    let gemm_threads = if pool { candle_core::utils::get_num_threads() } else { 1 };
    let parallelism =
        if gemm_threads > 1 { gemm::Parallelism::Rayon(gemm_threads) } else { gemm::Parallelism::None };
    let element = |i: usize, dst: &mut [std::mem::MaybeUninit<f32>], _split: bool| {
        // SAFETY: batch element i's operands lie in `lhs` and `rhs` (the reach checked above:
        // offsets grow with every index), and `dst` holds its contiguous m × n result.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                dst.as_mut_ptr().cast::<f32>(),
                1,
                n as isize,
                false,
                lhs[offset(ls, i)..].as_ptr(),
                ls[r - 1] as isize,
                ls[r - 2] as isize,
                rhs[offset(rs, i)..].as_ptr(),
                rs[r - 1] as isize,
                rs[r - 2] as isize,
                0f32,
                1f32,
                false,
                false,
                false,
                parallelism,
            )
        }
    };
    // Not zeroed (candle zeroes its output first: ~5% of `small`'s fwbw in `perf`): gemm with
    // `read_dst` false writes every element of each m × n block before it reads any.
    let out = batch_products(batch, m * n, threads, element);
    drop((sa, sb));
    Tensor::from_vec(out, batch_dims.iter().copied().chain([m, n]).collect::<Vec<_>>(), &Device::Cpu)
}

/// The `batch` products of `len` elements each, `element(i, dst, split)` writing product `i`
/// into `dst` (every element of it): split over the current pool, one product per task, when
/// `threads` is the pool's, there are two or more products and two or more threads (`split`
/// then true: the product itself should not split again); else in turn.
fn batch_products<T: Send>(
    batch: usize,
    len: usize,
    threads: Threads,
    element: impl Fn(usize, &mut [std::mem::MaybeUninit<T>], bool) + Sync,
) -> Vec<T> {
    let mut out: Vec<T> = Vec::with_capacity(batch * len);
    let spare = &mut out.spare_capacity_mut()[..batch * len];
    let split = batch > 1 && matches!(threads, Threads::Pool) && rayon::current_num_threads() > 1;
    if len > 0 && split {
        spare.par_chunks_mut(len).enumerate().for_each(|(i, dst)| element(i, dst, true));
    } else if len > 0 {
        spare.chunks_mut(len).enumerate().for_each(|(i, dst)| element(i, dst, false));
    }
    // SAFETY: each product wrote its `len` elements (the caller's contract), and the blocks
    // tile `out`.
    unsafe { out.set_len(batch * len) };
    out
}

/// Batch element `i`'s first element in an operand of batch dims `batch_dims` and strides
/// `strides` (the batch dims' strides first, then the matrix's two).
fn batch_offset(batch_dims: &[usize], strides: &[usize], i: usize) -> usize {
    let mut rest = i;
    let mut off = 0;
    for d in (0..batch_dims.len()).rev() {
        off += (rest % batch_dims[d]) * strides[d];
        rest /= batch_dims[d];
    }
    off
}

/// A product of bf16 operands of rank 2–4 (batch dims equal, any strides) on the process's bf16
/// path ([`bf16_gemm::chosen`]): f32 sums rounded to bf16 once. `None` for any other product
/// (another dtype, ranks or batch dims that differ: candle's matmul takes those).
///
/// # Errors
/// The bf16 path's [`bf16_gemm::PathError`], as a candle error.
fn bf16_matmul(a: &Tensor, b: &Tensor, threads: Threads) -> candle_core::Result<Option<Tensor>> {
    let (da, db) = (a.dims(), b.dims());
    let r = da.len();
    let bf16s = a.dtype() == CDType::BF16 && b.dtype() == CDType::BF16;
    let Some((m, k, n)) = batched_shape(da, db).filter(|_| bf16s) else {
        return Ok(None);
    };
    let batch_dims = &da[..r - 2];
    let batch: usize = batch_dims.iter().product();
    let pool = matches!(threads, Threads::Pool);
    let out = with_bf16_operands(a, b, |path, (va, la), (vb, lb)| {
        let element = |i: usize, dst: &mut [std::mem::MaybeUninit<half::bf16>], parallel: bool| {
            let (lhs, rhs) = (operand(va, la, batch_dims, i), operand(vb, lb, batch_dims, i));
            bf16_gemm::gemm(path, (m, n, k), (lhs, rhs), bf16_gemm::Out::Rows(dst), parallel)
        };
        batch_products(batch, m * n, threads, |i, dst, split| element(i, dst, pool && !split))
    })?;
    Tensor::from_vec(out, da[..r - 1].iter().copied().chain([n]).collect::<Vec<_>>(), &Device::Cpu).map(Some)
}

/// Batch element `i` of a bf16 operand of layout `l` (batch dims `batch_dims`) as the bf16
/// path reads it.
fn operand<'a>(v: &'a [half::bf16], l: &candle_core::Layout, batch_dims: &[usize], i: usize) -> Strided<'a> {
    let (s, r) = (l.stride(), l.stride().len());
    Strided {
        data: &v[l.start_offset() + batch_offset(batch_dims, s, i)..],
        row_stride: s[r - 2],
        col_stride: s[r - 1],
    }
}

/// candle's refusal of operands whose batch dims do not collapse into one stride.
fn is_striding(e: &candle_core::Error) -> bool {
    match e {
        candle_core::Error::MatMulUnexpectedStriding(_) => true,
        candle_core::Error::WithBacktrace { inner, .. } => is_striding(inner),
        _ => false,
    }
}

#[cfg(test)]
mod matmul_tests {
    use super::*;
    use proptest::prelude::*;

    /// `dims` filled from `seed`, then permuted by `perm`.
    fn view(dims: [usize; 4], perm: [usize; 4], seed: u64) -> Tensor {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let data: Vec<f32> = (0..dims.iter().product::<usize>())
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect();
        Tensor::from_vec(data, dims.to_vec(), &Device::Cpu).unwrap().permute(perm.to_vec()).unwrap()
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
    }

    /// `small`'s shapes, past gemm's own threading threshold (48 · 48 · 256 multiply-adds) and
    /// its larger kernel blocks: batched rank-3 and rank-4 products, contiguous and permuted,
    /// and rank-2 ones (a linear's forward and its two gradients, one with a transposed lhs),
    /// on one thread and split over a pool, and with gemm held to one thread (a pair's
    /// product, [`crate::exec::pairs`]), give the interpreter's bits — the interpreter's gemm runs on
    /// as many threads as candle's setting says (the machine's cores by default).
    #[test]
    fn large_products_give_the_interpreters_bits() {
        let cases = [
            (view([2, 1, 128, 256], [0, 1, 2, 3], 1), view([2, 1, 256, 688], [0, 1, 2, 3], 2)),
            (view([2, 128, 3, 256], [0, 2, 1, 3], 3), view([2, 256, 3, 200], [0, 2, 1, 3], 4)),
            (view([3, 2, 256, 130], [0, 1, 3, 2], 5), view([3, 2, 256, 96], [0, 1, 2, 3], 6)),
            (view([1, 1, 128, 256], [0, 1, 2, 3], 7), view([1, 1, 256, 688], [0, 1, 2, 3], 8)),
            (view([1, 1, 128, 256], [0, 1, 3, 2], 9), view([1, 1, 128, 688], [0, 1, 2, 3], 10)),
            (view([1, 1, 128, 688], [0, 1, 2, 3], 11), view([1, 1, 688, 256], [0, 1, 2, 3], 12)),
        ];
        for (x, y) in cases {
            let squeeze = |t: &Tensor| {
                if t.dims()[0] == 1 {
                    t.squeeze(0).unwrap().squeeze(0).unwrap()
                } else {
                    t.squeeze(1).unwrap_or(t.clone())
                }
            };
            for (x, y) in [(x.clone(), y.clone()), (squeeze(&x), squeeze(&y))] {
                let want = bits(&matmul(&x, &y).unwrap());
                for threads in [1, 2, 3] {
                    let pool = crate::kernels::threads::rank_pool(0, threads).unwrap();
                    for t in [Threads::Pool, Threads::One] {
                        let got = pool.install(|| bits(&compiled_matmul(&x, &y, t).unwrap()));
                        assert_eq!(got, want, "{:?} · {:?} on {threads} threads, {t:?}", x.dims(), y.dims());
                    }
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

        /// Attention's operand pairs — lhs contiguous, transposed (Pᵀ) or permuted (q), rhs
        /// permuted (k, v), permuted and transposed (kᵀ), contiguous or transposed — give the
        /// interpreter's bits, on one thread and with the batch split over a pool.
        #[test]
        fn compiled_matmul_equals_the_interpreters(
            b in 1usize..3, h in 1usize..4, m in 1usize..80, k in 1usize..80, n in 1usize..80,
            lhs in 0usize..3, rhs in 0usize..4, seed in 0u64..1000
        ) {
            let x = match lhs {
                0 => view([b, h, m, k], [0, 1, 2, 3], seed),
                1 => view([b, h, k, m], [0, 1, 3, 2], seed),
                _ => view([b, m, h, k], [0, 2, 1, 3], seed),
            };
            let y = match rhs {
                0 => view([b, k, h, n], [0, 2, 1, 3], seed + 1),
                1 => view([b, n, h, k], [0, 2, 3, 1], seed + 1),
                2 => view([b, h, k, n], [0, 1, 2, 3], seed + 1),
                _ => view([b, h, n, k], [0, 1, 3, 2], seed + 1),
            };
            let want = bits(&matmul(&x, &y).unwrap());
            prop_assert_eq!(bits(&compiled_matmul(&x, &y, Threads::Pool).unwrap()), want.clone());
            prop_assert_eq!(bits(&compiled_matmul(&x, &y, Threads::One).unwrap()), want.clone());
            // With batch elements split over a pool (batched_gemm).
            let pool = crate::kernels::threads::rank_pool(0, 3).unwrap();
            prop_assert_eq!(pool.install(|| bits(&compiled_matmul(&x, &y, Threads::Pool).unwrap())), want);
        }
    }
}
