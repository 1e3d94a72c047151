//! The schedule executor: [`run_rank`] runs **one rank's** lowered program over a [`Comm`],
//! calling a [`StageWork`] for the compute (docs/ARCHITECTURE.md, "Runtime"); [`run_pipeline`] is
//! the in-process harness that runs every rank of a schedule as a thread over [`ThreadComm`].
//!
//! SEND_F / SEND_B are [`Comm::send`] (never blocks), RECV_F / RECV_B are [`Comm::recv`] with the
//! receive timeout. Per (stage, microbatch) a rank keeps the received input, the received output
//! gradient, the output waiting for its SEND_F and the input gradient waiting for its SEND_B; each
//! is dropped as soon as its consumer ran. Adjacent stages on one rank hand over locally (no
//! SEND/RECV in the lowered schedule). A rank whose action fails or panics calls [`Comm::abort`],
//! so every other rank's pending and later RECV fails at once with [`CommError::Aborted`], which
//! [`run_rank`] reports as [`PipelineError::Aborted`] naming the failed rank.
//!
//! # Ranks
//!
//! A schedule numbers its ranks `0..p` (the *schedule rank*); the communicator numbers the ranks
//! of the whole run (the *world rank*). The `pipeline` [`Group`] given to [`run_rank`] lists the
//! world ranks of this rank's pipeline in schedule-rank order (e.g. [`Mesh::pipeline_group`]), so
//! the same schedule runs in every data-parallel replica. Errors name world ranks; the intervals
//! of the timeline name schedule ranks.

pub mod data_parallel;
pub mod stage;

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use candle_core::Tensor;
use graphpp_schedule::{
    Action, CommKind, CommSpan, ComputeKind, Interval, Schedule, StageOpKind, Task, Timeline,
};

use crate::exec::CollectiveSpan;
use graphpp_comm::mesh::Mesh;
use graphpp_comm::{Comm, CommError, Group, Tag, ThreadComm};

/// The error type stage computations return.
pub type WorkError = Box<dyn std::error::Error + Send + Sync>;

/// The compute of the stages one rank holds. Activations and gradients travel between stages as
/// candle [`Tensor`]s.
///
/// Inputs are `None` where the route has no neighbour: a route's first stage gets no input
/// activation (it reads its own microbatch), its last stage gets no output gradient (it seeds
/// d loss = 1 itself), and returns no output activation / no input gradient respectively.
pub trait StageWork: Send {
    /// F(stage, mb): returns the activation for the next stage (`None` on the route's last stage).
    fn forward(
        &mut self,
        stage: usize,
        mb: usize,
        input: Option<Tensor>,
    ) -> Result<Option<Tensor>, WorkError>;
    /// B(stage, mb): full backward; accumulates weight gradients and returns the input gradient
    /// (`None` on the route's first stage).
    fn backward(
        &mut self,
        stage: usize,
        mb: usize,
        grad: Option<Tensor>,
    ) -> Result<Option<Tensor>, WorkError>;
    /// I(stage, mb): input-gradient backward; keeps what W needs.
    fn backward_input(
        &mut self,
        stage: usize,
        mb: usize,
        grad: Option<Tensor>,
    ) -> Result<Option<Tensor>, WorkError>;
    /// W(stage, mb): weight-gradient backward from what I kept.
    fn backward_weight(&mut self, stage: usize, mb: usize) -> Result<(), WorkError>;
    /// OVERLAP_F_B: F of `f` and B of `b` as one multiplexed computation; by default F then B.
    #[allow(clippy::type_complexity)]
    fn overlap(
        &mut self,
        f: Task,
        input: Option<Tensor>,
        b: Task,
        grad: Option<Tensor>,
    ) -> Result<(Option<Tensor>, Option<Tensor>), WorkError> {
        let out = self.forward(f.stage, f.mb, input)?;
        let gin = self.backward(b.stage, b.mb, grad)?;
        Ok((out, gin))
    }
    /// UNSHARD / RESHARD / REDUCE_GRAD of a stage; by default nothing (no FSDP).
    fn stage_op(&mut self, _kind: StageOpKind, _stage: usize) -> Result<(), WorkError> {
        Ok(())
    }
    /// The in-graph collectives the actions since the last call started, each with its trace
    /// label ([`CollectiveSpan::label`]); by default none.
    fn take_collectives(&mut self) -> Vec<(String, CollectiveSpan)> {
        Vec::new()
    }
}

/// A failed rank: which world rank, at which step of its program, and why.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// A compute action (or a stage op) failed on a rank.
    #[error("rank {rank} failed at action {step} of its schedule ({action}): {message}")]
    Action {
        /// The world rank.
        rank: usize,
        /// Index into the rank's program.
        step: usize,
        /// The action text.
        action: String,
        /// The cause.
        message: String,
    },
    /// An action panicked on a rank.
    #[error("rank {rank} panicked at action {step} of its schedule ({action}): {message}")]
    Panic {
        /// The world rank.
        rank: usize,
        /// Index into the rank's program.
        step: usize,
        /// The action text.
        action: String,
        /// The panic message.
        message: String,
    },
    /// A SEND or RECV failed on the communicator (a receive timeout, a bad peer).
    #[error("rank {rank} failed at action {step} of its schedule ({action}): {source}")]
    Comm {
        /// The world rank.
        rank: usize,
        /// Index into the rank's program.
        step: usize,
        /// The action text.
        action: String,
        /// The communicator's error (boxed: it is large).
        source: Box<CommError>,
    },
    /// This rank stopped because another rank failed and aborted the communicator.
    #[error("rank {rank} stopped at action {step} of its schedule ({action}) because rank {failed_rank} failed: {reason}")]
    Aborted {
        /// The world rank that stopped.
        rank: usize,
        /// Index into its program.
        step: usize,
        /// The action it was running.
        action: String,
        /// The world rank that failed first.
        failed_rank: usize,
        /// That rank's error.
        reason: String,
    },
    /// The schedule, the pipeline group, the communicator and the workers disagree (e.g. ranks ≠
    /// workers, a stage on two ranks, a rank outside its pipeline group).
    #[error("bad pipeline setup: {0}")]
    Setup(String),
}

impl PipelineError {
    /// Whether this rank only stopped because another rank failed.
    pub fn is_aborted(&self) -> bool {
        matches!(self, PipelineError::Aborted { .. })
    }

    /// The world rank that reports the error (none for a setup error).
    pub fn rank(&self) -> Option<usize> {
        match self {
            PipelineError::Action { rank, .. }
            | PipelineError::Panic { rank, .. }
            | PipelineError::Comm { rank, .. }
            | PipelineError::Aborted { rank, .. } => Some(*rank),
            PipelineError::Setup(_) => None,
        }
    }
}

/// What [`run_rank`] returns: the worker back (with its accumulated gradients, losses, …) and the
/// rank's measured intervals (seconds since [`RankOptions::start`], `rank` = schedule rank).
#[derive(Debug)]
pub struct RankOutcome<W> {
    /// The rank's worker.
    pub work: W,
    /// One interval per action of its program, in program order.
    pub intervals: Vec<Interval>,
    /// The in-graph collectives its actions ran ([`StageWork::take_collectives`]), same clock.
    pub comm: Vec<CommSpan>,
}

/// How [`run_rank`] runs.
#[derive(Clone, Copy, Debug)]
pub struct RankOptions {
    /// Bound on every RECV.
    pub timeout: Duration,
    /// Time origin of the reported intervals (the same instant on every rank of a thread run).
    pub start: Instant,
}

impl RankOptions {
    /// Receive timeout `timeout`; intervals measured from now.
    pub fn new(timeout: Duration) -> RankOptions {
        RankOptions { timeout, start: Instant::now() }
    }
}

/// Why one action failed, before it is given its rank and step.
enum StepError {
    Work(WorkError),
    Comm(CommError),
}

impl From<WorkError> for StepError {
    fn from(e: WorkError) -> Self {
        StepError::Work(e)
    }
}

impl From<CommError> for StepError {
    fn from(e: CommError) -> Self {
        StepError::Comm(e)
    }
}

impl From<String> for StepError {
    fn from(e: String) -> Self {
        StepError::Work(e.into())
    }
}

/// Where stages live and which stages each microbatch visits.
#[derive(Debug, Clone)]
struct Layout {
    rank_of: BTreeMap<usize, usize>,
    routes: Vec<Option<Range<usize>>>,
}

impl Layout {
    fn new(s: &Schedule) -> Result<Self, PipelineError> {
        let mut rank_of = BTreeMap::new();
        for (stage, ranks) in s.placement() {
            if ranks.len() != 1 {
                return Err(PipelineError::Setup(format!("stage {stage} is on ranks {ranks:?}")));
            }
            rank_of.insert(stage, ranks[0]);
        }
        Ok(Layout { rank_of, routes: s.routes() })
    }
    fn route(&self, mb: usize) -> Range<usize> {
        self.routes.get(mb).cloned().flatten().unwrap_or(0..0)
    }
    fn rank(&self, stage: usize) -> usize {
        self.rank_of.get(&stage).copied().unwrap_or(usize::MAX)
    }
}

/// Per-rank buffers, keyed by (stage, mb).
#[derive(Default)]
struct Buffers {
    input: HashMap<Task, Tensor>,
    grad: HashMap<Task, Tensor>,
    to_send_f: HashMap<Task, Tensor>,
    to_send_b: HashMap<Task, Tensor>,
}

struct RankRunner<'a, W: StageWork> {
    /// Schedule rank.
    rank: usize,
    work: W,
    comm: &'a dyn Comm,
    /// World ranks of the pipeline, by schedule rank.
    pipeline: &'a Group,
    layout: &'a Layout,
    timeout: Duration,
    buf: Buffers,
}

impl<W: StageWork> RankRunner<'_, W> {
    fn take_input(&mut self, t: Task) -> Result<Option<Tensor>, StepError> {
        if t.stage == self.layout.route(t.mb).start {
            return Ok(None);
        }
        let x = self.buf.input.remove(&t);
        Ok(Some(x.ok_or_else(|| format!("no input activation for {}F{}", t.stage, t.mb))?))
    }

    fn take_grad(&mut self, t: Task) -> Result<Option<Tensor>, StepError> {
        if t.stage + 1 == self.layout.route(t.mb).end {
            return Ok(None);
        }
        let g = self.buf.grad.remove(&t);
        Ok(Some(g.ok_or_else(|| format!("no output gradient for stage {} mb {}", t.stage, t.mb))?))
    }

    fn put_output(&mut self, t: Task, out: Option<Tensor>) {
        if t.stage + 1 >= self.layout.route(t.mb).end {
            return;
        }
        if let Some(out) = out {
            let next = Task::new(t.stage + 1, t.mb);
            if self.layout.rank(next.stage) == self.rank {
                self.buf.input.insert(next, out);
            } else {
                self.buf.to_send_f.insert(t, out);
            }
        }
    }

    fn put_input_grad(&mut self, t: Task, gin: Option<Tensor>) {
        if let (Some(g), true) = (gin, t.stage > self.layout.route(t.mb).start) {
            let prev = Task::new(t.stage - 1, t.mb);
            if self.layout.rank(prev.stage) == self.rank {
                self.buf.grad.insert(prev, g);
            } else {
                self.buf.to_send_b.insert(t, g);
            }
        }
    }

    fn run_action(&mut self, a: &Action) -> Result<(), StepError> {
        match *a {
            Action::Compute { kind: ComputeKind::F, task } => {
                let input = self.take_input(task)?;
                let out = self.work.forward(task.stage, task.mb, input)?;
                self.put_output(task, out);
            }
            Action::Compute { kind: kind @ (ComputeKind::B | ComputeKind::I), task } => {
                let grad = self.take_grad(task)?;
                let gin = if kind == ComputeKind::B {
                    self.work.backward(task.stage, task.mb, grad)?
                } else {
                    self.work.backward_input(task.stage, task.mb, grad)?
                };
                self.put_input_grad(task, gin);
            }
            Action::Compute { kind: ComputeKind::W, task } => {
                self.work.backward_weight(task.stage, task.mb)?
            }
            Action::Overlap { f, b } => {
                let input = self.take_input(f)?;
                let grad = self.take_grad(b)?;
                let (out, gin) = self.work.overlap(f, input, b, grad)?;
                self.put_output(f, out);
                self.put_input_grad(b, gin);
            }
            Action::Comm { kind, task } => self.comm(kind, task)?,
            Action::StageOp { kind, stage } => self.work.stage_op(kind, stage)?,
        }
        Ok(())
    }

    /// The world rank holding `stage`.
    fn peer(&self, stage: usize) -> Result<usize, StepError> {
        let r = self.layout.rank(stage);
        let world = self.pipeline.ranks().get(r).copied();
        Ok(world
            .ok_or_else(|| format!("stage {stage} is placed on no rank of pipeline {}", self.pipeline))?)
    }

    fn comm(&mut self, kind: CommKind, t: Task) -> Result<(), StepError> {
        match kind {
            CommKind::SendF => {
                let peer = self.peer(t.stage + 1)?;
                let msg = self.buf.to_send_f.remove(&t).ok_or_else(|| format!("{t:?}: nothing to send"))?;
                self.comm.send(peer, Tag::Activation { stage: t.stage + 1, mb: t.mb }, msg)?;
            }
            CommKind::SendB => {
                let peer = self.peer(t.stage.wrapping_sub(1))?;
                let msg = self
                    .buf
                    .to_send_b
                    .remove(&t)
                    .ok_or_else(|| format!("{t:?}: no input gradient to send"))?;
                let tag = Tag::Gradient { stage: t.stage.wrapping_sub(1), mb: t.mb };
                self.comm.send(peer, tag, msg)?;
            }
            CommKind::RecvF => {
                let peer = self.peer(t.stage.wrapping_sub(1))?;
                let tag = Tag::Activation { stage: t.stage, mb: t.mb };
                let msg = self.comm.recv(peer, tag, self.timeout)?;
                self.buf.input.insert(t, msg);
            }
            CommKind::RecvB => {
                let peer = self.peer(t.stage + 1)?;
                let tag = Tag::Gradient { stage: t.stage, mb: t.mb };
                let msg = self.comm.recv(peer, tag, self.timeout)?;
                self.buf.grad.insert(t, msg);
            }
            // A send is complete when `Comm::send` returns (the communicator owns the message
            // from then on), so PyTorch's completion wait has nothing left to wait for.
            CommKind::WaitSendF | CommKind::WaitSendB => {}
        }
        Ok(())
    }

    /// Runs the program; on a local failure aborts the communicator and returns the error with
    /// its step.
    fn run(mut self, program: &[Action], t0: Instant) -> Result<RankOutcome<W>, PipelineError> {
        let me = self.comm.rank();
        let mut intervals = Vec::with_capacity(program.len());
        let mut comm = Vec::new();
        for (step, a) in program.iter().enumerate() {
            let start = t0.elapsed().as_secs_f64();
            let res = catch_unwind(AssertUnwindSafe(|| self.run_action(a)));
            let (rank, action) = (me, a.to_string());
            let err = match res {
                Ok(Ok(())) => None,
                Ok(Err(StepError::Work(e))) => {
                    Some(PipelineError::Action { rank, step, action, message: e.to_string() })
                }
                Ok(Err(StepError::Comm(CommError::Aborted { failed_rank, reason }))) => {
                    // Another rank failed; it reports its own error. Nothing to abort.
                    return Err(PipelineError::Aborted { rank, step, action, failed_rank, reason });
                }
                Ok(Err(StepError::Comm(e))) => {
                    Some(PipelineError::Comm { rank, step, action, source: Box::new(e) })
                }
                Err(p) => Some(PipelineError::Panic { rank, step, action, message: panic_message(&p) }),
            };
            if let Some(err) = err {
                self.comm.abort(&err.to_string());
                return Err(err);
            }
            intervals.push(Interval { rank: self.rank, start, end: t0.elapsed().as_secs_f64(), action: *a });
            let secs = |t: Instant| t.saturating_duration_since(t0).as_secs_f64();
            comm.extend(self.work.take_collectives().into_iter().map(|(label, c)| CommSpan {
                rank: self.rank,
                action: *a,
                start: secs(c.start),
                wait: secs(c.wait),
                end: secs(c.end),
                label,
            }));
        }
        Ok(RankOutcome { work: self.work, intervals, comm })
    }
}

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".into())
}

/// Runs this rank's program of the lowered `schedule` over `comm`: the rank is `comm.rank()`,
/// its schedule rank its position in `pipeline` (the world ranks of its pipeline in schedule-rank
/// order, one per schedule rank). Returns the worker and the rank's measured intervals.
///
/// On a failure of its own (a compute error, a panic, a receive timeout, a bad setup) the rank
/// calls [`Comm::abort`] with its error's text before returning it, so the other ranks stop
/// promptly instead of waiting for their timeouts.
///
/// # Errors
/// [`PipelineError::Setup`] when the schedule places a stage on two ranks, `pipeline` does not
/// have one rank per schedule rank or does not contain `comm.rank()`;
/// [`PipelineError::Action`] / [`PipelineError::Panic`] for a failed or panicking action;
/// [`PipelineError::Comm`] for a SEND/RECV error (timeout, bad peer);
/// [`PipelineError::Aborted`] when another rank failed first (naming it).
pub fn run_rank<W: StageWork>(
    schedule: &Schedule,
    pipeline: &Group,
    work: W,
    comm: &dyn Comm,
    opts: &RankOptions,
) -> Result<RankOutcome<W>, PipelineError> {
    let setup = || -> Result<(usize, Layout), PipelineError> {
        let p = schedule.num_ranks();
        if pipeline.size() != p {
            return Err(PipelineError::Setup(format!(
                "pipeline group {pipeline} has {} ranks, the schedule {p}",
                pipeline.size()
            )));
        }
        let rank = pipeline.index_of(comm.rank()).ok_or_else(|| {
            PipelineError::Setup(format!("rank {} is not in its pipeline group {pipeline}", comm.rank()))
        })?;
        Ok((rank, Layout::new(schedule)?))
    };
    let (rank, layout) = setup().inspect_err(|e| comm.abort(&e.to_string()))?;
    let runner = RankRunner {
        rank,
        work,
        comm,
        pipeline,
        layout: &layout,
        timeout: opts.timeout,
        buf: Buffers::default(),
    };
    runner.run(&schedule.program(rank), opts.start)
}

/// Of the errors of a run's ranks (in rank order), the one to report: the error of the rank the
/// others name as failed, else the first that is not an abort echo, else the first.
fn first_failure(mut errors: Vec<PipelineError>) -> Option<PipelineError> {
    let culprit = errors.iter().find_map(|e| match e {
        PipelineError::Aborted { failed_rank, .. } => Some(*failed_rank),
        _ => None,
    });
    let own = |e: &PipelineError| !e.is_aborted();
    let pos = errors
        .iter()
        .position(|e| own(e) && culprit.is_some_and(|c| e.rank() == Some(c)))
        .or_else(|| errors.iter().position(own))
        .unwrap_or(0);
    (!errors.is_empty()).then(|| errors.swap_remove(pos))
}

/// Runs a lowered `schedule` with one worker per rank (index = rank) as threads of this process,
/// each calling [`run_rank`] over its end of a [`ThreadComm::world`] (pipeline = world: pp = p,
/// dp = 1). Returns the workers (with their accumulated gradients) and the measured timeline
/// (seconds).
///
/// # Errors
/// [`PipelineError::Setup`] when the schedule and workers disagree; otherwise the failing rank's
/// own error ([`PipelineError::Action`], [`PipelineError::Panic`], [`PipelineError::Comm`]) —
/// the [`PipelineError::Aborted`] of the ranks that only stopped because of it are not reported.
/// `timeout` bounds every RECV.
pub fn run_pipeline<W: StageWork>(
    schedule: &Schedule,
    workers: Vec<W>,
    timeout: Duration,
) -> Result<(Vec<W>, Timeline), PipelineError> {
    let p = schedule.num_ranks();
    if workers.len() != p {
        return Err(PipelineError::Setup(format!("{} workers for {p} ranks", workers.len())));
    }
    Layout::new(schedule)?;
    let mesh = Mesh::new(p, 1).map_err(|e| PipelineError::Setup(e.to_string()))?;
    let opts = RankOptions::new(timeout);
    let results: Vec<Result<RankOutcome<W>, PipelineError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = workers
            .into_iter()
            .zip(ThreadComm::world(p))
            .enumerate()
            .map(|(rank, (work, comm))| {
                let opts = &opts;
                scope.spawn(move || {
                    let pipeline =
                        mesh.pipeline_group(rank).map_err(|e| PipelineError::Setup(e.to_string()))?;
                    run_rank(schedule, &pipeline, work, &comm, opts)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("run_rank catches its panics")).collect()
    });
    let mut workers = Vec::with_capacity(p);
    let (mut intervals, mut comm) = (Vec::new(), Vec::new());
    let mut errors = Vec::new();
    for r in results {
        match r {
            Ok(RankOutcome { work, intervals: iv, comm: c }) => {
                workers.push(work);
                intervals.extend(iv);
                comm.extend(c);
            }
            Err(e) => errors.push(e),
        }
    }
    match first_failure(errors) {
        Some(e) => Err(e),
        None => Ok((workers, Timeline { ranks: p, intervals, comm, unit: "s".into() })),
    }
}
