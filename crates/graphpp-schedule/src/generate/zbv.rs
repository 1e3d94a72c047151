//! ZB-V (zero bubble, V placement; PyTorch `ScheduleZBVZeroBubble`).
//!
//! Source: Qi et al., "Pipeline Parallelism with Controllable Memory" (NeurIPS 2024), §4 (V-shape
//! schedule); docs/ARCHITECTURE.md, "Schedules and reference figures" (ZB-V row); PyTorch
//! `torch/distributed/pipelining/schedules.py`. Rank `r` holds chunk 0 = stage `r` and chunk 1 =
//! stage `2p−1−r`. With `n = max(2p−1, m)` microbatches:
//! warm-up `2(p−r)−1` × F(chunk 0), `r` × [F1, F0], `p−r` × [F1, I1, W1];
//! steady, while chunk 1 trails chunk 0 or chunk 0 has forwards left: [F0 if any left, I0, W0, F1, I1, W1];
//! cool-down `r` × [I0, I1], `p−r` × [I0, W0], then the remaining W1, then the remaining W0.
//! Actions on microbatches `≥ m` (the padding when `m < 2p−1`) are counted but never built.

use super::{require, GenerateError, Kind, Shape};
use crate::action::{Action, ComputeKind};
use crate::schedule::Schedule;

/// ZB-V for `shape` (`p` ranks, `v = 2`, `m` microbatches); emits `F`, `I`, `W`. Any `m ≥ 1` is served
/// (PyTorch does too).
///
/// Work and memory are proportional to the actions kept plus `p`: the padding microbatches are
/// counted, never built (at p = 10 000, m = 8 the padded order would hold 1.2·10⁹ actions for the
/// 4.8·10⁵ kept).
///
/// # Errors
/// [`GenerateError::Constraint`] when `v ≠ 2` (V placement has exactly two chunks per rank).
pub fn generate(shape: &Shape) -> Result<Schedule, GenerateError> {
    require(shape.stages_per_rank == 2, Kind::Zbv, shape, || {
        format!("needs exactly 2 stages per rank for V placement (v={})", shape.stages_per_rank)
    })?;
    let (p, m) = (shape.ranks, shape.microbatches);
    let programs = (0..p).map(|r| rank_program(r, p, m)).collect();
    Ok(Schedule::from_programs(programs))
}

/// One chunk's counters of forwards, input backwards and weight backwards issued so far, padding
/// microbatches included; only those below `m` become actions.
struct Chunk {
    stage: usize,
    m: usize,
    /// Issued F, I, W, indexed by [`slot`].
    issued: [usize; 3],
}

/// The counter of a compute kind (ZB-V issues no B).
fn slot(kind: ComputeKind) -> usize {
    match kind {
        ComputeKind::F => 0,
        ComputeKind::I | ComputeKind::B => 1,
        ComputeKind::W => 2,
    }
}

impl Chunk {
    fn new(stage: usize, m: usize) -> Self {
        Chunk { stage, m, issued: [0; 3] }
    }

    /// Issues the next `kind`, pushing it unless its microbatch is padding.
    fn next(&mut self, kind: ComputeKind, prog: &mut Vec<Action>) {
        let mb = self.issued[slot(kind)];
        if mb < self.m {
            prog.push(Action::compute(kind, self.stage, mb));
        }
        self.issued[slot(kind)] += 1;
    }

    /// True while issuing `kind` can still yield a kept action.
    fn live(&self, kind: ComputeKind) -> bool {
        self.issued[slot(kind)] < self.m
    }
}

/// The two chunks of a rank: chunk 0 = stage `r`, chunk 1 = stage `2p−1−r`.
type Chunks = [Chunk; 2];

/// Issues `steps` (chunk, kind) `times` times over; once no step can yield a kept action, the
/// rest are counted without a loop.
fn repeat(c: &mut Chunks, times: usize, steps: &[(usize, ComputeKind)], prog: &mut Vec<Action>) {
    let mut done = 0;
    while done < times && steps.iter().any(|&(ch, kind)| c[ch].live(kind)) {
        for &(ch, kind) in steps {
            c[ch].next(kind, prog);
        }
        done += 1;
    }
    for &(ch, kind) in steps {
        c[ch].issued[slot(kind)] += times - done;
    }
}

/// Rank `r`'s program: the order of `n = max(2p−1, m)` microbatches with those `≥ m` dropped.
fn rank_program(r: usize, p: usize, m: usize) -> Vec<Action> {
    use ComputeKind::{F, I, W};
    let n = (2 * p - 1).max(m);
    let mut c = [Chunk::new(r, m), Chunk::new(2 * p - 1 - r, m)];
    let mut prog = Vec::with_capacity(6 * m);
    repeat(&mut c, 2 * (p - r) - 1, &[(0, F)], &mut prog);
    repeat(&mut c, r, &[(1, F), (0, F)], &mut prog);
    repeat(&mut c, p - r, &[(1, F), (1, I), (1, W)], &mut prog);
    steady(&mut c, n, &mut prog);
    repeat(&mut c, r, &[(0, I), (1, I)], &mut prog);
    repeat(&mut c, p - r, &[(0, I), (0, W)], &mut prog);
    let [w1, w0] = [1, 0].map(|ch| c[ch].issued[slot(I)] - c[ch].issued[slot(W)]);
    repeat(&mut c, w1, &[(1, W)], &mut prog);
    repeat(&mut c, w0, &[(0, W)], &mut prog);
    prog
}

/// The steady phase: while chunk 1 trails chunk 0 or chunk 0 has forwards left,
/// [F0 if any of the `n` left, I0, W0, F1, I1, W1]. It stops early once all six counters are past
/// `m`: from there on every phase issues padding only.
fn steady(c: &mut Chunks, n: usize, prog: &mut Vec<Action>) {
    use ComputeKind::{F, I, W};
    let rest = [(0, I), (0, W), (1, F), (1, I), (1, W)];
    let live = |c: &Chunks| c[0].live(F) || rest.iter().any(|&(ch, kind)| c[ch].live(kind));
    while (c[1].issued[0] < c[0].issued[0] || c[0].issued[0] < n) && live(c) {
        if c[0].issued[0] < n {
            c[0].next(F, prog);
        }
        for (ch, kind) in rest {
            c[ch].next(kind, prog);
        }
    }
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

    /// The order as first written: every padded microbatch built, then dropped (the phases of the
    /// module doc, one loop each).
    fn padded_program(r: usize, p: usize, m: usize) -> Vec<Action> {
        let n = (2 * p - 1).max(m);
        let mut c = [Chunk::new(r, usize::MAX), Chunk::new(2 * p - 1 - r, usize::MAX)];
        let mut prog = Vec::new();
        let mut run = |c: &mut Chunks, steps: &[(usize, ComputeKind)]| {
            steps.iter().for_each(|&(ch, kind)| c[ch].next(kind, &mut prog))
        };
        (0..2 * (p - r) - 1).for_each(|_| run(&mut c, &[(0, F)]));
        (0..r).for_each(|_| run(&mut c, &[(1, F), (0, F)]));
        (0..p - r).for_each(|_| run(&mut c, &[(1, F), (1, I), (1, W)]));
        while c[1].issued[0] < c[0].issued[0] || c[0].issued[0] < n {
            if c[0].issued[0] < n {
                run(&mut c, &[(0, F)]);
            }
            run(&mut c, &[(0, I), (0, W), (1, F), (1, I), (1, W)]);
        }
        (0..r).for_each(|_| run(&mut c, &[(0, I), (1, I)]));
        (0..p - r).for_each(|_| run(&mut c, &[(0, I), (0, W)]));
        while c[1].issued[2] < c[1].issued[1] {
            run(&mut c, &[(1, W)]);
        }
        while c[0].issued[2] < c[0].issued[1] {
            run(&mut c, &[(0, W)]);
        }
        prog.retain(|a| a.computes().all(|(_, t)| t.mb < m));
        prog
    }

    proptest! {
        /// Counting the padding instead of building it keeps the order: every rank's program equals
        /// the padded-then-dropped one, for m below, at and above 2p − 1.
        #[test]
        fn padding_is_counted_not_built(p in 1usize..12, m in 1usize..40) {
            let s = generate(&Shape::new(p, 2, m)).unwrap();
            for r in 0..p {
                prop_assert_eq!(s.program(r), padded_program(r, p, m));
            }
        }
    }

    /// A shape whose padding outnumbers its actions 2500 to 1 (p = 10 000, m = 8) builds only the
    /// 3·2·m actions of each rank.
    #[test]
    fn many_ranks_few_microbatches() {
        let (p, m) = (10_000, 8);
        let s = generate(&Shape::new(p, 2, m)).unwrap();
        assert_eq!(s.actions().count(), 6 * p * m);
        let last = s.program(p - 1);
        assert_eq!(last, padded_program(p - 1, p, m));
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
