//! The softmax kernels ([`graphpp_graph::Op::Softmax`], [`graphpp_graph::Op::SoftmaxBackward`],
//! [`graphpp_graph::Op::LogSoftmax`], [`graphpp_graph::Op::LogSoftmaxBackward`]), one row at a
//! time: each reduction fused with the elementwise chain around it.
//!
//! Each row of `n` elements along the axis is finished in L1, a block of rows at a time: for the
//! softmax, `z = scale · x + mask`, `m = max z` (NaN-ignoring, so a row holding NaN gives NaN
//! below), `e = exp(z − m)` with the C library's `expf` bits ([`crate::kernels::expf`], four lanes at a
//! time), `s = Σ e` in a fixed order (eight interleaved partial sums, element `i` into sum
//! `i mod 8`, then added pairwise: `((s0+s4)+(s2+s6))+((s1+s5)+(s3+s7))`, which the compiler
//! vectorises without changing a bit), and `y = e / s`; the log-softmax ends with
//! `y = (z − m) − ln s`. The attention composition it replaces (scale, add the mask, max,
//! subtract, exp, sum, divide) read and wrote the whole `[B, H, T, T]` score tensor several times
//! and saved three of them for the backward; the backward kernels read only `y`.
//!
//! The interpreter and the compiled executor both run these kernels, so they agree bit for bit;
//! f32 rows run them directly, bf16 rows in f32 rounded once at the end, f64 rows through
//! candle's ops in the same order.

use candle_core::{DType as CDType, Device, Tensor};
use rayon::prelude::*;

use crate::kernels::device::composed;
use crate::kernels::expf;
use crate::kernels::tensor::{cast, read_f32};

/// Rows are split over the current rayon pool when the tensor has at least this many elements
/// (as the fused elementwise groups, [`crate::exec::fusion`]).
const PARALLEL_MIN: usize = 1 << 18;

/// Softmax of `scale · x + mask` over `axis` ([`graphpp_graph::Op::Softmax`]); the mask
/// broadcasts to x's shape. f32 (and bf16, in f32) one row at a time; f64, and every operand
/// [`composed`] names, through candle.
///
/// # Errors
/// candle's, for an axis out of range, a mask that does not broadcast, or a dtype other than
/// f32, bf16 and f64.
pub fn softmax(x: &Tensor, mask: Option<&Tensor>, axis: usize, scale: f64) -> candle_core::Result<Tensor> {
    if x.dims().get(axis) == Some(&0) {
        return x.zeros_like();
    }
    let last = x.rank().saturating_sub(1);
    if axis != last {
        // Move the axis last (the mask broadcast to x's shape with it), compute, move it back.
        let mask = mask.map(|m| m.broadcast_as(x.shape())?.transpose(axis, last)).transpose()?;
        return softmax(&x.transpose(axis, last)?, mask.as_ref(), last, scale)?.transpose(axis, last);
    }
    match x.dtype() {
        CDType::BF16 => {
            let mask = mask.map(|m| cast(m, CDType::F32)).transpose()?;
            cast(&softmax(&cast(x, CDType::F32)?, mask.as_ref(), axis, scale)?, CDType::BF16)
        }
        CDType::F32 if !composed(x) => rows_f32(x, mask, scale),
        _ => {
            let z = x.affine(scale, 0.0)?;
            let z = match mask {
                Some(m) => z.broadcast_add(&m.to_dtype(z.dtype())?)?,
                None => z,
            };
            let e = z.broadcast_sub(&z.max_keepdim(axis)?)?.exp()?;
            let s = e.sum_keepdim(axis)?;
            e.broadcast_div(&s)
        }
    }
}

/// `scale · y ⊙ (g − Σ_axis g ⊙ y)` ([`graphpp_graph::Op::SoftmaxBackward`]): f32 (and bf16, in
/// f32) one row at a time, the sum in the order of [`softmax`]'s; f64, and every operand [`composed`] names, through candle.
///
/// # Errors
/// candle's, for an axis out of range, shapes that differ or another dtype.
pub fn softmax_backward(y: &Tensor, g: &Tensor, axis: usize, scale: f64) -> candle_core::Result<Tensor> {
    let last = y.rank().saturating_sub(1);
    if axis != last {
        let (y, g) = (y.transpose(axis, last)?, g.transpose(axis, last)?);
        return softmax_backward(&y, &g, last, scale)?.transpose(axis, last);
    }
    match y.dtype() {
        CDType::BF16 => {
            let (y32, g32) = (cast(y, CDType::F32)?, cast(g, CDType::F32)?);
            cast(&softmax_backward(&y32, &g32, axis, scale)?, CDType::BF16)
        }
        CDType::F32 if !composed(y) => backward_f32(y, g, scale),
        _ => {
            let s = (g * y)?.sum_keepdim(axis)?;
            (y * g.broadcast_sub(&s)?)?.affine(scale, 0.0)
        }
    }
}

/// Log-softmax of `x` over `axis` ([`graphpp_graph::Op::LogSoftmax`]): `z − ln Σ e^z` with
/// `z = x − max x`, f32 (and bf16, in f32) one row at a time — max, exponent and sum as
/// [`softmax`]'s, then `ln` of the sum once a row —; f64, and every operand [`composed`] names, through candle.
///
/// # Errors
/// candle's, for an axis out of range or another dtype.
pub fn log_softmax(x: &Tensor, axis: usize) -> candle_core::Result<Tensor> {
    if x.dims().get(axis) == Some(&0) {
        return x.zeros_like();
    }
    let last = x.rank().saturating_sub(1);
    if axis != last {
        return log_softmax(&x.transpose(axis, last)?, last)?.transpose(axis, last);
    }
    match x.dtype() {
        CDType::BF16 => cast(&log_softmax(&cast(x, CDType::F32)?, axis)?, CDType::BF16),
        CDType::F32 if !composed(x) => map_rows(x, |_, x, n, y| log_rows(x, n, y)),
        _ => {
            let z = x.broadcast_sub(&x.max_keepdim(axis)?)?;
            let lse = z.exp()?.sum_keepdim(axis)?.log()?;
            z.broadcast_sub(&lse)
        }
    }
}

/// `g − e^y ⊙ Σ_axis g` ([`graphpp_graph::Op::LogSoftmaxBackward`]), f32 (and bf16, in f32) one
/// row at a time, the sum in the fixed order of the module doc; f64, and every operand [`composed`] names, through candle.
///
/// # Errors
/// candle's, for an axis out of range, shapes that differ or another dtype.
pub fn log_softmax_backward(y: &Tensor, g: &Tensor, axis: usize) -> candle_core::Result<Tensor> {
    let last = y.rank().saturating_sub(1);
    if axis != last {
        let (y, g) = (y.transpose(axis, last)?, g.transpose(axis, last)?);
        return log_softmax_backward(&y, &g, last)?.transpose(axis, last);
    }
    match y.dtype() {
        CDType::F32 if !composed(y) => pair_rows(y, g, log_backward_rows),
        CDType::BF16 => {
            let (y32, g32) = (cast(y, CDType::F32)?, cast(g, CDType::F32)?);
            cast(&log_softmax_backward(&y32, &g32, axis)?, CDType::BF16)
        }
        _ => g.broadcast_sub(&y.exp()?.broadcast_mul(&g.sum_keepdim(axis)?)?),
    }
}

/// Log-softmax of each row of `n` elements of `x` into `y`, in blocks as [`rows`].
fn log_rows(x: &[f32], n: usize, y: &mut [f32]) {
    if n == 0 {
        return;
    }
    let per = (BLOCK / n).max(1) * n;
    let mut e = vec![0f32; per.min(x.len())];
    for (xb, yb) in x.chunks(per).zip(y.chunks_mut(per)) {
        for (xr, yr) in xb.chunks_exact(n).zip(yb.chunks_exact_mut(n)) {
            let m = max(xr);
            for (v, &a) in yr.iter_mut().zip(xr) {
                *v = a - m;
            }
        }
        let e = &mut e[..xb.len()];
        expf::exp_slice(yb, e, false);
        for (yr, er) in yb.chunks_exact_mut(n).zip(e.chunks_exact(n)) {
            let l = sum(er).ln();
            for v in yr.iter_mut() {
                *v -= l;
            }
        }
    }
}

/// `dx = g − e^y ⊙ Σ g` per row of `n` elements (the exponent in blocks as [`rows`]).
fn log_backward_rows(y: &[f32], g: &[f32], n: usize, dx: &mut [f32]) {
    if n == 0 {
        return;
    }
    let per = (BLOCK / n).max(1) * n;
    for ((yb, gb), db) in y.chunks(per).zip(g.chunks(per)).zip(dx.chunks_mut(per)) {
        expf::exp_slice(yb, db, false);
        for (gr, dr) in gb.chunks_exact(n).zip(db.chunks_exact_mut(n)) {
            let s = sum(gr);
            for (d, &b) in dr.iter_mut().zip(gr) {
                *d = b - *d * s;
            }
        }
    }
}

/// A contiguous f32 tensor's elements, copied.
fn f32s(t: &Tensor) -> candle_core::Result<Vec<f32>> {
    t.flatten_all()?.to_vec1::<f32>()
}

/// The mask's rows as `rows` reads them, for x of `dims`: the mask itself where it is
/// contiguous and its dims (leading 1s dropped) end x's dims — row r of x then reads mask row
/// `r mod (mask rows)` (attention's `[T, T]` causal mask under `[B, H, T, T]` scores) — else
/// the mask broadcast to x's shape and copied.
fn mask_rows(mask: &Tensor, dims: &[usize]) -> candle_core::Result<Vec<f32>> {
    let md = mask.dims();
    let lead = md.iter().take_while(|&&d| d == 1).count();
    let own = &md[lead..];
    let suffix = !own.is_empty() && own.len() <= dims.len() && own == &dims[dims.len() - own.len()..];
    if suffix {
        f32s(&mask.contiguous()?)
    } else {
        f32s(&mask.broadcast_as(dims)?.contiguous()?)
    }
}

/// `f(first_row, x_part, out_part)` over whole rows of `n` elements: in parts of about a quarter
/// of [`PARALLEL_MIN`] elements over the current rayon pool when there are at least that many
/// and the pool has two threads or more, else at once.
fn by_rows(x: &[f32], n: usize, out: &mut [f32], f: impl Fn(usize, &[f32], &mut [f32]) + Sync) {
    match (PARALLEL_MIN / 4).checked_div(n) {
        Some(r) if x.len() >= PARALLEL_MIN && rayon::current_num_threads() > 1 => {
            let per = r.max(1) * n;
            out.par_chunks_mut(per)
                .zip(x.par_chunks(per))
                .enumerate()
                .for_each(|(i, (o, x))| f(i * per / n, x, o));
        }
        Some(_) => f(0, x, out),
        None => {}
    }
}

/// [`softmax`] over the last axis of an f32 tensor.
fn rows_f32(x: &Tensor, mask: Option<&Tensor>, scale: f64) -> candle_core::Result<Tensor> {
    let mask = mask.map(|m| mask_rows(m, x.dims())).transpose()?;
    let scale = scale as f32;
    map_rows(x, |first, x, n, y| rows(first, x, mask.as_deref(), n, scale, y))
}

/// [`softmax_backward`] over the last axis of f32 tensors.
fn backward_f32(y: &Tensor, g: &Tensor, scale: f64) -> candle_core::Result<Tensor> {
    let scale = scale as f32;
    pair_rows(y, g, |y, g, n, dx| backward_rows(y, g, n, scale, dx))
}

/// `f(first_row, x_rows, n, out_rows)` over the last-axis rows of an f32 tensor (split as
/// [`by_rows`]) into a new tensor of its shape.
fn map_rows(x: &Tensor, f: impl Fn(usize, &[f32], usize, &mut [f32]) + Sync) -> candle_core::Result<Tensor> {
    let n = x.dims().last().copied().unwrap_or(1);
    let out = read_f32(x, |data| {
        let mut out = vec![0f32; data.len()];
        by_rows(data, n, &mut out, |first, x, y| f(first, x, n, y));
        out
    })?;
    Tensor::from_vec(out, x.dims(), &Device::Cpu)
}

/// `f(y_rows, g_rows, n, out_rows)` over the last-axis rows of two f32 tensors of one shape
/// (split as [`by_rows`]) into a new tensor of that shape.
fn pair_rows(
    y: &Tensor,
    g: &Tensor,
    f: impl Fn(&[f32], &[f32], usize, &mut [f32]) + Sync,
) -> candle_core::Result<Tensor> {
    if y.dims() != g.dims() {
        candle_core::bail!("softmax backward: y {:?} and g {:?} differ", y.dims(), g.dims())
    }
    let n = y.dims().last().copied().unwrap_or(1);
    let out = read_f32(y, |yv| {
        read_f32(g, |gv| {
            let mut out = vec![0f32; yv.len()];
            by_rows(yv, n, &mut out, |first, y, dx| f(y, &gv[first * n..first * n + y.len()], n, dx));
            out
        })
    })??;
    Tensor::from_vec(out, y.dims(), &Device::Cpu)
}

/// `dx = scale · y ⊙ (g − s)` with `s = Σ g ⊙ y` per row of `n` elements (the sum in
/// [`sum`]'s order).
fn backward_rows(y: &[f32], g: &[f32], n: usize, scale: f32, dx: &mut [f32]) {
    for ((yr, gr), dr) in y.chunks_exact(n).zip(g.chunks_exact(n)).zip(dx.chunks_exact_mut(n)) {
        for ((d, &a), &b) in dr.iter_mut().zip(yr).zip(gr) {
            *d = b * a;
        }
        let s = sum(dr);
        for ((d, &a), &b) in dr.iter_mut().zip(yr).zip(gr) {
            *d = scale * (a * (b - s));
        }
    }
}

/// Elements of the rows whose exponent is taken in one call (at least one row).
const BLOCK: usize = 1024;

/// Softmax of `scale · x + mask` for each row of `n` elements of `x` into `y` (module doc);
/// `x` starts at row `first` of the tensor, whose row r reads mask row `r mod (mask rows)`.
/// `x.len()` is a multiple of `n`, equal to `y.len()`. Rows go in blocks of about [`BLOCK`]
/// elements: their `z − m` into a buffer, one exponent call over the block into `y`, then each
/// row's sum and division.
fn rows(first: usize, x: &[f32], mask: Option<&[f32]>, n: usize, scale: f32, y: &mut [f32]) {
    debug_assert_eq!(x.len(), y.len());
    if n == 0 {
        return;
    }
    let mask_rows = mask.map_or(1, |m| (m.len() / n).max(1));
    let per = (BLOCK / n).max(1) * n;
    let mut z = vec![0f32; per.min(x.len())];
    for (b, (xb, yb)) in x.chunks(per).zip(y.chunks_mut(per)).enumerate() {
        let z = &mut z[..xb.len()];
        for (j, (xr, zr)) in xb.chunks_exact(n).zip(z.chunks_exact_mut(n)).enumerate() {
            match mask {
                Some(mask) => {
                    let r = (first + b * per / n + j) % mask_rows;
                    for ((v, &a), &c) in zr.iter_mut().zip(xr).zip(&mask[r * n..r * n + n]) {
                        *v = a * scale + c;
                    }
                }
                None => {
                    for (v, &a) in zr.iter_mut().zip(xr) {
                        *v = a * scale;
                    }
                }
            }
            let m = max(zr);
            for v in zr.iter_mut() {
                *v -= m;
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
pub(crate) fn max(v: &[f32]) -> f32 {
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
pub(crate) fn sum(v: &[f32]) -> f32 {
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
            rows(0, &x, None, n, 1.0, &mut y);
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
        rows(0, &x, None, 4, 1.0, &mut y);
        assert_eq!((y[1], y[3]), (0.0, 0.0));
        assert!((y[0] + y[2] - 1.0).abs() < 1e-6 && y[2] > y[0]);
        let mut z = [0f32; 3];
        rows(0, &[0.0, f32::NAN, 1.0], None, 3, 1.0, &mut z);
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
                let got = softmax(&input, None, axis, 1.0).unwrap();
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
        // Rows of a [B, T, n] tensor under a [T, n] mask: each part of a split must read the mask
        // rows of its own first row.
        let (t, n) = (7, 64);
        let b = PARALLEL_MIN / (t * n) + 5;
        let x = row(b * t * n, 11);
        let xt = Tensor::from_vec(x.clone(), (b, t, n), &Device::Cpu).unwrap();
        let m = row(t * n, 2);
        let mt = Tensor::from_vec(m.clone(), (t, n), &Device::Cpu).unwrap();
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        for mask in [None, Some(&mt)] {
            let split = f32s(&pool.install(|| softmax(&xt, mask, 2, 0.5)).unwrap()).unwrap();
            let mut whole = vec![0f32; x.len()];
            rows(0, &x, mask.map(|_| m.as_slice()), n, 0.5, &mut whole);
            assert!(
                split.iter().zip(&whole).all(|(a, b)| a.to_bits() == b.to_bits()),
                "mask {}",
                mask.is_some()
            );
        }
    }

    /// `scale · x + mask` against the f64 softmax of the same; a `[T, T]` mask under `[B, H, T,
    /// T]` scores (read row by row, periodically) against the same mask broadcast and copied
    /// (through a non-last axis).
    #[test]
    fn scale_and_mask_as_the_f64_softmax_does() {
        let (b, h, t) = (2, 3, 5);
        let x = Tensor::from_vec(row(b * h * t * t, 5), (b, h, t, t), &Device::Cpu).unwrap();
        let causal: Vec<f32> =
            (0..t * t).map(|i| if i % t > i / t { -1e9 } else { (i % 3) as f32 * 0.25 }).collect();
        let mask = Tensor::from_vec(causal, (t, t), &Device::Cpu).unwrap();
        let got = softmax(&x, Some(&mask), 3, 0.5).unwrap();
        let want = {
            let z = x.to_dtype(CDType::F64).unwrap().affine(0.5, 0.0).unwrap();
            let z = z.broadcast_add(&mask.to_dtype(CDType::F64).unwrap()).unwrap();
            let e = z.broadcast_sub(&z.max_keepdim(3).unwrap()).unwrap().exp().unwrap();
            e.broadcast_div(&e.sum_keepdim(3).unwrap()).unwrap()
        };
        let diff = (got.to_dtype(CDType::F64).unwrap() - &want).unwrap().abs().unwrap();
        assert!(diff.flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap() < 1e-7);
        // Masked entries are exactly 0.
        let g = f32s(&got).unwrap();
        assert!(g
            .chunks(t)
            .enumerate()
            .all(|(r, row)| row.iter().enumerate().all(|(c, &v)| c <= r % t || v == 0.0)));
        // Through axis 2 of the transposed scores, the mask transposed too: a copied mask.
        let xt = x.transpose(2, 3).unwrap();
        let mt = mask.t().unwrap();
        let other = softmax(&xt, Some(&mt), 2, 0.5).unwrap().transpose(2, 3).unwrap();
        assert_eq!(f32s(&other.contiguous().unwrap()).unwrap(), f32s(&got).unwrap());
    }

    /// `rows × n` inputs and output gradients, as values and as `[rows, n]` tensors.
    fn inputs_and_grads(rows: usize, n: usize, seeds: (u32, u32)) -> (Vec<f32>, Vec<f32>, Tensor, Tensor) {
        let (x, g) = (row(rows * n, seeds.0), row(rows * n, seeds.1));
        let dev = &Device::Cpu;
        let (xt, gt) = (
            Tensor::from_vec(x.clone(), (rows, n), dev).unwrap(),
            Tensor::from_vec(g.clone(), (rows, n), dev).unwrap(),
        );
        (x, g, xt, gt)
    }

    /// The backward kernel against `scale · y ⊙ (g − Σ g ⊙ y)` in f64 (the formula itself is
    /// checked against finite differences by `tests/vjp_fd.rs`).
    #[test]
    fn backward_is_the_softmax_vjp() {
        let n = 7;
        let (_, g, xt, gt) = inputs_and_grads(3, n, (9, 4));
        let y = softmax(&xt, None, 1, 0.5).unwrap();
        let dx = f32s(&softmax_backward(&y, &gt, 1, 0.5).unwrap()).unwrap();
        let yv = f32s(&y).unwrap();
        for r in 0..3 {
            let (yr, gr) = (&yv[r * n..r * n + n], &g[r * n..r * n + n]);
            let s: f64 = yr.iter().zip(gr).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum();
            for (i, (&a, &b)) in yr.iter().zip(gr).enumerate() {
                let want = 0.5 * f64::from(a) * (f64::from(b) - s);
                assert!((f64::from(dx[r * n + i]) - want).abs() < 1e-6, "row {r} col {i}");
            }
        }
    }

    /// Log-softmax against the f64 one, and its backward against `g − softmax · Σ g` in f64.
    #[test]
    fn log_softmax_and_its_backward() {
        let n = 37;
        let (x, g, xt, gt) = inputs_and_grads(4, n, (13, 6));
        let y = log_softmax(&xt, 1).unwrap();
        let yv = f32s(&y).unwrap();
        let dx = f32s(&log_softmax_backward(&y, &gt, 1).unwrap()).unwrap();
        for r in 0..4 {
            let want = oracle(&x[r * n..r * n + n]);
            let gs: f64 = g[r * n..r * n + n].iter().map(|&v| f64::from(v)).sum();
            for (i, p) in want.iter().enumerate() {
                let k = r * n + i;
                assert!((f64::from(yv[k]) - p.ln()).abs() < 2e-6, "y row {r} col {i}");
                let d = f64::from(g[k]) - p * gs;
                assert!((f64::from(dx[k]) - d).abs() < 1e-5, "dx row {r} col {i}");
            }
        }
        // Axis 0 (moved last and back) and f64 agree with the f32 rows.
        let t = log_softmax(&xt.t().unwrap().contiguous().unwrap(), 0).unwrap().t().unwrap();
        assert_eq!(f32s(&t.contiguous().unwrap()).unwrap(), yv);
        let y64 = log_softmax(&xt.to_dtype(CDType::F64).unwrap(), 1).unwrap();
        let d64 = (y64 - y.to_dtype(CDType::F64).unwrap()).unwrap().abs().unwrap();
        assert!(d64.flatten_all().unwrap().max(0).unwrap().to_scalar::<f64>().unwrap() < 2e-6);
    }
}
