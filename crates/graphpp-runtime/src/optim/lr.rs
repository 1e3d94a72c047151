//! Learning-rate schedule: linear warm-up from 0, then cosine decay to a floor — the schedule of
//! nanoGPT's `get_lr` and Megatron-LM's `OptimizerParamScheduler.get_lr` (cosine style, init lr 0).

/// Errors of [`CosineSchedule::new`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LrError {
    /// The peak learning rate is not finite and > 0.
    #[error("peak learning rate {lr} must be finite and > 0")]
    BadLr { lr: f64 },
    /// The floor is outside `[0, lr]`.
    #[error("min_lr {min_lr} must be finite and in [0, lr = {lr}]")]
    BadMinLr { min_lr: f64, lr: f64 },
    /// Warm-up longer than the whole schedule.
    #[error("warmup ({warmup} steps) exceeds total ({total} {})", if *.total == 1 { "step" } else { "steps" })]
    WarmupExceedsTotal { warmup: u64, total: u64 },
    /// A schedule of zero steps.
    #[error("total must be at least 1 step")]
    ZeroTotal,
}

/// Linear warm-up then cosine decay. For the optimizer step `t` (1-based, the `t` of AdamW's bias
/// correction; `t = 0` is allowed and means "before the first step"), with peak `lr`, floor
/// `min_lr`, `warmup` and `total` steps (Megatron-LM `get_lr`; nanoGPT `get_lr` up to the
/// off-by-one of its warm-up):
/// ```text
/// t <= warmup (warmup > 0):  lr · t / warmup
/// warmup < t <= total:       min_lr + (lr − min_lr) · ½ · (1 + cos(π · (t − warmup) / (total − warmup)))
/// t > total:                 min_lr
/// ```
/// So the rate is `lr/2` at `t = warmup/2`, `lr` at `t = warmup`, and `min_lr` at `t = total`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CosineSchedule {
    lr: f64,
    min_lr: f64,
    warmup: u64,
    total: u64,
}

impl CosineSchedule {
    /// A schedule. Errors: [`LrError::BadLr`] (lr not finite or <= 0), [`LrError::BadMinLr`]
    /// (min_lr outside `[0, lr]`), [`LrError::ZeroTotal`], [`LrError::WarmupExceedsTotal`].
    pub fn new(lr: f64, min_lr: f64, warmup: u64, total: u64) -> Result<Self, LrError> {
        if !lr.is_finite() || lr <= 0.0 {
            return Err(LrError::BadLr { lr });
        }
        if !(0.0..=lr).contains(&min_lr) {
            return Err(LrError::BadMinLr { min_lr, lr });
        }
        if total == 0 {
            return Err(LrError::ZeroTotal);
        }
        if warmup > total {
            return Err(LrError::WarmupExceedsTotal { warmup, total });
        }
        Ok(CosineSchedule { lr, min_lr, warmup, total })
    }

    /// The schedule of a setup that takes no optimizer step (a verification's gradient step):
    /// `new(1e-3, 0, 0, 1)`, which cannot fail.
    pub const fn no_steps() -> Self {
        CosineSchedule { lr: 1e-3, min_lr: 0.0, warmup: 0, total: 1 }
    }

    /// Peak learning rate.
    pub fn peak(&self) -> f64 {
        self.lr
    }

    /// The learning rate for optimizer step `t` (formula in the type's docs).
    pub fn lr_at(&self, t: u64) -> f64 {
        if self.warmup > 0 && t <= self.warmup {
            return self.lr * t as f64 / self.warmup as f64;
        }
        if t >= self.total {
            return self.min_lr;
        }
        let ratio = (t - self.warmup) as f64 / (self.total - self.warmup) as f64;
        let coeff = 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos());
        self.min_lr + coeff * (self.lr - self.min_lr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * b.abs().max(1e-12)
    }

    #[test]
    fn warmup_is_linear_from_zero() {
        let s = CosineSchedule::new(3e-4, 3e-5, 100, 1000).unwrap();
        assert_eq!(s.lr_at(0), 0.0);
        assert!(close(s.lr_at(1), 3e-6));
        assert!(close(s.lr_at(50), 1.5e-4));
        assert!(close(s.lr_at(100), 3e-4));
    }

    #[test]
    fn cosine_hits_midpoint_and_floor() {
        let s = CosineSchedule::new(1.0, 0.1, 100, 1100).unwrap();
        // Half-way through the decay cos(π/2) = 0: the mean of peak and floor.
        assert!(close(s.lr_at(600), 0.55));
        // A quarter in: 0.1 + 0.9 · ½(1 + cos(π/4)).
        let q = 0.1 + 0.9 * 0.5 * (1.0 + std::f64::consts::FRAC_1_SQRT_2);
        assert!(close(s.lr_at(350), q));
        assert_eq!(s.lr_at(1100), 0.1);
        assert_eq!(s.lr_at(5000), 0.1);
        // Just past the warm-up the rate starts below the peak and keeps falling.
        assert!(s.lr_at(101) < 1.0 && s.lr_at(101) > s.lr_at(102));
    }

    #[test]
    fn no_warmup_starts_at_peak() {
        let s = CosineSchedule::new(2.0, 0.0, 0, 10).unwrap();
        assert_eq!(s.lr_at(0), 2.0);
        assert!(close(s.lr_at(5), 1.0));
        assert_eq!(s.lr_at(10), 0.0);
    }

    #[test]
    fn warmup_equal_total_holds_floor_afterwards() {
        let s = CosineSchedule::new(1.0, 0.25, 10, 10).unwrap();
        assert_eq!(s.lr_at(10), 1.0);
        assert_eq!(s.lr_at(11), 0.25);
    }

    #[test]
    fn bad_settings_are_typed_errors() {
        assert_eq!(
            CosineSchedule::new(1.0, 0.0, 11, 10),
            Err(LrError::WarmupExceedsTotal { warmup: 11, total: 10 })
        );
        assert_eq!(CosineSchedule::new(1.0, 0.0, 0, 0), Err(LrError::ZeroTotal));
        assert_eq!(CosineSchedule::new(0.0, 0.0, 0, 5), Err(LrError::BadLr { lr: 0.0 }));
        assert!(matches!(CosineSchedule::new(f64::NAN, 0.0, 0, 5), Err(LrError::BadLr { .. })));
        assert_eq!(CosineSchedule::new(1.0, 2.0, 0, 5), Err(LrError::BadMinLr { min_lr: 2.0, lr: 1.0 }));
        assert!(matches!(CosineSchedule::new(1.0, -0.1, 0, 5), Err(LrError::BadMinLr { .. })));
    }
}
