//! A timeline: what each rank ran and when. The simulator produces one; the runtime records a
//! measured one; the renderers draw either (docs/ARCHITECTURE.md, "Renderers").

use crate::action::Action;
use crate::schedule::RankId;

/// One action's execution interval on a rank.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Interval {
    /// The rank that ran it.
    pub rank: RankId,
    /// Start time (timeline units).
    pub start: f64,
    /// End time (timeline units), `>= start`.
    pub end: f64,
    /// What ran.
    pub action: Action,
}

/// A communication in flight inside an action (an in-graph collective such as expert
/// parallelism's all-to-all): measured only — the simulator prices it inside the action's time.
///
/// `start ≤ wait ≤ end`: from `start` to `wait` the rank did other work — computed, or waited on
/// another collective — while the transfer progressed; from `wait` to `end` it was blocked on
/// the data.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct CommSpan {
    /// The rank that started it.
    pub rank: RankId,
    /// The action whose graph started it.
    pub action: Action,
    /// When the collective was started (timeline units).
    pub start: f64,
    /// When the rank began waiting for it (timeline units).
    pub wait: f64,
    /// When the wait returned (timeline units).
    pub end: f64,
    /// What it was, e.g. `ep.dispatch all_to_all_v (forward)`.
    pub label: String,
}

impl CommSpan {
    /// Time the collective was in flight while the rank did other work: `wait − start`.
    pub fn overlapped(&self) -> f64 {
        self.wait - self.start
    }

    /// Time the rank was blocked on it: `end − wait`.
    pub fn blocked(&self) -> f64 {
        self.end - self.wait
    }
}

/// Intervals of all ranks plus the unit they are measured in.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Timeline {
    /// Number of ranks (rows).
    pub ranks: usize,
    /// Intervals, in no particular order.
    pub intervals: Vec<Interval>,
    /// In-graph communications of a measured timeline (empty for a simulated one).
    #[serde(default)]
    pub comm: Vec<CommSpan>,
    /// The time unit: `"unit"` for simulated cost units, `"s"` for measured seconds.
    pub unit: String,
}

impl Timeline {
    /// End of the last interval (0 for an empty timeline).
    pub fn makespan(&self) -> f64 {
        self.intervals.iter().map(|i| i.end).fold(0.0, f64::max)
    }

    /// Start of the first interval (0 for an empty timeline).
    pub fn start(&self) -> f64 {
        self.intervals.iter().map(|i| i.start).fold(f64::INFINITY, f64::min).min(self.makespan())
    }

    /// Every rank's intervals, each rank's sorted by start time: one pass over the intervals
    /// (`by_rank()[r]` for rank `r`; an interval of a rank ≥ [`Timeline::ranks`] is left out).
    pub fn by_rank(&self) -> Vec<Vec<Interval>> {
        let mut rows = vec![Vec::new(); self.ranks];
        for i in &self.intervals {
            if let Some(row) = rows.get_mut(i.rank) {
                row.push(*i);
            }
        }
        for row in &mut rows {
            row.sort_by(|a: &Interval, b| a.start.total_cmp(&b.start));
        }
        rows
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn by_rank_groups_and_sorts() {
        let at = |rank, start: f64| Interval { rank, start, end: start + 1.0, action: Action::f(rank, 0) };
        let t = Timeline {
            ranks: 2,
            intervals: vec![at(1, 3.0), at(0, 2.0), at(1, 1.0), at(0, 0.0), at(5, 0.0)],
            comm: Vec::new(),
            unit: "unit".into(),
        };
        let starts: Vec<Vec<f64>> = t.by_rank().iter().map(|r| r.iter().map(|i| i.start).collect()).collect();
        assert_eq!(starts, vec![vec![0.0, 2.0], vec![1.0, 3.0]]);
    }
}
