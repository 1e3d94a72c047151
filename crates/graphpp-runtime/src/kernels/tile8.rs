//! 8 × 8 f32 blocks transposed in AVX2 registers: unpack pairs of rows, shuffle pairs of pairs,
//! swap 128-bit halves (24 shuffles for 64 elements instead of 64 strided scalar moves). Used
//! where a kernel reads a matrix across its rows: attention's k and v per query head
//! (`crate::kernels::attention`) and a transposed weight gradient added into its accumulator
//! (`crate::kernels::accumulate`).

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::__m256;

/// Rows `src + i · src_rs .. + 8` (`i < 8`), transposed: element `j` of returned row `i` is
/// element `i` of source row `j`.
///
/// # Safety
/// The CPU has AVX2; `src + i · src_rs .. + 8` is valid for reads for `i < 8`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn load_transposed(src: *const f32, src_rs: usize) -> [__m256; 8] {
    use std::arch::x86_64::*;
    // SAFETY: the caller's contract (rows in bounds).
    let r = |i: usize| unsafe { _mm256_loadu_ps(src.add(i * src_rs)) };
    let (r0, r1, r2, r3, r4, r5, r6, r7) = (r(0), r(1), r(2), r(3), r(4), r(5), r(6), r(7));
    let (t0, t1) = (_mm256_unpacklo_ps(r0, r1), _mm256_unpackhi_ps(r0, r1));
    let (t2, t3) = (_mm256_unpacklo_ps(r2, r3), _mm256_unpackhi_ps(r2, r3));
    let (t4, t5) = (_mm256_unpacklo_ps(r4, r5), _mm256_unpackhi_ps(r4, r5));
    let (t6, t7) = (_mm256_unpacklo_ps(r6, r7), _mm256_unpackhi_ps(r6, r7));
    let (s0, s1) = (_mm256_shuffle_ps::<0x44>(t0, t2), _mm256_shuffle_ps::<0xEE>(t0, t2));
    let (s2, s3) = (_mm256_shuffle_ps::<0x44>(t1, t3), _mm256_shuffle_ps::<0xEE>(t1, t3));
    let (s4, s5) = (_mm256_shuffle_ps::<0x44>(t4, t6), _mm256_shuffle_ps::<0xEE>(t4, t6));
    let (s6, s7) = (_mm256_shuffle_ps::<0x44>(t5, t7), _mm256_shuffle_ps::<0xEE>(t5, t7));
    [
        _mm256_permute2f128_ps::<0x20>(s0, s4),
        _mm256_permute2f128_ps::<0x20>(s1, s5),
        _mm256_permute2f128_ps::<0x20>(s2, s6),
        _mm256_permute2f128_ps::<0x20>(s3, s7),
        _mm256_permute2f128_ps::<0x31>(s0, s4),
        _mm256_permute2f128_ps::<0x31>(s1, s5),
        _mm256_permute2f128_ps::<0x31>(s2, s6),
        _mm256_permute2f128_ps::<0x31>(s3, s7),
    ]
}

/// The 8 × 8 block at `src` (rows `src_rs` apart) transposed into `dst` (rows `dst_rs` apart).
///
/// # Safety
/// The CPU has AVX2; `src + i · src_rs .. + 8` and `dst + i · dst_rs .. + 8` are valid for
/// `i < 8` (reads and writes), and do not overlap.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn transpose8(src: *const f32, src_rs: usize, dst: *mut f32, dst_rs: usize) {
    // SAFETY: the caller's contract.
    let rows = unsafe { load_transposed(src, src_rs) };
    for (i, o) in rows.into_iter().enumerate() {
        // SAFETY: the caller's contract (row i of dst in bounds).
        unsafe { std::arch::x86_64::_mm256_storeu_ps(dst.add(i * dst_rs), o) };
    }
}
