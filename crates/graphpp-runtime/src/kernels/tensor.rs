//! Conversions between candle tensors and plain data: IR dtypes, f64 and u32 buffers (made on
//! the CPU), named maps, in-place reads of CPU f32 storage, and the bf16 ↔ f32 casts (one
//! vectorised loop on the CPU, candle's cast elsewhere).

use std::collections::HashMap;

use candle_core::{CpuStorage, DType as CDType, Device, StridedBlocks, Tensor};
use graphpp_graph::DType;
use half::bf16;
use rayon::prelude::*;

/// candle dtype of an IR dtype.
pub fn candle_dtype(d: DType) -> CDType {
    match d {
        DType::F32 => CDType::F32,
        DType::F64 => CDType::F64,
        DType::BF16 => CDType::BF16,
        DType::U32 => CDType::U32,
    }
}

/// `f` of a CPU f32 tensor's elements in row-major order, read in place where the tensor is
/// contiguous (copied first where it is not).
///
/// # Errors
/// A tensor that is not a CPU f32 one; candle's, from the copy.
pub(crate) fn read_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> candle_core::Result<R> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cpu(CpuStorage::F32(data)) = &*storage else {
        candle_core::bail!("expected a CPU f32 tensor, got {:?}", t.dtype())
    };
    Ok(f(&data[layout.start_offset()..layout.start_offset() + t.elem_count()]))
}

/// A tensor of IR type (`dtype`, `shape`) from f64 row-major data (cast to `dtype`).
pub fn tensor_from_f64(data: &[f64], shape: &[usize], dtype: DType) -> candle_core::Result<Tensor> {
    Tensor::from_slice(data, shape.to_vec(), &Device::Cpu)?.to_dtype(candle_dtype(dtype))
}

/// A u32 tensor from row-major data.
pub fn tensor_u32(data: &[u32], shape: &[usize]) -> candle_core::Result<Tensor> {
    Tensor::from_slice(data, shape.to_vec(), &Device::Cpu)
}

/// All elements as f64, row-major.
pub fn to_f64(t: &Tensor) -> candle_core::Result<Vec<f64>> {
    t.to_dtype(CDType::F64)?.flatten_all()?.to_vec1::<f64>()
}

/// Named value map from parallel names and tensors.
pub fn named(names: &[String], tensors: &[Tensor]) -> HashMap<String, Tensor> {
    names.iter().cloned().zip(tensors.iter().cloned()).collect::<HashMap<_, _>>()
}

/// `x` rounded to the nearest bf16, ties to even, a NaN kept quiet: the bits of `half`'s
/// `bf16::from_f32` (and so of candle's cast), in a form the compiler vectorises.
#[inline(always)]
pub fn round_bf16(x: f32) -> bf16 {
    let b = x.to_bits();
    let bits = if x.is_nan() { (b >> 16) | 0x40 } else { (b + 0x7FFF + ((b >> 16) & 1)) >> 16 };
    bf16::from_bits(bits as u16)
}

/// `x` as f32 (exact: a bf16 is an f32's high half).
#[inline(always)]
pub fn widen_bf16(x: bf16) -> f32 {
    f32::from_bits((x.to_bits() as u32) << 16)
}

/// Elements per part when a cast is split over the rank's pool.
const CAST_PART: usize = 1 << 15;

/// `t` in `dtype`: candle's `to_dtype`, with the bits candle gives, but a CPU bf16 → f32 or
/// f32 → bf16 cast runs as one vectorised loop (split over the current pool for large
/// contiguous tensors; run by run for a strided view) instead of candle's per-element
/// conversion (a quarter of a bf16 `train` step in `perf`: docs/PERFORMANCE.md, "bf16"). One
/// difference: a signalling-NaN bf16 widens to a signalling-NaN f32 here, where candle (through
/// `half`) sets its quiet bit; graphpp's own bf16 values never hold one (every rounding to bf16
/// quiets NaNs).
///
/// # Errors
/// candle's, from `to_dtype`.
pub fn cast(t: &Tensor, dtype: CDType) -> candle_core::Result<Tensor> {
    let pair = (t.dtype(), dtype);
    let widen_or_round = matches!(pair, (CDType::BF16, CDType::F32) | (CDType::F32, CDType::BF16));
    if !widen_or_round || !t.device().is_cpu() {
        return t.to_dtype(dtype);
    }
    if !t.is_contiguous() {
        return cast_runs(t);
    }
    let n = t.elem_count();
    let (storage, layout) = t.storage_and_layout();
    let range = layout.start_offset()..layout.start_offset() + n;
    match &*storage {
        candle_core::Storage::Cpu(CpuStorage::BF16(v)) => {
            Tensor::from_vec(map(&v[range], widen_bf16), t.shape(), &Device::Cpu)
        }
        candle_core::Storage::Cpu(CpuStorage::F32(v)) => {
            Tensor::from_vec(map(&v[range], round_bf16), t.shape(), &Device::Cpu)
        }
        _ => candle_core::bail!("cast: expected a CPU tensor"),
    }
}

/// [`cast`] of a strided CPU bf16 or f32 tensor (a permuted view: heads split from `[B, T, H,
/// E]`) to the other dtype, contiguous: run by run of the elements its layout keeps contiguous
/// (candle's strided blocks), each in one vectorised loop, where candle converts element by
/// element through a strided index. The same bits.
fn cast_runs(t: &Tensor) -> candle_core::Result<Tensor> {
    let (storage, _) = t.storage_and_layout();
    let mut runs: Vec<(usize, usize)> = Vec::new();
    match t.strided_blocks() {
        StridedBlocks::SingleBlock { start_offset, len } => runs.push((start_offset, len)),
        StridedBlocks::UniformBlocks { start_offset, block_len, count, src_stride } => {
            runs.extend((0..count).map(|i| (start_offset + i * src_stride, block_len)))
        }
        StridedBlocks::MultipleBlocks { block_start_index, block_len } => {
            runs.extend(block_start_index.map(|start| (start, block_len)))
        }
    }
    fn convert<A: Copy, B>(v: &[A], runs: &[(usize, usize)], f: impl Fn(A) -> B) -> Vec<B> {
        let mut out = Vec::with_capacity(runs.iter().map(|r| r.1).sum());
        for &(start, len) in runs {
            out.extend(v[start..start + len].iter().map(|&x| f(x)));
        }
        out
    }
    match &*storage {
        candle_core::Storage::Cpu(CpuStorage::BF16(v)) => {
            Tensor::from_vec(convert(v, &runs, widen_bf16), t.shape(), &Device::Cpu)
        }
        candle_core::Storage::Cpu(CpuStorage::F32(v)) => {
            Tensor::from_vec(convert(v, &runs, round_bf16), t.shape(), &Device::Cpu)
        }
        _ => candle_core::bail!("cast: expected a CPU tensor"),
    }
}

/// `f` of every element of `x`, in parts over the current pool when `x` is long.
fn map<A: Copy + Sync, B: Copy + Send>(x: &[A], f: impl Fn(A) -> B + Sync) -> Vec<B> {
    let mut out: Vec<B> = Vec::with_capacity(x.len());
    let spare = &mut out.spare_capacity_mut()[..x.len()];
    let part = |(d, s): (&mut [std::mem::MaybeUninit<B>], &[A])| {
        for (d, s) in d.iter_mut().zip(s) {
            d.write(f(*s));
        }
    };
    if x.len() > CAST_PART && rayon::current_num_threads() > 1 {
        spare.par_chunks_mut(CAST_PART).zip(x.par_chunks(CAST_PART)).for_each(part);
    } else {
        part((spare, x));
    }
    // SAFETY: every element of the spare capacity was written above.
    unsafe { out.set_len(x.len()) };
    out
}

/// f32 values that test a rounding to bf16: ties to even both ways, the carry into the
/// exponent, overflow, subnormals, infinities, NaNs (quiet and signalling), zeros, then `random`
/// bit patterns (xorshift).
#[cfg(test)]
pub(crate) fn rounding_cases(random: usize) -> Vec<f32> {
    let mut bits: Vec<u32> = vec![
        0x3F80_8000,
        0x3F81_8000,
        0x3F80_8001,
        0x3F7F_FFFF,
        0x7F7F_FFFF,
        0xFF7F_FFFF,
        0x0000_8000,
        0x0001_8000,
        0x7F80_0000,
        0xFF80_0000,
        0x7FC0_0001,
        0xFF80_0001,
        0x7F80_0001,
        0,
        0x8000_0000,
    ];
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    bits.extend((0..random).map(|_| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 32) as u32
    }));
    bits.into_iter().map(f32::from_bits).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fast casts give candle's bits: ties to even both ways, the carry into the exponent,
    /// overflow, subnormals, infinities, NaNs and random patterns; a strided view and an offset
    /// view too; and f32 → bf16 → f32 is exact on bf16 values.
    #[test]
    fn casts_give_candles_bits() {
        let xs = rounding_cases(CAST_PART * 2 + 5);
        let n = xs.len();
        let t = Tensor::from_vec(xs, n, &Device::Cpu).unwrap();
        let pool = crate::kernels::threads::rank_pool(0, 2).unwrap();
        for view in [
            t.clone(),
            t.narrow(0, 3, 1000).unwrap(),
            t.narrow(0, 0, 1000).unwrap().reshape((10, 100)).unwrap().t().unwrap(),
            // Heads split from [B, T, H, E]: runs of E contiguous elements (candle's strided
            // blocks), as attention widens q, k and v.
            t.narrow(0, 7, 960).unwrap().reshape((4, 6, 5, 8)).unwrap().permute((0, 2, 1, 3)).unwrap(),
        ] {
            let want = view.to_dtype(CDType::BF16).unwrap();
            let got = pool.install(|| cast(&view, CDType::BF16)).unwrap();
            // f32 bits of a tensor; of a bf16 one through candle's exact widening, so equal f32
            // bits are equal bf16 bits.
            let bits = |x: &Tensor| {
                let x = x.to_dtype(CDType::F32).unwrap().flatten_all().unwrap();
                x.to_vec1::<f32>().unwrap().iter().map(|f| f.to_bits()).collect::<Vec<_>>()
            };
            assert_eq!(got.dtype(), CDType::BF16);
            assert_eq!(bits(&got), bits(&want));
            let back = pool.install(|| cast(&got, CDType::F32)).unwrap();
            assert_eq!(back.dtype(), CDType::F32);
            assert_eq!(bits(&back), bits(&want));
            assert_eq!(got.dims(), view.dims());
            // A bf16 view of the same layout widens to candle's f32 bits too.
            if let [a, b, ..] = view.dims() {
                let (a, b) = (*a, *b);
                let bf = want.flatten_all().unwrap();
                let strided = if view.rank() == 4 {
                    bf.reshape((4, 5, 6, 8)).unwrap().permute((0, 2, 1, 3)).unwrap()
                } else {
                    bf.reshape((b, a)).unwrap().t().unwrap()
                };
                let wide = pool.install(|| cast(&strided, CDType::F32)).unwrap();
                assert_eq!(bits(&wide), bits(&strided.to_dtype(CDType::F32).unwrap()));
            }
        }
    }
}
