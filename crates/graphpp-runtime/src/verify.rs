//! One training step of the Llama-style model run pipelined under a schedule and on a single
//! device from the same weights and batch, and the comparison of their losses and gradients —
//! the core invariant of docs/ARCHITECTURE.md "Runtime" → Semantics (`graphpp verify`, tests).
//!
//! Pipelined: the schedule of `kind` for `shape` is generated and lowered (SEND/RECV), every
//! schedule stage gets its [`Stage`] (graphs under the options' recompute policy, weights from
//! [`init_parameters`] with the step's seed — seeded per parameter name, so any split gives the
//! same weights — or the given [`VerifySetup::weights`]) and [`run_pipeline`] runs one [`GraphStages`] per rank on threads.
//! Single device: one stage holding every layer runs the m microbatches concatenated along the
//! batch axis (`[m·B, T]`), fw then full_bw.
//!
//! Precision: the pipelined step computes in [`VerifySetup::dtype`], the single-device step in
//! [`VerifySetup::reference_dtype`], both from the same f32 master weights
//! ([`StageOptions::mixed`]); `graphpp verify --dtype bf16` thus checks bf16 mixed precision
//! against f32, at [`BF16_TOLERANCE`].
//!
//! DualPipe holds two parameter copies: schedule stage `p + i` is a second copy of stage `i`'s
//! layers (same names, same initial weights; microbatches `m/2..m` route through stages `p..2p`).
//! Its gradient for a parameter is the sum of the two copies' gradients, which is what one device
//! computes for the shared parameter. Every other kind splits the model into `S = p·v` stages.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use candle_core::Tensor;
use graphpp_graph::names::{LOSS, TARGETS, TOKENS};
use graphpp_graph::{stage_graphs, DType, RecomputePolicy};
use graphpp_models::rng::Rng;
use graphpp_models::{split_layers, Model, StageOptions};
use graphpp_schedule::{lower, Kind, LowerOptions, Options, Shape};

use crate::exec::{run_named, ExecError, RunOptions};
use crate::kernels::tensor::{tensor_u32, to_f64};
use crate::pipeline::stage::{sum_by_name, Env, GraphStages, Microbatches};
use crate::pipeline::{run_pipeline, PipelineError};
use crate::train::build::{stage_specs, StageBuild};
use crate::train::error::SetupError;
use crate::train::setup::TrainSetup;

/// Default tolerance of `graphpp verify`: relative difference (see [`VerifyReport`]) in f32.
/// Source: the project's acceptance criterion for pipelined gradients (1e-5 relative, f32).
pub const TOLERANCE: f64 = 1e-5;

/// Default tolerance of `graphpp verify` when either step computes in bf16 (relative, as
/// [`TOLERANCE`]). bf16 keeps 8 significant bits: one rounding errs by up to 2⁻⁹ ≈ 2.0e-3
/// relative (3.9e-3 = 2⁻⁸ is one unit in the last place), and a gradient passes through dozens of
/// rounded values (every layer's activations and output gradients). Measured, pipelined bf16
/// against one-device f32: `tiny` over seeds 0–2 × {1F1B m=4, ZB-V m=8, DualPipeV m=5} ×
/// B×T ∈ {1×16, 2×64}, and `small` (8 layers) 1F1B m=4 2×64 — largest gradient difference
/// 1.26e-2 … 2.03e-2 relative (mostly q/k projections and RMSNorm weights), loss at most 3.9e-5.
/// 5e-2 leaves a factor 2.5 over the worst case while a real error (a missing or wrong gradient
/// term: differences of order 1) still fails.
pub const BF16_TOLERANCE: f64 = 5e-2;

/// The default tolerance for a step computed in `dtype` checked against `reference_dtype`:
/// [`BF16_TOLERANCE`] when either is bf16, else [`TOLERANCE`].
pub fn default_tolerance(dtype: DType, reference_dtype: DType) -> f64 {
    if dtype == DType::BF16 || reference_dtype == DType::BF16 {
        BF16_TOLERANCE
    } else {
        TOLERANCE
    }
}

/// Floor of the reference scale in relative differences (avoids 0/0 on an all-zero gradient).
const SCALE_FLOOR: f64 = 1e-12;

/// Why a verification step could not run.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    /// Building the schedule, the stage split or the stage graphs failed.
    #[error(transparent)]
    Setup(#[from] SetupError),
    /// The tolerance is not a finite number >= 0.
    #[error("--tolerance {0}: the tolerance must be a finite number >= 0 (a relative difference)")]
    Tolerance(f64),
    /// The single-device step failed.
    #[error("single-device step: {0}")]
    Exec(#[from] ExecError),
    /// The pipelined step failed (names rank, step and action).
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
    /// A tensor operation failed.
    #[error("tensor: {0}")]
    Tensor(#[from] candle_core::Error),
    /// The two steps do not produce the same set of values (a missing loss or gradient).
    #[error("pipelined and single-device steps disagree on {0}")]
    Mismatch(String),
    /// The step run as a training run's ranks failed ([`data_parallel_step`]).
    #[error(transparent)]
    Train(Box<crate::train::TrainError>),
}

/// What one verification step runs: a training run's setup (the model, the schedule, the
/// layout and the data's shape; its optimizer settings are unused, a verification takes no
/// optimizer step), the initial weights and the reference step's dtype.
#[derive(Debug, Clone)]
pub struct VerifySetup {
    /// The run the pipelined step is one step of.
    pub train: TrainSetup,
    /// Initial parameters by name (e.g. pretrained weights, `--init-from`), f32, HF shapes;
    /// `None` draws them from `train.seed` ([`init_parameters`]).
    pub weights: Option<Arc<Env>>,
    /// Compute dtype of the single-device reference step (the pipelined step's is
    /// `train.dtype`).
    pub reference_dtype: DType,
}

impl VerifySetup {
    /// A setup with default generator options, seed 0, no data parallelism, a 60 s RECV
    /// timeout, both steps in f32 on the CPU.
    pub fn new(
        model: impl Model + 'static,
        kind: Kind,
        shape: Shape,
        microbatch_size: usize,
        seq_len: usize,
    ) -> Self {
        let train = TrainSetup {
            model: Arc::new(model),
            kind,
            shape,
            options: Options::default(),
            schedule: None,
            layers_per_stage: None,
            microbatch_size,
            dp: 1,
            fsdp: false,
            ep: 1,
            tp: 1,
            sequence_parallel: false,
            post_validate: false,
            seq_len,
            seed: 0,
            adamw: crate::optim::AdamWConfig::default(),
            lr: crate::optim::lr::CosineSchedule::no_steps(),
            grad_clip: None,
            recompute: graphpp_models::Recompute::SaveAll,
            expert_bias_update: 0.001,
            link: None,
            timeout: Duration::from_secs(60),
            dtype: DType::F32,
            device: candle_core::Device::Cpu,
            ranks_here: None,
            process_bytes: 0,
        };
        VerifySetup { train, weights: None, reference_dtype: DType::F32 }
    }

    /// The setup's checks ([`TrainSetup::check_sized`]), the step's size estimated for the
    /// single-device step, which runs all `m·B` sequences at once and so is the larger.
    ///
    /// # Errors
    /// [`VerifyError::Setup`] ([`SetupError::Size`]) when a step would be too large; otherwise
    /// [`VerifyError::Train`] with the setup's error (dp, ep).
    pub fn check(&self) -> Result<(), VerifyError> {
        self.train.check_sized(true).map_err(|e| match e {
            crate::train::TrainError::Size(e) => VerifyError::Setup(SetupError::Size(e)),
            e => VerifyError::Train(Box::new(e)),
        })?;
        // The reference step's bf16 path, checked before either step runs: it computes on the
        // CPU's own kernels whatever the pipelined step's device and kernels
        // (`single_device_step`).
        self.reference_bf16_path()
            .map(|_| ())
            .map_err(|e| VerifyError::Train(Box::new(SetupError::from(e).into())))
    }

    /// The bf16 matmul path the reference step runs on: `None` for an f32 reference.
    ///
    /// # Errors
    /// [`crate::kernels::bf16_gemm::PathError`] where `GRAPHPP_BF16_GEMM` names a path this
    /// process cannot run.
    pub fn reference_bf16_path(
        &self,
    ) -> Result<Option<crate::kernels::bf16_gemm::Bf16Gemm>, crate::kernels::bf16_gemm::PathError> {
        if self.reference_dtype != DType::BF16 {
            return Ok(None);
        }
        crate::kernels::bf16_gemm::chosen().map(Some)
    }
}

/// Loss and gradients of one step.
#[derive(Debug)]
pub struct StepResult {
    /// Step loss: mean over microbatches of the per-microbatch mean token loss.
    pub loss: f64,
    /// Per-microbatch losses (pipelined step only; empty for the single-device step).
    pub microbatch_losses: Vec<f64>,
    /// d loss / dθ by name `grad.<param>`.
    pub grads: BTreeMap<String, Tensor>,
}

/// The comparison of a pipelined and a single-device step.
///
/// Relative differences are taken per value against the single-device reference `b`:
/// `max_i |a_i − b_i| / max(max_i |b_i|, 1e-12)` (the reference tensor's scale, so a tiny element
/// does not blow up the ratio); `max_rel` is the largest over all gradient tensors.
#[derive(Debug, Clone, PartialEq)]
pub struct VerifyReport {
    /// Step loss of the pipelined run.
    pub loss_pipelined: f64,
    /// Step loss on one device.
    pub loss_single: f64,
    /// |loss_pipelined − loss_single| / max(|loss_single|, 1e-12).
    pub loss_rel: f64,
    /// Largest absolute gradient difference over every element of every gradient.
    pub max_abs: f64,
    /// Largest relative gradient difference (see the type doc).
    pub max_rel: f64,
    /// The gradient with the largest relative difference.
    pub worst: String,
    /// Number of gradient tensors compared.
    pub gradients: usize,
}

/// `tol` if it can be a tolerance: a finite number `>= 0` (NaN would fail every comparison, a
/// negative one every step).
///
/// # Errors
/// [`VerifyError::Tolerance`].
pub fn check_tolerance(tol: f64) -> Result<f64, VerifyError> {
    if tol.is_finite() && tol >= 0.0 {
        Ok(tol)
    } else {
        Err(VerifyError::Tolerance(tol))
    }
}

impl VerifyReport {
    /// Whether the loss and every gradient are within `tol` relative.
    pub fn passes(&self, tol: f64) -> bool {
        self.loss_rel <= tol && self.max_rel <= tol
    }
}

/// Random token ids and targets (uniform below the vocabulary) for `m` microbatches of
/// `[batch, seq]`, from `seed`.
pub fn random_microbatches(
    vocab: usize,
    m: usize,
    batch: usize,
    seq: usize,
    seed: u64,
) -> Result<Microbatches, VerifyError> {
    let mut rng = Rng::new(seed ^ 0x5eed_da7a);
    let mut draw = || -> candle_core::Result<Tensor> {
        let ids: Vec<u32> = (0..batch * seq).map(|_| rng.below(vocab as u64) as u32).collect();
        tensor_u32(&ids, &[batch, seq])
    };
    let (mut tokens, mut targets) = (Vec::with_capacity(m), Vec::with_capacity(m));
    for _ in 0..m {
        tokens.push(draw()?);
        targets.push(draw()?);
    }
    Ok(Microbatches { tokens, targets })
}

/// Sums each gradient over all stages of all ranks (DualPipe's two copies add up).
fn collect_grads(workers: &[GraphStages]) -> Result<BTreeMap<String, Tensor>, VerifyError> {
    let grads = workers.iter().flat_map(|w| w.stages().values()).flat_map(|st| st.grads().clone());
    Ok(sum_by_name(grads)?.into_iter().collect())
}

/// Runs one step of `setup` pipelined. Errors: generation, lowering, graph building, or the
/// first failing rank ([`PipelineError`]).
pub fn pipelined_step(setup: &VerifySetup) -> Result<StepResult, VerifyError> {
    // The schedule first: a shape the kind cannot serve is the more useful error.
    let compute = crate::train::build::compute_schedule(
        setup.train.kind,
        &setup.train.shape,
        &setup.train.options,
        setup.train.schedule.as_deref(),
    )?;
    let schedule = lower(&compute, &LowerOptions::default()).map_err(SetupError::from)?;
    let specs = stage_specs(
        &*setup.train.model,
        setup.train.kind,
        &setup.train.shape,
        setup.train.layers_per_stage.as_deref(),
    )?;
    let m = setup.train.shape.microbatches;
    let data = Arc::new(random_microbatches(
        setup.train.model.vocab_size(),
        m,
        setup.train.microbatch_size,
        setup.train.seq_len,
        setup.train.seed,
    )?);
    let opts = StageOptions::mixed(setup.train.microbatch_size, setup.train.seq_len, setup.train.dtype);
    let given = setup.weights.as_deref();
    let build = StageBuild {
        model: &*setup.train.model,
        specs: &specs,
        opts: &opts,
        seed: setup.train.seed,
        given,
        device: &setup.train.device,
    };
    let workers = build.all_ranks(&schedule, data)?;
    let (workers, _) = run_pipeline(&schedule, workers, setup.train.timeout)?;
    let mut losses = BTreeMap::new();
    for w in &workers {
        losses.extend(w.losses().iter().map(|(&k, &v)| (k, v)));
    }
    if losses.len() != m {
        return Err(VerifyError::Mismatch(format!("losses: {} of {m} microbatches", losses.len())));
    }
    let microbatch_losses: Vec<f64> = losses.into_values().collect();
    let loss = microbatch_losses.iter().sum::<f64>() / m as f64;
    Ok(StepResult { loss, microbatch_losses, grads: collect_grads(&workers)? })
}

/// Runs the same step on one device, the CPU with its own kernels (whatever `GRAPHPP_KERNELS`
/// says), computing in `setup.reference_dtype`: one stage with every layer over the m
/// microbatches concatenated along the batch axis.
pub fn single_device_step(setup: &VerifySetup) -> Result<StepResult, VerifyError> {
    // The CPU's own kernels, also when GRAPHPP_KERNELS forces the compositions the pipelined
    // step is checked on.
    crate::kernels::device::with_composed(false, || reference_step(setup))
}

/// [`single_device_step`]'s body.
fn reference_step(setup: &VerifySetup) -> Result<StepResult, VerifyError> {
    let cfg = &*setup.train.model;
    let m = setup.train.shape.microbatches;
    let spec = split_layers(cfg.num_layers(), 1, None).map_err(SetupError::from)?.remove(0);
    let opts =
        StageOptions::mixed(setup.train.microbatch_size * m, setup.train.seq_len, setup.reference_dtype);
    let stage = cfg.build_stage(&spec, &opts).map_err(SetupError::from)?;
    let graphs = stage_graphs(&stage, &RecomputePolicy::SaveAll).map_err(SetupError::from)?;
    let data = random_microbatches(
        cfg.vocab_size(),
        m,
        setup.train.microbatch_size,
        setup.train.seq_len,
        setup.train.seed,
    )?;
    let given = setup.weights.as_deref();
    // The reference runs on the host, whatever device the pipelined step ran on.
    let host = candle_core::Device::Cpu;
    let build = StageBuild {
        model: cfg,
        specs: std::slice::from_ref(&spec),
        opts: &opts,
        seed: setup.train.seed,
        given,
        device: &host,
    };
    let mut env = build.state(&spec)?;
    env.insert(TOKENS.into(), Tensor::cat(&data.tokens, 0)?);
    env.insert(TARGETS.into(), Tensor::cat(&data.targets, 0)?);
    let f = run_named(&graphs.fw, &env, &RunOptions::default())?;
    let loss = to_f64(f.output(&graphs.fw, LOSS).ok_or_else(|| VerifyError::Mismatch("loss".into()))?)?[0];
    env.extend(graphs.fw.output_names().into_iter().zip(f.outputs));
    env.extend(crate::pipeline::stage::aux_loss_seeds(&graphs.full_bw, 1.0)?);
    let b = run_named(&graphs.full_bw, &env, &RunOptions::default())?;
    let grads = graphs.full_bw.output_names().into_iter().zip(b.outputs).collect();
    Ok(StepResult { loss, microbatch_losses: Vec::new(), grads })
}

/// Max |a − b| and max |a − b| / max(max |b|, floor) of two tensors of the same shape.
fn diff(a: &Tensor, b: &Tensor) -> Result<(f64, f64), VerifyError> {
    let (a, b) = (to_f64(a)?, to_f64(b)?);
    if a.len() != b.len() {
        return Err(VerifyError::Mismatch(format!("sizes {} vs {}", a.len(), b.len())));
    }
    let scale = b.iter().fold(SCALE_FLOOR, |s, x| s.max(x.abs()));
    let abs = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max);
    Ok((abs, abs / scale))
}

/// Compares a pipelined step `a` with the single-device step `b`. Errors:
/// [`VerifyError::Mismatch`] when they hold different gradient names or shapes.
pub fn compare(a: &StepResult, b: &StepResult) -> Result<VerifyReport, VerifyError> {
    let names = |r: &StepResult| r.grads.keys().cloned().collect::<Vec<_>>();
    if names(a) != names(b) {
        return Err(VerifyError::Mismatch(format!("gradient names: {:?} vs {:?}", names(a), names(b))));
    }
    let mut r = VerifyReport {
        loss_pipelined: a.loss,
        loss_single: b.loss,
        loss_rel: (a.loss - b.loss).abs() / b.loss.abs().max(SCALE_FLOOR),
        max_abs: 0.0,
        max_rel: 0.0,
        worst: String::new(),
        gradients: b.grads.len(),
    };
    for (name, gb) in &b.grads {
        let ga = a.grads.get(name).ok_or_else(|| {
            VerifyError::Mismatch(format!("{name}: the pipelined step returned no such gradient"))
        })?;
        if ga.dims() != gb.dims() {
            return Err(VerifyError::Mismatch(format!("{name}: shape {:?} vs {:?}", ga.dims(), gb.dims())));
        }
        let (abs, rel) = diff(ga, gb)?;
        r.max_abs = r.max_abs.max(abs);
        if rel >= r.max_rel {
            r.max_rel = rel;
            r.worst = name.clone();
        }
    }
    Ok(r)
}

/// The pipelined step run as a training run's ranks run it — [`crate::Trainer::gradient_step`]:
/// the schedule lowered with REDUCE_GRAD (and FSDP's UNSHARD/RESHARD), each replica on its
/// `batch / dp` rows, the gradients reduced over the replicas and the copies, tensor-parallel
/// shards gathered whole — every rank a thread here, or (with `comm`) this process's rank of a
/// world of `p × dp × tp` processes. Returns
/// the step's loss and gradients on the leader, `None` elsewhere.
///
/// # Errors
/// [`VerifyError::Train`] (a batch that does not split over dp, a failing rank).
pub fn data_parallel_step(
    setup: &VerifySetup,
    comm: Option<Arc<dyn graphpp_comm::Comm>>,
) -> Result<Option<StepResult>, VerifyError> {
    let train = |e: crate::train::TrainError| VerifyError::Train(Box::new(e));
    let ts = setup.train.clone();
    let mut t = match comm {
        Some(c) => crate::train::Trainer::on_comm(ts, c),
        None => crate::train::Trainer::new(ts),
    }
    .map_err(train)?;
    if let Some(w) = &setup.weights {
        t.load_parameters(w).map_err(train)?;
    }
    let m = setup.train.shape.microbatches;
    let data = random_microbatches(
        setup.train.model.vocab_size(),
        m,
        setup.train.microbatch_size,
        setup.train.seq_len,
        setup.train.seed,
    )?;
    let (loss, grads) = t.gradient_step(data).map_err(train)?;
    Ok(grads.map(|g| StepResult {
        loss,
        microbatch_losses: Vec::new(),
        grads: g.into_iter().map(|(n, t)| (graphpp_graph::names::grad_of(&n), t)).collect(),
    }))
}

/// Runs `setup` pipelined and on one device and compares them (what `graphpp verify` prints).
///
/// # Errors
/// Those of [`VerifySetup::check`] (before anything is built), else those of the two steps.
pub fn verify_step(setup: &VerifySetup) -> Result<VerifyReport, VerifyError> {
    setup.check()?;
    let t = &setup.train;
    let a = if t.dp > 1 || t.fsdp || t.ep > 1 || t.tp > 1 {
        data_parallel_step(setup, None)?.ok_or_else(|| VerifyError::Mismatch("no leader".into()))?
    } else {
        pipelined_step(setup)?
    };
    let b = single_device_step(setup)?;
    compare(&a, &b)
}
