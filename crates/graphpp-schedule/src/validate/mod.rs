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
//!
//! The errors are in [`error`], the survey and summary of a schedule in [`survey`].

// The errors are cold and some variants carry two `Loc`s so that the message can name both
// actions; boxing them would only make matching on variants clumsier.
#![allow(clippy::result_large_err)]

use std::collections::{BTreeSet, HashSet};
use std::ops::Range;

use rayon::prelude::*;

use crate::action::{Action, CommKind, ComputeKind, StageId, StageOpKind, Task};
use crate::deps::{DepGraph, Index, Pos, RunOrder, Walk};
use crate::placement::Placement;
use crate::route::widen_route;
use crate::schedule::{RankId, Schedule};
use crate::table::TaskMap;

mod error;
mod survey;
#[cfg(test)]
mod tests;

pub use error::{Loc, ValidationError, Wait};
use survey::Survey;
pub use survey::{ActionCounts, Summary};

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

/// Routes from compute actions only (see [`Schedule::route`]); index = microbatch.
pub fn compute_routes(s: &Schedule) -> Vec<Option<Range<StageId>>> {
    let mut routes = Vec::new();
    for (_, task) in s.actions().flat_map(|(_, a)| a.computes()) {
        widen_route(&mut routes, task);
    }
    routes
}

fn mbs_of(a: &Action) -> impl Iterator<Item = usize> {
    crate::route::tasks_of(a).map(|t| t.mb)
}

/// Every microbatch an action names is below the count of actions
/// ([`ValidationError::MicrobatchBeyondActions`]): what bounds the per-microbatch tables the
/// other checks build (stages have sparse tables of their own).
pub(crate) fn check_microbatch_numbers(s: &Schedule) -> Result<(), ValidationError> {
    let actions = s.actions().count();
    for at in cells(s) {
        if let Some(mb) = mbs_of(&at.action).find(|&mb| mb >= actions) {
            return Err(ValidationError::MicrobatchBeyondActions { mb, actions, at });
        }
    }
    Ok(())
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
/// m = 1024).
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
    check_microbatch_numbers(s)?;
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
