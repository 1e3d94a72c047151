//! Interleaved zero bubble (ZB1P; PyTorch `ScheduleInterleavedZeroBubble`).
//!
//! Source: Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), §3 (ZB-H1 on interleaved
//! chunks); docs/ARCHITECTURE.md, "Schedules and reference figures" (Interleaved zero bubble row); PyTorch
//! `torch/distributed/pipelining/schedules.py`. Interleaved 1F1B (see [`super::interleaved`]) with a
//! warm-up of one forward per hop instead of two, each backward split into `I` and `W`: after the
//! `k`-th `I`, once `k ≥ r`, rank `r` runs the `W` of its oldest backward still without one; the rest
//! of the `W`s end the program. PyTorch's rejection of `m` not divisible by its round count is lifted
//! the same way as in interleaved 1F1B.

use super::interleaved::{generate_variant, Variant};
use super::{GenerateError, Shape};
use crate::schedule::Schedule;

/// Interleaved ZB1P for `shape` (`p` ranks, `v ≥ 1` stages per rank, loop placement, `m`
/// microbatches). Emits `F`, `I` and `W`; rank `r`'s warm-up is `min((v−1)·g + (p−1−r), v·m)`
/// forwards (`g` = microbatches per round).
///
/// # Errors
/// None beyond the common checks; every shape is served.
pub fn generate(shape: &Shape) -> Result<Schedule, GenerateError> {
    Ok(generate_variant(shape, Variant::ZERO_BUBBLE))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::action::{Action, ComputeKind};
    use proptest::prelude::*;

    /// p = 4, v = 2, m = 8: the last rank (r = 3) holds back its first 3 W's; rank 0 runs its first W
    /// right after its first I.
    #[test]
    fn weight_delay_is_rank() {
        let s = generate(&Shape::new(4, 2, 8)).unwrap();
        let first_w =
            |r: usize| s.program(r).iter().position(|a| a.computes().any(|(k, _)| k == ComputeKind::W));
        let first_i =
            |r: usize| s.program(r).iter().position(|a| a.computes().any(|(k, _)| k == ComputeKind::I));
        assert_eq!(first_w(0).unwrap(), first_i(0).unwrap() + 1);
        let p3 = s.program(3);
        let is_before_w0 = &p3[..first_w(3).unwrap()];
        let n_i = is_before_w0.iter().filter(|a| a.computes().any(|(k, _)| k == ComputeKind::I)).count();
        assert_eq!(n_i, 4, "rank 3 runs I number 0..=3 before its first W");
        assert_eq!(p3[first_w(3).unwrap()], Action::w(7, 0));
    }

    proptest! {
        /// Each own (stage, mb) has F, then I, then W exactly once; W's follow the I order; no B.
        #[test]
        fn f_i_w_once_and_w_in_i_order(p in 1usize..7, v in 1usize..4, m in 1usize..20) {
            let s = generate(&Shape::new(p, v, m)).unwrap();
            for r in 0..p {
                let mut seen = std::collections::HashMap::new();
                let (mut i_order, mut w_order) = (vec![], vec![]);
                for a in s.program(r) {
                    for (k, t) in a.computes() {
                        prop_assert_eq!(t.stage % p, r);
                        let prev = seen.insert(t, k);
                        let expect_prev = match k {
                            ComputeKind::F => None,
                            ComputeKind::I => Some(ComputeKind::F),
                            ComputeKind::W => Some(ComputeKind::I),
                            ComputeKind::B => { prop_assert!(false, "no B in ZB1P"); None }
                        };
                        prop_assert_eq!(prev, expect_prev);
                        if k == ComputeKind::I { i_order.push(t) }
                        if k == ComputeKind::W { w_order.push(t) }
                    }
                }
                prop_assert_eq!(seen.len(), v * m);
                prop_assert!(seen.values().all(|&k| k == ComputeKind::W));
                prop_assert_eq!(i_order, w_order);
            }
        }
    }
}
