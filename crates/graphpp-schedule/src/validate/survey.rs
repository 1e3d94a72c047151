//! What one pass over a schedule's cells gathers before the checks ([`Survey`]) and what the
//! validator reports of a valid schedule ([`Summary`], [`ActionCounts`]).

use std::fmt;
use std::ops::Range;

use rayon::prelude::*;

use crate::action::{Action, CommKind, ComputeKind, StageId, StageOpKind, Task};
use crate::placement::Placement;
use crate::route::widen_route;
use crate::schedule::{RankId, Schedule, Step};

/// Number of actions of each kind; an OVERLAP_F_B counts once as `overlap` and not as F or B.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ActionCounts {
    /// F.
    pub f: usize,
    /// B.
    pub b: usize,
    /// I.
    pub i: usize,
    /// W.
    pub w: usize,
    /// OVERLAP_F_B.
    pub overlap: usize,
    /// SEND_F + SEND_B.
    pub send: usize,
    /// RECV_F + RECV_B.
    pub recv: usize,
    /// UNSHARD.
    pub unshard: usize,
    /// RESHARD.
    pub reshard: usize,
    /// REDUCE_GRAD.
    pub reduce_grad: usize,
    /// WAIT_SEND_F + WAIT_SEND_B.
    pub wait_send: usize,
    /// WAIT_REDUCE_GRAD.
    pub wait_reduce_grad: usize,
}

impl ActionCounts {
    /// Every count with its kind's name in the action text (`F`, …, `OVERLAP_F_B`, `SEND`, …,
    /// `WAIT_REDUCE_GRAD`), in that order: what the summary line and the Python binding list.
    pub fn named(&self) -> [(&'static str, usize); 12] {
        [
            ("F", self.f),
            ("B", self.b),
            ("I", self.i),
            ("W", self.w),
            ("OVERLAP_F_B", self.overlap),
            ("SEND", self.send),
            ("RECV", self.recv),
            ("UNSHARD", self.unshard),
            ("RESHARD", self.reshard),
            ("REDUCE_GRAD", self.reduce_grad),
            ("WAIT_SEND", self.wait_send),
            ("WAIT_REDUCE_GRAD", self.wait_reduce_grad),
        ]
    }
}

impl ActionCounts {
    /// Counts the actions of a schedule.
    pub fn of(s: &Schedule) -> Self {
        let mut c = ActionCounts::default();
        for (_, a) in s.actions() {
            c.add(a);
        }
        c
    }

    /// Adds the counts of `o`.
    fn merge(&mut self, o: &ActionCounts) {
        let ActionCounts {
            f,
            b,
            i,
            w,
            overlap,
            send,
            recv,
            unshard,
            reshard,
            reduce_grad,
            wait_send,
            wait_reduce_grad,
        } = *o;
        self.f += f;
        self.b += b;
        self.i += i;
        self.w += w;
        self.overlap += overlap;
        self.send += send;
        self.recv += recv;
        self.unshard += unshard;
        self.reshard += reshard;
        self.reduce_grad += reduce_grad;
        self.wait_send += wait_send;
        self.wait_reduce_grad += wait_reduce_grad;
    }

    /// Counts one action.
    #[inline]
    fn add(&mut self, a: &Action) {
        let c = self;
        {
            let slot = match a {
                Action::Compute { kind: ComputeKind::F, .. } => &mut c.f,
                Action::Compute { kind: ComputeKind::B, .. } => &mut c.b,
                Action::Compute { kind: ComputeKind::I, .. } => &mut c.i,
                Action::Compute { kind: ComputeKind::W, .. } => &mut c.w,
                Action::Overlap { .. } => &mut c.overlap,
                Action::Comm { kind: CommKind::SendF | CommKind::SendB, .. } => &mut c.send,
                Action::Comm { kind: CommKind::RecvF | CommKind::RecvB, .. } => &mut c.recv,
                Action::Comm { kind: CommKind::WaitSendF | CommKind::WaitSendB, .. } => &mut c.wait_send,
                Action::StageOp { kind: StageOpKind::Unshard, .. } => &mut c.unshard,
                Action::StageOp { kind: StageOpKind::Reshard, .. } => &mut c.reshard,
                Action::StageOp { kind: StageOpKind::ReduceGrad, .. } => &mut c.reduce_grad,
                Action::StageOp { kind: StageOpKind::WaitReduceGrad, .. } => &mut c.wait_reduce_grad,
            };
            *slot += 1;
        }
    }
}

/// What one pass over the cells gathers before the checks (none of it can fail): the counts,
/// the largest stage and microbatch named, the compute routes and the largest stage a
/// non-compute action names.
pub(super) struct Survey {
    pub(super) counts: ActionCounts,
    /// One more than the largest stage any action names (0 if none).
    pub(super) stages_named: usize,
    /// One more than the largest microbatch any action names (0 if none).
    pub(super) mbs_named: usize,
    /// [`super::compute_routes`].
    pub(super) routes: Vec<Option<Range<StageId>>>,
    /// One more than the largest stage a non-compute action (SEND/RECV/WAIT/UNSHARD/RESHARD/
    /// REDUCE_GRAD) names (0 if none).
    pub(super) other_stages: usize,
}

impl Survey {
    /// The survey of `s`: the ranks' surveys, gathered in parallel (rayon's current pool).
    pub(super) fn of(s: &Schedule) -> Self {
        s.ranks.par_iter().map(|row| Survey::of_row(row)).reduce(Survey::empty, Survey::merge)
    }

    /// Nothing surveyed.
    fn empty() -> Self {
        Survey {
            counts: ActionCounts::default(),
            stages_named: 0,
            mbs_named: 0,
            routes: Vec::new(),
            other_stages: 0,
        }
    }

    /// The survey of one rank's program.
    fn of_row(row: &[Step]) -> Self {
        let mut v = Survey::empty();
        for a in row.iter().flatten() {
            v.counts.add(a);
            match *a {
                Action::Compute { task, .. } => v.compute(task),
                Action::Overlap { f, b } => {
                    v.compute(f);
                    v.compute(b);
                }
                Action::Comm { task, .. } => {
                    v.other(task.stage);
                    v.mbs_named = v.mbs_named.max(task.mb.saturating_add(1));
                }
                Action::StageOp { stage, .. } => v.other(stage),
            }
        }
        v
    }

    /// The survey of both parts of a schedule.
    fn merge(mut self, other: Survey) -> Survey {
        self.counts.merge(&other.counts);
        self.stages_named = self.stages_named.max(other.stages_named);
        self.mbs_named = self.mbs_named.max(other.mbs_named);
        self.other_stages = self.other_stages.max(other.other_stages);
        for (mb, r) in other.routes.into_iter().enumerate() {
            if let Some(r) = r {
                widen_route(&mut self.routes, Task::new(r.start, mb));
                widen_route(&mut self.routes, Task::new(r.end - 1, mb));
            }
        }
        self
    }

    /// Notes a compute task.
    #[inline]
    fn compute(&mut self, t: Task) {
        self.stages_named = self.stages_named.max(t.stage.saturating_add(1));
        self.mbs_named = self.mbs_named.max(t.mb.saturating_add(1));
        widen_route(&mut self.routes, t);
    }

    /// Notes the stage of a non-compute action.
    #[inline]
    fn other(&mut self, stage: StageId) {
        self.stages_named = self.stages_named.max(stage.saturating_add(1));
        self.other_stages = self.other_stages.max(stage.saturating_add(1));
    }
}

/// What a valid schedule looks like.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    /// p.
    pub ranks: usize,
    /// S.
    pub stages: usize,
    /// m.
    pub microbatches: usize,
    /// The placement the stage → rank map matches (loop checked first), `None` for any other.
    pub placement: Option<Placement>,
    /// Actions by kind.
    pub counts: ActionCounts,
    /// True when the schedule holds any SEND/RECV/UNSHARD/RESHARD/REDUCE_GRAD/WAIT.
    pub lowered: bool,
    /// Ranks without a compute action (only when [`ValidateOptions::ranks`] is not given; with it
    /// such a rank is [`ValidationError::IdleRank`]). Callers should warn about them.
    pub idle_ranks: Vec<RankId>,
}

/// One line: `valid: 4 ranks, 8 stages (loop placement), 8 microbatches, compute-only; 64 F, 64 B`.
impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let placement = self.placement.map_or("other", Placement::name);
        let parts: Vec<String> =
            self.counts.named().iter().filter(|(_, n)| *n > 0).map(|(k, n)| format!("{n} {k}")).collect();
        let n =
            |count: usize, one: &str, many: &str| format!("{count} {}", if count == 1 { one } else { many });
        write!(
            f,
            "valid: {}, {} ({placement} placement), {}, {}; {}",
            n(self.ranks, "rank", "ranks"),
            n(self.stages, "stage", "stages"),
            n(self.microbatches, "microbatch", "microbatches"),
            if self.lowered { "lowered" } else { "compute-only" },
            parts.join(", ")
        )
    }
}
