//! `graphpp verify`: one training step pipelined under a schedule and one on a single device from
//! the same weights and batch; prints both losses and the largest gradient differences, and fails
//! (exit 1) above the tolerance (docs/ARCHITECTURE.md "Runtime" → Semantics). With `--dp N`
//! (and `--fsdp`), `--ep N` or `--tp N` the pipelined step runs as a training run's ranks do,
//! each replica on its share of the batch; under `mpirun -n W` (W = ranks × dp × tp) one rank per
//! process, the leader comparing and printing.

use crate::cmd::model::ModelArgs;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
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

use crate::cmd::layout::{LayoutArgs, LAYOUT_FLAGS};
use crate::cmd::value::count;

/// Arguments of `graphpp verify`.
#[derive(Args)]
#[command(
    mut_arg("schedule", |a| a.required_unless_present_any(["strategy", "schedule_file"])),
    mut_arg("ranks", |a| a.required_unless_present_any(["strategy", "schedule_file"])),
    mut_arg("microbatches", |a| a.required_unless_present_any(["strategy", "schedule_file"])),
    mut_arg("microbatch_size", |a| {
        a.help("B: sequences per microbatch, split over the --dp replicas (default: dp, one sequence each)")
    })
)]
pub struct VerifyArgs {
    /// The schedule and the layout (the flags a strategy file stands for).
    #[command(flatten)]
    layout: LayoutArgs,
    /// The model (`--model`, `--layers`, `--init-from`).
    #[command(flatten)]
    model: ModelArgs,
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
    /// --microbatch-size, --dp, --ep, --fsdp, --tp, --sequence-parallel and --device. Its recompute policy and post-validation do not
    /// change the gradients and are not run here.
    #[arg(long, value_name = "FILE", conflicts_with_all = LAYOUT_FLAGS)]
    strategy: Option<PathBuf>,
}

/// A difference above the tolerance (the step ran, so no rank failed), and what to try.
#[derive(Debug, thiserror::Error)]
#[error("FAIL: difference above tolerance {} relative{}", if *.0 == 0.0 { "0".to_string() } else { format!("{:e}", .0) }, .1)]
struct AboveTolerance(f64, String);

/// Runs `graphpp verify`. Errors: bad shape or model (typed, with the numbers), a failing rank,
/// or a difference above the tolerance.
pub fn run(mut a: VerifyArgs) -> Result<()> {
    if let Some(path) = &a.strategy {
        let s = Strategy::load(path)?;
        a.layout.apply_strategy(&s);
    }
    a.layout.take_schedule_file_shape()?;
    crate::cmd::launch(|e| e.downcast_ref::<AboveTolerance>().is_some(), |launch| verify(&a, launch))
}

fn verify(a: &VerifyArgs, launch: &Launch) -> Result<()> {
    let (kind, ranks, microbatches) = a.layout.shape(None)?;
    if let Some(t) = a.tolerance {
        check_tolerance(t)?;
    }
    let dp = a.layout.dp();
    launch.check_world(ranks, dp, a.layout.tp, a.layout.device)?;
    let files = crate::cmd::settings_files(&[a.strategy.as_deref(), a.layout.schedule_file.as_deref()]);
    launch.agree("the command line", graphpp::launch::command_fingerprint(&files))?;
    let local_ranks = if launch.world() > 1 {
        graphpp::launch::local_processes()
    } else {
        ranks.saturating_mul(dp).saturating_mul(a.layout.tp)
    };
    let op = crate::cmd::set_op_threads(local_ranks, None);
    let v = a.layout.stages_per_rank(kind);
    let (setup, name) = setup_of(a, kind, Shape::new(ranks, v, microbatches), dp)?;
    let tolerance = a.tolerance.unwrap_or_else(|| default_tolerance(a.dtype, a.reference_dtype));
    setup.check().map_err(|e| flag_error(a, e))?;
    // Whatever else the shape can be refused for, before the warning: the kind's own shape
    // rules (its schedule, generated again by the step) and the model's layer split.
    let refused = |e: TrainError| flag_error(a, VerifyError::Train(Box::new(e)));
    setup.train.compute_schedule().map_err(refused)?;
    graphpp_runtime::train::build::run_stages(&setup.train, (0, 0))
        .map_err(|e| flag_error(a, VerifyError::Setup(e)))?;
    op.warn();
    let t0 = Instant::now();
    let r = if launch.world() > 1 {
        // Every process runs its rank; the leader gets the gradients and compares.
        let Some(pipelined) = data_parallel_step(&setup, launch.comm())? else { return Ok(()) };
        compare(&pipelined, &single_device_step(&setup)?)?
    } else {
        verify_step(&setup).map_err(|e| flag_error(a, e))?
    };
    print_report(a, &setup, &name, launch.world(), &r);
    println!("wall time {:.2} s", t0.elapsed().as_secs_f64());
    if !r.passes(tolerance) {
        // bf16 rounding flips some routing choices against f32 (docs/cli/verify.md).
        let routed = setup.train.model.routed_experts() > 0;
        let hint = if routed && a.dtype != a.reference_dtype {
            "; compare a MoE model in one dtype (e.g. --dtype bf16 --reference-dtype bf16): \
             bf16 rounding sends some tokens to other experts than f32 does"
        } else {
            ""
        };
        return Err(AboveTolerance(tolerance, hint.into()).into());
    }
    println!("PASS (tolerance {tolerance:e} relative)");
    Ok(())
}

/// The setup the flags describe at `shape` with `dp` replicas, and the model's name for the
/// report (the preset or config path, or the `--init-from` folder).
///
/// # Errors
/// A model config or `--init-from` folder that cannot be read; a bad `--layers`; an unreadable
/// `--schedule-file`; a `--device` that cannot be opened.
fn setup_of(a: &VerifyArgs, kind: Kind, shape: Shape, dp: usize) -> Result<(VerifySetup, String)> {
    let (model, weights) = a.model.load()?;
    let (weights, name) = (weights.map(|w| Arc::new(w.into_iter().collect())), a.model.name());
    let l = &a.layout;
    let mut setup = VerifySetup::new(model, kind, shape, l.microbatch_size(), a.seq_len);
    let t = &mut setup.train;
    t.seed = a.seed;
    t.options.group = l.group;
    t.options.mem_cap = l.mem_cap;
    if let Some(path) = &l.schedule_file {
        let given = graphpp::train::read_schedule_file(path)
            .map_err(|e| anyhow::anyhow!("--schedule-file {}: {e}", path.display()))?;
        t.schedule = Some(given);
    }
    t.layers_per_stage = l.layers_per_stage.clone();
    (t.dtype, t.dp, t.fsdp, t.ep, t.tp) = (a.dtype, dp, l.fsdp, l.ep, l.tp);
    t.sequence_parallel = l.sequence_parallel;
    t.device = l.device.open().map_err(graphpp::train::RunError::from)?;
    // verify reads no corpus; its ranks are threads of this process, or one process each.
    let ranks = graphpp::train::ranks_in_process(shape.ranks * dp * l.tp);
    let workers = graphpp_runtime::kernels::threads::op_threads();
    t.process_bytes = graphpp_runtime::train::memory::process_bytes(0, ranks, workers);
    setup.weights = weights;
    setup.reference_dtype = a.reference_dtype;
    Ok((setup, name))
}

/// Prints the run's line, both losses and the largest gradient differences.
fn print_report(a: &VerifyArgs, setup: &VerifySetup, name: &str, world: usize, r: &VerifyReport) {
    let t = &setup.train;
    let parts = crate::cmd::layout::parallel_parts(t.dp, t.fsdp, t.ep, (t.tp, t.sequence_parallel));
    let mut layout = if parts.is_empty() { String::new() } else { format!(" {}", parts.join(" ")) };
    if world > 1 {
        layout.push_str(&format!(", {world} processes"));
    }
    if !a.layout.device.is_cpu() {
        layout.push_str(&format!(" on {}", a.layout.device));
    }
    if graphpp_runtime::kernels::device::forced_composed() {
        layout.push_str(", composed kernels");
    }
    // The pipelined step's path where it runs graphpp's CPU kernels, else the reference's (which
    // always does).
    let path = t.bf16_path().ok().flatten().or(setup.reference_bf16_path().ok().flatten());
    layout.push_str(&crate::cmd::bf16_matmuls(path));
    let layers = t.model.num_layers();
    println!(
        "verify {}{} p={} v={} m={}{layout} (model {name}, {layers} layer{}, B={} T={}, seed {}, {})",
        t.kind,
        a.layout.schedule_file.as_ref().map_or(String::new(), |f| format!(" (order of {})", f.display())),
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
/// --ep) or the schedule file (whichever step found it); any other error as it is.
fn flag_error(a: &VerifyArgs, e: VerifyError) -> anyhow::Error {
    let setup = match e {
        VerifyError::Setup(s) => s,
        VerifyError::Train(t) => match *t {
            TrainError::Setup(s) => s,
            TrainError::BatchNotDivisible { batch, dp } => {
                let default = if a.layout.dp.is_none() { " (--dp defaults to --ep)" } else { "" };
                return anyhow::anyhow!("{}{default}", graphpp::train::dp_not_dividing(dp, batch));
            }
            t => return VerifyError::Train(Box::new(t)).into(),
        },
        e => return e.into(),
    };
    match (setup, &a.layout.schedule_file) {
        (e @ (SetupError::ScheduleFile(_) | SetupError::Generate(_)), Some(path)) => {
            let hint = a.layout.schedule.map_or(String::new(), graphpp::train::order_hint);
            anyhow::anyhow!("--schedule-file {}: {e} {hint}", path.display())
        }
        (e, _) => VerifyError::Setup(e).into(),
    }
}
