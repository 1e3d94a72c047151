//! One rank's training step over a [`Comm`]: the rank-local half of [`crate::train::Trainer`]
//! (docs/ARCHITECTURE.md "Runtime").
//!
//! A [`RankTrainer`] owns one rank's [`GraphStages`], its [`AdamW`], its communicator and the
//! lowered schedule. [`RankTrainer::step`] runs the rank's program with [`run_rank`], then, as
//! Megatron-LM does after the last backward, with collectives only:
//! 1. a parameter held on several ranks (DualPipe's two copies, a tied embedding on the first
//!    and last stage; under sequence parallelism a replicated parameter on every tp rank) has
//!    its gradient summed by an `all_reduce` over the ranks holding it — one group per parameter
//!    name (`copies.<name>`), started in name order on every holder;
//! 2. the global squared L2 norm is an `all_reduce` over the world of a vector with one entry
//!    per distinct parameter (names sorted), each filled in by the parameter's lowest holder
//!    only, so a copy counts once (a parameter split by tensor parallelism: by every tp rank,
//!    each its block's sum); the entries are then added in name order, which gives the bitwise
//!    value of a single-process [`local_sq_norm`] over all distinct gradients without tensor
//!    parallelism;
//! 3. every gradient is scaled by [`clip_scale`] of that norm;
//! 4. the local AdamW step at [`crate::optim::lr::CosineSchedule::lr_at`].
//!
//! The step loss is an `all_reduce` over the world of one f64 vector: each microbatch's loss
//! where this rank holds the last stage of its route, a count per microbatch (so every rank
//! returns the same mean and a microbatch without a loss is detected), each rank's peak and
//! resident bytes at its own index, and the tokens each expert of each MoE layer received where
//! this rank ran the layer (summed: the step's global load). After the optimizer step each MoE
//! layer's routing bias moves by ±γ against that load ([`RankTrainer`]'s `balance_experts`,
//! DeepSeek-V3's auxiliary-loss-free balancing), identically on every copy and replica.
//!
//! The holders of every parameter come from the schedule's placement and each stage's
//! parameter names ([`stage_parameters`]), which are the same on every rank: all ranks agree on
//! the groups and on the order of the collectives.

mod collectives;
mod state;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use graphpp_schedule::{CommSpan, Interval, Schedule};

use graphpp_comm::mesh::Coords;

use crate::optim::clip::{clip_scale, local_sq_norm, scale_grads};
use crate::optim::{AdamW, OptimError, M_PREFIX, STEP_KEY, V_PREFIX};
use crate::pipeline::data_parallel::DataParallel;
use crate::pipeline::stage::{env_bytes, sum_by_name, Env, GraphStages, Microbatches, StageError};
use crate::pipeline::{run_rank, RankOptions, RankOutcome};
use crate::train::build::StageBuild;
use crate::train::error::SetupError;
use crate::train::error::TrainError;
use crate::train::setup::TrainSetup;
use graphpp_comm::mesh::Mesh;
use graphpp_comm::{Comm, Group, Pending, Tag};

/// The figures of one step that every rank agrees on: the loss, the norm, the learning rate,
/// every rank's bytes, post-validation's verdict and the experts' load. Part of a rank's report
/// ([`RankStepReport`]) and of the process's ([`crate::StepReport`]).
#[derive(Debug, Clone, PartialEq)]
pub struct StepStats {
    /// Optimizer steps completed, this one included (1-based).
    pub step: u64,
    /// Step loss: mean over the microbatches of their mean token loss (nats per token).
    pub loss: f64,
    /// The MoE layers' auxiliary balance losses, summed over the layers and averaged as `loss`
    /// (0 without one; [`graphpp_models::MoeConfig::aux_loss_alpha`]); part of the objective
    /// the gradients are of, not of `loss`.
    pub aux_loss: f64,
    /// The multi-token-prediction module's cross-entropy (of each token's second next token),
    /// averaged as `loss` (0 without the module; [`graphpp_models::MoeConfig::mtp_loss_weight`]):
    /// λ times it is part of the objective, not of `loss` or `aux_loss`.
    pub mtp_loss: f64,
    /// Global L2 norm of the gradients before clipping (each distinct parameter once).
    pub grad_norm: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Peak memory of every rank during the step, bytes (index = world rank): parameters,
    /// buffers, gradient accumulators and AdamW moments, plus the rank's activation peak
    /// ([`GraphStages::peak_activation_bytes`]). Logical tensor sizes, not allocator figures.
    pub peak_bytes: Vec<u64>,
    /// Resident training state of every rank, bytes (index = world rank): its distinct
    /// parameters, their gradients and the two AdamW moments, all f32 — with FSDP, the shards.
    pub resident_bytes: Vec<u64>,
    /// Whether post-validation rolled the optimistic optimizer step back (clipping applied, so
    /// the step was redone with the clipped gradients).
    pub rolled_back: bool,
    /// Tokens routed to each expert in the step, per MoE layer in
    /// [`graphpp_models::Model::moe_layers`] order, summed over the microbatches and the
    /// data-parallel replicas (empty for a dense model).
    pub expert_load: Vec<Vec<u64>>,
}

/// What one rank's step did.
#[derive(Debug, Clone)]
pub struct RankStepReport {
    /// The step's figures, the same on every rank.
    pub stats: StepStats,
    /// Measured intervals (seconds since the step's start on the rank that ran them, `rank` =
    /// schedule rank): on the leader (world rank 0) those of every rank of replica 0 (tp index
    /// 0), gathered;
    /// on any other rank its own.
    pub intervals: Vec<Interval>,
    /// The in-graph collectives of those ranks' actions (expert parallelism's all-to-alls),
    /// same clock and ranks as `intervals`.
    pub comm: Vec<CommSpan>,
    /// Seconds this rank was blocked at the iteration boundary: waiting for the world-wide loss
    /// and gradient-norm reductions (what `--post-validate` overlaps with the optimizer step).
    pub boundary_wait_s: f64,
    /// Seconds this rank waited, after its pipeline run, for the data-parallel gradient
    /// reductions its REDUCE_GRAD actions started (the part of them not hidden behind compute;
    /// 0 without data parallelism).
    pub reduce_wait_s: f64,
}

/// What [`RankTrainer::update`] did.
struct Update {
    sums: StepSums,
    norm: f64,
    lr: f64,
    /// Time blocked on the world-wide loss and norm reductions.
    waited: Duration,
    /// Time blocked on the data-parallel gradient reductions after the pipeline run.
    reduce_wait: Duration,
    rolled_back: bool,
}

/// The step's world-wide sums ([`RankTrainer::finish_loss`]).
struct StepSums {
    /// Mean cross-entropy over the microbatches and replicas.
    loss: f64,
    /// Mean over the microbatches and replicas of the MoE layers' auxiliary losses, summed.
    aux_loss: f64,
    /// Mean over the microbatches and replicas of the multi-token-prediction cross-entropy.
    mtp_loss: f64,
    /// Each rank's peak bytes (index = world rank).
    peak: Vec<u64>,
    /// Each rank's resident bytes.
    resident: Vec<u64>,
    /// Tokens per expert of each MoE layer.
    expert_load: Vec<Vec<f64>>,
}

/// What a [`Tag::Gather`] message carries (its tag's `what`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gathered {
    /// A step's intervals: `[n, 2]` f64 (start, end) in program order.
    Intervals = 0,
    /// A parameter or optimizer-moment tensor, in the sender's [`RankTrainer::owned`] order.
    State = 1,
    /// A step's in-graph collectives: `[k, 4]` f64 (program index of the action, start, wait,
    /// end), then their labels as one u8 tensor, `\n`-separated.
    Comm = 2,
}

/// A rank's in-graph collectives as two tensors for the leader: `[k, 4]` f64 (index of the
/// action in `program`, start, wait, end) and the labels as one u8 tensor, `\n`-separated.
fn encode_comm(
    program: &[graphpp_schedule::Action],
    comm: &[CommSpan],
) -> Result<(Tensor, Tensor), TrainError> {
    let index = |c: &CommSpan| program.iter().position(|a| *a == c.action).unwrap_or(usize::MAX);
    let times: Vec<f64> = comm.iter().flat_map(|c| [index(c) as f64, c.start, c.wait, c.end]).collect();
    let labels = comm.iter().map(|c| c.label.as_str()).collect::<Vec<_>>().join("\n").into_bytes();
    let n = labels.len();
    Ok((Tensor::from_vec(times, (comm.len(), 4), &Device::Cpu)?, Tensor::from_vec(labels, n, &Device::Cpu)?))
}

/// [`encode_comm`] undone for schedule rank `pp`. Errors: what does not fit (as text).
fn decode_comm(
    program: &[graphpp_schedule::Action],
    pp: usize,
    times: &Tensor,
    labels: &Tensor,
) -> Result<Vec<CommSpan>, String> {
    let times: Vec<Vec<f64>> = times.to_vec2().map_err(|e| e.to_string())?;
    let labels = String::from_utf8(labels.to_vec1::<u8>().map_err(|e| e.to_string())?)
        .map_err(|e| format!("comm labels: {e}"))?;
    let labels: Vec<&str> = if times.is_empty() { Vec::new() } else { labels.split('\n').collect() };
    if labels.len() != times.len() {
        return Err(format!("{} collectives and {} labels", times.len(), labels.len()));
    }
    times
        .iter()
        .zip(labels)
        .map(|(t, label)| {
            let action = *program
                .get(t[0] as usize)
                .ok_or_else(|| format!("a collective of action {}, not in its program", t[0]))?;
            Ok(CommSpan { rank: pp, action, start: t[1], wait: t[2], end: t[3], label: label.into() })
        })
        .collect()
}

/// What [`RankTrainer::send_to_leader`] gathers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Gather {
    /// Each parameter's gradient.
    Gradients,
    /// Parameters and MoE balancing biases (inference, `--init-from` exports).
    Parameters,
    /// Parameters, biases, AdamW moments and step (checkpoints).
    Training,
}

/// The parameter an optimizer-state key belongs to (`adam.m.<name>` → `<name>`); a parameter
/// name is its own.
fn parameter_of(key: &str) -> &str {
    key.strip_prefix(M_PREFIX).or_else(|| key.strip_prefix(V_PREFIX)).unwrap_or(key)
}

fn gather_tag(what: Gathered, item: usize) -> Tag {
    Tag::Gather { what: what as u8, item }
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
    /// This rank's replica (`0..dp`).
    replica: usize,
    /// This rank's position in its tensor-parallel group (`0..tp`); the ranks of index 0 report
    /// the losses and own the replicated parameters.
    tp_index: usize,
    mesh: Mesh,
    /// For every world rank, the parameters it owns — it is their lowest holder in their lead
    /// replica (0, or a routed expert's block) — and sends with their optimizer moments to the
    /// leader, names sorted.
    owned: BTreeMap<usize, Vec<String>>,
    /// World rank → the MoE balancing biases (buffers) it sends in [`RankTrainer::gather_state`]
    /// with the optimizer state: each bias's lowest holder in replica 0.
    bias_owned: BTreeMap<usize, Vec<String>>,
    /// `None` after a failed step (the stages were lost or are inconsistent).
    work: Option<GraphStages>,
    optim: AdamW,
    step: u64,
    /// Parameters of this rank held on several ranks, in name order.
    copies: Vec<Copies>,
    /// Every distinct parameter name of the model, sorted.
    all_names: Vec<String>,
    /// For each of `all_names`, whether this rank is its lowest pipeline holder — and, unless
    /// tensor parallelism splits the parameter, of tp index 0 — (adds it to the norm when its
    /// replica is the parameter's lead replica).
    counts_here: Vec<bool>,
    /// For each of `all_names`, the lowest replica holding it: 0, or a routed expert's block
    /// under expert parallelism.
    lead_replica: Vec<usize>,
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
    TrainError::Setup(SetupError::Inconsistent(msg))
}

/// Checks that the mesh, the communicator, the schedule and the setup describe one layout: pp
/// = the schedule's ranks, world = the communicator's, the setup's dp, ep and tp the mesh's (dp
/// dividing the microbatch size, tp the model's heads and width: [`TrainSetup::check_tp`]).
///
/// # Errors
/// [`TrainError::Setup`] ([`SetupError::Inconsistent`]); [`TrainError::BatchNotDivisible`].
fn check_layout(
    setup: &TrainSetup,
    schedule: &Schedule,
    mesh: &Mesh,
    comm: &dyn Comm,
) -> Result<(), TrainError> {
    if mesh.pp() != schedule.num_ranks() || mesh.world() != comm.world() {
        return Err(mismatch(format!(
            "mesh pp {} × dp {} × tp {} for a schedule of {} ranks over a world of {}",
            mesh.pp(),
            mesh.dp(),
            mesh.tp(),
            schedule.num_ranks(),
            comm.world()
        )));
    }
    if (mesh.dp(), mesh.ep(), mesh.tp()) != (setup.dp, setup.ep, setup.tp) {
        return Err(mismatch(format!(
            "mesh dp {} ep {} tp {} for a run of dp {} ep {} tp {}",
            mesh.dp(),
            mesh.ep(),
            mesh.tp(),
            setup.dp,
            setup.ep,
            setup.tp
        )));
    }
    setup.check_dp()?;
    setup.check_tp()
}

/// The stages of pipeline position `me` with their initial weights, the graphs' communicator
/// under expert parallelism and the data-parallel reductions (expert gradients over their
/// holders).
///
/// # Errors
/// [`TrainError::Setup`] when the layers do not divide into the stages, a graph fails to build
/// or a group cannot be formed.
fn build_work(
    setup: &TrainSetup,
    schedule: &Schedule,
    mesh: &Mesh,
    comm: &Arc<dyn Comm>,
    me: usize,
) -> Result<GraphStages, TrainError> {
    let rank = comm.rank();
    let coords = mesh.coords(rank).map_err(SetupError::from)?;
    let ep_index = mesh.ep_index(rank).map_err(SetupError::from)?;
    let (specs, opts) = crate::train::build::run_stages(setup, (ep_index, coords.tp))?;
    let empty = Arc::new(Microbatches { tokens: Vec::new(), targets: Vec::new() });
    let build = StageBuild {
        model: &*setup.model,
        specs: &specs,
        opts: &opts,
        seed: setup.seed,
        given: None,
        device: &setup.device,
    };
    let mut work = build.rank(schedule, empty, me)?;
    if setup.ep > 1 || setup.tp > 1 {
        let (comm, mesh, timeout) = (Arc::clone(comm), *mesh, setup.timeout);
        work.set_graph_comm(crate::pipeline::stage::StageComm { comm, mesh, timeout });
    }
    if setup.dp > 1 {
        let data_parallel = mesh.data_parallel_group(rank).map_err(SetupError::from)?;
        let mut dp = DataParallel::new(Arc::clone(comm), data_parallel, setup.fsdp, setup.timeout)?;
        if setup.ep > 1 {
            let mine = work.stages().values().flat_map(|s| s.parameter_names().iter().cloned());
            let experts = mine.filter(|n| setup.model.expert_of(n).is_some()).collect();
            let group = mesh.expert_data_parallel_group(rank).map_err(SetupError::from)?;
            dp.set_expert_parallel(group, experts)?;
        }
        work.set_data_parallel(dp)?;
    }
    Ok(work)
}

/// Who holds what, over every expert block: the schedule ranks of every parameter name, the
/// lowest replica (expert block) holding each, and the lowest schedule rank of every MoE
/// balancing bias. The same on every rank.
struct Holders {
    holders: BTreeMap<String, BTreeSet<usize>>,
    lead: BTreeMap<String, usize>,
    bias_holders: BTreeMap<String, usize>,
}

impl Holders {
    /// The holders under `schedule`'s placement (the same for every tensor-parallel index:
    /// names, not shapes); checks that this rank's stages in `work` (expert block `ep_index`,
    /// tensor-parallel shard `tp_index`) hold exactly their model stage's parameters.
    ///
    /// # Errors
    /// [`TrainError::Setup`] ([`SetupError::Inconsistent`]) for a schedule stage without a
    /// model stage or a stage whose parameters differ.
    fn of(
        setup: &TrainSetup,
        schedule: &Schedule,
        work: &GraphStages,
        (ep_index, tp_index): (usize, usize),
    ) -> Result<Self, TrainError> {
        let mut h =
            Holders { holders: BTreeMap::new(), lead: BTreeMap::new(), bias_holders: BTreeMap::new() };
        for index in 0..setup.ep {
            let (specs, _) = crate::train::build::run_stages(setup, (index, tp_index))?;
            for (stage, ranks) in schedule.placement() {
                let spec = specs
                    .get(stage)
                    .ok_or_else(|| mismatch(format!("stage {stage}: no model stage for it")))?;
                for bias in
                    setup.model.stage_layers(spec).into_iter().filter_map(|l| setup.model.balance_bias(l))
                {
                    let first = ranks.iter().copied().min().unwrap_or_default();
                    let e = h.bias_holders.entry(bias).or_insert(first);
                    *e = (*e).min(first);
                }
                let names: BTreeSet<String> =
                    setup.model.stage_parameters(spec).into_iter().map(|(n, _)| n).collect();
                if index == ep_index {
                    if let Some(st) = work.stages().get(&stage) {
                        let held: BTreeSet<String> = st.parameter_names().iter().cloned().collect();
                        if held != names {
                            return Err(mismatch(format!(
                                "stage {stage}: parameters differ from the model's stage"
                            )));
                        }
                    }
                }
                for n in names {
                    h.lead.entry(n.clone()).or_insert(index);
                    h.holders.entry(n).or_default().extend(ranks.iter().copied());
                }
            }
        }
        Ok(h)
    }
}

impl RankTrainer {
    /// Builds rank `comm.rank()` of `mesh`: the stages `schedule` (from [`TrainSetup::lowered_schedule`])
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
        let comm: Arc<dyn Comm> = match setup.link {
            Some(link) => Arc::new(graphpp_comm::EmulatedComm::new(comm, link)),
            None => comm,
        };
        let rank = comm.rank();
        check_layout(&setup, &schedule, &mesh, &*comm)?;
        let pipeline = mesh.pipeline_group(rank).map_err(SetupError::from)?;
        let world = Group::world(comm.world())?;
        let Coords { dp: replica, tp: tp_index, .. } = mesh.coords(rank).map_err(SetupError::from)?;
        let me =
            pipeline.index_of(rank).ok_or_else(|| mismatch(format!("rank {rank} outside {pipeline}")))?;
        let ep_index = mesh.ep_index(rank).map_err(SetupError::from)?;
        let work = build_work(&setup, &schedule, &mesh, &comm, me)?;
        let mine: BTreeSet<String> =
            work.stages().values().flat_map(|s| s.parameter_names().iter().cloned()).collect();
        let held = Holders::of(&setup, &schedule, &work, (ep_index, tp_index))?;
        let mut copies = Vec::new();
        let mut all_names = Vec::with_capacity(held.holders.len());
        let mut counts_here = Vec::with_capacity(held.holders.len());
        let mut lead_replica = Vec::with_capacity(held.holders.len());
        let mut owned: BTreeMap<usize, Vec<String>> = BTreeMap::new();
        for (name, hs) in held.holders {
            let lead = held.lead[&name];
            // Tensor-parallel shards are gathered whole in each group first; tp index 0 sends.
            if let Some(&first) = hs.first() {
                let owner = mesh.rank_of(Coords { pp: first, dp: lead, tp: 0 }).map_err(SetupError::from)?;
                owned.entry(owner).or_default().push(name.clone());
            }
            let here = mine.contains(&name);
            let split = setup.model.tensor_parallel_split(&name, setup.tp).filter(|_| setup.tp > 1);
            // A partial gradient on several tp ranks is summed over them: under sequence
            // parallelism a replicated parameter's (read by sequence shards), and a block held
            // by several ranks (replicated key/value heads).
            let replicas = split.map_or(1, |s| s.replicas);
            let holders = graphpp_models::TensorShard::new(tp_index, setup.tp).holders(replicas);
            let tps = match split {
                None if setup.sequence_parallel => 0..setup.tp,
                _ => holders.clone(),
            };
            if hs.len() * tps.len() > 1 && here {
                let ranks = hs
                    .iter()
                    .flat_map(|&pp| tps.clone().map(move |tp| Coords { dp: replica, pp, tp }))
                    .map(|c| mesh.rank_of(c))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(SetupError::from)?;
                copies
                    .push(Copies { group: Group::new(format!("copies.{name}"), ranks)?, name: name.clone() });
            }
            // The norm counts a replicated parameter at tp index 0, a split one at the first
            // holder of each block.
            let counted = match split {
                Some(_) => tp_index == holders.start,
                None => tp_index == 0,
            };
            counts_here.push(hs.first() == Some(&me) && here && counted);
            lead_replica.push(lead);
            all_names.push(name);
        }
        let mut bias_owned: BTreeMap<usize, Vec<String>> = BTreeMap::new();
        for (bias, first) in held.bias_holders {
            let owner = mesh.rank_of(Coords::at(0, first)).map_err(SetupError::from)?;
            bias_owned.entry(owner).or_default().push(bias);
        }
        let optim = AdamW::new(setup.adamw)?;
        Ok(RankTrainer {
            setup,
            schedule,
            comm,
            pipeline,
            world,
            replica,
            tp_index,
            mesh,
            owned,
            bias_owned,
            work: Some(work),
            optim,
            step: 0,
            copies,
            all_names,
            counts_here,
            lead_replica,
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
    /// [`TrainError::Poisoned`] after an earlier failed step; [`TrainError::Pipeline`]: the
    /// pipeline error (naming rank, step and action); [`TrainError::Comm`] for a failed
    /// collective; [`TrainError::Optim`] for a non-finite gradient norm (the step is not
    /// applied). On any failure after the pipeline run the communicator is aborted, so the other
    /// ranks stop too, and this rank is poisoned.
    pub fn step_at(&mut self, data: Arc<Microbatches>, start: Instant) -> Result<RankStepReport, TrainError> {
        let outcome = self.run_pipeline(data, start)?;
        let mut work = outcome.work;
        let updated = self
            .update(&mut work)
            .and_then(|u| Ok((u, self.gather_timeline(outcome.intervals, outcome.comm)?)));
        match updated {
            Ok((u, (intervals, comm))) => {
                self.work = Some(work);
                let stats = StepStats {
                    step: self.step,
                    loss: u.sums.loss,
                    aux_loss: u.sums.aux_loss,
                    mtp_loss: u.sums.mtp_loss,
                    grad_norm: u.norm,
                    lr: u.lr,
                    peak_bytes: u.sums.peak,
                    resident_bytes: u.sums.resident,
                    rolled_back: u.rolled_back,
                    expert_load: u
                        .sums
                        .expert_load
                        .iter()
                        .map(|l| l.iter().map(|&x| x as u64).collect())
                        .collect(),
                };
                Ok(RankStepReport {
                    stats,
                    intervals,
                    comm,
                    boundary_wait_s: u.waited.as_secs_f64(),
                    reduce_wait_s: u.reduce_wait.as_secs_f64(),
                })
            }
            Err(e) if e.is_skipped_step() => {
                // Every rank reached the same verdict from the same global norm: nothing to
                // abort, and nothing was applied.
                self.work = Some(work);
                Err(e)
            }
            Err(e) => {
                self.comm.abort(&format!("rank {}: {e}", self.comm.rank()));
                Err(e)
            }
        }
    }

    /// One forward and backward over `data` without an optimizer step (`graphpp verify`): the
    /// step loss (the same on every rank) and, on the leader, every distinct parameter's
    /// gradient d(step loss)/dθ — reduced over the data-parallel replicas and the copies, full
    /// (FSDP shards gathered) — gathered as in [`RankTrainer::gather_state`]; `None` elsewhere.
    /// The gradients are consumed; parameters do not change.
    ///
    /// # Errors
    /// As [`RankTrainer::step_at`].
    #[allow(clippy::type_complexity)]
    pub fn gradient_step(
        &mut self,
        data: Arc<Microbatches>,
    ) -> Result<(f64, Option<BTreeMap<String, Tensor>>), TrainError> {
        let outcome = self.run_pipeline(data, Instant::now())?;
        let mut work = outcome.work;
        let result = (|| {
            let loss = self.finish_loss(self.start_loss(&work)?)?.loss;
            let (grads, _) = self.reduce_grads(&mut work)?;
            let local = Self::unsharded_in(Some(&work), grads.into_iter().collect())?;
            let local = self.whole_over_tp(local)?;
            Ok((loss, self.send_to_leader(local, Gather::Gradients)?))
        })();
        match &result {
            // The stages are kept only when the step completed: a failure may leave reductions
            // in flight and gradients behind, so the rank is poisoned, as in `step_at`.
            Ok(_) => self.work = Some(work),
            Err(e) => self.comm.abort(&format!("rank {}: {e}", self.comm.rank())),
        }
        result
    }

    /// Runs this rank's program over `data` (this replica's rows), intervals measured from
    /// `start`; the stages are out of `self.work` until the caller puts them back.
    fn run_pipeline(
        &mut self,
        data: Arc<Microbatches>,
        start: Instant,
    ) -> Result<RankOutcome<GraphStages>, TrainError> {
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
        Ok(run_rank(&self.schedule, &self.pipeline, work, &*self.comm, &opts)?)
    }

    /// This replica's rows of every microbatch (`B / dp` sequences from row `replica · B / dp`).
    fn slice(&self, data: &Microbatches) -> Result<Microbatches, TrainError> {
        let b = self.setup.microbatch_size / self.setup.dp;
        let cut = |ts: &[Tensor]| -> Result<Vec<Tensor>, TrainError> {
            ts.iter()
                .enumerate()
                .map(|(mb, t)| {
                    if t.dims().first() != Some(&self.setup.microbatch_size) {
                        return Err(TrainError::Data(format!(
                            "microbatch {mb} has shape {:?}, [{}, T] expected",
                            t.dims(),
                            self.setup.microbatch_size
                        )));
                    }
                    Ok(t.narrow(0, self.replica * b, b)?)
                })
                .collect()
        };
        Ok(Microbatches { tokens: cut(&data.tokens)?, targets: cut(&data.targets)? })
    }

    /// The collectives and the optimizer step after the pipeline run (see the module doc).
    fn update(&mut self, work: &mut GraphStages) -> Result<Update, TrainError> {
        let loss = self.start_loss(work)?;
        if self.setup.post_validate {
            // The world-wide loss (in effect a barrier) is waited for after the optimistic
            // optimizer step.
            let (grads, reduce_wait) = self.reduce_grads(work)?;
            return self.post_validated(work, loss, grads, reduce_wait);
        }
        let t = Instant::now();
        let sums = self.finish_loss(loss)?;
        let mut waited = t.elapsed();
        let (mut grads, reduce_wait) = self.reduce_grads(work)?;
        let norm = self.start_norm(work, &grads)?;
        let t = Instant::now();
        let sq = self.finish_norm(norm)?;
        waited += t.elapsed();
        let lr = self.setup.lr.lr_at(self.step + 1);
        let scale = self.checked_scale(sq)?;
        scale_grads(&mut grads, scale)?;
        let (params, optim) = self.optimizer_step(work, &grads, lr)?;
        self.commit(work, params, optim, &sums.expert_load)?;
        Ok(Update { sums, norm: sq.sqrt(), lr, waited, reduce_wait, rolled_back: false })
    }

    /// The zero-bubble paper's optimizer post-validation (Qi et al. 2024, "Zero Bubble Pipeline
    /// Parallelism", section 4): the world-wide loss and gradient-norm reductions are started,
    /// the AdamW step is taken at once from this rank's unclipped gradients, and only then are
    /// the reductions waited for. When the global check says the step was wrong — a gradient
    /// norm above `max_grad_norm` (clipping) or a non-finite one — the step is rolled back
    /// (parameters and moments restored) and redone with the clipped gradients, or the step
    /// fails. The result is bitwise the synchronous step's.
    fn post_validated(
        &mut self,
        work: &mut GraphStages,
        loss: Pending<Tensor>,
        mut grads: Env,
        reduce_wait: Duration,
    ) -> Result<Update, TrainError> {
        let norm = self.start_norm(work, &grads)?;
        let lr = self.setup.lr.lr_at(self.step + 1);
        let optimistic = self.optimizer_step(work, &grads, lr);
        let t = Instant::now();
        let sums = self.finish_loss(loss)?;
        let sq = self.finish_norm(norm)?;
        let waited = t.elapsed();
        let scale = self.checked_scale(sq)?;
        let (step, rolled_back) = match optimistic {
            Ok(step) if scale == 1.0 => (step, false),
            // Roll back: the optimistic step is dropped, the clipped one taken.
            _ => {
                scale_grads(&mut grads, scale)?;
                (self.optimizer_step(work, &grads, lr)?, true)
            }
        };
        self.commit(work, step.0, step.1, &sums.expert_load)?;
        Ok(Update { sums, norm: sq.sqrt(), lr, waited, reduce_wait, rolled_back })
    }

    /// The clipping scale of the global squared norm `sq` (1 without clipping).
    ///
    /// # Errors
    /// [`TrainError::Optim`] for a non-finite norm (the step is not applied).
    fn checked_scale(&self, sq: f64) -> Result<f32, TrainError> {
        match self.setup.grad_clip {
            Some(max_norm) => Ok(clip_scale(sq, max_norm)?),
            None if sq.is_finite() => Ok(1.0),
            None => Err(OptimError::NonFiniteNorm { sq_norm: sq }.into()),
        }
    }

    /// The AdamW step from `grads` at `lr` on copies: the new parameters and optimizer; nothing
    /// changes until [`RankTrainer::commit`].
    fn optimizer_step(&self, work: &GraphStages, grads: &Env, lr: f64) -> Result<(Env, AdamW), TrainError> {
        let mut params: Env = work.stages().values().flat_map(|s| s.parameters()).collect();
        let grads: Env = params.keys().filter_map(|n| grads.get(n).map(|g| (n.clone(), g.clone()))).collect();
        let mut optim = self.optim.clone();
        optim.step(&mut params, &grads, lr)?;
        Ok((params, optim))
    }

    /// Installs a step's parameters and optimizer, and moves the MoE routing biases against the
    /// step's expert load (`balance_experts`).
    fn commit(
        &mut self,
        work: &mut GraphStages,
        params: Env,
        optim: AdamW,
        expert_load: &[Vec<f64>],
    ) -> Result<(), TrainError> {
        for s in work.stages_mut().values_mut() {
            s.set_parameters(&params)?;
        }
        self.optim = optim;
        self.step += 1;
        self.balance_experts(work, expert_load)
    }
}
