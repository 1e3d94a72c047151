//! bf16 matrix products with f32 accumulation: `C = A · B` for bf16 `A` (`m × k`) and `B`
//! (`k × n`) on any strides, each sum kept in f32 and rounded to bf16 once (round to nearest
//! even), as mixed-precision training on GPUs and CPUs computes it (cuBLAS's and oneDNN's bf16
//! GEMMs accumulate in f32).
//!
//! Three paths, one chosen per process ([`chosen`]):
//! - [`Bf16Gemm::Amx`]: Intel AMX's `tdpbf16ps` on tile registers (16 × 32 bf16 times 32 × 16
//!   into 16 × 16 f32 sums: 8,192 multiply-adds an instruction), on Linux after the process asks
//!   for the tiles; the loops are tested on every CPU through an emulation of the tile
//!   instructions (`amx`);
//! - [`Bf16Gemm::Avx512Bf16`]: the AVX-512 BF16 dot product `vdpbf16ps`, which multiplies pairs of
//!   bf16 values and adds both products to an f32 lane — twice the multiply-adds per instruction
//!   of an f32 FMA, and no widening of the operands. Operands are packed into register-tile
//!   panels (`A` into 8-row panels, `B` into 32-column panels, both as `k`-pairs), a tile of
//!   8 × 32 sums is kept in 16 registers, and `k` is blocked so a `B` panel block stays in L1;
//! - [`Bf16Gemm::Widened`]: every CPU — the operands widened to f32 (exactly) and multiplied by
//!   the `gemm` crate's f32 kernel, as candle's CPU bf16 matmul does.
//!
//! The choice: the environment variable [`PATH_VAR`] names a path (to test each one, or to rule
//! one out), else the fastest the CPU has (docs/ARCHITECTURE.md, "bf16 matrix products").
//!
//! Each output's sum runs over `k` in the same order whatever the thread count, so the bits do
//! not depend on how the work is split. The paths sum in different orders, so their bits differ
//! within f32 rounding; and `vdpbf16ps` and `tdpbf16ps` treat subnormal inputs and results as
//! zero (whatever MXCSR says), so below ~1e-38 those paths give zeros where `widened` keeps
//! subnormals.

use super::tensor::{round_bf16, widen_bf16};
use gemm::Parallelism;
use half::bf16;
use std::mem::MaybeUninit;
use std::sync::OnceLock;

#[cfg(target_arch = "x86_64")]
mod amx;

/// The environment variable that names the bf16 matmul path: `amx`, `avx512-bf16` or `widened`.
pub const PATH_VAR: &str = "GRAPHPP_BF16_GEMM";

/// A way to compute a bf16 product (module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16Gemm {
    /// AMX's `tdpbf16ps` on tile registers (x86-64 Linux with AMX-TILE and AMX-BF16, once the
    /// kernel grants the tiles and the hardware passes the path's self-check).
    Amx,
    /// AVX-512 BF16's `vdpbf16ps` on packed panels (x86-64 with `avx512f` and `avx512bf16`).
    Avx512Bf16,
    /// Operands widened to f32 and multiplied by the `gemm` crate (every CPU).
    Widened,
}

impl Bf16Gemm {
    /// Every path, fastest first.
    pub const ALL: [Bf16Gemm; 3] = [Bf16Gemm::Amx, Bf16Gemm::Avx512Bf16, Bf16Gemm::Widened];

    /// The name [`PATH_VAR`] takes.
    pub fn name(self) -> &'static str {
        match self {
            Bf16Gemm::Amx => "amx",
            Bf16Gemm::Avx512Bf16 => "avx512-bf16",
            Bf16Gemm::Widened => "widened",
        }
    }

    /// Whether this process can run the path ([`Bf16Gemm::unavailable`] is `None`).
    pub fn available(self) -> bool {
        self.unavailable().is_none()
    }

    /// Why this process cannot run the path — the CPU lacks its instructions, or (AMX) the OS
    /// refused the tiles or the hardware failed the path's self-check — or `None` where it can.
    /// AMX's answer is found once a process (it asks the kernel for the tiles).
    pub fn unavailable(self) -> Option<String> {
        match self {
            #[cfg(target_arch = "x86_64")]
            Bf16Gemm::Amx => amx::unavailable(),
            #[cfg(not(target_arch = "x86_64"))]
            Bf16Gemm::Amx => Some("AMX is an x86-64 path".into()),
            Bf16Gemm::Avx512Bf16 => (!has_avx512_bf16()).then(|| "this CPU lacks AVX-512 BF16".into()),
            Bf16Gemm::Widened => None,
        }
    }
}

/// Every path's name, comma-separated.
fn path_names() -> String {
    Bf16Gemm::ALL.map(Bf16Gemm::name).join(", ")
}

impl std::fmt::Display for Bf16Gemm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// [`PATH_VAR`] names no path, or one this process cannot run.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    /// Not one of the names.
    #[error("{PATH_VAR}={0:?} names no bf16 matmul path (expected one of: {names})", names = path_names())]
    Unknown(String),
    /// A path this process cannot run: the path, why ([`Bf16Gemm::unavailable`]), the paths it
    /// can.
    #[error("{PATH_VAR}={0}: {1}; this process can run: {2} (unset {PATH_VAR} to take the fastest)")]
    Unavailable(Bf16Gemm, String, String),
}

/// The path named by `value` (a [`PATH_VAR`] setting), if this process can run it
/// ([`Bf16Gemm::unavailable`]).
///
/// # Errors
/// [`PathError`] for an unknown name or a path this process cannot run.
pub fn parse_path(value: &str) -> Result<Bf16Gemm, PathError> {
    let path = Bf16Gemm::ALL
        .into_iter()
        .find(|p| p.name().eq_ignore_ascii_case(value.trim()))
        .ok_or_else(|| PathError::Unknown(value.to_string()))?;
    if let Some(why) = path.unavailable() {
        let has: Vec<_> = Bf16Gemm::ALL.into_iter().filter(|p| p.available()).map(Bf16Gemm::name).collect();
        return Err(PathError::Unavailable(path, why, has.join(", ")));
    }
    Ok(path)
}

/// The process's bf16 matmul path: [`PATH_VAR`]'s (any case; set but empty counts as unset),
/// else the first of [`Bf16Gemm::ALL`] this process can run. Read once; later changes to the
/// variable are not seen. On a CPU with AMX the first call asks the kernel for the tiles and runs
/// the AMX path's self-check (`amx`), so a run that needs no bf16 product should not call it.
///
/// # Errors
/// [`PathError`] where [`PATH_VAR`] is set to a name [`parse_path`] refuses.
pub fn chosen() -> Result<Bf16Gemm, PathError> {
    static CHOSEN: OnceLock<Result<Bf16Gemm, PathError>> = OnceLock::new();
    CHOSEN
        .get_or_init(|| match std::env::var(PATH_VAR) {
            Ok(v) if !v.trim().is_empty() => parse_path(&v),
            _ => Ok(Bf16Gemm::ALL.into_iter().find(|p| p.available()).unwrap_or(Bf16Gemm::Widened)),
        })
        .clone()
}

fn has_avx512_bf16() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// A bf16 matrix read in place: element `(i, j)` is `data[i · row_stride + j · col_stride]`.
#[derive(Clone, Copy, Debug)]
pub struct Strided<'a> {
    /// The values; every element the shape reaches must lie inside.
    pub data: &'a [bf16],
    /// Elements between rows.
    pub row_stride: usize,
    /// Elements between columns.
    pub col_stride: usize,
}

impl Strided<'_> {
    fn at(&self, i: usize, j: usize) -> bf16 {
        self.data[i * self.row_stride + j * self.col_stride]
    }
}

/// Where a product's sums go, each rounded to bf16 once.
pub enum Out<'a> {
    /// `m × n` row-major bf16.
    Rows(&'a mut [MaybeUninit<bf16>]),
    /// `n × m` row-major (the transpose), each rounded sum widened back to f32 exactly: the bits
    /// of casting the `Rows` product to f32 after transposing it (a weight gradient, which
    /// autodiff transposes before the cast back to its f32 master weight: `crate::exec`'s
    /// transposed products), written in the order the cast's output is read.
    WidenedTransposed(&'a mut [MaybeUninit<f32>]),
}

impl Out<'_> {
    fn len(&self) -> usize {
        match self {
            Out::Rows(o) => o.len(),
            Out::WidenedTransposed(o) => o.len(),
        }
    }
}

/// `a · b`, `a` `m × k`, `b` `k × n`, into `out` (every element written; its layout: [`Out`]),
/// on `path`; split over the current rayon pool when `parallel` and the product is large
/// enough to gain. `path` must be available (else the widened path runs).
///
/// Panics if an operand's strides reach outside its data or `out` is not `m · n` long (the
/// callers check both).
pub fn gemm(
    path: Bf16Gemm,
    (m, n, k): (usize, usize, usize),
    (a, b): (Strided, Strided),
    out: Out,
    parallel: bool,
) {
    assert_eq!(out.len(), m * n, "bf16 gemm: output of {} for {m} × {n}", out.len());
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        match out {
            Out::Rows(o) => o.iter_mut().for_each(|o| {
                o.write(bf16::ZERO);
            }),
            Out::WidenedTransposed(o) => o.iter_mut().for_each(|o| {
                o.write(0.0);
            }),
        }
        return;
    }
    let parallel = parallel && m * n * k >= 48 * 48 * 256 && rayon::current_num_threads() > 1;
    match path {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        // SAFETY: the process can run the path: the CPU has AMX and the kernel granted the tiles.
        Bf16Gemm::Amx if path.available() => unsafe { amx::gemm::<amx::Amx>(m, n, k, a, b, out, parallel) },
        #[cfg(target_arch = "x86_64")]
        Bf16Gemm::Avx512Bf16 if has_avx512_bf16() => packed::gemm(m, n, k, a, b, out, parallel),
        _ => widened(m, n, k, a, b, out, parallel),
    }
}

/// Whether `got` (`m × n` row-major) is `a · b` within bf16 rounding of the exact (f64) product:
/// each f32 sum may differ from the exact one by `(k + 2) · 2⁻²³` of the sum of its terms'
/// magnitudes (up to two roundings of 2⁻²⁴ per term, in any order of summation, with room to
/// spare), and its bf16 value from the sum by half an ulp (2⁻⁹ relative; 2⁻⁸ allowed). The AMX
/// path's self-check and the tests read this.
///
/// # Errors
/// The first element outside the bound, its value and the exact one.
#[cfg(any(test, all(target_arch = "x86_64", target_os = "linux")))]
fn within_rounding(m: usize, n: usize, k: usize, a: Strided, b: Strided, got: &[bf16]) -> Result<(), String> {
    for i in 0..m {
        for j in 0..n {
            let terms = (0..k).map(|l| a.at(i, l).to_f64() * b.at(l, j).to_f64());
            let (exact, size) = terms.fold((0.0, 0.0), |(s, z), t| (s + t, z + t.abs()));
            let bound = exact.abs() * 2f64.powi(-8) + size * (k as f64 + 2.0) * 2f64.powi(-23);
            let value = got[i * n + j].to_f64();
            if (value - exact).abs() > bound {
                return Err(format!(
                    "({i}, {j}) of {m}×{k}·{k}×{n}: {value} against exact {exact} (bound {bound})"
                ));
            }
        }
    }
    Ok(())
}

/// An operand widened to f32 (exact), with the strides of the copy: a run that is contiguous
/// in the source (a row, or a column of a transposed view) stays contiguous.
fn widen(s: Strided, rows: usize, cols: usize) -> (Vec<f32>, usize, usize) {
    let wide = |h: &bf16| widen_bf16(*h);
    let mut v = Vec::with_capacity(rows * cols);
    if s.col_stride == 1 {
        for i in 0..rows {
            v.extend(s.data[i * s.row_stride..][..cols].iter().map(wide));
        }
        (v, cols, 1)
    } else if s.row_stride == 1 {
        for j in 0..cols {
            v.extend(s.data[j * s.col_stride..][..rows].iter().map(wide));
        }
        (v, 1, rows)
    } else {
        v.extend((0..rows).flat_map(|i| (0..cols).map(move |j| widen_bf16(s.at(i, j)))));
        (v, cols, 1)
    }
}

/// The widened path: both operands widened to f32, the `gemm` crate's product on their
/// strides, each sum rounded to bf16.
fn widened(m: usize, n: usize, k: usize, a: Strided, b: Strided, out: Out, parallel: bool) {
    let ((wa, ra, ca), (wb, rb, cb)) = (widen(a, m, k), widen(b, k, n));
    // Not zeroed: gemm with `read_dst` false writes every element before it reads any.
    let mut c: Vec<f32> = Vec::with_capacity(m * n);
    let threads = if parallel { Parallelism::Rayon(rayon::current_num_threads()) } else { Parallelism::None };
    // SAFETY: `wa` holds m × k elements on strides (ra, ca), `wb` k × n on (rb, cb), `c` has
    // room for m × n row-major, every one of which gemm writes (so `set_len` after it).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.spare_capacity_mut().as_mut_ptr().cast::<f32>(),
            1,
            n as isize,
            false,
            wa.as_ptr(),
            ca as isize,
            ra as isize,
            wb.as_ptr(),
            cb as isize,
            rb as isize,
            0f32,
            1f32,
            false,
            false,
            false,
            threads,
        );
        c.set_len(m * n);
    };
    match out {
        Out::Rows(o) => {
            for (o, v) in o.iter_mut().zip(&c) {
                o.write(round_bf16(*v));
            }
        }
        Out::WidenedTransposed(o) => {
            for (j, row) in o.chunks_mut(m).enumerate() {
                for (i, o) in row.iter_mut().enumerate() {
                    o.write(widen_bf16(round_bf16(c[i * n + j])));
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod packed {
    //! The `vdpbf16ps` path: packing, the 8 × 32 register tile, and the loops around it.

    use super::{bf16, MaybeUninit, Out, Strided};
    use rayon::prelude::*;
    use std::arch::x86_64::*;

    /// Rows of a register tile (and of an `A` panel).
    const MR: usize = 8;
    /// Columns of a register tile (and of a `B` panel): two 16-lane registers.
    pub(super) const NR: usize = 32;
    /// `k`-pairs per block: a `B` panel block is `KC · NR · 4` bytes (16 KiB), within L1 beside
    /// its `A` panel block (4 KiB).
    const KC: usize = 128;

    /// `A` (`m × k`) as `⌈m/8⌉` panels of `⌈k/2⌉` pairs × 8 rows (zero rows past `m`, a zero
    /// high half past `k`).
    fn pack_a(a: Strided, m: usize, k: usize) -> Vec<u32> {
        let mut packed = vec![0u32; m.div_ceil(MR) * k.div_ceil(2) * MR];
        pack::<MR>(a.data, a.col_stride, a.row_stride, k, m, &mut packed, false);
        packed
    }

    /// `B` (`k × n`) as `⌈n/32⌉` panels of `pairs` k-pairs × 32 columns (`pairs ≥ ⌈k/2⌉`; zero
    /// past `n` and `k`).
    pub(super) fn pack_b(b: Strided, k: usize, n: usize, pairs: usize, parallel: bool) -> Vec<u32> {
        let mut packed = vec![0u32; n.div_ceil(NR) * pairs * NR];
        pack::<NR>(b.data, b.row_stride, b.col_stride, k, n, &mut packed, parallel);
        packed
    }

    /// Packs a matrix given along two axes — `k` (the product's inner dim, `k_stride` apart) and
    /// `x` (`x_len` rows of `A` or columns of `B`, `x_stride` apart) — into panels of `W` along
    /// `x`, each `dst.len() / ⌈x_len/W⌉` pairs × `W` words (at least `⌈k/2⌉` pairs; the pairs past
    /// `k` stay zero): word `(p, w)` holds `(x0 + w, 2p)` in its low half and `(x0 + w, 2p + 1)`
    /// in its high half. `dst` is zeroed. Two layouts read
    /// whole runs: `k` contiguous (a row-major `A`, a transposed `B`: each pair is one word) and
    /// `x` contiguous (two runs of `W` interleaved); others go element by element.
    fn pack<const W: usize>(
        data: &[bf16],
        k_stride: usize,
        x_stride: usize,
        k: usize,
        x_len: usize,
        dst: &mut [u32],
        parallel: bool,
    ) {
        let pairs = k.div_ceil(2);
        let panel_len = dst.len() / x_len.div_ceil(W);
        let at = |x: usize, l: usize| data[x * x_stride + l * k_stride].to_bits() as u32;
        let panel = |(t, dst): (usize, &mut [u32])| {
            let x0 = t * W;
            let width = W.min(x_len - x0);
            if k_stride == 1 {
                let runs: Vec<&[bf16]> = (x0..x0 + width).map(|x| &data[x * x_stride..][..k]).collect();
                let word = |two: &[bf16]| two[0].to_bits() as u32 | (two[1].to_bits() as u32) << 16;
                for (p, d) in dst.chunks_mut(W).take(k / 2).enumerate() {
                    for (d, run) in d.iter_mut().zip(&runs) {
                        *d = word(&run[2 * p..2 * p + 2]);
                    }
                }
                if k % 2 == 1 {
                    for (d, run) in dst[(pairs - 1) * W..].iter_mut().zip(&runs) {
                        *d = run[k - 1].to_bits() as u32;
                    }
                }
            } else if x_stride == 1 {
                for (p, d) in dst.chunks_mut(W).take(pairs).enumerate() {
                    let lo = &data[2 * p * k_stride + x0..][..width];
                    if 2 * p + 1 < k {
                        let hi = &data[(2 * p + 1) * k_stride + x0..][..width];
                        for ((d, l), h) in d.iter_mut().zip(lo).zip(hi) {
                            *d = l.to_bits() as u32 | (h.to_bits() as u32) << 16;
                        }
                    } else {
                        for (d, l) in d.iter_mut().zip(lo) {
                            *d = l.to_bits() as u32;
                        }
                    }
                }
            } else {
                for p in 0..pairs {
                    for w in 0..width {
                        let hi = if 2 * p + 1 < k { at(x0 + w, 2 * p + 1) } else { 0 };
                        dst[p * W + w] = at(x0 + w, 2 * p) | hi << 16;
                    }
                }
            }
        };
        if parallel {
            dst.par_chunks_mut(panel_len).enumerate().for_each(panel);
        } else {
            dst.chunks_mut(panel_len).enumerate().for_each(panel);
        }
    }

    /// See [`super::gemm`]; the CPU has AVX-512 F and BF16.
    pub(super) fn gemm(m: usize, n: usize, k: usize, a: Strided, b: Strided, out: Out, parallel: bool) {
        let pairs = k.div_ceil(2);
        let (pa, pb) = (pack_a(a, m, k), pack_b(b, k, n, pairs, parallel));
        // The sums, panel-major: column panel `j` holds its m × 32 block, row-major.
        let mut c = vec![0f32; n.div_ceil(NR) * m * NR];
        let panel = |(j, cj): (usize, &mut [f32])| {
            let bj = &pb[j * pairs * NR..(j + 1) * pairs * NR];
            for p0 in (0..pairs).step_by(KC) {
                let len = KC.min(pairs - p0);
                for (t, ci) in cj.chunks_mut(MR * NR).enumerate() {
                    let ai = &pa[t * pairs * MR + p0 * MR..][..len * MR];
                    // SAFETY: the CPU has AVX-512 F and BF16 (the caller checked); `ai` holds
                    // `len` pairs × 8 rows, `bj[p0 * NR..]` `len` pairs × 32 columns, and `ci`
                    // the tile's `ci.len() / 32` rows of 32 sums.
                    unsafe { tile(ai.as_ptr(), bj[p0 * NR..].as_ptr(), len, ci, p0 == 0) };
                }
            }
        };
        if parallel {
            c.par_chunks_mut(m * NR).enumerate().for_each(panel);
        } else {
            c.chunks_mut(m * NR).enumerate().for_each(panel);
        }
        write_out(&c, m, m, out, parallel);
    }

    /// Rounds the panel-major sums `c` — each 32-column panel `rows × 32`, row-major, of which
    /// the first `m` rows are the product's — to bf16 into `out` (its layout: [`Out`]).
    pub(super) fn write_out(c: &[f32], rows: usize, m: usize, out: Out, parallel: bool) {
        let out = match out {
            Out::Rows(o) => o,
            Out::WidenedTransposed(o) => return widen_transposed(c, rows, m, o, parallel),
        };
        let n = out.len() / m;
        let round = |(i, row): (usize, &mut [MaybeUninit<bf16>])| {
            for (j, o) in row.chunks_mut(NR).enumerate() {
                let sums = &c[j * rows * NR + i * NR..][..o.len()];
                round(sums, o);
            }
        };
        if parallel {
            out.par_chunks_mut(n).enumerate().for_each(round);
        } else {
            out.chunks_mut(n).enumerate().for_each(round);
        }
    }

    /// The panel-major sums `c` (`rows` rows per 32-column panel, the first `m` the product's)
    /// rounded to bf16 and widened back, written transposed into `out` (`n × m`): each block of
    /// 16 rows of a panel is rounded in order, then written out column by column (runs of 16
    /// along the output's rows).
    fn widen_transposed(c: &[f32], rows: usize, m: usize, out: &mut [MaybeUninit<f32>], parallel: bool) {
        let transpose = |(j, cols): (usize, &mut [MaybeUninit<f32>])| {
            let width = cols.len() / m;
            let mut block = [MaybeUninit::<bf16>::uninit(); 16 * NR];
            for i0 in (0..m).step_by(16) {
                let h = 16.min(m - i0);
                let sums = &c[j * rows * NR + i0 * NR..][..h * NR];
                round(sums, &mut block[..h * NR]);
                for col in 0..width {
                    for r in 0..h {
                        // SAFETY: `round` wrote the block's first h · 32 elements.
                        let x = unsafe { block[r * NR + col].assume_init() };
                        cols[col * m + i0 + r].write(super::widen_bf16(x));
                    }
                }
            }
        };
        if parallel {
            out.par_chunks_mut(NR * m).enumerate().for_each(transpose);
        } else {
            out.chunks_mut(NR * m).enumerate().for_each(transpose);
        }
    }

    /// `out[i] = bf16(sums[i])` (`half`'s `bf16::from_f32`): [`round_to_bf16`] where the CPU has
    /// AVX-512 F, else one at a time (the emulated AMX tiles' tests run on any CPU).
    fn round(sums: &[f32], out: &mut [MaybeUninit<bf16>]) {
        if std::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512 F (checked just above).
            return unsafe { round_to_bf16(sums, out) };
        }
        for (o, v) in out.iter_mut().zip(sums) {
            o.write(super::round_bf16(*v));
        }
    }

    /// `out[i] = bf16(sums[i])`, rounded to nearest even (NaN kept quiet): `half`'s
    /// `bf16::from_f32`, 16 lanes at a time.
    ///
    /// # Safety
    /// The CPU has AVX-512 F; `out` is as long as `sums`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn round_to_bf16(sums: &[f32], out: &mut [MaybeUninit<bf16>]) {
        let mut chunks = sums.chunks_exact(16);
        for (i, v) in chunks.by_ref().enumerate() {
            let bits = _mm512_castps_si512(_mm512_loadu_ps(v.as_ptr()));
            let odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
            let up = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
            let rounded = _mm512_srli_epi32(up, 16);
            // NaN: the high half with the quiet bit set, as `half` does.
            let nan = _mm512_cmp_ps_mask(_mm512_castsi512_ps(bits), _mm512_castsi512_ps(bits), _CMP_UNORD_Q);
            let quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
            let halves = _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet));
            _mm256_storeu_si256(out[i * 16..].as_mut_ptr().cast(), halves);
        }
        let done = sums.len() - chunks.remainder().len();
        for (o, v) in out[done..].iter_mut().zip(chunks.remainder()) {
            o.write(bf16::from_f32(*v));
        }
    }

    /// One register tile: `c[r][0..32] (+)= Σ_p a[p][r] · b[p][0..32]` over `pairs` k-pairs, for
    /// the tile's rows `r < c.len() / 32` (at most 8); starts from zero when `first`, else from
    /// `c`.
    ///
    /// # Safety
    /// The CPU has AVX-512 F and BF16; `a` reaches `pairs · 8` words and `b` `pairs · 32`.
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn tile(a: *const u32, b: *const u32, pairs: usize, c: &mut [f32], first: bool) {
        let rows = c.len() / NR;
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        if !first {
            for (r, acc) in acc.iter_mut().enumerate().take(rows) {
                acc[0] = _mm512_loadu_ps(c[r * NR..].as_ptr());
                acc[1] = _mm512_loadu_ps(c[r * NR + 16..].as_ptr());
            }
        }
        for p in 0..pairs {
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(p * NR).cast()));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.add(p * NR + 16).cast()));
            for (r, acc) in acc.iter_mut().enumerate() {
                let ar: __m512bh = std::mem::transmute(_mm512_set1_epi32(*a.add(p * MR + r) as i32));
                acc[0] = _mm512_dpbf16_ps(acc[0], ar, b0);
                acc[1] = _mm512_dpbf16_ps(acc[1], ar, b1);
            }
        }
        for (r, acc) in acc.iter().enumerate().take(rows) {
            _mm512_storeu_ps(c[r * NR..].as_mut_ptr(), acc[0]);
            _mm512_storeu_ps(c[r * NR + 16..].as_mut_ptr(), acc[1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `rows × cols` values spread over ±2 (bf16-exact), stored transposed when `t`.
    fn matrix(rows: usize, cols: usize, t: bool, seed: u64) -> (Vec<bf16>, usize, usize) {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let v = (0..rows * cols)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                bf16::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0)
            })
            .collect();
        if t {
            (v, 1, rows)
        } else {
            (v, cols, 1)
        }
    }

    /// A product the tests run: a path this process has, or (x86-64) the AMX path's loops on
    /// emulated tiles (`amx::SoftTiles`), which every CPU runs.
    #[derive(Clone, Copy, Debug)]
    enum Product {
        Path(Bf16Gemm),
        #[cfg(target_arch = "x86_64")]
        EmulatedAmx,
    }

    impl std::fmt::Display for Product {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            match self {
                Product::Path(p) => p.fmt(f),
                #[cfg(target_arch = "x86_64")]
                Product::EmulatedAmx => f.write_str("amx on emulated tiles"),
            }
        }
    }

    /// Every product this process can run.
    fn products() -> Vec<Product> {
        let paths = Bf16Gemm::ALL.into_iter().filter(|p| p.available()).map(Product::Path);
        #[cfg(target_arch = "x86_64")]
        let paths = paths.chain([Product::EmulatedAmx]);
        paths.collect()
    }

    /// `product`'s `a · b` into `out` ([`gemm`]'s arguments).
    fn run(
        product: Product,
        (m, n, k): (usize, usize, usize),
        (a, b): (Strided, Strided),
        out: Out,
        parallel: bool,
    ) {
        match product {
            Product::Path(path) => gemm(path, (m, n, k), (a, b), out, parallel),
            #[cfg(target_arch = "x86_64")]
            Product::EmulatedAmx => {
                let parallel = parallel && rayon::current_num_threads() > 1;
                // SAFETY: the emulated tiles run on any CPU.
                unsafe { amx::gemm::<amx::SoftTiles>(m, n, k, a, b, out, parallel) }
            }
        }
    }

    /// `product`'s `a · b` rounded to bf16, `m × n` row-major.
    fn rows(
        product: Product,
        mnk: (usize, usize, usize),
        ab: (Strided, Strided),
        parallel: bool,
    ) -> Vec<bf16> {
        let mut out = vec![MaybeUninit::uninit(); mnk.0 * mnk.1];
        run(product, mnk, ab, Out::Rows(&mut out), parallel);
        // SAFETY: a product writes every element.
        out.iter().map(|o| unsafe { o.assume_init() }).collect()
    }

    /// Every product against the f64 product of the same bf16 values ([`within_rounding`]).
    fn check(m: usize, n: usize, k: usize, ta: bool, tb: bool, seed: u64, parallel: bool) {
        let (va, ra, ca) = matrix(m, k, ta, seed);
        let (vb, rb, cb) = matrix(k, n, tb, seed + 1);
        let a = Strided { data: &va, row_stride: ra, col_stride: ca };
        let b = Strided { data: &vb, row_stride: rb, col_stride: cb };
        for product in products() {
            let got = rows(product, (m, n, k), (a, b), parallel);
            if let Err(e) = within_rounding(m, n, k, a, b, &got) {
                panic!("{product}: {e}");
            }
        }
    }

    #[test]
    fn every_path_rounds_the_exact_product_of_small_shapes() {
        // Odd k (a half-filled last pair), m not a multiple of 8 (or 16), n not of 32, k past one
        // block (a tile's 32); m past two 16-row tiles (AMX's odd last block).
        for (m, n, k) in
            [(1, 1, 1), (3, 5, 7), (9, 33, 17), (8, 32, 2), (17, 70, 300), (128, 64, 257), (48, 32, 64)]
        {
            for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
                check(m, n, k, ta, tb, (m * n + k) as u64, false);
            }
        }
    }

    #[test]
    fn the_split_over_threads_gives_the_same_bits() {
        let pool = crate::kernels::threads::rank_pool(0, 3).unwrap();
        let (m, n, k) = (128, 200, 256);
        let (va, _, _) = matrix(m, k, false, 5);
        let (vb, _, _) = matrix(k, n, false, 6);
        let a = Strided { data: &va, row_stride: k, col_stride: 1 };
        let b = Strided { data: &vb, row_stride: n, col_stride: 1 };
        for product in products() {
            let bits = |parallel| {
                rows(product, (m, n, k), (a, b), parallel).iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            };
            let one = bits(false);
            assert_eq!(pool.install(|| bits(true)), one, "{product}");
        }
        pool.install(|| check(m, n, k, false, true, 9, true));
    }

    #[test]
    fn the_path_names_parse_back_and_unknown_ones_are_refused() {
        for p in Bf16Gemm::ALL.into_iter().filter(|p| p.available()) {
            assert_eq!(parse_path(p.name()), Ok(p));
        }
        assert_eq!(parse_path("tiles"), Err(PathError::Unknown("tiles".into())));
        assert_eq!(
            PathError::Unknown("tiles".into()).to_string(),
            "GRAPHPP_BF16_GEMM=\"tiles\" names no bf16 matmul path (expected one of: amx, avx512-bf16, widened)"
        );
        assert_eq!(parse_path(" WIDENED "), Ok(Bf16Gemm::Widened), "any case, spaces trimmed");
        for path in [Bf16Gemm::Amx, Bf16Gemm::Avx512Bf16].into_iter().filter(|p| !p.available()) {
            let e = parse_path(path.name()).unwrap_err();
            assert!(matches!(&e, PathError::Unavailable(p, why, _) if *p == path && !why.is_empty()), "{e}");
            eprintln!("not tested on the hardware here: {e}");
        }
    }

    /// The vector rounding gives `half`'s bits: ties to even both ways, the carry into the
    /// exponent, overflow to infinity, subnormals, infinities and NaNs.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_vector_rounding_is_halfs() {
        if !std::is_x86_feature_detected!("avx512f") {
            eprintln!("this CPU has no AVX-512 F: the vector rounding is not used here");
            return;
        }
        let sums = crate::kernels::tensor::rounding_cases(4096);
        let mut out = vec![MaybeUninit::uninit(); sums.len()];
        // SAFETY: the CPU has AVX-512 F (checked above), and the lengths are equal.
        unsafe { packed::round_to_bf16(&sums, &mut out) };
        for (x, o) in sums.iter().zip(&out) {
            // SAFETY: every element was written.
            let got = unsafe { o.assume_init() }.to_bits();
            assert_eq!(got, bf16::from_f32(*x).to_bits(), "{:#010x}", x.to_bits());
        }
    }

    #[test]
    fn a_zero_depth_product_is_zeros() {
        let mut out = vec![MaybeUninit::new(bf16::ONE); 6];
        let empty = Strided { data: &[], row_stride: 0, col_stride: 0 };
        gemm(Bf16Gemm::Widened, (2, 3, 0), (empty, empty), Out::Rows(&mut out), false);
        assert!(out.iter().all(|o| unsafe { o.assume_init() } == bf16::ZERO));
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

        #[test]
        fn every_path_rounds_the_exact_product(
            m in 1usize..40, n in 1usize..80, k in 1usize..300, ta: bool, tb: bool, seed in 0u64..1000
        ) {
            check(m, n, k, ta, tb, seed, false);
        }

        /// The transposed, widened layout holds the plain product's values widened, element
        /// (j, i) for (i, j), on every available path, split over threads or not (m past a 16-row block, n past a
        /// 32-column panel).
        #[test]
        fn the_transposed_layout_holds_the_same_bits(
            m in 1usize..50, n in 1usize..80, k in 1usize..300, ta: bool, parallel: bool, seed in 0u64..1000
        ) {
            let (va, ra, ca) = matrix(m, k, ta, seed);
            let (vb, rb, cb) = matrix(k, n, false, seed + 1);
            let a = Strided { data: &va, row_stride: ra, col_stride: ca };
            let b = Strided { data: &vb, row_stride: rb, col_stride: cb };
            let pool = crate::kernels::threads::rank_pool(0, 2).unwrap();
            for product in products() {
                let (mut plain, mut transposed) = (vec![MaybeUninit::uninit(); m * n], vec![MaybeUninit::uninit(); m * n]);
                pool.install(|| {
                    run(product, (m, n, k), (a, b), Out::Rows(&mut plain), parallel);
                    run(product, (m, n, k), (a, b), Out::WidenedTransposed(&mut transposed), parallel);
                });
                for i in 0..m {
                    for j in 0..n {
                        // SAFETY: both products write every element.
                        let (x, y) = unsafe { (plain[i * n + j].assume_init(), transposed[j * m + i].assume_init()) };
                        prop_assert_eq!(x.to_f32().to_bits(), y.to_bits(), "{} ({}, {})", product, i, j);
                    }
                }
            }
        }
    }
}
