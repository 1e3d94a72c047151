//! Self-attention in one kernel ([`graphpp_graph::Op::Attention`]) and its backward
//! ([`graphpp_graph::Op::AttentionBackward`]), blocked after FlashAttention-2 (Dao 2023,
//! Algorithms 1 and 2; query tiles outermost), the backward recomputing each row's maximum and
//! sum instead of saving the log-sum-exp.
//!
//! Shapes: q `[B, H, T, E]`, k `[B, KV, T, E]`, v `[B, KV, T, E_v]` and o and g `[B, H, T,
//! E_v]` with KV dividing H (query head h reads key/value head h / (H/KV): grouped-query
//! attention, never repeated in memory; the value width may differ from q·k's, as in
//! multi-head latent attention), the additive mask `[T, T]`. The tasks, forward and backward, are the (batch, query head)s; in the
//! backward a group's first query head writes its key/value head's dk and dv and the others
//! partials of their own, added in query-head order afterwards ([`sum_partials`]), so a pool has
//! B·H tasks to split at any KV, where a task per key/value head would leave threads idle when KV
//! is small; the partials' extra pass costs little (measured: docs/PERFORMANCE.md, "Attention").
//! The results do not depend on the split.
//! Operands are read in place on their strides where their columns are contiguous (heads split
//! from `[B, T, H, E]`: rows `H · E` apart; the products' sums do not depend on the row stride,
//! so the bits are their copies'), else copied first. The products are [`product`]'s: register
//! blocks without packing, summing only the terms the mask lets be non-zero; `k` (and in the
//! backward `v`) is transposed once per query head so that every product reads rows.
//!
//! **Forward** (f32): per tile of [`BQ`] query rows, the keys a tile of [`BK`] at a time:
//! `S = q kᵀ` into a `BQ × BK` scratch, `z = scale · S + mask`, the running row maximum
//! `m` and sum `l` of `e^(z − m)` rescaled by `e^(m_old − m)` when the maximum grows (the online
//! softmax, Milakov & Gimelshein 2018), and the output rows `acc += e^(z − m) v` rescaled
//! alike; at the end `o = acc / l`. No more than one `BQ × BK` tile of the scores (and one of
//! their exponentials) exists at a time per task: the `[B, H, T, T]` probabilities are never
//! held, in the forward or saved for the backward.
//!
//! **Backward** (f32): per query tile, the scores of its key tiles again (one `BQ × T` row
//! block per task), their softmax `P` in two passes (max, then sum), `D = rowsum(g ⊙ o)`, and
//! per key tile `dv += Pᵀ g`, `dP = g vᵀ`, `dS = scale · P ⊙ (dP − D)`, `dq += dS k`,
//! `dk += dSᵀ q`. Five products per tile where the saved-probabilities backward did four.
//!
//! **Masked keys.** A mask entry at or below [`HIDDEN`] hides its key. Each query row's *span*
//! runs from its first visible key to its last ([`Spans`]), and only scores inside spans are
//! computed: key tiles no row of a query tile reaches are skipped, and within a tile the
//! products skip the register blocks (and the terms of a sum) outside the spans. Outside its
//! span a row's `e^(z − m)` are exact zeros in f32 whenever the row sees some key (the causal
//! mask's −1e9 under a finite row maximum: below −104 `e^x` rounds to +0.0), so skipping
//! changes no bit of the sums, up to the sign of a zero (tested against a −1e7 mask, which is
//! computed everywhere, causal and sliding-window) while halving the causal work — for finite
//! q, k, v (a NaN or ∞ at a hidden key reaches the composition's output through `0 · ∞`, not the
//! kernel's) and visible scores more than ~104 above the hidden ones. NaN in the mask counts as
//! visible. A row that sees no key spans every key (its softmax is over all of
//! them, as the composition's).
//!
//! bf16 runs the f32 kernels on its values widened, each result rounded to bf16 once. f64 runs
//! the composition — `q kᵀ`, softmax in the wide dtype ([`crate::kernels::softmax`]), `P v` —
//! which is also the reference the f32 kernels are tested against (`tests` below); `tests/vjp_fd.rs` checks that composition's gradients (f64) by
//! finite differences.

mod product;

use std::ops::Range;

use candle_core::{DType as CDType, Device, Tensor};
use rayon::prelude::*;

use crate::kernels::device::composed;
use crate::kernels::softmax::{max, softmax, softmax_backward, sum};
use crate::kernels::tensor::cast;
use product::{product, Mat, Out, MR};

/// Query rows per tile.
pub const BQ: usize = 128;
/// Keys per tile.
pub const BK: usize = 128;
/// A mask entry at or below this hides its key (graphpp's causal mask is −1e9).
pub const HIDDEN: f32 = -1e8;

/// `softmax(scale · q kᵀ + mask) v` ([`graphpp_graph::Op::Attention`]): q `[B, H, T, E]`, k
/// `[B, KV, T, E]`, v `[B, KV, T, E_v]` (query head `h` reads key/value head `h / (H / KV)`),
/// mask `[T, T]` of q's wide dtype → `[B, H, T, E_v]`. bf16 q, k, v run the f32 kernel on their values widened and
/// the output is rounded to bf16 once — f32 math inside, as FlashAttention's bf16 kernels keep
/// the scores and the softmax in f32; f64, and every operand [`composed`] names, runs the
/// [`composition`].
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
    if q.dtype() == CDType::BF16 {
        let [q, k, v, mask] = widened([q, k, v, mask])?;
        return cast(&attention(&q, &k, &v, &mask, scale)?, CDType::BF16);
    }
    if q.dtype() != CDType::F32 || composed(q) {
        return composition(q, k, v, mask, scale);
    }
    let held = Held::of(&[q, k, v, &mask.reshape((1, 1, sizes.t, sizes.t))?])?;
    let te = sizes.t * sizes.ev;
    let mut out = vec![0f32; sizes.b * sizes.h * te];
    held.with(|x| {
        let (q, k, v, mask) = (x[0], x[1], x[2], x[3].head(0));
        let spans = Spans::of(mask, sizes.t);
        let ctx = Ctx { mask, spans: &spans, s: sizes, scale: scale as f32 };
        // One task per (batch, head) over the pool (on a one-thread pool, in turn).
        out.par_chunks_mut(te.max(1)).enumerate().for_each_init(
            || Scratch::of(sizes),
            |scratch, (bh, o)| {
                let kv = sizes.kv_of(bh);
                let head = [q.head(bh), k.head(kv), v.head(kv)];
                Job::Forward(head, o).run(&ctx, scratch)
            },
        );
    })?;
    Tensor::from_vec(out, sizes.out_dims(), &Device::Cpu)
}

/// The gradients of q, k and v along the heads, `[B, H + 2·KV, T, max(E, E_v)]`, the narrower
/// ones zero-padded ([`graphpp_graph::Op::AttentionBackward`]), of the [`attention`] with output
/// `o` and output gradient `g` (both `[B, H, T, E_v]`). One task per (batch, query head), so that a wide pool
/// has work at B = 1 under grouped-query attention too: a group's first query head writes its
/// key/value head's dk and dv, the others partials of their own, which are then added in
/// query-head order ([`sum_partials`]) — the bits of the kernel run on k and v repeated per
/// query head, summed per group. bf16 operands run the f32 kernel on their values widened and
/// the gradients are rounded to bf16 once ([`attention`]'s rule).
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
    if o.dims() != sizes.out_dims() || g.dims() != sizes.out_dims() {
        candle_core::bail!(
            "attention backward: o {:?} and g {:?} must be the output's {:?}",
            o.dims(),
            g.dims(),
            sizes.out_dims()
        )
    }
    if q.dtype() == CDType::BF16 {
        let [q, k, v, mask, o, g] = widened([q, k, v, mask, o, g])?;
        return cast(&attention_backward(&q, &k, &v, &mask, &o, &g, scale)?, CDType::BF16);
    }
    if q.dtype() != CDType::F32 || composed(q) {
        return composition_backward(q, k, v, mask, g, scale);
    }
    let held = Held::of(&[q, k, v, o, g, &mask.reshape((1, 1, sizes.t, sizes.t))?])?;
    // Each head's gradient `[T, w]`, w the wider of q·k's and v's widths.
    let te = sizes.t * sizes.w();
    let group = sizes.h / sizes.kv;
    let mut out = vec![0f32; sizes.b * (sizes.h + 2 * sizes.kv) * te];
    // dk and dv of each query head after its group's first, summed into the group's afterwards.
    let mut partials = vec![0f32; sizes.b * sizes.kv * (group - 1) * 2 * te];
    // Per (batch, query head): its dq, and the dk and dv it writes — its key/value head's for a
    // group's first query head, its own partials for the others.
    let mut tasks = Vec::with_capacity(sizes.b * sizes.h);
    let mut rest = partials.chunks_mut(te.max(1));
    for batch in out.chunks_mut(((sizes.h + 2 * sizes.kv) * te).max(1)) {
        let (dq, kv) = batch.split_at_mut(sizes.h * te);
        let (dk, dv) = kv.split_at_mut(sizes.kv * te);
        let mut dq = dq.chunks_mut(te.max(1));
        for (dk, dv) in dk.chunks_mut(te.max(1)).zip(dv.chunks_mut(te.max(1))) {
            tasks.push((dq.next(), dk, dv));
            for _ in 1..group {
                tasks.push((dq.next(), rest.next().unwrap_or_default(), rest.next().unwrap_or_default()));
            }
        }
    }
    held.with(|x| {
        let (q, k, v, o, g, mask) = (x[0], x[1], x[2], x[3], x[4], x[5].head(0));
        let spans = Spans::of(mask, sizes.t);
        let ctx = Ctx { mask, spans: &spans, s: sizes, scale: scale as f32 };
        tasks.into_par_iter().enumerate().for_each_init(
            || Scratch::of(sizes),
            |scratch, (bh, (dq, dk, dv))| {
                let kv = sizes.kv_of(bh);
                let head = Head { q: q.head(bh), k: k.head(kv), v: v.head(kv), o: o.head(bh), g: g.head(bh) };
                let grads = Grads { dq: dq.unwrap_or_default(), dk, dv };
                Job::Backward(head, grads).run(&ctx, scratch)
            },
        );
    })?;
    sum_partials(&mut out, &partials, sizes);
    Tensor::from_vec(out, (sizes.b, sizes.h + 2 * sizes.kv, sizes.t, sizes.w()), &Device::Cpu)
}

/// Adds each key/value head's partial dk and dv (`partials`: per (batch, key/value head), its
/// query heads after the first, each dk then dv, `[T, w]`) into `out`'s (`[B, H + 2·KV, T, w]`),
/// in query-head order: the sums of the kernel run on k and v repeated per query head.
fn sum_partials(out: &mut [f32], partials: &[f32], s: Sizes) {
    let (te, group) = (s.t * s.w(), s.h / s.kv);
    if group == 1 || te == 0 {
        return;
    }
    let per_head = (group - 1) * 2 * te;
    let mut heads: Vec<(&mut [f32], &mut [f32])> = Vec::with_capacity(s.b * s.kv);
    for batch in out.chunks_mut((s.h + 2 * s.kv) * te) {
        let (dk, dv) = batch[s.h * te..].split_at_mut(s.kv * te);
        heads.extend(dk.chunks_mut(te).zip(dv.chunks_mut(te)));
    }
    heads.into_par_iter().zip(partials.par_chunks(per_head)).for_each(|((dk, dv), p)| {
        for pair in p.chunks(2 * te) {
            let (pk, pv) = pair.split_at(te);
            dk.iter_mut().zip(pk).for_each(|(a, &b)| *a += b);
            dv.iter_mut().zip(pv).for_each(|(a, &b)| *a += b);
        }
    });
}

/// Static sizes of one call: `B · H` query heads (`B · KV` key/value heads) of `t` rows of `e`
/// features of q and k, `ev` of v and the output.
#[derive(Clone, Copy, Debug)]
struct Sizes {
    b: usize,
    h: usize,
    kv: usize,
    t: usize,
    e: usize,
    ev: usize,
}

impl Sizes {
    fn of(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> candle_core::Result<Sizes> {
        let &[b, h, t, e] = q.dims() else {
            candle_core::bail!("attention: q must be [B, H, T, E], got {:?}", q.dims())
        };
        let kv = k.dims().get(1).copied().unwrap_or(0);
        let ev = v.dims().get(3).copied().unwrap_or(0);
        let kv_fits = k.dims() == [b, kv, t, e] && kv > 0 && h.is_multiple_of(kv);
        if !kv_fits || v.dims() != [b, kv, t, ev] || mask.dims() != [t, t] {
            candle_core::bail!(
                "attention: k {:?} and v {:?} must be [B, KV, T, E] and [B, KV, T, E_v] of q {:?} with KV \
                 dividing H, and the mask {:?} [{t}, {t}]",
                k.dims(),
                v.dims(),
                q.dims(),
                mask.dims()
            )
        }
        Ok(Sizes { b, h, kv, t, e, ev })
    }

    /// The key/value head (batch-major index) query head `bh` (batch-major) reads.
    fn kv_of(&self, bh: usize) -> usize {
        (bh / self.h) * self.kv + (bh % self.h) / (self.h / self.kv)
    }

    /// The output's `[B, H, T, E_v]`.
    fn out_dims(&self) -> Vec<usize> {
        vec![self.b, self.h, self.t, self.ev]
    }

    /// The backward's width per head: the wider of q·k's and v's.
    fn w(&self) -> usize {
        self.e.max(self.ev)
    }
}

/// f32 operands `[B, heads, T, E]` held for reading in place: each as it is where its columns are
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

/// One f32 operand `[B, heads, T, E]` in its storage: (batch b, head h)'s row r starts at
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

/// Per query row, the keys it sees; per key, the query rows that see it (module doc, "Masked
/// keys"). A row's range runs from its first visible key to its last — every key for a row that
/// sees none (its softmax is over all of them, as the composition's); a key's from the first to
/// the last row whose range holds it (empty for a key in no row's range).
struct Spans {
    rows: Vec<Range<usize>>,
    keys: Vec<Range<usize>>,
}

impl Spans {
    fn of(mask: View, t: usize) -> Spans {
        // NaN counts as visible: it reaches the output as the composition's does.
        let seen = |m: &f32| *m > HIDDEN || m.is_nan();
        let rows: Vec<Range<usize>> = (0..t)
            .map(|r| {
                let m = &mask.from(r)[..t];
                match (m.iter().position(seen), m.iter().rposition(seen)) {
                    (Some(lo), Some(hi)) => lo..hi + 1,
                    _ => 0..t,
                }
            })
            .collect();
        // Per key, the first and one past the last row whose range holds it.
        let (mut first, mut end) = (vec![usize::MAX; t], vec![0; t]);
        for (r, span) in rows.iter().enumerate() {
            for c in span.clone() {
                first[c] = first[c].min(r);
                end[c] = r + 1;
            }
        }
        let keys = first.into_iter().zip(end).map(|(lo, hi)| if lo < hi { lo..hi } else { 0..0 }).collect();
        Spans { rows, keys }
    }

    /// The smallest range holding `within` ∩ `ranges[i]` for every `i` in `of`, relative to
    /// `within.start` (empty where none meets `within`).
    fn hull(ranges: &[Range<usize>], of: Range<usize>, within: Range<usize>) -> Range<usize> {
        let (lo, hi) = ranges[of]
            .iter()
            .map(|r| r.start.max(within.start)..r.end.min(within.end))
            .filter(|r| !r.is_empty())
            .fold((usize::MAX, 0), |(lo, hi), r| (lo.min(r.start), hi.max(r.end)));
        if lo < hi {
            lo - within.start..hi - within.start
        } else {
            0..0
        }
    }

    /// The key tiles `(first key, keys)` the query rows `rows` compute: those that meet some
    /// row's range.
    fn key_tiles(&self, rows: Range<usize>, t: usize) -> impl Iterator<Item = (usize, usize)> {
        let hull = Spans::hull(&self.rows, rows, 0..t);
        (0..t)
            .step_by(BK)
            .filter(move |&c0| c0 < hull.end && c0 + BK > hull.start)
            .map(move |c0| (c0, BK.min(t - c0)))
    }
}

/// Per block of [`MR`] of the rows (or keys) `of`, the [`Spans::hull`] of their ranges within
/// `within`: the reach ([`product`]) of a product summing over `within`.
fn blocks(ranges: &[Range<usize>], of: Range<usize>, within: Range<usize>) -> Vec<Range<usize>> {
    of.clone().step_by(MR).map(|i| Spans::hull(ranges, i..(i + MR).min(of.end), within.clone())).collect()
}

/// All of `0..e` where `seen` meets `keys` (some row of a block sees some key of it), else
/// nothing: the reach of a scores product.
fn all_if(seen: &Range<usize>, keys: Range<usize>, e: usize) -> Range<usize> {
    if seen.start < keys.end && keys.start < seen.end {
        0..e
    } else {
        0..0
    }
}

/// `x`'s `[T, E]` rows as the columns of `dst` `[E, T]`: whole 8 × 8 blocks by AVX2 shuffles
/// where the CPU has AVX2 (and FMA, as the kernels ask), the rest element by element.
#[inline(always)]
fn transpose(x: View, (t, e): (usize, usize), dst: &mut [f32]) {
    let dst = &mut dst[..t * e];
    let whole = |n: usize| n - n % 8;
    #[cfg(target_arch = "x86_64")]
    let done = if product::avx2_fma() { (whole(t), whole(e)) } else { (0, 0) };
    #[cfg(not(target_arch = "x86_64"))]
    let done = (0, 0);
    #[cfg(target_arch = "x86_64")]
    for c0 in (0..done.0).step_by(8) {
        for j0 in (0..done.1).step_by(8) {
            let src = &x.from(c0)[j0..];
            assert!(7 * x.rs + 8 <= src.len() && 7 * t + c0 + 8 <= dst.len() - j0 * t);
            // SAFETY: the CPU has AVX2 (`avx2_fma`, above); rows c0..c0 + 8 of x hold columns
            // j0..j0 + 8 and rows j0..j0 + 8 of dst columns c0..c0 + 8 (asserted just above).
            unsafe {
                crate::kernels::tile8::transpose8(src.as_ptr(), x.rs, dst[j0 * t + c0..].as_mut_ptr(), t)
            };
        }
    }
    for c in 0..t {
        let row = &x.from(c)[..e];
        let from = if c < done.0 { done.1 } else { 0 };
        for (j, &y) in row.iter().enumerate().skip(from) {
            dst[j * t + c] = y;
        }
    }
}

/// One task's scratch, reused by the (batch, head)s it runs: k and v transposed `[E, T]` and
/// `[E_v, T]`, a tile
/// of scores `z` (the backward's: one row) and of probabilities `p` (the backward's: a `BQ × T`
/// row block), and a tile of the backward's `dS`.
struct Scratch {
    kt: Vec<f32>,
    vt: Vec<f32>,
    z: Vec<f32>,
    p: Vec<f32>,
    ds: Vec<f32>,
}

impl Scratch {
    fn of(s: Sizes) -> Scratch {
        let tile = BQ.min(s.t) * BK.min(s.t);
        Scratch {
            kt: vec![0.0; s.t * s.e],
            vt: vec![0.0; s.t * s.ev],
            z: vec![0.0; tile.max(s.t)],
            p: vec![0.0; BQ.min(s.t) * s.t],
            ds: vec![0.0; tile],
        }
    }
}

/// `Σ a ⊙ b` in order.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// What one call shares with each (batch, head): the mask, its spans, the sizes and the scale.
#[derive(Clone, Copy)]
struct Ctx<'a> {
    mask: View<'a>,
    spans: &'a Spans,
    s: Sizes,
    scale: f32,
}

/// One task's work on one query head.
enum Job<'a, 'b> {
    /// The forward: q, k, v rows into o.
    Forward([View<'a>; 3], &'b mut [f32]),
    /// The backward: dq, and dk, dv (its key/value head's, or its partials: [`sum_partials`]).
    Backward(Head<'a>, Grads<'b>),
}

impl Job<'_, '_> {
    /// Runs the job: built for AVX2 and FMA where the CPU has them (the kernels' elementwise
    /// loops 8 lanes wide; the products dispatch on their own), else as it is.
    fn run(self, c: &Ctx, x: &mut Scratch) {
        #[cfg(target_arch = "x86_64")]
        if product::avx2_fma() {
            #[target_feature(enable = "avx2,fma")]
            fn avx2(job: Job, c: &Ctx, x: &mut Scratch) {
                job.run_in(c, x)
            }
            // SAFETY: the CPU has AVX2 and FMA (checked just above).
            return unsafe { avx2(self, c, x) };
        }
        self.run_in(c, x)
    }

    #[inline(always)]
    fn run_in(self, c: &Ctx, x: &mut Scratch) {
        match self {
            Job::Forward(qkv, o) => forward_in(qkv, c, o, x),
            Job::Backward(head, grads) => backward_in(head, c, grads, x),
        }
    }
}

/// One (batch, head) of the forward (module doc): q, k `[T, E]` and v `[T, E_v]` rows, o its
/// `[T, E_v]` output.
#[inline(always)]
fn forward_in([q, k, v]: [View; 3], c: &Ctx, o: &mut [f32], Scratch { kt, z, p, .. }: &mut Scratch) {
    let Ctx { mask, spans, s, scale } = *c;
    let (t, e, ev) = (s.t, s.e, s.ev);
    transpose(k, (t, e), kt);
    let (mut m, mut l) = ([f32::NEG_INFINITY; BQ], [0f32; BQ]);
    for r0 in (0..t).step_by(BQ) {
        let rows = BQ.min(t - r0);
        let acc = &mut o[r0 * ev..(r0 + rows) * ev];
        acc.fill(0.0);
        m.fill(f32::NEG_INFINITY);
        l.fill(0.0);
        for (c0, cols) in spans.key_tiles(r0..r0 + rows, t) {
            // The keys each block of MR rows sees (tile-relative).
            let seen = blocks(&spans.rows, r0..r0 + rows, c0..c0 + cols);
            let (z, p) = (&mut z[..rows * cols], &mut p[..rows * cols]);
            let qi = Mat { data: q.from(r0), rs: q.rs, cs: 1 };
            let ktj = Mat { data: &kt[c0..], rs: t, cs: 1 };
            product((rows, cols, e), Out { data: z, rs: cols }, false, qi, ktj, |rs, ks| {
                all_if(&seen[rs.start / MR], ks, e)
            });
            for (r, (zr, pr)) in z.chunks_exact_mut(cols).zip(p.chunks_exact_mut(cols)).enumerate() {
                let span = Spans::hull(&spans.rows, r0 + r..r0 + r + 1, c0..c0 + cols);
                pr[..span.start].fill(0.0);
                pr[span.end..].fill(0.0);
                if span.is_empty() {
                    // Every key of the tile hidden: e^(z − m) would add +0.0 (module doc).
                    continue;
                }
                let (zs, ps) = (&mut zr[span.clone()], &mut pr[span.clone()]);
                for (x, &a) in zs.iter_mut().zip(&mask.from(r0 + r)[c0 + span.start..c0 + span.end]) {
                    *x = *x * scale + a;
                }
                let top = m[r].max(max(zs));
                // A row that has seen only −∞ so far subtracts 0 (not −∞ − −∞ = NaN): its
                // exponentials are 0 until it sees a key, as in the composition.
                let base = if top == f32::NEG_INFINITY { 0.0 } else { top };
                zs.iter_mut().for_each(|x| *x -= base);
                crate::kernels::expf::exp_slice(zs, ps, false);
                // e^(m_old − m_new); 1 while the maximum stands (also −∞ to −∞: nothing seen).
                let shrink = if top == m[r] { 1.0 } else { crate::kernels::expf::exp(m[r] - top) };
                // Over the whole tile row (zeros outside the span): the sum's lanes as a full
                // row's, so the bits do not depend on the span.
                l[r] = l[r] * shrink + sum(pr);
                m[r] = top;
                if shrink != 1.0 {
                    acc[r * ev..(r + 1) * ev].iter_mut().for_each(|x| *x *= shrink);
                }
            }
            let vj = Mat { data: v.from(c0), rs: v.rs, cs: 1 };
            let pm = Mat { data: p, rs: cols, cs: 1 };
            product((rows, ev, cols), Out { data: acc, rs: ev }, true, pm, vj, |rs, _| {
                seen[rs.start / MR].clone()
            });
        }
        for (r, row) in acc.chunks_exact_mut(ev.max(1)).enumerate() {
            row.iter_mut().for_each(|x| *x /= l[r]);
        }
    }
}

/// One (batch, head)'s operands: q and k `[T, E]` rows, v, o and g `[T, E_v]`.
struct Head<'a> {
    q: View<'a>,
    k: View<'a>,
    v: View<'a>,
    o: View<'a>,
    g: View<'a>,
}

/// One (batch, head)'s gradients, each `[T, w]` row-major (w the wider width; dq and dk fill
/// the first E columns, dv the first E_v).
struct Grads<'a> {
    dq: &'a mut [f32],
    dk: &'a mut [f32],
    dv: &'a mut [f32],
}

/// One (batch, head) of the backward (module doc).
#[inline(always)]
fn backward_in(x: Head, c: &Ctx, d: Grads, scratch: &mut Scratch) {
    let Ctx { mask, spans, s, scale } = *c;
    let (t, e, ev, w) = (s.t, s.e, s.ev, s.w());
    // p: the softmax of the query tile's row block over its key tiles (row stride t).
    let Scratch { kt, vt, z, p, ds } = scratch;
    transpose(x.k, (t, e), kt);
    transpose(x.v, (t, ev), vt);
    for r0 in (0..t).step_by(BQ) {
        let rows = BQ.min(t - r0);
        let tiles: Vec<(usize, usize)> = spans.key_tiles(r0..r0 + rows, t).collect();
        let qi = Mat { data: x.q.from(r0), rs: x.q.rs, cs: 1 };
        // Per key tile, the keys each block of MR rows sees, and the rows each block of MR keys
        // is seen by (tile-relative).
        let seen: Vec<_> =
            tiles.iter().map(|&(c0, cols)| blocks(&spans.rows, r0..r0 + rows, c0..c0 + cols)).collect();
        let seen_by: Vec<_> =
            tiles.iter().map(|&(c0, cols)| blocks(&spans.keys, c0..c0 + cols, r0..r0 + rows)).collect();
        for (&(c0, cols), seen) in tiles.iter().zip(&seen) {
            let ktj = Mat { data: &kt[c0..], rs: t, cs: 1 };
            let out = Out { data: &mut p[c0..], rs: t };
            product((rows, cols, e), out, false, qi, ktj, |rs, ks| all_if(&seen[rs.start / MR], ks, e));
        }
        for (r, row) in p.chunks_exact_mut(t).take(rows).enumerate() {
            let span = spans.rows[r0 + r].clone();
            let seg = &mut row[span.clone()];
            for (y, &a) in seg.iter_mut().zip(&mask.from(r0 + r)[span.clone()]) {
                *y = *y * scale + a;
            }
            let top = max(seg);
            let z = &mut z[..span.len()];
            z.iter_mut().zip(seg.iter()).for_each(|(z, &y)| *z = y - top);
            crate::kernels::expf::exp_slice(z, seg, false);
            let mut total = 0.0;
            for &(c0, cols) in &tiles {
                let tile = &mut row[c0..c0 + cols];
                tile[..span.start.saturating_sub(c0).min(cols)].fill(0.0);
                tile[span.end.saturating_sub(c0).min(cols)..].fill(0.0);
                // Tile by tile, as the sums of the tiles a full row would have.
                total += sum(tile);
            }
            row[span].iter_mut().for_each(|y| *y /= total);
        }
        let gi = Mat { data: x.g.from(r0), rs: x.g.rs, cs: 1 };
        let big_d: Vec<f32> = (r0..r0 + rows).map(|r| dot(&x.g.from(r)[..ev], &x.o.from(r)[..ev])).collect();
        for ((&(c0, cols), seen), seen_by) in tiles.iter().zip(&seen).zip(&seen_by) {
            let pt = Mat { data: &p[c0..], rs: 1, cs: t };
            let dv = Out { data: &mut d.dv[c0 * w..], rs: w };
            product((cols, ev, rows), dv, true, pt, gi, |ks, _| seen_by[ks.start / MR].clone());
            let ds = &mut ds[..rows * cols];
            let vtj = Mat { data: &vt[c0..], rs: t, cs: 1 };
            product((rows, cols, ev), Out { data: ds, rs: cols }, false, gi, vtj, |rs, ks| {
                all_if(&seen[rs.start / MR], ks, ev)
            });
            for (r, dr) in ds.chunks_exact_mut(cols).enumerate() {
                for (y, &pv) in dr.iter_mut().zip(&p[r * t + c0..r * t + c0 + cols]) {
                    *y = scale * pv * (*y - big_d[r]);
                }
            }
            let kj = Mat { data: x.k.from(c0), rs: x.k.rs, cs: 1 };
            let dq = Out { data: &mut d.dq[r0 * w..], rs: w };
            let dsm = Mat { data: ds, rs: cols, cs: 1 };
            product((rows, e, cols), dq, true, dsm, kj, |rs, _| seen[rs.start / MR].clone());
            let dk = Out { data: &mut d.dk[c0 * w..], rs: w };
            let dst = Mat { data: ds, rs: 1, cs: cols };
            product((cols, e, rows), dk, true, dst, qi, |ks, _| seen_by[ks.start / MR].clone());
        }
    }
}

/// `N` tensors widened to f32 (exact; an f32 one is kept).
fn widened<const N: usize>(ts: [&Tensor; N]) -> candle_core::Result<[Tensor; N]> {
    let mut out = Vec::with_capacity(N);
    for t in ts {
        out.push(cast(t, CDType::F32)?);
    }
    Ok(out.try_into().unwrap_or_else(|_| unreachable!("N tensors in, N out")))
}

/// The softmax `P = softmax(scale · q kᵀ + mask)` `[B, H, T, T]` in the mask's (wide) dtype, the
/// product in q's.
fn probabilities(q: &Tensor, k: &Tensor, mask: &Tensor, scale: f64) -> candle_core::Result<Tensor> {
    let s = crate::kernels::matmul::matmul(q, &k.t()?)?;
    softmax(&cast(&s, mask.dtype())?, Some(mask), 3, scale)
}

/// `x` `[B, KV, T, E]` with each key/value head repeated for its `heads / KV` query heads:
/// `[B, heads, T, E]` (HF `repeat_kv`).
fn repeat_kv(x: &Tensor, heads: usize) -> candle_core::Result<Tensor> {
    let (b, kv, t, e) = x.dims4()?;
    if kv == 0 || !heads.is_multiple_of(kv) {
        candle_core::bail!("attention: {kv} key/value heads for {heads} query heads (must divide them)")
    }
    if kv == heads {
        return Ok(x.clone());
    }
    x.unsqueeze(2)?.broadcast_as((b, kv, heads / kv, t, e))?.reshape((b, heads, t, e))
}

/// A gradient `[B, H, T, E]` of repeated key/value heads summed back to `[B, kv, T, E]`.
fn sum_kv(d: &Tensor, kv: usize) -> candle_core::Result<Tensor> {
    let (b, h, t, e) = d.dims4()?;
    if kv == h {
        return Ok(d.clone());
    }
    d.reshape((b, kv, h / kv, t, e))?.sum(2)
}

/// [`attention`] as its composition — `q kᵀ`, [`softmax`] in the mask's (wide) dtype, `P v` with
/// `P` cast to q's dtype, the key/value heads repeated for their query heads — holding the
/// `[B, H, T, T]` scores: the reference the kernels are tested against, and what bf16 and f64
/// run.
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
    let heads = q.dims().get(1).copied().unwrap_or(0);
    let (k, v) = (repeat_kv(k, heads)?, repeat_kv(v, heads)?);
    let p = cast(&probabilities(q, &k, mask, scale)?, q.dtype())?;
    crate::kernels::matmul::matmul(&p, &v)
}

/// [`attention_backward`] as the composition's autodiff gives it: `dv = Pᵀ g`, `dP = g vᵀ`,
/// `dS` the softmax backward of `dP` (in the wide dtype), `dq = dS k`, `dk = dSᵀ q` (dk and dv
/// summed over each key/value head's query heads), joined along the heads `[B, H + 2·KV, T,
/// max(E, E_v)]`, the narrower ones zero-padded.
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
    use crate::kernels::matmul::matmul;
    let (heads, kv) = (q.dims().get(1).copied().unwrap_or(0), k.dims().get(1).copied().unwrap_or(0));
    let (k, v) = (repeat_kv(k, heads)?, repeat_kv(v, heads)?);
    let wide = probabilities(q, &k, mask, scale)?;
    let p = cast(&wide, q.dtype())?;
    let dv = sum_kv(&matmul(&p.t()?, g)?, kv)?;
    let dp = cast(&matmul(g, &v.t()?)?, wide.dtype())?;
    let ds = cast(&softmax_backward(&wide, &dp, 3, scale)?, q.dtype())?;
    let dq = matmul(&ds, &k)?;
    let dk = sum_kv(&matmul(&ds.t()?, q)?, kv)?;
    let width = dq.dim(3)?.max(dv.dim(3)?);
    let pad = |x: Tensor| {
        let short = width - x.dim(3)?;
        if short == 0 {
            Ok(x)
        } else {
            x.pad_with_zeros(3, 0, short)
        }
    };
    Tensor::cat(&[pad(dq)?, pad(dk)?, pad(dv)?], 1)
}

#[cfg(test)]
mod tests;
