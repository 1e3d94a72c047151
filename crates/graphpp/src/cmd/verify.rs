//! `graphpp verify`: one training step pipelined under a schedule and one on a single device from
//! the same weights and batch; prints both losses and the largest gradient differences, and fails
//! (exit 1) above the tolerance (docs/ARCHITECTURE.md "Runtime" → Semantics). With `--dp N`
//! (and `--fsdp`) the pipelined step runs as a training run's ranks do, each replica on its
//! share of the batch; under `mpirun -n W` (W = ranks × dp) one rank per process, the leader
//! comparing and printing.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use graphpp::launch::Launch;
use graphpp::strategy::Strategy;
use graphpp_graph::DType;
use graphpp_runtime::verify::{
    check_tolerance, compare, data_parallel_step, default_tolerance, single_device_step, verify_step,
    VerifyError, VerifyReport, VerifySetup,
};
use graphpp_runtime::{SetupError, TrainError};
use graphpp_schedule::{Kind, Shape};

use crate::cmd::value::count;

/// Arguments of `graphpp verify`.
#[derive(Args)]
pub struct VerifyArgs {
    /// Schedule kind (`1f1b`, `zbv`, `dualpipev`, …; PyTorch class names accepted).
    #[arg(long, required_unless_present = "strategy")]
    schedule: Option<Kind>,
    /// Run the order of a compute-only schedule file (CSV or JSON) that keeps --schedule's
    /// placement, instead of its generated one.
    #[arg(long, value_name = "FILE")]
    schedule_file: Option<PathBuf>,
    /// grouped-interleaved: consecutive microbatches per chunk (default p).
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    group: Option<usize>,
    /// zb-auto, zbv-auto: activation-memory cap per rank in M_B units (default p).
    #[arg(long, allow_hyphen_values = true)]
    mem_cap: Option<f64>,
    /// p: ranks in the pipeline (one thread each; under mpirun, one process each).
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>, required_unless_present = "strategy")]
    ranks: Option<usize>,
    /// v: stages per rank (S = p·v; DualPipe's 2p stages hold two copies of a p-stage split);
    /// default 2 for interleaved kinds and the V kinds (ZB-V, V-Half, V-Min, DualPipe(V)), else 1.
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    stages_per_rank: Option<usize>,
    /// m: microbatches in the step.
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>, required_unless_present = "strategy")]
    microbatches: Option<usize>,
    /// Model: a preset (`tiny`, `small`, `moe-tiny`, `moe-small`) or a JSON config file with
    /// Hugging Face field names (DeepSeek-V3 MoE fields make it a MoE model).
    #[arg(long, default_value = "tiny")]
    model: String,
    /// Override the preset's number of decoder layers (it must be at least the model stages).
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    layers: Option<usize>,
    /// Run the step from a Hugging Face model folder (config.json + model.safetensors): its config
    /// is the model and its weights the parameters (excludes --model and --layers).
    #[arg(long, value_name = "DIR", conflicts_with_all = ["model", "layers"])]
    init_from: Option<PathBuf>,
    /// Decoder layers of each model stage, e.g. `2,1,1` (default: an even split).
    #[arg(long, value_delimiter = ',', allow_hyphen_values = true, value_parser = count::<usize>)]
    layers_per_stage: Option<Vec<usize>>,
    /// B: sequences per microbatch (split over the --dp replicas).
    #[arg(long, default_value_t = 1, allow_hyphen_values = true, value_parser = count::<usize>)]
    microbatch_size: usize,
    /// Data-parallel replicas of the pipeline (world = ranks × dp); must divide B. Default: the
    /// --ep degree (1 without it).
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    dp: Option<usize>,
    /// Expert parallelism: each MoE layer's routed experts split over groups of this many
    /// data-parallel replicas (token dispatch and combine by all-to-all); must divide --dp and
    /// the routed experts.
    #[arg(long, default_value_t = 1, allow_hyphen_values = true, value_parser = count::<usize>)]
    ep: usize,
    /// FSDP (ZeRO-3) over the --dp replicas (the gradients are then reduce-scattered shards,
    /// gathered for the comparison).
    #[arg(long)]
    fsdp: bool,
    /// T: tokens per sequence.
    #[arg(long, default_value_t = 16, allow_hyphen_values = true, value_parser = count::<usize>)]
    seq_len: usize,
    /// Seed of the initial weights and of the random batch.
    #[arg(long, default_value_t = 0, allow_hyphen_values = true, value_parser = count::<u64>)]
    seed: u64,
    /// Compute dtype of the pipelined step: `f32`, or `bf16` mixed precision (f32 master weights
    /// and gradients, bf16 activations and messages, f32 loss).
    #[arg(long, default_value = "f32", value_parser = crate::cmd::parse_compute_dtype)]
    dtype: DType,
    /// Compute dtype of the single-device reference step.
    #[arg(long, default_value = "f32", value_parser = crate::cmd::parse_compute_dtype)]
    reference_dtype: DType,
    /// Largest accepted relative difference of the loss and of any gradient, where the relative
    /// difference of a tensor is max|a − b| / max(max|b|, 1e-12) against the single-device `b`
    /// (default 1e-5, or 5e-2 when either step computes in bf16).
    #[arg(long, allow_hyphen_values = true)]
    tolerance: Option<f64>,
    /// Verify the strategy of a TOML (or .json) file (see `train --strategy`): it stands for
    /// --schedule, --schedule-file, --group, --mem-cap, --ranks, --stages-per-rank, --layers-per-stage, --microbatches,
    /// --microbatch-size, --dp, --ep and --fsdp. Its recompute policy and post-validation do not
    /// change the gradients and are not run here.
    #[arg(long, value_name = "FILE", conflicts_with_all = VERIFY_STRATEGY_FLAGS)]
    strategy: Option<PathBuf>,
}

/// The flags a strategy file stands for in `verify`.
const VERIFY_STRATEGY_FLAGS: [&str; 12] = [
    "schedule",
    "schedule_file",
    "group",
    "mem_cap",
    "ranks",
    "stages_per_rank",
    "layers_per_stage",
    "microbatches",
    "microbatch_size",
    "dp",
    "ep",
    "fsdp",
];

impl VerifyArgs {
    /// Takes the settings of strategy `s` (the flags it stands for).
    fn apply_strategy(&mut self, s: &Strategy) {
        self.schedule = Some(s.order.schedule);
        self.schedule_file = s.order.file.clone();
        self.group = s.order.group;
        self.mem_cap = s.order.mem_cap;
        self.ranks = Some(s.place.ranks);
        self.stages_per_rank = Some(s.stages_per_rank());
        self.layers_per_stage = s.place.layers_per_stage.clone();
        self.microbatches = Some(s.split.microbatches);
        self.microbatch_size = s.split.microbatch_size;
        self.dp = Some(s.dp());
        self.ep = s.shard.ep;
        self.fsdp = s.shard.fsdp;
    }

    /// The schedule kind, ranks and microbatches (clap requires them unless --strategy, which
    /// sets them).
    fn step_shape(&self) -> Result<(Kind, usize, usize)> {
        match (self.schedule, self.ranks, self.microbatches) {
            (Some(k), Some(p), Some(m)) => Ok((k, p, m)),
            _ => bail!("--schedule, --ranks and --microbatches are required (or --strategy)"),
        }
    }
}

/// A difference above the tolerance: the step ran, so no rank failed.
#[derive(Debug, thiserror::Error)]
#[error("FAIL: difference above tolerance {0:e} relative")]
struct AboveTolerance(f64);

/// Runs `graphpp verify`. Errors: bad shape or model (typed, with the numbers), a failing rank,
/// or a difference above the tolerance.
pub fn run(mut a: VerifyArgs) -> Result<()> {
    if let Some(path) = &a.strategy {
        let s = Strategy::load(path)?;
        a.apply_strategy(&s);
    }
    Launch::run(
        crate::cmd::announce,
        |e| e.downcast_ref::<AboveTolerance>().is_some(),
        |launch| verify(&a, launch),
    )
}

fn verify(a: &VerifyArgs, launch: &Launch) -> Result<()> {
    let (kind, ranks, microbatches) = a.step_shape()?;
    if let Some(t) = a.tolerance {
        check_tolerance(t)?;
    }
    let dp = a.dp.unwrap_or(a.ep);
    launch.check_world(ranks, dp)?;
    let files = crate::cmd::settings_files(&[a.strategy.as_deref(), a.schedule_file.as_deref()]);
    launch.agree("the command line", graphpp::launch::command_fingerprint(&files))?;
    let local_ranks = if launch.world() > 1 { graphpp::launch::local_processes() } else { ranks * dp };
    crate::cmd::set_op_threads(local_ranks, None);
    let v = a.stages_per_rank.unwrap_or_else(|| kind.default_stages_per_rank());
    let (setup, name) = setup_of(a, kind, Shape::new(ranks, v, microbatches), dp)?;
    let tolerance = a.tolerance.unwrap_or_else(|| default_tolerance(a.dtype, a.reference_dtype));
    let t0 = Instant::now();
    let r = if launch.world() > 1 {
        setup.check().map_err(|e| flag_error(a, e))?;
        // Every process runs its rank; the leader gets the gradients and compares.
        let Some(pipelined) = data_parallel_step(&setup, launch.comm())? else { return Ok(()) };
        compare(&pipelined, &single_device_step(&setup)?)?
    } else {
        verify_step(&setup).map_err(|e| flag_error(a, e))?
    };
    print_report(a, &setup, &name, launch.world(), &r);
    println!("wall time {:.2} s", t0.elapsed().as_secs_f64());
    if !r.passes(tolerance) {
        return Err(AboveTolerance(tolerance).into());
    }
    println!("PASS (tolerance {tolerance:e} relative)");
    Ok(())
}

/// The setup the flags describe at `shape` with `dp` replicas, and the model's name for the
/// report (the preset or config path, or the `--init-from` folder).
///
/// # Errors
/// A model config or `--init-from` folder that cannot be read; a bad `--layers`; an unreadable
/// `--schedule-file`.
fn setup_of(a: &VerifyArgs, kind: Kind, shape: Shape, dp: usize) -> Result<(VerifySetup, String)> {
    let (mut model, weights, name) = match &a.init_from {
        Some(dir) => {
            let p = graphpp::pretrained::load(dir).context("--init-from")?;
            (
                graphpp_models::ModelConfig::Llama(p.config),
                Some(Arc::new(p.tensors.into_iter().collect())),
                dir.display().to_string(),
            )
        }
        None => (crate::cmd::graph::load_config(&a.model)?, None, a.model.clone()),
    };
    if let Some(l) = a.layers {
        model.base_mut().num_hidden_layers = l;
        model.validate().context("--layers")?;
    }
    let mut setup = VerifySetup::new(model, kind, shape, a.microbatch_size, a.seq_len);
    let t = &mut setup.train;
    t.seed = a.seed;
    t.options.group = a.group;
    t.options.mem_cap = a.mem_cap;
    if let Some(path) = &a.schedule_file {
        let given = graphpp::train::read_schedule_file(path)
            .map_err(|e| anyhow::anyhow!("--schedule-file {}: {e}", path.display()))?;
        t.schedule = Some(given);
    }
    t.layers_per_stage = a.layers_per_stage.clone();
    (t.dtype, t.dp, t.fsdp, t.ep) = (a.dtype, dp, a.fsdp, a.ep);
    setup.weights = weights;
    setup.reference_dtype = a.reference_dtype;
    Ok((setup, name))
}

/// Prints the run's line, both losses and the largest gradient differences.
fn print_report(a: &VerifyArgs, setup: &VerifySetup, name: &str, world: usize, r: &VerifyReport) {
    let t = &setup.train;
    let layout = match (t.dp, t.fsdp, world) {
        (1, _, 1) => String::new(),
        (dp, fsdp, w) => format!(
            " dp={dp}{}{}{}",
            if fsdp { " fsdp" } else { "" },
            if t.ep > 1 { format!(" ep={}", t.ep) } else { String::new() },
            if w > 1 { format!(", {w} processes") } else { String::new() }
        ),
    };
    let layers = t.model.num_layers();
    println!(
        "verify {} p={} v={} m={}{layout} (model {name}, {layers} layer{}, B={} T={}, seed {}, {})",
        t.kind,
        t.shape.ranks,
        t.shape.stages_per_rank,
        t.shape.microbatches,
        if layers == 1 { "" } else { "s" },
        t.microbatch_size,
        t.seq_len,
        t.seed,
        if a.dtype == a.reference_dtype {
            a.dtype.to_string()
        } else {
            format!("pipelined {} vs single device {}", a.dtype, a.reference_dtype)
        }
    );
    println!("loss pipelined     {:.9}", r.loss_pipelined);
    println!("loss single device {:.9}   (relative difference {:.3e})", r.loss_single, r.loss_rel);
    println!(
        "gradients: {} tensor{}, max abs difference {:.3e}, max relative difference {:.3e} ({})",
        r.gradients,
        if r.gradients == 1 { "" } else { "s" },
        r.max_abs,
        r.max_rel,
        r.worst
    );
}

/// A setup error that names the flag at fault: the data-parallel degree (which defaults to
/// --ep) or the schedule file; any other error as it is.
fn flag_error(a: &VerifyArgs, e: VerifyError) -> anyhow::Error {
    match (e, &a.schedule_file) {
        (VerifyError::Train(t), _) => match *t {
            TrainError::BatchNotDivisible { batch, dp } => anyhow::anyhow!(
                "--dp {dp} does not divide --microbatch-size {batch}: each replica runs B/dp sequences{}",
                if a.dp.is_none() { " (--dp defaults to --ep)" } else { "" }
            ),
            t => VerifyError::Train(Box::new(t)).into(),
        },
        (VerifyError::Setup(SetupError::ScheduleFile(m)), Some(path)) => {
            anyhow::anyhow!("--schedule-file {}: {m}", path.display())
        }
        (e, _) => e.into(),
    }
}
