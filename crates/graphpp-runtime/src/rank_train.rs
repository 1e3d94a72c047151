//! One rank's training step over a [`Comm`]: the rank-local half of [`crate::train::Trainer`]
//! (docs/ARCHITECTURE.md "Runtime"; issue 8).
//!
//! A [`RankTrainer`] owns one rank's [`GraphStages`], its [`AdamW`], its communicator and the
//! lowered schedule. [`RankTrainer::step`] runs the rank's program with [`run_rank`], then, as
//! Megatron-LM does after the last backward, with collectives only:
//! 1. a parameter held on several ranks (DualPipe's two copies, a tied embedding on the first
//!    and last stage) has its gradient summed by an `all_reduce` over the ranks holding it — one
//!    group per parameter name (`copies.<name>`), started in name order on every holder;
//! 2. the global squared L2 norm is an `all_reduce` over the world of a vector with one entry
//!    per distinct parameter (names sorted), each filled in by the parameter's lowest holder
//!    only, so a copy counts once; the entries are then added in name order, which gives the
//!    bitwise value of a single-process [`local_sq_norm`] over all distinct gradients;
//! 3. every gradient is scaled by [`clip_scale`] of that norm;
//! 4. the local AdamW step at [`crate::lr::CosineSchedule::lr_at`].
//!
//! The step loss is an `all_reduce` over the world of a `[2, m]` f64 tensor: row 0 each
//! microbatch's loss where this rank holds the last stage of its route, row 1 a count, so every
//! rank returns the same mean and a microbatch without a loss is detected.
//!
//! The holders of every parameter come from the schedule's placement and each stage's
//! parameter names ([`stage_parameters`]), which are the same on every rank: all ranks agree on
//! the groups and on the order of the collectives.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use graphpp_models::{stage_parameters, StageOptions};
use graphpp_schedule::{generate, lower, Interval, LowerOptions, Schedule};

use crate::clip::{clip_scale, local_sq_norm, scale_grads};
use crate::comm::{Comm, Group, Pending};
use crate::mesh::Mesh;
use crate::optim::{AdamW, OptimError, M_PREFIX, STEP_KEY, V_PREFIX};
use crate::pipeline::{run_rank, RankOptions};
use crate::stage::{env_bytes, sum_by_name, Env, GraphStages, Microbatches};
use crate::train::{TrainError, TrainSetup};
use crate::verify::{rank_worker, stage_specs, VerifyError};

/// Checks that dp divides the batch and the step's size, and builds the lowered schedule of `setup` (the same on every rank).
///
/// # Errors
/// [`TrainError::BatchNotDivisible`] when dp is 0 or does not divide the batch;
/// [`TrainError::Size`] when the schedule or the step would be too large;
/// [`TrainError::Setup`] when the kind cannot serve the shape.
pub fn train_schedule(setup: &TrainSetup) -> Result<Schedule, TrainError> {
    if setup.dp == 0 || !setup.batch.is_multiple_of(setup.dp) {
        return Err(TrainError::BatchNotDivisible { batch: setup.batch, dp: setup.dp });
    }
    let local = setup.batch / setup.dp;
    crate::memory::check_step(&setup.model, setup.kind, &setup.shape, local, setup.seq, false)?;
    let schedule = generate(setup.kind, &setup.shape, &setup.options).map_err(VerifyError::from)?;
    Ok(lower(&schedule, &LowerOptions::default()).map_err(VerifyError::from)?)
}

/// What one rank's step did.
#[derive(Debug, Clone)]
pub struct RankStepReport {
    /// Optimizer steps completed, this one included (1-based).
    pub step: u64,
    /// Step loss: mean over the microbatches of their mean token loss (nats per token); the same
    /// on every rank.
    pub loss: f64,
    /// Global L2 norm of the gradients before clipping (each distinct parameter once); the same
    /// on every rank.
    pub grad_norm: f64,
    /// Learning rate used.
    pub lr: f64,
    /// This rank's measured intervals (seconds since the step's start, `rank` = schedule rank).
    pub intervals: Vec<Interval>,
    /// Peak memory of this rank during the step, bytes (see [`crate::StepReport::peak_bytes`]).
    pub peak_bytes: u64,
}

/// A parameter held on more than one rank: the group of its holders.
#[derive(Debug, Clone)]
struct Copies {
    name: String,
    group: Group,
}

/// One rank of a training run: its stages, optimizer and communicator (see the module doc).
pub struct RankTrainer {
    setup: TrainSetup,
    schedule: Arc<Schedule>,
    comm: Arc<dyn Comm>,
    pipeline: Group,
    world: Group,
    /// The data-parallel group (the same pipeline position in every replica).
    data_parallel: Group,
    /// This rank's replica (`0..dp`).
    replica: usize,
    /// `None` after a failed step (the stages were lost or are inconsistent).
    work: Option<GraphStages>,
    optim: AdamW,
    step: u64,
    /// Parameters of this rank held on several ranks, in name order.
    copies: Vec<Copies>,
    /// Every distinct parameter name of the model, sorted.
    all_names: Vec<String>,
    /// For each of `all_names`, whether this rank is its lowest holder (adds it to the norm).
    counts_here: Vec<bool>,
}

impl std::fmt::Debug for RankTrainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankTrainer")
            .field("rank", &self.comm.rank())
            .field("pipeline", &self.pipeline)
            .field("step", &self.step)
            .field("copies", &self.copies.iter().map(|c| c.group.to_string()).collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

fn mismatch(msg: String) -> TrainError {
    TrainError::Setup(VerifyError::Mismatch(msg))
}

impl RankTrainer {
    /// Builds rank `comm.rank()` of `mesh`: the stages `schedule` (from [`train_schedule`])
    /// places on its pipeline position, with the initial weights of `setup.seed`.
    ///
    /// # Errors
    /// [`TrainError::Setup`] when the mesh, the communicator and the schedule disagree (pp ≠ the
    /// schedule's ranks, world ≠ the communicator's), the layers do not divide into the stages,
    /// or a graph fails to build; [`TrainError::Optim`] for bad AdamW settings.
    pub fn new(
        setup: TrainSetup,
        schedule: Arc<Schedule>,
        mesh: Mesh,
        comm: Arc<dyn Comm>,
    ) -> Result<Self, TrainError> {
        let rank = comm.rank();
        if mesh.pp() != schedule.num_ranks() || mesh.world() != comm.world() {
            return Err(mismatch(format!(
                "mesh pp {} × dp {} for a schedule of {} ranks over a world of {}",
                mesh.pp(),
                mesh.dp(),
                schedule.num_ranks(),
                comm.world()
            )));
        }
        let pipeline = mesh.pipeline_group(rank).map_err(|e| mismatch(e.to_string()))?;
        let world = Group::world(comm.world())?;
        let data_parallel = mesh.data_parallel_group(rank).map_err(|e| mismatch(e.to_string()))?;
        let replica = mesh.coords(rank).map_err(|e| mismatch(e.to_string()))?.dp;
        if setup.dp != mesh.dp() || setup.dp == 0 || !setup.batch.is_multiple_of(setup.dp) {
            return Err(TrainError::BatchNotDivisible { batch: setup.batch, dp: mesh.dp() });
        }
        let me =
            pipeline.index_of(rank).ok_or_else(|| mismatch(format!("rank {rank} outside {pipeline}")))?;
        let specs = stage_specs(&setup.model, setup.kind, &setup.shape, setup.layers_per_stage.as_deref())?;
        let opts = StageOptions {
            recompute: setup.recompute,
            ..StageOptions::mixed(setup.batch / setup.dp, setup.seq, setup.dtype)
        };
        let empty = Arc::new(Microbatches { tokens: Vec::new(), targets: Vec::new() });
        let work = rank_worker(&setup.model, &schedule, &specs, &opts, setup.seed, None, empty, me)?;
        // Holders (schedule ranks) of every parameter name.
        let mut holders: BTreeMap<String, BTreeSet<usize>> = BTreeMap::new();
        for (stage, ranks) in schedule.placement() {
            let spec =
                specs.get(stage).ok_or_else(|| mismatch(format!("stage {stage}: no model stage for it")))?;
            let names: BTreeSet<String> =
                stage_parameters(&setup.model, spec).into_iter().map(|(n, _)| n).collect();
            if let Some(st) = work.stages().get(&stage) {
                let held: BTreeSet<String> = st.parameter_names().iter().cloned().collect();
                if held != names {
                    return Err(mismatch(format!("stage {stage}: parameters differ from the model's stage")));
                }
            }
            for n in names {
                holders.entry(n).or_default().extend(ranks.iter().copied());
            }
        }
        let mut copies = Vec::new();
        let mut all_names = Vec::with_capacity(holders.len());
        let mut counts_here = Vec::with_capacity(holders.len());
        for (name, hs) in holders {
            if hs.len() > 1 && hs.contains(&me) {
                let ranks = hs.iter().map(|&r| pipeline.ranks()[r]).collect();
                copies
                    .push(Copies { group: Group::new(format!("copies.{name}"), ranks)?, name: name.clone() });
            }
            counts_here.push(hs.first() == Some(&me));
            all_names.push(name);
        }
        let optim = AdamW::new(setup.adamw)?;
        Ok(RankTrainer {
            setup,
            schedule,
            comm,
            pipeline,
            world,
            data_parallel,
            replica,
            work: Some(work),
            optim,
            step: 0,
            copies,
            all_names,
            counts_here,
        })
    }

    /// This rank's world rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// The lowered schedule every step runs.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// This rank's stages (`None` after a failed step).
    pub fn stages(&self) -> Option<&GraphStages> {
        self.work.as_ref()
    }

    /// Optimizer steps completed.
    pub fn steps_done(&self) -> u64 {
        self.step
    }

    /// Groups of the parameters this rank holds with other ranks (`copies.<name>[ranks]`), in
    /// name order.
    pub fn copy_groups(&self) -> Vec<&Group> {
        self.copies.iter().map(|c| &c.group).collect()
    }

    /// One training step over `data` (all m microbatches; the rank reads those its first stages
    /// need), intervals measured from now. See [`RankTrainer::step_at`].
    ///
    /// # Errors
    /// Those of [`RankTrainer::step_at`].
    pub fn step(&mut self, data: Arc<Microbatches>) -> Result<RankStepReport, TrainError> {
        self.step_at(data, Instant::now())
    }

    /// One training step (see the module doc), intervals measured from `start`. Every rank of
    /// the world must call it for the same step.
    ///
    /// # Errors
    /// [`TrainError::Data`] for a wrong microbatch count or a microbatch without a loss;
    /// [`TrainError::Poisoned`] after an earlier failed step; [`TrainError::Setup`] wrapping the
    /// pipeline error (naming rank, step and action); [`TrainError::Comm`] for a failed
    /// collective; [`TrainError::Optim`] for a non-finite gradient norm (the step is not
    /// applied). On any failure after the pipeline run the communicator is aborted, so the other
    /// ranks stop too, and this rank is poisoned.
    pub fn step_at(&mut self, data: Arc<Microbatches>, start: Instant) -> Result<RankStepReport, TrainError> {
        let m = self.setup.shape.microbatches;
        if data.len() != m || data.targets.len() != m {
            return Err(TrainError::Data(format!(
                "{} microbatches given, the schedule runs {m}",
                data.len()
            )));
        }
        let data = if self.setup.dp > 1 { Arc::new(self.slice(&data)?) } else { data };
        let mut work = self.work.take().ok_or(TrainError::Poisoned)?;
        work.start_step(data);
        let opts = RankOptions { timeout: self.setup.timeout, start };
        let outcome =
            run_rank(&self.schedule, &self.pipeline, work, &*self.comm, &opts).map_err(VerifyError::from)?;
        let mut work = outcome.work;
        match self.update(&mut work) {
            Ok((loss, grad_norm, lr, peak_bytes)) => {
                self.work = Some(work);
                Ok(RankStepReport {
                    step: self.step,
                    loss,
                    grad_norm,
                    lr,
                    intervals: outcome.intervals,
                    peak_bytes,
                })
            }
            Err(e) => {
                self.comm.abort(&format!("rank {}: {e}", self.comm.rank()));
                Err(e)
            }
        }
    }

    /// This replica's rows of every microbatch (`B / dp` sequences from row `replica · B / dp`).
    fn slice(&self, data: &Microbatches) -> Result<Microbatches, TrainError> {
        let b = self.setup.batch / self.setup.dp;
        let cut = |ts: &[Tensor]| -> Result<Vec<Tensor>, TrainError> {
            ts.iter()
                .enumerate()
                .map(|(mb, t)| {
                    if t.dims().first() != Some(&self.setup.batch) {
                        return Err(TrainError::Data(format!(
                            "microbatch {mb} has shape {:?}, [{}, T] expected",
                            t.dims(),
                            self.setup.batch
                        )));
                    }
                    Ok(t.narrow(0, self.replica * b, b)?)
                })
                .collect()
        };
        Ok(Microbatches { tokens: cut(&data.tokens)?, targets: cut(&data.targets)? })
    }

    /// The collectives and the optimizer step after the pipeline run; returns (loss, norm, lr,
    /// peak bytes).
    fn update(&mut self, work: &mut GraphStages) -> Result<(f64, f64, f64, u64), TrainError> {
        let timeout = self.setup.timeout;
        let m = self.setup.shape.microbatches;
        // Loss: [2, m] (loss, count) summed over the world.
        let mut rows = vec![0.0f64; 2 * m];
        for (&mb, &l) in work.losses() {
            if mb < m {
                rows[mb] = l;
                rows[m + mb] = 1.0;
            }
        }
        let t = Tensor::from_vec(rows, (2, m), &Device::Cpu)?;
        let summed = self.comm.all_reduce(&self.world, &t)?.wait(timeout)?.to_dtype(DType::F64)?;
        let summed: Vec<Vec<f64>> = summed.to_vec2()?;
        let replicas = self.setup.dp as f64;
        if let Some(mb) = summed[1].iter().position(|&c| c != replicas) {
            return Err(TrainError::Data(format!(
                "microbatch {mb} has {} losses, {replicas} expected",
                summed[1][mb]
            )));
        }
        let loss = summed[0].iter().sum::<f64>() / (m * self.setup.dp) as f64;
        let params_bytes = env_bytes(
            work.stages().values().flat_map(|s| s.parameter_names().iter().filter_map(|n| s.state().get(n))),
        );
        let peak = (work.state_bytes() + 2 * params_bytes + work.peak_activation_bytes()) as u64;
        // Sum of the copies' gradients.
        let local: Vec<(String, Tensor)> =
            work.stages_mut().values_mut().flat_map(|s| s.take_grads()).collect();
        let mut grads = sum_by_name(local)?;
        let pending: Vec<(String, Pending<Tensor>)> = self
            .copies
            .iter()
            .map(|c| {
                let g = grads.get(&c.name).ok_or_else(|| mismatch(format!("no gradient of {}", c.name)))?;
                Ok((c.name.clone(), self.comm.all_reduce(&c.group, g)?))
            })
            .collect::<Result<_, TrainError>>()?;
        for (name, p) in pending {
            grads.insert(name, p.wait(timeout)?);
        }
        // Data parallelism: the mean over the replicas, parameter by parameter in name order.
        if self.setup.dp > 1 {
            let mut names: Vec<String> = grads.keys().cloned().collect();
            names.sort();
            let pending = names
                .into_iter()
                .map(|n| {
                    let p = self.comm.all_reduce(&self.data_parallel, &grads[&n])?;
                    Ok((n, p))
                })
                .collect::<Result<Vec<_>, TrainError>>()?;
            let inv = 1.0 / self.setup.dp as f64;
            for (name, p) in pending {
                grads.insert(name, p.wait(timeout)?.affine(inv, 0.0)?);
            }
        }
        // Global norm: one entry per distinct parameter, from its lowest holder in replica 0.
        let mut sq = vec![0.0f64; self.all_names.len()];
        for (i, name) in self.all_names.iter().enumerate() {
            if self.counts_here[i] && self.replica == 0 {
                let g = grads.get(name).ok_or_else(|| mismatch(format!("no gradient of {name}")))?;
                sq[i] = local_sq_norm(&HashMap::from([(name.clone(), g.clone())]))?;
            }
        }
        let n = sq.len();
        let sq_t = Tensor::from_vec(sq, n, &Device::Cpu)?;
        let sq_all: Vec<f64> = self.comm.all_reduce(&self.world, &sq_t)?.wait(timeout)?.to_vec1()?;
        let sq = sq_all.iter().fold(0.0, |a, &x| a + x);
        if let Some(max_norm) = self.setup.max_grad_norm {
            scale_grads(&mut grads, clip_scale(sq, max_norm)?)?;
        } else if !sq.is_finite() {
            return Err(OptimError::NonFiniteNorm { sq_norm: sq }.into());
        }
        let lr = self.setup.lr.lr_at(self.step + 1);
        let mut params: Env = work.stages().values().flat_map(|s| s.parameters()).collect();
        let grads: Env = params.keys().filter_map(|n| grads.get(n).map(|g| (n.clone(), g.clone()))).collect();
        self.optim.step(&mut params, &grads, lr)?;
        for s in work.stages_mut().values_mut() {
            s.set_parameters(&params)?;
        }
        self.step += 1;
        Ok((loss, sq.sqrt(), lr, peak))
    }

    /// This rank's parameters by name (copies on one rank are equal; one is taken).
    ///
    /// # Errors
    /// [`TrainError::Poisoned`] after a failed step.
    pub fn parameters(&self) -> Result<BTreeMap<String, Tensor>, TrainError> {
        let w = self.work.as_ref().ok_or(TrainError::Poisoned)?;
        Ok(w.stages().values().flat_map(|s| s.parameters()).collect())
    }

    /// This rank's optimizer state (`adam.m.<name>`, `adam.v.<name>`, `adam.step`).
    ///
    /// # Errors
    /// [`TrainError::Optim`] from [`AdamW::state_dict`].
    pub fn optimizer_state(&self) -> Result<BTreeMap<String, Tensor>, TrainError> {
        Ok(self.optim.state_dict()?.into_iter().collect())
    }

    /// Checks that every stage of this rank finds its parameters in `params`.
    ///
    /// # Errors
    /// [`TrainError::Stage`] naming the first missing or misshapen parameter;
    /// [`TrainError::Poisoned`].
    pub fn check_parameters(&self, params: &HashMap<String, Tensor>) -> Result<(), TrainError> {
        let w = self.work.as_ref().ok_or(TrainError::Poisoned)?;
        for s in w.stages().values() {
            s.check_parameters(params)?;
        }
        Ok(())
    }

    /// Replaces every parameter of this rank's stages with the tensor of the same name in
    /// `params`; the optimizer state is not touched.
    ///
    /// # Errors
    /// As [`RankTrainer::check_parameters`]; nothing changes then.
    pub fn load_parameters(&mut self, params: &HashMap<String, Tensor>) -> Result<(), TrainError> {
        self.check_parameters(params)?;
        let w = self.work.as_mut().ok_or(TrainError::Poisoned)?;
        for s in w.stages_mut().values_mut() {
            s.set_parameters(params)?;
        }
        Ok(())
    }

    /// The optimizer this rank would have after [`RankTrainer::load_state`] of `tensors`
    /// (checks everything, changes nothing).
    ///
    /// # Errors
    /// As [`RankTrainer::load_state`].
    pub fn prepare_state(&self, tensors: &HashMap<String, Tensor>) -> Result<AdamW, TrainError> {
        self.check_parameters(tensors)?;
        let w = self.work.as_ref().ok_or(TrainError::Poisoned)?;
        let names = w.stages().values().flat_map(|s| s.parameter_names().iter());
        let keys = std::iter::once(STEP_KEY.to_string())
            .chain(names.flat_map(|n| [format!("{M_PREFIX}{n}"), format!("{V_PREFIX}{n}")]));
        let state: HashMap<String, Tensor> =
            keys.filter_map(|k| tensors.get(&k).map(|t| (k, t.clone()))).collect();
        let mut opt = self.optim.clone();
        opt.load_state_dict(&state)?;
        Ok(opt)
    }

    /// Restores this rank's parameters and optimizer state from a saved state (see
    /// [`crate::Trainer::load_state`]); the step count continues from `adam.step`.
    ///
    /// # Errors
    /// [`TrainError::Stage`] for a missing or misshapen parameter, [`TrainError::Optim`] for a
    /// missing or inconsistent optimizer entry; nothing changes then.
    pub fn load_state(&mut self, tensors: &HashMap<String, Tensor>) -> Result<(), TrainError> {
        let opt = self.prepare_state(tensors)?;
        self.commit_state(tensors, opt)
    }

    /// Applies a state checked by [`RankTrainer::prepare_state`].
    pub(crate) fn commit_state(
        &mut self,
        tensors: &HashMap<String, Tensor>,
        opt: AdamW,
    ) -> Result<(), TrainError> {
        let w = self.work.as_mut().ok_or(TrainError::Poisoned)?;
        for s in w.stages_mut().values_mut() {
            s.set_parameters(tensors)?;
        }
        self.step = opt.step_count();
        self.optim = opt;
        Ok(())
    }
}
