//! The AMX path: Intel AMX's `tdpbf16ps` (Intel SDM vol. 2, "TDPBF16PS"), which multiplies a
//! tile of 16 rows × 16 bf16 pairs of `A` by a tile of 16 pairs × 16 columns of `B` and adds the
//! 16 × 16 dot products of 32 terms to an f32 tile: 8,192 bf16 multiply-adds an instruction,
//! where a `vdpbf16ps` on 512-bit registers does 32.
//!
//! **Blocking.** The eight tile registers hold four sums (a 32 × 32 block of `C`: `tmm0`–`tmm3`),
//! two `A` tiles (`tmm4`, `tmm5`: rows `i..i+16` and `i+16..i+32`) and two `B` tiles (`tmm6`,
//! `tmm7`: the two 16-column halves of a 32-column panel). Every tile is 16 rows × 64 bytes.
//! `A` is packed into tiles of 16 rows × 32 values (zero past `m` and `k`); `B` into the
//! `vdpbf16ps` path's 32-column panels of k-pairs ([`super::packed::pack_b`]), with the pairs
//! padded to a multiple of 16, so a `B` tile is 16 of a panel's rows, 128 bytes apart. The sums
//! go to the same panel-major buffer as that path's, and are rounded by the same code
//! ([`super::packed::write_out`]). Each output's sum runs over `k` in the same order whatever the
//! thread count (the split is over column panels).
//!
//! **Permission.** Linux gives a process the tile registers only after it asks:
//! `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)` (kernel 5.16 and later,
//! Documentation/arch/x86/xstate.rst); the grant holds for every thread of the process.
//!
//! **Tests.** The loops are generic over [`Tiles`]. `SoftTiles` (tests only) carries out the
//! instructions in Rust, `tdpbf16ps` in one order it may sum in — the Intrinsics Guide's
//! pseudocode for `_tile_dpbf16ps`: each k-pair's even product, then its odd one, added to the
//! sum, subnormals as zero — so the packing, the blocking, the tails and the write-out are tested
//! on every CPU against the f64 product. The hardware may sum in another order (the SDM's current
//! text keeps the even and the odd products in separate chains), so it is held to the same f64
//! bound, never to the emulation's bits: the hardware path ([`Amx`]) runs the crate's product
//! tests where the CPU has AMX, and the first time a process asks for it ([`unavailable`]) its
//! product of a test shape must lie within f32 rounding of the exact one, or the path is not
//! used (the reason is printed). That check catches wrong sums, not a faulting instruction, which
//! would end the process: `GRAPHPP_BF16_GEMM=avx512-bf16` rules the path out.

use super::packed::{self, NR};
use super::{bf16, MaybeUninit, Out, Strided};
use rayon::prelude::*;
use std::sync::OnceLock;

/// Rows of a tile (and of an `A` tile block).
const TR: usize = 16;
/// k-pairs in a tile's row: 64 bytes.
const TP: usize = 16;
/// 4-byte words in a tile.
const WORDS: usize = TR * TP;

/// The tile instructions the loops use, on tile registers 0–7 (`T`, `C`, `A`, `B`: a register's
/// number). Strides are in 4-byte words. Every tile is 16 rows × 64 bytes ([`Tiles::configure`]).
pub(super) trait Tiles: Default {
    /// Sets every tile to 16 rows × 64 bytes (`ldtilecfg`, palette 1).
    ///
    /// # Safety
    /// Where the tiles are the hardware's: the process has the tile permission.
    unsafe fn configure(&mut self);
    /// Tile `T` = 0 (`tilezero`).
    ///
    /// # Safety
    /// [`Tiles::configure`] ran on this thread.
    unsafe fn zero<const T: u8>(&mut self);
    /// Tile `T` = 16 rows of 16 words from `src`, rows `stride` words apart (`tileloadd`).
    ///
    /// # Safety
    /// [`Tiles::configure`] ran on this thread; `src` reaches `15 · stride + 16` words.
    unsafe fn load<const T: u8>(&mut self, src: *const u32, stride: usize);
    /// Tile `C` += tile `A` · tile `B`, as bf16 pairs into f32 sums (`tdpbf16ps`).
    ///
    /// # Safety
    /// [`Tiles::configure`] ran on this thread.
    unsafe fn dot<const C: u8, const A: u8, const B: u8>(&mut self);
    /// Tile `T`'s 16 rows of 16 f32 to `dst`, rows `stride` floats apart (`tilestored`).
    ///
    /// # Safety
    /// [`Tiles::configure`] ran on this thread; `dst` reaches `15 · stride + 16` floats.
    unsafe fn store<const T: u8>(&mut self, dst: *mut f32, stride: usize);
    /// Gives the tile registers back to their initial state (`tilerelease`), so a context switch
    /// need not save them.
    ///
    /// # Safety
    /// As [`Tiles::configure`].
    unsafe fn release(&mut self);
}

/// The hardware's tile registers.
#[derive(Default)]
#[cfg(target_os = "linux")]
pub(super) struct Amx;

#[cfg(target_os = "linux")]
impl Tiles for Amx {
    #[inline(always)]
    unsafe fn configure(&mut self) {
        /// The 64-byte tile configuration `ldtilecfg` reads (Intel SDM vol. 2, "LDTILECFG").
        #[repr(C, align(64))]
        struct Config([u8; 64]);
        // Byte 0: palette 1; bytes 16–31: each tile's bytes a row (u16); 48–55: its rows; the
        // rest zero.
        let mut config = Config([0; 64]);
        config.0[0] = 1;
        for t in 0..8 {
            config.0[16 + 2 * t..18 + 2 * t].copy_from_slice(&(4 * TP as u16).to_le_bytes());
            config.0[48 + t] = TR as u8;
        }
        std::arch::asm!("ldtilecfg [{}]", in(reg) config.0.as_ptr(), options(nostack, readonly));
    }

    #[inline(always)]
    unsafe fn zero<const T: u8>(&mut self) {
        std::arch::asm!("tilezero tmm{t}", t = const T, options(nostack, nomem));
    }

    #[inline(always)]
    unsafe fn load<const T: u8>(&mut self, src: *const u32, stride: usize) {
        std::arch::asm!(
            "tileloadd tmm{t}, [{src} + {stride}*1]",
            t = const T,
            src = in(reg) src,
            stride = in(reg) 4 * stride,
            options(nostack, readonly)
        );
    }

    #[inline(always)]
    unsafe fn dot<const C: u8, const A: u8, const B: u8>(&mut self) {
        std::arch::asm!("tdpbf16ps tmm{c}, tmm{a}, tmm{b}", c = const C, a = const A, b = const B, options(nostack, nomem));
    }

    #[inline(always)]
    unsafe fn store<const T: u8>(&mut self, dst: *mut f32, stride: usize) {
        std::arch::asm!(
            "tilestored [{dst} + {stride}*1], tmm{t}",
            t = const T,
            dst = in(reg) dst,
            stride = in(reg) 4 * stride,
            options(nostack)
        );
    }

    #[inline(always)]
    unsafe fn release(&mut self) {
        std::arch::asm!("tilerelease", options(nostack, nomem));
    }
}

/// The tile instructions carried out in Rust (module doc): `tdpbf16ps` adds, for each k-pair in
/// order, the even product and then the odd one to each f32 sum (each product of two bf16 is
/// exact in f32), treats subnormal inputs as zero and flushes subnormal sums to zero. The tests'
/// tiles (slow: scalar loops).
#[cfg(test)]
pub(super) struct SoftTiles {
    /// Each register's 16 × 16 words (bf16 pairs or f32 bits).
    regs: Vec<[u32; WORDS]>,
}

#[cfg(test)]
impl Default for SoftTiles {
    fn default() -> Self {
        SoftTiles { regs: vec![[0; WORDS]; 8] }
    }
}

/// A bf16's value as f32, a subnormal as zero.
#[cfg(test)]
fn daz(h: u32) -> f32 {
    let x = f32::from_bits((h & 0xFFFF) << 16);
    if x.is_subnormal() {
        0.0
    } else {
        x
    }
}

#[cfg(test)]
impl Tiles for SoftTiles {
    unsafe fn configure(&mut self) {}

    unsafe fn zero<const T: u8>(&mut self) {
        self.regs[T as usize] = [0; WORDS];
    }

    unsafe fn load<const T: u8>(&mut self, src: *const u32, stride: usize) {
        for r in 0..TR {
            // SAFETY: `src` reaches `15 · stride + 16` words (the caller's promise).
            let row = unsafe { std::slice::from_raw_parts(src.add(r * stride), TP) };
            self.regs[T as usize][r * TP..][..TP].copy_from_slice(row);
        }
    }

    unsafe fn dot<const C: u8, const A: u8, const B: u8>(&mut self) {
        let (a, b) = (self.regs[A as usize], self.regs[B as usize]);
        let c = &mut self.regs[C as usize];
        for r in 0..TR {
            for j in 0..TP {
                let mut sum = f32::from_bits(c[r * TP + j]);
                for p in 0..TP {
                    let (x, y) = (a[r * TP + p], b[p * TP + j]);
                    sum += daz(x) * daz(y);
                    sum += daz(x >> 16) * daz(y >> 16);
                    if sum.is_subnormal() {
                        sum = 0.0f32.copysign(sum);
                    }
                }
                c[r * TP + j] = sum.to_bits();
            }
        }
    }

    unsafe fn store<const T: u8>(&mut self, dst: *mut f32, stride: usize) {
        for r in 0..TR {
            for j in 0..TP {
                // SAFETY: `dst` reaches `15 · stride + 16` floats (the caller's promise).
                unsafe { *dst.add(r * stride + j) = f32::from_bits(self.regs[T as usize][r * TP + j]) };
            }
        }
    }

    unsafe fn release(&mut self) {}
}

/// `A` (`m × k`) as blocks of 16 rows, each `blocks` tiles along `k` of 16 rows × 16 pairs (a
/// tile's rows 64 bytes apart, the tiles 1 KiB apart; zero past `m` and `k`). Two layouts read
/// whole runs: `k` contiguous (a row-major `A`: a row's pairs are its words) and `m` contiguous
/// (a transposed `A`, as a weight gradient's `Xᵀ`: two runs along `m` interleaved); others go
/// element by element.
fn pack_a(a: Strided, m: usize, k: usize, blocks: usize) -> Vec<u32> {
    let mut packed = vec![0u32; m.div_ceil(TR) * blocks * WORDS];
    // The word of row i, pair p.
    let at = |i: usize, p: usize| i / TR * blocks * WORDS + p / TP * WORDS + i % TR * TP + p % TP;
    let bits = |h: &bf16| h.to_bits() as u32;
    if a.col_stride == 1 {
        for i in 0..m {
            for (p, two) in a.data[i * a.row_stride..][..k].chunks(2).enumerate() {
                packed[at(i, p)] = bits(&two[0]) | two.get(1).map_or(0, bits) << 16;
            }
        }
    } else if a.row_stride == 1 {
        for p in 0..k.div_ceil(2) {
            let lo = &a.data[2 * p * a.col_stride..][..m];
            for (i, h) in lo.iter().enumerate() {
                packed[at(i, p)] = bits(h);
            }
            if 2 * p + 1 < k {
                for (i, h) in a.data[(2 * p + 1) * a.col_stride..][..m].iter().enumerate() {
                    packed[at(i, p)] |= bits(h) << 16;
                }
            }
        }
    } else {
        for i in 0..m {
            for l in 0..k {
                packed[at(i, l / 2)] |= bits(&a.at(i, l)) << (16 * (l % 2));
            }
        }
    }
    packed
}

/// [`super::gemm`]'s product on the tiles `T`, `m`, `n` and `k` at least 1 (the caller returns
/// early on an empty dim).
///
/// # Safety
/// `T`'s instructions run on this CPU: for [`Amx`], [`unavailable`] is `None` (the process has
/// the tile permission) or the call is its self-check, after the permission was granted.
pub(super) unsafe fn gemm<T: Tiles>(
    m: usize,
    n: usize,
    k: usize,
    a: Strided,
    b: Strided,
    out: Out,
    parallel: bool,
) {
    let blocks = k.div_ceil(2 * TP);
    let pairs = blocks * TP;
    let rows = m.div_ceil(TR) * TR;
    let (pa, pb) = (pack_a(a, m, k, blocks), packed::pack_b(b, k, n, pairs, parallel));
    // The sums, panel-major: column panel `j` holds its rows × 32 block, row-major.
    let mut c = vec![0f32; n.div_ceil(NR) * rows * NR];
    let panel = |(j, cj): (usize, &mut [f32])| {
        let bj = &pb[j * pairs * NR..][..pairs * NR];
        let mut tiles = T::default();
        // SAFETY: `T`'s instructions run here (the caller's promise); the tiles are configured
        // before use and released after.
        unsafe {
            tiles.configure();
            for i in (0..rows / TR).step_by(2) {
                let two = (i + 2) * TR <= rows;
                let a = &pa[i * blocks * WORDS..][..if two { 2 } else { 1 } * blocks * WORDS];
                block(&mut tiles, a, bj, blocks, &mut cj[i * TR * NR..][..if two { 2 } else { 1 } * TR * NR]);
            }
            tiles.release();
        }
    };
    if parallel {
        c.par_chunks_mut(rows * NR).enumerate().for_each(panel);
    } else {
        c.chunks_mut(rows * NR).enumerate().for_each(panel);
    }
    packed::write_out(&c, rows, m, out, parallel);
}

/// One or two 16-row blocks (`a`: `blocks` tiles each) times a panel `b` (`16 · blocks` pairs ×
/// 32 columns), summed over all of `k` in tiles 0–3 and stored into `c` (16 or 32 rows of 32).
///
/// # Safety
/// [`Tiles::configure`] ran on this thread.
unsafe fn block<T: Tiles>(tiles: &mut T, a: &[u32], b: &[u32], blocks: usize, c: &mut [f32]) {
    let two = c.len() == 2 * TR * NR;
    assert!(a.len() == c.len() / (TR * NR) * blocks * WORDS && b.len() == blocks * TP * NR);
    // SAFETY (every call below): each load reads a tile of 16 rows of 16 words inside `a` (1 KiB
    // tiles) or `b` (rows 32 words apart, halves 16 words apart); each store writes 16 rows of 16
    // floats inside `c` (rows 32 floats apart), all by the lengths asserted above.
    unsafe {
        tiles.zero::<0>();
        tiles.zero::<1>();
        if two {
            tiles.zero::<2>();
            tiles.zero::<3>();
        }
        for q in 0..blocks {
            let bq = b[q * TP * NR..].as_ptr();
            tiles.load::<4>(a[q * WORDS..].as_ptr(), TP);
            tiles.load::<6>(bq, NR);
            tiles.load::<7>(bq.add(TP), NR);
            tiles.dot::<0, 4, 6>();
            tiles.dot::<1, 4, 7>();
            if two {
                tiles.load::<5>(a[(blocks + q) * WORDS..].as_ptr(), TP);
                tiles.dot::<2, 5, 6>();
                tiles.dot::<3, 5, 7>();
            }
        }
        let c = c.as_mut_ptr();
        tiles.store::<0>(c, NR);
        tiles.store::<1>(c.add(TP), NR);
        if two {
            tiles.store::<2>(c.add(TR * NR), NR);
            tiles.store::<3>(c.add(TR * NR + TP), NR);
        }
    }
}

/// Why a process does not use AMX tiles.
#[derive(Clone, Debug, PartialEq)]
enum Refusal {
    /// The CPU lacks AMX-TILE or AMX-BF16.
    NoAmx,
    /// Only Linux's permission request is written.
    #[cfg(not(target_os = "linux"))]
    NotLinux,
    /// The kernel refused the tile permission (its error).
    Permission(String),
    /// The hardware's product of the test shape was not within f32 rounding of the exact one.
    Check(String),
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::NoAmx => f.write_str("this CPU lacks AMX (AMX-TILE and AMX-BF16)"),
            #[cfg(not(target_os = "linux"))]
            Refusal::NotLinux => {
                f.write_str("AMX tiles are asked for the Linux way, and this OS is not Linux")
            }
            Refusal::Permission(e) => write!(f, "the kernel refused the AMX tile permission: {e}"),
            Refusal::Check(e) => write!(f, "the AMX product failed its self-check: {e}"),
        }
    }
}

/// Why this process cannot use AMX tiles, or `None` where it can: the CPU lacks AMX-TILE or
/// AMX-BF16; the OS is not Linux or refused the tile permission; or the hardware's product of a
/// test shape is not within f32 rounding of the exact one (printed on standard error once: a
/// fault this path must not hide). Found once a process.
pub(super) fn unavailable() -> Option<String> {
    refusal().map(|r| r.to_string())
}

fn refusal() -> Option<Refusal> {
    static WHY: OnceLock<Option<Refusal>> = OnceLock::new();
    WHY.get_or_init(|| {
        let why = probe();
        if let Some(fault @ Refusal::Check(_)) = &why {
            eprintln!("graphpp: {fault}; bf16 matmuls will not use AMX");
        }
        why
    })
    .clone()
}

fn probe() -> Option<Refusal> {
    if !has_amx() {
        return Some(Refusal::NoAmx);
    }
    #[cfg(not(target_os = "linux"))]
    return Some(Refusal::NotLinux);
    #[cfg(target_os = "linux")]
    {
        if let Err(e) = request_tiles() {
            return Some(Refusal::Permission(e.to_string()));
        }
        // SAFETY: the CPU has AMX and the kernel granted the tiles (both checked above).
        unsafe { self_check::<Amx>() }.err().map(Refusal::Check)
    }
}

/// CPUID leaf 7 (where the CPU has it): AMX-BF16 is EDX bit 22, AMX-TILE bit 24.
fn has_amx() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__cpuid_count, __get_cpuid_max};
        let edx = if __get_cpuid_max(0).0 >= 7 { __cpuid_count(7, 0).edx } else { 0 };
        edx >> 22 & 1 == 1 && edx >> 24 & 1 == 1
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`: the grant holds for every thread of the
/// process (Linux 5.16 and later; older kernels answer `EINVAL`).
#[cfg(target_os = "linux")]
fn request_tiles() -> Result<(), std::io::Error> {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a plain system call with integer arguments.
    let r = unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// `T`'s product of a shape with a tail in every dim (m, n and k past whole tiles, odd k),
/// against the f64 product: one two-block and one one-block row step, two column panels (the
/// second part-filled), three k-tiles.
///
/// # Safety
/// As [`gemm`]'s.
#[cfg(any(test, target_os = "linux"))]
unsafe fn self_check<T: Tiles>() -> Result<(), String> {
    let (m, n, k) = (37, 45, 71);
    let values = |len: usize, seed: usize| -> Vec<bf16> {
        (0..len).map(|i| bf16::from_f32(((i * 7 + seed) % 23) as f32 / 8.0 - 1.4)).collect()
    };
    let (va, vb) = (values(m * k, 1), values(k * n, 5));
    let a = Strided { data: &va, row_stride: k, col_stride: 1 };
    let b = Strided { data: &vb, row_stride: n, col_stride: 1 };
    let mut out = vec![MaybeUninit::uninit(); m * n];
    // SAFETY: `T`'s instructions run here (the caller's promise).
    unsafe { gemm::<T>(m, n, k, a, b, Out::Rows(&mut out), false) };
    // SAFETY: `gemm` writes every element.
    let got: Vec<bf16> = out.iter().map(|o| unsafe { o.assume_init() }).collect();
    super::within_rounding(m, n, k, a, b, &got)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Where the CPU has AMX, the hardware passed the check (else `unavailable` says why, and
    /// the check on [`SoftTiles`] below is all that runs here).
    #[test]
    fn the_emulated_tiles_pass_the_self_check() {
        // SAFETY: the emulated tiles run on any CPU.
        assert_eq!(unsafe { self_check::<SoftTiles>() }, Ok(()));
        match refusal() {
            None => eprintln!("this CPU has AMX: the hardware path passed its self-check"),
            Some(why) => {
                assert!(!matches!(why, Refusal::Check(_)), "{why}");
                eprintln!("AMX not used here: {why}");
            }
        }
    }

    /// The three ways `pack_a` reads `A` — row-major, transposed, every other element of a
    /// wider matrix — give the same words, with `m` and `k` past whole tiles and `k` odd.
    #[test]
    fn every_layout_of_a_packs_alike() {
        let (m, k) = (19, 37);
        let value = |i: usize, l: usize| bf16::from_f32((i * 41 + l * 7) as f32 / 64.0 - 3.0);
        let rows: Vec<bf16> = (0..m * k).map(|x| value(x / k, x % k)).collect();
        let cols: Vec<bf16> = (0..m * k).map(|x| value(x % m, x / m)).collect();
        let spread: Vec<bf16> = (0..m * 2 * k)
            .map(|x| if x % 2 == 0 { value(x / (2 * k), x % (2 * k) / 2) } else { bf16::NAN })
            .collect();
        let blocks = k.div_ceil(2 * TP);
        let packs = [
            pack_a(Strided { data: &rows, row_stride: k, col_stride: 1 }, m, k, blocks),
            pack_a(Strided { data: &cols, row_stride: 1, col_stride: m }, m, k, blocks),
            pack_a(Strided { data: &spread, row_stride: 2 * k, col_stride: 2 }, m, k, blocks),
        ];
        assert_eq!(packs[0], packs[1]);
        assert_eq!(packs[0], packs[2]);
        // Row 17 (the second block's row 1), k = 35 (the second tile's pair 1, high half).
        let word = packs[0][blocks * WORDS + WORDS + TP + 1];
        assert_eq!(word >> 16, value(17, 35).to_bits() as u32);
        // Past k (pair 18 is k = 36 and 37; 37 is padding): the high half is zero.
        assert_eq!(packs[0][WORDS + 2] >> 16, 0);
    }

    /// The emulated `tdpbf16ps` adds the even product, then the odd one, pair by pair (module
    /// doc): with a large term first and its negation later, the small terms between are lost or
    /// kept as that order says.
    #[test]
    fn the_emulated_dot_product_sums_pair_by_pair() {
        let mut t = SoftTiles::default();
        let pair = |lo: f32, hi: f32| {
            bf16::from_f32(lo).to_bits() as u32 | (bf16::from_f32(hi).to_bits() as u32) << 16
        };
        // Row 0 of A: pairs (2^24, 1), (1, -2^24); column 0 of B: all ones.
        t.regs[4][0] = pair(16_777_216.0, 1.0);
        t.regs[4][1] = pair(1.0, -16_777_216.0);
        for p in 0..TP {
            t.regs[6][p * TP] = pair(1.0, 1.0);
        }
        // SAFETY: the emulated tiles need no configuration.
        unsafe { t.dot::<0, 4, 6>() };
        // 2^24 + 1 = 2^24 (ties to even), + 1 = 2^24, - 2^24 = 0.
        assert_eq!(f32::from_bits(t.regs[0][0]), 0.0);
        t.regs[4][1] = pair(-16_777_216.0, 1.0);
        t.regs[0] = [0; WORDS];
        // SAFETY: as above.
        unsafe { t.dot::<0, 4, 6>() };
        // 2^24 + 1 = 2^24, - 2^24 = 0, + 1 = 1.
        assert_eq!(f32::from_bits(t.regs[0][0]), 1.0);
    }
}
