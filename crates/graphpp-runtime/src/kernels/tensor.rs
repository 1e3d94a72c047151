//! Conversions between candle CPU tensors and plain data: IR dtypes, f64 and u32 buffers, named
//! maps, and in-place reads of f32 storage.

use std::collections::HashMap;

use candle_core::{CpuStorage, DType as CDType, Device, Tensor};
use graphpp_graph::DType;

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
