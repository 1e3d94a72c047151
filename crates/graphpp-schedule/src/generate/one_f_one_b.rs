//! 1F1B (PipeDream-flush): a warm-up of forwards, then one forward and one backward alternately,
//! then the remaining backwards.
//!
//! Source: Narayanan et al., "PipeDream-2BW / flush" (2021), §3; docs/ARCHITECTURE.md, "Schedules and reference
//! figures" (1F1B row: `w = min(m, p−1−r)` warm-up forwards, then (F, B) pairs, then `w` backwards).
//! PyTorch `Schedule1F1B` gives the same order. Unlike PyTorch, which rejects `m < p`, every `m ≥ 1` is
//! served: the warm-up is capped by `m`.

use super::{require, GenerateError, Kind, Shape};
use crate::action::Action;
use crate::schedule::Schedule;

/// 1F1B for `shape` (`p` ranks, `v = 1`, `m` microbatches). Rank `r` holds stage `r` and runs
/// `w = min(m, p−1−r)` forwards, then pairs `F(w+i) B(i)` while forwards remain, then the last
/// `w` backwards, all in microbatch order. At most `min(m, p−r)` forwards are in flight on rank `r`.
///
/// # Errors
/// [`GenerateError::Constraint`] when `v ≠ 1`.
pub fn generate(shape: &Shape) -> Result<Schedule, GenerateError> {
    require(shape.stages_per_rank == 1, Kind::OneFOneB, shape, || {
        format!("needs 1 stage per rank (v={})", shape.stages_per_rank)
    })?;
    let (p, m) = (shape.ranks, shape.microbatches);
    let programs = (0..p).map(|r| rank_program(r, p - 1 - r, m)).collect();
    Ok(Schedule::from_programs(programs))
}

/// The 1F1B program of `stage` with `later` stages after it and `m` microbatches.
fn rank_program(stage: usize, later: usize, m: usize) -> Vec<Action> {
    let warmup = later.min(m);
    let mut prog: Vec<Action> = (0..warmup).map(|mb| Action::f(stage, mb)).collect();
    for mb in warmup..m {
        prog.push(Action::f(stage, mb));
        prog.push(Action::b(stage, mb - warmup));
    }
    prog.extend((m - warmup..m).map(|mb| Action::b(stage, mb)));
    prog
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::action::ComputeKind;
    use proptest::prelude::*;

    /// docs/ARCHITECTURE.md 1F1B row, p = 4, m = 8.
    #[test]
    fn design_reference_programs() {
        let s = generate(&Shape::new(4, 1, 8)).unwrap();
        assert_eq!(s.program_text(0), "0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7");
        assert!(s.program_text(3).starts_with("3F0 3B0 3F1 3B1 3F2 3B2"));
    }

    /// Serves m < p (PyTorch rejects it): rank 0 of p = 4, m = 2 is all forwards then all backwards.
    #[test]
    fn serves_fewer_microbatches_than_ranks() {
        let s = generate(&Shape::new(4, 1, 2)).unwrap();
        assert_eq!(s.program_text(0), "0F0 0F1 0B0 0B1");
        assert_eq!(s.program_text(3), "3F0 3B0 3F1 3B1");
    }

    proptest! {
        /// Peak in-flight forwards (F done, B not yet) on rank r is min(m, p − r); every (stage, mb)
        /// has exactly one F then one B.
        #[test]
        fn peak_in_flight_is_p_minus_r(p in 1usize..9, m in 1usize..24) {
            let s = generate(&Shape::new(p, 1, m)).unwrap();
            for r in 0..p {
                let (mut live, mut peak) = (0i64, 0i64);
                let mut f_seen = vec![false; m];
                let mut b_seen = vec![false; m];
                for a in s.program(r) {
                    for (k, t) in a.computes() {
                        prop_assert_eq!(t.stage, r);
                        match k {
                            ComputeKind::F => { prop_assert!(!f_seen[t.mb]); f_seen[t.mb] = true; live += 1 }
                            ComputeKind::B => { prop_assert!(f_seen[t.mb] && !b_seen[t.mb]); b_seen[t.mb] = true; live -= 1 }
                            _ => prop_assert!(false, "1F1B emits only F and B"),
                        }
                        peak = peak.max(live);
                    }
                }
                prop_assert!(b_seen.iter().all(|&x| x));
                prop_assert_eq!(peak as usize, m.min(p - r));
            }
        }
    }
}
