//! The planner: every feasible strategy for a model on N ranks — schedule
//! kind, pipeline × data-parallel × tensor-parallel degrees, FSDP or plain replicas,
//! microbatch count and size, recompute policy — simulated with a cost model and the byte model
//! of its real stage graphs, and ranked.
//!
//! Per candidate: the kind's compute schedule at (pp, v, m), lowered as the runtime lowers it
//! (with dp > 1 a REDUCE_GRAD after each stage's last backward, and under FSDP the UNSHARD /
//! RESHARD around its compute); each stage's graphs at `B / dp`
//! sequences under the policy (built once per distinct model stage); each action's time from its
//! graph's [`Work`] at a [`Speed`] (fitted to a [`crate::profile::Profile`] of the same model on this machine, or
//! the default) plus, under tensor parallelism, its graph's collectives over the `tp` group (the
//! bytes a ring sends — `2 (tp − 1) / tp` of an all-reduced value — over the link, counted as
//! exposed: a bound, since the executor overlaps them with other work where the graph allows); each hop between ranks takes
//! the stage output's bytes over the link; the data-parallel collectives (UNSHARD's all-gather,
//! REDUCE_GRAD's all-reduce or reduce-scatter, ring volumes) take the data link on the rank's
//! timeline ([`predict`]); the step time = the simulated makespan; peak bytes =
//! [`graphpp_schedule::bytes`]' walk, with FSDP's sharded state in place of a replica's.
//! A candidate fits when every rank's peak is within the memory per rank. Layer splits are even,
//! or where the layers do not divide the stages the most even one
//! ([`graphpp_models::balanced_split`]: the first stages one layer more); with one rank per pipeline only the
//! kinds of one stage per rank are listed (they differ there in memory: GPipe holds every
//! microbatch, 1F1B one — gradient accumulation).

use std::sync::Arc;

use graphpp_graph::names::OUTPUT;
use graphpp_graph::{DType, InputKind, StageGraphs};
use graphpp_models::{ModelConfig, Recompute, StageOptions};
use graphpp_runtime::train::build::{stage_specs, GraphCache};
use graphpp_runtime::train::bytes::byte_model;
use graphpp_runtime::SetupError;
use graphpp_schedule::simulate::simulate_with;
use graphpp_schedule::{
    generate, lower, Action, Kind, LowerOptions, Memory, Options, Schedule, Shape, StageOpKind,
};

use crate::profile::{PerKind, Speed, Work};

/// Link bandwidth assumed between ranks: 10 GB/s (the order of a PCIe 4.0 x16 link).
pub const DEFAULT_LINK_BYTES_PER_SECOND: f64 = 10e9;

/// The bandwidths (bytes/s) a layout's traffic runs at: the pipeline's hand-overs, the
/// tensor-parallel collectives and the data-parallel gradient reduction (one link everywhere, or
/// by the links each crosses on a cluster: [`crate::hardware::Hardware::links`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Links {
    /// Hand-overs between pipeline ranks.
    pub hop: f64,
    /// Tensor-parallel collectives.
    pub tensor: f64,
    /// The data-parallel gradient reduction.
    pub data: f64,
    /// Seconds per message of a hand-over.
    pub hop_latency: f64,
    /// Seconds per step of a tensor-parallel ring (an all-reduce over t ranks takes
    /// `2 (t − 1)` steps, an all-gather or reduce-scatter `t − 1`).
    pub tensor_latency: f64,
    /// Expert parallelism's all-to-alls: the bytes a rank sends per second, over the links its
    /// group's members cross ([`crate::hardware::Hardware::links`]).
    pub expert: f64,
}

impl Links {
    /// One bandwidth for every kind of traffic, no latency.
    pub fn uniform(bytes_per_second: f64) -> Links {
        Links {
            hop: bytes_per_second,
            tensor: bytes_per_second,
            data: bytes_per_second,
            hop_latency: 0.0,
            tensor_latency: 0.0,
            expert: bytes_per_second,
        }
    }
}

/// What to plan for.
#[derive(Debug, Clone)]
pub struct PlanRequest {
    /// The model.
    pub model: ModelConfig,
    /// N: ranks (devices) in all; each candidate splits them into pp × dp.
    pub ranks: usize,
    /// Memory of one rank, bytes.
    pub memory_per_rank: u64,
    /// Sequences per step over all replicas (m × B).
    pub global_batch: usize,
    /// T: tokens per sequence.
    pub seq_len: usize,
    /// Compute dtype.
    pub dtype: DType,
    /// Schedule kinds to consider.
    pub kinds: Vec<Kind>,
    /// Recompute policies to consider.
    pub recompute: Vec<Recompute>,
    /// Most microbatches per step considered.
    pub max_microbatches: usize,
    /// Only this pipeline depth pp (`--pp`), when set: it must divide the ranks.
    pub pp: Option<usize>,
    /// Only this tensor-parallel degree (`--tp`), when set: it must divide the ranks.
    pub tp: Option<usize>,
    /// Only this expert-parallel degree (`--ep`), when set: it must divide the data-parallel
    /// degree of a layout, and the model's routed experts.
    pub ep: Option<usize>,
    /// Only this microbatch count m (`--microbatches`), when set, whatever `max_microbatches`
    /// says: it must divide the global batch.
    pub microbatches: Option<usize>,
    /// How fast a rank computes ([`crate::profile::Profile::speed`], or the default).
    pub speed: Speed,
    /// Bytes per second between two ranks (pipeline hand-overs, gradient all-reduce).
    pub link_bytes_per_second: f64,
    /// The cluster, when planning for one: its links replace `link_bytes_per_second` by the
    /// links each layout's traffic crosses.
    pub hardware: Option<crate::hardware::Hardware>,
}

impl PlanRequest {
    /// The bandwidths of layout `(pp, dp, tp, ep)`'s traffic.
    pub fn links(&self, (pp, dp, tp, ep): (usize, usize, usize, usize)) -> Links {
        match &self.hardware {
            Some(h) => h.links((pp, dp, tp, ep)),
            None => Links::uniform(self.link_bytes_per_second),
        }
    }
}

/// One strategy and its predicted figures.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Candidate {
    /// Schedule kind.
    pub kind: Kind,
    /// Pipeline ranks p.
    pub pp: usize,
    /// Data-parallel replicas.
    pub dp: usize,
    /// Whether the replicas shard the parameters, gradients and AdamW moments (FSDP; only with
    /// dp > 1): all-gathers before a stage computes, reduce-scatters after its last backward.
    pub fsdp: bool,
    /// Tensor-parallel degree of each pipeline position.
    pub tp: usize,
    /// Expert-parallel degree: replicas sharing one layer's routed experts (1 for a dense model).
    pub ep: usize,
    /// Stages per rank v.
    pub stages_per_rank: usize,
    /// Decoder layers of each model stage where they do not divide evenly
    /// ([`graphpp_models::balanced_split`]); `None`: an even split.
    pub layers_per_stage: Option<Vec<usize>>,
    /// m.
    pub microbatches: usize,
    /// B: sequences per microbatch over the replicas.
    pub microbatch_size: usize,
    /// Recompute policy.
    pub recompute: Recompute,
    /// Predicted step time, seconds.
    pub step_seconds: f64,
    /// Predicted in-iteration r_bubble.
    pub bubble: f64,
    /// Seconds of the step its schedule does not hide communication under
    /// ([`Prediction::exposed_comm_seconds`]).
    pub exposed_comm_seconds: f64,
    /// Predicted peak bytes of the fullest rank.
    pub peak_bytes: u64,
    /// Whether every rank's peak is within the memory per rank.
    pub fits: bool,
}

impl Candidate {
    /// The `graphpp train` flags that run this strategy.
    pub fn train_flags(&self, seq_len: usize) -> String {
        format!(
            "--schedule {} --ranks {} --stages-per-rank {}{} --dp {}{} --tp {}{} --microbatches {} --microbatch-size {} --seq-len {} --recompute {}",
            self.kind.name(),
            self.pp,
            self.stages_per_rank,
            self.layers_per_stage.as_deref().map_or(String::new(), |l| format!(" --layers-per-stage {}", layer_list(l))),
            self.dp,
            if self.fsdp { " --fsdp" } else { "" },
            self.tp,
            if self.ep > 1 { format!(" --ep {}", self.ep) } else { String::new() },
            self.microbatches,
            self.microbatch_size,
            seq_len,
            self.recompute.name()
        )
    }
}

/// A layer split as `--layers-per-stage` takes it: `4,4,3`.
pub fn layer_list(layers: &[usize]) -> String {
    layers.iter().map(ToString::to_string).collect::<Vec<_>>().join(",")
}

/// Why no plan can be made.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlanError {
    /// A count is zero.
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    /// A speed or bandwidth is not a positive finite number.
    #[error("{what} is {value}: it must be a positive finite number")]
    Rate {
        /// Which figure.
        what: &'static str,
        /// The value.
        value: f64,
    },
    /// Building a stage graph or the byte model failed.
    #[error("{0}")]
    Build(String),
    /// A pinned pipeline depth or microbatch count that cannot split the ranks or the batch.
    #[error("{flag} {value} does not divide {of} {total}")]
    Pin {
        /// `--pp` or `--microbatches`.
        flag: &'static str,
        /// The pinned value.
        value: usize,
        /// `--ranks` or `--global-batch`.
        of: &'static str,
        /// What it must divide.
        total: usize,
    },
}

/// The graphs of each schedule stage of `kind` at `shape`, `batch` sequences per replica, as
/// tensor-parallel rank 0 of `tp` and expert-parallel rank 0 of `ep` build them.
fn schedule_graphs(
    req: &PlanRequest,
    (kind, shape, tp, ep): (Kind, &Shape, usize, usize),
    layers_per_stage: Option<&[usize]>,
    batch: usize,
    recompute: Recompute,
    cache: &mut GraphCache,
) -> Result<Vec<Arc<StageGraphs>>, PlanError> {
    let build = |e: SetupError| PlanError::Build(e.to_string());
    let tp = graphpp_models::TensorShard::new(0, tp);
    let ep = graphpp_models::ExpertShard { index: 0, size: ep };
    let specs = stage_specs(&req.model, kind, shape, layers_per_stage).map_err(build)?;
    let specs: Vec<_> = specs.into_iter().map(|s| graphpp_models::StageSpec { tp, ep, ..s }).collect();
    let opts = StageOptions { recompute, ..StageOptions::mixed(batch, req.seq_len, req.dtype) };
    specs.iter().map(|spec| cache.get(&req.model, spec, &opts).map_err(build)).collect()
}

/// Time of `a` on stages whose actions compute for `compute` seconds, plus its tensor-parallel
/// collectives (`tp`: their traffic per action kind and stage) and its expert-parallel
/// all-to-alls over `links`. An OVERLAP_F_B runs one half's all-to-alls while the other
/// computes (DualPipe's overlap, DeepSeek-V3 §3.2.1): the longer of its compute and its
/// all-to-alls; any other action waits for its all-to-alls.
fn action_seconds(
    a: &Action,
    (compute, traffic): (&[PerKind<f64>], &[PerKind<Traffic>]),
    links: &Links,
) -> f64 {
    let (mut work, mut tp, mut ep) = (0.0, 0.0, 0.0);
    for (kind, t) in a.computes() {
        work += compute.get(t.stage).map_or(0.0, |w| w.get(kind));
        let x = traffic.get(t.stage).map_or(Traffic::default(), |x| x.get(kind));
        tp += x.tensor_seconds(links);
        ep += x.expert as f64 / links.expert;
    }
    let overlapped = matches!(a, Action::Overlap { .. });
    tp + if overlapped { work.max(ep) } else { work + ep }
}

/// How long one run of a graph computes: at a fitted or assumed [`Speed`] (seconds per matmul
/// FLOP and per byte other nodes write), or node by node on a cluster's device
/// ([`crate::hardware::Hardware::graph_seconds`]).
#[derive(Debug, Clone, Copy)]
pub enum Cost<'a> {
    /// The action's [`Work`] at a speed.
    Speed(&'a Speed),
    /// The device's per-node rates for graphs computing in the dtype.
    Device(&'a crate::hardware::Hardware, DType),
}

impl Cost<'_> {
    /// Seconds of one run of `g`.
    pub fn seconds(&self, g: &graphpp_graph::Graph) -> f64 {
        match self {
            Cost::Speed(s) => s.seconds(Work::of(g)),
            Cost::Device(h, dtype) => h.graph_seconds(g, *dtype),
        }
    }

    /// Seconds of each action kind of a stage (I nothing and W the full backward where the
    /// stage has no dI/dW split, as [`stage_work`]).
    fn stage(&self, g: &StageGraphs) -> PerKind<f64> {
        PerKind::of_stage(g, |graph| self.seconds(graph))
    }
}

/// What one rank sends over the tensor-parallel group in one run of `g`, ring algorithms: the
/// bytes — `2 (t − 1) / t` of each all-reduced value, `(t − 1) / t` of each all-gather's result
/// and of each reduce-scatter's operand (sequence parallelism); a replicate sends nothing — and
/// the ring steps, each paying a link's latency (`2 (t − 1)` per all-reduce, `t − 1` per
/// all-gather or reduce-scatter).
///
/// And what it sends to the other members of its expert-parallel group: of each variable-count
/// all-to-all (dispatch, combine, and their adjoints in the backward), the rows it holds —
/// the smaller of what it sends and the static rows it could receive — of which `(G − 1) / G`
/// go to other members under balanced routing.
fn traffic(g: &graphpp_graph::Graph) -> Traffic {
    use graphpp_graph::{CollectiveKind, MeshAxis, Op};
    let (mut bytes, mut steps, mut expert) = (0.0, 0, 0.0);
    for n in &g.nodes {
        let Op::CollectiveStart { kind, group, .. } = n.op else { continue };
        let t = group.size.max(1);
        match (group.mesh_axis, kind) {
            (MeshAxis::Expert, CollectiveKind::AllToAllV { .. }) => {
                let held = g.node(n.inputs[0]).ty.size_bytes().min(n.ty.size_bytes());
                expert += (t - 1) as f64 / t as f64 * held as f64;
            }
            (MeshAxis::Tensor, _) => {
                let share = graphpp_comm::emulated::ring(t);
                let (b, s) = match kind {
                    CollectiveKind::AllReduce => (2.0 * share * n.ty.size_bytes() as f64, 2 * (t - 1)),
                    CollectiveKind::AllGather => (share * n.ty.size_bytes() as f64, t - 1),
                    CollectiveKind::ReduceScatter => {
                        (share * g.node(n.inputs[0]).ty.size_bytes() as f64, t - 1)
                    }
                    _ => (0.0, 0),
                };
                bytes += b;
                steps += s;
            }
            _ => {}
        }
    }
    Traffic { tensor: bytes as u64, steps: steps as u64, expert: expert as u64 }
}

/// A graph's collective traffic ([`traffic`]): tensor-parallel bytes and ring steps, and the
/// bytes its expert-parallel all-to-alls send to other members.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Traffic {
    tensor: u64,
    steps: u64,
    expert: u64,
}

impl Traffic {
    /// Seconds of its tensor-parallel part over `links`.
    fn tensor_seconds(&self, links: &Links) -> f64 {
        self.tensor as f64 / links.tensor + self.steps as f64 * links.tensor_latency
    }
}

/// [`traffic`] of each action kind's graph of a stage.
fn stage_traffic(g: &StageGraphs) -> PerKind<Traffic> {
    PerKind::of_stage(g, traffic)
}

/// What the planner predicts for one strategy.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Prediction {
    /// Step time, seconds: the simulated makespan (a lowered schedule's FSDP all-gathers and
    /// gradient reductions on the ranks' timelines); for a compute-only schedule with replicas,
    /// plus the fullest rank's gradient all-reduce after it.
    pub step_seconds: f64,
    /// In-iteration r_bubble of the simulated schedule.
    pub bubble: f64,
    /// Seconds of the step the schedule does not hide communication under: the step less the
    /// same step over free links.
    pub exposed_comm_seconds: f64,
    /// Peak bytes of every rank: the byte model's walk ([`graphpp_schedule::bytes`]), each
    /// stage's resident bytes under FSDP those the runtime holds (`StageParams::fsdp_resident`
    /// and the buffers).
    pub peak_bytes: Vec<u64>,
}

/// A stage's parameter bytes as its data-parallel collectives move them: the f32 bytes of the
/// shared parameters and of the routed experts (reduced over dp / ep replicas), and what FSDP
/// gathers (bf16 for a parameter every graph reads only through a cast to bf16, as the runtime
/// gathers it).
#[derive(Debug, Clone, Copy, Default)]
struct StageParams {
    shared: f64,
    routed: f64,
    gathered: f64,
}

impl StageParams {
    /// The parts of stage `g` of `model`; what FSDP gathers only when `fsdp` (else the f32 bytes,
    /// without walking the graphs' readers).
    fn of(g: &StageGraphs, model: &dyn graphpp_models::Model, fsdp: bool) -> StageParams {
        let inputs = g.fw.input_specs();
        let params: Vec<&graphpp_graph::InputSpec> =
            inputs.iter().filter(|i| i.kind == InputKind::Parameter).collect();
        let names: Vec<String> = params.iter().map(|i| i.name.clone()).collect();
        let bf16 =
            if fsdp { graphpp_runtime::pipeline::stage::read_as_bf16(g, &names) } else { Default::default() };
        let mut p = StageParams::default();
        for i in params {
            let bytes = i.ty.size_bytes() as f64;
            *(if model.expert_of(&i.name).is_some() { &mut p.routed } else { &mut p.shared }) += bytes;
            p.gathered += if bf16.contains(&i.name) { bytes / 2.0 } else { bytes };
        }
        p
    }

    /// Bytes one rank holds for the whole step under FSDP, as the runtime holds them
    /// (`graphpp_runtime::pipeline::data_parallel`): its shard of the f32 parameters and of their
    /// two AdamW moments (12 bytes a parameter over the group: dp for shared parameters, dp / ep
    /// for a routed expert's), the full f32 gradient accumulators (4 bytes a parameter: each
    /// microbatch's backward adds into them before REDUCE_GRAD's reduce-scatter) and the gathered
    /// parameters (bf16 or f32, [`StageParams::gathered`]). Buffers are not included.
    fn fsdp_resident(&self, (dp, ep): (usize, usize)) -> f64 {
        let group = |n: usize| n.max(1) as f64;
        let shards = 3.0 * (self.shared / group(dp) + self.routed / group(dp / ep.max(1)));
        shards + self.shared + self.routed + self.gathered
    }

    /// Bytes one rank sends reducing these gradients with ring collectives: `passes` (2 for an
    /// all-reduce, 1 for a reduce-scatter) times `(n − 1) / n` of each part over its group.
    fn reduced(&self, passes: f64, (dp, ep): (usize, usize)) -> f64 {
        let ring = graphpp_comm::emulated::ring;
        passes * (ring(dp) * self.shared + ring(dp / ep.max(1)) * self.routed)
    }
}

/// The [`Prediction`] for `schedule` (compute-only or lowered) whose stage `s` runs `graphs[s]`
/// (a tensor-parallel rank's: its collectives name their group's size) of `model`, with `dp`
/// replicas in expert-parallel groups of `ep`, a rank's graphs running for `cost` and its
/// traffic at `links` (see the module doc).
///
/// # Errors
/// [`PlanError::Build`] when the schedule cannot be simulated or a graph is missing.
pub fn predict(
    schedule: &Schedule,
    graphs: &[Arc<StageGraphs>],
    (model, dp, ep): (&dyn graphpp_models::Model, usize, usize),
    cost: Cost,
    links: Links,
) -> Result<Prediction, PlanError> {
    let compute: Vec<PerKind<f64>> = graphs.iter().map(|g| cost.stage(g)).collect();
    let traffic: Vec<PerKind<Traffic>> = graphs.iter().map(|g| stage_traffic(g)).collect();
    let hop = graphs.first().and_then(|g| g.fw.output_by_name(OUTPUT).map(|v| g.fw.node(v).ty.size_bytes()));
    let counts = graphpp_schedule::validate::ActionCounts::of(schedule);
    let (fsdp, reduced) = (counts.unshard > 0, counts.reduce_grad > 0);
    let params: Vec<StageParams> = graphs.iter().map(|g| StageParams::of(g, model, fsdp)).collect();
    let of = |stage: usize| params.get(stage).copied().unwrap_or_default();
    // A compute-only schedule's replicas all-reduce their gradients after the step, the fullest
    // rank's last.
    let mut sent = vec![0f64; schedule.num_ranks()];
    for (stage, ranks) in schedule.placement().into_iter().filter(|_| !reduced) {
        for r in ranks {
            sent[r] += of(stage).reduced(2.0, (dp, ep));
        }
    }
    let after = sent.into_iter().fold(0.0, f64::max);
    // The step and its bubble over `links`.
    let step = |links: &Links| -> Result<(f64, f64), PlanError> {
        // The lowered schedule's stage operations, on the rank's timeline: FSDP's all-gather
        // before a stage computes sends (dp − 1) / dp of what it gathers over the data-parallel
        // link, and its gradients' reduce-scatter as much of their f32 bytes; a REDUCE_GRAD
        // without FSDP all-reduces them (twice that), a routed expert's over dp / ep replicas.
        let seconds = |a: &Action| match *a {
            Action::StageOp { kind: StageOpKind::Unshard, stage } => {
                graphpp_comm::emulated::ring(dp) * of(stage).gathered / links.data
            }
            Action::StageOp { kind: StageOpKind::ReduceGrad, stage } => {
                of(stage).reduced(if fsdp { 1.0 } else { 2.0 }, (dp, ep)) / links.data
            }
            _ => action_seconds(a, (&compute, &traffic), links),
        };
        let hop_seconds = hop.unwrap_or(0) as f64 / links.hop + links.hop_latency;
        let sim = simulate_with(schedule, seconds, hop_seconds, &Memory::default())
            .map_err(|e| PlanError::Build(e.to_string()))?;
        Ok((sim.makespan + after / links.data, sim.bubble_ratio))
    };
    let (step_seconds, bubble) = step(&links)?;
    let (alone, _) = step(&Links::uniform(f64::INFINITY))?;
    let refs: Vec<&StageGraphs> = graphs.iter().map(|g| &**g).collect();
    let mut bytes = byte_model(&refs, schedule).map_err(|e| PlanError::Build(e.to_string()))?;
    if fsdp {
        for (s, (st, g)) in bytes.stages.iter_mut().zip(graphs).enumerate() {
            let buffers = graphpp_runtime::train::bytes::input_bytes(g, InputKind::Buffer);
            st.resident = of(s).fsdp_resident((dp, ep)) as u64 + buffers;
        }
    }
    let peak_bytes = bytes.peak_bytes(schedule).map_err(|e| PlanError::Build(e.to_string()))?;
    let exposed_comm_seconds = (step_seconds - alone).max(0.0);
    Ok(Prediction { step_seconds, bubble, exposed_comm_seconds, peak_bytes })
}

/// Whether `x` is the pinned value, when one is pinned.
fn pinned(pin: Option<usize>, x: usize) -> bool {
    pin.is_none_or(|p| p == x)
}

/// Every feasible candidate of `req`, ranked: those that fit first, each group by predicted step
/// time, then peak bytes; kinds with the same figures at the same shape are listed once. A kind
/// that cannot serve a shape (its generator's constraint) and more stages than layers are left
/// out; layers that do not divide the stages are split as evenly as they can be.
///
/// # Errors
/// [`PlanError::Zero`] for zero ranks, batch, sequence length or microbatches;
/// [`PlanError::Rate`] for a bad speed or bandwidth; [`PlanError::Pin`] for a pinned pp or m
/// that does not divide the ranks or the batch; [`PlanError::Build`] when a stage graph cannot
/// be built.
pub fn plan(req: &PlanRequest) -> Result<Vec<Candidate>, PlanError> {
    check_request(req)?;
    let mut out = candidates(req)?;
    rank(&mut out);
    Ok(out)
}

/// Checks the counts and rates of `req`. Errors: [`PlanError::Zero`] for zero ranks, batch,
/// sequence length or microbatches; [`PlanError::Rate`] for a speed or bandwidth that is not a
/// positive finite number.
fn check_request(req: &PlanRequest) -> Result<(), PlanError> {
    for (name, v) in [
        ("--ranks", req.ranks),
        ("--global-batch", req.global_batch),
        ("--seq-len", req.seq_len),
        ("--max-microbatches", req.max_microbatches),
    ] {
        if v == 0 {
            return Err(PlanError::Zero(name));
        }
    }
    for (flag, pin, of, total) in [
        ("--pp", req.pp, "--ranks", req.ranks),
        ("--tp", req.tp, "--ranks", req.ranks),
        ("--ep", req.ep, "--ranks", req.ranks),
        ("--microbatches", req.microbatches, "--global-batch", req.global_batch),
    ] {
        match pin {
            Some(0) => return Err(PlanError::Zero(flag)),
            Some(value) if !total.is_multiple_of(value) => {
                return Err(PlanError::Pin { flag, value, of, total })
            }
            _ => {}
        }
    }
    if let (Some(pp), Some(tp)) = (req.pp, req.tp) {
        let both = pp.saturating_mul(tp);
        if both > 0 && !req.ranks.is_multiple_of(both) {
            return Err(PlanError::Pin {
                flag: "--pp × --tp", value: both, of: "--ranks", total: req.ranks
            });
        }
    }
    // A pinned tp or ep the model cannot take says why (rather than "no candidate").
    if let Some(tp) = req.tp.filter(|&tp| tp > 0) {
        graphpp_models::Model::check_tp(&req.model, tp)
            .map_err(|e| PlanError::Build(format!("--tp {tp}: {e}")))?;
    }
    if let Some(ep) = req.ep.filter(|&ep| ep > 1) {
        if graphpp_models::Model::routed_experts(&req.model) == 0 {
            return Err(PlanError::Build(format!(
                "--ep {ep}: expert parallelism needs a mixture-of-experts model"
            )));
        }
        graphpp_models::Model::check_ep(&req.model, ep)
            .map_err(|e| PlanError::Build(format!("--ep {ep}: {e}")))?;
    }
    for (what, value) in [
        ("seconds per FLOP", req.speed.seconds_per_flop),
        ("seconds per byte", req.speed.seconds_per_byte),
        ("the link bandwidth", req.link_bytes_per_second),
    ] {
        if !(value.is_finite() && value > 0.0) {
            return Err(PlanError::Rate { what, value });
        }
    }
    Ok(())
}

/// Every feasible strategy of `req`, unranked, with its prediction: each split pp × dp × tp of
/// the ranks (tp one the model accepts: [`graphpp_models::Model::check_tp`]; pp at most the
/// layers; only `req.pp` when pinned), each arrangement of the replicas
/// ([`replica_arrangements`]: plain, FSDP, expert-parallel degrees), each kind (distinct) with at
/// most one model stage per layer (uneven splits balanced), each microbatch count m (only
/// `req.microbatches` when pinned) dividing the global batch into microbatches that split over
/// the dp replicas, each recompute policy (distinct). Errors: [`PlanError::Build`].
fn candidates(req: &PlanRequest) -> Result<Vec<Candidate>, PlanError> {
    let layers = graphpp_models::Model::num_layers(&req.model);
    let (mut kinds, mut policies) = (req.kinds.clone(), req.recompute.clone());
    kinds.sort();
    kinds.dedup();
    policies.sort_by_key(|r| r.name());
    policies.dedup();
    let mut cache = GraphCache::default();
    let mut out = Vec::new();
    // tp splits the heads: no more of it than heads (and the loop stays short for any --ranks).
    let heads = req.model.base().num_attention_heads;
    let tps = (1..=req.ranks.min(heads)).filter(|&tp| {
        req.ranks.is_multiple_of(tp)
            && pinned(req.tp, tp)
            && graphpp_models::Model::check_tp(&req.model, tp).is_ok()
    });
    for tp in tps {
        let per_tp = req.ranks / tp;
        // A pipeline has at most one rank per layer.
        let pps = (1..=per_tp.min(layers)).filter(|&pp| per_tp.is_multiple_of(pp) && pinned(req.pp, pp));
        for pp in pps {
            layout_candidates(req, (pp, per_tp / pp, tp), (&kinds, &policies), &mut cache, &mut out)?;
        }
    }
    Ok(out)
}

/// How a layout's `dp` replicas can be arranged: `(fsdp, ep)` — plain replicas, FSDP (dp > 1;
/// graphpp does not combine it with expert parallelism), and each expert-parallel degree ep
/// dividing dp that a mixture-of-experts model's routed experts split over (only `req.ep` when
/// pinned).
fn replica_arrangements(req: &PlanRequest, dp: usize) -> Vec<(bool, usize)> {
    let moe = graphpp_models::Model::routed_experts(&req.model) > 0;
    let splits = |ep: usize| ep == 1 || (moe && graphpp_models::Model::check_ep(&req.model, ep).is_ok());
    let eps = (1..=dp).filter(|&ep| dp.is_multiple_of(ep) && pinned(req.ep, ep) && splits(ep));
    eps.flat_map(|ep| [(false, ep), (true, ep)].into_iter().filter(|&(f, ep)| !f || (dp > 1 && ep == 1)))
        .collect()
}

/// The candidates of one layout `(pp, dp, tp)`, with each of its replica arrangements (see
/// [`candidates`]), appended to `out`.
fn layout_candidates(
    req: &PlanRequest,
    (pp, dp, tp): (usize, usize, usize),
    (kinds, policies): (&[Kind], &[Recompute]),
    cache: &mut GraphCache,
    out: &mut Vec<Candidate>,
) -> Result<(), PlanError> {
    let layers = graphpp_models::Model::num_layers(&req.model);
    let arrangements = replica_arrangements(req, dp);
    for &kind in kinds {
        let v = kind.default_stages_per_rank();
        // One rank per pipeline is no pipeline: chunks on it only add hand-overs.
        if pp == 1 && v > 1 {
            continue;
        }
        let stages = kind.model_stages(&Shape::new(pp, v, 1));
        if stages > layers {
            continue;
        }
        let split = (!layers.is_multiple_of(stages)).then(|| graphpp_models::balanced_split(layers, stages));
        let most = req.microbatches.unwrap_or(req.max_microbatches).min(req.global_batch);
        let ms = (1..=most).filter(|&m| req.global_batch.is_multiple_of(m) && pinned(req.microbatches, m));
        for m in ms {
            let b = req.global_batch / m;
            if !b.is_multiple_of(dp) {
                continue;
            }
            let shape = Shape::new(pp, v, m);
            let Ok(schedule) = generate(kind, &shape, &Options::default()) else { continue };
            // Replicas with and without FSDP, lowered as the runtime lowers them.
            for &(fsdp, ep) in &arrangements {
                let opts = LowerOptions::data_parallel(dp, fsdp, v);
                let lowered = lower(&schedule, &opts).map_err(|e| PlanError::Build(e.to_string()))?;
                for &recompute in policies {
                    let at = (kind, &shape, tp, ep);
                    let graphs = schedule_graphs(req, at, split.as_deref(), b / dp, recompute, cache)?;
                    let cost = match &req.hardware {
                        Some(h) => Cost::Device(h, req.dtype),
                        None => Cost::Speed(&req.speed),
                    };
                    let links = req.links((pp, dp, tp, ep));
                    let p = predict(&lowered, &graphs, (&req.model, dp, ep), cost, links)?;
                    let peak_bytes = p.peak_bytes.into_iter().max().unwrap_or(0);
                    out.push(Candidate {
                        kind,
                        pp,
                        dp,
                        fsdp,
                        tp,
                        ep,
                        stages_per_rank: v,
                        layers_per_stage: split.clone(),
                        microbatches: m,
                        microbatch_size: b,
                        recompute,
                        step_seconds: p.step_seconds,
                        bubble: p.bubble,
                        exposed_comm_seconds: p.exposed_comm_seconds,
                        peak_bytes,
                        fits: peak_bytes <= req.memory_per_rank,
                    });
                }
            }
        }
    }
    Ok(())
}

/// Ranks `out`: those that fit first, each group by step time, then peak bytes (a stable sort);
/// of the candidates with the same layout (pp, dp, FSDP, tp, ep), shape (v, m), policy, step
/// time and peak bytes (kinds that run alike) only the first is kept.
fn rank(out: &mut Vec<Candidate>) {
    out.sort_by(|a, b| {
        b.fits
            .cmp(&a.fits)
            .then(a.step_seconds.total_cmp(&b.step_seconds))
            .then(a.peak_bytes.cmp(&b.peak_bytes))
    });
    // Kinds that run alike on a shape (every v = 1 kind without a pipeline holding one microbatch)
    // give the same strategy: list it once, under the first kind.
    let mut seen = std::collections::HashSet::new();
    out.retain(|c| {
        seen.insert((
            (c.pp, c.dp, c.fsdp, c.tp, c.ep),
            c.stages_per_rank,
            c.microbatches,
            c.recompute,
            c.step_seconds.to_bits(),
            c.peak_bytes,
        ))
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use graphpp_schedule::Task;

    fn request(memory_per_rank: u64) -> PlanRequest {
        PlanRequest {
            model: ModelConfig::preset("tiny").unwrap(),
            ranks: 2,
            memory_per_rank,
            global_batch: 8,
            seq_len: 16,
            dtype: DType::F32,
            kinds: vec![Kind::Gpipe, Kind::OneFOneB, Kind::ZbH1, Kind::Zbv],
            recompute: vec![Recompute::SaveAll, Recompute::StageInputs],
            max_microbatches: 8,
            pp: None,
            tp: None,
            ep: None,
            microbatches: None,
            speed: Speed::default(),
            link_bytes_per_second: DEFAULT_LINK_BYTES_PER_SECOND,
            hardware: None,
        }
    }

    /// The planted case: the best strategy without a cap needs more memory than the cap gives,
    /// so the planner must choose another — one that fits — and mark the first as not fitting.
    #[test]
    fn a_binding_memory_cap_makes_the_planner_choose_another_strategy() {
        let free = plan(&request(u64::MAX)).unwrap();
        let best = &free[0];
        assert!(free.iter().all(|c| c.fits));
        assert!(free.windows(2).all(|w| w[0].step_seconds <= w[1].step_seconds));
        let cap = best.peak_bytes - 1;
        let capped = plan(&request(cap)).unwrap();
        let chosen = &capped[0];
        assert!(chosen.fits && chosen.peak_bytes <= cap, "{chosen:?}");
        let id = |c: &Candidate| (c.kind, c.pp, c.dp, c.fsdp, c.tp, c.microbatches, c.recompute);
        assert_ne!(id(chosen), id(best));
        assert!(chosen.step_seconds >= best.step_seconds);
        let same = capped.iter().find(|c| id(c) == id(best)).unwrap();
        assert!(!same.fits);
        // Everything that fits is ranked before everything that does not.
        let first_out = capped.iter().position(|c| !c.fits).unwrap();
        assert!(capped[first_out..].iter().all(|c| !c.fits));
    }

    /// A mixture-of-experts model's replicas are searched with each expert-parallel degree its
    /// routed experts split over: ep 2 holds half the experts (a lower peak than ep 1 at the same
    /// layout), pays all-to-alls, never combines with FSDP, and its command says `--ep 2`; a
    /// pinned ep on a dense model is refused.
    #[test]
    fn expert_parallel_layouts_are_searched_for_moe_models() {
        let moe = ModelConfig::preset("moe-tiny").unwrap();
        let req = PlanRequest { model: moe, pp: Some(1), tp: Some(1), ..request(u64::MAX) };
        let all = plan(&req).unwrap();
        let eps: std::collections::BTreeSet<usize> = all.iter().map(|c| c.ep).collect();
        assert_eq!(eps.into_iter().collect::<Vec<_>>(), vec![1, 2]);
        assert!(all.iter().all(|c| !(c.fsdp && c.ep > 1)));
        let key = |c: &Candidate| (c.kind, c.microbatches, c.recompute, c.fsdp);
        for c in all.iter().filter(|c| c.ep == 2) {
            let one = all.iter().find(|o| o.ep == 1 && key(o) == key(c)).unwrap();
            assert!(c.peak_bytes < one.peak_bytes, "{c:?} {one:?}");
            assert!(c.exposed_comm_seconds > 0.0 && c.train_flags(16).contains("--tp 1 --ep 2"), "{c:?}");
        }
        let pinned = plan(&PlanRequest { ep: Some(2), ..req.clone() }).unwrap();
        assert!(!pinned.is_empty() && pinned.iter().all(|c| c.ep == 2));
        let e = plan(&PlanRequest { ep: Some(2), ..request(u64::MAX) }).unwrap_err().to_string();
        assert!(e.contains("--ep 2: expert parallelism needs a mixture-of-experts model"), "{e}");
    }

    /// Layers that do not divide the stages are split as evenly as they can be, the first stages
    /// one layer more: tiny's 4 layers over a 3-rank pipeline run 2, 1, 1, and the command says
    /// so (before, no 3-rank pipeline was planned).
    #[test]
    fn uneven_layer_splits_are_planned() {
        let req = PlanRequest { ranks: 3, pp: Some(3), kinds: vec![Kind::OneFOneB], ..request(u64::MAX) };
        let all = plan(&req).unwrap();
        assert!(!all.is_empty() && all.iter().all(|c| c.layers_per_stage.as_deref() == Some(&[2, 1, 1][..])));
        assert!(all[0].train_flags(16).contains("--stages-per-rank 1 --layers-per-stage 2,1,1 --dp 1"));
    }

    /// Replicas are searched with and without FSDP: under a cap below every replicated
    /// layout's peak the planner chooses a sharded one, and its command says `--fsdp`.
    #[test]
    fn fsdp_is_searched_and_fits_where_replicas_do_not() {
        let mut req = PlanRequest { pp: Some(1), tp: Some(1), ..request(u64::MAX) };
        let free = plan(&req).unwrap();
        let least = |fsdp: bool| free.iter().filter(|c| c.fsdp == fsdp).map(|c| c.peak_bytes).min().unwrap();
        assert!(free.iter().all(|c| c.dp == 2));
        let (replicated, sharded) = (least(false), least(true));
        assert!(sharded < replicated, "{sharded} {replicated}");
        req.memory_per_rank = replicated - 1;
        let chosen = &plan(&req).unwrap()[0];
        assert!(chosen.fits && chosen.fsdp, "{chosen:?}");
        assert!(chosen.train_flags(16).contains("--dp 2 --fsdp --tp 1"), "{}", chosen.train_flags(16));
    }

    #[test]
    fn data_parallelism_replicates_the_parameters_and_pipelining_splits_them() {
        let all = plan(&request(u64::MAX)).unwrap();
        let find = |pp: usize| {
            all.iter()
                .find(|c| {
                    c.pp == pp
                        && c.tp == 1
                        && c.kind == Kind::Gpipe
                        && c.microbatches == 2
                        && c.recompute == Recompute::SaveAll
                })
                .unwrap()
                .clone()
        };
        let (dp2, pp2) = (find(1), find(2));
        assert_eq!((dp2.dp, pp2.dp), (2, 1));
        // One replica holds every parameter (4 × f32 values with gradients and AdamW moments).
        let params = graphpp_models::Model::parameter_count(&ModelConfig::preset("tiny").unwrap()) as u64;
        assert!(dp2.peak_bytes > 16 * params, "{dp2:?}");
        assert!(pp2.peak_bytes < dp2.peak_bytes, "{pp2:?} vs {dp2:?}");
    }

    /// Tensor parallelism is searched: on 4 ranks tiny (4 heads, MLP width 176) is listed at
    /// tp = 1, 2 and 4 (all dividing it); a split layout holds fewer bytes per rank than the
    /// same pipeline without it, and its all-reduces are costed; at pp = 2 a cap below every
    /// tp = 1 candidate's peak makes the planner choose tp = 2.
    #[test]
    fn tensor_parallel_layouts_are_searched_and_shrink_the_peak() {
        let r = PlanRequest { ranks: 4, ..request(u64::MAX) };
        let all = plan(&r).unwrap();
        let tps: std::collections::BTreeSet<usize> = all.iter().map(|c| c.tp).collect();
        assert_eq!(tps.into_iter().collect::<Vec<_>>(), vec![1, 2, 4]);
        let find = |dp: usize, tp: usize| {
            all.iter()
                .find(|c| (c.kind, c.pp, c.dp, c.tp, c.microbatches) == (Kind::OneFOneB, 2, dp, tp, 4))
                .filter(|c| c.recompute == Recompute::SaveAll)
                .unwrap()
                .clone()
        };
        let (replicated, split) = (find(2, 1), find(1, 2));
        assert!(split.peak_bytes < replicated.peak_bytes, "{split:?} vs {replicated:?}");
        // Its all-reduces are costed: two of [B, T, D] f32 per layer in the forward, two in the
        // full backward (Megatron's g and f), 2 layers per stage at B = 2, T = 16, D = 64.
        let graphs = schedule_graphs(
            &r,
            (Kind::OneFOneB, &Shape::new(2, 1, 4), 2, 1),
            None,
            2,
            Recompute::SaveAll,
            &mut GraphCache::default(),
        )
        .unwrap();
        // A ring all-reduce over 2 sends 2 · (2 − 1) / 2 = 1 × the value in 2 steps. The first
        // stage's forward also all-reduces the vocabulary-parallel embedding's [B, T, D].
        let t = stage_traffic(&graphs[0]);
        let value = 2 * 16 * 64 * 4;
        assert_eq!((t.f.tensor, t.b.tensor), ((2 * 2 + 1) * value, 2 * 2 * value));
        assert_eq!((t.f.expert, t.b.expert), (0, 0));
        assert_eq!((t.f.steps, t.b.steps), (2 * 5, 2 * 4));
        // Two pipeline ranks: the other two replicate (dp = 2) or split (tp = 2) the stages.
        let pinned = PlanRequest { pp: Some(2), ..r };
        let two = plan(&pinned).unwrap();
        let cap = two.iter().filter(|c| c.tp == 1).map(|c| c.peak_bytes).min().unwrap() - 1;
        let capped = plan(&PlanRequest { memory_per_rank: cap, ..pinned }).unwrap();
        assert!(capped[0].fits && capped[0].tp == 2, "{:?}", capped[0]);
    }

    /// Expert parallelism's all-to-alls cost their bytes over the expert link: a slower link
    /// lengthens ZB-V's predicted step; DualPipeV runs one half's all-to-alls under the other
    /// half's compute, so the same slowdown costs it less (the seed's reason for DualPipeV).
    #[test]
    fn expert_all_to_alls_cost_their_link_and_hide_under_overlap() {
        let model = ModelConfig::preset("moe-tiny").unwrap();
        let shape = Shape::new(2, 2, 8);
        let ep = graphpp_models::ExpertShard { index: 0, size: 2 };
        let opts = StageOptions::mixed(2, 16, DType::F32);
        let step = |kind: Kind, expert: f64| {
            let specs = stage_specs(&model, kind, &shape, None).unwrap();
            let specs: Vec<_> = specs.into_iter().map(|s| graphpp_models::StageSpec { ep, ..s }).collect();
            let graphs = graphpp_runtime::train::build::all_stage_graphs(&model, &specs, &opts).unwrap();
            // Stage 1 holds MoE layer 1 (layer 0 is dense).
            let t = stage_traffic(&graphs[1]);
            assert!(t.f.expert > 0 && t.b.expert > 0, "the MoE stage sends rows both ways: {t:?}");
            let schedule = graphpp_schedule::generate(kind, &shape, &Default::default()).unwrap();
            let links = Links { expert, ..Links::uniform(1e12) };
            predict(&schedule, &graphs, (&model, 2, 2), Cost::Speed(&Speed::default()), links)
                .unwrap()
                .step_seconds
        };
        let slowdown = |kind| step(kind, 1e6) - step(kind, 1e12);
        let (zbv, dualpipev) = (slowdown(Kind::Zbv), slowdown(Kind::DualPipeV));
        assert!(zbv > 0.0 && dualpipev < zbv, "ZB-V slows by {zbv} s, DualPipeV by {dualpipev} s");
        // The rule itself, on one stage computing F 1 s and B 2 s and sending 1 MB each way
        // per action at 1 MB/s: F alone waits for its all-to-alls (2 s); an OVERLAP_F_B's 2 s of
        // all-to-alls run under its 3 s of compute; a slower link (0.5 MB/s: 4 s) shows.
        let compute = [PerKind { f: 1.0, b: 2.0, i: 0.0, w: 0.0 }];
        let sent = Traffic { expert: 1_000_000, ..Traffic::default() };
        let traffic = [PerKind { f: sent, b: sent, i: sent, w: sent }];
        let at = |expert: f64| Links { expert, ..Links::uniform(1e12) };
        let (f, fb) = (Action::f(0, 0), Action::overlap(Task::new(0, 1), Task::new(0, 0)));
        let seconds = |a: &Action, l: f64| action_seconds(a, (&compute, &traffic), &at(l));
        assert_eq!((seconds(&f, 1e6), seconds(&fb, 1e6), seconds(&fb, 5e5)), (2.0, 3.0, 4.0));
    }

    /// The lowered schedule's stage operations pay the data-parallel link: over a slow link an
    /// FSDP step (UNSHARD's all-gather and REDUCE_GRAD's reduce-scatter, each (dp − 1) / dp of
    /// the parameters) costs what the plain replicas' all-reduce does, whether that runs as
    /// REDUCE_GRAD actions or after a compute-only schedule — and each link-bound part shows.
    #[test]
    fn fsdp_and_data_parallel_reductions_pay_the_data_link() {
        let r = request(u64::MAX);
        let shape = Shape::new(1, 1, 4);
        let graphs = schedule_graphs(
            &r,
            (Kind::OneFOneB, &shape, 1, 1),
            None,
            2,
            Recompute::SaveAll,
            &mut GraphCache::default(),
        )
        .unwrap();
        let compute = generate(Kind::OneFOneB, &shape, &Options::default()).unwrap();
        let lowered = |fsdp: bool, reduce_grad: bool| {
            let opts = graphpp_schedule::LowerOptions { fsdp_max_unsharded: fsdp.then_some(1), reduce_grad };
            graphpp_schedule::lower(&compute, &opts).unwrap()
        };
        let step = |s: &Schedule, link: f64| {
            predict(s, &graphs, (&r.model, 2, 1), Cost::Speed(&Speed::default()), Links::uniform(link))
                .unwrap()
                .step_seconds
        };
        let params = graphpp_runtime::train::bytes::input_bytes(&graphs[0], InputKind::Parameter) as f64;
        // dp 2: an all-reduce sends 2 · 1/2 of the gradients, at 1 MB/s.
        let link_part = params / 1e6;
        let fast = step(&compute, 1e15);
        for s in [compute.clone(), lowered(true, false), lowered(false, true)] {
            let slow = step(&s, 1e6);
            assert!((slow - fast - link_part).abs() < 1e-6 * link_part, "{slow} vs {fast} + {link_part}");
        }
    }

    /// A routed expert's gradients are reduced over its dp / ep replicas only (none when ep = dp),
    /// and FSDP gathers a parameter the bf16 graphs read only through their cast in bf16: half
    /// its f32 bytes.
    #[test]
    fn reductions_take_their_groups_and_bf16_gathers_half() {
        let p = StageParams { shared: 160.0, routed: 80.0, gathered: 0.0 };
        assert_eq!(p.reduced(2.0, (16, 16)), 2.0 * 15.0 / 16.0 * 160.0);
        assert_eq!(p.reduced(1.0, (16, 4)), 15.0 / 16.0 * 160.0 + 3.0 / 4.0 * 80.0);
        let model = ModelConfig::preset("moe-tiny").unwrap();
        let spec = &stage_specs(&model, Kind::OneFOneB, &Shape::new(2, 1, 2), None).unwrap()[1];
        let of = |dtype| {
            let opts = StageOptions::mixed(2, 8, dtype);
            let graphs =
                graphpp_runtime::train::build::all_stage_graphs(&model, std::slice::from_ref(spec), &opts)
                    .unwrap();
            StageParams::of(&graphs[0], &model, true)
        };
        let (f32s, bf16s) = (of(DType::F32), of(DType::BF16));
        assert!(f32s.routed > 0.0 && f32s.shared > 0.0, "{f32s:?}");
        assert_eq!(f32s.gathered, f32s.shared + f32s.routed);
        assert!(bf16s.gathered < 0.6 * bf16s.shared + 0.6 * bf16s.routed, "{bf16s:?}");
    }

    /// On a cluster the same layout costs what its traffic crosses: tp = 4 on nodes of 4
    /// devices keeps its collectives on NVLink; on nodes of 2 they cross the network, and the
    /// predicted step is longer (compute equal: the device is the same).
    #[test]
    fn a_cluster_charges_the_links_a_layout_crosses() {
        let mut node4 = crate::hardware::Hardware::preset("h100-sxm").unwrap();
        node4.devices_per_node = 4;
        let node2 = crate::hardware::Hardware { devices_per_node: 2, ..node4.clone() };
        let step = |h: crate::hardware::Hardware| {
            let r = PlanRequest {
                ranks: 4,
                tp: Some(4),
                microbatches: Some(4),
                kinds: vec![Kind::OneFOneB],
                speed: h.speed(DType::F32),
                hardware: Some(h),
                ..request(u64::MAX)
            };
            let all = plan(&r).unwrap();
            let c = all.iter().find(|c| c.recompute == Recompute::SaveAll).unwrap().clone();
            assert_eq!((c.pp, c.dp, c.tp), (1, 1, 4));
            c.step_seconds
        };
        let slow = crate::hardware::Hardware {
            intra_node: crate::hardware::Link { latency_us: 1000.0, ..node4.intra_node },
            ..node4.clone()
        };
        let (inside, across, late) = (step(node4), step(node2), step(slow));
        assert!(across > inside, "tp over the network {across} s vs inside a node {inside} s");
        // Every tp ring step pays the latency: at least one 1 ms step lies on the critical path.
        assert!(late - inside >= 1e-3, "1 ms latency: {late} s vs {inside} s");
    }

    /// One rank per pipeline still lists every kind of one stage per rank: 1F1B there is
    /// gradient accumulation (one microbatch held), GPipe holds all of them.
    #[test]
    fn without_a_pipeline_one_f_one_b_accumulates_in_less_memory_than_gpipe() {
        let r = PlanRequest {
            ranks: 1,
            kinds: vec![Kind::Gpipe, Kind::OneFOneB, Kind::Zbv],
            ..request(u64::MAX)
        };
        let all = plan(&r).unwrap();
        let peak = |k: Kind| {
            all.iter()
                .find(|c| c.kind == k && c.microbatches == 8 && c.recompute == Recompute::SaveAll)
                .unwrap()
                .peak_bytes
        };
        assert!(
            peak(Kind::OneFOneB) < peak(Kind::Gpipe),
            "{} vs {}",
            peak(Kind::OneFOneB),
            peak(Kind::Gpipe)
        );
        assert!(all.iter().all(|c| c.kind != Kind::Zbv), "v = 2 on one rank is not listed");
    }

    #[test]
    fn bad_requests_are_named() {
        let r = PlanRequest { ranks: 0, ..request(1) };
        assert_eq!(plan(&r).unwrap_err(), PlanError::Zero("--ranks"));
        let r = PlanRequest { link_bytes_per_second: f64::NAN, ..request(1) };
        assert!(matches!(plan(&r).unwrap_err(), PlanError::Rate { what: "the link bandwidth", .. }));
        let r = PlanRequest { pp: Some(3), ..request(1) };
        assert_eq!(plan(&r).unwrap_err().to_string(), "--pp 3 does not divide --ranks 2");
        let r = PlanRequest { microbatches: Some(3), ..request(1) };
        assert_eq!(plan(&r).unwrap_err().to_string(), "--microbatches 3 does not divide --global-batch 8");
        let r = PlanRequest { tp: Some(3), ..request(1) };
        assert_eq!(plan(&r).unwrap_err().to_string(), "--tp 3 does not divide --ranks 2");
        let r = PlanRequest { pp: Some(2), tp: Some(2), ..request(1) };
        assert_eq!(plan(&r).unwrap_err().to_string(), "--pp × --tp 4 does not divide --ranks 2");
        // A pinned tp the model cannot take names the field, not "no candidate".
        let two_heads =
            graphpp_models::LlamaConfig { num_attention_heads: 2, ..graphpp_models::LlamaConfig::tiny() };
        let r = PlanRequest { ranks: 4, tp: Some(4), model: ModelConfig::Llama(two_heads), ..request(1) };
        let e = plan(&r).unwrap_err().to_string();
        assert!(e.starts_with("--tp 4: ") && e.contains("`num_attention_heads` = 2"), "{e}");
    }

    /// `--pp`, `--tp` and `--microbatches` pin the search: every row has them, and a pinned m
    /// is searched even above `--max-microbatches`.
    #[test]
    fn pinned_pp_and_microbatches_are_the_only_ones_listed() {
        let all = plan(&request(u64::MAX)).unwrap();
        assert!(all.iter().any(|c| c.pp == 1) && all.iter().any(|c| c.pp == 2));
        let r = PlanRequest { pp: Some(2), microbatches: Some(8), max_microbatches: 2, ..request(u64::MAX) };
        let pinned = plan(&r).unwrap();
        assert!(!pinned.is_empty());
        assert!(pinned.iter().all(|c| c.pp == 2 && c.microbatches == 8), "{pinned:?}");
        let want = all.iter().filter(|c| c.pp == 2 && c.microbatches == 8).count();
        assert_eq!(pinned.len(), want);
        let tp2 = plan(&PlanRequest { tp: Some(2), ..request(u64::MAX) }).unwrap();
        assert!(!tp2.is_empty() && tp2.iter().all(|c| c.tp == 2), "{tp2:?}");
        assert_eq!(tp2.len(), all.iter().filter(|c| c.tp == 2).count());
    }
}
