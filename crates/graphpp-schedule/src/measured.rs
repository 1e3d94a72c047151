//! Measured versus predicted: fit per-kind costs to a measured timeline, simulate the same
//! schedule with them, and compare the bubbles (issue 4: "the end summary gives the measured bubble
//! beside the simulator's prediction from the measured per-action times").

use crate::action::{Action, ComputeKind};
use crate::costs::{Costs, Memory};
use crate::schedule::Schedule;
use crate::simulate::{report, simulate, SimReport, SimulateError};
use crate::timeline::Timeline;

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
    pub costs: Costs,
    /// Figures of the measured timeline.
    pub measured: SimReport,
    /// Figures the simulator predicts with the fitted costs.
    pub predicted: SimReport,
}

/// Fits costs to `measured` (a timeline of running `schedule`), simulates `schedule` with them and
/// returns both reports. The measured timeline is shifted to start at 0.
///
/// # Errors
/// The simulator's errors for an invalid schedule.
pub fn measured_vs_predicted(
    schedule: &Schedule,
    measured: &Timeline,
) -> Result<MeasuredVsPredicted, SimulateError> {
    let costs = fit_costs(measured);
    let t0 = measured.start();
    let mut shifted = measured.clone();
    for i in &mut shifted.intervals {
        i.start -= t0;
        i.end -= t0;
    }
    let predicted = simulate(schedule, &costs, &Memory::default())?;
    Ok(MeasuredVsPredicted { costs, measured: report(shifted, schedule, &Memory::default()), predicted })
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let r = measured_vs_predicted(&s, &t).unwrap();
        assert_eq!((r.costs.f, r.costs.b), (1.5, 2.5));
        assert_eq!(r.measured.makespan, run.makespan);
        assert_eq!(r.predicted.makespan, run.makespan);
        assert!((r.measured.bubble_ratio - r.predicted.bubble_ratio).abs() < 1e-12);
    }

    #[test]
    fn missing_kinds_fall_back_to_ratios() {
        let t = Timeline { ranks: 1, unit: "s".into(), intervals: vec![] };
        let c = fit_costs(&t);
        assert_eq!((c.f, c.b, c.i, c.w, c.overlap()), (1.0, 2.0, 1.0, 1.0, 3.0));
    }
}
