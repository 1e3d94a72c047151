//! Interleaved 1F1B (Megatron-LM "interleaved schedule", PyTorch `ScheduleInterleaved1F1B`), and the
//! per-rank builder it shares with [`super::interleaved_zb`].
//!
//! Source: Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
//! Megatron-LM" (SC'21), §2.2.2; docs/ARCHITECTURE.md, "Schedules and reference figures" (Interleaved 1F1B row);
//! PyTorch `torch/distributed/pipelining/schedules.py` (flexible rounds, warm-up count).
//!
//! Loop placement: rank `r` holds stages `r, r+p, …, r+(v−1)p` (chunk `c` is stage `c·p + r`).
//! Microbatches are split into `R` rounds of `g = m / R` consecutive microbatches; a rank runs a round
//! on chunk 0, then on chunk 1, … (depth first), forwards in that order and backwards in the mirrored
//! chunk order. PyTorch takes `R = max(1, ⌊m/p⌋)` and rejects `m` when `R ∤ m`; we take the largest
//! `R ≤ max(1, ⌊m/p⌋)` that divides `m`, which is PyTorch's `R` whenever PyTorch accepts the shape, so
//! every `m ≥ 1` is served (a prime `m > p` gets one round: breadth first, more memory).

use super::{GenerateError, Shape};
use crate::action::{Action, ComputeKind};
use crate::schedule::Schedule;

/// Interleaved 1F1B for `shape` (`p` ranks, `v ≥ 1` stages per rank, `m` microbatches), full
/// backwards (`B`). Rank `r` warms up with `min((v−1)·g + 2(p−1−r), v·m)` forwards (`g` = microbatches
/// per round, see the module docs), then alternates one forward and one backward, then drains.
///
/// # Errors
/// None beyond the common checks (`p, v, m ≥ 1`); every shape is served.
pub fn generate(shape: &Shape) -> Result<Schedule, GenerateError> {
    Ok(generate_variant(shape, Variant::ONE_F_ONE_B))
}

/// Which interleaved schedule [`generate_variant`] builds.
#[derive(Debug, Clone, Copy)]
pub(super) struct Variant {
    /// Extra warm-up forwards per rank of distance from the last rank (2 for 1F1B, 1 for ZB1P).
    pub warmup_per_hop: usize,
    /// Split each backward into `I` now and `W` later (zero bubble); otherwise a full `B`.
    pub split_backward: bool,
}

impl Variant {
    /// Interleaved 1F1B.
    pub const ONE_F_ONE_B: Variant = Variant { warmup_per_hop: 2, split_backward: false };
    /// Interleaved zero bubble (ZB1P).
    pub const ZERO_BUBBLE: Variant = Variant { warmup_per_hop: 1, split_backward: true };
}

/// Builds every rank's program of the interleaved `variant` for `shape` (`p, v, m ≥ 1`).
pub(super) fn generate_variant(shape: &Shape, variant: Variant) -> Schedule {
    let per_round = microbatches_per_round(shape.ranks, shape.microbatches);
    let order = chunk_order(shape.stages_per_rank, shape.microbatches, per_round);
    let programs = (0..shape.ranks).map(|r| rank_program(r, shape, per_round, &order, variant)).collect();
    Schedule::from_programs(programs)
}

/// Microbatches per round `g = m / R`, `R` the largest divisor of `m` not above `max(1, ⌊m/p⌋)`.
pub(super) fn microbatches_per_round(p: usize, m: usize) -> usize {
    let mut rounds = (m / p).max(1);
    while !m.is_multiple_of(rounds) {
        rounds -= 1;
    }
    m / rounds
}

/// The (chunk, microbatch) of each of a rank's `v·m` forwards, in order: round by round, chunk by
/// chunk, the round's microbatches in order. The `k`-th backward uses entry `k` with the chunk mirrored.
fn chunk_order(v: usize, m: usize, per_round: usize) -> Vec<(usize, usize)> {
    (0..m)
        .step_by(per_round)
        .flat_map(|start| (0..v).flat_map(move |c| (start..start + per_round).map(move |mb| (c, mb))))
        .collect()
}

/// Rank `r`'s program: warm-up forwards, then (F, B) steps, then cool-down backwards. With a split
/// backward, step `k` (`k`-th backward) is followed by the `W` of the oldest backward without one once
/// `k ≥ r`, and the remaining `W`s close the program.
fn rank_program(
    r: usize,
    shape: &Shape,
    per_round: usize,
    order: &[(usize, usize)],
    variant: Variant,
) -> Vec<Action> {
    let (p, v) = (shape.ranks, shape.stages_per_rank);
    let n = order.len();
    let warmup = ((v - 1) * per_round + variant.warmup_per_hop * (p - 1 - r)).min(n);
    let forward = |k: usize| Action::f(order[k].0 * p + r, order[k].1);
    let backward =
        |k: usize, kind: ComputeKind| Action::compute(kind, (v - 1 - order[k].0) * p + r, order[k].1);
    let bwd_kind = if variant.split_backward { ComputeKind::I } else { ComputeKind::B };
    let mut prog = Vec::with_capacity(3 * n);
    let mut weights_done = 0;
    for step in 0..n + warmup {
        if step < n {
            prog.push(forward(step));
        }
        if let Some(k) = step.checked_sub(warmup) {
            prog.push(backward(k, bwd_kind));
            if variant.split_backward && k >= r {
                prog.push(backward(weights_done, ComputeKind::W));
                weights_done += 1;
            }
        }
    }
    if variant.split_backward {
        prog.extend((weights_done..n).map(|k| backward(k, ComputeKind::W)));
    }
    prog
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// p = 4, v = 2, m = 8 (rounds of 4): rank 0 runs stage 0 for microbatches 0..4, then stage 4 for
    /// 0..4, then stage 0 for 4..8 (Megatron depth-first order); its warm-up is (2−1)·4 + 2·3 = 10
    /// forwards, so the first backward (stage 4, the later chunk, mb 0) follows the 11th forward.
    #[test]
    fn depth_first_chunk_order() {
        let s = generate(&Shape::new(4, 2, 8)).unwrap();
        let r0 = s.program_text(0);
        assert!(r0.starts_with("0F0 0F1 0F2 0F3 4F0 4F1 4F2 4F3 0F4 0F5 0F6 4B0 0F7 4B1 4F4"), "{r0}");
        // Last rank: warm-up of one round only, then strict alternation on the last stage.
        assert!(s.program_text(3).starts_with("3F0 3F1 3F2 3F3 7F0 7B0 7F1 7B1"), "{}", s.program_text(3));
    }

    #[test]
    fn rounds_divide_m() {
        assert_eq!(microbatches_per_round(4, 8), 4);
        assert_eq!(microbatches_per_round(4, 10), 5); // PyTorch: 2 rounds of 5
        assert_eq!(microbatches_per_round(4, 3), 3); // m < p: one round
        assert_eq!(microbatches_per_round(4, 9), 9); // PyTorch rejects; 9 has no divisor in 2..=2
        assert_eq!(microbatches_per_round(4, 18), 6); // ⌊18/4⌋ = 4 ∤ 18 → 3 rounds of 6
    }

    /// Peak number of chunk forwards in flight (F done, B not yet) on rank `r`.
    fn peak_in_flight(s: &Schedule, r: usize) -> usize {
        let (mut live, mut peak) = (0usize, 0usize);
        for a in s.program(r) {
            for (k, _) in a.computes() {
                match k {
                    ComputeKind::F => live += 1,
                    _ => live -= 1,
                }
                peak = peak.max(live);
            }
        }
        peak
    }

    /// docs/ARCHITECTURE.md Interleaved 1F1B row: rank 0 holds p + (p−1)/v full-stage activations, 5.5 for p = 4,
    /// v = 2, i.e. 11 chunk activations (a chunk is 1/v of a stage).
    #[test]
    fn rank0_peak_memory_matches_design() {
        let s = generate(&Shape::new(4, 2, 8)).unwrap();
        assert_eq!(peak_in_flight(&s, 0) as f64 / 2.0, 5.5);
    }

    proptest! {
        /// Every (stage, mb) of the rank's own stages gets one F then one B; forwards of a stage run
        /// in microbatch order; the first forward of chunk c+1 follows the g-th forward of chunk c.
        #[test]
        fn each_task_once_in_order(p in 1usize..7, v in 1usize..4, m in 1usize..20) {
            let s = generate(&Shape::new(p, v, m)).unwrap();
            let g = microbatches_per_round(p, m);
            for r in 0..p {
                let prog = s.program(r);
                let mut f_next = vec![0usize; v];
                let mut b_next = vec![0usize; v];
                for (i, a) in prog.iter().enumerate() {
                    for (k, t) in a.computes() {
                        prop_assert_eq!(t.stage % p, r);
                        let c = t.stage / p;
                        match k {
                            ComputeKind::F => { prop_assert_eq!(t.mb, f_next[c]); f_next[c] += 1; }
                            ComputeKind::B => {
                                prop_assert_eq!(t.mb, b_next[c]);
                                prop_assert!(b_next[c] < f_next[c]);
                                b_next[c] += 1;
                            }
                            _ => prop_assert!(false, "interleaved 1F1B emits F and B only, got {} at {}", a, i),
                        }
                    }
                }
                prop_assert!(f_next.iter().chain(&b_next).all(|&x| x == m));
                let warmup = ((v - 1) * g + 2 * (p - 1 - r)).min(v * m);
                prop_assert_eq!(peak_in_flight(&s, r), (warmup + 1).min(v * m));
                if v > 1 {
                    let pos = |a: Action| prog.iter().position(|&x| x == a).unwrap();
                    prop_assert!(pos(Action::f(p + r, 0)) > pos(Action::f(r, g - 1)));
                }
            }
        }
    }
}
