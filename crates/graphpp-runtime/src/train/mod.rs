//! Training steps under a pipeline schedule: the per-step loop that `graphpp train` drives
//! (docs/ARCHITECTURE.md "Runtime" → Executor of a schedule).
//!
//! A [`Trainer`] is the part of a training run that lives in this process: the lowered schedule
//! and the [`RankTrainer`]s of the ranks this process runs (graphs built once, reused every
//! step) — every rank, each over its end of a [`ThreadComm::world`] ([`Trainer::new`]), or one
//! rank over a communicator whose other ranks are other processes ([`Trainer::on_comm`], e.g.
//! `MpiComm` under `mpirun`). [`Trainer::step`] runs each local rank's [`RankTrainer::step_at`]
//! (on its own thread when there are several): the pipeline run, then, as Megatron-LM does
//! after the last backward, the copies' gradient all-reduce, the data-parallel mean, the global
//! norm clip and the local AdamW step — all over the communicator (see [`crate::train::rank_train`]).
//!
//! Whole-model work happens on the *leader*, the process that runs world rank 0: every process
//! calls [`Trainer::gather_state`], [`Trainer::evaluate`] and [`Trainer::generate`] at the same
//! point of the run; the parameters travel to the leader, which returns the result, and the
//! other processes get `None`. [`Trainer::load_state`] is local: every process reads the same
//! saved state and takes what its ranks hold.
//!
//! Both DualPipe copies receive the same summed gradient and have the same optimizer state, so
//! they stay bitwise equal. Evaluation and text generation run one forward of the whole model on
//! one device from the current parameters.

pub mod build;
pub mod bytes;
pub mod error;
pub mod memory;
pub mod rank_train;
pub mod sample;
pub mod setup;

pub use error::TrainError;
pub use setup::TrainSetup;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use candle_core::Tensor;
use graphpp_graph::names::{LOGITS, LOSS, TARGETS, TOKENS};
use graphpp_graph::Graph;
use graphpp_models::{split_layers, StageOptions};
use graphpp_schedule::{Schedule, Timeline};

use crate::exec::{Program, RunOptions};
use crate::kernels::tensor::{tensor_from_f64, tensor_u32, to_f64};
use crate::pipeline::stage::{Env, GraphStages, Microbatches};
use crate::pipeline::PipelineError;
use crate::train::error::SetupError;
use crate::train::rank_train::{RankStepReport, RankTrainer, StepStats};
use crate::train::sample::sample_next;
use graphpp_comm::mesh::Mesh;
use graphpp_comm::{Comm, ThreadComm};

/// What one step did in this process.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// The step's figures, the same on every rank.
    pub stats: StepStats,
    /// Measured timeline of the pipeline run of replica 0 (seconds since the step began on each
    /// rank); complete on the leader, only this process's ranks elsewhere.
    pub timeline: Timeline,
    /// Seconds each rank of this process was blocked at the iteration boundary (index = world
    /// rank for a thread run; this process's rank alone otherwise): see
    /// [`RankStepReport::boundary_wait_s`].
    pub boundary_wait_s: Vec<f64>,
    /// Seconds each rank of this process waited for its data-parallel gradient reductions after
    /// its pipeline run (see [`RankStepReport::reduce_wait_s`]); indexed as `boundary_wait_s`.
    pub reduce_wait_s: Vec<f64>,
}

/// This process's part of a training run: the [`RankTrainer`]s of its ranks (see the module doc).
#[derive(Debug)]
pub struct Trainer {
    setup: TrainSetup,
    schedule: Arc<Schedule>,
    /// This process's ranks, in world-rank order.
    ranks: Vec<RankTrainer>,
    /// Each rank's intra-op thread pool ([`crate::kernels::threads`]), index as `ranks`.
    pools: Vec<rayon::ThreadPool>,
    /// Whether the pools' idle workers poll for work while a rank's work runs (a step, an
    /// evaluation: [`crate::kernels::threads::install_hot`]) — when every pool's threads have cores of
    /// their own.
    spin: bool,
    poisoned: bool,
    step: u64,
    /// Single-device inference graphs by (batch, logits?), built on first use.
    inference: HashMap<(usize, bool), Arc<Graph>>,
}

/// One pool of `threads` threads per rank. Errors: [`TrainError::Setup`] when the OS refuses a
/// thread.
fn rank_pools(ranks: &[RankTrainer], threads: usize) -> Result<Vec<rayon::ThreadPool>, TrainError> {
    ranks
        .iter()
        .map(|r| {
            crate::kernels::threads::rank_pool(r.rank(), threads)
                .map_err(|e| SetupError::ThreadPool { rank: r.rank(), reason: e.to_string() }.into())
        })
        .collect()
}

impl Trainer {
    /// Builds the lowered schedule, the stage graphs and the initial weights (from `setup.seed`).
    ///
    /// # Errors
    /// [`TrainError::BatchNotDivisible`] and [`TrainError::Size`] (before anything is built)
    /// when dp is 0 or does not divide the batch, or the schedule or the step would be too
    /// large; [`TrainError::Setup`] when the kind cannot serve the shape, the layers do not divide
    /// into the stages, or a graph fails to build; [`TrainError::Optim`] for bad AdamW settings.
    pub fn new(setup: TrainSetup) -> Result<Self, TrainError> {
        let schedule = Arc::new(setup.lowered_schedule()?);
        let p = schedule.num_ranks();
        let mesh = Mesh::new(p, setup.dp)
            .and_then(|m| m.with_ep(setup.ep))
            .and_then(|m| m.with_tp(setup.tp))
            .map_err(SetupError::from)?;
        let ranks = ThreadComm::world(mesh.world())
            .into_iter()
            .map(|c| RankTrainer::new(setup.clone(), Arc::clone(&schedule), mesh, Arc::new(c)))
            .collect::<Result<Vec<_>, _>>()?;
        Self::with_ranks(setup, schedule, ranks)
    }

    /// Builds the one rank `comm.rank()` of a world of processes (world = p × dp × tp ranks).
    ///
    /// # Errors
    /// As [`Trainer::new`]; [`TrainError::Setup`] when the communicator's world is not
    /// p × dp × tp.
    pub fn on_comm(setup: TrainSetup, comm: Arc<dyn Comm>) -> Result<Self, TrainError> {
        let schedule = Arc::new(setup.lowered_schedule()?);
        let p = schedule.num_ranks();
        let mesh = Mesh::for_world(comm.world(), p, setup.dp, setup.tp)
            .and_then(|m| m.with_ep(setup.ep))
            .map_err(SetupError::from)?;
        let ranks = vec![RankTrainer::new(setup.clone(), Arc::clone(&schedule), mesh, comm)?];
        Self::with_ranks(setup, schedule, ranks)
    }

    /// The trainer of `ranks` (this process's), each with a pool of
    /// [`crate::kernels::threads::op_threads`] threads.
    fn with_ranks(
        setup: TrainSetup,
        schedule: Arc<Schedule>,
        ranks: Vec<RankTrainer>,
    ) -> Result<Self, TrainError> {
        let threads = crate::kernels::threads::op_threads();
        let pools = rank_pools(&ranks, threads)?;
        let spin = crate::kernels::threads::may_spin(ranks.len(), threads);
        Ok(Trainer {
            setup,
            schedule,
            ranks,
            pools,
            spin,
            poisoned: false,
            step: 0,
            inference: HashMap::new(),
        })
    }

    /// Whether this process runs world rank 0, where gathered state and results arrive.
    pub fn is_leader(&self) -> bool {
        self.ranks.first().is_some_and(|r| r.rank() == 0)
    }

    /// Whether this process runs every rank of the world.
    fn holds_world(&self) -> bool {
        self.ranks.len() == self.schedule.num_ranks() * self.setup.dp * self.setup.tp
    }

    /// Runs `f` on every local rank, in its thread pool (on its own thread when there are
    /// several); results in rank order.
    fn on_each<R: Send>(&mut self, f: impl Fn(&mut RankTrainer) -> R + Sync) -> Vec<R> {
        if let ([one], [pool]) = (self.ranks.as_mut_slice(), self.pools.as_slice()) {
            return vec![crate::kernels::threads::install_hot(pool, self.spin, || f(one))];
        }
        let (f, spin) = (&f, self.spin);
        std::thread::scope(|scope| {
            let handles: Vec<_> = self
                .ranks
                .iter_mut()
                .zip(&self.pools)
                .map(|(r, pool)| {
                    scope.spawn(move || crate::kernels::threads::install_hot(pool, spin, || f(r)))
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("a rank does not panic")).collect()
        })
    }

    /// Whether `flag` is set in any process of the run (e.g. a stop request seen by one
    /// process); every process calls it at the same point.
    ///
    /// # Errors
    /// [`TrainError::Comm`]; [`TrainError::Poisoned`].
    pub fn any(&self, flag: bool) -> Result<bool, TrainError> {
        if self.holds_world() {
            return Ok(flag);
        }
        self.ranks.first().ok_or(TrainError::Poisoned)?.any(flag)
    }

    /// One forward and backward without an optimizer step (see
    /// [`RankTrainer::gradient_step`]): the step loss and, on the leader, every distinct
    /// parameter's reduced, full gradient; `None` in the other processes.
    ///
    /// # Errors
    /// As [`Trainer::step`].
    #[allow(clippy::type_complexity)]
    pub fn gradient_step(
        &mut self,
        data: Microbatches,
    ) -> Result<(f64, Option<BTreeMap<String, Tensor>>), TrainError> {
        if self.poisoned {
            return Err(TrainError::Poisoned);
        }
        let data = Arc::new(data);
        let results = self.on_each(|r| r.gradient_step(Arc::clone(&data)));
        let mut out = (f64::NAN, None);
        for (loss, grads) in self.settle(results)? {
            out.0 = loss;
            out.1 = out.1.or(grads);
        }
        Ok(out)
    }

    /// The local ranks' results of one collective action, or the error to report: the trainer is
    /// poisoned unless every failure was a skipped step ([`TrainError::is_skipped_step`]).
    fn settle<R>(&mut self, results: Vec<Result<R, TrainError>>) -> Result<Vec<R>, TrainError> {
        let (ok, errors): (Vec<_>, Vec<_>) = results.into_iter().partition(Result::is_ok);
        let errors: Vec<TrainError> = errors.into_iter().filter_map(Result::err).collect();
        if errors.is_empty() {
            return Ok(ok.into_iter().filter_map(Result::ok).collect());
        }
        self.poisoned = !errors.iter().all(TrainError::is_skipped_step);
        Err(first_train_failure(errors))
    }

    /// Every distinct parameter and MoE routing bias (and, with `optimizer`, the AdamW moments
    /// and `adam.step`), gathered to the leader (see [`RankTrainer::gather_state`]); `None` in other processes.
    /// Every process calls it at the same point.
    ///
    /// # Errors
    /// [`TrainError::Poisoned`] after a failed step; [`TrainError::Comm`].
    pub fn gather_state(&mut self, optimizer: bool) -> Result<Option<BTreeMap<String, Tensor>>, TrainError> {
        if self.poisoned {
            return Err(TrainError::Poisoned);
        }
        let mut leader = None;
        for r in self.on_each(|r| r.gather_state(optimizer)) {
            if let Some(state) = r? {
                leader = Some(state);
            }
        }
        Ok(leader)
    }

    /// The lowered schedule every step runs.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The setup the trainer was built from.
    pub fn setup(&self) -> &TrainSetup {
        &self.setup
    }

    /// Each rank's stages (index = rank); empty after a failed step.
    pub fn ranks(&self) -> Vec<&GraphStages> {
        self.ranks.iter().filter_map(|r| r.stages()).collect()
    }

    /// The rank trainers (index = world rank).
    pub fn rank_trainers(&self) -> &[RankTrainer] {
        &self.ranks
    }

    /// Optimizer steps completed.
    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// One training step over `data` (m microbatches of `[B, T]` token ids and targets): every
    /// rank's [`RankTrainer::step_at`] on its own thread, from the same start instant.
    ///
    /// # Errors
    /// [`TrainError::Data`] for a wrong microbatch count; a failing rank
    /// ([`TrainError::Pipeline`]: the pipeline error that names rank, step and action — the
    /// trainer is then [`TrainError::Poisoned`]); [`TrainError::Optim`] for a non-finite gradient
    /// norm (the step is not applied; the trainer stays usable, see
    /// [`TrainError::is_skipped_step`]).
    pub fn step(&mut self, data: Microbatches) -> Result<StepReport, TrainError> {
        let m = self.setup.shape.microbatches;
        if data.len() != m || data.targets.len() != m {
            return Err(TrainError::Data(format!(
                "{} microbatches given, the schedule runs {m}",
                data.len()
            )));
        }
        if self.poisoned {
            return Err(TrainError::Poisoned);
        }
        let data = Arc::new(data);
        let start = Instant::now();
        let results = self.on_each(|r| r.step_at(Arc::clone(&data), start));
        let mut reports: Vec<RankStepReport> = self.settle(results)?;
        let boundary_wait_s = reports.iter().map(|r| r.boundary_wait_s).collect();
        let reduce_wait_s = reports.iter().map(|r| r.reduce_wait_s).collect();
        // The first local rank: the leader where it is local, whose intervals are replica 0's.
        let first = reports.swap_remove(0);
        self.step = first.stats.step;
        Ok(StepReport {
            stats: first.stats,
            timeline: Timeline {
                ranks: self.schedule.num_ranks(),
                intervals: first.intervals,
                comm: first.comm,
                unit: "s".into(),
            },
            boundary_wait_s,
            reduce_wait_s,
        })
    }

    /// The parameters held in this process by name (DualPipe's copies are equal; one is taken):
    /// every distinct parameter of the model when this process runs every rank
    /// ([`Trainer::new`]) without FSDP or tensor parallelism. With FSDP they are 1-D shards (one
    /// replica's wins the name), under tensor parallelism the split ones are one tp rank's
    /// blocks, and in a process of a multi-process run only its rank's: use
    /// [`Trainer::gather_state`] for the whole tensors.
    pub fn parameters(&self) -> BTreeMap<String, Tensor> {
        self.ranks.iter().filter_map(|r| r.parameters().ok()).flatten().collect()
    }

    /// The optimizer state of the parameters held in this process (`adam.m.<name>`,
    /// `adam.v.<name>`), `adam.step` (i64 scalar) and the MoE routing biases; shards with FSDP or
    /// tensor parallelism — see
    /// [`Trainer::parameters`] and [`Trainer::gather_state`].
    ///
    /// # Errors
    /// [`TrainError::Optim`] from [`AdamW::state_dict`](crate::AdamW::state_dict).
    pub fn optimizer_state(&self) -> Result<BTreeMap<String, Tensor>, TrainError> {
        let mut out = BTreeMap::new();
        for r in &self.ranks {
            out.extend(r.optimizer_state()?);
        }
        Ok(out)
    }

    /// Replaces every parameter of every stage with the tensor of the same name in `params` (e.g.
    /// pretrained weights; a tied embedding's copies on the first and last stage both take
    /// `model.embed_tokens.weight`); other names are ignored. Call it before the first step: the
    /// optimizer state is not touched.
    ///
    /// # Errors
    /// [`TrainError::Stage`] naming the first parameter missing or of another shape or dtype;
    /// nothing changes then.
    pub fn load_parameters(&mut self, params: &HashMap<String, Tensor>) -> Result<(), TrainError> {
        for r in &self.ranks {
            r.check_parameters(params)?;
        }
        for r in &mut self.ranks {
            r.load_parameters(params)?;
        }
        Ok(())
    }

    /// Restores parameters and optimizer state saved from [`Trainer::parameters`] and
    /// [`Trainer::optimizer_state`] of a run with the same model and split (any schedule): every
    /// stage takes its parameters (and MoE routing biases), every rank the `adam.*` entries of its
    /// parameters, and the step count continues from `adam.step`.
    ///
    /// # Errors
    /// [`TrainError::Stage`] for a missing or misshapen parameter, [`TrainError::Optim`] for a
    /// missing or inconsistent optimizer entry; nothing changes then.
    pub fn load_state(&mut self, tensors: &HashMap<String, Tensor>) -> Result<(), TrainError> {
        for r in &self.ranks {
            r.check_parameters(tensors)?;
        }
        let optim = self.ranks.iter().map(|r| r.prepare_state(tensors)).collect::<Result<Vec<_>, _>>()?;
        for (r, opt) in self.ranks.iter_mut().zip(optim) {
            r.commit_state(tensors, opt)?;
        }
        self.step = self.ranks.first().map(|r| r.steps_done()).unwrap_or(0);
        Ok(())
    }

    /// The whole model as one single-device graph over `[batch, T]`, with `logits` outputs or the
    /// loss; built once per (batch, logits).
    fn inference_graph(&mut self, batch: usize, logits: bool) -> Result<Arc<Graph>, TrainError> {
        if let Some(g) = self.inference.get(&(batch, logits)) {
            return Ok(Arc::clone(g));
        }
        let model = &self.setup.model;
        let spec = split_layers(model.num_layers(), 1, None).map_err(SetupError::from)?.remove(0);
        let opts =
            StageOptions { logits, ..StageOptions::mixed(batch, self.setup.seq_len, self.setup.dtype) };
        let g = Arc::new(model.build_stage(&spec, &opts).map_err(SetupError::from)?);
        self.inference.insert((batch, logits), Arc::clone(&g));
        Ok(g)
    }

    /// Parameters (gathered to the leader) and buffers for an inference graph; `None` outside
    /// the leader.
    fn inference_env(&mut self) -> Result<Option<Env>, TrainError> {
        let Some(params) = self.gather_state(false)? else { return Ok(None) };
        let mut env = Env::new();
        for (name, shape, data) in self.setup.model.stage_buffers(self.setup.seq_len) {
            let dtype = self.setup.model.buffer_dtype(&name, self.setup.dtype);
            env.insert(name, tensor_from_f64(&data, &shape, dtype)?);
        }
        // The trained MoE balancing biases replace the initial buffers, in the buffers' dtype.
        for (name, t) in params {
            let t = match env.get(&name) {
                Some(initial) => t.to_dtype(initial.dtype())?,
                None => t,
            };
            env.insert(name, t);
        }
        let on_device = |(name, t): (String, Tensor)| Ok((name, t.to_device(&self.setup.device)?));
        Ok(Some(env.into_iter().map(on_device).collect::<candle_core::Result<Env>>()?))
    }

    /// Mean token loss (nats per token) of the current parameters over `batches`, each a pair
    /// (inputs, targets) of `batch × T` row-major token ids, on the leader's device; `None` in
    /// the other processes (every process calls it at the same point).
    ///
    /// # Errors
    /// [`TrainError::Data`] for a batch of the wrong length or no batches.
    pub fn evaluate(
        &mut self,
        batches: &[(Vec<u32>, Vec<u32>)],
        batch: usize,
    ) -> Result<Option<f64>, TrainError> {
        let n = batch * self.setup.seq_len;
        if batches.is_empty() || batches.iter().any(|(x, y)| x.len() != n || y.len() != n) {
            return Err(TrainError::Data(format!(
                "evaluation needs batches of {batch}×{} tokens",
                self.setup.seq_len
            )));
        }
        let Some(mut env) = self.inference_env()? else { return Ok(None) };
        let g = self.inference_graph(batch, false)?;
        // Compiled once for all batches (the interpreter's bits; it keeps the transposed
        // weights' row-major copies from one batch to the next).
        let program = Program::compile(&g);
        let mut sum = 0.0;
        for (x, y) in batches {
            let dev = &self.setup.device;
            env.insert(TOKENS.into(), tensor_u32(x, &[batch, self.setup.seq_len])?.to_device(dev)?);
            env.insert(TARGETS.into(), tensor_u32(y, &[batch, self.setup.seq_len])?.to_device(dev)?);
            let r = program.run_named_with(&g, &env, &RunOptions::default(), None)?;
            let loss = r.output(&g, LOSS).ok_or_else(|| TrainError::Data("no loss output".into()))?;
            sum += to_f64(loss)?[0];
        }
        Ok(Some(sum / batches.len() as f64))
    }

    /// Continues `prompt` by `count` tokens: each step runs the model over the last `T` tokens
    /// (right-padded with 0 while shorter; causal attention keeps the padding invisible) and
    /// draws from the logits at the last real position with [`sample_next`]. On the leader;
    /// `None` in the other processes (every process calls it at the same point).
    ///
    /// # Errors
    /// [`TrainError::Data`] for an empty prompt or a token id outside the vocabulary;
    /// [`TrainError::Sample`] for NaN logits.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        count: usize,
        temperature: f32,
        top_k: usize,
        rng: &mut u64,
    ) -> Result<Option<Vec<u32>>, TrainError> {
        let (t, vocab) = (self.setup.seq_len, self.setup.model.vocab_size());
        if prompt.is_empty() || prompt.iter().any(|&x| x as usize >= vocab) {
            return Err(TrainError::Data(format!("a prompt needs 1 or more token ids below {vocab}")));
        }
        let Some(mut env) = self.inference_env()? else { return Ok(None) };
        let g = self.inference_graph(1, true)?;
        // Compiled once for all tokens: the interpreter copied every transposed weight for every
        // token (`perf` of `train --model small --steps 6`: 15% of the run in those copies).
        let program = Program::compile(&g);
        let mut text = prompt.to_vec();
        for _ in 0..count {
            let window = &text[text.len().saturating_sub(t)..];
            let mut ids = window.to_vec();
            ids.resize(t, 0);
            env.insert(TOKENS.into(), tensor_u32(&ids, &[1, t])?.to_device(&self.setup.device)?);
            let r = program.run_named_with(&g, &env, &RunOptions::default(), None)?;
            let logits = r.output(&g, LOGITS).ok_or_else(|| TrainError::Data("no logits output".into()))?;
            let row: Vec<f32> = logits.get(window.len() - 1)?.to_vec1()?;
            text.push(sample_next(&row, temperature, top_k, rng)?);
        }
        Ok(Some(text.split_off(prompt.len())))
    }
}

/// Of the errors of a step's ranks (in rank order), the one to report: the pipeline error of the
/// rank the others name as failed, else the first error that is not an echo of another rank's
/// abort, else the first.
fn first_train_failure(mut errors: Vec<TrainError>) -> TrainError {
    fn pipeline(e: &TrainError) -> Option<&PipelineError> {
        match e {
            TrainError::Pipeline(p) => Some(p),
            _ => None,
        }
    }
    let echo = |e: &TrainError| {
        pipeline(e).is_some_and(PipelineError::is_aborted)
            || matches!(e, TrainError::Comm(c) if matches!(**c, graphpp_comm::CommError::Aborted { .. }))
    };
    let culprit = errors.iter().filter_map(pipeline).find_map(|p| match p {
        PipelineError::Aborted { failed_rank, .. } => Some(*failed_rank),
        _ => None,
    });
    let pos = errors
        .iter()
        .position(|e| {
            !echo(e) && culprit.is_some_and(|c| pipeline(e).and_then(PipelineError::rank) == Some(c))
        })
        .or_else(|| errors.iter().position(|e| !echo(e)))
        .unwrap_or(0);
    errors.swap_remove(pos)
}
