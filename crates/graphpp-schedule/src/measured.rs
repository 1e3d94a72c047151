//! Measured versus predicted: fit per-action costs to a measured timeline, simulate the same
//! schedule with them, and compare the bubbles: a
//! run's summary gives the measured bubble beside the simulator's prediction from the measured
//! per-action times.
//!
//! The prediction gives every compute action the duration it was measured to take (so stage
//! imbalance — the first stage holds the embedding, the last the LM head and the loss — and
//! per-microbatch variation carry over); an action absent from the timeline takes its kind's mean.
//! What the prediction leaves out is what the runtime adds on its own: hand-over latency and
//! waiting that the schedule's dependencies do not imply. SEND/RECV intervals of an in-process
//! run are mostly a RECV waiting for its message, so they count as idle in the measured figures
//! and cost 0 in the prediction.

use std::collections::HashMap;

use crate::action::{Action, ComputeKind};
use crate::costs::{Costs, Memory};
use crate::schedule::Schedule;
use crate::simulate::{report, simulate_with, SimReport, SimulateError};
use crate::timeline::Timeline;

/// Whether `a` computes (F, B, I, W, OVERLAP_F_B) rather than moves data or shards.
fn computes(a: &Action) -> bool {
    matches!(a, Action::Compute { .. } | Action::Overlap { .. })
}

/// Measured durations of a timeline's compute actions, in the timeline's unit: each action's own
/// (its mean if the timeline holds several steps).
#[derive(Debug, Clone)]
pub struct MeasuredCosts {
    actions: HashMap<Action, f64>,
    /// Per-kind means over all stages (for an action that never ran).
    pub per_kind: Costs,
}

impl MeasuredCosts {
    /// Fits the durations of `t`'s compute and OVERLAP_F_B intervals.
    pub fn fit(t: &Timeline) -> Self {
        let mut acc: HashMap<Action, (f64, usize)> = HashMap::new();
        for i in t.intervals.iter().filter(|i| computes(&i.action)) {
            let e = acc.entry(i.action).or_default();
            e.0 += i.end - i.start;
            e.1 += 1;
        }
        let actions = acc.into_iter().map(|(a, (s, n))| (a, s / n as f64)).collect();
        MeasuredCosts { actions, per_kind: fit_costs(t) }
    }

    /// The duration of `a`: as measured, else its kind's mean; 0 for SEND, RECV and FSDP stage
    /// operations.
    pub fn duration(&self, a: &Action) -> f64 {
        if !computes(a) {
            return 0.0;
        }
        self.actions.get(a).copied().unwrap_or_else(|| crate::simulate::duration(a, &self.per_kind))
    }
}

/// Mean measured duration of each action kind (F, B, I, W, OVERLAP_F_B, and SEND/RECV/FSDP as
/// `comm_action`) in the timeline's unit. A kind that never ran keeps the default ratio to T_F
/// (B = 2F, I = W = F, overlap = F + B). The hop latency `c` is set to 0: in-process transport
/// hand-over is part of the measured RECV time.
pub fn fit_costs(t: &Timeline) -> Costs {
    let mut sum = [0.0f64; 6];
    let mut n = [0usize; 6];
    for i in &t.intervals {
        let k = match i.action {
            Action::Compute { kind: ComputeKind::F, .. } => 0,
            Action::Compute { kind: ComputeKind::B, .. } => 1,
            Action::Compute { kind: ComputeKind::I, .. } => 2,
            Action::Compute { kind: ComputeKind::W, .. } => 3,
            Action::Overlap { .. } => 4,
            Action::Comm { .. } | Action::StageOp { .. } => 5,
        };
        sum[k] += i.end - i.start;
        n[k] += 1;
    }
    let mean = |k: usize| (n[k] > 0).then(|| sum[k] / n[k] as f64);
    let f = mean(0).unwrap_or(1.0);
    let b = mean(1).unwrap_or_else(|| mean(2).unwrap_or(f) + mean(3).unwrap_or(f));
    Costs {
        f,
        b,
        i: mean(2).unwrap_or(b / 2.0),
        w: mean(3).unwrap_or(b / 2.0),
        overlap: mean(4),
        comm: 0.0,
        comm_action: mean(5).unwrap_or(0.0),
    }
}

/// The measured figures of a run beside the simulator's prediction for the same schedule.
#[derive(Debug, Clone)]
pub struct MeasuredVsPredicted {
    /// Costs fitted to the measured timeline.
    pub costs: MeasuredCosts,
    /// Figures of the measured timeline (compute and OVERLAP_F_B busy; SEND/RECV time idle).
    pub measured: SimReport,
    /// Figures the simulator predicts with the measured action durations.
    pub predicted: SimReport,
}

/// Fits costs to `measured` (a timeline of running `schedule`), simulates `schedule` with them and
/// returns both reports; `hop` is the latency of one cross-rank hand-over in seconds (an
/// emulated link's latency plus an activation's transfer; 0 for threads of one machine). The
/// measured timeline is shifted to start at 0 and its SEND/RECV/FSDP
/// intervals are dropped (see the module doc).
///
/// # Errors
/// The simulator's errors for an invalid schedule.
pub fn measured_vs_predicted(
    schedule: &Schedule,
    measured: &Timeline,
    hop: f64,
) -> Result<MeasuredVsPredicted, SimulateError> {
    let costs = MeasuredCosts::fit(measured);
    let t0 = measured.start();
    let mut shifted = measured.clone();
    shifted.intervals.retain(|i| computes(&i.action));
    for i in &mut shifted.intervals {
        i.start -= t0;
        i.end -= t0;
    }
    let predicted = simulate_with(schedule, |a| costs.duration(a), hop, &Memory::default())?;
    Ok(MeasuredVsPredicted { costs, measured: report(shifted, schedule, &Memory::default()), predicted })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulate::simulate;

    #[test]
    fn simulated_timeline_is_its_own_prediction() {
        // Fitting the costs of a simulated run and simulating again reproduces the run exactly.
        let s = Schedule::from_csv("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n").unwrap();
        let costs = Costs { f: 1.5, b: 2.5, ..Costs::default() };
        let run = simulate(&s, &costs, &Memory::default()).unwrap();
        let mut t = run.timeline.clone();
        for i in &mut t.intervals {
            i.start += 10.0;
            i.end += 10.0;
        }
        let r = measured_vs_predicted(&s, &t, 0.0).unwrap();
        assert_eq!((r.costs.per_kind.f, r.costs.per_kind.b), (1.5, 2.5));
        assert_eq!(r.measured.makespan, run.makespan);
        assert_eq!(r.predicted.makespan, run.makespan);
        assert!((r.measured.bubble_ratio - r.predicted.bubble_ratio).abs() < 1e-12);
    }

    #[test]
    fn missing_kinds_fall_back_to_ratios() {
        let t = Timeline { ranks: 1, unit: "s".into(), intervals: vec![], comm: Vec::new() };
        let c = fit_costs(&t);
        assert_eq!((c.f, c.b, c.i, c.w, c.overlap()), (1.0, 2.0, 1.0, 1.0, 3.0));
    }

    /// A pipeline whose last stage is 3× slower: per-action fitting reproduces the run, one mean
    /// per kind would not (it predicts a balanced pipeline).
    #[test]
    fn per_action_costs_predict_an_unbalanced_run() {
        let s =
            crate::generate(crate::Kind::OneFOneB, &crate::Shape::new(2, 1, 4), &Default::default()).unwrap();
        let slow = |a: &Action| match a {
            Action::Compute { kind, task } => {
                let base = if *kind == ComputeKind::F { 1.0 } else { 2.0 };
                base * if task.stage == 1 { 3.0 } else { 1.0 }
            }
            _ => 0.0,
        };
        let run = simulate_with(&s, slow, 0.0, &Memory::default()).unwrap();
        let r = measured_vs_predicted(&s, &run.timeline, 0.0).unwrap();
        assert!((r.predicted.makespan - run.makespan).abs() < 1e-12);
        assert!((r.predicted.bubble_ratio - run.bubble_ratio).abs() < 1e-12);
        let per_kind = simulate(&s, &r.costs.per_kind, &Memory::default()).unwrap();
        assert!((per_kind.makespan - run.makespan).abs() > 1.0, "{} vs {}", per_kind.makespan, run.makespan);
    }

    /// RECV time (waiting for a message) is idle in the measured figures.
    #[test]
    fn recv_waiting_is_idle() {
        let s = Schedule::from_csv("0F0,0SEND_F0\n1RECV_F0,1F0\n").unwrap();
        let iv = |rank, start, end, a: &str| crate::Interval { rank, start, end, action: a.parse().unwrap() };
        let t = Timeline {
            ranks: 2,
            comm: Vec::new(),
            unit: "s".into(),
            intervals: vec![
                iv(0, 0.0, 1.0, "0F0"),
                iv(0, 1.0, 1.0, "0SEND_F0"),
                iv(1, 0.0, 1.0, "1RECV_F0"),
                iv(1, 1.0, 2.0, "1F0"),
            ],
        };
        let r = measured_vs_predicted(&s, &t, 0.0).unwrap();
        assert_eq!(r.measured.busy, vec![1.0, 1.0]);
        assert_eq!(r.measured.idle, vec![1.0, 1.0]);
        assert_eq!(r.predicted.makespan, 2.0);
    }
}
