//! A stage's gradient accumulators, summed in place.
//!
//! Each backward of a step adds its `grad.<param>` outputs, scaled by 1/m on a route's last
//! stage (`crate::pipeline::stage`), to the stage's running sums. `a.add(&g.affine(s, 0))` allocates two
//! tensors and passes over the parameters' size three times per microbatch. [`Accumulators::add`]
//! makes a new sum (a tensor owned by the accumulators and shared with nothing) from a step's
//! first gradient when it is scaled, else from its first two, and from then on adds each
//! gradient into it in one pass, computing `acc + (g · s + 0)` per element — the f32 operations
//! candle's affine and add perform, in the same order, so the sums are bitwise those of the
//! allocating form. An unscaled first gradient is kept as it came (it may share storage with
//! other values of the backward's outputs: it is never written). Sums on a device other than the
//! CPU ([`composed`]) take the allocating form.

use std::collections::{HashMap, HashSet};

use candle_core::{CpuStorage, DType, Layout, Tensor};

use super::device::composed;
use rayon::prelude::*;

/// Elements from which an in-place add splits over the rank's pool.
const PARALLEL_MIN: usize = 1 << 18;

/// Running gradient sums by name, and which of them this value owns (writes in place).
#[derive(Debug, Default)]
pub struct Accumulators {
    sums: HashMap<String, Tensor>,
    /// Sums made here by [`Accumulators::add`]: shared with no other value.
    owned: HashSet<String>,
}

impl Accumulators {
    /// The sums by name (a sum owned here changes in place when the next gradient is added: clone
    /// its data to keep a value).
    pub fn sums(&self) -> &HashMap<String, Tensor> {
        &self.sums
    }

    /// Adds `g · scale` (`scale` None: `g`) to the sum `name`, or starts it.
    ///
    /// # Errors
    /// candle's, for a gradient whose shape or dtype differs from the sum's.
    pub fn add(&mut self, name: &str, g: Tensor, scale: Option<f32>) -> candle_core::Result<()> {
        let Some(acc) = self.sums.get(name) else {
            // Scaling makes a new tensor: owned. Unscaled, `g` is kept as it came.
            let sum = match scale {
                // A transposed weight gradient goes through the blocks of `AddScaled` into
                // zeros: 0 + (g · s + 0) is g · s + 0 bit for bit (the + 0 already made −0 +0),
                // where candle's affine walks the view element by element.
                Some(_)
                    if g.dtype() == DType::F32 && g.rank() == 2 && !g.is_contiguous() && !composed(&g) =>
                {
                    let sum = g.zeros_like()?;
                    sum.inplace_op2(&g, &AddScaled { scale })?;
                    sum
                }
                _ => scaled(g, scale)?,
            };
            if scale.is_some() {
                self.owned.insert(name.to_string());
            }
            self.sums.insert(name.to_string(), sum);
            return Ok(());
        };
        let in_place = self.owned.contains(name)
            && !composed(acc)
            && acc.dtype() == DType::F32
            && g.dtype() == DType::F32
            && acc.dims() == g.dims()
            && acc.is_contiguous()
            && (g.is_contiguous() || g.rank() == 2);
        if in_place {
            return acc.inplace_op2(&g, &AddScaled { scale });
        }
        let sum = acc.add(&scaled(g, scale)?)?;
        self.owned.insert(name.to_string());
        self.sums.insert(name.to_string(), sum);
        Ok(())
    }

    /// Sets the sum `name` to `value` (not owned: it may be shared).
    pub fn insert(&mut self, name: String, value: Tensor) {
        self.owned.remove(&name);
        self.sums.insert(name, value);
    }

    /// Moves the sums out; the accumulators restart empty.
    pub fn take(&mut self) -> HashMap<String, Tensor> {
        self.owned.clear();
        std::mem::take(&mut self.sums)
    }
}

/// `g · scale` (candle's affine: a new tensor), or `g` itself without a scale.
///
/// # Errors
/// candle's.
pub fn scaled(g: Tensor, scale: Option<f32>) -> candle_core::Result<Tensor> {
    match scale {
        Some(s) => g.affine(f64::from(s), 0.0),
        None => Ok(g),
    }
}

/// `acc[i] = acc[i] + (g[i] · scale + 0)` (`acc[i] + g[i]` without a scale): `acc` contiguous
/// f32, `g` contiguous or a strided rank-2 view ([`Strided`]).
struct AddScaled {
    scale: Option<f32>,
}

impl candle_core::InplaceOp2 for AddScaled {
    fn name(&self) -> &'static str {
        "add-scaled"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<()> {
        let (CpuStorage::F32(acc), CpuStorage::F32(g)) = (s1, s2) else {
            candle_core::bail!("add-scaled takes f32 tensors")
        };
        let Some((a0, a1)) = l1.contiguous_offsets() else {
            candle_core::bail!("add-scaled writes a contiguous tensor")
        };
        if l1.dims() != l2.dims() {
            candle_core::bail!("add-scaled: shapes {:?} and {:?}", l1.dims(), l2.dims())
        }
        let acc = &mut acc[a0..a1];
        let add_one = |g: f32| term(g, self.scale);
        if let Some((g0, g1)) = l2.contiguous_offsets() {
            let g = &g[g0..g1];
            let add = |(a, g): (&mut [f32], &[f32])| a.iter_mut().zip(g).for_each(|(a, &g)| *a += add_one(g));
            let threads = rayon::current_num_threads();
            if threads > 1 && acc.len() >= PARALLEL_MIN {
                let chunk = acc.len().div_ceil(threads);
                acc.par_chunks_mut(chunk).zip(g.par_chunks(chunk)).for_each(add);
            } else {
                add((acc, g));
            }
            return Ok(());
        }
        let strided = Strided::new(g, l2, self.scale)?;
        // Bands of TILE rows: each band reads its own columns' segments and writes its own rows.
        let band = TILE * strided.cols.max(1);
        let threads = rayon::current_num_threads();
        if threads > 1 && acc.len() >= PARALLEL_MIN {
            let per = acc.len().div_ceil(threads).div_ceil(band) * band;
            acc.par_chunks_mut(per)
                .enumerate()
                .for_each(|(c, a)| strided.add_rows(c * per / strided.cols, a));
        } else {
            strided.add_rows(0, acc);
        }
        Ok(())
    }
}

/// What a gradient element adds to its sum: `g · scale + 0` (the `+ 0` turns −0 into +0, as
/// candle's affine does), or `g` without a scale.
#[inline(always)]
fn term(g: f32, scale: Option<f32>) -> f32 {
    match scale {
        Some(s) => g * s + 0.0,
        None => g,
    }
}

/// A rank-2 strided gradient: element (i, j) at `g[g0 + i · s0 + j · s1]`, `rows × cols`
/// (every such index in bounds: [`Strided::new`] checks), added into row-major `cols`-wide rows.
#[derive(Clone, Copy)]
struct Strided<'a> {
    g: &'a [f32],
    g0: usize,
    s0: usize,
    s1: usize,
    rows: usize,
    cols: usize,
    scale: Option<f32>,
    /// Whether full 8 × 8 blocks go through AVX2 registers ([`Strided::add8`]): the CPU has
    /// AVX2 and each column is contiguous (`s0 == 1`).
    vector: bool,
}

impl<'a> Strided<'a> {
    /// The view `layout` of `g`.
    ///
    /// # Errors
    /// A layout of another rank, or strides that reach past `g`.
    fn new(g: &'a [f32], layout: &Layout, scale: Option<f32>) -> candle_core::Result<Self> {
        let (&[rows, cols], &[s0, s1]) = (layout.dims(), layout.stride()) else {
            candle_core::bail!("add-scaled reads a strided operand of rank 2 only")
        };
        let g0 = layout.start_offset();
        // The last element's index (None on overflow), for a gradient that has elements.
        if rows > 0 && cols > 0 {
            let last = (rows - 1)
                .checked_mul(s0)
                .zip((cols - 1).checked_mul(s1))
                .and_then(|(a, b)| a.checked_add(b)?.checked_add(g0));
            if last.is_none_or(|l| l >= g.len()) {
                candle_core::bail!(
                    "add-scaled: strides {:?} reach past the operand's {} elements",
                    layout.stride(),
                    g.len()
                )
            }
        }
        #[cfg(target_arch = "x86_64")]
        let vector = s0 == 1 && std::arch::is_x86_feature_detected!("avx2");
        #[cfg(not(target_arch = "x86_64"))]
        let vector = false;
        Ok(Strided { g, g0, s0, s1, rows, cols, scale, vector })
    }

    /// Adds rows `row0 .. row0 + acc.len() / cols` of the gradient into `acc` (those rows),
    /// TILE × TILE at a time so that both the rows written and the columns read stay in cache. A
    /// weight gradient is a transposed view (dW = (Xᵀ · dY)ᵀ, `s0 == 1`): with AVX2, its full
    /// 8 × 8 blocks are transposed in registers ([`crate::kernels::tile8`]) and added 8 lanes at a time,
    /// the same operations per element as the scalar loop (no fused multiply-add), so the same
    /// bits.
    ///
    /// # Panics
    /// If those rows are not the gradient's (`row0 + rows > self.rows`).
    fn add_rows(&self, row0: usize, acc: &mut [f32]) {
        let (rows, cols, vector) = (acc.len() / self.cols.max(1), self.cols, self.vector);
        assert!(row0 + rows <= self.rows, "rows {row0}..{} of a {}-row gradient", row0 + rows, self.rows);
        for ib in (0..rows).step_by(TILE) {
            for jb in (0..cols).step_by(TILE) {
                let (ie, je) = ((ib + TILE).min(rows), (jb + TILE).min(cols));
                // The part of the tile covered by whole 8 × 8 blocks.
                let (iv, jv) =
                    if vector { (ib + (ie - ib) / 8 * 8, jb + (je - jb) / 8 * 8) } else { (ib, jb) };
                #[cfg(target_arch = "x86_64")]
                for i in (ib..iv).step_by(8) {
                    for j in (jb..jv).step_by(8) {
                        // SAFETY: AVX2 is present and s0 == 1 (`vector`); rows i..i + 8 of acc
                        // hold columns j..j + 8 (i + 8 <= rows, j + 8 <= cols), and the
                        // gradient's rows row0 + i .. + 8 (asserted above to be its rows) ×
                        // columns j..j + 8 lie within the extent `new` checked.
                        unsafe { self.add8(row0 + i, j, &mut acc[i * cols..]) };
                    }
                }
                for i in ib..ie {
                    // Columns the blocks did not cover: all of them on rows past iv.
                    let from = if i < iv { jv } else { jb };
                    for j in from..je {
                        let g = self.g[self.g0 + (row0 + i) * self.s0 + j * self.s1];
                        acc[i * cols + j] += term(g, self.scale);
                    }
                }
            }
        }
    }

    /// Adds the gradient's 8 × 8 block at (row `i`, column `j`) into `acc`'s first 8 rows,
    /// columns `j .. j + 8`.
    ///
    /// # Safety
    /// AVX2 is present; `s0 == 1`; `acc` holds 8 rows of `cols` (`j + 8 <= cols`); the gradient's
    /// rows `i .. i + 8` × columns `j .. j + 8` are in bounds.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    unsafe fn add8(&self, i: usize, j: usize, acc: &mut [f32]) {
        use std::arch::x86_64::*;
        debug_assert!(self.s0 == 1 && i + 8 <= self.rows && j + 8 <= self.cols);
        // Column j + r of the gradient, rows i..i + 8, is contiguous (s0 == 1): 8 source rows.
        // SAFETY: the caller's contract.
        let block = unsafe {
            crate::kernels::tile8::load_transposed(self.g.as_ptr().add(self.g0 + i + j * self.s1), self.s1)
        };
        for (q, row) in block.into_iter().enumerate() {
            let added = match self.scale {
                Some(s) => _mm256_add_ps(_mm256_mul_ps(row, _mm256_set1_ps(s)), _mm256_setzero_ps()),
                None => row,
            };
            let a = acc[q * self.cols + j..q * self.cols + j + 8].as_mut_ptr();
            // SAFETY: the slice just taken holds the 8 lanes.
            unsafe { _mm256_storeu_ps(a, _mm256_add_ps(_mm256_loadu_ps(a), added)) };
        }
    }
}

/// Side of the tiles a strided operand is read in (32 × 32 f32: 4 KiB).
const TILE: usize = 32;

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn t(v: &[f32]) -> Tensor {
        Tensor::from_slice(v, v.len(), &Device::Cpu).unwrap()
    }

    /// The allocating form the accumulators replace: `want + g · scale` (or `g · scale` first).
    fn allocating(want: Option<Tensor>, g: &Tensor, scale: Option<f32>) -> Tensor {
        let s = scaled(g.clone(), scale).unwrap();
        match want {
            Some(w) => w.add(&s).unwrap(),
            None => s,
        }
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
    }

    /// Four gradients with and without a scale (−0.0 and values whose sums round): the sums are
    /// bitwise `a.add(&g.affine(s, 0))` step by step, the first gradient is never written, and
    /// a sum inserted from outside is never written either.
    #[test]
    fn in_place_sums_are_the_allocating_sums() {
        let grads: Vec<Vec<f32>> = (0..4)
            .map(|k| {
                (0..300_000).map(|i| ((i * 7 + k * 13) % 101) as f32 * 0.1 - 5.0 + 1e-7 * k as f32).collect()
            })
            .collect();
        let mut special = grads.clone();
        special[0][0] = -0.0;
        special[1][0] = -0.0;
        for scale in [None, Some(1.0 / 3.0)] {
            for pool in [1, 3] {
                let first = t(&special[0]);
                let kept = bits(&first);
                let mut acc = Accumulators::default();
                let mut want: Option<Tensor> = None;
                let pool = crate::kernels::threads::rank_pool(0, pool).unwrap();
                for g in &special {
                    let g = if want.is_none() { first.clone() } else { t(g) };
                    want = Some(allocating(want, &g, scale));
                    pool.install(|| acc.add("w", g, scale)).unwrap();
                    assert_eq!(bits(&acc.sums()["w"]), bits(want.as_ref().unwrap()), "{scale:?}");
                }
                assert_eq!(bits(&first), kept, "the first gradient is not written");
                let outside = t(&grads[3]);
                acc.insert("w".into(), outside.clone());
                acc.add("w", t(&grads[2]), scale).unwrap();
                assert_eq!(bits(&outside), bits(&t(&grads[3])), "an inserted sum is not written");
                assert_eq!(acc.take().len(), 1);
                assert!(acc.sums().is_empty());
            }
        }
    }

    /// A transposed gradient (a weight's, as the backward graph outputs it) is added in place
    /// through its strides: the sums are those of the allocating form bit for bit — ragged
    /// shapes (the 8 × 8 blocks' edges), a scale that rounds, −0.0, and a pool that splits the
    /// rows into bands (600 × 448 is past `PARALLEL_MIN`).
    #[test]
    fn transposed_gradients_add_in_place() {
        for (r, c) in [(70, 45), (64, 24), (600, 448)] {
            let raw = |k: usize| -> Tensor {
                let mut v: Vec<f32> = (0..r * c)
                    .map(|i| ((i * 31 + k * 7) % 97) as f32 * 0.37 - 17.0 + 1e-6 * k as f32)
                    .collect();
                v[k] = -0.0;
                Tensor::from_vec(v, (c, r), &Device::Cpu).unwrap().t().unwrap()
            };
            for scale in [None, Some(0.125f32), Some(1.0 / 3.0)] {
                for threads in [1, 3] {
                    let pool = crate::kernels::threads::rank_pool(0, threads).unwrap();
                    let mut acc = Accumulators::default();
                    let mut want: Option<Tensor> = None;
                    let mut ids = Vec::new();
                    for k in 0..4 {
                        let g = raw(k);
                        assert!(!g.is_contiguous());
                        want = Some(allocating(want, &g, scale));
                        pool.install(|| acc.add("w", g, scale)).unwrap();
                        let flat = |t: &Tensor| bits(&t.flatten_all().unwrap());
                        let case = format!("{r}x{c}, {scale:?}, {threads} threads, gradient {k}");
                        assert_eq!(flat(&acc.sums()["w"]), flat(want.as_ref().unwrap()), "{case}");
                        ids.push(acc.sums()["w"].id());
                    }
                    // From the second gradient on (the first, when scaled) the sum is one
                    // tensor, written in place.
                    let from = if scale.is_some() { 0 } else { 1 };
                    assert!(ids[from..].iter().all(|&id| id == ids[from]), "{scale:?}: a new tensor per add");
                }
            }
        }
    }

    /// Every strided view is added as element (i, j) at its strides says, whichever way its
    /// blocks go: an offset view whose column stride is not its row count (narrowed before the
    /// transpose), a view with a row stride (s0 != 1: scalar tiles), ragged edges; with AVX2's
    /// blocks and without (`vector` off), against a reference indexed element by element.
    #[test]
    fn strided_views_add_at_their_strides() {
        let wide: Vec<f32> = (0..90 * 61).map(|i| ((i * 13) % 89) as f32 * 0.61 - 27.0).collect();
        let base = Tensor::from_vec(wide, (90, 61), &Device::Cpu).unwrap();
        let views = [
            base.narrow(1, 3, 53).unwrap().t().unwrap(), // [53, 90], g0 = 3, s1 = 61
            base.narrow(0, 5, 40).unwrap().narrow(1, 2, 37).unwrap(), // [40, 37], s0 = 61, s1 = 1
            base.narrow(0, 1, 17).unwrap().narrow(1, 0, 8).unwrap().t().unwrap(), // [8, 17]
        ];
        for view in &views {
            let (storage, layout) = view.storage_and_layout();
            let candle_core::Storage::Cpu(CpuStorage::F32(g)) = &*storage else { panic!("cpu f32") };
            let (rows, cols) = view.dims2().unwrap();
            let (s0, s1) = (layout.stride()[0], layout.stride()[1]);
            for scale in [None, Some(1.0f32 / 3.0)] {
                let start: Vec<f32> = (0..rows * cols).map(|k| (k % 7) as f32 - 3.0).collect();
                let want: Vec<u32> = (0..rows * cols)
                    .map(|k| {
                        let (i, j) = (k / cols, k % cols);
                        (start[k] + term(g[layout.start_offset() + i * s0 + j * s1], scale)).to_bits()
                    })
                    .collect();
                let strided = Strided::new(g, layout, scale).unwrap();
                assert_eq!(strided.vector, s0 == 1 && cfg!(target_arch = "x86_64") && avx2(), "{s0}");
                for vector in [false, strided.vector] {
                    let mut acc = start.clone();
                    Strided { vector, ..strided }.add_rows(0, &mut acc);
                    let got: Vec<u32> = acc.iter().map(|x| x.to_bits()).collect();
                    assert_eq!(
                        got, want,
                        "{rows}x{cols} at strides ({s0}, {s1}), {scale:?}, vector {vector}"
                    );
                }
            }
        }
        // A layout that reaches past its storage is refused before anything is read.
        let short = [0f32; 10];
        let layout = Layout::new((4, 4).into(), vec![1, 4], 0);
        assert!(Strided::new(&short, &layout, None).is_err());
    }

    fn avx2() -> bool {
        #[cfg(target_arch = "x86_64")]
        return std::arch::is_x86_feature_detected!("avx2");
        #[cfg(not(target_arch = "x86_64"))]
        false
    }

    /// A gradient of another shape is an error, not a silent broadcast or a partial add.
    #[test]
    fn a_gradient_of_another_shape_is_an_error() {
        let mut acc = Accumulators::default();
        acc.add("w", t(&[1.0, 2.0]), Some(0.5)).unwrap();
        assert!(acc.add("w", t(&[1.0, 2.0, 3.0]), Some(0.5)).is_err());
        assert!(acc.add("w", t(&[1.0, 2.0, 3.0]), None).is_err());
    }
}
