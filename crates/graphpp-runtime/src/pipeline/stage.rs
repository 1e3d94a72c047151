//! The stages one rank holds, run as real stage graphs under the schedule executor
//! (docs/ARCHITECTURE.md "Runtime" → Stage).
//!
//! A [`Stage`] is its callables (fw, full_bw, bw_di, bw_dw from [`StageGraphs`]) and its state
//! (parameters and buffers, gradient accumulators). [`GraphStages`] holds a rank's stages (loop
//! or V placement: any set of stage ids) and the per-(stage, microbatch) caches: the values the
//! backward reads (stage input or tokens/targets, `saved.*`) kept from F until its B or I, and
//! the dI → dW stash kept from I until W. Each cache entry is removed by its last use.
//!
//! Loss scaling (docs/ARCHITECTURE.md "Runtime" → Semantics): a microbatch's loss is the mean over its
//! tokens (the last stage's fw computes it and its full_bw seeds d loss = 1); the step loss is the
//! mean over the `m` microbatches, so every gradient a route's last stage produces (`grad.input`,
//! `grad.<param>`) is multiplied by 1/m — which scales every upstream gradient too, as backward
//! is linear in the seed. Accumulators then hold d(step loss)/dθ.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use candle_core::{Device, Tensor};
use graphpp_graph::names::{
    grad_of, grad_target, Side, AUX_LOSS, EXPERT_LOAD, INPUT, LOSS, MTP_LOSS, OUTPUT, TARGETS, TOKENS,
};
use graphpp_graph::passes::{multiplex_fw_bw, Multiplex};
use graphpp_graph::{Graph, GraphError, InputKind, StageGraphs};
use graphpp_schedule::Task;

use crate::exec::{CollectiveSpan, ExecError, ExecReport, GraphComm, Program, RunOptions};
use crate::kernels::accumulate::Accumulators;
use crate::kernels::tensor::{tensor_from_f64, to_f64};
use crate::pipeline::data_parallel::{DataParallel, DataParallelError};
use crate::pipeline::{StageWork, WorkError};
use graphpp_schedule::StageOpKind;

/// Values by name (graph inputs or outputs).
pub type Env = HashMap<String, Tensor>;

/// Sums tensors of the same name (a parameter's gradients from several stages or ranks, e.g.
/// DualPipe's two copies). Errors: candle's, for tensors of one name with different shapes.
pub fn sum_by_name(items: impl IntoIterator<Item = (String, Tensor)>) -> candle_core::Result<Env> {
    let mut out = Env::new();
    for (name, g) in items {
        let sum = match out.remove(&name) {
            Some(a) => a.add(&g)?,
            None => g,
        };
        out.insert(name, sum);
    }
    Ok(out)
}

/// Why a stage computation failed; names the stage and microbatch.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// A value the action needs is not there (e.g. B before F, W before I, a stage this rank
    /// does not hold, a microbatch without data).
    #[error("stage {stage} mb {mb}: missing {what}")]
    Missing {
        /// Stage id.
        stage: usize,
        /// Microbatch id.
        mb: usize,
        /// What is missing.
        what: String,
    },
    /// Executing a graph failed (wrong input shape, kernel error).
    #[error("stage {stage} mb {mb}: {source}")]
    Exec {
        /// Stage id.
        stage: usize,
        /// Microbatch id.
        mb: usize,
        /// The executor's error.
        source: ExecError,
    },
    /// Building the overlap graph failed.
    #[error("overlap graph of stages {f} and {b}: {source}")]
    Overlap {
        /// Stage of the forward half.
        f: usize,
        /// Stage of the backward half.
        b: usize,
        /// The pass error.
        source: GraphError,
    },
    /// A parameter given to [`Stage::set_parameters`] (or a buffer to [`Stage::set_buffer`]) is
    /// missing or has the wrong shape or dtype.
    #[error("parameter {name}: {reason}")]
    Parameter {
        /// Parameter name.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// A data-parallel reduction, gather or shard failed.
    #[error(transparent)]
    DataParallel(#[from] DataParallelError),
    /// The schedule holds UNSHARD / RESHARD / REDUCE_GRAD but the rank has no data-parallel
    /// group ([`GraphStages::set_data_parallel`]): running them as no-ops would be wrong.
    #[error("stage {stage}: {op} needs a data-parallel group, and this rank has none")]
    NoDataParallel {
        /// Stage id.
        stage: usize,
        /// The stage op.
        op: String,
    },
    /// A tensor operation (gradient accumulation or scaling) failed.
    #[error("stage {stage}: {source}")]
    Tensor {
        /// Stage id.
        stage: usize,
        /// candle's error.
        source: candle_core::Error,
    },
}

/// Token ids and targets of every microbatch of one step: `tokens[j]`, `targets[j]` are
/// `[B, T]` u32 tensors for microbatch `j`.
#[derive(Debug, Clone)]
pub struct Microbatches {
    /// Input token ids per microbatch.
    pub tokens: Vec<Tensor>,
    /// Target token ids per microbatch.
    pub targets: Vec<Tensor>,
}

impl Microbatches {
    /// Number of microbatches `m`.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }
    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }
}

/// One stage: its graphs, parameters + buffers, and gradient accumulators.
#[derive(Debug)]
pub struct Stage {
    graphs: Arc<StageGraphs>,
    /// The graphs compiled once for the compiled executor ([`Program`]).
    programs: Arc<Programs>,
    state: Env,
    grads: Accumulators,
    /// Names the backward graphs read that are not state (F keeps those of them it has: its
    /// inputs and `saved.*` outputs; the output gradient arrives with B or I).
    bw_reads: HashSet<String>,
    /// Names bw_dw reads (kept in the stash after I).
    dw_reads: HashSet<String>,
    /// Names of the parameter inputs of fw (what the optimizer updates), in input order.
    params: Vec<String>,
    /// The parameters every graph of the stage reads only through a cast to bf16 (mixed
    /// precision): FSDP gathers them in bf16 ([`crate::pipeline::data_parallel`]).
    bf16_params: HashSet<String>,
    first: bool,
    last: bool,
    /// Where the stage's state lives and its graphs run; the inputs a step brings (tokens,
    /// targets, received activations and gradients) are moved here.
    device: Device,
}

/// A stage's graphs compiled ([`Program::compile`]), field for field as in [`StageGraphs`].
#[derive(Debug)]
struct Programs {
    fw: Program,
    full_bw: Program,
    di_dw: Option<(Program, Program)>,
}

impl Programs {
    /// Drops every program's kept copies of transposed parameters ([`Program::clear_kept`]).
    fn clear_kept(&self) {
        self.fw.clear_kept();
        self.full_bw.clear_kept();
        if let Some((di, dw)) = &self.di_dw {
            di.clear_kept();
            dw.clear_kept();
        }
    }

    /// The stage's programs, sharing one store of kept values: a weight's bf16 cast (or
    /// transposed copy) is made once a step for all of them.
    fn compile(g: &StageGraphs) -> Self {
        let kept = crate::exec::kept::KeptStore::default();
        let compile = |graph| Program::compile_with(graph, kept.clone());
        Programs {
            fw: compile(&g.fw),
            full_bw: compile(&g.full_bw),
            di_dw: g.di_dw.as_ref().map(|(di, dw)| (compile(di), compile(dw))),
        }
    }
}

/// What a stage keeps between its actions: the names its backward graphs read that are not
/// state (`is_state`) — kept from F until B or I, where present then — and those bw_dw reads
/// (kept from I until W). One rule for the runtime's caches and the byte model
/// ([`crate::train::bytes::stage_bytes`]).
pub(crate) fn kept_names(
    graphs: &StageGraphs,
    is_state: impl Fn(&str) -> bool,
) -> (HashSet<String>, HashSet<String>) {
    let mut bw_reads: HashSet<String> = graphs.full_bw.input_names().into_iter().collect();
    let mut dw_reads = HashSet::new();
    if let Some((di, dw)) = &graphs.di_dw {
        bw_reads.extend(di.input_names());
        dw_reads.extend(dw.input_names().into_iter().filter(|n| !is_state(n)));
        bw_reads.extend(dw_reads.iter().cloned());
    }
    bw_reads.retain(|n| !is_state(n));
    (bw_reads, dw_reads)
}

/// The `params` that every graph of `graphs` reading them reads only through a cast to bf16
/// (FSDP gathers those in bf16).
pub fn read_as_bf16(graphs: &StageGraphs, params: &[String]) -> HashSet<String> {
    let mut all = vec![&graphs.fw, &graphs.full_bw];
    if let Some((di, dw)) = &graphs.di_dw {
        all.extend([di, dw]);
    }
    let to_bf16 =
        |op: &graphpp_graph::Op| matches!(op, graphpp_graph::Op::Cast { dtype: graphpp_graph::DType::BF16 });
    let mut out: HashSet<String> = params.iter().cloned().collect();
    for g in all {
        // A graph without a cast to bf16 (every graph of an f32 stage) reads what it reads as is.
        if !g.nodes.iter().any(|n| to_bf16(&n.op)) {
            out.retain(|p| g.input_by_name(p).is_none());
            continue;
        }
        let users = g.users();
        out.retain(|p| {
            g.input_by_name(p).is_none_or(|v| users[v.0].iter().all(|u| to_bf16(&g.nodes[u.0].op)))
        });
    }
    out
}

impl Stage {
    /// A stage from its graphs and its `state` on `device`: every parameter and buffer input of
    /// `graphs.fw` by name. The stage reads `tokens` when fw has that input (a model's first
    /// stage) and produces the loss when fw outputs `loss` (its last stage).
    pub fn new(graphs: StageGraphs, state: Env, device: Device) -> Self {
        debug_assert!(
            state.values().all(|t| t.device().same_device(&device)),
            "a stage's state lives on its device"
        );
        let (bw_reads, dw_reads) = kept_names(&graphs, |n| state.contains_key(n));
        let first = graphs.fw.input_by_name(TOKENS).is_some();
        let last = graphs.fw.output_by_name(LOSS).is_some();
        let params: Vec<String> = graphs
            .fw
            .input_specs()
            .into_iter()
            .filter(|i| i.kind == InputKind::Parameter)
            .map(|i| i.name)
            .collect();
        let programs = Arc::new(Programs::compile(&graphs));
        let bf16_params = read_as_bf16(&graphs, &params);
        Stage {
            graphs: Arc::new(graphs),
            programs,
            state,
            grads: Accumulators::default(),
            bw_reads,
            dw_reads,
            params,
            bf16_params,
            first,
            last,
            device,
        }
    }

    /// Names of the stage's parameters (the fw inputs of kind parameter), in input order.
    pub fn parameter_names(&self) -> &[String] {
        &self.params
    }

    /// The parameters by name (tensor handles; no copy).
    pub fn parameters(&self) -> Env {
        self.params.iter().filter_map(|n| self.state.get(n).map(|t| (n.clone(), t.clone()))).collect()
    }

    /// Checks that `params` holds every parameter of the stage with its shape and dtype (other
    /// names are ignored). Errors: [`StageError::Parameter`] naming the first one missing or
    /// misshapen.
    pub fn check_parameters(&self, params: &Env) -> Result<(), StageError> {
        for n in &self.params {
            let bad = |reason: String| StageError::Parameter { name: n.clone(), reason };
            let new = params.get(n).ok_or_else(|| bad("missing".into()))?;
            let old = &self.state[n];
            if new.dims() != old.dims() || new.dtype() != old.dtype() {
                return Err(bad(format!(
                    "given {:?} {:?}, the stage holds {:?} {:?}",
                    new.dims(),
                    new.dtype(),
                    old.dims(),
                    old.dtype()
                )));
            }
        }
        Ok(())
    }

    /// Replaces every parameter of the stage with the tensor of the same name in `params` (other
    /// names are ignored), moved to the stage's device. Errors: as [`Stage::check_parameters`],
    /// or a move that fails; nothing changes then.
    pub fn set_parameters(&mut self, params: &Env) -> Result<(), StageError> {
        self.check_parameters(params)?;
        let moved = self
            .params
            .iter()
            .map(|n| match params[n].to_device(&self.device) {
                Ok(p) => Ok((n.clone(), p)),
                Err(e) => Err(StageError::Parameter { name: n.clone(), reason: e.to_string() }),
            })
            .collect::<Result<Vec<_>, _>>()?;
        self.state.extend(moved);
        Ok(())
    }

    /// Replaces the buffer `name` (e.g. a MoE layer's balancing bias), keeping its shape and
    /// dtype; `false` (nothing changes) when the stage has no such buffer. Errors: a tensor of
    /// another shape.
    pub fn set_buffer(&mut self, name: &str, value: &Tensor) -> Result<bool, StageError> {
        let Some(old) = self.state.get(name) else { return Ok(false) };
        let bad = |reason: String| StageError::Parameter { name: name.to_string(), reason };
        if old.dims() != value.dims() {
            return Err(bad(format!("buffer shape {:?}, expected {:?}", value.dims(), old.dims())));
        }
        let v = value.to_dtype(old.dtype()).and_then(|v| v.to_device(&self.device));
        self.state.insert(name.to_string(), v.map_err(|e| bad(e.to_string()))?);
        Ok(true)
    }

    /// Moves the accumulated gradients out, keyed by parameter name (without the `grad.`
    /// prefix of [`Stage::grads`]); the accumulators restart at zero for the next step.
    pub fn take_grads(&mut self) -> Env {
        self.grads
            .take()
            .into_iter()
            .map(|(k, v)| (grad_target(&k).map(str::to_string).unwrap_or(k), v))
            .collect()
    }

    /// Accumulated gradients `grad.<param>` (d step loss / dθ summed over the microbatches run so
    /// far); a parameter appears once its stage ran a backward. A sum may change in place at the
    /// next backward ([`Accumulators`]).
    pub fn grads(&self) -> &Env {
        self.grads.sums()
    }

    /// Parameters and buffers by name.
    pub fn state(&self) -> &Env {
        &self.state
    }
}

/// The stages one rank holds and their per-microbatch caches; implements [`StageWork`].
#[derive(Debug)]
pub struct GraphStages {
    stages: BTreeMap<usize, Stage>,
    data: Arc<Microbatches>,
    saved: HashMap<Task, Env>,
    stash: HashMap<Task, Env>,
    losses: BTreeMap<usize, f64>,
    /// Tokens per expert of each MoE layer this step, by layer.
    expert_load: BTreeMap<usize, Vec<f64>>,
    /// Auxiliary losses of this step's forwards, summed (the MTP loss apart).
    aux_loss: f64,
    /// The multi-token-prediction losses ([`MTP_LOSS`], λ-weighted) of this step's forwards,
    /// summed.
    mtp_loss: f64,
    overlap: HashMap<(usize, usize), Arc<(Graph, Program)>>,
    /// Peak activation bytes of the step so far (see [`GraphStages::peak_activation_bytes`]).
    peak_activation_bytes: usize,
    /// Data parallelism / FSDP of this rank, if any.
    dp: Option<DataParallel>,
    /// Where the stage graphs' own collectives run (expert parallelism's all-to-alls), if any.
    graph_comm: Option<StageComm>,
    /// The stage graphs' collectives since [`StageWork::take_collectives`], labelled.
    collectives: Vec<(String, CollectiveSpan)>,
}

/// What a rank's stage graphs need to run their collectives ([`crate::exec::GraphComm`]).
#[derive(Clone)]
pub struct StageComm {
    /// This rank's communicator.
    pub comm: Arc<dyn graphpp_comm::Comm>,
    /// The mesh the graph groups resolve through.
    pub mesh: graphpp_comm::mesh::Mesh,
    /// Bound on each collective's wait.
    pub timeout: std::time::Duration,
}

impl std::fmt::Debug for StageComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StageComm").field("rank", &self.comm.rank()).field("mesh", &self.mesh).finish()
    }
}

/// Runs `g` through its compiled `program` (its collectives over `comm`); returns its outputs by
/// name and the run's report (outputs taken).
fn run_graph(
    g: &Graph,
    program: &Program,
    env: &Env,
    t: Task,
    comm: Option<&StageComm>,
) -> Result<(Env, ExecReport), StageError> {
    let gc = comm.map(|c| GraphComm { comm: &*c.comm, mesh: &c.mesh, timeout: c.timeout });
    let mut r = program
        .run_named_with(g, env, &RunOptions::default(), gc.as_ref())
        .map_err(|source| StageError::Exec { stage: t.stage, mb: t.mb, source })?;
    let outs = g.output_names().into_iter().zip(std::mem::take(&mut r.outputs)).collect();
    Ok((outs, r))
}

/// The seeds of a backward graph's auxiliary losses: every input `grad.aux_loss.<layer>` of
/// `bw` ([`AUX_LOSS`]) bound to the scalar `seed` in its dtype — d objective / d aux, 1 for a
/// graph over the whole batch, 1/m for one microbatch of m whose gradients are not scaled later.
///
/// # Errors
/// A tensor that cannot be made in the input's dtype.
pub fn aux_loss_seeds(bw: &Graph, seed: f64) -> candle_core::Result<Env> {
    let prefix = grad_of(AUX_LOSS);
    bw.input_specs()
        .into_iter()
        .filter(|i| i.name.starts_with(&prefix))
        .map(|i| Ok((i.name, tensor_from_f64(&[seed], &[], i.ty.dtype)?)))
        .collect()
}

/// Logical bytes (`numel × dtype size`) of the tensors of `env`.
pub fn env_bytes<'a>(env: impl IntoIterator<Item = &'a Tensor>) -> usize {
    env.into_iter().map(|t| t.elem_count() * t.dtype().size_in_bytes()).sum()
}

fn missing(t: Task, what: &str) -> StageError {
    StageError::Missing { stage: t.stage, mb: t.mb, what: what.into() }
}

impl GraphStages {
    /// A rank's `stages` (by stage id) for one step over `data` (m = `data.len()`).
    pub fn new(stages: BTreeMap<usize, Stage>, data: Arc<Microbatches>) -> Self {
        GraphStages {
            stages,
            data,
            saved: HashMap::new(),
            stash: HashMap::new(),
            losses: BTreeMap::new(),
            expert_load: BTreeMap::new(),
            aux_loss: 0.0,
            mtp_loss: 0.0,
            overlap: HashMap::new(),
            peak_activation_bytes: 0,
            dp: None,
            graph_comm: None,
            collectives: Vec::new(),
        }
    }

    /// Runs the stage graphs' collectives (expert parallelism's token all-to-alls) over `comm`.
    pub fn set_graph_comm(&mut self, comm: StageComm) {
        self.graph_comm = Some(comm);
    }

    /// Makes this rank a member of a data-parallel group: the schedule's REDUCE_GRAD (and, with
    /// FSDP, UNSHARD / RESHARD) then run over it ([`crate::pipeline::data_parallel`]). With FSDP every
    /// parameter of every stage is replaced by this rank's shard.
    ///
    /// # Errors
    /// [`StageError::DataParallel`] when a parameter cannot be sharded.
    pub fn set_data_parallel(&mut self, mut dp: DataParallel) -> Result<(), StageError> {
        if dp.fsdp() {
            for st in self.stages.values_mut() {
                for n in &st.params {
                    if let Some(full) = st.state.get(n) {
                        let shard = dp.to_shard(n, full)?;
                        st.state.insert(n.clone(), shard);
                    }
                }
            }
        }
        self.dp = Some(dp);
        Ok(())
    }

    /// This rank's data parallelism, if any.
    pub fn data_parallel(&self) -> Option<&DataParallel> {
        self.dp.as_ref()
    }

    /// Waits for the gradient reductions the step's REDUCE_GRAD actions started and puts the
    /// replicas' mean (with FSDP, this rank's shard of it) into each stage's accumulators.
    /// Nothing to do without data parallelism.
    ///
    /// # Errors
    /// [`StageError::DataParallel`] (a timeout, another rank's abort).
    pub fn finish_data_parallel(&mut self) -> Result<(), StageError> {
        let Some(dp) = self.dp.as_mut() else { return Ok(()) };
        for (stage, name, mean) in dp.finish()? {
            let st = self.stages.get_mut(&stage).ok_or_else(|| missing(Task::new(stage, 0), "stage"))?;
            st.grads.insert(grad_of(&name), mean);
        }
        Ok(())
    }

    /// Before a compute on `stage`: waits for the all-gathers an UNSHARD started and puts the
    /// full parameters into its state.
    fn ready(&mut self, stage: usize) -> Result<(), StageError> {
        let Some(dp) = self.dp.as_mut() else { return Ok(()) };
        let full = dp.wait_unshard(stage)?;
        if let Some(st) = self.stages.get_mut(&stage) {
            st.state.extend(full);
        }
        Ok(())
    }

    /// UNSHARD / RESHARD / REDUCE_GRAD of `stage` (see [`crate::pipeline::data_parallel`]).
    fn run_stage_op(&mut self, kind: StageOpKind, stage: usize) -> Result<(), StageError> {
        if self.dp.is_none() {
            return Err(StageError::NoDataParallel { stage, op: format!("{kind:?}") });
        }
        let t = Task::new(stage, 0);
        match kind {
            StageOpKind::Unshard => {
                let st =
                    self.stages.get_mut(&stage).ok_or_else(|| missing(t, "stage (not held by this rank)"))?;
                let shards: Vec<(String, Tensor)> =
                    st.params.iter().filter_map(|n| st.state.remove(n).map(|s| (n.clone(), s))).collect();
                let bf16 = &st.bf16_params;
                self.dp
                    .as_mut()
                    .map_or(Ok(()), |dp| dp.start_unshard(stage, shards, |n| bf16.contains(n)))?;
            }
            StageOpKind::Reshard => {
                self.ready(stage)?;
                let shards = self.dp.as_mut().map(|dp| dp.reshard(stage)).unwrap_or_default();
                let st =
                    self.stages.get_mut(&stage).ok_or_else(|| missing(t, "stage (not held by this rank)"))?;
                st.state.extend(shards);
                // The full parameters are gone: so are their transposed copies.
                st.programs.clear_kept();
            }
            StageOpKind::ReduceGrad => {
                let st =
                    self.stages.get_mut(&stage).ok_or_else(|| missing(t, "stage (not held by this rank)"))?;
                let grads: Vec<(String, Tensor)> = st.take_grads().into_iter().collect();
                self.dp.as_mut().map_or(Ok(()), |dp| dp.start_reduce(stage, grads))?;
            }
            // Every started reduction is awaited at the end of the step
            // ([`GraphStages::finish_data_parallel`]); waiting earlier changes no value.
            StageOpKind::WaitReduceGrad => {}
        }
        Ok(())
    }

    /// Peak activation memory of this rank in the current step, bytes: the largest, over the
    /// actions run, of the per-microbatch caches held by other (stage, microbatch) pairs (saved
    /// activations, dI→dW stashes) plus the running graph's peak live bytes (see
    /// [`crate::exec`]: activations only, no parameters). Reset by [`GraphStages::start_step`].
    pub fn peak_activation_bytes(&self) -> usize {
        self.peak_activation_bytes
    }

    /// Bytes of this rank's stage state (parameters and buffers) and gradient accumulators.
    pub fn state_bytes(&self) -> usize {
        self.stages.values().map(|s| env_bytes(s.state.values()) + env_bytes(s.grads.sums().values())).sum()
    }

    /// Runs `g` for `t` on its stage's device (an input from elsewhere — tokens, a received
    /// activation or gradient — moved there first) and records the rank's activation peak
    /// during it.
    fn run_graph(&mut self, g: &Graph, program: &Program, env: &Env, t: Task) -> Result<Env, StageError> {
        let device = self.stage(t)?.device.clone();
        let moved;
        let env = if env.values().all(|x| x.device().same_device(&device)) {
            env
        } else {
            let to = |(k, x): (&String, &Tensor)| Ok((k.clone(), x.to_device(&device)?));
            moved = env
                .iter()
                .map(to)
                .collect::<candle_core::Result<Env>>()
                .map_err(|source| StageError::Tensor { stage: t.stage, source })?;
            &moved
        };
        let (outs, report) = run_graph(g, program, env, t, self.graph_comm.as_ref())?;
        let cached = env_bytes(self.saved.values().chain(self.stash.values()).flat_map(|e| e.values()));
        self.peak_activation_bytes = self.peak_activation_bytes.max(cached + report.peak_live_bytes);
        self.collectives.extend(report.collectives.into_iter().map(|c| (c.label(g), c)));
        Ok(outs)
    }

    /// The stages, by stage id.
    pub fn stages(&self) -> &BTreeMap<usize, Stage> {
        &self.stages
    }

    /// The stages, by stage id, mutable (the optimizer updates their parameters between steps).
    pub fn stages_mut(&mut self) -> &mut BTreeMap<usize, Stage> {
        &mut self.stages
    }

    /// Prepares the next step over `data`: forgets the last step's losses and any cache a failed
    /// step left. Gradients are not touched (take them with [`Stage::take_grads`]).
    pub fn start_step(&mut self, data: Arc<Microbatches>) {
        self.data = data;
        self.losses.clear();
        self.aux_loss = 0.0;
        self.mtp_loss = 0.0;
        self.expert_load.clear();
        self.saved.clear();
        self.stash.clear();
        self.peak_activation_bytes = 0;
    }

    /// The auxiliary losses (`aux_loss.<layer>` outputs) of the forwards this rank ran this
    /// step, summed over layers and microbatches (the MTP loss apart).
    pub fn aux_loss(&self) -> f64 {
        self.aux_loss
    }

    /// The multi-token-prediction losses ([`MTP_LOSS`]: λ times the cross-entropy) of the
    /// forwards this rank ran this step, summed over microbatches.
    pub fn mtp_loss(&self) -> f64 {
        self.mtp_loss
    }

    /// Loss (mean over its tokens) of each microbatch whose route ends on this rank.
    pub fn losses(&self) -> &BTreeMap<usize, f64> {
        &self.losses
    }

    /// Number of (stage, microbatch) cache entries still held (saved activations + dI→dW
    /// stashes); 0 after a complete step.
    pub fn live_caches(&self) -> usize {
        self.saved.len() + self.stash.len()
    }

    fn stage(&self, t: Task) -> Result<&Stage, StageError> {
        self.stages.get(&t.stage).ok_or_else(|| missing(t, "stage (not held by this rank)"))
    }

    /// fw inputs of `t`: state, then tokens (first stage) or the received input, then targets.
    fn fw_env(&self, t: Task, input: Option<Tensor>) -> Result<Env, StageError> {
        let st = self.stage(t)?;
        let mut env = st.state.clone();
        let data = |v: &Vec<Tensor>| v.get(t.mb).cloned().ok_or_else(|| missing(t, "microbatch data"));
        if st.first {
            env.insert(TOKENS.into(), data(&self.data.tokens)?);
        } else {
            env.insert(INPUT.into(), input.ok_or_else(|| missing(t, "input activation"))?);
        }
        if st.last {
            env.insert(TARGETS.into(), data(&self.data.targets)?);
        }
        Ok(env)
    }

    /// Keeps what the backward reads, records the loss; returns the output for the next stage.
    fn after_fw(&mut self, t: Task, mut env: Env, outs: Env) -> Result<Option<Tensor>, StageError> {
        self.count_expert_load(t, &outs)?;
        for (name, aux) in outs.iter().filter(|(k, _)| k.starts_with(AUX_LOSS)) {
            let value = to_f64(aux).map_err(|source| StageError::Tensor { stage: t.stage, source })?[0];
            *(if name == MTP_LOSS { &mut self.mtp_loss } else { &mut self.aux_loss }) += value;
        }
        let st = self.stage(t)?;
        env.extend(outs);
        let loss = if st.last {
            let loss = env.get(LOSS).ok_or_else(|| missing(t, "loss output"))?;
            Some(to_f64(loss).map_err(|source| StageError::Tensor { stage: t.stage, source })?[0])
        } else {
            None
        };
        let out = match loss {
            Some(_) => None,
            None => Some(env.get(OUTPUT).cloned().ok_or_else(|| missing(t, "output"))?),
        };
        let keep: Env = env.into_iter().filter(|(k, _)| st.bw_reads.contains(k)).collect();
        if let Some(l) = loss {
            self.losses.insert(t.mb, l);
        }
        self.saved.insert(t, keep);
        Ok(out)
    }

    /// Adds the forward's `expert_load.<layer>` outputs to the step's counts.
    fn count_expert_load(&mut self, t: Task, outs: &Env) -> Result<(), StageError> {
        for (name, counts) in outs.iter().filter(|(k, _)| k.starts_with(EXPERT_LOAD)) {
            let layer: usize = name[EXPERT_LOAD.len()..]
                .parse()
                .map_err(|_| missing(t, "layer number of an expert_load output"))?;
            let c = to_f64(counts).map_err(|source| StageError::Tensor { stage: t.stage, source })?;
            let sum = self.expert_load.entry(layer).or_insert_with(|| vec![0.0; c.len()]);
            sum.iter_mut().zip(c).for_each(|(s, x)| *s += x);
        }
        Ok(())
    }

    /// Tokens routed to each expert of each MoE layer this rank ran, summed over the step's
    /// microbatches so far (by layer; see [`graphpp_graph::names::EXPERT_LOAD`]).
    pub fn expert_load(&self) -> &BTreeMap<usize, Vec<f64>> {
        &self.expert_load
    }

    /// Backward inputs of `t`: state, the cache F kept (removed), and `grad.output`.
    fn bw_env(&mut self, t: Task, grad: Option<Tensor>) -> Result<Env, StageError> {
        let cache = self.saved.remove(&t).ok_or_else(|| missing(t, "saved activations (F not run)"))?;
        let st = self.stage(t)?;
        let mut env = st.state.clone();
        env.extend(cache);
        if !st.last {
            env.insert(grad_of(OUTPUT), grad.ok_or_else(|| missing(t, "output gradient"))?);
        }
        // d objective / d aux_loss: 1/m per microbatch — except on a route's last stage, whose
        // gradients are all scaled by 1/m afterwards (`scaled`).
        let m = self.data.len().max(1) as f64;
        let seed = if st.last { 1.0 } else { 1.0 / m };
        let seeds = aux_loss_seeds(&st.graphs.full_bw, seed)
            .map_err(|source| StageError::Tensor { stage: t.stage, source })?;
        env.extend(seeds);
        Ok(env)
    }

    /// The factor 1/m a backward's outputs take on a route's last stage (see the module doc);
    /// `None` elsewhere and for one microbatch.
    fn scale(&self, t: Task) -> Result<Option<f32>, StageError> {
        let m = self.data.len().max(1);
        Ok((self.stage(t)?.last && m > 1).then_some((1.0 / m as f64) as f32))
    }

    /// `g` times [`Self::scale`] (a new tensor), or `g` itself.
    fn scaled(&self, t: Task, g: Tensor) -> Result<Tensor, StageError> {
        crate::kernels::accumulate::scaled(g, self.scale(t)?)
            .map_err(|source| StageError::Tensor { stage: t.stage, source })
    }

    /// Accumulates the `grad.<param>` outputs (in place, [`Accumulators`]); returns
    /// `grad.input` (scaled), if any.
    fn after_bw(&mut self, t: Task, outs: Env) -> Result<Option<Tensor>, StageError> {
        let gin_name = grad_of(INPUT);
        let scale = self.scale(t)?;
        let mut gin = None;
        for (name, g) in outs {
            if name == gin_name {
                gin = Some(self.scaled(t, g)?);
                continue;
            }
            let st = self.stages.get_mut(&t.stage).ok_or_else(|| missing(t, "stage"))?;
            st.grads.add(&name, g, scale).map_err(|source| StageError::Tensor { stage: t.stage, source })?;
        }
        Ok(gin)
    }

    fn overlap_graph(&mut self, f: usize, b: usize) -> Result<Arc<(Graph, Program)>, StageError> {
        if let Some(g) = self.overlap.get(&(f, b)) {
            return Ok(Arc::clone(g));
        }
        let get = |s: usize| self.stages.get(&s).ok_or_else(|| missing(Task::new(s, 0), "stage"));
        let g = multiplex_fw_bw(&get(f)?.graphs.fw, &get(b)?.graphs.full_bw, Multiplex::CommOverlap)
            .map_err(|source| StageError::Overlap { f, b, source })?;
        let program = Program::compile(&g);
        let g = Arc::new((g, program));
        self.overlap.insert((f, b), Arc::clone(&g));
        Ok(g)
    }

    fn forward_task(&mut self, t: Task, input: Option<Tensor>) -> Result<Option<Tensor>, StageError> {
        self.ready(t.stage)?;
        let env = self.fw_env(t, input)?;
        let st = self.stage(t)?;
        let (g, p) = (Arc::clone(&st.graphs), Arc::clone(&st.programs));
        let outs = self.run_graph(&g.fw, &p.fw, &env, t)?;
        self.after_fw(t, env, outs)
    }

    fn backward_task(&mut self, t: Task, grad: Option<Tensor>) -> Result<Option<Tensor>, StageError> {
        self.ready(t.stage)?;
        let env = self.bw_env(t, grad)?;
        let st = self.stage(t)?;
        let (g, p) = (Arc::clone(&st.graphs), Arc::clone(&st.programs));
        let outs = self.run_graph(&g.full_bw, &p.full_bw, &env, t)?;
        self.after_bw(t, outs)
    }

    /// I: runs bw_di and stashes what bw_dw reads. A stage without the split (a model's first
    /// stage has no input gradient) stashes its backward inputs and runs full_bw at W.
    fn input_task(&mut self, t: Task, grad: Option<Tensor>) -> Result<Option<Tensor>, StageError> {
        self.ready(t.stage)?;
        let env = self.bw_env(t, grad)?;
        let st = self.stage(t)?;
        let (g, p) = (Arc::clone(&st.graphs), Arc::clone(&st.programs));
        let (Some((di, _)), Some((pdi, _))) = (&g.di_dw, &p.di_dw) else {
            let keep: Env = env.into_iter().filter(|(k, _)| !st.state.contains_key(k)).collect();
            self.stash.insert(t, keep);
            return Ok(None);
        };
        let mut outs = self.run_graph(di, pdi, &env, t)?;
        let gin = outs.remove(&grad_of(INPUT)).ok_or_else(|| missing(t, "input gradient output of bw_di"))?;
        let dw_reads = &self.stage(t)?.dw_reads;
        outs.extend(env.into_iter().filter(|(k, _)| dw_reads.contains(k)));
        self.stash.insert(t, outs);
        Ok(Some(self.scaled(t, gin)?))
    }

    fn weight_task(&mut self, t: Task) -> Result<(), StageError> {
        self.ready(t.stage)?;
        let stash = self.stash.remove(&t).ok_or_else(|| missing(t, "dI→dW stash (I not run)"))?;
        let st = self.stage(t)?;
        let (g, p) = (Arc::clone(&st.graphs), Arc::clone(&st.programs));
        let mut env = st.state.clone();
        env.extend(stash);
        let (graph, program) = match (&g.di_dw, &p.di_dw) {
            (Some((_, dw)), Some((_, pdw))) => (dw, pdw),
            _ => (&g.full_bw, &p.full_bw),
        };
        let outs = self.run_graph(graph, program, &env, t)?;
        self.after_bw(t, outs).map(|_| ())
    }

    /// OVERLAP_F_B: one run of the multiplexed graph (fw of `f`, full_bw of `b`; inputs and
    /// outputs prefixed `f.` / `b.`).
    fn overlap_task(
        &mut self,
        f: Task,
        input: Option<Tensor>,
        b: Task,
        grad: Option<Tensor>,
    ) -> Result<(Option<Tensor>, Option<Tensor>), StageError> {
        self.ready(f.stage)?;
        self.ready(b.stage)?;
        let g = self.overlap_graph(f.stage, b.stage)?;
        let fenv = self.fw_env(f, input)?;
        let benv = self.bw_env(b, grad)?;
        let mut env: Env = fenv.iter().map(|(k, v)| (Side::Fw.name(k), v.clone())).collect();
        env.extend(benv.into_iter().map(|(k, v)| (Side::Bw.name(&k), v)));
        let (mut fo, mut bo) = (Env::new(), Env::new());
        for (k, v) in self.run_graph(&g.0, &g.1, &env, f)? {
            match Side::split(&k) {
                Some((Side::Fw, n)) => fo.insert(n.to_string(), v),
                Some((Side::Bw, n)) => bo.insert(n.to_string(), v),
                None => None,
            };
        }
        let out = self.after_fw(f, fenv, fo)?;
        let gin = self.after_bw(b, bo)?;
        Ok((out, gin))
    }
}

impl StageWork for GraphStages {
    fn forward(
        &mut self,
        stage: usize,
        mb: usize,
        input: Option<Tensor>,
    ) -> Result<Option<Tensor>, WorkError> {
        Ok(self.forward_task(Task::new(stage, mb), input)?)
    }

    fn backward(
        &mut self,
        stage: usize,
        mb: usize,
        grad: Option<Tensor>,
    ) -> Result<Option<Tensor>, WorkError> {
        Ok(self.backward_task(Task::new(stage, mb), grad)?)
    }

    fn backward_input(
        &mut self,
        stage: usize,
        mb: usize,
        grad: Option<Tensor>,
    ) -> Result<Option<Tensor>, WorkError> {
        Ok(self.input_task(Task::new(stage, mb), grad)?)
    }

    fn backward_weight(&mut self, stage: usize, mb: usize) -> Result<(), WorkError> {
        Ok(self.weight_task(Task::new(stage, mb))?)
    }

    fn overlap(
        &mut self,
        f: Task,
        input: Option<Tensor>,
        b: Task,
        grad: Option<Tensor>,
    ) -> Result<(Option<Tensor>, Option<Tensor>), WorkError> {
        Ok(self.overlap_task(f, input, b, grad)?)
    }

    fn stage_op(&mut self, kind: StageOpKind, stage: usize) -> Result<(), WorkError> {
        Ok(self.run_stage_op(kind, stage)?)
    }

    fn take_collectives(&mut self) -> Vec<(String, CollectiveSpan)> {
        std::mem::take(&mut self.collectives)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use graphpp_models::{build_stage, split_layers, LlamaConfig, Recompute, StageOptions};

    /// Under mixed precision every parameter of a Llama stage but the embedding table (cast after
    /// its row gather) is read only through its bf16 cast; in f32 none is.
    #[test]
    fn mixed_precision_reads_every_matrix_through_its_bf16_cast() {
        let cfg = LlamaConfig::tiny();
        let spec = split_layers(cfg.num_hidden_layers, 1, None).unwrap().remove(0);
        for dtype in [graphpp_graph::DType::BF16, graphpp_graph::DType::F32] {
            let opts = StageOptions::mixed(2, 8, dtype);
            let fw = build_stage(&cfg, &spec, &opts).unwrap();
            let graphs = graphpp_graph::stage_graphs(&fw, &Recompute::default().policy(&spec)).unwrap();
            let params: Vec<String> = fw
                .input_specs()
                .into_iter()
                .filter(|i| i.kind == InputKind::Parameter)
                .map(|i| i.name)
                .collect();
            let bf16 = read_as_bf16(&graphs, &params);
            if dtype == graphpp_graph::DType::BF16 {
                let rest: Vec<&String> = params.iter().filter(|p| !bf16.contains(*p)).collect();
                assert_eq!(rest, [&graphpp_models::llama::EMBED.to_string()]);
            } else {
                assert!(bf16.is_empty());
            }
        }
    }
}
