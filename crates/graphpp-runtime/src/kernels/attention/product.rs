//! The small dense products of attention's tiles (`q kᵀ`, `P v`, `g vᵀ`, `dS k`, `dSᵀ q`, `Pᵀ g`:
//! at most 128 × 128 × E), register-blocked without packing, summing only where the mask lets a
//! term be non-zero.
//!
//! gemm packs both operands into panels before its micro-kernel runs, once per call, and cannot
//! know that a causal mask zeroes a third of a 64 × 64 tile's terms, so on attention's tiles
//! these blocks are faster than gemm calls, forward and backward (measured:
//! docs/PERFORMANCE.md, "Attention"). Here each block of [`MR`] × [`NR`] outputs is summed in
//! registers straight from the operands (the rhs's rows are contiguous: a transposed rhs is
//! copied first by the caller), and a caller-given *reach* names, per block, the range of the
//! inner index whose terms may be non-zero; the others are known zeros and are not added. Every
//! output element is the sum of its terms in ascending order of the inner index, starting from
//! the destination (when accumulating) or +0, so a block's bits do not depend on the block
//! sizes, the operands' strides, or the reach (adding a zero term changes no bit of a finite
//! sum, `x + (±0) = x`, up to the sign of a zero).
//!
//! Built for AVX2 with FMA where the CPU has them (one rounding per multiply-add, as the
//! GPU kernels do), else with a separate multiply and add.

use std::ops::Range;

/// Output rows per register block.
pub(super) const MR: usize = 4;
/// Output columns per register block: two AVX2 registers of f32 (`MR · NR / 8` = 8 accumulator
/// registers, 3 more for the operands: 11 of the 16).
const NR: usize = 16;

/// A matrix read in place: element (i, j) at `data[i · rs + j · cs]`.
#[derive(Clone, Copy, Debug)]
pub(super) struct Mat<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

/// The output: element (i, j) at `data[i · rs + j]`.
#[derive(Debug)]
pub(super) struct Out<'a> {
    pub data: &'a mut [f32],
    pub rs: usize,
}

/// `out[i][j] (+)= Σ_{p ∈ reach} a[i][p] · b[p][j]` for `i < m`, `j < n` (`(m, n, k)` the sizes):
/// added to `out` when `accumulate`, else written over it. `reach(rows, cols)` is the range of
/// `p` (clipped to `0..k`) whose terms may be non-zero for the outputs `rows × cols` (a block of
/// at most [`MR`] × [`NR`]); `b`'s columns must be contiguous (`b.cs == 1`).
///
/// Panics where an operand's extent passes its slice or `b.cs != 1` (a bug in the caller: the
/// kernels' sizes come from checked shapes).
pub(super) fn product(
    (m, n, k): (usize, usize, usize),
    out: Out,
    accumulate: bool,
    a: Mat,
    b: Mat,
    reach: impl Fn(Range<usize>, Range<usize>) -> Range<usize>,
) {
    if m == 0 || n == 0 {
        return;
    }
    // Checked: the unchecked reads in `block` rely on these bounds.
    let extent = |rows: usize, rs: usize, cols: usize, cs: usize| {
        (rows - 1).checked_mul(rs)?.checked_add((cols - 1).checked_mul(cs)?)?.checked_add(1)
    };
    let fits = |e: Option<usize>, len: usize| e.is_some_and(|e| e <= len);
    assert!(b.cs == 1, "attention: a product's rhs must have contiguous columns");
    assert!(fits(extent(m, out.rs, n, 1), out.data.len()), "attention: product output too short");
    assert!(k == 0 || fits(extent(m, a.rs, k, a.cs), a.data.len()), "attention: product lhs too short");
    assert!(k == 0 || fits(extent(k, b.rs, n, 1), b.data.len()), "attention: product rhs too short");
    let task = Task { n, k, out, accumulate, a, b };
    #[cfg(target_arch = "x86_64")]
    if avx2_fma() {
        // SAFETY: the CPU has AVX2 and FMA (checked just above).
        return unsafe { run_fma(m, task, &reach) };
    }
    run::<false>(m, task, &reach)
}

/// Whether the CPU has AVX2 and FMA: the attention kernels' vector build (false off x86-64).
pub(super) fn avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// One call's operands (sizes checked by [`product`]).
struct Task<'a, 'b> {
    n: usize,
    k: usize,
    out: Out<'a>,
    accumulate: bool,
    a: Mat<'b>,
    b: Mat<'b>,
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn run_fma(m: usize, task: Task, reach: &impl Fn(Range<usize>, Range<usize>) -> Range<usize>) {
    run::<true>(m, task, reach)
}

/// The blocks of a product in turn: full [`MR`] × [`NR`] blocks in registers, the ragged edge
/// one element at a time (the same sums in the same order).
#[inline(always)]
fn run<const FMA: bool>(m: usize, mut t: Task, reach: &impl Fn(Range<usize>, Range<usize>) -> Range<usize>) {
    for i0 in (0..m).step_by(MR) {
        let rows = i0..(i0 + MR).min(m);
        for j0 in (0..t.n).step_by(NR) {
            let cols = j0..(j0 + NR).min(t.n);
            let r = reach(rows.clone(), cols.clone());
            let terms = r.start.min(t.k)..r.end.min(t.k);
            if rows.len() == MR && cols.len() == NR {
                block::<FMA>(&mut t, i0, j0, terms);
            } else {
                edge::<FMA>(&mut t, rows.clone(), cols, terms);
            }
        }
    }
}

/// `x · y + z`: fused where `FMA` (one rounding), else multiplied and added.
#[inline(always)]
fn madd<const FMA: bool>(x: f32, y: f32, z: f32) -> f32 {
    if FMA {
        x.mul_add(y, z)
    } else {
        x * y + z
    }
}

/// One full block: outputs `i0..i0 + MR` × `j0..j0 + NR` summed in registers over `terms`.
#[inline(always)]
fn block<const FMA: bool>(t: &mut Task, i0: usize, j0: usize, terms: Range<usize>) {
    let mut acc = [[0f32; NR]; MR];
    if t.accumulate {
        for (r, row) in acc.iter_mut().enumerate() {
            let at = (i0 + r) * t.out.rs + j0;
            row.copy_from_slice(&t.out.data[at..at + NR]);
        }
    }
    let (a, b) = (t.a, t.b);
    for p in terms {
        let brow: &[f32; NR] = b.data[p * b.rs + j0..][..NR].try_into().expect("NR elements");
        for (r, row) in acc.iter_mut().enumerate() {
            // SAFETY: i0 + r < m and p < k, inside a's extent (checked by `product`).
            let x = unsafe { *a.data.get_unchecked((i0 + r) * a.rs + p * a.cs) };
            for (y, &w) in row.iter_mut().zip(brow) {
                *y = madd::<FMA>(x, w, *y);
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        let at = (i0 + r) * t.out.rs + j0;
        t.out.data[at..at + NR].copy_from_slice(row);
    }
}

/// A ragged block (fewer than [`MR`] rows or [`NR`] columns), summed in place in the output.
#[inline(always)]
fn edge<const FMA: bool>(t: &mut Task, rows: Range<usize>, cols: Range<usize>, terms: Range<usize>) {
    let (a, b) = (t.a, t.b);
    for i in rows {
        let out = &mut t.out.data[i * t.out.rs + cols.start..i * t.out.rs + cols.end];
        if !t.accumulate {
            out.fill(0.0);
        }
        for p in terms.clone() {
            let x = a.data[i * a.rs + p * a.cs];
            let brow = &b.data[p * b.rs + cols.start..p * b.rs + cols.end];
            for (y, &w) in out.iter_mut().zip(brow) {
                *y = madd::<FMA>(x, w, *y);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32).map(|i| ((i.wrapping_mul(2654435761) ^ seed) % 2001) as f32 / 1000.0 - 1.0).collect()
    }

    /// `a · b` in f64, `a` on (rs, cs), `b` row-major.
    fn naive((m, n, k): (usize, usize, usize), a: Mat, b: Mat) -> Vec<f64> {
        let mut c = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] =
                    (0..k).map(|p| a.data[i * a.rs + p * a.cs] as f64 * b.data[p * b.rs + j] as f64).sum();
            }
        }
        c
    }

    #[test]
    fn products_match_f64_on_ragged_sizes_and_strided_lhs() {
        for (m, n, k) in [(4, 16, 32), (64, 64, 32), (5, 17, 3), (1, 1, 1), (7, 40, 9), (130, 33, 64)] {
            for transposed in [false, true] {
                let (av, bv) = (values(m * k, 7), values(k * n, 11));
                let a = if transposed {
                    Mat { data: &av, rs: 1, cs: m }
                } else {
                    Mat { data: &av, rs: k, cs: 1 }
                };
                let b = Mat { data: &bv, rs: n, cs: 1 };
                let mut out = values(m * n, 3);
                let before = out.clone();
                product((m, n, k), Out { data: &mut out, rs: n }, true, a, b, |_, _| 0..k);
                let want = naive((m, n, k), a, b);
                for (i, (&o, &w)) in out.iter().zip(&want).enumerate() {
                    let w = w + before[i] as f64;
                    assert!((o as f64 - w).abs() <= 1e-5 * (1.0 + w.abs()), "{m}×{n}×{k} [{i}]: {o} vs {w}");
                }
            }
        }
    }

    #[test]
    fn the_multiply_then_add_build_matches_f64_too() {
        // What a CPU without FMA runs (the tests' host takes the FMA build through `product`).
        let (m, n, k) = (9, 37, 20);
        let (av, bv) = (values(m * k, 13), values(k * n, 17));
        let (a, b) = (Mat { data: &av, rs: k, cs: 1 }, Mat { data: &bv, rs: n, cs: 1 });
        let mut out = vec![0f32; m * n];
        let task = Task { n, k, out: Out { data: &mut out, rs: n }, accumulate: false, a, b };
        run::<false>(m, task, &|_, _| 0..k);
        for (&o, w) in out.iter().zip(naive((m, n, k), a, b)) {
            assert!((o as f64 - w).abs() <= 1e-5 * (1.0 + w.abs()), "{o} vs {w}");
        }
    }

    #[test]
    fn a_reach_that_leaves_out_only_zero_terms_changes_no_bit() {
        // Causal-like zeros: a[i][p] = 0 for p > i; the reach of rows i0..i1 stops at i1.
        let (m, n, k) = (37, 40, 37);
        let mut av = values(m * k, 5);
        for i in 0..m {
            av[i * k + i + 1..(i + 1) * k].fill(0.0);
        }
        let bv = values(k * n, 9);
        let (a, b) = (Mat { data: &av, rs: k, cs: 1 }, Mat { data: &bv, rs: n, cs: 1 });
        let run = |reach: &dyn Fn(Range<usize>, Range<usize>) -> Range<usize>| {
            let mut out = vec![f32::NAN; m * n];
            product((m, n, k), Out { data: &mut out, rs: n }, false, a, b, reach);
            out.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        };
        assert_eq!(run(&|rows, _| 0..rows.end), run(&|_, _| 0..k));
        // An empty reach writes zeros (not accumulating).
        assert!(run(&|_, _| 0..0).iter().all(|&x| x == 0));
    }
}
