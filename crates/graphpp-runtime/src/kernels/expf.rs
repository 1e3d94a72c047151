//! `e^x` over f32 slices with the bits of the C library's `expf`, eight lanes at a time (four
//! without AVX-512).
//!
//! The compiled executor must compute what the interpreter computes, and the interpreter's `exp`
//! is candle's, which calls the platform's `expf` one element at a time (glibc's `__expf_fma` on
//! a CPU with FMA: 4–8 ns an element here, a third of the fused kernels' time in a `tiny` step).
//! glibc's algorithm (Szabolcs Nagy's, from Arm's optimized-routines) works in double precision:
//! with `z = x · 32/ln 2`, `k = round(z)` and `r = z − k`, `e^x = 2^(k/32) · p(r)` where
//! `2^(i/32)` comes from a 32-entry table and `p` is a cubic; the result is rounded to f32 once.
//! Evaluated in the same order with the same fused multiply-adds as `__expf_fma` it gives the
//! same bits: checked for every f32 in [−103.9, 88.7] (2.24·10⁹ values, 25 s in release: the
//! ignored test `every_f32_in_the_vector_range`; the unit tests check a dense sample). Entry `i`
//! of the table ([`TABLE`]) is the bits of the double nearest `2^(i/32)` minus `i · 2^47`, so that
//! adding `k · 2^47` puts `k/32`'s whole part into the exponent.
//!
//! The vector path runs only where it is known to match: Linux with glibc on x86-64 with AVX-512
//! or AVX2, and FMA (where glibc picks `__expf_fma`), and only after a self-check against `f32::exp`;
//! elsewhere the scalar [`exp`] runs. Within the vector path, lanes below −104 and above 89 get
//! [`exp`]'s +0 and +∞ by a blend (a causal mask's −10⁹ scores fill half of every attention row);
//! the few others outside [−103, 88.5] (the gaps next to those, NaN) are redone by [`exp`].

use std::mem::MaybeUninit;
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
    exp_into(x, as_uninit(d), negate);
}

/// `d` as a slice that [`exp_into`] writes: only initialised values are ever written through
/// it, so `d` stays initialised.
fn as_uninit(d: &mut [f32]) -> &mut [MaybeUninit<f32>] {
    // SAFETY: `MaybeUninit<f32>` has f32's layout; the callers write only initialised values.
    unsafe { &mut *(d as *mut [f32] as *mut [MaybeUninit<f32>]) }
}

/// [`exp_slice`] into an output that may be uninitialised (every element is written).
#[inline]
pub fn exp_into(x: &[f32], d: &mut [MaybeUninit<f32>], negate: bool) {
    assert_eq!(x.len(), d.len(), "exp_into: operand and output lengths differ");
    #[cfg(all(target_arch = "x86_64", target_os = "linux", target_env = "gnu"))]
    match vector_path() {
        // SAFETY: `vector_path` saw AVX-512 (F, VL, DQ) and FMA on this CPU; the lengths are
        // equal (asserted).
        Some(Path::Avx512) => return unsafe { x86::exp_avx512(x, d, negate) },
        // SAFETY: `vector_path` saw AVX2 and FMA on this CPU; the lengths are equal (asserted).
        Some(Path::Avx2) => return unsafe { x86::exp_avx2_fma(x, d, negate) },
        None => {}
    }
    scalar(x, d, negate)
}

/// Which vector kernel [`exp_slice`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// Eight lanes at a time, the table read with two in-register permutes (AVX-512 F, VL, DQ).
    Avx512,
    /// Four lanes at a time, the table read with a gather (AVX2).
    Avx2,
}

fn scalar(x: &[f32], d: &mut [MaybeUninit<f32>], negate: bool) {
    for (v, &x) in d.iter_mut().zip(x) {
        v.write(exp(if negate { -x } else { x }));
    }
}

/// The vector kernel [`exp_slice`] runs, if any: glibc on x86-64, the CPU has the kernel's
/// instructions, and the kernel reproduced `f32::exp` on a sample spread over its range (checked
/// once per process; the AVX-512 kernel is preferred, the AVX2 one is the fallback).
pub fn vector_path() -> Option<Path> {
    static PATH: OnceLock<Option<Path>> = OnceLock::new();
    *PATH.get_or_init(|| {
        #[cfg(all(target_arch = "x86_64", target_os = "linux", target_env = "gnu"))]
        {
            let xs = self_check_inputs();
            let matches = |got: &[f32]| xs.iter().zip(got).all(|(x, g)| x.exp().to_bits() == g.to_bits());
            let mut got = vec![0f32; xs.len()];
            if x86::has_avx512() {
                // SAFETY: the CPU has AVX-512 F, VL, DQ and FMA (checked just above).
                unsafe { x86::exp_avx512(&xs, as_uninit(&mut got), false) };
                if matches(&got) {
                    return Some(Path::Avx512);
                }
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                // SAFETY: AVX2 and FMA were detected just above.
                unsafe { x86::exp_avx2_fma(&xs, as_uninit(&mut got), false) };
                if matches(&got) {
                    return Some(Path::Avx2);
                }
            }
        }
        None
    })
}

/// 4096 inputs spread over the vector range, and two whose results lie within 10⁻⁹ of a
/// rounding boundary (where a different evaluation order gives the neighbouring float).
fn self_check_inputs() -> Vec<f32> {
    let mut xs: Vec<f32> = (0..4096).map(|i| LOW + (HIGH - LOW) * (i as f32 + 0.37) / 4096.0).collect();
    xs.extend([f32::from_bits(0x4202_422f), f32::from_bits(0xc27c_65d9)]);
    xs
}

/// `2^(i/32)` as the bits of the nearest double, minus `i · 2^47` (glibc's `__exp2f_data.tab`
/// holds the same numbers; these were printed from `f64::exp2` and pass the exhaustive check).
const TABLE: [u64; 32] = [
    0x3FF0000000000000,
    0x3FEFD9B0D3158574,
    0x3FEFB5586CF9890F,
    0x3FEF9301D0125B51,
    0x3FEF72B83C7D517B,
    0x3FEF54873168B9AA,
    0x3FEF387A6E756238,
    0x3FEF1E9DF51FDEE1,
    0x3FEF06FE0A31B715,
    0x3FEEF1A7373AA9CB,
    0x3FEEDEA64C123422,
    0x3FEECE086061892D,
    0x3FEEBFDAD5362A27,
    0x3FEEB42B569D4F82,
    0x3FEEAB07DD485429,
    0x3FEEA47EB03A5585,
    0x3FEEA09E667F3BCD,
    0x3FEE9F75E8EC5F74,
    0x3FEEA11473EB0187,
    0x3FEEA589994CCE13,
    0x3FEEACE5422AA0DB,
    0x3FEEB737B0CDC5E5,
    0x3FEEC49182A3F090,
    0x3FEED503B23E255D,
    0x3FEEE89F995AD3AD,
    0x3FEEFF76F2FB5E47,
    0x3FEF199BDD85529C,
    0x3FEF3720DCEF9069,
    0x3FEF5818DCFBA487,
    0x3FEF7C97337B9B5F,
    0x3FEFA4AFA2A490DA,
    0x3FEFD0765B6E4540,
];

/// 32/ln 2 (the double nearest 1/ln 2, times 32 exactly).
const INV_LN2_N: f64 = f64::from_bits(0x3FF7_1547_652B_82FE) * 32.0;
/// 1.5 · 2^52: adding it rounds a double of magnitude below 2^51 to an integer, kept in the low
/// bits of the sum.
const SHIFT: f64 = f64::from_bits(0x4338_0000_0000_0000);

/// The cubic's coefficients (of 2^(r/32) − 1 in r = z − k), scaled by 32^−3, 32^−2, 32^−1
/// (powers of two: exact).
const COEFFICIENTS: [f64; 3] = [
    f64::from_bits(0x3FAC_6AF8_4B91_2394) / 32768.0,
    f64::from_bits(0x3FCE_BFCE_50FA_C4F3) / 1024.0,
    f64::from_bits(0x3FE6_2E42_FF0C_52D6) / 32.0,
];

#[cfg(all(target_arch = "x86_64", target_os = "linux", target_env = "gnu"))]
mod x86 {
    use super::{COEFFICIENTS, HIGH, INV_LN2_N, LOW, SHIFT, TABLE};
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;

    /// Whether the CPU has what [`exp_avx512`] needs (AVX-512 F, VL, DQ, AVX2, FMA).
    pub fn has_avx512() -> bool {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512dq")
            && is_x86_feature_detected!("fma")
    }

    /// [`exp_avx2_fma`]'s arithmetic eight lanes at a time in 512-bit registers. The 32-entry
    /// table lives in four registers and is read with two two-register permutes and a blend on
    /// the index's bit 4, in place of a gather (gathers are slow on CPUs with the Downfall
    /// microcode fix). Same operations per lane in the same order, so the same bits.
    ///
    /// # Safety
    /// The CPU must have what [`has_avx512`] checks; `x` and `d` have equal lengths.
    #[target_feature(enable = "avx512f,avx512vl,avx512dq,avx2,fma")]
    pub unsafe fn exp_avx512(x: &[f32], d: &mut [MaybeUninit<f32>], negate: bool) {
        let table =
            |i: usize| _mm512_castsi512_pd(unsafe { _mm512_loadu_si512(TABLE.as_ptr().add(i) as *const _) });
        let (t0, t1, t2, t3) = (table(0), table(8), table(16), table(24));
        let inv = _mm512_set1_pd(INV_LN2_N);
        let shift = _mm512_set1_pd(SHIFT);
        let [c0, c1, c2] = COEFFICIENTS.map(|c| _mm512_set1_pd(c));
        let one = _mm512_set1_pd(1.0);
        let bit4 = _mm512_set1_epi64(16);
        let (lo, hi) = (_mm256_set1_ps(LOW), _mm256_set1_ps(HIGH));
        let (zero_below, inf_above, inf) =
            (_mm256_set1_ps(-104.0), _mm256_set1_ps(89.0), _mm256_set1_ps(f32::INFINITY));
        let sign = _mm256_set1_ps(if negate { -0.0 } else { 0.0 });
        let n = x.len() / 8 * 8;
        for i in (0..n).step_by(8) {
            // SAFETY: i + 8 ≤ n ≤ x.len() = d.len().
            let xs = _mm256_xor_ps(unsafe { _mm256_loadu_ps(x.as_ptr().add(i)) }, sign);
            let under = _mm256_cmp_ps_mask::<_CMP_LT_OQ>(xs, zero_below);
            if under == 0xff {
                // Eight lanes below −104 (a causal mask's run): +0 each. SAFETY: as the load.
                unsafe { _mm256_storeu_ps(d.as_mut_ptr().cast::<f32>().add(i), _mm256_setzero_ps()) };
                continue;
            }
            let xd = _mm512_cvtps_pd(xs);
            let kd = _mm512_fmadd_pd(inv, xd, shift);
            let ki = _mm512_castpd_si512(kd);
            let r = _mm512_fmsub_pd(inv, xd, _mm512_sub_pd(kd, shift));
            // Entries 0–15 and 16–31 by the index's low four bits, then bit 4 picks between them.
            let t = _mm512_mask_blend_pd(
                _mm512_test_epi64_mask(ki, bit4),
                _mm512_permutex2var_pd(t0, ki, t1),
                _mm512_permutex2var_pd(t2, ki, t3),
            );
            let s =
                _mm512_castsi512_pd(_mm512_add_epi64(_mm512_castpd_si512(t), _mm512_slli_epi64::<47>(ki)));
            let z = _mm512_fmadd_pd(c0, r, c1);
            let y = _mm512_fmadd_pd(c2, r, one);
            let y = _mm512_fmadd_pd(z, _mm512_mul_pd(r, r), y);
            let over = _mm256_cmp_ps_mask::<_CMP_GT_OQ>(xs, inf_above);
            let out = _mm256_maskz_mov_ps(!under, _mm512_cvtpd_ps(_mm512_mul_pd(y, s)));
            let out = _mm256_mask_blend_ps(over, out, inf);
            // SAFETY: as the load.
            unsafe { _mm256_storeu_ps(d.as_mut_ptr().cast::<f32>().add(i), out) };
            let inside = _mm256_cmp_ps_mask::<_CMP_GE_OQ>(xs, lo) & _mm256_cmp_ps_mask::<_CMP_LE_OQ>(xs, hi);
            if inside | under | over != 0xff {
                super::scalar(&x[i..i + 8], &mut d[i..i + 8], negate);
            }
        }
        super::scalar(&x[n..], &mut d[n..], negate);
    }

    /// [`super::exp_slice`] four lanes at a time: each as `__expf_fma` computes it (the multiply
    /// by 32/ln 2 fused into both the rounding and the remainder, the cubic in three fused
    /// multiply-adds), then lanes outside `[LOW, HIGH]` redone by the scalar [`exp`].
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA; `x` and `d` have equal lengths.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_avx2_fma(x: &[f32], d: &mut [MaybeUninit<f32>], negate: bool) {
        let inv = _mm256_set1_pd(INV_LN2_N);
        let shift = _mm256_set1_pd(SHIFT);
        let [c0, c1, c2] = COEFFICIENTS.map(|c| _mm256_set1_pd(c));
        let one = _mm256_set1_pd(1.0);
        let low_bits = _mm256_set1_epi64x(31);
        let (lo, hi) = (_mm_set1_ps(LOW), _mm_set1_ps(HIGH));
        let (zero_below, inf_above, inf) =
            (_mm_set1_ps(-104.0), _mm_set1_ps(89.0), _mm_set1_ps(f32::INFINITY));
        let sign = _mm_set1_ps(if negate { -0.0 } else { 0.0 });
        let n = x.len() / 4 * 4;
        for i in (0..n).step_by(4) {
            // SAFETY: i + 4 ≤ n ≤ x.len() = d.len().
            let xs = _mm_xor_ps(unsafe { _mm_loadu_ps(x.as_ptr().add(i)) }, sign);
            let under = _mm_cmplt_ps(xs, zero_below);
            if _mm_movemask_ps(under) == 0b1111 {
                // Four lanes below −104 (a run of a causal mask's −10⁹ scores): +0 each, with no
                // table lookup. SAFETY: as the load.
                unsafe { _mm_storeu_ps(d.as_mut_ptr().cast::<f32>().add(i), _mm_setzero_ps()) };
                continue;
            }
            let xd = _mm256_cvtps_pd(xs);
            let kd = _mm256_fmadd_pd(inv, xd, shift);
            let ki = _mm256_castpd_si256(kd);
            let r = _mm256_fmsub_pd(inv, xd, _mm256_sub_pd(kd, shift));
            let idx = _mm256_and_si256(ki, low_bits);
            // SAFETY: every index is below 32, the table's length.
            let t = unsafe { _mm256_i64gather_epi64::<8>(TABLE.as_ptr() as *const i64, idx) };
            let s = _mm256_castsi256_pd(_mm256_add_epi64(t, _mm256_slli_epi64::<47>(ki)));
            let z = _mm256_fmadd_pd(c0, r, c1);
            let y = _mm256_fmadd_pd(c2, r, one);
            let y = _mm256_fmadd_pd(z, _mm256_mul_pd(r, r), y);
            // Lanes below −104 are +0 and above 89 are +∞, as the scalar `exp` has them (a
            // causal mask's −10⁹ scores fill half of every attention row).
            let over = _mm_cmpgt_ps(xs, inf_above);
            let out = _mm_andnot_ps(under, _mm256_cvtpd_ps(_mm256_mul_pd(y, s)));
            let out = _mm_blendv_ps(out, inf, over);
            // SAFETY: as the load.
            unsafe { _mm_storeu_ps(d.as_mut_ptr().cast::<f32>().add(i), out) };
            // Lanes in neither range nor the vector one (NaN compares false: it is one of them).
            let inside = _mm_and_ps(_mm_cmpge_ps(xs, lo), _mm_cmple_ps(xs, hi));
            if _mm_movemask_ps(_mm_or_ps(inside, _mm_or_ps(under, over))) != 0b1111 {
                super::scalar(&x[i..i + 4], &mut d[i..i + 4], negate);
            }
        }
        super::scalar(&x[n..], &mut d[n..], negate);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every 1021st f32 bit pattern (4.2 million values, both signs, all magnitudes), the
    /// self-check's near-ties and the special values, through every kernel ([`kernels`]): libm's
    /// bits, NaN for NaN.
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
            for (kernel, f) in kernels() {
                let mut d = vec![0f32; xs.len()];
                f(&xs, &mut d, negate);
                for (i, &x) in xs.iter().enumerate() {
                    let x = if negate { -x } else { x };
                    let want = x.exp();
                    if want.is_nan() {
                        assert!(d[i].is_nan(), "{kernel}: e^{x}");
                    } else {
                        assert_eq!(d[i].to_bits(), want.to_bits(), "{kernel}: e^{x}");
                    }
                }
            }
        }
    }

    /// An `e^x` kernel: operand, output, negate.
    type Kernel = fn(&[f32], &mut [f32], bool);

    /// Every kernel this CPU can run, by name: `exp_slice` (the chosen one), the scalar loop,
    /// and each vector kernel the CPU has, called directly (so the AVX2 fallback stays tested
    /// on a CPU that picks AVX-512).
    fn kernels() -> Vec<(&'static str, Kernel)> {
        let mut k: Vec<(&'static str, Kernel)> =
            vec![("exp_slice", exp_slice), ("scalar", |x, d, n| scalar(x, as_uninit(d), n))];
        #[cfg(all(target_arch = "x86_64", target_os = "linux", target_env = "gnu"))]
        {
            if x86::has_avx512() {
                // SAFETY: the CPU has the kernel's instructions (checked just above).
                k.push(("avx512", |x, d, n| unsafe { x86::exp_avx512(x, as_uninit(d), n) }));
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                // SAFETY: the CPU has the kernel's instructions (checked just above).
                k.push(("avx2", |x, d, n| unsafe { x86::exp_avx2_fma(x, as_uninit(d), n) }));
            }
        }
        k
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

    /// Each table entry, with `i · 2^47` added back, is `2^(i/32)` to within one ulp of libm's.
    #[test]
    fn the_table_holds_powers_of_two() {
        for (i, &t) in TABLE.iter().enumerate() {
            let v = f64::from_bits(t.wrapping_add((i as u64) << 47));
            let want = (i as f64 / 32.0).exp2();
            assert!((v - want).abs() <= f64::EPSILON * want, "entry {i}: {v} vs {want}");
        }
    }

    /// The exhaustive check behind the module doc: every f32 in [−103.9, 88.7] through the slice
    /// path gives libm's bits (2.24·10⁹ values; 25 s in release — `cargo test --release -p
    /// graphpp-runtime --lib every_f32 -- --ignored`).
    #[test]
    #[ignore = "25 s in release, minutes in debug"]
    fn every_f32_in_the_vector_range() {
        let (lo, hi) = (-103.9f32, 88.7f32);
        let mut bits = 0u32;
        let mut xs = Vec::with_capacity(1 << 16);
        let mut d = vec![0f32; 1 << 16];
        loop {
            let x = f32::from_bits(bits);
            if x >= lo && x <= hi {
                xs.push(x);
            }
            if xs.len() == xs.capacity() || bits == u32::MAX {
                exp_slice(&xs, &mut d[..xs.len()], false);
                for (x, v) in xs.iter().zip(&d) {
                    assert_eq!(v.to_bits(), x.exp().to_bits(), "e^{x}");
                }
                xs.clear();
            }
            if bits == u32::MAX {
                break;
            }
            bits += 1;
        }
    }

    /// The vector path is the one under test on a CPU that has it (not a silent fallback).
    #[test]
    fn the_vector_path_runs_where_the_cpu_has_it() {
        #[cfg(all(target_arch = "x86_64", target_os = "linux", target_env = "gnu"))]
        {
            if x86::has_avx512() {
                assert_eq!(vector_path(), Some(Path::Avx512), "AVX-512 present but not chosen");
            } else if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                assert_eq!(vector_path(), Some(Path::Avx2), "AVX2 + FMA present but not chosen");
            }
        }
    }

    /// Lengths that are not a multiple of the lane count, and the empty slice.
    #[test]
    fn ragged_tails() {
        for len in 0..19 {
            let xs: Vec<f32> = (0..len).map(|i| i as f32 * 0.7 - 3.0).collect();
            for (kernel, f) in kernels() {
                let mut d = vec![f32::NAN; len];
                f(&xs, &mut d, false);
                for (x, v) in xs.iter().zip(&d) {
                    assert_eq!(v.to_bits(), x.exp().to_bits(), "{kernel}, len {len}, e^{x}");
                }
            }
        }
    }
}
