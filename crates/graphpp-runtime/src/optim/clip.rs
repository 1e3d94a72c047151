//! Global gradient-norm clipping across stages, with the semantics of PyTorch's
//! `torch.nn.utils.clip_grad_norm_` (norm_type 2) and Megatron-LM's `clip_grad_norm_fp32`: the norm is
//! the L2 norm over all gradients of all stages, and every gradient is multiplied by
//! `min(1, max_norm / (norm + 1e-6))`.
//!
//! Split in three so ranks can combine: each rank computes [`local_sq_norm`] of its stages'
//! gradients, the runtime sums those over ranks (an all-reduce of one f64), then every rank computes
//! the same [`clip_scale`] and applies it with [`scale_grads`]. [`clip_grad_norm`] does all three for
//! a single rank.

use crate::optim::{kernel, OptimError};
use candle_core::{DType, Tensor};
use std::collections::HashMap;

/// Added to the norm in the clipping coefficient, as in PyTorch and Megatron-LM.
pub const CLIP_EPS: f64 = 1e-6;

/// Sum of squares of every element of every gradient (f64; summed per tensor in f64, tensors in
/// name order so the result does not depend on map order). Gradients may be f32, f64, bf16 or f16.
/// Errors: [`OptimError::DType`] for an integer tensor, [`OptimError::Kernel`].
pub fn local_sq_norm(grads: &HashMap<String, Tensor>) -> Result<f64, OptimError> {
    let mut names: Vec<&String> = grads.keys().collect();
    names.sort();
    let mut total = 0.0;
    for name in names {
        let g = &grads[name];
        if !g.dtype().is_float() {
            return Err(OptimError::DType {
                name: name.clone(),
                dtype: g.dtype(),
                expected: "a float dtype",
            });
        }
        let sq = g.to_dtype(DType::F64).and_then(|x| x.sqr()?.sum_all()?.to_scalar::<f64>());
        total += sq.map_err(kernel(name))?;
    }
    Ok(total)
}

/// The factor to multiply every gradient by: `min(1, max_norm / (sqrt(total_sq_norm) + 1e-6))`,
/// where `total_sq_norm` is the sum of [`local_sq_norm`] over all ranks (PyTorch
/// `clip_grad_norm_`: `clip_coef_clamped = clamp(max_norm / (total_norm + 1e-6), max=1)`).
/// Errors: [`OptimError::BadMaxNorm`] unless `max_norm` is finite and > 0;
/// [`OptimError::NonFiniteNorm`] for a NaN, infinite or negative `total_sq_norm` (an overflowed
/// gradient: the caller should skip the step rather than apply NaN).
pub fn clip_scale(total_sq_norm: f64, max_norm: f64) -> Result<f32, OptimError> {
    if !max_norm.is_finite() || max_norm <= 0.0 {
        return Err(OptimError::BadMaxNorm { max_norm });
    }
    if !total_sq_norm.is_finite() || total_sq_norm < 0.0 {
        return Err(OptimError::NonFiniteNorm { sq_norm: total_sq_norm });
    }
    Ok((max_norm / (total_sq_norm.sqrt() + CLIP_EPS)).min(1.0) as f32)
}

/// Multiplies every gradient by `scale` in place (a scale of exactly 1 leaves them untouched).
/// Errors: [`OptimError::BadScale`] for a NaN, infinite or negative scale, [`OptimError::Kernel`].
pub fn scale_grads(grads: &mut HashMap<String, Tensor>, scale: f32) -> Result<(), OptimError> {
    if !scale.is_finite() || scale < 0.0 {
        return Err(OptimError::BadScale { scale });
    }
    if scale == 1.0 {
        return Ok(());
    }
    for (name, g) in grads.iter_mut() {
        *g = g.affine(scale as f64, 0.0).map_err(kernel(name))?;
    }
    Ok(())
}

/// Single-rank clipping: [`local_sq_norm`], [`clip_scale`], [`scale_grads`]; returns the total L2
/// norm before clipping (as PyTorch's `clip_grad_norm_` does). Errors: those of the three parts.
pub fn clip_grad_norm(grads: &mut HashMap<String, Tensor>, max_norm: f64) -> Result<f64, OptimError> {
    let sq = local_sq_norm(grads)?;
    scale_grads(grads, clip_scale(sq, max_norm)?)?;
    Ok(sq.sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn grads(pairs: &[(&str, &[f32])]) -> HashMap<String, Tensor> {
        pairs
            .iter()
            .map(|(n, d)| (n.to_string(), Tensor::from_slice(d, d.len(), &Device::Cpu).unwrap()))
            .collect()
    }

    #[test]
    fn sq_norm_sums_over_all_tensors() {
        // 3² + 4² + 12² = 169: norm 13.
        let g = grads(&[("a", &[3.0, 4.0]), ("b", &[12.0])]);
        assert_eq!(local_sq_norm(&g).unwrap(), 169.0);
        assert_eq!(local_sq_norm(&HashMap::new()).unwrap(), 0.0);
    }

    /// Two ranks holding halves of the gradients: summing their squared norms gives the same scale
    /// as one rank holding everything (the global norm, not a per-stage one).
    #[test]
    fn ranks_combine_squared_norms() {
        let (r0, r1) = (grads(&[("a", &[3.0, 4.0])]), grads(&[("b", &[12.0])]));
        let total = local_sq_norm(&r0).unwrap() + local_sq_norm(&r1).unwrap();
        let s = clip_scale(total, 1.3).unwrap();
        assert!((s as f64 - 1.3 / (13.0 + 1e-6)).abs() < 1e-7);
        // A per-stage clip would scale rank 0 by 1.3/5 instead.
        assert!((s - 0.1).abs() < 1e-6);
    }

    #[test]
    fn scale_is_one_below_the_threshold() {
        assert_eq!(clip_scale(0.25, 1.0).unwrap(), 1.0);
        assert_eq!(clip_scale(0.0, 1.0).unwrap(), 1.0);
        // Norm 2, max 1: 1/(2 + 1e-6).
        assert_eq!(clip_scale(4.0, 1.0).unwrap(), (1.0 / (2.0 + 1e-6)) as f32);
    }

    #[test]
    fn clipping_brings_the_norm_to_max_norm() {
        let mut g = grads(&[("a", &[3.0, 4.0]), ("b", &[12.0])]);
        let norm = clip_grad_norm(&mut g, 6.5).unwrap();
        assert_eq!(norm, 13.0);
        let after = local_sq_norm(&g).unwrap().sqrt();
        assert!((after - 6.5).abs() < 1e-5, "{after}");
        let a = g["a"].to_vec1::<f32>().unwrap();
        assert!((a[0] - 1.5).abs() < 1e-6 && (a[1] - 2.0).abs() < 1e-6, "{a:?}");
    }

    proptest::proptest! {
        /// Any split of the gradients over ranks gives the single-rank squared norm (up to f64
        /// rounding), and after clipping with the combined scale the global norm is at most max_norm.
        #[test]
        fn any_rank_split_clips_to_max_norm(
            data in proptest::collection::vec(-50.0f32..50.0, 1..40),
            ranks in proptest::collection::vec(0usize..4, 40),
            max_norm in 0.01f64..100.0,
        ) {
            let mut per_rank: Vec<HashMap<String, Tensor>> = vec![HashMap::new(); 4];
            for (i, x) in data.iter().enumerate() {
                per_rank[ranks[i]].extend(grads(&[(&format!("g{i}"), &[*x])]));
            }
            let whole: f64 = data.iter().map(|x| (*x as f64).powi(2)).sum();
            let total: f64 = per_rank.iter().map(|g| local_sq_norm(g).unwrap()).sum();
            proptest::prop_assert!((total - whole).abs() <= 1e-12 * whole.max(1.0));
            let s = clip_scale(total, max_norm).unwrap();
            let mut after = 0.0;
            for g in per_rank.iter_mut() {
                scale_grads(g, s).unwrap();
                after += local_sq_norm(g).unwrap();
            }
            proptest::prop_assert!(after.sqrt() <= max_norm * (1.0 + 1e-6), "{} > {max_norm}", after.sqrt());
            if whole.sqrt() > max_norm * 1.01 {
                proptest::prop_assert!((after.sqrt() - max_norm).abs() <= 1e-5 * max_norm);
            } else if whole.sqrt() < max_norm * 0.99 {
                proptest::prop_assert_eq!(s, 1.0);
            }
        }
    }

    #[test]
    fn bad_inputs_are_typed_errors() {
        assert!(matches!(clip_scale(1.0, 0.0), Err(OptimError::BadMaxNorm { .. })));
        assert!(matches!(clip_scale(1.0, f64::INFINITY), Err(OptimError::BadMaxNorm { .. })));
        assert!(matches!(clip_scale(f64::NAN, 1.0), Err(OptimError::NonFiniteNorm { .. })));
        assert!(matches!(clip_scale(f64::INFINITY, 1.0), Err(OptimError::NonFiniteNorm { .. })));
        let mut g = grads(&[("a", &[f32::NAN])]);
        assert!(matches!(clip_grad_norm(&mut g, 1.0), Err(OptimError::NonFiniteNorm { .. })));
        assert!(matches!(scale_grads(&mut g, f32::NAN), Err(OptimError::BadScale { .. })));
        let ints = HashMap::from([("i".to_string(), Tensor::from_slice(&[1u32], 1, &Device::Cpu).unwrap())]);
        assert!(matches!(local_sq_norm(&ints), Err(OptimError::DType { name, .. }) if name == "i"));
    }
}
