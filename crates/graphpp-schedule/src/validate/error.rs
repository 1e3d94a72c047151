//! The validator's error: where an action sits ([`Loc`]), one edge of a waiting cycle
//! ([`Wait`]) and [`ValidationError`], one variant per rule of [`super`]'s checks.

use std::fmt;
use std::ops::Range;

use crate::action::{Action, ComputeKind, StageId, StageOpKind, Task};
use crate::deps::MissingDep;
use crate::schedule::RankId;

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

/// Why a schedule is invalid.
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
    /// An action names a microbatch at least as large as the schedule's count of actions: a
    /// valid schedule names every microbatch `0..m`, each in an action of its own, so `m` is at
    /// most that count — some microbatch below this one is missing. Checked before any table
    /// indexed by microbatch is built, so that a short file naming microbatch 4294967295 is
    /// refused at once instead of sizing tables by it.
    #[error(
        "{at}: microbatch {mb} is beyond the schedule's {actions} actions (a schedule names every \
         microbatch from 0 up, one action at least each, so one below {mb} is missing)"
    )]
    MicrobatchBeyondActions {
        /// The microbatch named.
        mb: usize,
        /// Actions in the schedule.
        actions: usize,
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
