//! ZB-V (zero bubble, V placement; PyTorch `ScheduleZBVZeroBubble`).
//!
//! Source: Qi et al., "Pipeline Parallelism with Controllable Memory" (NeurIPS 2024), §4 (V-shape
//! schedule); docs/ARCHITECTURE.md, "Schedules and reference figures" (ZB-V row); PyTorch
//! `torch/distributed/pipelining/schedules.py`. Rank `r` holds chunk 0 = stage `r` and chunk 1 =
//! stage `2p−1−r`. With `n = max(2p−1, m)` microbatches:
//! warm-up `2(p−r)−1` × F(chunk 0), `r` × [F1, F0], `p−r` × [F1, I1, W1];
//! steady, while chunk 1 trails chunk 0 or chunk 0 has forwards left: [F0 if any left, I0, W0, F1, I1, W1];
//! cool-down `r` × [I0, I1], `p−r` × [I0, W0], then the remaining W1, then the remaining W0.
//! Actions on microbatches `≥ m` (the padding when `m < 2p−1`) are dropped.

use super::{require, GenerateError, Kind, Shape};
use crate::action::{Action, ComputeKind};
use crate::schedule::Schedule;

/// ZB-V for `shape` (`p` ranks, `v = 2`, `m` microbatches); emits `F`, `I`, `W`. Any `m ≥ 1` is served
/// (PyTorch does too).
///
/// # Errors
/// [`GenerateError::Constraint`] when `v ≠ 2` (V placement has exactly two chunks per rank).
pub fn generate(shape: &Shape) -> Result<Schedule, GenerateError> {
    require(shape.stages_per_rank == 2, Kind::Zbv, shape, || {
        format!("needs exactly 2 stages per rank for V placement (v={})", shape.stages_per_rank)
    })?;
    let (p, m) = (shape.ranks, shape.microbatches);
    let programs = (0..p)
        .map(|r| rank_program(r, p, (2 * p - 1).max(m)).into_iter().filter(|a| task_mb(a) < m).collect())
        .collect();
    Ok(Schedule::from_programs(programs))
}

fn task_mb(a: &Action) -> usize {
    a.computes().map(|(_, t)| t.mb).max().unwrap_or(0)
}

/// Per-chunk counters of forwards, input backwards and weight backwards issued so far.
struct Chunk {
    stage: usize,
    f: usize,
    i: usize,
    w: usize,
}

impl Chunk {
    fn new(stage: usize) -> Self {
        Chunk { stage, f: 0, i: 0, w: 0 }
    }
    fn next(&mut self, kind: ComputeKind) -> Action {
        let counter = match kind {
            ComputeKind::F => &mut self.f,
            ComputeKind::I | ComputeKind::B => &mut self.i,
            ComputeKind::W => &mut self.w,
        };
        *counter += 1;
        Action::compute(kind, self.stage, *counter - 1)
    }
}

/// Rank `r`'s program with `n` (padded) microbatches.
fn rank_program(r: usize, p: usize, n: usize) -> Vec<Action> {
    use ComputeKind::{F, I, W};
    let mut c0 = Chunk::new(r);
    let mut c1 = Chunk::new(2 * p - 1 - r);
    let mut prog = Vec::with_capacity(6 * n);
    for _ in 0..2 * (p - r) - 1 {
        prog.push(c0.next(F));
    }
    for _ in 0..r {
        prog.extend([c1.next(F), c0.next(F)]);
    }
    for _ in 0..p - r {
        prog.extend([c1.next(F), c1.next(I), c1.next(W)]);
    }
    while c1.f < c0.f || c0.f < n {
        if c0.f < n {
            prog.push(c0.next(F));
        }
        prog.extend([c0.next(I), c0.next(W), c1.next(F), c1.next(I), c1.next(W)]);
    }
    for _ in 0..r {
        prog.extend([c0.next(I), c1.next(I)]);
    }
    for _ in 0..p - r {
        prog.extend([c0.next(I), c0.next(W)]);
    }
    while c1.w < c1.i {
        prog.push(c1.next(W));
    }
    while c0.w < c0.i {
        prog.push(c0.next(W));
    }
    prog
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// docs/ARCHITECTURE.md ZB-V row at p = 4, m = 8: rank 0 warms up with 2·4−1 = 7 F of stage 0, then r = 0
    /// [F1, F0] pairs, then p − r = 4 × [F1, I1, W1] on stage 7; rank 3 with one F of stage 3, then
    /// 3 × [F(4), F(3)], then one [F1, I1, W1].
    #[test]
    fn warm_up_follows_design_row() {
        let s = generate(&Shape::new(4, 2, 8)).unwrap();
        assert!(s.program_text(0).starts_with(
            "0F0 0F1 0F2 0F3 0F4 0F5 0F6 7F0 7I0 7W0 7F1 7I1 7W1 7F2 7I2 7W2 7F3 7I3 7W3 0F7 0I0 0W0"
        ));
        assert!(s.program_text(3).starts_with("3F0 4F0 3F1 4F1 3F2 4F2 3F3 4F3 4I0 4W0 3F4"));
    }

    #[test]
    fn rejects_v_other_than_two() {
        let e = generate(&Shape::new(4, 3, 8)).unwrap_err();
        assert!(e.to_string().contains("needs exactly 2 stages per rank"), "{e}");
    }

    proptest! {
        /// docs/ARCHITECTURE.md ZB-V row: memory p·M_B in full-stage units, i.e. at most 2p chunk activations
        /// (held from F until W) on every rank, reached once m ≥ 2p − 1.
        #[test]
        fn peak_activations_are_p_stages(p in 1usize..8, extra in 0usize..10) {
            let m = 2 * p - 1 + extra;
            let s = generate(&Shape::new(p, 2, m)).unwrap();
            for r in 0..p {
                let (mut live, mut peak) = (0i64, 0i64);
                for a in s.program(r) {
                    for (k, _) in a.computes() {
                        live += match k { F => 1, W => -1, _ => 0 };
                        peak = peak.max(live);
                    }
                }
                prop_assert_eq!(peak, 2 * p as i64);
            }
        }
    }

    proptest! {
        /// V placement (rank r holds r and 2p−1−r only); each (stage, mb) F, I, W once in that order;
        /// padding microbatches (m < 2p−1) are gone.
        #[test]
        fn v_placement_and_each_task_once(p in 1usize..8, m in 1usize..24) {
            let s = generate(&Shape::new(p, 2, m)).unwrap();
            for r in 0..p {
                let mut seen = std::collections::HashMap::new();
                for a in s.program(r) {
                    for (k, t) in a.computes() {
                        prop_assert!(t.stage == r || t.stage == 2 * p - 1 - r);
                        prop_assert!(t.mb < m);
                        let prev = seen.insert(t, k);
                        let want = match k { F => None, I => Some(F), W => Some(I), B => Some(B) };
                        prop_assert_ne!(k, B);
                        prop_assert_eq!(prev, want);
                    }
                }
                prop_assert_eq!(seen.len(), 2 * m);
            }
        }
    }
    use ComputeKind::{B, F, I, W};
}
