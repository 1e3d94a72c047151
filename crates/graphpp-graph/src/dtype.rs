//! Element types and static shapes of graph values, with NumPy-style broadcasting
//! (docs/ARCHITECTURE.md "Graph IR": static shapes, dtype kept in the IR).

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Element type of a value. `U32` holds indices (token ids, targets, top-k results).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// 32-bit float (default for training).
    #[default]
    F32,
    /// 64-bit float (finite-difference gradient checks).
    F64,
    /// bfloat16: the compute dtype of mixed-precision stage graphs (8 significant bits, f32's
    /// exponent range).
    BF16,
    /// 32-bit unsigned integer (indices).
    U32,
}

impl DType {
    /// Size of one element in bytes.
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::U32 => 4,
            DType::F64 => 8,
            DType::BF16 => 2,
        }
    }

    /// Whether values of this type carry gradients.
    pub fn is_float(self) -> bool {
        !matches!(self, DType::U32)
    }

    /// The dtype in which the precision-sensitive parts of a computation on values of this dtype
    /// run: RMSNorm's mean of squares, the attention softmax, the loss. `f32` for `bf16` (as
    /// Hugging Face Llama upcasts in `LlamaRMSNorm`, `softmax(…, dtype=float32)` and the logits
    /// before the loss); the dtype itself otherwise.
    pub fn wide(self) -> DType {
        match self {
            DType::BF16 => DType::F32,
            d => d,
        }
    }

    /// Short name used in the text form (`f32`, `f64`, `bf16`, `u32`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::BF16 => "bf16",
            DType::U32 => "u32",
        }
    }
}

/// A name that is not one of `f32`, `f64`, `bf16`, `u32`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown dtype `{0}` (expected f32, f64, bf16 or u32)")]
pub struct UnknownDType(pub String);

impl FromStr for DType {
    type Err = UnknownDType;

    /// Parses the text-form name ([`DType::name`]), case-insensitively.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [DType::F32, DType::F64, DType::BF16, DType::U32]
            .into_iter()
            .find(|d| d.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| UnknownDType(s.to_string()))
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A tensor's static shape: dimension sizes, outermost first; rank 0 is a scalar. (The
/// pipeline's shape, p × v × m, is `graphpp_schedule::Shape`.)
pub type Dims = Vec<usize>;

/// Type of one SSA value: dtype and static shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorType {
    /// Element type.
    pub dtype: DType,
    /// Dimension sizes.
    pub shape: Dims,
}

impl TensorType {
    /// A type from a dtype and a shape.
    pub fn new(dtype: DType, shape: impl Into<Dims>) -> Self {
        TensorType { dtype, shape: shape.into() }
    }

    /// Number of elements (1 for a scalar).
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Size in bytes (`numel * dtype size`).
    pub fn size_bytes(&self) -> usize {
        self.numel() * self.dtype.size_bytes()
    }
}

impl fmt::Display for TensorType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dims: Vec<String> = self.shape.iter().map(|d| d.to_string()).collect();
        write!(f, "{}[{}]", self.dtype, dims.join(","))
    }
}

/// NumPy broadcasting of two shapes: align on the right; each pair of dimensions must be equal or
/// one of them 1. Returns `None` when the shapes do not broadcast.
pub fn broadcast_shapes(a: &[usize], b: &[usize]) -> Option<Dims> {
    let rank = a.len().max(b.len());
    let mut out = vec![0; rank];
    for i in 0..rank {
        let da = if i < rank - a.len() { 1 } else { a[i - (rank - a.len())] };
        let db = if i < rank - b.len() { 1 } else { b[i - (rank - b.len())] };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return None,
        };
    }
    Some(out)
}

/// Whether `from` broadcasts to exactly `to` (NumPy rules, one-directional).
pub fn broadcasts_to(from: &[usize], to: &[usize]) -> bool {
    from.len() <= to.len() && broadcast_shapes(from, to).as_deref() == Some(to)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcasting_follows_numpy() {
        assert_eq!(broadcast_shapes(&[4, 1, 3], &[5, 1]), Some(vec![4, 5, 3]));
        assert_eq!(broadcast_shapes(&[], &[2, 3]), Some(vec![2, 3]));
        assert_eq!(broadcast_shapes(&[2, 3], &[3, 2]), None);
        assert!(broadcasts_to(&[1, 3], &[2, 3]));
        assert!(!broadcasts_to(&[2, 3], &[3]));
    }

    #[test]
    fn type_text_and_size() {
        let t = TensorType::new(DType::F32, vec![4, 64, 256]);
        assert_eq!(t.to_string(), "f32[4,64,256]");
        assert_eq!(t.size_bytes(), 4 * 64 * 256 * 4);
        assert_eq!(TensorType::new(DType::BF16, vec![]).size_bytes(), 2);
    }

    #[test]
    fn names_parse_back_and_bf16_widens_to_f32() {
        for d in [DType::F32, DType::F64, DType::BF16, DType::U32] {
            assert_eq!(d.name().parse::<DType>(), Ok(d));
        }
        assert_eq!("BF16".parse::<DType>(), Ok(DType::BF16));
        assert_eq!("fp16".parse::<DType>(), Err(UnknownDType("fp16".into())));
        assert_eq!(DType::BF16.wide(), DType::F32);
        assert_eq!(DType::F64.wide(), DType::F64);
        assert_eq!(DType::default(), DType::F32);
    }
}
