//! Looped BFS (breadth-first pipeline parallelism; PyTorch `ScheduleLoopedBFS`).
//!
//! Source: Lamy-Poirier, "Breadth-First Pipeline Parallelism" (MLSys 2023), §3; docs/ARCHITECTURE.md, "Schedules
//! and reference figures" (Looped BFS row); PyTorch `torch/distributed/pipelining/schedules.py`.
//! Loop placement. Rank `r` runs all `m` forwards of its chunk 0 (stage `r`), then of chunk 1 (stage
//! `r+p`), …; then the backwards chunk by chunk in reverse (last chunk first), each chunk's
//! microbatches in reverse order (`m−1` first), as PyTorch does. Any `m ≥ 1` and `v ≥ 1` is served.

use super::{GenerateError, Shape};
use crate::action::Action;
use crate::schedule::Schedule;

/// Looped BFS for `shape` (`p` ranks, `v` stages per rank, `m` microbatches); full backwards (`B`).
///
/// # Errors
/// None beyond the common checks.
pub fn generate(shape: &Shape) -> Result<Schedule, GenerateError> {
    let (p, v, m) = (shape.ranks, shape.stages_per_rank, shape.microbatches);
    let programs = (0..p)
        .map(|r| {
            let stages: Vec<usize> = (0..v).map(|c| c * p + r).collect();
            let forwards = stages.iter().flat_map(|&s| (0..m).map(move |mb| Action::f(s, mb)));
            let backwards = stages.iter().rev().flat_map(|&s| (0..m).rev().map(move |mb| Action::b(s, mb)));
            forwards.chain(backwards).collect()
        })
        .collect();
    Ok(Schedule::from_programs(programs))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::action::ComputeKind;
    use proptest::prelude::*;

    proptest! {
        /// All F before any B; F chunks ascending and B chunks descending; within a chunk, F microbatch
        /// ascending and B descending.
        #[test]
        fn breadth_first_order(p in 1usize..7, v in 1usize..4, m in 1usize..12) {
            let s = generate(&Shape::new(p, v, m)).unwrap();
            for r in 0..p {
                let tasks: Vec<_> = s.program(r).iter().flat_map(|a| a.computes().collect::<Vec<_>>()).collect();
                prop_assert_eq!(tasks.len(), 2 * v * m);
                let (fs, bs) = tasks.split_at(v * m);
                prop_assert!(fs.iter().all(|(k, _)| *k == ComputeKind::F));
                prop_assert!(bs.iter().all(|(k, _)| *k == ComputeKind::B));
                let key_f: Vec<_> = fs.iter().map(|(_, t)| (t.stage, t.mb)).collect();
                let mut sorted = key_f.clone();
                sorted.sort();
                prop_assert_eq!(&key_f, &sorted);
                let key_b: Vec<_> = bs.iter().map(|(_, t)| (t.stage, t.mb)).collect();
                let mut rsorted = key_b.clone();
                rsorted.sort_by(|a, b| b.cmp(a));
                prop_assert_eq!(&key_b, &rsorted);
                prop_assert!(key_f.iter().all(|&(s, _)| s % p == r));
            }
        }
    }
}
