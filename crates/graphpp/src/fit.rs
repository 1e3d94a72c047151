//! The step loop of a training run ([`fit`]): steps until the run's last step, evaluating,
//! checkpointing and logging metrics at its points, stopping cleanly on SIGINT / SIGTERM. What
//! `graphpp train` drives; the command only parses its flags, calls [`fit`] and prints what an
//! [`Observer`] is told and what [`Fit`] gathered.
//!
//! Under `mpirun` every process runs the same loop: the steps, evaluations and checkpoints are
//! collective (the leader, world rank 0, writes; the others take part in the gathers), and every
//! process stops after the same step whichever saw the signal.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::time::Instant;

use graphpp_runtime::{StepReport, TrainError};
use graphpp_schedule::Timeline;

use crate::checkpoint::{self, CheckpointError};
use crate::metrics::{MetricsError, MetricsLog, StepRecord};
use crate::stop::{Interrupted, StopRequest, StopSignal};
use crate::train::{Run, RunError};

/// When the loop evaluates, where it writes checkpoints and what it keeps for the summary.
#[derive(Debug, Clone, Default)]
pub struct FitOptions {
    /// The last step to run (the run's `steps`, or fewer with `--stop-after`).
    pub last_step: u64,
    /// Evaluate (and checkpoint) every this many steps, and at the last step (0: only there).
    pub eval_every: u64,
    /// Folder of the run's checkpoints (written at every evaluation and on a signal).
    pub checkpoint_dir: Option<PathBuf>,
    /// Keep only the newest this many checkpoints (0: keep all).
    pub keep_checkpoints: usize,
    /// How many of the last steps' timelines to keep (`--trace`, the bubble summary).
    pub keep_timelines: usize,
    /// Keep every step's timeline and each rank's largest peak bytes (`graphpp profile`).
    pub profile: bool,
}

/// An evaluation on the leader: the step's report, its timing and the validation loss.
#[derive(Debug, Clone, Copy)]
pub struct Evaluation<'a> {
    /// The step just run.
    pub report: &'a StepReport,
    /// Validation loss, nats per token.
    pub val_loss: f64,
    /// The step's own seconds (no evaluation, no checkpoint).
    pub step_s: f64,
    /// Seconds of training since the run began (a resumed run continues its log's clock).
    pub elapsed_s: f64,
    /// Tokens per second of the step.
    pub tokens_per_s: f64,
    /// Model FLOP/s of the step (6·N·tokens, see [`Run::flops_per_token`]).
    pub flops_per_s: f64,
}

/// What the caller is told while the loop runs (the CLI's progress bar and lines).
pub trait Observer {
    /// After every step, on every process.
    ///
    /// # Errors
    /// The caller's own output failing; the loop stops with [`FitError::Output`].
    fn stepped(&mut self, report: &StepReport, step_s: f64) -> std::io::Result<()>;

    /// After an evaluation, on the leader, once its checkpoint is written.
    ///
    /// # Errors
    /// As [`Observer::stepped`].
    fn evaluated(&mut self, e: &Evaluation) -> std::io::Result<()>;
}

/// Why the loop stopped before its last step.
#[derive(Debug, thiserror::Error)]
pub enum FitError {
    /// A step failed.
    #[error("step {step}: {error}")]
    Step {
        /// The step (1-based).
        step: u64,
        /// Why (boxed: a run error is large).
        #[source]
        error: Box<RunError>,
    },
    /// An evaluation or a checkpoint failed (boxed: a run error is large).
    #[error(transparent)]
    Run(Box<RunError>),
    /// The metrics log could not be written.
    #[error(transparent)]
    Metrics(#[from] MetricsError),
    /// The loss is not finite.
    #[error("step {step}: the loss is {loss} (diverged); lower --lr")]
    Diverged {
        /// The step.
        step: u64,
        /// Its loss.
        loss: f64,
    },
    /// SIGINT / SIGTERM: the step was finished and saved.
    #[error(transparent)]
    Interrupted(#[from] Interrupted),
    /// The observer's output failed.
    #[error("output: {0}")]
    Output(#[from] std::io::Error),
}

impl From<RunError> for FitError {
    fn from(e: RunError) -> Self {
        FitError::Run(Box::new(e))
    }
}

impl From<TrainError> for FitError {
    fn from(e: TrainError) -> Self {
        FitError::Run(Box::new(e.into()))
    }
}

impl From<CheckpointError> for FitError {
    fn from(e: CheckpointError) -> Self {
        FitError::Run(Box::new(e.into()))
    }
}

/// What the loop measured, for the run's summary.
#[derive(Debug, Clone, Default)]
pub struct Fit {
    /// The step the loop started after (0 for a fresh run).
    pub first_step: u64,
    /// The last [`FitOptions::keep_timelines`] steps: (start, seconds since the loop began;
    /// the measured timeline).
    pub kept: VecDeque<(f64, Timeline)>,
    /// Per step: the longest any local rank was blocked at the iteration boundary, seconds.
    pub boundary_wait_s: Vec<f64>,
    /// Per step: the fraction of the step spent waiting for the data-parallel gradient
    /// reduction after the pipeline (the longest of the local ranks).
    pub exposed_reduce: Vec<f64>,
    /// Steps post-validation rolled back.
    pub rollbacks: u64,
    /// Each step's own seconds.
    pub step_s: Vec<f64>,
    /// With [`FitOptions::profile`]: every step's timeline.
    pub profiled: Vec<Timeline>,
    /// With [`FitOptions::profile`]: each pipeline rank's largest peak bytes over the steps
    /// (index = the rank of replica 0, `0..p`).
    pub peaks: Vec<u64>,
    /// The last validation loss (the leader's; `None` elsewhere).
    pub val_loss: Option<f64>,
    /// Seconds the loop took.
    pub wall_s: f64,
}

impl Fit {
    /// Steps the loop ran.
    pub fn steps_run(&self) -> u64 {
        self.step_s.len() as u64
    }
}

/// Runs `run` from its current step to `o.last_step`: each step, then at an evaluation step the
/// validation loss, a checkpoint (pruned to [`FitOptions::keep_checkpoints`]) and the
/// observer's [`Observer::evaluated`]; every step's [`StepRecord`] goes to `metrics` (on the
/// leader). After each step every process learns whether any saw a signal in `stop`; then the
/// step just finished is saved (unless it was just saved) and the loop ends with
/// [`FitError::Interrupted`]. A run already at its last step is evaluated once.
///
/// # Errors
/// [`FitError`]: a failing step (naming it), a non-finite loss, a checkpoint or metrics write,
/// a signal, the observer's output.
pub fn fit(
    run: &mut Run,
    o: &FitOptions,
    metrics: &mut MetricsLog,
    stop: &StopRequest,
    observer: &mut dyn Observer,
) -> Result<Fit, FitError> {
    let t0 = Instant::now();
    let before = metrics.records().last().map_or(0.0, |r| r.elapsed_s);
    let mut fit = Fit { first_step: run.steps_done(), peaks: vec![0; run.config().ranks], ..Fit::default() };
    // The world rank of each pipeline rank of replica 0 (tp index 0), whose peak a profile keeps.
    let c = run.config();
    let mesh = graphpp_comm::Mesh::new(c.ranks, c.dp).and_then(|m| m.with_tp(c.tp)).ok();
    let leads: Vec<usize> = (0..c.ranks)
        .map(|p| mesh.and_then(|m| m.rank_of(graphpp_comm::Coords::at(0, p)).ok()).unwrap_or(p))
        .collect();
    // The step of the last checkpoint written and, on the leader, its path: the same step on
    // every process, so all agree whether a stop needs one more checkpoint.
    let mut saved_at: Option<(u64, Option<PathBuf>)> = None;
    while run.steps_done() < o.last_step {
        let start = t0.elapsed().as_secs_f64();
        let r = run.step().map_err(|e| FitError::Step { step: run.steps_done() + 1, error: Box::new(e) })?;
        let secs = t0.elapsed().as_secs_f64() - start;
        observer.stepped(&r, secs)?;
        if !r.stats.loss.is_finite() {
            return Err(FitError::Diverged { step: r.stats.step, loss: r.stats.loss });
        }
        let at_eval = (o.eval_every > 0 && r.stats.step % o.eval_every == 0) || r.stats.step == o.last_step;
        let elapsed = before + t0.elapsed().as_secs_f64();
        if at_eval {
            if let Some(e) = evaluate(run, o, &r, (secs, elapsed), metrics, observer)? {
                fit.val_loss = e.val_loss;
                saved_at = o.checkpoint_dir.as_ref().map(|_| (r.stats.step, e.saved));
            }
        } else {
            metrics.push(step_record(run, &r, secs, elapsed, None))?;
        }
        fit.keep(o, &leads, start, secs, r);
        // Every process stops after the same step, whichever saw the signal.
        let signal = stop.requested();
        if run.trainer().any(signal.is_some())? {
            let signal = signal.unwrap_or(StopSignal::Terminate);
            return Err(interrupted(run, o, signal, saved_at)?.into());
        }
    }
    if fit.steps_run() == 0 {
        fit.val_loss = run.evaluate()?;
    }
    fit.wall_s = t0.elapsed().as_secs_f64();
    Ok(fit)
}

impl Fit {
    /// Keeps what the summary needs of step `r` (started `start` seconds into the loop); `leads`:
    /// the world rank of each pipeline rank of replica 0 (tp index 0).
    fn keep(&mut self, o: &FitOptions, leads: &[usize], start: f64, secs: f64, r: StepReport) {
        self.step_s.push(secs);
        self.boundary_wait_s.push(r.boundary_wait_s.iter().copied().fold(0.0, f64::max));
        self.exposed_reduce.push(r.reduce_wait_s.iter().copied().fold(0.0, f64::max) / secs.max(1e-12));
        self.rollbacks += u64::from(r.stats.rolled_back);
        if o.profile {
            for (peak, &rank) in self.peaks.iter_mut().zip(leads) {
                *peak = (*peak).max(r.stats.peak_bytes.get(rank).copied().unwrap_or(0));
            }
            self.profiled.push(r.timeline.clone());
        }
        self.kept.push_back((start, r.timeline));
        if self.kept.len() > o.keep_timelines {
            self.kept.pop_front();
        }
    }
}

/// The metrics line of step `r`.
fn step_record(run: &Run, r: &StepReport, secs: f64, elapsed: f64, val_loss: Option<f64>) -> StepRecord {
    let tokens = run.config().tokens_per_step() as f64;
    StepRecord {
        step: r.stats.step,
        loss: r.stats.loss,
        lr: r.stats.lr,
        grad_norm: r.stats.grad_norm,
        step_s: secs,
        tokens_per_s: tokens / secs,
        elapsed_s: elapsed,
        val_loss,
        peak_bytes: Some(r.stats.peak_bytes.clone()),
        resident_bytes: Some(r.stats.resident_bytes.clone()),
        boundary_wait_s: Some(r.boundary_wait_s.clone()),
        flops_per_s: Some(run.flops_per_token() * tokens / secs),
        aux_loss: (r.stats.aux_loss != 0.0).then_some(r.stats.aux_loss),
        mtp_loss: (r.stats.mtp_loss != 0.0).then_some(r.stats.mtp_loss),
    }
}

/// What an evaluation step leaves: the validation loss and the checkpoint written (both only on
/// the leader).
struct Evaluated {
    val_loss: Option<f64>,
    saved: Option<PathBuf>,
}

/// An evaluation step: the validation loss, the metrics line, the checkpoint (written before
/// the observer prints: a failing terminal must not cost the step), then the observer. Returns
/// the validation loss and the checkpoint written, both only on the leader (the other
/// processes take part in the gathers and get `(None, None)`); `None` when the leader got no
/// validation loss.
fn evaluate(
    run: &mut Run,
    o: &FitOptions,
    r: &StepReport,
    (secs, elapsed): (f64, f64),
    metrics: &mut MetricsLog,
    observer: &mut dyn Observer,
) -> Result<Option<Evaluated>, FitError> {
    let val = run.evaluate()?;
    if !run.is_leader() {
        if let Some(dir) = &o.checkpoint_dir {
            run.save(dir, None)?;
        }
        return Ok(Some(Evaluated { val_loss: None, saved: None }));
    }
    let rec = step_record(run, r, secs, elapsed, val);
    let (tokens_per_s, flops_per_s) = (rec.tokens_per_s, rec.flops_per_s.unwrap_or(0.0));
    metrics.push(rec)?;
    let Some(val_loss) = val else { return Ok(None) };
    let mut saved = None;
    if let Some(dir) = &o.checkpoint_dir {
        saved = run.save(dir, Some(val_loss))?;
        checkpoint::prune(dir, o.keep_checkpoints)?;
    }
    let e = Evaluation { report: r, val_loss, step_s: secs, elapsed_s: elapsed, tokens_per_s, flops_per_s };
    observer.evaluated(&e)?;
    Ok(Some(Evaluated { val_loss: Some(val_loss), saved }))
}

/// After SIGINT / SIGTERM: saves the step just finished (unless it was just saved) and returns
/// the [`Interrupted`] that makes the binary exit with 128 + the signal number.
fn interrupted(
    run: &mut Run,
    o: &FitOptions,
    signal: StopSignal,
    saved_at: Option<(u64, Option<PathBuf>)>,
) -> Result<Interrupted, FitError> {
    let step = run.steps_done();
    let saved = match (&o.checkpoint_dir, saved_at) {
        (Some(_), Some((at, path))) if at == step => path,
        (Some(dir), _) => run.save(dir, None)?,
        (None, _) => None,
    };
    Ok(Interrupted { signal, step, saved })
}
