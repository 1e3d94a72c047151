//! GPipe (all-forward-all-backward): every rank runs all `m` forwards, then all `m` full backwards.
//!
//! Source: Huang et al., "GPipe" (2019), §2.2; docs/ARCHITECTURE.md, "Schedules and reference figures" (GPipe row);
//! PyTorch `ScheduleGPipe` (forwards in microbatch order, then backwards in microbatch order).
//! One stage per rank (`v = 1`), stage `r` on rank `r`. Any `m ≥ 1` is served.

use super::{require, GenerateError, Kind, Shape};
use crate::action::Action;
use crate::schedule::Schedule;

/// GPipe for `shape` (`p` ranks, `v = 1`, `m` microbatches): rank `r` runs
/// `rF0 … rF(m-1) rB0 … rB(m-1)`.
///
/// # Errors
/// [`GenerateError::Constraint`] when `v ≠ 1` (GPipe places one stage per rank).
pub fn generate(shape: &Shape) -> Result<Schedule, GenerateError> {
    require(shape.stages_per_rank == 1, Kind::Gpipe, shape, || {
        format!("needs 1 stage per rank (v={})", shape.stages_per_rank)
    })?;
    let m = shape.microbatches;
    let programs = (0..shape.ranks)
        .map(|r| (0..m).map(|mb| Action::f(r, mb)).chain((0..m).map(|mb| Action::b(r, mb))).collect())
        .collect();
    Ok(Schedule::from_programs(programs))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::action::ComputeKind;
    use proptest::prelude::*;

    fn kinds(s: &Schedule, r: usize) -> Vec<ComputeKind> {
        s.program(r).iter().flat_map(|a| a.computes().map(|(k, _)| k).collect::<Vec<_>>()).collect()
    }

    proptest! {
        /// All forwards precede all backwards on every rank; each (stage, mb) has one F and one B.
        #[test]
        fn all_forward_then_all_backward(p in 1usize..9, m in 1usize..20) {
            let s = generate(&Shape::new(p, 1, m)).unwrap();
            for r in 0..p {
                let k = kinds(&s, r);
                prop_assert_eq!(k.len(), 2 * m);
                prop_assert!(k[..m].iter().all(|&x| x == ComputeKind::F));
                prop_assert!(k[m..].iter().all(|&x| x == ComputeKind::B));
                let prog = s.program(r);
                prop_assert_eq!(prog[m], Action::b(r, 0));
                prop_assert_eq!(prog[2 * m - 1], Action::b(r, m - 1));
            }
        }
    }

    #[test]
    fn rejects_two_stages_per_rank() {
        let e = generate(&Shape::new(4, 2, 8)).unwrap_err();
        assert!(e.to_string().contains("needs 1 stage per rank (v=2)"), "{e}");
    }
}
