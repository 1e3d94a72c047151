//! The softmax kernel ([`graphpp_graph::Op::Softmax`]), one row at a time (issue 11 item 1: a
//! reduction fused with the elementwise chain around it).
//!
//! Each row of `n` elements along the softmax axis is finished in L1, a block of rows at a time:
//! `m = max x` (NaN-ignoring, so a row holding NaN gives NaN below), `e = exp(x − m)` with the C
//! library's `expf` bits ([`crate::expf`], four lanes at a time), `s = Σ e` in a fixed order
//! (eight interleaved partial sums, element `i` into sum `i mod 8`, then added pairwise:
//! `((s0+s4)+(s2+s6))+((s1+s5)+(s3+s7))`, which the compiler vectorises without changing a bit),
//! and `y = e / s`. The composition it replaces (max, subtract, exp, sum, divide: five nodes)
//! read and wrote the whole `[B, H, T, T]` score tensor five times and saved three of them for
//! the backward; the backward now reads only `y`.
//!
//! The interpreter and the compiled executor both run this kernel, so they agree bit for bit; f32
//! rows run it directly, bf16 rows in f32 rounded once at the end, f64 rows through candle's ops
//! in the same order (max, subtract, exp, sum, divide).

use candle_core::{CpuStorage, DType as CDType, Device, Tensor};
use rayon::prelude::*;

use crate::expf;

/// Rows are split over the current rayon pool when the tensor has at least this many elements
/// (as the fused elementwise groups, [`crate::fusion`]).
const PARALLEL_MIN: usize = 1 << 18;

/// Softmax of `x` over `axis`.
///
/// # Errors
/// candle's, for an axis out of range or a dtype other than f32, bf16 and f64.
pub fn softmax(x: &Tensor, axis: usize) -> candle_core::Result<Tensor> {
    let last = x.rank().saturating_sub(1);
    if axis != last {
        // Move the axis last, compute, and move it back (a view).
        let moved = x.transpose(axis, last)?;
        return softmax(&moved, last)?.transpose(axis, last);
    }
    match x.dtype() {
        CDType::F32 => rows_f32(x),
        CDType::BF16 => rows_f32(&x.to_dtype(CDType::F32)?)?.to_dtype(CDType::BF16),
        _ => {
            let m = x.max_keepdim(axis)?;
            let e = x.broadcast_sub(&m)?.exp()?;
            let s = e.sum_keepdim(axis)?;
            e.broadcast_div(&s)
        }
    }
}

/// [`softmax`] over the last axis of an f32 tensor.
fn rows_f32(x: &Tensor) -> candle_core::Result<Tensor> {
    let n = x.dims().last().copied().unwrap_or(1);
    let x = x.contiguous()?;
    let (storage, layout) = x.storage_and_layout();
    let candle_core::Storage::Cpu(CpuStorage::F32(data)) = &*storage else {
        candle_core::bail!("softmax rows take a CPU f32 tensor")
    };
    let data = &data[layout.start_offset()..layout.start_offset() + x.elem_count()];
    let mut out = vec![0f32; data.len()];
    // Parts of whole rows, about a quarter of `PARALLEL_MIN` elements each.
    match (PARALLEL_MIN / 4).checked_div(n) {
        Some(r) if data.len() >= PARALLEL_MIN && rayon::current_num_threads() > 1 => {
            let per = r.max(1) * n;
            out.par_chunks_mut(per).zip(data.par_chunks(per)).for_each(|(y, x)| rows(x, n, y));
        }
        Some(_) => rows(data, n, &mut out),
        None => {}
    }
    Tensor::from_vec(out, x.dims(), &Device::Cpu)
}

/// Elements of the rows whose exponent is taken in one call (at least one row).
const BLOCK: usize = 1024;

/// Softmax of each row of `n` elements of `x` into `y` (module doc). `x.len()` is a multiple of
/// `n`, equal to `y.len()`. Rows go in blocks of about [`BLOCK`] elements: their `x − m` into a
/// buffer, one exponent call over the block into `y`, then each row's sum and division.
pub fn rows(x: &[f32], n: usize, y: &mut [f32]) {
    debug_assert_eq!(x.len(), y.len());
    if n == 0 {
        return;
    }
    let per = (BLOCK / n).max(1) * n;
    let mut z = vec![0f32; per.min(x.len())];
    for (xb, yb) in x.chunks(per).zip(y.chunks_mut(per)) {
        let z = &mut z[..xb.len()];
        for (xr, zr) in xb.chunks_exact(n).zip(z.chunks_exact_mut(n)) {
            let m = max(xr);
            for (v, &a) in zr.iter_mut().zip(xr) {
                *v = a - m;
            }
        }
        expf::exp_slice(z, yb, false);
        for yr in yb.chunks_exact_mut(n) {
            let s = sum(yr);
            for v in yr.iter_mut() {
                *v /= s;
            }
        }
    }
}

/// The largest element of `v`, ignoring NaN (−∞ if all are NaN): eight running maxima, then
/// theirs. A maximum is exact, so the order only decides between −0.0 and +0.0, which give the
/// same `e^(x − m)`.
fn max(v: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 8];
    let mut chunks = v.chunks_exact(8);
    for c in &mut chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a = a.max(x);
        }
    }
    for (a, &x) in acc.iter_mut().zip(chunks.remainder()) {
        *a = a.max(x);
    }
    acc.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// `Σ v` in the fixed order of the module doc.
fn sum(v: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let mut chunks = v.chunks_exact(8);
    for c in &mut chunks {
        for (a, &x) in acc.iter_mut().zip(c) {
            *a += x;
        }
    }
    for (a, &x) in acc.iter_mut().zip(chunks.remainder()) {
        *a += x;
    }
    ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Softmax in f64 of one row, the oracle.
    fn oracle(x: &[f32]) -> Vec<f64> {
        let m = x.iter().map(|&v| f64::from(v)).fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = x.iter().map(|&v| (f64::from(v) - m).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|v| v / s).collect()
    }

    fn row(n: usize, seed: u32) -> Vec<f32> {
        (0..n).map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 97.0 - 5.0).collect()
    }

    #[test]
    fn rows_match_the_f64_softmax() {
        for n in [1, 3, 8, 13, 64, 300] {
            let x = row(n, 7);
            let mut y = vec![0f32; n];
            rows(&x, n, &mut y);
            for (i, (&got, want)) in y.iter().zip(oracle(&x)).enumerate() {
                assert!(
                    (f64::from(got) - want).abs() <= 1e-6 * want.max(1e-30),
                    "n={n} i={i}: {got} vs {want}"
                );
            }
            let total: f32 = y.iter().sum();
            assert!((total - 1.0).abs() < 1e-5, "n={n}: Σ = {total}");
        }
    }

    #[test]
    fn masked_entries_are_zero_and_nan_spreads() {
        let x = [1.0, -1e9, 2.0, -1e9];
        let mut y = [9f32; 4];
        rows(&x, 4, &mut y);
        assert_eq!((y[1], y[3]), (0.0, 0.0));
        assert!((y[0] + y[2] - 1.0).abs() < 1e-6 && y[2] > y[0]);
        let mut z = [0f32; 3];
        rows(&[0.0, f32::NAN, 1.0], 3, &mut z);
        assert!(z.iter().all(|v| v.is_nan()), "{z:?}");
    }

    #[test]
    fn any_axis_and_dtype_agree_with_candle() {
        let x = Tensor::from_vec(row(2 * 5 * 7, 3), (2, 5, 7), &Device::Cpu).unwrap();
        for axis in 0..3 {
            for dtype in [CDType::F32, CDType::F64, CDType::BF16] {
                // The f64 softmax of the same (rounded) input.
                let input = x.to_dtype(dtype).unwrap();
                let reference = {
                    let x = input.to_dtype(CDType::F64).unwrap();
                    let e = x.broadcast_sub(&x.max_keepdim(axis).unwrap()).unwrap().exp().unwrap();
                    e.broadcast_div(&e.sum_keepdim(axis).unwrap()).unwrap()
                };
                let got = softmax(&input, axis).unwrap();
                assert_eq!(got.dims(), x.dims());
                let diff = (got.to_dtype(CDType::F64).unwrap() - &reference).unwrap().abs().unwrap();
                let worst = diff.flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap();
                let tol = if dtype == CDType::BF16 { 4e-3 } else { 1e-7 };
                assert!(worst <= tol, "axis {axis} {dtype:?}: {worst}");
            }
        }
    }

    #[test]
    fn split_rows_give_the_same_bits() {
        let n = 64;
        let x = row(PARALLEL_MIN + 5 * n, 11);
        let t = Tensor::from_vec(x.clone(), (x.len() / n, n), &Device::Cpu).unwrap();
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        let split = pool.install(|| softmax(&t, 1)).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let mut whole = vec![0f32; x.len()];
        rows(&x, n, &mut whole);
        assert!(split.iter().zip(&whole).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}
