//! Self-attention in one kernel ([`graphpp_graph::Op::Attention`]) and its backward
//! ([`graphpp_graph::Op::AttentionBackward`]), blocked after FlashAttention-2 (Dao 2023,
//! Algorithms 1 and 2; query tiles outermost), the backward recomputing each row's maximum and
//! sum instead of saving the log-sum-exp (issue 11 item 1).
//!
//! Shapes: q, k, v, o and g `[B, H, T, E]`, the additive mask `[T, T]`; each (batch, head) is
//! one task, split over the current rayon pool (the results do not depend on the split). Operands are read in place on their strides where their columns
//! are contiguous (heads split from `[B, T, H, E]`: rows `H · E` apart; gemm's sums do not
//! depend on the row stride, so the bits are their copies'), else copied first.
//!
//! **Forward** (f32): per tile of [`BQ`] query rows, the keys a tile of [`BK`] at a time:
//! `S = q kᵀ` by gemm into a `BQ × BK` scratch, `z = scale · S + mask`, the running row maximum
//! `m` and sum `l` of `e^(z − m)` rescaled by `e^(m_old − m)` when the maximum grows (the online
//! softmax, Milakov & Gimelshein 2018), and the output rows `acc += e^(z − m) v` rescaled
//! alike; at the end `o = acc / l`. No more than one `BQ × BK` tile of the scores (and one of
//! their exponentials) exists at a time per task: the `[B, H, T, T]` probabilities are never held, in the forward or saved for
//! the backward.
//!
//! **Backward** (f32): per query tile, the scores of its live key tiles again (one `BQ × T` row
//! block per task), their softmax `P` in two passes (max, then sum), `D = rowsum(g ⊙ o)`, and
//! per key tile `dv += Pᵀ g`, `dP = g vᵀ`, `dS = scale · P ⊙ (dP − D)`, `dq += dS k`,
//! `dk += dSᵀ q`. Five products per tile where the saved-probabilities backward did four.
//!
//! **Masked tiles.** A key tile whose mask entries for a query tile are all at or below
//! [`HIDDEN`] is skipped: its `e^(z − m)` are exact zeros in f32 whenever the row sees some key
//! (the causal mask's −1e9 under a finite row maximum: below −104 `e^x` rounds to +0.0), so
//! skipping changes no bit of the sums while halving the causal work at long `T` — for finite
//! q, k, v (a NaN or ∞ at a hidden key reaches the composition's output through `0 · ∞`, not the
//! kernel's) and visible scores more than ~104 above the hidden ones. A query tile with a row
//! that sees no key keeps every key tile (its softmax is over all keys, as the composition's).
//!
//! Other dtypes (bf16, f64) run the composition — `q kᵀ`, softmax in the wide dtype
//! ([`crate::softmax`]), `P v` — which is also the reference the f32 kernels are tested
//! against (`tests` below); `tests/vjp_fd.rs` checks that composition's gradients (f64) by
//! finite differences.

use candle_core::{DType as CDType, Device, Tensor};
use rayon::prelude::*;

use crate::softmax::{max, softmax, softmax_backward, sum};

/// Query rows per tile.
pub const BQ: usize = 128;
/// Keys per tile.
pub const BK: usize = 128;
/// A mask entry at or below this hides its key (graphpp's causal mask is −1e9).
pub const HIDDEN: f32 = -1e8;

/// `softmax(scale · q kᵀ + mask) v` ([`graphpp_graph::Op::Attention`]): q, k, v `[B, H, T, E]`,
/// mask `[T, T]` of q's wide dtype → `[B, H, T, E]`.
///
/// # Errors
/// candle's, for shapes other than those or a dtype other than f32, bf16 and f64.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    scale: f64,
) -> candle_core::Result<Tensor> {
    let sizes = Sizes::of(q, k, v, mask)?;
    if q.dtype() != CDType::F32 {
        return composition(q, k, v, mask, scale);
    }
    let held = Held::of(&[q, k, v, &mask.reshape((1, 1, sizes.t, sizes.t))?])?;
    let te = sizes.t * sizes.e;
    let mut out = vec![0f32; sizes.b * sizes.h * te];
    held.with(|x| {
        let (q, k, v, mask) = (x[0], x[1], x[2], x[3].head(0));
        let live = Live::of(mask, sizes.t);
        // One task per (batch, head) over the pool (on a one-thread pool, in turn).
        out.par_chunks_mut(te.max(1)).enumerate().for_each(|(bh, o)| {
            forward_head([q.head(bh), k.head(bh), v.head(bh)], mask, &live, sizes, scale as f32, o)
        });
    })?;
    Tensor::from_vec(out, sizes.dims(), &Device::Cpu)
}

/// The gradients of q, k and v stacked `[3, B, H, T, E]`
/// ([`graphpp_graph::Op::AttentionBackward`]) of the [`attention`] with output `o` and output
/// gradient `g` (both `[B, H, T, E]`).
///
/// # Errors
/// candle's, for shapes other than those or a dtype other than f32, bf16 and f64.
pub fn attention_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    o: &Tensor,
    g: &Tensor,
    scale: f64,
) -> candle_core::Result<Tensor> {
    let sizes = Sizes::of(q, k, v, mask)?;
    if o.dims() != q.dims() || g.dims() != q.dims() {
        candle_core::bail!(
            "attention backward: o {:?} and g {:?} must be q's {:?}",
            o.dims(),
            g.dims(),
            q.dims()
        )
    }
    if q.dtype() != CDType::F32 {
        return composition_backward(q, k, v, mask, g, scale);
    }
    let held = Held::of(&[q, k, v, o, g, &mask.reshape((1, 1, sizes.t, sizes.t))?])?;
    let te = sizes.t * sizes.e;
    let len = sizes.b * sizes.h * te;
    let mut out = vec![0f32; 3 * len];
    held.with(|x| {
        let (q, k, v, o, g, mask) = (x[0], x[1], x[2], x[3], x[4], x[5].head(0));
        let live = Live::of(mask, sizes.t);
        let (dq, rest) = out.split_at_mut(len);
        let (dk, dv) = rest.split_at_mut(len);
        let n = te.max(1);
        let parts = dq.par_chunks_mut(n).zip(dk.par_chunks_mut(n).zip(dv.par_chunks_mut(n)));
        parts.enumerate().for_each(|(bh, (dq, (dk, dv)))| {
            let head = Head { q: q.head(bh), k: k.head(bh), v: v.head(bh), o: o.head(bh), g: g.head(bh) };
            backward_head(head, mask, &live, sizes, scale as f32, Grads { dq, dk, dv })
        });
    })?;
    let dims: Vec<usize> = [3].into_iter().chain(sizes.dims()).collect();
    Tensor::from_vec(out, dims, &Device::Cpu)
}

/// Static sizes of one call: `bh = B · H` tasks of `t` rows of `e` features.
#[derive(Clone, Copy, Debug)]
struct Sizes {
    b: usize,
    h: usize,
    t: usize,
    e: usize,
}

impl Sizes {
    fn of(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> candle_core::Result<Sizes> {
        let &[b, h, t, e] = q.dims() else {
            candle_core::bail!("attention: q must be [B, H, T, E], got {:?}", q.dims())
        };
        if k.dims() != q.dims() || v.dims() != q.dims() || mask.dims() != [t, t] {
            candle_core::bail!(
                "attention: q {:?}, k {:?}, v {:?} must match and the mask {:?} be [{t}, {t}]",
                q.dims(),
                k.dims(),
                v.dims(),
                mask.dims()
            )
        }
        Ok(Sizes { b, h, t, e })
    }

    /// `[B, H, T, E]`.
    fn dims(&self) -> Vec<usize> {
        vec![self.b, self.h, self.t, self.e]
    }
}

/// f32 operands `[B, H, T, E]` held for reading in place: each as it is where its columns are
/// contiguous (a heads-split view: rows `H · E` apart), else its contiguous copy.
struct Held(Vec<Tensor>);

impl Held {
    fn of(ts: &[&Tensor]) -> candle_core::Result<Held> {
        let own = |t: &&Tensor| if t.stride()[3] == 1 { Ok((*t).clone()) } else { t.contiguous() };
        Ok(Held(ts.iter().map(own).collect::<candle_core::Result<_>>()?))
    }

    /// Runs `f` on the operands' rows, their storage read-locked meanwhile.
    fn with<R>(&self, f: impl FnOnce(&[Rows]) -> R) -> candle_core::Result<R> {
        let guards: Vec<_> = self.0.iter().map(|t| t.storage_and_layout()).collect();
        let rows = guards.iter().zip(&self.0).map(|((storage, layout), t)| Rows::of(storage, layout, t));
        Ok(f(&rows.collect::<candle_core::Result<Vec<_>>>()?))
    }
}

/// One f32 operand `[B, H, T, E]` in its storage: (batch b, head h)'s row r starts at
/// `start + b · sb + h · sh + r · rs`, its E columns contiguous.
#[derive(Clone, Copy)]
struct Rows<'a> {
    data: &'a [f32],
    start: usize,
    sb: usize,
    sh: usize,
    rs: usize,
    heads: usize,
}

impl<'a> Rows<'a> {
    fn of(
        storage: &'a candle_core::Storage,
        layout: &candle_core::Layout,
        t: &Tensor,
    ) -> candle_core::Result<Rows<'a>> {
        let candle_core::Storage::Cpu(candle_core::CpuStorage::F32(data)) = storage else {
            candle_core::bail!("attention: expected a CPU f32 tensor, got {:?}", t.dtype())
        };
        let st = layout.stride();
        Ok(Rows { data, start: layout.start_offset(), sb: st[0], sh: st[1], rs: st[2], heads: t.dims()[1] })
    }

    /// (batch, head) `bh`'s rows.
    fn head(&self, bh: usize) -> View<'a> {
        let at = self.start + (bh / self.heads.max(1)) * self.sb + (bh % self.heads.max(1)) * self.sh;
        View { data: &self.data[at.min(self.data.len())..], rs: self.rs }
    }
}

/// One (batch, head)'s `[T, E]` rows: row r at `data[r · rs..][..E]`.
#[derive(Clone, Copy)]
struct View<'a> {
    data: &'a [f32],
    rs: usize,
}

impl<'a> View<'a> {
    /// The elements from row `r` on.
    fn from(&self, r: usize) -> &'a [f32] {
        &self.data[(r * self.rs).min(self.data.len())..]
    }
}

/// Which (query tile, key tile) pairs the kernels compute (module doc, "Masked tiles").
struct Live {
    keys: usize,
    live: Vec<bool>,
}

impl Live {
    fn of(mask: View, t: usize) -> Live {
        let (queries, keys) = (t.div_ceil(BQ), t.div_ceil(BK));
        let mut live = vec![false; queries * keys];
        let mut sees = vec![false; t];
        for r in 0..t {
            for (c, &m) in mask.from(r)[..t].iter().enumerate() {
                // NaN counts as visible: it reaches the output as the composition's does.
                if m > HIDDEN || m.is_nan() {
                    live[(r / BQ) * keys + c / BK] = true;
                    sees[r] = true;
                }
            }
        }
        for i in 0..queries {
            if sees[i * BQ..((i + 1) * BQ).min(t)].iter().any(|&s| !s) {
                live[i * keys..(i + 1) * keys].fill(true);
            }
        }
        Live { keys, live }
    }

    /// The key tiles `(first key, keys)` query tile `i` computes.
    fn tiles(&self, i: usize, t: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..self.keys)
            .filter(move |&j| self.live[i * self.keys + j])
            .map(move |j| (j * BK, BK.min(t - j * BK)))
    }
}

/// `dst[m × n] (+)= a[m × k] · b[k × n]` on one thread: each operand given with its
/// `(row stride, column stride)`, `dst` with its row stride (columns contiguous), added to when
/// `accumulate`. Panics if an operand's strides reach outside its slice (a bug here, not bad
/// input: [`Sizes::of`] checked the shapes).
#[allow(clippy::too_many_arguments)]
fn product(
    (m, n, k): (usize, usize, usize),
    (dst, dst_rs): (&mut [f32], usize),
    accumulate: bool,
    a: &[f32],
    (a_rs, a_cs): (usize, usize),
    b: &[f32],
    (b_rs, b_cs): (usize, usize),
) {
    if m == 0 || n == 0 {
        return;
    }
    let reach = |rs: usize, cs: usize, rows: usize, cols: usize| (rows - 1) * rs + (cols - 1) * cs + 1;
    assert!(reach(dst_rs, 1, m, n) <= dst.len(), "attention: product destination too short");
    if k == 0 {
        if !accumulate {
            dst.chunks_mut(dst_rs).take(m).for_each(|r| r[..n].fill(0.0));
        }
        return;
    }
    assert!(
        reach(a_rs, a_cs, m, k) <= a.len() && reach(b_rs, b_cs, k, n) <= b.len(),
        "attention: product operand too short"
    );
    // SAFETY: every element gemm reads or writes lies inside its slice (asserted above), and
    // `dst` does not alias `a` or `b` (a `&mut` beside two `&`).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            accumulate,
            a.as_ptr(),
            a_cs as isize,
            a_rs as isize,
            b.as_ptr(),
            b_cs as isize,
            b_rs as isize,
            1f32,
            1f32,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

/// `Σ a ⊙ b` in order.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// One (batch, head) of the forward (module doc): q, k, v `[T, E]` row-major, o its `[T, E]`
/// output.
#[allow(clippy::too_many_arguments)]
fn forward_head([q, k, v]: [View; 3], mask: View, live: &Live, s: Sizes, scale: f32, o: &mut [f32]) {
    let (t, e) = (s.t, s.e);
    let mut z = vec![0f32; BQ.min(t) * BK.min(t)];
    let mut p = z.clone();
    let (mut m, mut l) = ([f32::NEG_INFINITY; BQ], [0f32; BQ]);
    for (i, r0) in (0..t).step_by(BQ).enumerate() {
        let rows = BQ.min(t - r0);
        let acc = &mut o[r0 * e..(r0 + rows) * e];
        acc.fill(0.0);
        m.fill(f32::NEG_INFINITY);
        l.fill(0.0);
        for (c0, cols) in live.tiles(i, t) {
            let (z, p) = (&mut z[..rows * cols], &mut p[..rows * cols]);
            product((rows, cols, e), (z, cols), false, q.from(r0), (q.rs, 1), k.from(c0), (1, k.rs));
            for (r, (zr, pr)) in z.chunks_exact_mut(cols).zip(p.chunks_exact_mut(cols)).enumerate() {
                let mr = &mask.from(r0 + r)[c0..c0 + cols];
                for (x, &a) in zr.iter_mut().zip(mr) {
                    *x = *x * scale + a;
                }
                let top = m[r].max(max(zr));
                // A row that has seen only −∞ so far subtracts 0 (not −∞ − −∞ = NaN): its
                // exponentials are 0 until it sees a key, as in the composition.
                let base = if top == f32::NEG_INFINITY { 0.0 } else { top };
                for x in zr.iter_mut() {
                    *x -= base;
                }
                crate::expf::exp_slice(zr, pr, false);
                // e^(m_old − m_new); 1 while the maximum stands (also −∞ to −∞: nothing seen).
                let shrink = if top == m[r] { 1.0 } else { crate::expf::exp(m[r] - top) };
                l[r] = l[r] * shrink + sum(pr);
                m[r] = top;
                if shrink != 1.0 {
                    acc[r * e..(r + 1) * e].iter_mut().for_each(|x| *x *= shrink);
                }
            }
            product((rows, e, cols), (acc, e), true, p, (cols, 1), v.from(c0), (v.rs, 1));
        }
        for (r, row) in acc.chunks_exact_mut(e.max(1)).enumerate() {
            row.iter_mut().for_each(|x| *x /= l[r]);
        }
    }
}

/// One (batch, head)'s operands, each `[T, E]` row-major.
struct Head<'a> {
    q: View<'a>,
    k: View<'a>,
    v: View<'a>,
    o: View<'a>,
    g: View<'a>,
}

/// One (batch, head)'s gradients, each `[T, E]` row-major.
struct Grads<'a> {
    dq: &'a mut [f32],
    dk: &'a mut [f32],
    dv: &'a mut [f32],
}

/// One (batch, head) of the backward (module doc).
fn backward_head(x: Head, mask: View, live: &Live, s: Sizes, scale: f32, d: Grads) {
    let (t, e) = (s.t, s.e);
    // The softmax of the query tile's row block over its live key tiles (row stride t).
    let mut p = vec![0f32; BQ.min(t) * t];
    let mut z = vec![0f32; BK.min(t)];
    let mut ds = vec![0f32; BQ.min(t) * BK.min(t)];
    for (i, r0) in (0..t).step_by(BQ).enumerate() {
        let rows = BQ.min(t - r0);
        let tiles: Vec<(usize, usize)> = live.tiles(i, t).collect();
        for &(c0, cols) in &tiles {
            product(
                (rows, cols, e),
                (&mut p[c0..], t),
                false,
                x.q.from(r0),
                (x.q.rs, 1),
                x.k.from(c0),
                (1, x.k.rs),
            );
        }
        for (r, row) in p.chunks_exact_mut(t).take(rows).enumerate() {
            let mr = &mask.from(r0 + r)[..t];
            let mut top = f32::NEG_INFINITY;
            for &(c0, cols) in &tiles {
                for (y, &a) in row[c0..c0 + cols].iter_mut().zip(&mr[c0..c0 + cols]) {
                    *y = *y * scale + a;
                }
                top = top.max(max(&row[c0..c0 + cols]));
            }
            let mut total = 0.0;
            for &(c0, cols) in &tiles {
                let (seg, z) = (&mut row[c0..c0 + cols], &mut z[..cols]);
                z.iter_mut().zip(seg.iter()).for_each(|(z, &y)| *z = y - top);
                crate::expf::exp_slice(z, seg, false);
                total += sum(seg);
            }
            for &(c0, cols) in &tiles {
                row[c0..c0 + cols].iter_mut().for_each(|y| *y /= total);
            }
        }
        let gi = x.g.from(r0);
        let big_d: Vec<f32> = (r0..r0 + rows).map(|r| dot(&x.g.from(r)[..e], &x.o.from(r)[..e])).collect();
        for &(c0, cols) in &tiles {
            let pj = &p[c0..];
            product((cols, e, rows), (&mut d.dv[c0 * e..], e), true, pj, (1, t), gi, (x.g.rs, 1));
            let ds = &mut ds[..rows * cols];
            product((rows, cols, e), (ds, cols), false, gi, (x.g.rs, 1), x.v.from(c0), (1, x.v.rs));
            for (r, dr) in ds.chunks_exact_mut(cols).enumerate() {
                for (y, &pv) in dr.iter_mut().zip(&pj[r * t..r * t + cols]) {
                    *y = scale * pv * (*y - big_d[r]);
                }
            }
            product(
                (rows, e, cols),
                (&mut d.dq[r0 * e..], e),
                true,
                ds,
                (cols, 1),
                x.k.from(c0),
                (x.k.rs, 1),
            );
            product(
                (cols, e, rows),
                (&mut d.dk[c0 * e..], e),
                true,
                ds,
                (1, cols),
                x.q.from(r0),
                (x.q.rs, 1),
            );
        }
    }
}

/// The softmax `P = softmax(scale · q kᵀ + mask)` `[B, H, T, T]` in the mask's (wide) dtype, the
/// product in q's.
fn probabilities(q: &Tensor, k: &Tensor, mask: &Tensor, scale: f64) -> candle_core::Result<Tensor> {
    let s = crate::executor::matmul(q, &k.t()?)?;
    softmax(&s.to_dtype(mask.dtype())?, Some(mask), 3, scale)
}

/// [`attention`] as its composition — `q kᵀ`, [`softmax`] in the mask's (wide) dtype, `P v` with
/// `P` cast to q's dtype — holding the `[B, H, T, T]` scores: the reference the kernels are
/// tested against, and what bf16 and f64 run.
///
/// # Errors
/// candle's, for shapes that do not fit.
pub fn composition(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    scale: f64,
) -> candle_core::Result<Tensor> {
    let p = probabilities(q, k, mask, scale)?.to_dtype(q.dtype())?;
    crate::executor::matmul(&p, v)
}

/// [`attention_backward`] as the composition's autodiff gives it: `dv = Pᵀ g`, `dP = g vᵀ`,
/// `dS` the softmax backward of `dP` (in the wide dtype), `dq = dS k`, `dk = dSᵀ q`, stacked
/// `[3, B, H, T, E]`.
///
/// # Errors
/// candle's, for shapes that do not fit.
pub fn composition_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: &Tensor,
    g: &Tensor,
    scale: f64,
) -> candle_core::Result<Tensor> {
    use crate::executor::matmul;
    let wide = probabilities(q, k, mask, scale)?;
    let p = wide.to_dtype(q.dtype())?;
    let dv = matmul(&p.t()?, g)?;
    let dp = matmul(g, &v.t()?)?.to_dtype(wide.dtype())?;
    let ds = softmax_backward(&wide, &dp, 3, scale)?.to_dtype(q.dtype())?;
    let dq = matmul(&ds, k)?;
    let dk = matmul(&ds.t()?, q)?;
    Tensor::stack(&[dq, dk, dv], 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [−1, 1) (a linear congruential sequence).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn tensor(dims: &[usize], seed: u64, amp: f32) -> Tensor {
        let n = dims.iter().product();
        Tensor::from_vec(values(n, seed).into_iter().map(|x| x * amp).collect::<Vec<_>>(), dims, &Device::Cpu)
            .unwrap()
    }

    /// A `[t, t]` mask hiding with `hide` where `hidden(query, key)`.
    fn mask(t: usize, hide: f32, hidden: impl Fn(usize, usize) -> bool) -> Tensor {
        let m: Vec<f32> = (0..t * t).map(|i| if hidden(i / t, i % t) { hide } else { 0.0 }).collect();
        Tensor::from_vec(m, (t, t), &Device::Cpu).unwrap()
    }

    fn causal(t: usize) -> Tensor {
        mask(t, -1e9, |q, k| k > q)
    }

    fn f64s(t: &Tensor) -> Vec<f64> {
        t.to_dtype(CDType::F64).unwrap().flatten_all().unwrap().to_vec1().unwrap()
    }

    /// Largest |a − b| over the largest |b|; infinite where only one of a pair is NaN (f64::max
    /// would skip it).
    fn relative(a: &Tensor, b: &Tensor) -> f64 {
        let (a, b) = (f64s(a), f64s(b));
        assert_eq!(a.len(), b.len());
        let scale = b.iter().fold(0f64, |m, x| m.max(x.abs()));
        let gap = |x: f64, y: f64| if x.is_nan() != y.is_nan() { f64::INFINITY } else { (x - y).abs() };
        a.iter().zip(&b).fold(0f64, |m, (&x, &y)| m.max(gap(x, y))) / scale
    }

    struct Case {
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        mask: Tensor,
    }

    fn case(b: usize, h: usize, t: usize, e: usize, mask: Tensor) -> Case {
        let d = [b, h, t, e];
        Case {
            q: tensor(&d, 1, 2.0),
            k: tensor(&d, 2, 2.0),
            v: tensor(&d, 3, 1.0),
            g: tensor(&d, 4, 1.0),
            mask,
        }
    }

    /// The f32 kernels against the composition in f64, forward and backward.
    fn check(c: &Case, scale: f64) {
        check_in(c, scale, CDType::F64)
    }

    /// The f32 kernels against the composition in `dtype`, forward and backward.
    fn check_in(c: &Case, scale: f64, dtype: CDType) {
        let wide = |x: &Tensor| x.to_dtype(dtype).unwrap();
        let o = attention(&c.q, &c.k, &c.v, &c.mask, scale).unwrap();
        let want = composition(&wide(&c.q), &wide(&c.k), &wide(&c.v), &wide(&c.mask), scale).unwrap();
        let err = relative(&o, &want);
        assert!(err < 1e-6, "forward {:?}: {err:e}", c.q.dims());
        let d = attention_backward(&c.q, &c.k, &c.v, &c.mask, &o, &c.g, scale).unwrap();
        let want =
            composition_backward(&wide(&c.q), &wide(&c.k), &wide(&c.v), &wide(&c.mask), &wide(&c.g), scale)
                .unwrap();
        for i in 0..3 {
            let err = relative(&d.get(i).unwrap(), &want.get(i).unwrap());
            assert!(err < 1e-5, "gradient {i} of {:?}: {err:e}", c.q.dims());
        }
    }

    #[test]
    fn kernels_match_the_composition_in_one_tile_and_across_tiles() {
        // One whole tile, less than one, and ragged tiles after one or two whole ones.
        for (t, e) in [(BQ, 32), (5, 4), (BK + 36, 8), (2 * BK + 22, 16)] {
            check(&case(2, 3, t, e, causal(t)), 1.0 / (e as f64).sqrt());
        }
    }

    #[test]
    fn kernels_match_the_composition_under_other_masks() {
        let t = 3 * BK + 10;
        // A sliding window of 40 keys: whole key tiles hidden on both sides of the diagonal.
        check(&case(1, 2, t, 8, mask(t, -1e9, |q, k| k > q || q - k >= 40)), 0.3);
        // Rows 70..80 see no key: their query tile keeps every key tile. In f32 their scores all
        // round to −1e9 (a uniform softmax), in f64 they do not: the reference is f32's.
        check_in(&case(1, 2, t, 8, mask(t, -1e9, |q, k| k > q || (70..80).contains(&q))), 0.3, CDType::F32);
        // The same window hidden with −∞: a live tile in which one row sees nothing yet.
        check(&case(1, 2, t, 8, mask(t, f32::NEG_INFINITY, |q, k| k > q || q - k >= 40)), 0.3);
        // No mask at all.
        check(&case(2, 1, t, 8, mask(t, 0.0, |_, _| false)), 0.3);
    }

    #[test]
    fn skipping_hidden_tiles_changes_no_bit() {
        // −1e7 hides a key as exactly as −1e9 (e^x is +0.0 below −104) but is above HIDDEN, so
        // its tiles are computed: the outputs must be the same bits.
        let t = BK + 22;
        let (skipped, computed) =
            (case(2, 2, t, 16, causal(t)), case(2, 2, t, 16, mask(t, -1e7, |q, k| k > q)));
        let bits = |x: &Tensor| {
            x.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        let run = |c: &Case| {
            let o = attention(&c.q, &c.k, &c.v, &c.mask, 0.25).unwrap();
            let d = attention_backward(&c.q, &c.k, &c.v, &c.mask, &o, &c.g, 0.25).unwrap();
            (bits(&o), bits(&d))
        };
        let live = |m: &Tensor| {
            let m = m.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            Live::of(View { data: &m, rs: t }, t).live
        };
        assert!(live(&skipped.mask).iter().any(|l| !l));
        assert!(live(&computed.mask).iter().all(|&l| l));
        assert_eq!(run(&skipped), run(&computed));
    }

    #[test]
    fn results_do_not_depend_on_the_threads() {
        let c = case(2, 4, BK + 36, 8, causal(BK + 36));
        let run = || {
            let o = attention(&c.q, &c.k, &c.v, &c.mask, 0.5).unwrap();
            let d = attention_backward(&c.q, &c.k, &c.v, &c.mask, &o, &c.g, 0.5).unwrap();
            (f64s(&o), f64s(&d))
        };
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap().install(run);
        let two = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap().install(run);
        assert_eq!(one, two);
    }

    #[test]
    fn strided_operands_give_their_copies_bits() {
        // Heads split from [B, T, H, E] (rows H·E apart: read in place) and a k stored
        // transposed (columns not contiguous: copied) against contiguous copies of the same.
        let (b, h, t, e) = (2, 3, BK + 36, 8);
        let split = |seed| tensor(&[b, t, h, e], seed, 1.0).permute((0, 2, 1, 3)).unwrap();
        let (q, v, g) = (split(1), split(3), split(4));
        let k = tensor(&[b, h, e, t], 2, 1.0).transpose(2, 3).unwrap();
        assert!(!q.is_contiguous() && q.stride()[3] == 1 && k.stride()[3] != 1);
        let c = |x: &Tensor| x.contiguous().unwrap();
        let mask = causal(t);
        let bits = |x: &Tensor| {
            x.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        let o = attention(&q, &k, &v, &mask, 0.3).unwrap();
        let oc = attention(&c(&q), &c(&k), &c(&v), &mask, 0.3).unwrap();
        assert_eq!(bits(&o), bits(&oc));
        let d = attention_backward(&q, &k, &v, &mask, &o, &g, 0.3).unwrap();
        let dc = attention_backward(&c(&q), &c(&k), &c(&v), &mask, &oc, &c(&g), 0.3).unwrap();
        assert_eq!(bits(&d), bits(&dc));
    }

    #[test]
    fn bad_shapes_are_errors() {
        let c = case(1, 1, 8, 4, causal(8));
        let short = tensor(&[1, 1, 7, 4], 5, 1.0);
        assert!(attention(&c.q, &short, &c.v, &c.mask, 1.0).is_err());
        assert!(attention(&c.q, &c.k, &c.v, &causal(7), 1.0).is_err());
        assert!(attention_backward(&c.q, &c.k, &c.v, &c.mask, &short, &c.g, 1.0).is_err());
    }
}
