//! The schedule executor: runs each rank's lowered program on its own OS thread over a
//! [`Transport`], calling a [`StageWork`] for the compute (docs/ARCHITECTURE.md, "Runtime").
//!
//! Per (stage, microbatch) it keeps the received input, the received output gradient, the output
//! waiting for its SEND_F and the input gradient waiting for its SEND_B; each is dropped as soon as
//! its consumer ran. Adjacent stages on one rank hand over locally (no SEND/RECV in the lowered
//! schedule). A failing or panicking rank aborts the transport, so every other rank stops with an
//! error instead of hanging; [`run_pipeline`] returns the first failure, naming rank, step and action.

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use graphpp_schedule::{Action, CommKind, ComputeKind, Interval, Schedule, StageOpKind, Task, Timeline};

use crate::transport::{Tag, TagKind, ThreadTransport, Transport};

/// The error type stage computations return.
pub type WorkError = Box<dyn std::error::Error + Send + Sync>;

/// The compute of the stages one rank holds. `T` is what travels between stages (an activation
/// or a gradient tensor).
///
/// Inputs are `None` where the route has no neighbour: a route's first stage gets no input
/// activation (it reads its own microbatch), its last stage gets no output gradient (it seeds
/// d loss = 1 itself), and returns no output activation / no input gradient respectively.
pub trait StageWork: Send {
    /// Activation / gradient type.
    type Tensor: Send + 'static;
    /// F(stage, mb): returns the activation for the next stage (`None` on the route's last stage).
    fn forward(
        &mut self,
        stage: usize,
        mb: usize,
        input: Option<Self::Tensor>,
    ) -> Result<Option<Self::Tensor>, WorkError>;
    /// B(stage, mb): full backward; accumulates weight gradients and returns the input gradient
    /// (`None` on the route's first stage).
    fn backward(
        &mut self,
        stage: usize,
        mb: usize,
        grad: Option<Self::Tensor>,
    ) -> Result<Option<Self::Tensor>, WorkError>;
    /// I(stage, mb): input-gradient backward; keeps what W needs.
    fn backward_input(
        &mut self,
        stage: usize,
        mb: usize,
        grad: Option<Self::Tensor>,
    ) -> Result<Option<Self::Tensor>, WorkError>;
    /// W(stage, mb): weight-gradient backward from what I kept.
    fn backward_weight(&mut self, stage: usize, mb: usize) -> Result<(), WorkError>;
    /// OVERLAP_F_B: F of `f` and B of `b` as one multiplexed computation; by default F then B.
    #[allow(clippy::type_complexity)]
    fn overlap(
        &mut self,
        f: Task,
        input: Option<Self::Tensor>,
        b: Task,
        grad: Option<Self::Tensor>,
    ) -> Result<(Option<Self::Tensor>, Option<Self::Tensor>), WorkError> {
        let out = self.forward(f.stage, f.mb, input)?;
        let gin = self.backward(b.stage, b.mb, grad)?;
        Ok((out, gin))
    }
    /// UNSHARD / RESHARD / REDUCE_GRAD of a stage; by default nothing (no FSDP).
    fn stage_op(&mut self, _kind: StageOpKind, _stage: usize) -> Result<(), WorkError> {
        Ok(())
    }
}

/// A failed pipeline run: the first rank that failed and what it was doing.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    /// An action failed on a rank.
    #[error("rank {rank} failed at step {step} ({action}): {message}")]
    Action {
        /// The rank.
        rank: usize,
        /// Index into the rank's program.
        step: usize,
        /// The action text.
        action: String,
        /// The cause.
        message: String,
    },
    /// A rank's thread panicked.
    #[error("rank {rank} panicked at step {step} ({action}): {message}")]
    Panic {
        /// The rank.
        rank: usize,
        /// Index into the rank's program.
        step: usize,
        /// The action text.
        action: String,
        /// The panic message.
        message: String,
    },
    /// The schedule and the workers disagree (e.g. ranks ≠ workers, a stage on two ranks).
    #[error("bad pipeline setup: {0}")]
    Setup(String),
}

/// Result of one rank: its worker back and its measured intervals (seconds since the run began).
type RankOutcome<W> = (W, Vec<Interval>);

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
struct Buffers<T> {
    input: HashMap<Task, T>,
    grad: HashMap<Task, T>,
    to_send_f: HashMap<Task, T>,
    to_send_b: HashMap<Task, T>,
}

struct RankRunner<'a, W: StageWork, X: Transport<W::Tensor>> {
    rank: usize,
    work: W,
    net: X,
    layout: &'a Layout,
    timeout: Duration,
    buf: Buffers<W::Tensor>,
}

impl<W: StageWork, X: Transport<W::Tensor>> RankRunner<'_, W, X> {
    fn take_input(&mut self, t: Task) -> Result<Option<W::Tensor>, WorkError> {
        if t.stage == self.layout.route(t.mb).start {
            return Ok(None);
        }
        self.buf
            .input
            .remove(&t)
            .map(Some)
            .ok_or_else(|| format!("no input activation for {}F{}", t.stage, t.mb).into())
    }

    fn take_grad(&mut self, t: Task) -> Result<Option<W::Tensor>, WorkError> {
        if t.stage + 1 == self.layout.route(t.mb).end {
            return Ok(None);
        }
        self.buf
            .grad
            .remove(&t)
            .map(Some)
            .ok_or_else(|| format!("no output gradient for stage {} mb {}", t.stage, t.mb).into())
    }

    fn put_output(&mut self, t: Task, out: Option<W::Tensor>) {
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

    fn put_input_grad(&mut self, t: Task, gin: Option<W::Tensor>) {
        if let (Some(g), true) = (gin, t.stage > self.layout.route(t.mb).start) {
            let prev = Task::new(t.stage - 1, t.mb);
            if self.layout.rank(prev.stage) == self.rank {
                self.buf.grad.insert(prev, g);
            } else {
                self.buf.to_send_b.insert(t, g);
            }
        }
    }

    fn run_action(&mut self, a: &Action) -> Result<(), WorkError> {
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

    fn comm(&mut self, kind: CommKind, t: Task) -> Result<(), WorkError> {
        let (peer_stage, tag_kind) = match kind {
            CommKind::SendF | CommKind::RecvB => (t.stage + 1, TagKind::Activation),
            CommKind::RecvF | CommKind::SendB => (t.stage.wrapping_sub(1), TagKind::Gradient),
        };
        let peer = self.layout.rank(peer_stage);
        match kind {
            CommKind::SendF => {
                let msg = self.buf.to_send_f.remove(&t).ok_or_else(|| format!("{t:?}: nothing to send"))?;
                self.net.send(peer, Tag { kind: TagKind::Activation, stage: peer_stage, mb: t.mb }, msg)?;
            }
            CommKind::SendB => {
                let msg = self
                    .buf
                    .to_send_b
                    .remove(&t)
                    .ok_or_else(|| format!("{t:?}: no input gradient to send"))?;
                self.net.send(peer, Tag { kind: tag_kind, stage: peer_stage, mb: t.mb }, msg)?;
            }
            CommKind::RecvF => {
                let msg = self.net.recv(
                    peer,
                    Tag { kind: TagKind::Activation, stage: t.stage, mb: t.mb },
                    self.timeout,
                )?;
                self.buf.input.insert(t, msg);
            }
            CommKind::RecvB => {
                let msg = self.net.recv(
                    peer,
                    Tag { kind: TagKind::Gradient, stage: t.stage, mb: t.mb },
                    self.timeout,
                )?;
                self.buf.grad.insert(t, msg);
            }
        }
        Ok(())
    }

    /// Runs the program; on failure aborts the transport and returns the error with its step.
    fn run(mut self, program: &[Action], t0: Instant) -> Result<RankOutcome<W>, PipelineError> {
        let mut intervals = Vec::with_capacity(program.len());
        for (step, a) in program.iter().enumerate() {
            let start = t0.elapsed().as_secs_f64();
            let res = catch_unwind(AssertUnwindSafe(|| self.run_action(a)));
            let fail = |message: String, panic: bool| {
                let (rank, action) = (self.rank, a.to_string());
                if panic {
                    PipelineError::Panic { rank, step, action, message }
                } else {
                    PipelineError::Action { rank, step, action, message }
                }
            };
            let err = match res {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(fail(e.to_string(), false)),
                Err(p) => Some(fail(panic_message(&p), true)),
            };
            if let Some(err) = err {
                self.net.abort(&err.to_string());
                return Err(err);
            }
            intervals.push(Interval { rank: self.rank, start, end: t0.elapsed().as_secs_f64(), action: *a });
        }
        Ok((self.work, intervals))
    }
}

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".into())
}

/// True for the error of a rank that only stopped because another rank aborted.
fn is_aborted(e: &PipelineError) -> bool {
    matches!(e, PipelineError::Action { message, .. } if message.starts_with("stopped because rank"))
}

/// Runs a lowered `schedule` with one worker per rank (index = rank) on threads in this process.
/// Returns the workers (with their accumulated gradients) and the measured timeline (seconds).
///
/// # Errors
/// [`PipelineError::Setup`] when the schedule and workers disagree; otherwise the first rank's
/// failure ([`PipelineError::Action`] / [`PipelineError::Panic`]) — ranks that only stopped
/// because of it are not reported. `timeout` bounds every RECV.
pub fn run_pipeline<W: StageWork>(
    schedule: &Schedule,
    workers: Vec<W>,
    timeout: Duration,
) -> Result<(Vec<W>, Timeline), PipelineError> {
    let p = schedule.num_ranks();
    if workers.len() != p {
        return Err(PipelineError::Setup(format!("{} workers for {p} ranks", workers.len())));
    }
    let layout = Layout::new(schedule)?;
    let nets = ThreadTransport::<W::Tensor>::group(p);
    let t0 = Instant::now();
    let results: Vec<Result<RankOutcome<W>, PipelineError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = workers
            .into_iter()
            .zip(nets)
            .enumerate()
            .map(|(rank, (work, net))| {
                let layout = &layout;
                let program = schedule.program(rank);
                scope.spawn(move || {
                    let buf = Buffers {
                        input: HashMap::new(),
                        grad: HashMap::new(),
                        to_send_f: HashMap::new(),
                        to_send_b: HashMap::new(),
                    };
                    RankRunner { rank, work, net, layout, timeout, buf }.run(&program, t0)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank runners catch their panics")).collect()
    });
    let mut workers = Vec::with_capacity(p);
    let mut intervals = Vec::new();
    let mut first_err: Option<PipelineError> = None;
    for r in results {
        match r {
            Ok((w, iv)) => {
                workers.push(w);
                intervals.extend(iv);
            }
            Err(e) => {
                if first_err.is_none() || (!is_aborted(&e) && first_err.as_ref().is_some_and(is_aborted)) {
                    first_err = Some(e);
                }
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok((workers, Timeline { ranks: p, intervals, unit: "s".into() })),
    }
}
