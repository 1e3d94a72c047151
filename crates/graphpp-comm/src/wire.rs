//! The wire form of a tensor, for communicators whose ranks are processes (MPI): a small header
//! giving dtype and shape, then the elements in row-major order, little-endian.
//!
//! ```text
//! offset  size       field
//! 0       2          magic b"GP"
//! 2       1          format version (1)
//! 3       1          dtype code (see DTYPE_CODES)
//! 4       4          ndim, u32 LE
//! 8       8 × ndim   dims, u64 LE each
//! …       numel × s  elements, LE (s = dtype size in bytes); a 0-dim tensor has one element
//! ```
//!
//! The buffer holds exactly one tensor: missing bytes are [`WireError::Truncated`], extra bytes
//! [`WireError::Trailing`].

use candle_core::{DType, Device, Tensor, WithDType};

use super::CommError;

/// First two bytes of every buffer.
pub const MAGIC: [u8; 2] = *b"GP";
/// The format version this build writes and reads.
pub const VERSION: u8 = 1;
/// Bytes before the dims.
const FIXED: usize = 8;

/// The dtypes the wire form carries and their codes.
pub const DTYPE_CODES: [(DType, u8); 9] = [
    (DType::U8, 0),
    (DType::U32, 1),
    (DType::I16, 2),
    (DType::I32, 3),
    (DType::I64, 4),
    (DType::BF16, 5),
    (DType::F16, 6),
    (DType::F32, 7),
    (DType::F64, 8),
];

/// A malformed buffer, or a tensor the wire form cannot carry.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The buffer ends before the header or the data does.
    #[error("tensor wire buffer truncated: {needed} bytes needed, {got} present")]
    Truncated {
        /// Bytes the header says the buffer holds (or the fixed header size).
        needed: usize,
        /// Bytes present.
        got: usize,
    },
    /// Bytes after the tensor's data.
    #[error("tensor wire buffer has {extra} bytes after the tensor data")]
    Trailing {
        /// How many.
        extra: usize,
    },
    /// The buffer does not start with [`MAGIC`].
    #[error("not a tensor wire buffer: starts with {found:?}, expected {MAGIC:?} (\"GP\")")]
    BadMagic {
        /// The first two bytes.
        found: [u8; 2],
    },
    /// A format version this build does not read.
    #[error("tensor wire format version {found}; this build reads version {VERSION}")]
    Version {
        /// The version byte.
        found: u8,
    },
    /// A dtype code not in [`DTYPE_CODES`].
    #[error("unknown dtype code {code} in tensor wire buffer")]
    UnknownDtype {
        /// The code.
        code: u8,
    },
    /// A shape whose byte size does not fit in memory addresses.
    #[error("tensor wire buffer declares shape {shape:?}, too large to hold")]
    TooLarge {
        /// The declared dims.
        shape: Vec<u64>,
    },
    /// A dtype the wire form does not carry (the 8-, 6- and 4-bit floats).
    #[error("the tensor wire form cannot carry {dtype:?} tensors")]
    Unsupported {
        /// The dtype.
        dtype: DType,
    },
    /// A malformed message envelope between rank processes ([`super::envelope`]).
    #[error("malformed message envelope: {message}")]
    Envelope {
        /// What is wrong.
        message: String,
    },
    /// Reading the tensor's elements or building the tensor failed.
    #[error("tensor wire form: {message}")]
    Tensor {
        /// candle's error text.
        message: String,
    },
}

fn candle(e: candle_core::Error) -> WireError {
    WireError::Tensor { message: e.to_string() }
}

/// The wire form of `t` (any device; the data is copied to the host).
///
/// # Errors
/// [`WireError::Unsupported`] for the 8-, 6- and 4-bit float dtypes; [`WireError::Tensor`] when
/// candle cannot read the elements.
pub fn encode(t: &Tensor) -> Result<Vec<u8>, CommError> {
    let dtype = t.dtype();
    let code = DTYPE_CODES
        .iter()
        .find(|(d, _)| *d == dtype)
        .map(|&(_, c)| c)
        .ok_or(WireError::Unsupported { dtype })?;
    let dims = t.dims();
    let mut out = Vec::with_capacity(FIXED + 8 * dims.len() + t.elem_count() * dtype.size_in_bytes());
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    out.push(code);
    // ndim ≤ u32::MAX: candle shapes are far smaller.
    out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
    for &d in dims {
        out.extend_from_slice(&(d as u64).to_le_bytes());
    }
    match dtype {
        DType::U8 => put(&mut out, t, u8::to_le_bytes),
        DType::U32 => put(&mut out, t, u32::to_le_bytes),
        DType::I16 => put(&mut out, t, i16::to_le_bytes),
        DType::I32 => put(&mut out, t, i32::to_le_bytes),
        DType::I64 => put(&mut out, t, i64::to_le_bytes),
        DType::BF16 => put(&mut out, t, half::bf16::to_le_bytes),
        DType::F16 => put(&mut out, t, half::f16::to_le_bytes),
        DType::F32 => put(&mut out, t, f32::to_le_bytes),
        DType::F64 => put(&mut out, t, f64::to_le_bytes),
        _ => Err(WireError::Unsupported { dtype }),
    }?;
    Ok(out)
}

fn put<T: WithDType, const N: usize>(
    out: &mut Vec<u8>,
    t: &Tensor,
    le: fn(T) -> [u8; N],
) -> Result<(), WireError> {
    for v in t.flatten_all().and_then(|f| f.to_vec1::<T>()).map_err(candle)? {
        out.extend_from_slice(&le(v));
    }
    Ok(())
}

/// The CPU tensor whose wire form is `buf`.
///
/// # Errors
/// [`CommError::Wire`] with [`WireError::Truncated`], [`WireError::Trailing`],
/// [`WireError::BadMagic`], [`WireError::Version`], [`WireError::UnknownDtype`] or
/// [`WireError::TooLarge`].
pub fn decode(buf: &[u8]) -> Result<Tensor, CommError> {
    let got = buf.len();
    if got < FIXED {
        return Err(WireError::Truncated { needed: FIXED, got }.into());
    }
    let found = [buf[0], buf[1]];
    if found != MAGIC {
        return Err(WireError::BadMagic { found }.into());
    }
    if buf[2] != VERSION {
        return Err(WireError::Version { found: buf[2] }.into());
    }
    let code = buf[3];
    let dtype = DTYPE_CODES
        .iter()
        .find(|(_, c)| *c == code)
        .map(|&(d, _)| d)
        .ok_or(WireError::UnknownDtype { code })?;
    let ndim = u32::from_le_bytes([buf[4], buf[5], buf[6], buf[7]]) as usize;
    let header = ndim.checked_mul(8).and_then(|n| n.checked_add(FIXED));
    let header = match header {
        Some(h) if h <= got => h,
        // A header longer than the buffer (or than memory) is a truncated buffer.
        _ => return Err(WireError::Truncated { needed: header.unwrap_or(usize::MAX), got }.into()),
    };
    let dims64: Vec<u64> = buf[FIXED..header]
        .chunks_exact(8)
        .map(|c| {
            let mut a = [0u8; 8];
            a.copy_from_slice(c);
            u64::from_le_bytes(a)
        })
        .collect();
    let too_large = || WireError::TooLarge { shape: dims64.clone() };
    let dims = dims64
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| too_large()))
        .collect::<Result<Vec<usize>, _>>()?;
    let data_len =
        dims.iter().try_fold(dtype.size_in_bytes(), |a, &d| a.checked_mul(d)).ok_or_else(too_large)?;
    let needed = header.checked_add(data_len).ok_or_else(too_large)?;
    if got < needed {
        return Err(WireError::Truncated { needed, got }.into());
    }
    if got > needed {
        return Err(WireError::Trailing { extra: got - needed }.into());
    }
    let data = &buf[header..];
    let t = match dtype {
        DType::U8 => get(data, &dims, u8::from_le_bytes),
        DType::U32 => get(data, &dims, u32::from_le_bytes),
        DType::I16 => get(data, &dims, i16::from_le_bytes),
        DType::I32 => get(data, &dims, i32::from_le_bytes),
        DType::I64 => get(data, &dims, i64::from_le_bytes),
        DType::BF16 => get(data, &dims, half::bf16::from_le_bytes),
        DType::F16 => get(data, &dims, half::f16::from_le_bytes),
        DType::F32 => get(data, &dims, f32::from_le_bytes),
        DType::F64 => get(data, &dims, f64::from_le_bytes),
        _ => Err(WireError::Unsupported { dtype }),
    }?;
    Ok(t)
}

fn get<T: WithDType, const N: usize>(
    data: &[u8],
    dims: &[usize],
    from_le: fn([u8; N]) -> T,
) -> Result<Tensor, WireError> {
    let values: Vec<T> = data
        .chunks_exact(N)
        .map(|c| {
            let mut a = [0u8; N];
            a.copy_from_slice(c);
            from_le(a)
        })
        .collect();
    Tensor::from_vec(values, dims, &Device::Cpu).map_err(candle)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn wire_err(r: Result<Tensor, CommError>) -> WireError {
        match r {
            Err(CommError::Wire(e)) => e,
            other => panic!("expected a wire error, got {other:?}"),
        }
    }

    /// A tensor of `dtype` and `dims` whose elements come from `bits` (any bit pattern the dtype
    /// holds, NaNs included for the floats).
    fn tensor(dtype: DType, dims: &[usize], bits: &[u64]) -> Tensor {
        let n: usize = dims.iter().product();
        let b = |i: usize| bits[i % bits.len()];
        let cpu = &Device::Cpu;
        match dtype {
            DType::U8 => Tensor::from_vec((0..n).map(|i| b(i) as u8).collect(), dims, cpu),
            DType::U32 => Tensor::from_vec((0..n).map(|i| b(i) as u32).collect(), dims, cpu),
            DType::I16 => Tensor::from_vec((0..n).map(|i| b(i) as i16).collect(), dims, cpu),
            DType::I32 => Tensor::from_vec((0..n).map(|i| b(i) as i32).collect(), dims, cpu),
            DType::I64 => Tensor::from_vec((0..n).map(|i| b(i) as i64).collect(), dims, cpu),
            DType::BF16 => {
                Tensor::from_vec((0..n).map(|i| half::bf16::from_bits(b(i) as u16)).collect(), dims, cpu)
            }
            DType::F16 => {
                Tensor::from_vec((0..n).map(|i| half::f16::from_bits(b(i) as u16)).collect(), dims, cpu)
            }
            DType::F32 => Tensor::from_vec((0..n).map(|i| f32::from_bits(b(i) as u32)).collect(), dims, cpu),
            DType::F64 => Tensor::from_vec((0..n).map(|i| f64::from_bits(b(i))).collect(), dims, cpu),
            _ => unreachable!("not generated"),
        }
        .unwrap()
    }

    /// The elements' bit patterns, widened to u64 (bitwise comparison: NaN == NaN).
    fn bit_patterns(t: &Tensor) -> Vec<u64> {
        let f = t.flatten_all().unwrap();
        match t.dtype() {
            DType::U8 => f.to_vec1::<u8>().unwrap().into_iter().map(u64::from).collect(),
            DType::U32 => f.to_vec1::<u32>().unwrap().into_iter().map(u64::from).collect(),
            DType::I16 => f.to_vec1::<i16>().unwrap().into_iter().map(|v| v as u16 as u64).collect(),
            DType::I32 => f.to_vec1::<i32>().unwrap().into_iter().map(|v| v as u32 as u64).collect(),
            DType::I64 => f.to_vec1::<i64>().unwrap().into_iter().map(|v| v as u64).collect(),
            DType::BF16 => {
                f.to_vec1::<half::bf16>().unwrap().into_iter().map(|v| v.to_bits() as u64).collect()
            }
            DType::F16 => f.to_vec1::<half::f16>().unwrap().into_iter().map(|v| v.to_bits() as u64).collect(),
            DType::F32 => f.to_vec1::<f32>().unwrap().into_iter().map(|v| v.to_bits() as u64).collect(),
            DType::F64 => f.to_vec1::<f64>().unwrap().into_iter().map(f64::to_bits).collect(),
            _ => unreachable!("not generated"),
        }
    }

    #[test]
    fn header_layout_is_as_documented() {
        let t = Tensor::new(&[[1f32, 2.0, 3.0]], &Device::Cpu).unwrap();
        let b = encode(&t).unwrap();
        let mut want = vec![b'G', b'P', 1, 7, 2, 0, 0, 0];
        want.extend_from_slice(&1u64.to_le_bytes());
        want.extend_from_slice(&3u64.to_le_bytes());
        for v in [1f32, 2.0, 3.0] {
            want.extend_from_slice(&v.to_le_bytes());
        }
        assert_eq!(b, want);
    }

    #[test]
    fn non_contiguous_tensors_travel_in_row_major_order() {
        let t = Tensor::new(&[[1i64, 2, 3], [4, 5, 6]], &Device::Cpu).unwrap().t().unwrap();
        let d = decode(&encode(&t).unwrap()).unwrap();
        assert_eq!(d.to_vec2::<i64>().unwrap(), vec![vec![1, 4], vec![2, 5], vec![3, 6]]);
    }

    #[test]
    fn scalars_and_empty_tensors_round_trip() {
        let s = Tensor::new(2.5f64, &Device::Cpu).unwrap();
        let d = decode(&encode(&s).unwrap()).unwrap();
        assert_eq!(d.dims(), &[] as &[usize]);
        assert_eq!(d.to_scalar::<f64>().unwrap(), 2.5);
        let e = Tensor::zeros((0, 3), DType::BF16, &Device::Cpu).unwrap();
        let d = decode(&encode(&e).unwrap()).unwrap();
        assert_eq!((d.dims(), d.dtype()), (&[0usize, 3][..], DType::BF16));
    }

    #[test]
    fn malformed_buffers_are_typed_errors() {
        let t = Tensor::new(&[1u32, 2, 3], &Device::Cpu).unwrap();
        let b = encode(&t).unwrap();
        assert_eq!(wire_err(decode(&b[..5])), WireError::Truncated { needed: 8, got: 5 });
        assert_eq!(wire_err(decode(&b[..b.len() - 1])), WireError::Truncated { needed: 28, got: 27 });
        let mut long = b.clone();
        long.push(0);
        assert_eq!(wire_err(decode(&long)), WireError::Trailing { extra: 1 });
        let mut m = b.clone();
        m[0] = b'X';
        assert_eq!(wire_err(decode(&m)), WireError::BadMagic { found: [b'X', b'P'] });
        let mut v = b.clone();
        v[2] = 9;
        assert_eq!(wire_err(decode(&v)), WireError::Version { found: 9 });
        let mut c = b.clone();
        c[3] = 200;
        assert_eq!(wire_err(decode(&c)), WireError::UnknownDtype { code: 200 });
        // ndim = u32::MAX: the header alone is longer than the buffer.
        let mut n = b.clone();
        n[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(wire_err(decode(&n)), WireError::Truncated { got: 28, .. }));
        // dims whose byte size overflows.
        let mut big = b[..8].to_vec();
        big[4] = 2;
        big.extend_from_slice(&u64::MAX.to_le_bytes());
        big.extend_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(wire_err(decode(&big)), WireError::TooLarge { .. }));
    }

    #[test]
    fn eight_bit_floats_are_unsupported() {
        let t = Tensor::zeros(2, DType::F8E4M3, &Device::Cpu).unwrap();
        assert!(matches!(encode(&t), Err(CommError::Wire(WireError::Unsupported { dtype: DType::F8E4M3 }))));
    }

    fn dtypes() -> impl Strategy<Value = DType> {
        prop::sample::select(DTYPE_CODES.iter().map(|&(d, _)| d).collect::<Vec<_>>())
    }

    proptest! {
        /// Every carried dtype round-trips bit for bit, with its shape, and every strict prefix
        /// of a buffer is a truncated buffer.
        #[test]
        fn round_trip_and_truncation(
            dtype in dtypes(),
            dims in prop::collection::vec(0usize..5, 0..4),
            bits in prop::collection::vec(any::<u64>(), 1..16),
            cut in any::<prop::sample::Index>(),
        ) {
            let t = tensor(dtype, &dims, &bits);
            let b = encode(&t).unwrap();
            let n: usize = dims.iter().product();
            prop_assert_eq!(b.len(), 8 + 8 * dims.len() + n * dtype.size_in_bytes());
            let d = decode(&b).unwrap();
            prop_assert_eq!(d.dtype(), dtype);
            prop_assert_eq!(d.dims(), &dims[..]);
            prop_assert_eq!(bit_patterns(&d), bit_patterns(&t));
            let k = cut.index(b.len());
            let is_truncated = matches!(wire_err(decode(&b[..k])), WireError::Truncated { got, .. } if got == k);
            prop_assert!(is_truncated);
        }
    }
}
