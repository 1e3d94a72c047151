//! Static validation of a schedule (docs/ARCHITECTURE.md, "Schedule IR" → "Validation").
//!
//! [`validate`] runs the checks below in this order and returns the first failure as a typed
//! [`ValidationError`] naming rank, step and action where one exists. A *step* is the 0-based
//! CSV cell index in the rank's row (idle steps counted).
//!
//! 1. the schedule has compute actions; the expected number of ranks ([`ValidateOptions::ranks`]),
//!    each with a compute action; every stage is on exactly one rank;
//! 2. microbatches: none beyond the expected `m`, none missing; the routes (the stages each
//!    microbatch's compute actions name, see [`Schedule::route`]) follow from the placement, checked
//!    for the whole schedule: either every route is all stages `0..S` (one pipeline) or every route
//!    is one half, `0..S/2` or `S/2..S`, with both halves used and placed as DualPipe's two
//!    directions (stage `S/2+i` on the rank of stage `S/2−1−i`); `S` is the expected number of
//!    stages when given ([`ValidateOptions::stages`]);
//! 3. per (stage, microbatch) in the route: exactly one F and either one B (possibly the B half of
//!    OVERLAP_F_B) or one I plus one W;
//! 4. per stage, program order F before B/I, I before W;
//! 5. lowered schedules (any SEND/RECV/WAIT_SEND): every SEND/RECV/WAIT_SEND belongs to an existing cross-rank stage
//!    boundary of its microbatch's route, and every cross-rank boundary has exactly one
//!    SEND_F/RECV_F/SEND_B/RECV_B each; a WAIT_SEND_F/B (PyTorch 2.15's completion wait) comes at
//!    most once, after its SEND on the same rank;
//! 6. with UNSHARD/RESHARD: per rank, compute only on unsharded stages, no UNSHARD of an unsharded
//!    stage nor RESHARD of a sharded one, all resharded at the end;
//! 7. with REDUCE_GRAD: exactly one per stage, after the stage's last backward-like action (B/I/W);
//!    a WAIT_REDUCE_GRAD at most once per stage, after its REDUCE_GRAD;
//! 8. cross-rank deadlock check on [`DepGraph`] (blocking RECV semantics), naming the waiting cycle.
//!
//! PyTorch (`torch.distributed.pipelining`, `_validate_schedule`) checks only per-stage order;
//! checks 2, 5–8 go further, as docs/ARCHITECTURE.md asks.

// The errors are cold and some variants carry two `Loc`s so that the message can name both
// actions; boxing them would only make matching on variants clumsier.
#![allow(clippy::result_large_err)]

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fmt;
use std::ops::Range;

use rayon::prelude::*;

use crate::action::{Action, CommKind, ComputeKind, StageId, StageOpKind, Task};
use crate::deps::{widen_route, DepGraph, Index, MissingDep, Pos, RunOrder, Walk};
use crate::placement::Placement;
use crate::schedule::{RankId, Schedule, Step};
use crate::table::TaskMap;

/// What the validator expects beyond the schedule itself: the intended shape, where known.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ValidateOptions {
    /// Expected number of microbatches `m`; `None` infers it as one more than the largest
    /// microbatch any action names.
    pub microbatches: Option<usize>,
    /// Expected number of ranks `p`: the schedule must have exactly this many rows, each with a
    /// compute action. `None` accepts any number and lists ranks without compute in
    /// [`Summary::idle_ranks`].
    pub ranks: Option<usize>,
    /// Expected number of stages `S`; `None` infers it from the largest stage a compute names.
    pub stages: Option<usize>,
}

impl ValidateOptions {
    /// Only the number of microbatches is known.
    pub fn microbatches(m: usize) -> Self {
        ValidateOptions { microbatches: Some(m), ..Default::default() }
    }
}

/// Where an action sits: rank, step (0-based CSV cell index, idle steps counted) and the action.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Loc {
    /// Rank.
    pub rank: RankId,
    /// 0-based cell index in the rank's row.
    pub step: usize,
    /// The action in that cell.
    pub action: Action,
}

impl fmt::Display for Loc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} step {} (`{}`)", self.rank, self.step, self.action)
    }
}

/// One cross-rank wait of a deadlock cycle: the action at `at` waits for `on`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wait {
    /// The waiting action.
    pub at: Loc,
    /// The action it waits for (on another rank, except for a cycle inside one rank).
    pub on: Loc,
}

impl fmt::Display for Wait {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {} at step {} ({}) waits for {} on rank {}",
            self.at.rank, self.at.step, self.at.action, self.on.action, self.on.rank
        )
    }
}

fn join<T: fmt::Display>(items: &[T], sep: &str) -> String {
    items.iter().map(ToString::to_string).collect::<Vec<_>>().join(sep)
}

fn peer_text(peer: &Option<Loc>) -> String {
    peer.map_or(String::new(), |p| format!(" (its peer is at {p})"))
}

/// Why a schedule is invalid. [`ValidationError::kind`] gives the variant as a plain enum.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ValidationError {
    /// The schedule holds no compute action (F/B/I/W/OVERLAP_F_B).
    #[error("the schedule has no compute actions")]
    Empty,
    /// A stage's actions appear on more than one rank.
    #[error("stage {stage} is on rank {first_rank} and also at {at}")]
    StageOnManyRanks {
        /// The stage.
        stage: StageId,
        /// The rank of the stage's first action.
        first_rank: RankId,
        /// The first action of the stage on another rank.
        at: Loc,
    },
    /// An action names a microbatch `>= m` (only with [`ValidateOptions::microbatches`]).
    #[error("{at}: microbatch {mb} is out of range (expected m = {expected})")]
    MicrobatchOutOfRange {
        /// The offending microbatch.
        mb: usize,
        /// Expected m.
        expected: usize,
        /// Where.
        at: Loc,
    },
    /// No compute action names microbatch `mb`.
    #[error("microbatch {mb} is missing entirely (expected m = {expected})")]
    MissingMicrobatch {
        /// The missing microbatch.
        mb: usize,
        /// Expected (or inferred) m.
        expected: usize,
    },
    /// The schedule has another number of ranks than expected.
    #[error("the schedule has {found} ranks, expected {expected}")]
    RankCount {
        /// Expected p.
        expected: usize,
        /// Rows in the schedule.
        found: usize,
    },
    /// A rank has no compute action although the expected shape counts it.
    #[error("rank {rank} has no compute action (expected {ranks} ranks, each running stages)")]
    IdleRank {
        /// The rank.
        rank: RankId,
        /// Expected p.
        ranks: usize,
    },
    /// The compute actions name another number of stages than expected.
    #[error("the schedule's compute actions name {found} stages (0..{found}), expected {expected}")]
    StageCount {
        /// Expected S.
        expected: usize,
        /// One more than the largest stage a compute action names.
        found: usize,
    },
    /// A microbatch visits neither all stages nor one DualPipe half.
    #[error("microbatch {mb} visits stages {}..{}, expected 0..{stages} (or one half of it)", route.start, route.end)]
    RouteMismatch {
        /// The microbatch.
        mb: usize,
        /// The stages its compute actions name.
        route: Range<StageId>,
        /// S.
        stages: usize,
    },
    /// Every microbatch visits one half of the stages, but the halves are not placed as
    /// DualPipe's two directions (stage `S/2+i` with stage `S/2−1−i`).
    #[error("microbatches visit one half of the stages each, but stage {stage} is on rank {rank} and its DualPipe mirror, stage {mirror}, on rank {mirror_rank}: two directions over the same ranks place stage S/2+i with stage S/2-1-i")]
    HalvesNotMirrored {
        /// A stage of the upper half.
        stage: StageId,
        /// Its rank.
        rank: RankId,
        /// The stage of the lower half it should share a rank with.
        mirror: StageId,
        /// That stage's rank.
        mirror_rank: RankId,
    },
    /// A stage below S that no compute action names.
    #[error("stage {stage} has no compute action (S = {stages})")]
    StageWithoutCompute {
        /// The stage.
        stage: StageId,
        /// S.
        stages: usize,
    },
    /// Some microbatches visit all stages and others one half: the schedule is neither one
    /// pipeline nor DualPipe's two directions.
    #[error("microbatch {mb} visits stages {}..{} but microbatch {other_mb} visits {}..{}: every microbatch visits all {stages} stages (one pipeline), or each visits one half with both halves used (DualPipe's two directions)", .route.start, .route.end, .other_route.start, .other_route.end)]
    MixedRoutes {
        /// The microbatch whose route does not fit.
        mb: usize,
        /// Its route.
        route: Range<StageId>,
        /// A microbatch whose route sets the schedule's kind of route.
        other_mb: usize,
        /// That microbatch's route.
        other_route: Range<StageId>,
        /// S.
        stages: usize,
    },
    /// A (stage, microbatch) in a route lacks F, a backward (B or I), or the W after its I.
    #[error("{} is missing: no rank runs it{}", missing_text(*.kind, *.task), .rank.map_or(String::new(), |r| format!(" (stage {} is on rank {r})", .task.stage)))]
    MissingCompute {
        /// F, B (meaning "B or I") or W.
        kind: ComputeKind,
        /// The (stage, microbatch).
        task: Task,
        /// The rank that holds the stage, if any action of the stage exists.
        rank: Option<RankId>,
    },
    /// A compute (kind, stage, microbatch) runs twice.
    #[error("{at} runs {}{}{} a second time (first at {first})", .task.stage, .kind, .task.mb)]
    DuplicateCompute {
        /// The kind that repeats.
        kind: ComputeKind,
        /// The (stage, microbatch).
        task: Task,
        /// The second occurrence.
        at: Loc,
        /// The first occurrence.
        first: Loc,
    },
    /// One (stage, microbatch) has both a full B and an I.
    #[error("{at} and {other} give {}.{} both a full B and an I", .task.stage, .task.mb)]
    MixedBackward {
        /// The (stage, microbatch).
        task: Task,
        /// The action holding the I.
        at: Loc,
        /// The action holding the B.
        other: Loc,
    },
    /// A W whose (stage, microbatch) has no I.
    #[error("{at}: W without an I for stage {} microbatch {}", .task.stage, .task.mb)]
    WWithoutI {
        /// The (stage, microbatch).
        task: Task,
        /// The W.
        at: Loc,
    },
    /// A per-stage program-order rule is broken: F before B/I, I before W.
    #[error("{at} runs before (or together with) {needs} at step {needs_step}, which must come first")]
    OrderViolation {
        /// The action that runs too early.
        at: Loc,
        /// What must come first, in action text (e.g. `0F3`).
        needs: String,
        /// The step of what must come first (same rank).
        needs_step: usize,
    },
    /// A SEND/RECV for a stage boundary its microbatch's route does not have.
    #[error("{at}: no such hand-over; microbatch {} visits stages {}", .at_mb, route_text(.route))]
    CommOutOfRoute {
        /// Where.
        at: Loc,
        /// Its microbatch.
        at_mb: usize,
        /// The microbatch's route (`None` if no compute names it).
        route: Option<Range<StageId>>,
    },
    /// A SEND/RECV between two stages that live on the same rank (they hand over locally).
    #[error("{at}: SEND/RECV between stages {from} and {to}, both on rank {}", .at.rank)]
    LocalComm {
        /// Where.
        at: Loc,
        /// Sending stage.
        from: StageId,
        /// Receiving stage.
        to: StageId,
    },
    /// A cross-rank stage boundary of a lowered schedule lacks one of its four comm actions.
    #[error("rank {rank} has no `{missing}`{}", peer_text(.peer))]
    MissingComm {
        /// The rank that should hold it.
        rank: RankId,
        /// The missing action.
        missing: Action,
        /// The matching action on the other rank, if present.
        peer: Option<Loc>,
    },
    /// The same SEND/RECV/WAIT_SEND appears twice.
    #[error("{at} repeats {first}")]
    DuplicateComm {
        /// The second occurrence.
        at: Loc,
        /// The first occurrence.
        first: Loc,
    },
    /// A WAIT_SEND_F/B or WAIT_REDUCE_GRAD whose SEND or REDUCE_GRAD has not run before it on
    /// its rank.
    #[error("{at} waits for `{start}`, which its rank has not started before it")]
    WaitBeforeStart {
        /// The wait.
        at: Loc,
        /// The action it waits for.
        start: Action,
    },
    /// A non-compute action (SEND/RECV/WAIT/UNSHARD/RESHARD/REDUCE_GRAD) names a stage no compute
    /// action names.
    #[error("{at}: stage {stage} has no compute actions (S = {stages})")]
    UnknownStage {
        /// Where.
        at: Loc,
        /// The stage.
        stage: StageId,
        /// S.
        stages: usize,
    },
    /// Compute on a stage that is sharded at that point (schedules that use UNSHARD).
    #[error("{at}: stage {stage} is sharded here (no UNSHARD before, or RESHARD since)")]
    ComputeWhileSharded {
        /// The compute action.
        at: Loc,
        /// The sharded stage.
        stage: StageId,
    },
    /// UNSHARD of an unsharded stage, or RESHARD of a sharded one.
    #[error("{at}: the stage is already {}", if matches!(.at.action, Action::StageOp { kind: StageOpKind::Unshard, .. }) { "unsharded" } else { "sharded" })]
    RedundantShardOp {
        /// Where.
        at: Loc,
    },
    /// A stage is still unsharded when its rank's program ends.
    #[error("rank {rank} ends with stage {stage} unsharded (no RESHARD after its last UNSHARD)")]
    UnshardedAtEnd {
        /// Rank.
        rank: RankId,
        /// Stage.
        stage: StageId,
    },
    /// A schedule with REDUCE_GRAD lacks it for a stage.
    #[error("stage {stage} has no REDUCE_GRAD")]
    MissingReduceGrad {
        /// The stage.
        stage: StageId,
    },
    /// A stage's REDUCE_GRAD (or WAIT_REDUCE_GRAD) appears twice.
    #[error("{at} repeats {first}")]
    DuplicateReduceGrad {
        /// The second occurrence.
        at: Loc,
        /// The first occurrence.
        first: Loc,
    },
    /// A REDUCE_GRAD before its stage's last backward-like action.
    #[error("{at} comes before the stage's last backward-like action at {last}")]
    ReduceGradTooEarly {
        /// The REDUCE_GRAD.
        at: Loc,
        /// The last B/I/W of the stage.
        last: Loc,
    },
    /// An action's producer is absent (from [`DepGraph::build`]).
    #[error(transparent)]
    MissingDependency(#[from] MissingDep),
    /// The ranks wait on each other in a cycle.
    #[error("deadlock: {}", join(.cycle, "; "))]
    Deadlock {
        /// The cross-rank waits of the cycle, in order; the first starts on the lowest (rank, step).
        cycle: Vec<Wait>,
    },
}

fn missing_text(kind: ComputeKind, t: Task) -> String {
    match kind {
        ComputeKind::B => format!("{}B{} (or {}I{} with {}W{})", t.stage, t.mb, t.stage, t.mb, t.stage, t.mb),
        k => format!("{}{k}{}", t.stage, t.mb),
    }
}

fn route_text(r: &Option<Range<StageId>>) -> String {
    r.as_ref().map_or("no stages".into(), |r| format!("{}..{}", r.start, r.end))
}

/// [`ValidationError`]'s variant without its data, for matching in tests and callers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// [`ValidationError::Empty`].
    Empty,
    /// [`ValidationError::StageOnManyRanks`].
    StageOnManyRanks,
    /// [`ValidationError::MicrobatchOutOfRange`].
    MicrobatchOutOfRange,
    /// [`ValidationError::MissingMicrobatch`].
    MissingMicrobatch,
    /// [`ValidationError::RankCount`].
    RankCount,
    /// [`ValidationError::IdleRank`].
    IdleRank,
    /// [`ValidationError::StageCount`].
    StageCount,
    /// [`ValidationError::RouteMismatch`].
    RouteMismatch,
    /// [`ValidationError::MixedRoutes`].
    MixedRoutes,
    /// [`ValidationError::StageWithoutCompute`].
    StageWithoutCompute,
    /// [`ValidationError::HalvesNotMirrored`].
    HalvesNotMirrored,
    /// [`ValidationError::WaitBeforeStart`].
    WaitBeforeStart,
    /// [`ValidationError::MissingCompute`].
    MissingCompute,
    /// [`ValidationError::DuplicateCompute`].
    DuplicateCompute,
    /// [`ValidationError::MixedBackward`].
    MixedBackward,
    /// [`ValidationError::WWithoutI`].
    WWithoutI,
    /// [`ValidationError::OrderViolation`].
    OrderViolation,
    /// [`ValidationError::CommOutOfRoute`].
    CommOutOfRoute,
    /// [`ValidationError::LocalComm`].
    LocalComm,
    /// [`ValidationError::MissingComm`].
    MissingComm,
    /// [`ValidationError::DuplicateComm`].
    DuplicateComm,
    /// [`ValidationError::UnknownStage`].
    UnknownStage,
    /// [`ValidationError::ComputeWhileSharded`].
    ComputeWhileSharded,
    /// [`ValidationError::RedundantShardOp`].
    RedundantShardOp,
    /// [`ValidationError::UnshardedAtEnd`].
    UnshardedAtEnd,
    /// [`ValidationError::MissingReduceGrad`].
    MissingReduceGrad,
    /// [`ValidationError::DuplicateReduceGrad`].
    DuplicateReduceGrad,
    /// [`ValidationError::ReduceGradTooEarly`].
    ReduceGradTooEarly,
    /// [`ValidationError::MissingDependency`].
    MissingDependency,
    /// [`ValidationError::Deadlock`].
    Deadlock,
}

impl ValidationError {
    /// The variant as a plain [`ErrorKind`].
    pub fn kind(&self) -> ErrorKind {
        use ValidationError as V;
        match self {
            V::Empty => ErrorKind::Empty,
            V::StageOnManyRanks { .. } => ErrorKind::StageOnManyRanks,
            V::MicrobatchOutOfRange { .. } => ErrorKind::MicrobatchOutOfRange,
            V::MissingMicrobatch { .. } => ErrorKind::MissingMicrobatch,
            V::RankCount { .. } => ErrorKind::RankCount,
            V::IdleRank { .. } => ErrorKind::IdleRank,
            V::StageCount { .. } => ErrorKind::StageCount,
            V::RouteMismatch { .. } => ErrorKind::RouteMismatch,
            V::MixedRoutes { .. } => ErrorKind::MixedRoutes,
            V::StageWithoutCompute { .. } => ErrorKind::StageWithoutCompute,
            V::HalvesNotMirrored { .. } => ErrorKind::HalvesNotMirrored,
            V::WaitBeforeStart { .. } => ErrorKind::WaitBeforeStart,
            V::MissingCompute { .. } => ErrorKind::MissingCompute,
            V::DuplicateCompute { .. } => ErrorKind::DuplicateCompute,
            V::MixedBackward { .. } => ErrorKind::MixedBackward,
            V::WWithoutI { .. } => ErrorKind::WWithoutI,
            V::OrderViolation { .. } => ErrorKind::OrderViolation,
            V::CommOutOfRoute { .. } => ErrorKind::CommOutOfRoute,
            V::LocalComm { .. } => ErrorKind::LocalComm,
            V::MissingComm { .. } => ErrorKind::MissingComm,
            V::DuplicateComm { .. } => ErrorKind::DuplicateComm,
            V::UnknownStage { .. } => ErrorKind::UnknownStage,
            V::ComputeWhileSharded { .. } => ErrorKind::ComputeWhileSharded,
            V::RedundantShardOp { .. } => ErrorKind::RedundantShardOp,
            V::UnshardedAtEnd { .. } => ErrorKind::UnshardedAtEnd,
            V::MissingReduceGrad { .. } => ErrorKind::MissingReduceGrad,
            V::DuplicateReduceGrad { .. } => ErrorKind::DuplicateReduceGrad,
            V::ReduceGradTooEarly { .. } => ErrorKind::ReduceGradTooEarly,
            V::MissingDependency(_) => ErrorKind::MissingDependency,
            V::Deadlock { .. } => ErrorKind::Deadlock,
        }
    }
}

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
struct Survey {
    counts: ActionCounts,
    /// One more than the largest stage any action names (0 if none).
    stages_named: usize,
    /// One more than the largest microbatch any action names (0 if none).
    mbs_named: usize,
    /// [`compute_routes`].
    routes: Vec<Option<Range<StageId>>>,
    /// One more than the largest stage a non-compute action (SEND/RECV/WAIT/UNSHARD/RESHARD/
    /// REDUCE_GRAD) names (0 if none).
    other_stages: usize,
}

impl Survey {
    /// The survey of `s`: the ranks' surveys, gathered in parallel (rayon's current pool).
    fn of(s: &Schedule) -> Self {
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
        let placement = match self.placement {
            Some(Placement::Loop) => "loop",
            Some(Placement::V) => "V",
            None => "other",
        };
        let c = &self.counts;
        let parts: Vec<String> = [
            (c.f, "F"),
            (c.b, "B"),
            (c.i, "I"),
            (c.w, "W"),
            (c.overlap, "OVERLAP_F_B"),
            (c.send, "SEND"),
            (c.recv, "RECV"),
            (c.unshard, "UNSHARD"),
            (c.reshard, "RESHARD"),
            (c.reduce_grad, "REDUCE_GRAD"),
            (c.wait_send, "WAIT_SEND"),
            (c.wait_reduce_grad, "WAIT_REDUCE_GRAD"),
        ]
        .iter()
        .filter(|(n, _)| *n > 0)
        .map(|(n, k)| format!("{n} {k}"))
        .collect();
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

/// Rank `rank`'s non-idle cells in program order.
fn row_cells(s: &Schedule, rank: RankId) -> impl Iterator<Item = Loc> + '_ {
    let row = &s.ranks[rank];
    row.iter().enumerate().filter_map(move |(step, cell)| cell.map(|action| Loc { rank, step, action }))
}

/// Every non-idle cell, rank by rank in program order.
fn cells(s: &Schedule) -> impl Iterator<Item = Loc> + '_ {
    (0..s.num_ranks()).flat_map(|rank| row_cells(s, rank))
}

/// Number of cells (idle steps included): the size hint of the lookup tables.
fn cell_count(s: &Schedule) -> usize {
    s.ranks.iter().map(Vec::len).sum()
}

/// The full location of a table cell, reading the action back from `s`.
fn loc(s: &Schedule, p: Pos) -> Loc {
    let (rank, step) = (p.rank as usize, p.index as usize);
    Loc { rank, step, action: s.ranks[rank][step].expect("a table cell names a non-idle step") }
}

/// The table cell of a location.
fn pos(at: &Loc) -> Pos {
    Pos::new(at.rank, at.step)
}

/// Stage → rank lookup table (see [`TaskMap::by_stage`]).
pub(crate) type StageRanks = TaskMap<RankId>;

/// The stage → rank table.
///
/// # Errors
/// [`ValidationError::StageOnManyRanks`] at the first action of a stage on a second rank.
pub(crate) fn stage_rank_table(s: &Schedule) -> Result<StageRanks, ValidationError> {
    let stages = s.actions().flat_map(|(_, a)| a.stages()).max().map_or(0, |x| x + 1);
    stage_rank_table_of(s, stages)
}

/// [`stage_rank_table`] given `stages`, one more than the largest stage any action names. The
/// ranks' first uses of their stages are found in parallel (rayon's current pool), then entered
/// rank by rank: the first stage found on a second rank is the one a scan in rank/step order
/// finds first.
fn stage_rank_table_of(s: &Schedule, stages: usize) -> Result<StageRanks, ValidationError> {
    let firsts: Vec<Vec<(StageId, Loc)>> =
        (0..s.num_ranks()).into_par_iter().map(|rank| first_uses(s, rank)).collect();
    let mut map = TaskMap::by_stage(stages, cell_count(s));
    for (rank, uses) in firsts.into_iter().enumerate() {
        for (stage, at) in uses {
            let first_rank = map.first(0, Task::new(stage, 0), rank).unwrap_or(rank);
            if first_rank != rank {
                return Err(ValidationError::StageOnManyRanks { stage, first_rank, at });
            }
        }
    }
    Ok(map)
}

/// Each stage rank `rank`'s actions name, with the first action naming it, in order of first use.
fn first_uses(s: &Schedule, rank: RankId) -> Vec<(StageId, Loc)> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    // The two stages this rank's latest actions named, already seen.
    let mut recent: [Option<StageId>; 2] = [None, None];
    for at in row_cells(s, rank) {
        for stage in at.action.stages() {
            if recent.contains(&Some(stage)) {
                continue;
            }
            if seen.insert(stage) {
                out.push((stage, at));
            }
            recent = [Some(stage), recent[0]];
        }
    }
    out
}

/// The stage → rank map.
///
/// # Errors
/// [`ValidationError::StageOnManyRanks`] at the first action of a stage on a second rank.
pub fn stage_ranks(s: &Schedule) -> Result<BTreeMap<StageId, RankId>, ValidationError> {
    let table = stage_rank_table(s)?;
    let stages = s.actions().flat_map(|(_, a)| a.stages());
    Ok(stages.filter_map(|st| table.of_stage(st).map(|r| (st, r))).collect())
}

/// Routes from compute actions only (see [`Schedule::route`]); index = microbatch.
pub fn compute_routes(s: &Schedule) -> Vec<Option<Range<StageId>>> {
    let mut routes = Vec::new();
    for (_, task) in s.actions().flat_map(|(_, a)| a.computes()) {
        widen_route(&mut routes, task);
    }
    routes
}

fn mbs_of(a: &Action) -> impl Iterator<Item = usize> {
    crate::deps::tasks_of(a).map(|t| t.mb)
}

/// The placement kind the stage → rank table of stages `0..stages` matches with `p` ranks.
fn placement_kind(map: &StageRanks, stages: usize, p: usize) -> Option<Placement> {
    let held: Vec<(StageId, RankId)> =
        (0..stages).filter_map(|st| map.of_stage(st).map(|r| (st, r))).collect();
    [Placement::Loop, Placement::V].into_iter().find(|pl| {
        (*pl == Placement::Loop || held.len() == 2 * p) && held.iter().all(|&(st, r)| pl.rank_of(st, p) == r)
    })
}

/// Checks the microbatch set; returns m.
fn check_microbatches(
    s: &Schedule,
    survey: &Survey,
    expected: Option<usize>,
) -> Result<usize, ValidationError> {
    let routes = &survey.routes;
    if let Some(m) = expected.filter(|&m| survey.mbs_named > m) {
        for at in cells(s) {
            if let Some(mb) = mbs_of(&at.action).find(|&mb| mb >= m) {
                return Err(ValidationError::MicrobatchOutOfRange { mb, expected: m, at });
            }
        }
    }
    let m = expected.unwrap_or(survey.mbs_named);
    match (0..m).find(|&mb| routes.get(mb).cloned().flatten().is_none()) {
        Some(mb) => Err(ValidationError::MissingMicrobatch { mb, expected: m }),
        None => Ok(m),
    }
}

/// The routes of the whole schedule (see the module docs, check 2): all `0..S`, or all halves
/// with both halves used and placed as DualPipe places them (stage `S/2+i` on the rank of stage
/// `S/2−1−i`). A half route among full ones is the offender named.
fn check_routes(
    routes: &[Option<Range<StageId>>],
    stages: usize,
    placement: &StageRanks,
) -> Result<(), ValidationError> {
    let half = stages / 2;
    let is_half = |r: &Range<StageId>| stages.is_multiple_of(2) && (*r == (0..half) || *r == (half..stages));
    let named = || routes.iter().enumerate().filter_map(|(mb, r)| r.clone().map(|r| (mb, r)));
    for (mb, r) in named() {
        if r != (0..stages) && !is_half(&r) {
            return Err(ValidationError::RouteMismatch { mb, route: r, stages });
        }
    }
    let full = named().find(|(_, r)| *r == (0..stages));
    let part = named().find(|(_, r)| *r != (0..stages));
    match (full, part) {
        (Some((other_mb, other_route)), Some((mb, route))) => {
            Err(ValidationError::MixedRoutes { mb, route, other_mb, other_route, stages })
        }
        // Halves only: the lower one must be used too, or stages 0..S/2 run nothing.
        (None, Some(_)) if !named().any(|(_, r)| r.start == 0) => {
            Err(ValidationError::StageWithoutCompute { stage: 0, stages })
        }
        (None, Some(_)) => check_mirrored(placement, stages),
        _ => Ok(()),
    }
}

/// DualPipe's two directions run over the same ranks in opposite order: stage `S/2+i` must be on
/// the rank of stage `S/2−1−i`.
fn check_mirrored(placement: &StageRanks, stages: usize) -> Result<(), ValidationError> {
    let half = stages / 2;
    for i in 0..half {
        let (stage, mirror) = (half + i, half - 1 - i);
        let (rank, mirror_rank) = (placement.of_stage(stage), placement.of_stage(mirror));
        if rank != mirror_rank {
            return Err(ValidationError::HalvesNotMirrored {
                stage,
                rank: rank.unwrap_or_default(),
                mirror,
                mirror_rank: mirror_rank.unwrap_or_default(),
            });
        }
    }
    Ok(())
}

/// The expected number of ranks, each with a compute action; without it, the ranks that have none.
fn check_ranks(s: &Schedule, expected: Option<usize>) -> Result<Vec<RankId>, ValidationError> {
    let found = s.num_ranks();
    if let Some(expected) = expected.filter(|&p| p != found) {
        return Err(ValidationError::RankCount { expected, found });
    }
    let idle: Vec<RankId> =
        (0..found).filter(|&r| !s.ranks[r].iter().flatten().any(Action::is_compute)).collect();
    match (expected, idle.first()) {
        (Some(ranks), Some(&rank)) => Err(ValidationError::IdleRank { rank, ranks }),
        _ => Ok(idle),
    }
}

/// First occurrence of every compute (kind, task), slot = [`ComputeKind`] as index.
type ComputeIndex = TaskMap<Pos>;

/// The first program-order violation in rank/step order: the action, and the (kind, task) that
/// must come before it.
type EarlyAction = Option<(Loc, ComputeKind, Task)>;

/// Indexes the compute actions; `stages` and `mbs` bound their stages and microbatches.
///
/// Also finds the first action (in rank/step order) whose per-stage predecessor (F before B/I,
/// I before W) has not run at an earlier step. Every stage is on one rank here (checked before),
/// so the predecessor, if it exists, is on the same rank and already indexed iff it ran earlier.
fn index_compute(
    s: &Schedule,
    stages: usize,
    mbs: usize,
) -> Result<(ComputeIndex, EarlyAction), ValidationError> {
    let mut ix = TaskMap::new(4, stages, mbs, cell_count(s));
    let mut early = None;
    for (rank, row) in s.ranks.iter().enumerate() {
        for (step, cell) in row.iter().enumerate() {
            let Some(action) = *cell else { continue };
            let at = || Loc { rank, step, action };
            for (kind, task) in action.computes() {
                if let Some(first) = ix.first(kind as usize, task, Pos::new(rank, step)) {
                    return Err(ValidationError::DuplicateCompute {
                        kind,
                        task,
                        at: at(),
                        first: loc(s, first),
                    });
                }
                if early.is_none() {
                    let before = match kind {
                        ComputeKind::B | ComputeKind::I => ComputeKind::F,
                        ComputeKind::W => ComputeKind::I,
                        ComputeKind::F => continue,
                    };
                    if ix.get(before as usize, task).is_none_or(|f| f.index as usize >= step) {
                        early = Some((at(), before, task));
                    }
                }
            }
        }
    }
    Ok((ix, early))
}

/// [`index_compute`], [`check_tasks`] and [`check_order`]: the compute index of a schedule whose
/// compute actions are all there, once each, in an order their per-stage predecessors allow.
fn check_compute(
    s: &Schedule,
    stages: usize,
    routes: &[Option<Range<StageId>>],
    placement: &StageRanks,
) -> Result<ComputeIndex, ValidationError> {
    let (compute, early) = index_compute(s, stages, routes.len())?;
    check_tasks(s, &compute, stages, routes, placement)?;
    check_order(s, &compute, early)?;
    Ok(compute)
}

fn check_task(
    s: &Schedule,
    ix: &ComputeIndex,
    task: Task,
    rank: Option<RankId>,
) -> Result<(), ValidationError> {
    let get = |k: ComputeKind| ix.get(k as usize, task);
    let missing = |kind| ValidationError::MissingCompute { kind, task, rank };
    let (b, i, w) = (get(ComputeKind::B), get(ComputeKind::I), get(ComputeKind::W));
    if get(ComputeKind::F).is_none() {
        return Err(missing(ComputeKind::F));
    }
    match (b, i, w) {
        (Some(other), Some(at), _) => {
            Err(ValidationError::MixedBackward { task, at: loc(s, at), other: loc(s, other) })
        }
        (_, None, Some(at)) => Err(ValidationError::WWithoutI { task, at: loc(s, at) }),
        (None, None, None) => Err(missing(ComputeKind::B)),
        (None, Some(_), None) => Err(missing(ComputeKind::W)),
        _ => Ok(()),
    }
}

fn check_tasks(
    s: &Schedule,
    ix: &ComputeIndex,
    stages: usize,
    routes: &[Option<Range<StageId>>],
    placement: &StageRanks,
) -> Result<(), ValidationError> {
    // Stage by stage, in parallel (rayon's current pool), in the table's own order; only if a task
    // fails are they checked again in the documented order (microbatch, then stage) to find the
    // first.
    let all_ok = (0..stages).into_par_iter().all(|stage| {
        let rank = placement.of_stage(stage);
        routes.iter().enumerate().all(|(mb, r)| {
            !r.as_ref().is_some_and(|r| r.contains(&stage))
                || check_task(s, ix, Task::new(stage, mb), rank).is_ok()
        })
    });
    if all_ok {
        return Ok(());
    }
    for (mb, r) in routes.iter().enumerate() {
        for stage in r.clone().into_iter().flatten() {
            check_task(s, ix, Task::new(stage, mb), placement.of_stage(stage))?;
        }
    }
    Ok(())
}

/// F before B/I, I before W: the first violation [`index_compute`] found ([`check_tasks`] has
/// made sure every predecessor exists; should one not, a full scan decides).
fn check_order(s: &Schedule, ix: &ComputeIndex, early: EarlyAction) -> Result<(), ValidationError> {
    let Some((at, before, task)) = early else { return Ok(()) };
    match ix.get(before as usize, task) {
        Some(first) => Err(ValidationError::OrderViolation {
            at,
            needs: format!("{}{before}{}", task.stage, task.mb),
            needs_step: first.index as usize,
        }),
        None => check_order_scan(s, ix),
    }
}

/// F before B/I, I before W, scanning actions in rank/step order.
fn check_order_scan(s: &Schedule, ix: &ComputeIndex) -> Result<(), ValidationError> {
    for at in cells(s) {
        for (kind, task) in at.action.computes() {
            let before = match kind {
                ComputeKind::B | ComputeKind::I => ComputeKind::F,
                ComputeKind::W => ComputeKind::I,
                ComputeKind::F => continue,
            };
            if let Some(first) = ix.get(before as usize, task).filter(|f| f.index as usize >= at.step) {
                return Err(ValidationError::OrderViolation {
                    at,
                    needs: format!("{}{before}{}", task.stage, task.mb),
                    needs_step: first.index as usize,
                });
            }
        }
    }
    Ok(())
}

/// The stage boundary `(from, from + 1)` a comm action belongs to, if `stage` allows one.
fn boundary(kind: CommKind, stage: StageId) -> Option<StageId> {
    match kind {
        CommKind::SendF | CommKind::RecvB | CommKind::WaitSendF => Some(stage),
        CommKind::RecvF | CommKind::SendB | CommKind::WaitSendB => stage.checked_sub(1),
    }
}

/// The four comm actions of the hand-over of `mb` across boundary `(from, from + 1)`: SEND_F and
/// RECV_B on the rank of `from`, RECV_F and SEND_B on the rank of `from + 1`.
fn handover(from: StageId, mb: usize) -> [Action; 4] {
    [
        Action::comm(CommKind::SendF, from, mb),
        Action::comm(CommKind::RecvF, from + 1, mb),
        Action::comm(CommKind::SendB, from + 1, mb),
        Action::comm(CommKind::RecvB, from, mb),
    ]
}

/// First occurrence of every SEND/RECV/WAIT_SEND, slot = [`CommKind`] as index.
type CommIndex = TaskMap<Pos>;

fn comm_cell(ix: &CommIndex, a: &Action) -> Option<Pos> {
    match *a {
        Action::Comm { kind, task } => ix.get(kind as usize, task),
        _ => None,
    }
}

/// SEND/RECV checks; every stage is below `stages` and every microbatch below `routes.len()`.
/// Returns the index of the comm actions (the dependency walk's comm producers).
fn check_comm(
    s: &Schedule,
    routes: &[Option<Range<StageId>>],
    placement: &StageRanks,
    stages: usize,
) -> Result<CommIndex, ValidationError> {
    let mut ix = TaskMap::new(6, stages, routes.len(), cell_count(s));
    // Comm actions by kind; each one counted sits on a distinct cross-rank boundary of its route.
    let mut counts = [0usize; 6];
    let comm_cells = s.ranks.iter().enumerate().flat_map(|(rank, row)| {
        row.iter().enumerate().filter_map(move |(step, cell)| match *cell {
            Some(Action::Comm { kind, task }) => Some((kind, task, rank, step)),
            _ => None,
        })
    });
    for (kind, task, rank, step) in comm_cells {
        let at = Loc { rank, step, action: Action::Comm { kind, task } };
        if let Some(first) = ix.first(kind as usize, task, Pos::new(rank, step)) {
            return Err(ValidationError::DuplicateComm { at, first: loc(s, first) });
        }
        counts[kind as usize] += 1;
        let route = routes.get(task.mb).cloned().flatten();
        let from = boundary(kind, task.stage)
            .filter(|&b| route.as_ref().is_some_and(|r| r.start <= b && b + 1 < r.end));
        let Some(from) = from else {
            return Err(ValidationError::CommOutOfRoute { at, at_mb: task.mb, route });
        };
        if placement.of_stage(from) == placement.of_stage(from + 1) {
            return Err(ValidationError::LocalComm { at, from, to: from + 1 });
        }
        // Cells go rank by rank in program order and a stage is on one rank, so a SEND that runs
        // before its WAIT_SEND is indexed by now.
        if let Some(send) = kind.waits_for().filter(|&k| ix.get(k as usize, task).is_none()) {
            return Err(ValidationError::WaitBeforeStart { at, start: Action::Comm { kind: send, task } });
        }
    }
    if !all_handovers(&counts, routes, placement, stages) {
        check_handovers(s, &ix, routes, placement)?;
    }
    Ok(ix)
}

/// True when every cross-rank boundary of every route has its four comm actions, from the counts
/// alone: each comm action [`check_comm`] counted is on a distinct cross-rank boundary of its
/// route (duplicates, actions off their route and local ones were refused), so as many of a kind
/// as there are such boundaries means none is missing. False sends [`check_handovers`] looking
/// for the first one missing.
fn all_handovers(
    counts: &[usize; 6],
    routes: &[Option<Range<StageId>>],
    placement: &StageRanks,
    stages: usize,
) -> bool {
    // cuts[s]: cross-rank boundaries (b, b + 1) with b < s.
    let mut cuts = vec![0usize; stages + 1];
    for b in 0..stages {
        let cut = b + 1 < stages && placement.of_stage(b) != placement.of_stage(b + 1);
        cuts[b + 1] = cuts[b] + usize::from(cut);
    }
    let needed: usize = routes.iter().flatten().map(|r| cuts[r.end.saturating_sub(1)] - cuts[r.start]).sum();
    [CommKind::SendF, CommKind::RecvF, CommKind::SendB, CommKind::RecvB]
        .iter()
        .all(|&k| counts[k as usize] == needed)
}

/// Every cross-rank boundary of every route has its four comm actions.
fn check_handovers(
    s: &Schedule,
    ix: &CommIndex,
    routes: &[Option<Range<StageId>>],
    placement: &StageRanks,
) -> Result<(), ValidationError> {
    for (mb, r) in routes.iter().enumerate() {
        let Some(r) = r else { continue };
        for from in r.start..r.end.saturating_sub(1) {
            let (a, b) = (placement.of_stage(from), placement.of_stage(from + 1));
            if a == b {
                continue;
            }
            let acts = handover(from, mb);
            let peer_of = [1, 0, 3, 2];
            for (k, act) in acts.iter().enumerate() {
                if comm_cell(ix, act).is_none() {
                    let rank = if matches!(k, 0 | 3) { a } else { b };
                    return Err(ValidationError::MissingComm {
                        rank: rank.unwrap_or_default(),
                        missing: *act,
                        peer: comm_cell(ix, &acts[peer_of[k]]).map(|c| loc(s, c)),
                    });
                }
            }
        }
    }
    Ok(())
}

fn check_known_stages(s: &Schedule, survey: &Survey, stages: usize) -> Result<(), ValidationError> {
    if survey.other_stages <= stages {
        return Ok(());
    }
    for at in cells(s).filter(|a| !a.action.is_compute()) {
        if let Some(stage) = at.action.stages().find(|&s| s >= stages) {
            return Err(ValidationError::UnknownStage { at, stage, stages });
        }
    }
    Ok(())
}

fn check_sharding(s: &Schedule) -> Result<(), ValidationError> {
    for rank in 0..s.num_ranks() {
        let mut unsharded = BTreeSet::new();
        for at in row_cells(s, rank) {
            let changed = match at.action {
                Action::StageOp { kind: StageOpKind::Unshard, stage } => unsharded.insert(stage),
                Action::StageOp { kind: StageOpKind::Reshard, stage } => unsharded.remove(&stage),
                a => match a.stages().find(|st| a.is_compute() && !unsharded.contains(st)) {
                    Some(stage) => return Err(ValidationError::ComputeWhileSharded { at, stage }),
                    None => true,
                },
            };
            if !changed {
                return Err(ValidationError::RedundantShardOp { at });
            }
        }
        if let Some(&stage) = unsharded.iter().next() {
            return Err(ValidationError::UnshardedAtEnd { rank, stage });
        }
    }
    Ok(())
}

/// The last backward-like (B, I, W, or OVERLAP_F_B's B) action of each stage below `stages`.
fn last_backward(s: &Schedule, stages: usize) -> TaskMap<Pos> {
    let mut last = TaskMap::by_stage(stages, cell_count(s));
    for at in cells(s) {
        for (kind, task) in at.action.computes() {
            if kind != ComputeKind::F {
                last.set(0, Task::new(task.stage, 0), pos(&at));
            }
        }
    }
    last
}

/// REDUCE_GRAD and WAIT_REDUCE_GRAD checks; every stage is below `stages`.
fn check_reduce_grad(s: &Schedule, stages: usize) -> Result<(), ValidationError> {
    let last = last_backward(s, stages);
    // Slot 0: REDUCE_GRAD, slot 1: WAIT_REDUCE_GRAD.
    let mut seen: TaskMap<Pos> = TaskMap::new(2, stages, 1, cell_count(s));
    for at in cells(s) {
        let Action::StageOp { kind, stage } = at.action else { continue };
        let slot = match kind {
            StageOpKind::ReduceGrad => 0,
            StageOpKind::WaitReduceGrad => 1,
            _ => continue,
        };
        if let Some(first) = seen.first(slot, Task::new(stage, 0), pos(&at)) {
            return Err(ValidationError::DuplicateReduceGrad { at, first: loc(s, first) });
        }
        if slot == 1 && seen.get(0, Task::new(stage, 0)).is_none() {
            let start = Action::stage_op(StageOpKind::ReduceGrad, stage);
            return Err(ValidationError::WaitBeforeStart { at, start });
        }
        if let Some(l) = last.of_stage(stage).filter(|l| slot == 0 && l.index as usize > at.step) {
            return Err(ValidationError::ReduceGradTooEarly { at, last: loc(s, l) });
        }
    }
    match (0..stages).find(|&st| seen.get(0, Task::new(st, 0)).is_none()) {
        Some(stage) => Err(ValidationError::MissingReduceGrad { stage }),
        None => Ok(()),
    }
}

/// Missing producers and deadlocks: a [`Walk`] when the schedule runs to its end (returned with
/// the order it ran the actions in), else the [`DepGraph`] (built only then) names the missing
/// producer or the waiting cycle.
///
/// `routes` are the schedule's compute routes, which every other action's tasks lie within once
/// the checks before have passed; `ix` the producer tables the checks built.
fn check_deadlock<'a>(
    s: &'a Schedule,
    routes: &[Option<Range<StageId>>],
    ix: &Index,
) -> Result<(Walk<'a>, RunOrder), ValidationError> {
    let walk = Walk::with_index(s, routes.to_vec(), ix);
    if let Some(order) = walk.run_order() {
        return Ok((walk, order));
    }
    let g = DepGraph::build(s)?;
    let loc =
        |a: crate::deps::ActionRef| Loc { rank: a.rank, step: g.steps[a.rank][a.index], action: g.action(a) };
    // The walk and Kahn's order see the same edges: a walk that stops has a cycle (an empty one
    // should they ever disagree).
    let cycle = g.topo_order().err().unwrap_or_default();
    Err(ValidationError::Deadlock {
        cycle: cycle.into_iter().map(|(a, b)| Wait { at: loc(a), on: loc(b) }).collect(),
    })
}

/// Validates a schedule (see the module docs for the checks and their order).
///
/// # Errors
/// The first [`ValidationError`] found.
pub fn validate(s: &Schedule, opts: &ValidateOptions) -> Result<Summary, ValidationError> {
    validated(s, opts).map(|v| v.summary)
}

/// A schedule that passed [`validate`], with the dependency walk its deadlock check ran: what
/// [`Validated::simulate`] needs, so that validating and simulating one schedule build the
/// producer tables and walk the ranks once (the schedule toolchain's pipeline at p = 64, v = 2,
/// m = 1024; issue 11).
pub struct Validated<'a> {
    /// What the schedule looks like.
    pub summary: Summary,
    /// The producers of every action, and the routes.
    pub(crate) walk: Walk<'a>,
    /// Every action, in an order where each comes after its producers and the actions before it
    /// on its rank (the order the deadlock check ran them in).
    pub(crate) order: RunOrder,
    /// The schedule checked.
    pub(crate) schedule: &'a Schedule,
}

impl<'a> Validated<'a> {
    /// The schedule that was checked.
    pub fn schedule(&self) -> &'a Schedule {
        self.schedule
    }
}

/// [`validate`], keeping the tables and the walk for the passes that come next ([`crate::lower`],
/// [`Validated::simulate`]).
///
/// # Errors
/// As [`validate`].
pub fn validated<'a>(s: &'a Schedule, opts: &ValidateOptions) -> Result<Validated<'a>, ValidationError> {
    let survey = Survey::of(s);
    let c = &survey.counts;
    if c.f + c.b + c.i + c.w + c.overlap == 0 {
        return Err(ValidationError::Empty);
    }
    let idle_ranks = check_ranks(s, opts.ranks)?;
    let placement = stage_rank_table_of(s, survey.stages_named)?;
    let m = check_microbatches(s, &survey, opts.microbatches)?;
    let routes = &survey.routes;
    let stages = routes.iter().flatten().map(|r| r.end).max().unwrap_or(0);
    if let Some(expected) = opts.stages.filter(|&e| e != stages) {
        return Err(ValidationError::StageCount { expected, found: stages });
    }
    check_routes(routes, stages, &placement)?;
    // The compute checks and the comm checks run side by side (rayon's current pool); their
    // errors are taken in the order the checks are documented in.
    let known = check_known_stages(s, &survey, stages);
    let counts = survey.counts;
    let with_comm = known.is_ok() && counts.send + counts.recv + counts.wait_send > 0;
    let (compute, comm) = rayon::join(
        || check_compute(s, stages, routes, &placement),
        || with_comm.then(|| check_comm(s, routes, &placement, stages)),
    );
    let compute = compute?;
    known?;
    let comm = comm.transpose()?.unwrap_or_else(|| TaskMap::new(6, 0, 0, 0));
    if counts.unshard + counts.reshard > 0 {
        check_sharding(s)?;
    }
    if counts.reduce_grad + counts.wait_reduce_grad > 0 {
        check_reduce_grad(s, stages)?;
    }
    let (walk, order) = check_deadlock(s, routes, &Index { compute, comm })?;
    let lowered = counts.send
        + counts.recv
        + counts.wait_send
        + counts.unshard
        + counts.reshard
        + counts.reduce_grad
        + counts.wait_reduce_grad
        > 0;
    let summary = Summary {
        ranks: s.num_ranks(),
        stages,
        microbatches: m,
        placement: placement_kind(&placement, stages, s.num_ranks()),
        counts,
        lowered,
        idle_ranks,
    };
    Ok(Validated { summary, walk, order, schedule: s })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(csv: &str) -> Schedule {
        Schedule::from_csv(csv).unwrap()
    }

    fn check(csv: &str) -> Result<Summary, ValidationError> {
        validate(&sched(csv), &ValidateOptions::default())
    }

    fn err(csv: &str) -> ValidationError {
        check(csv).unwrap_err()
    }

    fn at(rank: RankId, step: usize, action: &str) -> Loc {
        Loc { rank, step, action: action.parse().unwrap() }
    }

    /// 2-rank 1F1B with m = 2, lowered by hand following docs/ARCHITECTURE.md's SEND/RECV rules.
    const LOWERED: &str = "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\n\
                           1RECV_F0,1F0,1B0,1SEND_B0,1RECV_F1,1F1,1B1,1SEND_B1\n";

    #[test]
    fn summary_of_a_valid_schedule() {
        let s = check("0F0,0F1,,0B0,0B1\n,1F0,1B0,1F1,1B1\n").unwrap();
        assert_eq!((s.ranks, s.stages, s.microbatches), (2, 2, 2));
        assert_eq!((s.counts.f, s.counts.b, s.placement, s.lowered), (4, 4, Some(Placement::Loop), false));
        assert_eq!(
            s.to_string(),
            "valid: 2 ranks, 2 stages (loop placement), 2 microbatches, compute-only; 4 F, 4 B"
        );
        let one = check("0F0,0B0\n").unwrap().to_string();
        assert!(one.starts_with("valid: 1 rank, 1 stage (loop placement), 1 microbatch,"), "{one}");
        let l = check(LOWERED).unwrap();
        assert_eq!((l.counts.send, l.counts.recv, l.lowered), (4, 4, true));
    }

    #[test]
    fn v_placement_and_dualpipe_halves() {
        // p = 2, V placement: rank 0 holds stages 0 and 3, rank 1 holds 1 and 2; microbatch 0
        // runs 0..2 (first half), microbatch 1 runs 2..4 (second half), as in DualPipe.
        let s = check("0F0,3F1,3B1,0B0\n1F0,2F1,1B0,2B1\n").unwrap();
        assert_eq!((s.stages, s.microbatches, s.placement), (4, 2, Some(Placement::V)));
        // A route of 1..3 is neither all stages nor a half.
        let e = err("0F0,0B0,3F0,3B0\n1F1,2F1,2B1,1B1,1F0,2F0,2B0,1B0\n");
        assert_eq!(e, ValidationError::RouteMismatch { mb: 1, route: 1..3, stages: 4 });
    }

    #[test]
    fn a_microbatch_that_skips_stages_is_refused() {
        // PyTorch's test suite: stage 1 runs F for microbatch 0 only (expected 2).
        let e =
            validate(&sched("0F0,0F1,0B0,0B1\n1F0,1B0\n"), &ValidateOptions::microbatches(2)).unwrap_err();
        assert_eq!(
            e,
            ValidationError::MixedRoutes { mb: 1, route: 0..1, other_mb: 0, other_route: 0..2, stages: 2 }
        );
        assert!(
            e.to_string().starts_with("microbatch 1 visits stages 0..1 but microbatch 0 visits 0..2"),
            "{e}"
        );
        // Microbatch 0 only on stage 0.
        let e = err("0F0,0F1,0B0,0B1\n1F1,1B1\n");
        assert_eq!(
            e,
            ValidationError::MixedRoutes { mb: 0, route: 0..1, other_mb: 1, other_route: 0..2, stages: 2 }
        );
        // Each microbatch on one stage only, or two independent pipelines: halves, but not
        // DualPipe's mirrored directions.
        let e = err("0F0,0B0\n1F1,1B1\n");
        assert_eq!(e, ValidationError::HalvesNotMirrored { stage: 1, rank: 1, mirror: 0, mirror_rank: 0 });
        let e = err("0F0,0B0\n1F0,1B0\n2F1,2B1\n3F1,3B1\n");
        assert_eq!(e, ValidationError::HalvesNotMirrored { stage: 2, rank: 2, mirror: 1, mirror_rank: 1 });
        // Four stages, microbatch 1 only on the first two: a half, but the others are full routes.
        let e = err("0F0,0F1,0B0,0B1\n1F0,1F1,1B0,1B1\n2F0,2B0\n3F0,3B0\n");
        assert_eq!(e.kind(), ErrorKind::MixedRoutes, "{e}");
        // Only the upper half of a DualPipe layout: stages 0..2 run nothing.
        let e = err("3F0,3B0\n2F0,2B0\n");
        assert_eq!(e, ValidationError::StageWithoutCompute { stage: 0, stages: 4 });
    }

    #[test]
    fn the_intended_shape_is_checked() {
        let idle = sched("0F0,0B0\n,,\n");
        // Without a shape: valid, the idle rank listed for a warning.
        let sum = validate(&idle, &ValidateOptions::default()).unwrap();
        assert_eq!((sum.ranks, sum.stages, sum.idle_ranks.clone()), (2, 1, vec![1]));
        let shape =
            |ranks, stages| ValidateOptions { microbatches: None, ranks: Some(ranks), stages: Some(stages) };
        assert_eq!(
            validate(&idle, &shape(2, 2)).unwrap_err(),
            ValidationError::IdleRank { rank: 1, ranks: 2 }
        );
        assert_eq!(
            validate(&idle, &shape(3, 1)).unwrap_err(),
            ValidationError::RankCount { expected: 3, found: 2 }
        );
        let two = sched("0F0,0B0\n1F0,1B0\n");
        assert_eq!(
            validate(&two, &shape(2, 3)).unwrap_err(),
            ValidationError::StageCount { expected: 3, found: 2 }
        );
        assert!(validate(&two, &shape(2, 2)).unwrap().idle_ranks.is_empty());
    }

    #[test]
    fn pytorch_wait_actions() {
        let waited = LOWERED
            .replace("0SEND_F1,", "0SEND_F1,0WAIT_SEND_F0,")
            .replace("1SEND_B1\n", "1SEND_B1,1WAIT_SEND_B1\n");
        let sum = check(&waited).unwrap();
        assert_eq!((sum.counts.wait_send, sum.counts.send), (2, 4));
        assert!(sum.to_string().ends_with("4 SEND, 4 RECV, 2 WAIT_SEND"), "{sum}");
        // A wait before its send, a repeated wait, a wait for a hand-over that does not exist.
        let e = err(&LOWERED.replace("0F0,0SEND_F0,", "0F0,0WAIT_SEND_F0,0SEND_F0,"));
        assert_eq!(
            e,
            ValidationError::WaitBeforeStart {
                at: at(0, 1, "0WAIT_SEND_F0"),
                start: "0SEND_F0".parse().unwrap()
            }
        );
        let e = err(&waited.replace("0WAIT_SEND_F0,", "0WAIT_SEND_F0,0WAIT_SEND_F0,"));
        assert_eq!(e.kind(), ErrorKind::DuplicateComm);
        let e = err(&waited.replace("1WAIT_SEND_B1", "1WAIT_SEND_F1"));
        assert_eq!(e.kind(), ErrorKind::CommOutOfRoute);
        // A send completes when its peer receives it: waiting for it before the peer can get to
        // its RECV deadlocks, where the same schedule without the wait is valid.
        let early = "0F0,0SEND_F0,0F1,0SEND_F1,0RECV_B0,0B0,0RECV_B1,0B1\n\
                     1RECV_F1,1F1,1RECV_F0,1F0,1B0,1SEND_B0,1B1,1SEND_B1\n";
        assert!(check(early).is_ok());
        let e = err(&early.replace("0F0,0SEND_F0,", "0F0,0SEND_F0,0WAIT_SEND_F0,"));
        let ValidationError::Deadlock { cycle } = &e else { panic!("{e:?}") };
        assert_eq!(cycle[0].at, at(0, 2, "0WAIT_SEND_F0"));
        // WAIT_REDUCE_GRAD: after its REDUCE_GRAD, once.
        assert_eq!(check("0F0,0B0,0REDUCE_GRAD,0WAIT_REDUCE_GRAD\n").unwrap().counts.wait_reduce_grad, 1);
        let e = err("0F0,0B0,0WAIT_REDUCE_GRAD,0REDUCE_GRAD\n");
        assert_eq!(
            e,
            ValidationError::WaitBeforeStart {
                at: at(0, 2, "0WAIT_REDUCE_GRAD"),
                start: "0REDUCE_GRAD".parse().unwrap()
            }
        );
        let e = err("0F0,0B0,0REDUCE_GRAD,0WAIT_REDUCE_GRAD,0WAIT_REDUCE_GRAD\n");
        assert_eq!(e.kind(), ErrorKind::DuplicateReduceGrad);
        // A wait alone does not make REDUCE_GRAD required where the schedule has none.
        assert_eq!(err("0F0,0B0,0WAIT_REDUCE_GRAD\n").kind(), ErrorKind::WaitBeforeStart);
    }

    #[test]
    fn huge_stage_numbers_use_the_sparse_tables() {
        // S = 10^12 + 1: the dense tables would not fit; the error is the same as for small S.
        let e = err("0F0,1000000000000F0\n");
        assert_eq!(
            e,
            ValidationError::MissingCompute { kind: ComputeKind::B, task: Task::new(0, 0), rank: Some(0) }
        );
    }

    #[test]
    fn empty() {
        assert_eq!(err(",\n"), ValidationError::Empty);
        assert_eq!(err("0UNSHARD,0RESHARD\n"), ValidationError::Empty);
    }

    #[test]
    fn stage_on_many_ranks() {
        let e = err("0F0,0B0\n1F0,0F1,1B0\n");
        assert_eq!(e, ValidationError::StageOnManyRanks { stage: 0, first_rank: 0, at: at(1, 1, "0F1") });
        assert!(e.to_string().contains("rank 1 step 1 (`0F1`)"), "{e}");
        // The ranks' stages are gathered in parallel; the error is still the first in rank/step
        // order: not rank 2's, and not a later step of rank 1.
        let e = err("0F0,1F0,1B0,0B0\n2F0,1F1,0F1,2B0\n0F2,3F0\n");
        assert_eq!(e, ValidationError::StageOnManyRanks { stage: 1, first_rank: 0, at: at(1, 1, "1F1") });
    }

    #[test]
    fn microbatch_out_of_range_and_missing() {
        let s = sched("0F0,0F1,0B0,0B1\n");
        let e = validate(&s, &ValidateOptions::microbatches(1)).unwrap_err();
        assert_eq!(e, ValidationError::MicrobatchOutOfRange { mb: 1, expected: 1, at: at(0, 1, "0F1") });
        let e = validate(&s, &ValidateOptions::microbatches(3)).unwrap_err();
        assert_eq!(e, ValidationError::MissingMicrobatch { mb: 2, expected: 3 });
        assert_eq!(err("0F0,0F2,0B0,0B2\n"), ValidationError::MissingMicrobatch { mb: 1, expected: 3 });
    }

    #[test]
    fn missing_compute_of_each_kind() {
        let f = err("0F0,0B0\n1B0\n");
        assert_eq!(
            f,
            ValidationError::MissingCompute { kind: ComputeKind::F, task: Task::new(1, 0), rank: Some(1) }
        );
        let b = err("0F0\n1F0,1B0\n");
        assert_eq!(
            b,
            ValidationError::MissingCompute { kind: ComputeKind::B, task: Task::new(0, 0), rank: Some(0) }
        );
        assert!(b.to_string().contains("0B0 (or 0I0 with 0W0)"), "{b}");
        let w = err("0F0,0I0\n1F0,1B0\n");
        assert_eq!(
            w,
            ValidationError::MissingCompute { kind: ComputeKind::W, task: Task::new(0, 0), rank: Some(0) }
        );
    }

    #[test]
    fn duplicate_compute() {
        let e = err("0F0,0B0,0F0\n");
        assert_eq!(
            e,
            ValidationError::DuplicateCompute {
                kind: ComputeKind::F,
                task: Task::new(0, 0),
                at: at(0, 2, "0F0"),
                first: at(0, 0, "0F0"),
            }
        );
        // The B half of an OVERLAP_F_B counts as the task's B.
        let e = err("0F0,0F1,0B0,(0F2;0B1)OVERLAP_F_B,0B1,0B2\n");
        assert_eq!(e.kind(), ErrorKind::DuplicateCompute);
    }

    #[test]
    fn mixed_backward_and_w_without_i() {
        let e = err("0F0,0B0,0I0,0W0\n");
        assert_eq!(
            e,
            ValidationError::MixedBackward {
                task: Task::new(0, 0),
                at: at(0, 2, "0I0"),
                other: at(0, 1, "0B0")
            }
        );
        assert_eq!(
            err("0F0,0B0,0W0\n"),
            ValidationError::WWithoutI { task: Task::new(0, 0), at: at(0, 2, "0W0") }
        );
    }

    #[test]
    fn order_violations() {
        let e = err("0B0,0F0\n");
        assert_eq!(
            e,
            ValidationError::OrderViolation { at: at(0, 0, "0B0"), needs: "0F0".into(), needs_step: 1 }
        );
        let e = err("0F0,0W0,0I0\n");
        assert_eq!(
            e,
            ValidationError::OrderViolation { at: at(0, 1, "0W0"), needs: "0I0".into(), needs_step: 2 }
        );
        // F and B of one (stage, mb) inside one OVERLAP_F_B: B must come strictly after F.
        assert_eq!(err("(0F0;0B0)OVERLAP_F_B\n").kind(), ErrorKind::OrderViolation);
    }

    #[test]
    fn comm_errors() {
        // A SEND_F out of the last stage: there is no stage 2.
        let e = err(&LOWERED.replace("1B1,1SEND_B1", "1B1,1SEND_B1,1SEND_F1"));
        assert_eq!(
            e,
            ValidationError::CommOutOfRoute { at: at(1, 8, "1SEND_F1"), at_mb: 1, route: Some(0..2) }
        );
        // Two stages on one rank hand over locally.
        let e = err("0F0,0SEND_F0,1RECV_F0,1F0,1B0,0B0\n");
        assert_eq!(e, ValidationError::LocalComm { at: at(0, 1, "0SEND_F0"), from: 0, to: 1 });
        // A dropped RECV_F names its peer SEND.
        let e = err(&LOWERED.replace("1RECV_F1,", ""));
        assert_eq!(
            e,
            ValidationError::MissingComm {
                rank: 1,
                missing: "1RECV_F1".parse().unwrap(),
                peer: Some(at(0, 3, "0SEND_F1"))
            }
        );
        assert_eq!(e.to_string(), "rank 1 has no `1RECV_F1` (its peer is at rank 0 step 3 (`0SEND_F1`))");
        let e = err(&LOWERED.replace("0SEND_F0,", "0SEND_F0,0SEND_F0,"));
        assert_eq!(
            e,
            ValidationError::DuplicateComm { at: at(0, 2, "0SEND_F0"), first: at(0, 1, "0SEND_F0") }
        );
        let e = err(&LOWERED.replace("0B1\n", "0B1,3REDUCE_GRAD\n"));
        assert_eq!(e, ValidationError::UnknownStage { at: at(0, 8, "3REDUCE_GRAD"), stage: 3, stages: 2 });
    }

    #[test]
    fn early_recv_deadlocks_with_its_cycle() {
        // Rank 1 posts RECV_F1 before producing 1B0's gradient; rank 0 waits for that gradient
        // before it sends 0F1's output: the early RECV deadlocks (docs/ARCHITECTURE.md, "Lowering passes").
        let e = err("0F0,0SEND_F0,0RECV_B0,0B0,0F1,0SEND_F1,0RECV_B1,0B1\n\
                     1RECV_F0,1RECV_F1,1F0,1B0,1SEND_B0,1F1,1B1,1SEND_B1\n");
        let ValidationError::Deadlock { cycle } = &e else { panic!("{e:?}") };
        let pairs: Vec<(Loc, Loc)> = cycle.iter().map(|w| (w.at, w.on)).collect();
        assert_eq!(
            pairs,
            vec![(at(0, 2, "0RECV_B0"), at(1, 4, "1SEND_B0")), (at(1, 1, "1RECV_F1"), at(0, 5, "0SEND_F1"))]
        );
    }

    #[test]
    fn two_rank_deadlock_names_the_cycle() {
        // Rank 0 runs 0B0 (needs 1B0) before 0F1; rank 1 runs 1F1 (needs 0F1) before 1B0.
        let e = err("0F0,,,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n");
        let ValidationError::Deadlock { cycle } = &e else { panic!("{e:?}") };
        let pairs: Vec<(Loc, Loc)> = cycle.iter().map(|w| (w.at, w.on)).collect();
        assert_eq!(pairs, vec![(at(0, 3, "0B0"), at(1, 2, "1B0")), (at(1, 0, "1F1"), at(0, 4, "0F1"))]);
        assert_eq!(
            e.to_string(),
            "deadlock: rank 0 at step 3 (0B0) waits for 1B0 on rank 1; rank 1 at step 0 (1F1) waits for 0F1 on rank 0"
        );
    }

    #[test]
    fn recv_after_its_consumer_is_a_wait_inside_one_rank() {
        let e = err("0F0,0SEND_F0,0RECV_B0,0B0\n1F0,1RECV_F0,1B0,1SEND_B0\n");
        let ValidationError::Deadlock { cycle } = &e else { panic!("{e:?}") };
        assert_eq!(cycle, &vec![Wait { at: at(1, 0, "1F0"), on: at(1, 1, "1RECV_F0") }]);
        assert!(e.to_string().ends_with("rank 1 at step 0 (1F0) waits for 1RECV_F0 on rank 1"), "{e}");
    }

    #[test]
    fn sharding_errors() {
        let ok = "0UNSHARD,0F0,0B0,0RESHARD\n";
        assert_eq!(check(ok).unwrap().counts.unshard, 1);
        let e = err("0UNSHARD,0F0,0RESHARD,0B0\n");
        assert_eq!(e, ValidationError::ComputeWhileSharded { at: at(0, 3, "0B0"), stage: 0 });
        let e = err("0UNSHARD,0F0,0UNSHARD,0B0,0RESHARD\n");
        assert_eq!(e, ValidationError::RedundantShardOp { at: at(0, 2, "0UNSHARD") });
        assert!(e.to_string().ends_with("already unsharded"), "{e}");
        let e = err("0UNSHARD,0F0,0B0,0RESHARD,0RESHARD\n");
        assert_eq!(e, ValidationError::RedundantShardOp { at: at(0, 4, "0RESHARD") });
        assert_eq!(err("0UNSHARD,0F0,0B0\n"), ValidationError::UnshardedAtEnd { rank: 0, stage: 0 });
    }

    #[test]
    fn reduce_grad_errors() {
        assert_eq!(check("0F0,0I0,0W0,0REDUCE_GRAD\n").unwrap().counts.reduce_grad, 1);
        let e = err("0F0,0I0,0REDUCE_GRAD,0W0\n");
        assert_eq!(
            e,
            ValidationError::ReduceGradTooEarly { at: at(0, 2, "0REDUCE_GRAD"), last: at(0, 3, "0W0") }
        );
        let e = err("0F0,0B0,0REDUCE_GRAD,0REDUCE_GRAD\n");
        assert_eq!(
            e,
            ValidationError::DuplicateReduceGrad {
                at: at(0, 3, "0REDUCE_GRAD"),
                first: at(0, 2, "0REDUCE_GRAD")
            }
        );
        assert_eq!(err("0F0,0B0,0REDUCE_GRAD\n1F0,1B0\n"), ValidationError::MissingReduceGrad { stage: 1 });
    }
}
