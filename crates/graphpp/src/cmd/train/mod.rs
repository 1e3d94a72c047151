//! `graphpp train`: trains a Llama-style model on text under a pipeline schedule, one thread per
//! rank, or one process per rank under `mpirun` ([`graphpp::launch`]): then
//! only the leader (world rank 0) prints and writes files, and every process calls the steps,
//! evaluations, checkpoints and the sample at the same points. Progress bar with loss, tokens/s and ETA; validation loss every N steps; a
//! generated sample at the end; checkpoints and `--resume`; `--trace` writes a Chrome trace of the
//! last measured steps; the summary puts the measured bubble beside the simulator's prediction.

use crate::cmd::model::ModelArgs;
use std::collections::VecDeque;
use std::path::PathBuf;

use crate::cmd::layout::{LayoutArgs, LAYOUT_FLAGS};

/// The most bytes `--sample-bytes` may ask for: each is a forward pass of the model.
const MAX_SAMPLE_BYTES: u64 = 65_536;
/// The most threads `--threads-per-rank` may ask for (a pool of a million threads was asked for,
/// and failed after minutes of spawning).
const MAX_THREADS_PER_RANK: u64 = 1024;
use anyhow::{bail, Context, Result};
use clap::Args;
use graphpp::checkpoint::CheckpointError;
use graphpp::fit::{fit, Evaluation, Fit, FitError, FitOptions, Observer};
use graphpp::launch::Launch;
use graphpp::metrics::{MetricsLog, StepRecord};
use graphpp::profile::Profile;
use graphpp::stop::{Interrupted, StopRequest};
use graphpp::strategy::Strategy;
use graphpp::train::{
    bubble_summary, check_checkpoint_dir, comm_summary, joined_timeline, resumable_checkpoint, Run,
    RunConfig, RunError, SavedRun,
};
use graphpp_models::Recompute;
use graphpp_models::{Model, ModelConfig};
use graphpp_runtime::StepReport;
use graphpp_schedule::{render::chrome_trace, Kind, Timeline};
use indicatif::{ProgressBar, ProgressStyle};

/// `println!` that survives a closed standard output (`graphpp train | head`): the run goes on and
/// still saves its checkpoints ([`crate::cmd::emit`] drops a broken pipe).
macro_rules! out {
    ($($arg:tt)*) => {
        crate::cmd::emit(&format!("{}\n", format_args!($($arg)*)))?
    };
}

mod print;

use print::{print_header, print_waits, progress, summarise, write_outputs, Lines};

/// Steps kept for `--trace` and the bubble summary (the last ones of the run).
const TRACE_STEPS: usize = 10;

/// `train`'s schedule kind, ranks and microbatches where neither the flags, a strategy nor a
/// `--schedule-file` give them.
const DEFAULT_SHAPE: (Kind, usize, usize) = (Kind::Zbv, 2, 8);

/// `a` with `[default: value]` added to its help: one of [`DEFAULT_SHAPE`], which applies after
/// `--schedule-file`'s shape, so it cannot be clap's own default.
fn shown_default(a: clap::Arg, value: &str) -> clap::Arg {
    let help = a.get_help().map(ToString::to_string).unwrap_or_default();
    a.help(format!("{help} [default: {value}]"))
}

/// Arguments of `graphpp train`.
#[derive(Args)]
#[command(
    mut_arg("schedule", |a| shown_default(a, "zbv")),
    mut_arg("ranks", |a| shown_default(a, "2")),
    mut_arg("microbatches", |a| shown_default(a, "8")),
    mut_arg("microbatch_size", |a| a.default_value("8"))
)]
pub struct TrainArgs {
    /// The schedule and the layout (the flags a strategy file stands for).
    #[command(flatten)]
    pub layout: LayoutArgs,
    /// The model (`--model`, `--layers`, `--init-from`).
    #[command(flatten)]
    model: ModelArgs,
    /// Optimizer post-validation (zero-bubble paper, section 4): each rank takes its AdamW step
    /// while the global gradient norm and the NaN/inf check are reduced, and rolls it back when
    /// they say so (clipping, a non-finite gradient); the results equal the synchronous step.
    #[arg(long)]
    post_validate: bool,
    /// T: tokens (bytes) per sequence.
    #[arg(long, default_value_t = 64, allow_hyphen_values = true, value_parser = crate::cmd::value::count::<usize>)]
    seq_len: usize,
    /// Optimizer steps of the run (the cosine learning-rate schedule ends here).
    #[arg(long, default_value_t = 1500)]
    steps: u64,
    /// Peak learning rate (AdamW, β = (0.9, 0.95)).
    #[arg(long, default_value_t = 3e-3, allow_hyphen_values = true)]
    lr: f64,
    /// Final learning rate of the cosine decay (default lr/10).
    #[arg(long, allow_hyphen_values = true)]
    min_lr: Option<f64>,
    /// Linear warm-up steps (default: 50, or a tenth of --steps when that is less).
    #[arg(long)]
    warmup: Option<u64>,
    /// AdamW decoupled weight decay.
    #[arg(long, default_value_t = 0.01, allow_hyphen_values = true)]
    weight_decay: f64,
    /// Global gradient-norm bound (0 disables clipping).
    #[arg(long, default_value_t = 1.0, allow_hyphen_values = true)]
    grad_clip: f64,
    /// Corpus: a UTF-8 file or folder (default: the Shakespeare corpus, fetched once into the cache).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Seed of the initial weights and of the training windows.
    #[arg(long, default_value_t = 0, allow_hyphen_values = true, value_parser = crate::cmd::value::count::<u64>)]
    seed: u64,
    /// Validation loss every N steps (0: only at the end).
    #[arg(long, default_value_t = 100)]
    eval_every: u64,
    /// Folder for checkpoints (written at every evaluation, at the end, and on SIGINT/SIGTERM);
    /// one run at a time holds it (a lock file), and it belongs to one run.
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Keep only the newest N checkpoints in --checkpoint-dir (0: keep all).
    #[arg(long, default_value_t = 0)]
    keep_checkpoints: usize,
    /// Continue from the newest checkpoint in --checkpoint-dir (which must hold one). A larger
    /// --steps extends a finished run; the learning-rate schedule is then the new one.
    #[arg(long, requires = "checkpoint_dir", conflicts_with_all = ["resume_if_present", "start_over"])]
    resume: bool,
    /// Continue from the newest checkpoint in --checkpoint-dir if there is one, else start
    /// fresh: one command line for a job that a cluster scheduler restarts.
    #[arg(long, requires = "checkpoint_dir", conflicts_with = "start_over")]
    resume_if_present: bool,
    /// Delete the checkpoints in --checkpoint-dir and start a fresh run there (without it a
    /// folder holding another run's checkpoints is refused).
    #[arg(long, requires = "checkpoint_dir")]
    start_over: bool,
    /// Stop after this many steps of the run (the learning-rate schedule still spans --steps);
    /// at least 1 and at most --steps.
    #[arg(long, allow_hyphen_values = true, value_parser = clap::value_parser!(u64).range(1..))]
    stop_after: Option<u64>,
    /// Write one JSON line per step to PATH (step, loss, lr, grad_norm, step_s, tokens_per_s,
    /// elapsed_s, peak_bytes and resident_bytes per rank, boundary_wait_s, flops_per_s, aux_loss
    /// and mtp_loss for a MoE model with them, and val_loss at evaluations); a resumed run
    /// keeps the lines up to its checkpoint's step, a fresh one truncates the file.
    #[arg(long)]
    metrics: Option<PathBuf>,
    /// Write a Chrome trace (Perfetto, chrome://tracing) of the last 10 measured steps to PATH.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Bytes of text to generate at the end (0: none; at most 65536: each byte is a forward pass
    /// of the model).
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(0..=MAX_SAMPLE_BYTES))]
    sample_bytes: u64,
    /// Intra-op threads per rank, the size of its thread pool (default: cores / ranks, at least
    /// 1; or RAYON_NUM_THREADS; at most 1024).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=MAX_THREADS_PER_RANK))]
    threads_per_rank: Option<u64>,
    /// Activation recomputation: pointwise (the backward recomputes pointwise values such as
    /// SwiGLU's σ(g) inside its fused ops), save-all (none), stage-inputs (full, per stage),
    /// matmuls (selective), layers (a checkpoint per decoder layer). Trades compute for
    /// activation memory; the losses do not change.
    #[arg(long, default_value = "pointwise")]
    recompute: Recompute,
    /// MoE models: bias update speed γ of the auxiliary-loss-free load balancing (each step, a
    /// layer's routing bias moves by γ against each expert's excess load; DeepSeek-V3's 0.001;
    /// 0 freezes the routing biases).
    #[arg(long, default_value_t = graphpp::train::default_expert_bias_update(), allow_hyphen_values = true)]
    expert_bias_update: f64,
    /// Emulated interconnect `LATENCY_US,GBPS` (e.g. `20,10`): every message between ranks and
    /// every collective takes the latency plus its bytes over the bandwidth (a message waits for
    /// its link to be free), so communication costs can be measured on one machine.
    #[arg(long)]
    link: Option<graphpp_comm::LinkModel>,
    /// Seconds a rank waits for a message or a collective before the run fails naming the ranks
    /// it waited for (a hung or stopped peer, a dead host).
    #[arg(long, default_value_t = graphpp::train::default_timeout(), allow_hyphen_values = true)]
    timeout: f64,
    /// Write an HTML report of the run to DIR/index.html at the end: strategy, loss and tokens/s
    /// curves, the measured timeline of the last steps beside the simulator's prediction, a row
    /// per evaluation.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Prompt of the generated sample.
    #[arg(long, default_value = "ROMEO:")]
    prompt: String,
    /// Compute dtype of the stage graphs: `f32`, or `bf16` mixed precision (f32 master weights,
    /// gradients, AdamW state and loss; bf16 activations and messages between ranks). bf16
    /// matmuls on the CPU take the fastest path the CPU has; the environment variable
    /// GRAPHPP_BF16_GEMM=amx|avx512-bf16|widened picks one.
    #[arg(long, default_value = "f32", value_parser = crate::cmd::parse_compute_dtype)]
    dtype: graphpp_graph::DType,
    /// Run the strategy of a TOML (or .json) file: its directives place, replicate, shard, split,
    /// order and recompute stand for --ranks, --stages-per-rank, --layers-per-stage, --dp,
    /// --fsdp, --ep, --tp, --sequence-parallel, --device, --microbatches, --microbatch-size, --schedule,
    /// --schedule-file, --group, --mem-cap, --post-validate and --recompute (which it excludes). See --print-strategy.
    #[arg(long, value_name = "FILE", conflicts_with_all = strategy_flags())]
    strategy: Option<PathBuf>,
    /// Print the strategy of the flags given (or of --strategy) as TOML and exit: the file
    /// --strategy runs the same way.
    #[arg(long)]
    print_strategy: bool,
    /// Write a profile of the run here at the end (`graphpp profile`; not a train flag).
    #[arg(skip)]
    profile: Option<PathBuf>,
}

/// The flags a strategy file stands for (see [`graphpp::strategy`]): the layout's, the
/// optimizer's post-validation and the recompute policy.
fn strategy_flags() -> Vec<&'static str> {
    LAYOUT_FLAGS.into_iter().chain(["post_validate", "recompute"]).collect()
}

impl TrainArgs {
    /// Takes the settings of strategy `s` (the flags it stands for).
    fn apply_strategy(&mut self, s: &Strategy) {
        self.layout.apply_strategy(s);
        self.post_validate = s.order.post_validate;
        self.recompute = s.recompute.policy;
    }

    /// The run's settings. `resumed` is the checkpoint's run when resuming: a flag left at its
    /// default whose default depends on --steps (--warmup) takes the checkpoint's value, so
    /// extending a run with a larger --steps keeps its warm-up.
    fn config(&self, resumed: Option<&RunConfig>) -> Result<RunConfig> {
        let l = &self.layout;
        let (kind, ranks, microbatches) = l.shape(Some(DEFAULT_SHAPE))?;
        let model = self.model.config()?;
        if let Some(stop) = self.stop_after.filter(|&s| s > self.steps) {
            bail!(
                "--stop-after {stop} is beyond --steps {}: the run ends at step {} anyway",
                self.steps,
                self.steps
            );
        }
        if !(self.grad_clip >= 0.0 && self.grad_clip.is_finite()) {
            bail!("--grad-clip {} must be a finite number >= 0 (0 disables clipping)", self.grad_clip);
        }
        let warmup = self.warmup.or(resumed.map(|r| r.warmup)).unwrap_or((self.steps / 10).min(50));
        if warmup > self.steps {
            bail!("--warmup {warmup} exceeds --steps {}", self.steps);
        }
        if self.sample_bytes > 0 && self.prompt.is_empty() {
            bail!("--prompt is empty: the sample needs one byte of prompt at least (or --sample-bytes 0)");
        }
        Ok(RunConfig {
            model_name: self.model.name(),
            model,
            kind,
            schedule_file: l.schedule_file.clone(),
            group: l.group,
            mem_cap: l.mem_cap,
            ranks,
            stages_per_rank: l.stages_per_rank(kind),
            microbatches,
            microbatch_size: l.microbatch_size(),
            dp: l.dp(),
            fsdp: l.fsdp,
            ep: l.ep,
            tp: l.tp,
            sequence_parallel: l.sequence_parallel,
            post_validate: self.post_validate,
            seq_len: self.seq_len,
            layers_per_stage: l.layers_per_stage.clone(),
            steps: self.steps,
            lr: self.lr,
            min_lr: self.min_lr.unwrap_or(self.lr / 10.0),
            warmup,
            weight_decay: self.weight_decay,
            grad_clip: (self.grad_clip > 0.0).then_some(self.grad_clip),
            seed: self.seed,
            data: self.data.clone(),
            recompute: self.recompute,
            init_from: self.model.init_from.clone(),
            dtype: self.dtype,
            expert_bias_update: self.expert_bias_update,
            link: self.link,
            timeout: self.timeout,
            device: l.device,
        })
    }
}

/// The settings `graphpp train --strategy PATH` would run, with `flags` (e.g. `--model tiny`)
/// and every other flag at its default: one code path from a strategy file to a run's settings.
///
/// # Errors
/// A strategy file that cannot be read or checked; flags `train` refuses.
pub fn strategy_config(path: &std::path::Path, flags: &[&str]) -> Result<RunConfig> {
    #[derive(clap::Parser)]
    struct Only {
        #[command(flatten)]
        train: TrainArgs,
    }
    let mut a =
        <Only as clap::Parser>::try_parse_from(std::iter::once("train").chain(flags.iter().copied()))?.train;
    a.apply_strategy(&Strategy::load(path)?);
    a.strategy = Some(path.to_path_buf());
    a.config(None)
}

/// Runs `graphpp profile`: `a`'s run until step `steps` (no evaluation before the end, no
/// sample; a resumed run counts from its checkpoint's step), then its [`Profile`] written to
/// `output`.
///
/// # Errors
/// As [`run`]; the profile file cannot be written.
pub fn profile(mut a: TrainArgs, steps: u64, output: PathBuf) -> Result<()> {
    check_output_file("--output", &output)?;
    a.stop_after = Some(steps.min(a.steps));
    a.eval_every = 0;
    a.sample_bytes = 0;
    a.profile = Some(output);
    run(a)
}

/// Runs `graphpp train`. Errors: bad settings, data or checkpoint (typed, naming the input), a
/// failing rank (naming rank, step and action); [`graphpp::stop::Interrupted`] after SIGINT /
/// SIGTERM, once the current step is finished and saved. Under `mpirun` a failing process tells
/// every other one to stop, naming its rank.
pub fn run(mut a: TrainArgs) -> Result<()> {
    if let Some(path) = &a.strategy {
        let s = Strategy::load(path)?;
        a.apply_strategy(&s);
    }
    a.layout.take_schedule_file_shape()?;
    if a.print_strategy {
        let s = Strategy::of_config(&a.config(None)?)?;
        s.check()?;
        out!("{}", s.to_toml()?.trim_end());
        return Ok(());
    }
    crate::cmd::launch(|e| e.downcast_ref::<Interrupted>().is_some(), |launch| train(&a, launch))
}

/// The run itself (see [`run`]).
fn train(a: &TrainArgs, launch: &Launch) -> Result<()> {
    let (_, ranks, _) = a.layout.shape(Some(DEFAULT_SHAPE))?;
    let dp = a.layout.dp();
    launch.check_world(ranks, dp, a.layout.tp, a.layout.device)?;
    let stop = StopRequest::install().context("installing the SIGINT/SIGTERM handlers")?;
    let local_ranks = if launch.world() > 1 {
        graphpp::launch::local_processes()
    } else {
        ranks.saturating_mul(dp).saturating_mul(a.layout.tp)
    };
    let op = crate::cmd::set_op_threads(local_ranks, a.threads_per_rank.map(|n| n as usize));
    // `_lock` holds the checkpoint folder for the whole run.
    let (mut run, mut metrics, _lock) = start(a, launch)?;
    op.warn();
    let threads = op.threads;
    print_header(&run, threads, launch.world(), a.stop_after)?;
    let options = FitOptions {
        last_step: a.stop_after.map_or(run.config().steps, |s| s.min(run.config().steps)),
        eval_every: a.eval_every,
        checkpoint_dir: a.checkpoint_dir.clone(),
        keep_checkpoints: a.keep_checkpoints,
        keep_timelines: TRACE_STEPS,
        profile: a.profile.is_some(),
    };
    let pb =
        if run.is_leader() { progress(options.last_step, run.steps_done()) } else { ProgressBar::hidden() };
    let mut observer = Lines { pb, tokens: run.config().tokens_per_step() as f64 };
    let fit = match fit(&mut run, &options, &mut metrics, &stop, &mut observer) {
        Ok(fit) => fit,
        Err(FitError::Interrupted(i)) => {
            observer.pb.finish_and_clear();
            return Err(i.into());
        }
        Err(e) => return Err(e.into()),
    };
    observer.pb.finish_and_clear();
    if fit.steps_run() == 0 {
        out!(
            "nothing to train: the run is at step {} and ends at step {}",
            fit.first_step,
            options.last_step
        );
    }
    summarise(a, &mut run, &fit.kept, fit.val_loss)?;
    if run.is_leader() {
        print_waits(a, &fit)?;
        write_outputs(a, &run, &fit, metrics.records())?;
    }
    Ok(())
}

/// Everything before step 1: the settings, every output path, the run (fresh, or resumed from
/// its checkpoint, saying so), its metrics log and the checkpoint folder's lock. Nothing is
/// written before the run is built. Only the leader checks and writes the outputs; every
/// process reads the checkpoint it resumes from.
fn start(a: &TrainArgs, launch: &Launch) -> Result<(Run, MetricsLog, Option<std::fs::File>)> {
    let resume_from = resume_point(a)?;
    let resume_step = resume_from.as_ref().map_or("none".to_string(), |s| s.step.to_string());
    let files = crate::cmd::settings_files(&[a.strategy.as_deref(), a.layout.schedule_file.as_deref()]);
    let fingerprint = graphpp::launch::command_fingerprint(&format!("resume from step {resume_step}{files}"));
    launch.agree("the command line or the checkpoint to resume", fingerprint)?;
    let config = a.config(resume_from.as_ref().map(|s| &s.config))?;
    config.validate()?;
    let leader = launch.is_leader();
    if leader {
        check_outputs(a, resume_from.is_some())?;
    }
    let mut run = Run::with_comm(config, launch.comm())?;
    let lock = a.checkpoint_dir.as_deref().filter(|_| leader).map(graphpp::checkpoint::lock).transpose()?;
    if let Some(dir) = a.checkpoint_dir.as_ref().filter(|d| leader && a.start_over && d.is_dir()) {
        graphpp::checkpoint::remove_all(dir)?;
    }
    if let (Some(saved), Some(dir)) = (&resume_from, &a.checkpoint_dir) {
        let step = saved.step;
        if step > run.config().steps {
            bail!(
                "--steps {} is below the checkpoint's step {step} in {}: give --steps {step} or more",
                run.config().steps,
                dir.display()
            );
        }
        let at = run.resume(&saved.sidecar)?;
        out!("resumed run {} from {} at step {at}", run.run_id(), dir.display());
        if saved.config.steps != run.config().steps {
            out!(
                "the run now ends at step {} (it was {}): the learning-rate schedule is the new one from step {}",
                run.config().steps,
                saved.config.steps,
                step + 1
            );
        }
    }
    let metrics = match &a.metrics {
        Some(path) if leader => MetricsLog::open(path, run.steps_done())?,
        _ => MetricsLog::in_memory(),
    };
    Ok((run, metrics, lock))
}

/// The checkpoint to continue from: with --resume the newest in --checkpoint-dir (an error when
/// there is none — the folder is never created); with --resume-if-present that one or none.
/// Returns its step, its run's settings and its sidecar (which [`Run::resume`] then loads
/// without looking through the folder again).
fn resume_point(a: &TrainArgs) -> Result<Option<SavedRun>> {
    let Some(dir) = a.checkpoint_dir.as_ref().filter(|_| a.resume || a.resume_if_present) else {
        return Ok(None);
    };
    match resumable_checkpoint(dir)? {
        Some(saved) => Ok(Some(saved)),
        None if a.resume && !dir.exists() => {
            bail!("--resume: the checkpoint folder {} does not exist (nothing to resume)", dir.display())
        }
        None if a.resume => Err(CheckpointError::NotFound(dir.clone()).into()),
        None => Ok(None),
    }
}

/// Checks every output path before any training, so that a bad one fails in the first second
/// rather than after the run: the trace's folder must exist and be writable (and the path not
/// be a folder); the checkpoint folder must be writable and, for a fresh run, hold no other
/// run's checkpoints (`--start-over` allows that: they are deleted once the run is built); the
/// metrics file's folder must be writable. Creates nothing.
fn check_outputs(a: &TrainArgs, resuming: bool) -> Result<()> {
    if let Some(path) = &a.trace {
        check_output_file("--trace", path)?;
    }
    if let Some(path) = &a.metrics {
        check_output_file("--metrics", path)?;
    }
    if let Some(dir) = &a.report {
        graphpp::checkpoint::check_writable(dir)
            .map_err(|e| anyhow::anyhow!("--report {}: cannot write there: {e}", dir.display()))?;
    }
    if let Some(dir) = &a.checkpoint_dir {
        // A resumed run continues its own folder; a fresh one must not take another run's.
        check_checkpoint_dir(dir, resuming || a.start_over).map_err(|e| match e {
            RunError::Checkpoint(io @ CheckpointError::Io { .. }) => {
                anyhow::anyhow!("--checkpoint-dir {}: cannot write there: {io}", dir.display())
            }
            other => other.into(),
        })?;
    }
    Ok(())
}

/// `path` names a file (not a folder) in an existing folder that accepts new files.
pub(crate) fn check_output_file(flag: &str, path: &std::path::Path) -> Result<()> {
    if path.is_dir() {
        bail!(
            "{flag} {}: is a folder; give a file path such as {}",
            path.display(),
            path.join("out.json").display()
        );
    }
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
    if !parent.is_dir() {
        bail!("{flag} {}: the folder {} does not exist", path.display(), parent.display());
    }
    graphpp::checkpoint::check_writable(parent)
        .with_context(|| format!("{flag} {}: cannot write into {}", path.display(), parent.display()))
}
