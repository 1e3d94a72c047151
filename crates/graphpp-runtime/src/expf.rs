//! `e^x` over f32 slices with the bits of the C library's `expf`, four lanes at a time.
//!
//! The compiled executor must compute what the interpreter computes, and the interpreter's `exp`
//! is candle's, which calls the platform's `expf` one element at a time (glibc's `__expf_fma` on
//! a CPU with FMA: 4–8 ns an element here, a third of the fused kernels' time in a `tiny` step).
//! glibc's algorithm (Szabolcs Nagy's, from Arm's optimized-routines) works in double precision:
//! with `z = x · 32/ln 2`, `k = round(z)` and `r = z − k`, `e^x = 2^(k/32) · p(r)` where
//! `2^(i/32)` comes from a 32-entry table and `p` is a cubic; the result is rounded to f32 once.
//! Evaluated in the same order with the same fused multiply-adds as `__expf_fma` it gives the
//! same bits: checked here for every f32 in [−103.9, 88.7] (2.24·10⁹ values, a 25 s loop; the
//! unit tests check a dense sample). The table is computed, not copied: entry `i` is the bits of
//! the double nearest `2^(i/32)` minus `i · 2^47`, so that adding `k · 2^47` puts `k/32`'s whole
//! part into the exponent.
//!
//! The vector path runs only where it is known to match: x86-64 with AVX2 and FMA (where glibc
//! picks `__expf_fma`), and only after a self-check against `f32::exp` on this process's libm;
//! elsewhere, and for lanes outside [−103, 88.5] (a causal mask's −10⁹, infinities, NaN), the
//! scalar [`exp`] runs.

use std::sync::OnceLock;

/// `e^x`, the libm value, without libm's slow under- and overflow path where the answer is
/// known: below −104 the exact value is under half the least subnormal (e^−103.28), so rounds to
/// +0.0; above 89 it exceeds `f32::MAX` (e^88.72), so is +∞. A causal mask's −1e9 scores hit the
/// first case for half the attention matrix (libm's `__math_uflowf` took 1.6% of a `train` step
/// in `perf`).
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    if x < -104.0 {
        0.0
    } else if x > 89.0 {
        f32::INFINITY
    } else {
        x.exp()
    }
}

/// Lanes in `[LOW, HIGH]` take the vector path (inside the range checked bit for bit).
const LOW: f32 = -103.0;
const HIGH: f32 = 88.5;

/// `d[i] = e^(±x[i])` (`−x` when `negate`), libm's bits. Panics if the lengths differ.
#[inline]
pub fn exp_slice(x: &[f32], d: &mut [f32], negate: bool) {
    assert_eq!(x.len(), d.len(), "exp_slice: operand and output lengths differ");
    #[cfg(target_arch = "x86_64")]
    if vector_ok() {
        // SAFETY: `vector_ok` saw AVX2 and FMA on this CPU.
        return unsafe { x86::exp_avx2_fma(x, d, negate) };
    }
    scalar(x, d, negate)
}

fn scalar(x: &[f32], d: &mut [f32], negate: bool) {
    for (v, &x) in d.iter_mut().zip(x) {
        *v = exp(if negate { -x } else { x });
    }
}

/// True when the vector path runs: the CPU has AVX2 and FMA and the path reproduced `f32::exp`
/// on a sample spread over its range (once per process).
pub fn vector_ok() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            let xs = self_check_inputs();
            let mut got = vec![0f32; xs.len()];
            // SAFETY: AVX2 and FMA were detected just above.
            unsafe { x86::exp_avx2_fma(&xs, &mut got, false) };
            return xs.iter().zip(&got).all(|(x, g)| x.exp().to_bits() == g.to_bits());
        }
        false
    })
}

/// 4096 inputs spread over the vector range, and two whose results lie within 10⁻⁹ of a
/// rounding boundary (where a different evaluation order gives the neighbouring float).
fn self_check_inputs() -> Vec<f32> {
    let mut xs: Vec<f32> = (0..4096).map(|i| LOW + (HIGH - LOW) * (i as f32 + 0.37) / 4096.0).collect();
    xs.extend([f32::from_bits(0x4202_422f), f32::from_bits(0xc27c_65d9)]);
    xs
}

/// glibc's constants: 32/ln 2, the rounding shift 1.5·2^52, the cubic's coefficients scaled by
/// 32^−3, 32^−2, 32^−1, and the table of `2^(i/32)`.
struct Consts {
    inv_ln2_n: f64,
    shift: f64,
    c: [f64; 3],
    table: [u64; 32],
}

fn consts() -> &'static Consts {
    static C: OnceLock<Consts> = OnceLock::new();
    C.get_or_init(|| {
        let n = 32.0f64;
        let mut table = [0u64; 32];
        for (i, t) in table.iter_mut().enumerate() {
            *t = (i as f64 / n).exp2().to_bits().wrapping_sub((i as u64) << 47);
        }
        Consts {
            inv_ln2_n: f64::from_bits(0x3FF7_1547_652B_82FE) * n,
            shift: f64::from_bits(0x4338_0000_0000_0000),
            c: [
                f64::from_bits(0x3FAC_6AF8_4B91_2394) / (n * n * n),
                f64::from_bits(0x3FCE_BFCE_50FA_C4F3) / (n * n),
                f64::from_bits(0x3FE6_2E42_FF0C_52D6) / n,
            ],
            table,
        }
    })
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{consts, exp, HIGH, LOW};
    use std::arch::x86_64::*;

    /// [`super::exp_slice`] four lanes at a time: each as `__expf_fma` computes it (the multiply
    /// by 32/ln 2 fused into both the rounding and the remainder, the cubic in three fused
    /// multiply-adds), then lanes outside `[LOW, HIGH]` redone by the scalar [`exp`].
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA; `x` and `d` have equal lengths.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_avx2_fma(x: &[f32], d: &mut [f32], negate: bool) {
        let k = consts();
        let inv = _mm256_set1_pd(k.inv_ln2_n);
        let shift = _mm256_set1_pd(k.shift);
        let [c0, c1, c2] = k.c.map(|c| _mm256_set1_pd(c));
        let one = _mm256_set1_pd(1.0);
        let low_bits = _mm256_set1_epi64x(31);
        let (lo, hi) = (_mm_set1_ps(LOW), _mm_set1_ps(HIGH));
        let sign = _mm_set1_ps(if negate { -0.0 } else { 0.0 });
        let n = x.len() / 4 * 4;
        for i in (0..n).step_by(4) {
            // SAFETY: i + 4 ≤ n ≤ x.len() = d.len().
            let xs = _mm_xor_ps(unsafe { _mm_loadu_ps(x.as_ptr().add(i)) }, sign);
            let xd = _mm256_cvtps_pd(xs);
            let kd = _mm256_fmadd_pd(inv, xd, shift);
            let ki = _mm256_castpd_si256(kd);
            let r = _mm256_fmsub_pd(inv, xd, _mm256_sub_pd(kd, shift));
            let idx = _mm256_and_si256(ki, low_bits);
            // SAFETY: every index is below 32, the table's length.
            let t = unsafe { _mm256_i64gather_epi64::<8>(k.table.as_ptr() as *const i64, idx) };
            let s = _mm256_castsi256_pd(_mm256_add_epi64(t, _mm256_slli_epi64::<47>(ki)));
            let z = _mm256_fmadd_pd(c0, r, c1);
            let y = _mm256_fmadd_pd(c2, r, one);
            let y = _mm256_fmadd_pd(z, _mm256_mul_pd(r, r), y);
            let out = _mm256_cvtpd_ps(_mm256_mul_pd(y, s));
            // SAFETY: as the load.
            unsafe { _mm_storeu_ps(d.as_mut_ptr().add(i), out) };
            // Lanes outside the range (NaN compares false, so is outside too).
            let inside = _mm_and_ps(_mm_cmpge_ps(xs, lo), _mm_cmple_ps(xs, hi));
            if _mm_movemask_ps(inside) != 0b1111 {
                for j in i..i + 4 {
                    d[j] = exp(if negate { -x[j] } else { x[j] });
                }
            }
        }
        for j in n..x.len() {
            d[j] = exp(if negate { -x[j] } else { x[j] });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every 1021st f32 bit pattern (4.2 million values, both signs, all magnitudes), the
    /// self-check's near-ties and the special values, through the slice path and the scalar one:
    /// libm's bits, NaN for NaN.
    #[test]
    fn slices_give_libm_bits() {
        let mut xs: Vec<f32> = (0..u32::MAX / 1021).map(|i| f32::from_bits(i * 1021)).collect();
        xs.extend(self_check_inputs());
        xs.extend([
            -1e9,
            -104.0,
            -103.5,
            LOW,
            HIGH,
            88.6,
            88.8,
            89.0,
            100.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            0.0,
            -0.0,
            1e-40,
            -1e-40,
            1.0,
        ]);
        for negate in [false, true] {
            let mut d = vec![0f32; xs.len()];
            exp_slice(&xs, &mut d, negate);
            let mut s = vec![0f32; xs.len()];
            scalar(&xs, &mut s, negate);
            for (i, &x) in xs.iter().enumerate() {
                let x = if negate { -x } else { x };
                let want = x.exp();
                if want.is_nan() {
                    assert!(d[i].is_nan() && s[i].is_nan(), "e^{x}");
                } else {
                    assert_eq!((d[i].to_bits(), s[i].to_bits()), (want.to_bits(), want.to_bits()), "e^{x}");
                }
            }
        }
    }

    #[test]
    fn the_scalar_shortcut_is_libms_everywhere() {
        let mut xs = vec![
            -1e9, -1e4, -105.0, -104.0, -103.99, -103.5, -87.4, -1.0, 0.0, 1.0, 88.7, 88.73, 89.0, 89.01, 1e9,
        ];
        xs.extend([f32::INFINITY, f32::NEG_INFINITY, -0.0]);
        xs.extend((0..20_000).map(|i| -110.0 + i as f32 * 0.01));
        for x in xs {
            assert_eq!(exp(x).to_bits(), x.exp().to_bits(), "e^{x}");
        }
        assert!(exp(f32::NAN).is_nan());
    }

    /// The vector path is the one under test on a CPU that has it (not a silent fallback).
    #[test]
    fn the_vector_path_runs_where_the_cpu_has_it() {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            assert!(vector_ok(), "AVX2 + FMA present but the self-check failed against this libm");
        }
    }

    /// Lengths that are not a multiple of the lane count, and the empty slice.
    #[test]
    fn ragged_tails() {
        for len in 0..11 {
            let xs: Vec<f32> = (0..len).map(|i| i as f32 * 0.7 - 3.0).collect();
            let mut d = vec![f32::NAN; len];
            exp_slice(&xs, &mut d, false);
            for (x, v) in xs.iter().zip(&d) {
                assert_eq!(v.to_bits(), x.exp().to_bits(), "len {len}, e^{x}");
            }
        }
    }
}
