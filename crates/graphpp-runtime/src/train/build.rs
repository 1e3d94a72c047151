//! Building a rank's stages from a [`Model`]: which model stage each schedule stage runs, the
//! stage graphs under the recompute policy, and their parameters and buffers — what the
//! trainer, `graphpp verify` and the tests share (docs/ARCHITECTURE.md "Runtime" → Stage).

use std::collections::BTreeMap;
use std::sync::Arc;

use graphpp_graph::{stage_graphs, StageGraphs};
use graphpp_models::{split_layers, Model, StageOptions, StageSpec};
use graphpp_schedule::bytes::ByteModel;
use graphpp_schedule::{Kind, Schedule, Shape};

use crate::kernels::tensor::tensor_from_f64;
use crate::pipeline::stage::{Env, GraphStages, Microbatches, Stage};
use crate::train::bytes::byte_model;
use crate::train::error::SetupError;

/// The model stage each schedule stage runs: `S = p·v` stages over the layers, except DualPipe,
/// whose `2p` schedule stages hold two copies of a `p`-stage split (stage `p + i` ≡ stage `i`).
/// `layers_per_stage` gives each model stage's layer count (`None`: an even split).
/// Errors: [`SetupError::TooFewLayers`] when the model has fewer layers than model stages;
/// [`ModelError::Split`] (as [`SetupError::Model`]) when the layers do not divide into the
/// stages or the given counts do not add up.
pub fn stage_specs(
    cfg: &dyn Model,
    kind: Kind,
    shape: &Shape,
    layers_per_stage: Option<&[usize]>,
) -> Result<Vec<StageSpec>, SetupError> {
    let s = shape.stages();
    let model_stages = kind.model_stages(shape);
    if model_stages > cfg.num_layers() {
        return Err(SetupError::TooFewLayers {
            layers: cfg.num_layers(),
            stages: model_stages,
            kind,
            ranks: shape.ranks,
            stages_per_rank: shape.stages_per_rank,
        });
    }
    let specs = split_layers(cfg.num_layers(), model_stages, layers_per_stage)?;
    Ok((0..s).map(|st| specs[st % model_stages].clone()).collect())
}

/// The compute-only schedule of a run: `given` (e.g. read from a file: an order of one's own)
/// when there is one, else `kind`'s generated one. A given schedule keeps `kind`'s placement —
/// `kind` names the placement family (a loop, a V, DualPipe's copies) that the stage split and
/// memory estimate follow — and fits `shape`: p ranks, S = p·v stages, m microbatches, F/B/I/W
/// and OVERLAP_F_B only (graphpp lowers it). The order within each rank is the given one, checked
/// by the validator (every dependency met, no deadlock).
///
/// # Errors
/// [`SetupError::ScheduleFile`] naming what does not fit; [`SetupError::Generate`] when the
/// kind cannot serve the shape.
pub fn compute_schedule(
    kind: Kind,
    shape: &Shape,
    options: &graphpp_schedule::Options,
    given: Option<&Schedule>,
) -> Result<Schedule, SetupError> {
    let generated = graphpp_schedule::generate(kind, shape, options)?;
    let Some(given) = given else { return Ok(generated) };
    let bad = |m: String| SetupError::ScheduleFile(m);
    let expect = graphpp_schedule::ValidateOptions {
        microbatches: Some(shape.microbatches),
        ranks: Some(shape.ranks),
        stages: Some(generated.placement().len()),
    };
    let summary = graphpp_schedule::validate(given, &expect).map_err(|e| {
        bad(format!(
            "not a valid schedule for p={} ranks, {} stages, m={} microbatches: {e}",
            shape.ranks,
            generated.placement().len(),
            shape.microbatches
        ))
    })?;
    if summary.lowered {
        return Err(bad("it has communication actions: give the compute-only order (F, B, I, W, OVERLAP_F_B); graphpp lowers it".into()));
    }
    let sorted =
        |m: std::collections::BTreeMap<usize, Vec<usize>>| -> std::collections::BTreeMap<usize, Vec<usize>> {
            m.into_iter()
                .map(|(stage, mut ranks)| {
                    ranks.sort_unstable();
                    (stage, ranks)
                })
                .collect()
        };
    let (want, got) = (sorted(generated.placement()), sorted(given.placement()));
    if let Some((stage, ranks)) = got.iter().find(|(s, r)| want.get(s) != Some(*r)) {
        return Err(bad(format!(
            "stage {stage} runs on rank(s) {ranks:?}, but {kind} places it on {:?} (the file must keep its kind's placement)",
            want.get(stage).cloned().unwrap_or_default()
        )));
    }
    let (want, got) = (generated.routes(), given.routes());
    if let Some(mb) = (0..want.len()).find(|&mb| want[mb] != got.get(mb).cloned().flatten()) {
        let shown =
            |r: &Option<std::ops::Range<usize>>| r.as_ref().map_or("none".into(), |r| format!("{r:?}"));
        return Err(bad(format!(
            "microbatch {mb} visits stages {} in the file, but {kind} routes it through {} (DualPipe \
             splits the microbatches between two parameter copies; every other kind routes each \
             through all stages)",
            shown(&got.get(mb).cloned().flatten()),
            shown(&want[mb])
        )));
    }
    Ok(given.clone())
}

/// The model stage of each schedule stage of a training run as the ranks of expert-parallel
/// index `ep_index` and tensor-parallel index `tp_index` hold them (their share of every MoE
/// layer's routed experts and of the split matrices), and the options
/// their graphs are built with: `B / dp` sequences per replica, the run's recompute policy and
/// dtype.
///
/// # Errors
/// As [`stage_specs`].
pub fn run_stages(
    setup: &crate::TrainSetup,
    (ep_index, tp_index): (usize, usize),
) -> Result<(Vec<StageSpec>, StageOptions), SetupError> {
    let specs = stage_specs(&*setup.model, setup.kind, &setup.shape, setup.layers_per_stage.as_deref())?;
    let ep = graphpp_models::ExpertShard { index: ep_index, size: setup.ep };
    let tp =
        graphpp_models::TensorShard { index: tp_index, size: setup.tp, sequence: setup.sequence_parallel };
    let specs = specs.into_iter().map(|s| StageSpec { ep, tp, ..s }).collect();
    let opts = StageOptions {
        recompute: setup.recompute,
        ..StageOptions::mixed(setup.microbatch_size / setup.dp.max(1), setup.seq_len, setup.dtype)
    };
    Ok((specs, opts))
}

/// The graphs of model stage `spec` (fw, full_bw, bw_di, bw_dw) under `opts`' recompute policy.
///
/// # Errors
/// Building or differentiating the stage graph.
pub fn graphs_of(
    model: &dyn Model,
    spec: &StageSpec,
    opts: &StageOptions,
) -> Result<StageGraphs, SetupError> {
    Ok(stage_graphs(&model.build_stage(spec, opts)?, &opts.recompute.policy(spec))?)
}

/// The graphs of every schedule stage (index = stage id) of `specs` ([`stage_specs`]), built
/// once per distinct model stage (DualPipe's two copies share theirs).
///
/// # Errors
/// As [`graphs_of`].
pub fn all_stage_graphs(
    model: &dyn Model,
    specs: &[StageSpec],
    opts: &StageOptions,
) -> Result<Vec<Arc<StageGraphs>>, SetupError> {
    let mut cache = GraphCache::default();
    specs.iter().map(|spec| cache.get(model, spec, opts)).collect()
}

/// Stage graphs built once per (model stage, stage options) and shared after: DualPipe's
/// copies, and the planner's candidates that run the same stage at the same shape.
#[derive(Default)]
pub struct GraphCache {
    built: Vec<(StageSpec, StageOptions, Arc<StageGraphs>)>,
}

impl GraphCache {
    /// The graphs of `spec` under `opts` ([`graphs_of`]), built on first use.
    ///
    /// # Errors
    /// As [`graphs_of`].
    pub fn get(
        &mut self,
        model: &dyn Model,
        spec: &StageSpec,
        opts: &StageOptions,
    ) -> Result<Arc<StageGraphs>, SetupError> {
        if let Some((_, _, g)) = self.built.iter().find(|(s, o, _)| s == spec && o == opts) {
            return Ok(Arc::clone(g));
        }
        let g = Arc::new(graphs_of(model, spec, opts)?);
        self.built.push((spec.clone(), opts.clone(), Arc::clone(&g)));
        Ok(g)
    }
}

/// What a rank's stages are built from: the model, the model stage each schedule stage runs
/// (`specs[s]`, from [`stage_specs`]), the stage options and the initial weights — `given` by
/// name (e.g. pretrained; a tied embedding's copies both read `model.embed_tokens.weight`), else
/// drawn from `seed` ([`Model::init_parameters`], seeded per name so any split agrees); a given
/// buffer of the right shape (a pretrained MoE routing bias) replaces the model's initial one.
#[derive(Clone, Copy)]
pub struct StageBuild<'a> {
    /// The model.
    pub model: &'a dyn Model,
    /// The model stage of each schedule stage.
    pub specs: &'a [StageSpec],
    /// Batch, sequence length, dtypes and recompute policy of the stage graphs.
    pub opts: &'a StageOptions,
    /// Seed of the initial weights when none are given.
    pub seed: u64,
    /// Initial parameters by name, f32, the model's shapes.
    pub given: Option<&'a Env>,
    /// Where the stages' state lives and their graphs run.
    pub device: &'a candle_core::Device,
}

impl StageBuild<'_> {
    /// Parameters and buffers of stage `spec` on the build's device: the parameters as tensors
    /// of [`StageOptions::parameter_dtype`], the buffers of the compute dtype.
    ///
    /// # Errors
    /// [`SetupError::Parameter`] for a parameter `given` lacks or holds in another shape.
    pub fn state(&self, spec: &StageSpec) -> Result<Env, SetupError> {
        let (model, opts) = (self.model, self.opts);
        let mut env = Env::new();
        match self.given {
            None => {
                for (name, shape, data) in model.init_parameters(spec, self.seed) {
                    let d: Vec<f64> = data.iter().map(|&x| x as f64).collect();
                    env.insert(name, tensor_from_f64(&d, &shape, opts.parameter_dtype())?);
                }
            }
            Some(given) => {
                // Given tensors are whole; under tensor parallelism the stage holds its shard.
                let whole = StageSpec { tp: graphpp_models::TensorShard::WHOLE, ..spec.clone() };
                for (name, shape) in model.stage_parameters(&whole) {
                    let t = given.get(&name).ok_or_else(|| SetupError::Parameter {
                        name: name.clone(),
                        reason: "not given".into(),
                    })?;
                    if t.dims() != shape.as_slice() {
                        return Err(SetupError::Parameter {
                            reason: format!("shape {:?}, the model needs {shape:?}", t.dims()),
                            name,
                        });
                    }
                    let t =
                        tensor_parallel_shard(t, model.tensor_parallel_split(&name, spec.tp.size), spec.tp)
                            .map_err(|reason| SetupError::Parameter { name: name.clone(), reason })?;
                    env.insert(
                        name,
                        t.to_dtype(crate::kernels::tensor::candle_dtype(opts.parameter_dtype()))?,
                    );
                }
            }
        }
        for (name, shape, data) in model.stage_buffers(opts.seq) {
            let dtype = model.buffer_dtype(&name, opts.dtype);
            // A given buffer (a pretrained MoE routing bias) replaces the model's initial one.
            let t = match self.given.and_then(|g| g.get(&name)).filter(|t| t.dims() == shape.as_slice()) {
                Some(t) => t.to_dtype(crate::kernels::tensor::candle_dtype(dtype))?,
                None => tensor_from_f64(&data, &shape, dtype)?,
            };
            env.insert(name, t);
        }
        env.into_iter().map(|(name, t)| Ok((name, t.to_device(self.device)?))).collect()
    }

    /// The [`GraphStages`] of schedule rank `rank`: the stages the schedule places on it, each
    /// with its graphs (under the options' recompute policy) and [`StageBuild::state`].
    ///
    /// # Errors
    /// [`SetupError::Inconsistent`] for a schedule stage without a model stage; graph building.
    pub fn rank(
        &self,
        schedule: &Schedule,
        data: Arc<Microbatches>,
        rank: usize,
    ) -> Result<GraphStages, SetupError> {
        let mut stages = BTreeMap::new();
        for (stage, ranks) in schedule.placement() {
            if !ranks.contains(&rank) {
                continue;
            }
            let spec = self
                .specs
                .get(stage)
                .ok_or_else(|| SetupError::Inconsistent(format!("stage {stage}: no model stage for it")))?;
            let state = self.state(spec)?;
            stages.insert(
                stage,
                Stage::new(graphs_of(self.model, spec, self.opts)?, state, self.device.clone()),
            );
        }
        Ok(GraphStages::new(stages, data))
    }

    /// One [`GraphStages`] per rank of `schedule` ([`StageBuild::rank`]), all over `data`.
    ///
    /// # Errors
    /// As [`StageBuild::rank`].
    pub fn all_ranks(
        &self,
        schedule: &Schedule,
        data: Arc<Microbatches>,
    ) -> Result<Vec<GraphStages>, SetupError> {
        (0..schedule.num_ranks()).map(|r| self.rank(schedule, Arc::clone(&data), r)).collect()
    }
}

/// The graphs of every schedule stage of a training run (index = stage id), built as its ranks
/// build theirs: `B / dp` sequences per replica, the run's recompute policy and dtype, the first
/// expert shard and tensor-parallel shard.
///
/// # Errors
/// As [`stage_specs`] and [`graphs_of`].
pub fn run_stage_graphs(setup: &crate::TrainSetup) -> Result<Vec<Arc<StageGraphs>>, SetupError> {
    let (specs, opts) = run_stages(setup, (0, 0))?;
    all_stage_graphs(&*setup.model, &specs, &opts)
}

/// The [`ByteModel`] of a training run's `schedule` (compute-only or lowered) over its
/// [`run_stage_graphs`]. FSDP's gathered parameters are not counted.
///
/// # Errors
/// As [`run_stage_graphs`] and [`byte_model`].
pub fn run_byte_model(setup: &crate::TrainSetup, schedule: &Schedule) -> Result<ByteModel, SetupError> {
    let graphs = run_stage_graphs(setup)?;
    let refs: Vec<&StageGraphs> = graphs.iter().map(|g| &**g).collect();
    byte_model(&refs, schedule)
}

/// Shard `tp` of the whole parameter `t` split as `split` says (rank `tp`'s block,
/// [`graphpp_models::TensorShard::block_of`]); `t` itself for a replicated one (`split`
/// `None`) or without tensor parallelism.
///
/// # Errors
/// A reason when the dimension is outside `t` or the blocks do not divide it (a whole tensor of
/// another shape than the model's).
pub fn tensor_parallel_shard(
    t: &candle_core::Tensor,
    split: Option<graphpp_models::tensor_parallel::Split>,
    tp: graphpp_models::TensorShard,
) -> Result<candle_core::Tensor, String> {
    let Some(split) = split.filter(|_| tp.is_split()) else { return Ok(t.clone()) };
    let d = split.dim;
    let len = t.dim(d).map_err(|e| e.to_string())?;
    let block = tp.block_of(len, split.replicas).ok_or_else(|| {
        format!("shape {:?}: dimension {d} ({len}) does not split over tp = {}", t.dims(), tp.size)
    })?;
    t.narrow(d, block.start, block.len()).map_err(|e| e.to_string())
}
