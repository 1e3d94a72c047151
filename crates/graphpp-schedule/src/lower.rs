//! Lowering passes (docs/ARCHITECTURE.md, "Schedule IR" → "Lowering passes"). Each pass maps a schedule to a
//! schedule and keeps a valid schedule valid (see [`crate::validate`]).
//!
//! Idle steps: [`add_send_recv`], [`add_unshard_reshard`] and [`add_reduce_grad`] drop them (the
//! output is compacted: a lowered program is an order, not a timing); [`merge_bw`] and
//! [`split_bw`] keep them, so that `merge_bw(split_bw(s)) == s` cell for cell.

use std::collections::BTreeMap;
use std::ops::Range;

use rayon::prelude::*;

use crate::action::{Action, CommKind, ComputeKind, StageId, StageOpKind, Task};
use crate::schedule::{Schedule, Step};
use crate::validate::{
    compute_routes, stage_rank_table, validate, Loc, StageRanks, ValidateOptions, ValidationError,
};

/// Why a lowering pass refused a schedule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LowerError {
    /// The input schedule is not valid (from [`lower`]'s input check, or a stage on several ranks).
    #[error("cannot lower an invalid schedule: {0}")]
    Invalid(Box<ValidationError>),
    /// The input already holds actions this pass would add.
    #[error(
        "the schedule already has {at}, which lowering adds itself ({pass}); give a compute-only schedule"
    )]
    AlreadyHas {
        /// The pass (`add_send_recv`, `add_unshard_reshard`, `add_reduce_grad`).
        pass: &'static str,
        /// The first such action.
        at: Loc,
    },
    /// `max_unsharded` is below the number of stages one action computes on.
    #[error(
        "{at} computes on {needed} stages at once, but at most {max} may be unsharded per rank \
         (--fsdp-max-unsharded)"
    )]
    TooFewUnsharded {
        /// The given limit.
        max: usize,
        /// Stages the action touches.
        needed: usize,
        /// The action.
        at: Loc,
    },
}

impl From<ValidationError> for LowerError {
    fn from(e: ValidationError) -> Self {
        LowerError::Invalid(Box::new(e))
    }
}

/// Options of [`lower`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LowerOptions {
    /// `Some(n)`: add the FSDP actions ([`add_unshard_reshard`] with at most `n` stages unsharded
    /// per rank, then [`add_reduce_grad`]); `None`: SEND/RECV only.
    pub fsdp_max_unsharded: Option<usize>,
    /// Add [`add_reduce_grad`] without UNSHARD/RESHARD (data parallelism without FSDP: each
    /// stage's gradient all-reduce starts right after its last backward); implied by
    /// `fsdp_max_unsharded`.
    pub reduce_grad: bool,
}

impl LowerOptions {
    /// How a run with `dp` data-parallel replicas (FSDP when `fsdp` and dp > 1) and
    /// `stages_per_rank` stages a rank is lowered: REDUCE_GRAD with dp > 1; under FSDP UNSHARD /
    /// RESHARD too, every stage of a rank unsharded at once at most.
    pub fn data_parallel(dp: usize, fsdp: bool, stages_per_rank: usize) -> LowerOptions {
        let replicas = dp > 1;
        LowerOptions {
            fsdp_max_unsharded: (replicas && fsdp).then_some(stages_per_rank.max(1)),
            reduce_grad: replicas,
        }
    }
}

/// The standard lowering pipeline: validate the input, then (when asked) [`add_unshard_reshard`]
/// and [`add_reduce_grad`], then [`add_send_recv`] (the order of PyTorch's lowering, so an UNSHARD
/// is issued before the RECV the compute waits on).
///
/// # Errors
/// [`LowerError::Invalid`] for an invalid input; the passes' errors otherwise.
pub fn lower(s: &Schedule, opts: &LowerOptions) -> Result<Schedule, LowerError> {
    // The input is validated while the passes run (rayon's current pool): the passes take any
    // input without panicking (refusing comm they add themselves), and their output is dropped
    // if the input is invalid. The passes find the stage → rank table and the routes again (the
    // validator finds them too, on the other worker), and the validator's tables and the output
    // are both held meanwhile.
    let (checked, lowered) = rayon::join(
        || validate(s, &ValidateOptions::default()).map(drop).map_err(Box::new),
        || match opts.fsdp_max_unsharded {
            Some(n) => add_send_recv(&add_reduce_grad(&add_unshard_reshard(s, n)?)?),
            None if opts.reduce_grad => add_send_recv(&add_reduce_grad(s)?),
            None => add_send_recv(s),
        },
    );
    checked.map_err(LowerError::Invalid)?;
    lowered
}

/// [`add_send_recv`]'s refusal of an input that holds SEND/RECV.
fn refuse_comm(s: &Schedule) -> Result<(), LowerError> {
    refuse_if(s, "add_send_recv", |a| matches!(a, Action::Comm { .. }))
}

/// The first action matching `pred`, as an [`LowerError::AlreadyHas`] of `pass`.
fn refuse_if(s: &Schedule, pass: &'static str, pred: impl Fn(&Action) -> bool) -> Result<(), LowerError> {
    for (rank, row) in s.ranks.iter().enumerate() {
        for (step, cell) in row.iter().enumerate() {
            if let Some(action) = cell.filter(|a| pred(a)) {
                return Err(LowerError::AlreadyHas { pass, at: Loc { rank, step, action } });
            }
        }
    }
    Ok(())
}

/// Where a microbatch's tensors cross ranks: stage → rank and the routes.
struct Wiring {
    rank_of: StageRanks,
    routes: Vec<Option<Range<StageId>>>,
}

impl Wiring {
    /// True when (stage `from`, `from + 1`) is a boundary of `mb`'s route and crosses ranks.
    fn crosses(&self, from: StageId, mb: usize) -> bool {
        let in_route =
            self.routes.get(mb).cloned().flatten().is_some_and(|r| r.start <= from && from + 1 < r.end);
        in_route && self.rank_of.of_stage(from) != self.rank_of.of_stage(from + 1)
    }

    /// RECVs that must run right before compute `(kind, t)`.
    fn recvs(&self, kind: ComputeKind, t: Task) -> Option<Action> {
        match kind {
            ComputeKind::F if t.stage > 0 && self.crosses(t.stage - 1, t.mb) => {
                Some(Action::comm(CommKind::RecvF, t.stage, t.mb))
            }
            ComputeKind::B | ComputeKind::I if self.crosses(t.stage, t.mb) => {
                Some(Action::comm(CommKind::RecvB, t.stage, t.mb))
            }
            _ => None,
        }
    }

    /// SENDs that must run right after compute `(kind, t)`.
    fn sends(&self, kind: ComputeKind, t: Task) -> Option<Action> {
        match kind {
            ComputeKind::F if self.crosses(t.stage, t.mb) => {
                Some(Action::comm(CommKind::SendF, t.stage, t.mb))
            }
            ComputeKind::B | ComputeKind::I if t.stage > 0 && self.crosses(t.stage - 1, t.mb) => {
                Some(Action::comm(CommKind::SendB, t.stage, t.mb))
            }
            _ => None,
        }
    }
}

/// Adds SEND/RECV for every cross-rank hand-over (docs/ARCHITECTURE.md, "Lowering passes").
///
/// A SEND goes right after the action that produces the tensor (F → SEND_F, B/I → SEND_B) when
/// the peer stage is on another rank; the matching RECV goes on the peer's rank right before the
/// action that consumes it, so a blocking RECV never holds up unrelated compute (early RECVs
/// deadlocked real Interleaved1F1B runs). Adjacent stages on one rank hand over locally, with no
/// comm. For OVERLAP_F_B the RECVs of both halves (F's, then B's) go before it and the SENDs of
/// both halves after it. Every RECV's dependencies are ones its consumer already had, so a
/// deadlock-free schedule stays deadlock-free. Idle steps are dropped; UNSHARD/RESHARD/REDUCE_GRAD
/// pass through.
///
/// # Errors
/// [`LowerError::AlreadyHas`] if the input holds SEND/RECV; [`LowerError::Invalid`] if a stage is
/// on several ranks.
pub fn add_send_recv(s: &Schedule) -> Result<Schedule, LowerError> {
    refuse_comm(s)?;
    let wiring = Wiring { rank_of: stage_rank_table(s)?, routes: compute_routes(s) };
    Ok(send_recv_with(s, &wiring))
}

/// [`add_send_recv`]'s output given the input's wiring (the input holds no SEND/RECV); the ranks'
/// programs are built in parallel (rayon's current pool).
fn send_recv_with(s: &Schedule, wiring: &Wiring) -> Schedule {
    let ranks = s
        .ranks
        .par_iter()
        .map(|row| {
            let mut out: Vec<Step> = Vec::with_capacity(3 * row.len());
            for &a in row.iter().flatten() {
                out.extend(a.computes().filter_map(|(k, t)| wiring.recvs(k, t)).map(Some));
                out.push(Some(a));
                out.extend(a.computes().filter_map(|(k, t)| wiring.sends(k, t)).map(Some));
            }
            out
        })
        .collect();
    Schedule { ranks }
}

/// The next `count` distinct stages that compute actions of `rest` touch, in order of first use;
/// all stages of `rest[0]` are always included even when they exceed `count`.
/// `all` is the number of distinct stages the rank holds (the scan stops once it has them all).
fn upcoming_stages(rest: &[Action], count: usize, all: usize) -> Vec<StageId> {
    let mut out: Vec<StageId> = Vec::new();
    for (i, a) in rest.iter().filter(|a| a.is_compute()).enumerate() {
        if i > 0 && (out.len() >= count || out.len() == all) {
            break;
        }
        for st in a.stages() {
            if !out.contains(&st) && (i == 0 || out.len() < count) {
                out.push(st);
            }
        }
    }
    out
}

/// Adds UNSHARD/RESHARD per rank, keeping at most `max_unsharded` stages unsharded.
///
/// The policy is PyTorch's `_add_unshard_reshard` (`torch.distributed.pipelining.schedules`):
/// before each compute action, the window is the next `max_unsharded` distinct stages that this
/// rank's compute actions touch from here on (prefetch); stages unsharded but outside the window
/// get RESHARD (in the order they were unsharded), window stages not yet unsharded get UNSHARD (in
/// order of use). Every stage still unsharded at the end gets RESHARD. SEND/RECV pass through and
/// are not counted as uses. Idle steps are dropped.
///
/// # Errors
/// [`LowerError::AlreadyHas`] if the input holds UNSHARD/RESHARD; [`LowerError::TooFewUnsharded`]
/// if one action computes on more stages than `max_unsharded` (0, or 1 with OVERLAP_F_B of two
/// stages).
pub fn add_unshard_reshard(s: &Schedule, max_unsharded: usize) -> Result<Schedule, LowerError> {
    refuse_if(s, "add_unshard_reshard", |a| {
        matches!(a, Action::StageOp { kind: StageOpKind::Unshard | StageOpKind::Reshard, .. })
    })?;
    let mut programs = Vec::with_capacity(s.num_ranks());
    for (rank, row) in s.ranks.iter().enumerate() {
        let cells: Vec<(usize, Action)> =
            row.iter().enumerate().filter_map(|(i, c)| c.map(|a| (i, a))).collect();
        let actions: Vec<Action> = cells.iter().map(|c| c.1).collect();
        let all = actions.iter().flat_map(|a| a.stages()).collect::<std::collections::BTreeSet<_>>().len();
        let mut unsharded: Vec<StageId> = Vec::new();
        let mut out = Vec::new();
        for (k, &(step, a)) in cells.iter().enumerate() {
            if a.is_compute() {
                let needed = a.stages().collect::<std::collections::BTreeSet<_>>().len();
                if needed > max_unsharded {
                    let at = Loc { rank, step, action: a };
                    return Err(LowerError::TooFewUnsharded { max: max_unsharded, needed, at });
                }
                let window = upcoming_stages(&actions[k..], max_unsharded, all);
                for st in unsharded.iter().filter(|st| !window.contains(st)) {
                    out.push(Action::stage_op(StageOpKind::Reshard, *st));
                }
                unsharded.retain(|st| window.contains(st));
                let fetch: Vec<StageId> = window.into_iter().filter(|st| !unsharded.contains(st)).collect();
                out.extend(fetch.iter().map(|&st| Action::stage_op(StageOpKind::Unshard, st)));
                unsharded.extend(fetch);
            }
            out.push(a);
        }
        out.extend(unsharded.into_iter().map(|st| Action::stage_op(StageOpKind::Reshard, st)));
        programs.push(out);
    }
    Ok(Schedule::from_programs(programs))
}

/// Adds one REDUCE_GRAD per stage right after the stage's last backward-like action (B, I, W, or
/// the B half of OVERLAP_F_B) on its rank (docs/ARCHITECTURE.md, "Lowering passes"). Idle steps are dropped.
///
/// # Errors
/// [`LowerError::AlreadyHas`] if the input holds REDUCE_GRAD.
pub fn add_reduce_grad(s: &Schedule) -> Result<Schedule, LowerError> {
    refuse_if(s, "add_reduce_grad", |a| matches!(a, Action::StageOp { kind: StageOpKind::ReduceGrad, .. }))?;
    let programs = (0..s.num_ranks())
        .map(|r| {
            let prog = s.program(r);
            // Index of each stage's last backward-like action on this rank.
            let mut last: BTreeMap<StageId, usize> = BTreeMap::new();
            for (i, a) in prog.iter().enumerate() {
                for (_, t) in a.computes().filter(|(k, _)| *k != ComputeKind::F) {
                    last.insert(t.stage, i);
                }
            }
            let mut out = Vec::with_capacity(prog.len() + last.len());
            for (i, a) in prog.into_iter().enumerate() {
                out.push(a);
                out.extend(
                    last.iter()
                        .filter(|(_, &l)| l == i)
                        .map(|(&st, _)| Action::stage_op(StageOpKind::ReduceGrad, st)),
                );
            }
            out
        })
        .collect();
    Ok(Schedule::from_programs(programs))
}

/// The index of the next non-idle step after `k`.
fn next_action(row: &[Step], k: usize) -> Option<usize> {
    (k + 1..row.len()).find(|&i| row[i].is_some())
}

/// Merges each I(s, j) whose next non-idle step is W(s, j) into one B(s, j) in the I's cell;
/// the W's cell is removed (idle steps between them stay). The inverse of [`split_bw`].
///
/// # Errors
/// None today; `Result` keeps the pass signature uniform.
pub fn merge_bw(s: &Schedule) -> Result<Schedule, LowerError> {
    let ranks = s
        .ranks
        .par_iter()
        .map(|row| {
            let mut out = Vec::with_capacity(row.len());
            let mut skip = None;
            for (k, cell) in row.iter().enumerate() {
                if skip == Some(k) {
                    continue;
                }
                if let Some(Action::Compute { kind: ComputeKind::I, task }) = *cell {
                    let n = next_action(row, k).filter(|&n| row[n] == Some(Action::w(task.stage, task.mb)));
                    if n.is_some() {
                        out.push(Some(Action::b(task.stage, task.mb)));
                        skip = n;
                        continue;
                    }
                }
                out.push(*cell);
            }
            out
        })
        .collect();
    Ok(Schedule { ranks })
}

/// Splits each full B(s, j) into I(s, j) in the B's cell and W(s, j) in a new cell right after it
/// (zero-bubble's split backward, with W not yet moved). The B half of an OVERLAP_F_B stays.
///
/// # Errors
/// None today; `Result` keeps the pass signature uniform.
pub fn split_bw(s: &Schedule) -> Result<Schedule, LowerError> {
    let ranks = s
        .ranks
        .par_iter()
        .map(|row| {
            let mut out = Vec::with_capacity(row.len());
            for cell in row {
                match *cell {
                    Some(Action::Compute { kind: ComputeKind::B, task }) => {
                        out.push(Some(Action::i(task.stage, task.mb)));
                        out.push(Some(Action::w(task.stage, task.mb)));
                    }
                    other => out.push(other),
                }
            }
            out
        })
        .collect();
    Ok(Schedule { ranks })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedule::RankId;

    fn sched(csv: &str) -> Schedule {
        Schedule::from_csv(csv).unwrap()
    }

    fn row(s: &Schedule, r: RankId) -> String {
        s.program(r).iter().map(ToString::to_string).collect::<Vec<_>>().join(" ")
    }

    fn valid(s: &Schedule) -> crate::validate::Summary {
        crate::validate::validate(s, &ValidateOptions::default()).unwrap()
    }

    #[test]
    fn send_recv_for_two_rank_1f1b() {
        // Idle steps are dropped; RECVs sit right before their consumer, SENDs right after the producer.
        let low = add_send_recv(&sched("0F0,0F1,,0B0,,0B1\n,1F0,1B0,1F1,1B1,\n")).unwrap();
        assert_eq!(row(&low, 0), "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1");
        assert_eq!(row(&low, 1), "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1");
        valid(&low);
    }

    #[test]
    fn local_hand_over_on_v_placement_has_no_comm() {
        // p = 2, V placement: stages 1 and 2 both live on rank 1.
        let s = sched("0F0,3F0,3B0,0B0\n1F0,2F0,2B0,1B0\n");
        let low = add_send_recv(&s).unwrap();
        assert_eq!(row(&low, 1), "1RECV_F0 1F0 2F0 2SEND_F0 2RECV_B0 2B0 1B0 1SEND_B0");
        assert_eq!(row(&low, 0), "0F0 0SEND_F0 3RECV_F0 3F0 3B0 3SEND_B0 0RECV_B0 0B0");
        assert_eq!(valid(&low).counts.send, 4);
    }

    #[test]
    fn overlap_gets_both_recvs_before_and_both_sends_after() {
        // p = 2, loop placement, v = 2: rank 0 holds stages 0 and 2, rank 1 holds 1 and 3.
        let s = sched(
            "0F0,0F1,2F0,(2F1;2B0)OVERLAP_F_B,2B1,0B0,0B1\n\
             1F0,1F1,3F0,3B0,3F1,3B1,1B0,1B1\n",
        );
        valid(&s);
        let low = add_send_recv(&s).unwrap();
        assert!(
            row(&low, 0)
                .contains("2SEND_F0 2RECV_F1 2RECV_B0 (2F1;2B0)OVERLAP_F_B 2SEND_F1 2SEND_B0 2RECV_B1 2B1"),
            "{}",
            row(&low, 0)
        );
        valid(&low);
    }

    #[test]
    fn send_recv_refuses_lowered_input() {
        let e = add_send_recv(&sched("0F0,0SEND_F0\n")).unwrap_err();
        assert!(matches!(e, LowerError::AlreadyHas { pass: "add_send_recv", at } if at.step == 1), "{e:?}");
        let e = add_send_recv(&sched("0F0\n0B0\n")).unwrap_err();
        assert!(
            matches!(e, LowerError::Invalid(ref v) if matches!(**v, ValidationError::StageOnManyRanks { .. }))
        );
    }

    #[test]
    fn unshard_reshard_windows() {
        // One rank holding stages 0 and 1 (PyTorch's window policy, worked by hand).
        let s = sched("0F0,1F0,1B0,0B0\n");
        let one = add_unshard_reshard(&s, 1).unwrap();
        assert_eq!(row(&one, 0), "0UNSHARD 0F0 0RESHARD 1UNSHARD 1F0 1B0 1RESHARD 0UNSHARD 0B0 0RESHARD");
        let two = add_unshard_reshard(&s, 2).unwrap();
        assert_eq!(row(&two, 0), "0UNSHARD 1UNSHARD 0F0 1F0 1B0 1RESHARD 0B0 0RESHARD");
        valid(&one);
        valid(&two);
        let e = add_unshard_reshard(&s, 0).unwrap_err();
        assert!(matches!(e, LowerError::TooFewUnsharded { max: 0, needed: 1, .. }), "{e:?}");
        let o = sched("0F0,1F0,0F1,(0F2;1B0)OVERLAP_F_B\n");
        let e = add_unshard_reshard(&o, 1).unwrap_err();
        assert!(matches!(e, LowerError::TooFewUnsharded { max: 1, needed: 2, at } if at.step == 3), "{e:?}");
    }

    #[test]
    fn reduce_grad_after_last_backward_like() {
        let s = sched("0F0,0F1,0I0,0I1,0W0,0W1\n1F0,1I0,1F1,1I1,1W1,1W0\n");
        let low = add_reduce_grad(&s).unwrap();
        assert_eq!(row(&low, 0), "0F0 0F1 0I0 0I1 0W0 0W1 0REDUCE_GRAD");
        assert_eq!(row(&low, 1), "1F0 1I0 1F1 1I1 1W1 1W0 1REDUCE_GRAD");
        let v = sched("0F0,1F0,1B0,0B0,0F1,1F1,1B1\n");
        assert_eq!(
            row(&add_reduce_grad(&v).unwrap(), 0),
            "0F0 1F0 1B0 0B0 0REDUCE_GRAD 0F1 1F1 1B1 1REDUCE_GRAD"
        );
        let e = add_reduce_grad(&low).unwrap_err();
        assert!(matches!(e, LowerError::AlreadyHas { pass: "add_reduce_grad", .. }), "{e:?}");
    }

    #[test]
    fn merge_and_split() {
        let zb = sched("0F0,0I0,,0W0,0F1,0I1,0F2,0W1\n");
        // I0 and W0 are adjacent across an idle step; I1 is followed by F2, so it stays.
        assert_eq!(merge_bw(&zb).unwrap(), sched("0F0,0B0,,0F1,0I1,0F2,0W1\n"));
        let b = sched("0F0,,0B0,(0F1;0B0)OVERLAP_F_B\n");
        assert_eq!(split_bw(&b).unwrap(), sched("0F0,,0I0,0W0,(0F1;0B0)OVERLAP_F_B\n"));
    }

    #[test]
    fn lower_pipeline_with_fsdp() {
        let s = sched("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n");
        let low = lower(&s, &LowerOptions { fsdp_max_unsharded: Some(1), ..Default::default() }).unwrap();
        assert_eq!(
            row(&low, 1),
            // SEND_B1 goes right after its producer 1B1, ahead of the REDUCE_GRAD added before it.
            "1UNSHARD 1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1REDUCE_GRAD 1RESHARD"
        );
        let sum = valid(&low);
        assert_eq!((sum.counts.unshard, sum.counts.reshard, sum.counts.reduce_grad), (2, 2, 2));
        let bad = sched("0B0,0F0\n");
        assert!(matches!(lower(&bad, &LowerOptions::default()), Err(LowerError::Invalid(_))));
    }

    #[test]
    fn lower_pipeline_with_reduce_grad_only() {
        let s = sched("0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n");
        let low = lower(&s, &LowerOptions { reduce_grad: true, ..Default::default() }).unwrap();
        assert_eq!(row(&low, 1), "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1REDUCE_GRAD");
        assert_eq!(row(&low, 0), "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1 0REDUCE_GRAD");
        let sum = valid(&low);
        assert_eq!((sum.counts.unshard, sum.counts.reshard, sum.counts.reduce_grad), (0, 0, 2));
    }
}
