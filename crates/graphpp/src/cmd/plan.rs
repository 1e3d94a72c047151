//! `graphpp plan`: the planner's ranked table ([`graphpp::plan`]) and the command that runs its
//! best strategy.

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use graphpp::dag::TrainingDag;
use graphpp::hardware::Hardware;
use graphpp::plan::{layer_list, plan, predict, Candidate, Cost, Links, PlanRequest};
use graphpp::profile::Profile;
use graphpp_models::Recompute;
use graphpp_schedule::Kind;

use crate::cmd::value::count;

/// Arguments of `graphpp plan`.
#[derive(Args)]
pub struct PlanArgs {
    /// Model: a preset or a JSON config file (as for `graphpp train`).
    #[arg(long, default_value = "tiny")]
    model: String,
    /// Override the model's number of decoder layers.
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    layers: Option<usize>,
    /// N: ranks in all (each strategy splits them into pipeline × data-parallel × tensor-parallel).
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>, required_unless_present_any = ["strategy", "print_hardware"])]
    ranks: Option<usize>,
    /// Memory of one rank: bytes, or with a unit (`512MiB`, `2GB`, `1.5GiB`); with --hardware,
    /// the device's by default.
    #[arg(long, allow_hyphen_values = true, value_parser = parse_bytes, required_unless_present_any = ["strategy", "hardware", "print_hardware"])]
    memory_per_rank: Option<u64>,
    /// Instead of searching: compile this strategy file (as `train --strategy` runs it) into its
    /// global training DAG — every action of every rank's lowered program, the graph each
    /// compute action runs, every dependency — and its prediction (step time, bubble, peak
    /// bytes per rank).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["ranks", "memory_per_rank", "global_batch", "max_microbatches", "pp", "tp", "ep", "microbatches", "schedule", "recompute", "top"])]
    strategy: Option<PathBuf>,
    /// With a search: predict this strategy file too (it must use --ranks ranks and
    /// --global-batch sequences) and say how the best strategy compares with it — step, bubble,
    /// exposed communication, peak — or that it is the best.
    #[arg(long, value_name = "FILE", conflicts_with = "strategy")]
    against: Option<PathBuf>,
    /// With --strategy: how to print the DAG.
    #[arg(long, value_enum, default_value_t = DagFormat::Text, requires = "strategy")]
    format: DagFormat,
    /// Sequences per step over all replicas (microbatches × microbatch size).
    #[arg(long, default_value_t = 64, allow_hyphen_values = true, value_parser = count::<usize>)]
    global_batch: usize,
    /// T: tokens per sequence.
    #[arg(long, default_value_t = 64, allow_hyphen_values = true, value_parser = count::<usize>)]
    seq_len: usize,
    /// Most microbatches per step to consider.
    #[arg(long, default_value_t = 32, allow_hyphen_values = true, value_parser = count::<usize>)]
    max_microbatches: usize,
    /// Only this pipeline depth pp (train's --ranks); it must divide --ranks.
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    pp: Option<usize>,
    /// Only this tensor-parallel degree (train's --tp); it must divide --ranks.
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    tp: Option<usize>,
    /// Only this expert-parallel degree (train's --ep) for a mixture-of-experts model; it must
    /// divide --ranks and the routed experts (each layout's dp it does not divide is left out).
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    ep: Option<usize>,
    /// Only this microbatch count m per step (train's --microbatches); it must divide
    /// --global-batch.
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    microbatches: Option<usize>,
    /// Only these schedule kinds (comma-separated; default: every kind).
    #[arg(long, value_delimiter = ',')]
    schedule: Option<Vec<Kind>>,
    /// Only these recompute policies (comma-separated; default: every policy).
    #[arg(long, value_delimiter = ',')]
    recompute: Option<Vec<Recompute>>,
    /// A profile of this model on this machine (`graphpp profile`): the speed fitted to its
    /// measured action times replaces the default (50 GFLOP/s of matmuls, 5 GB/s of other work).
    #[arg(long, value_name = "FILE")]
    profile: Option<PathBuf>,
    /// Plan for a cluster instead of this machine: a preset (h100-sxm, h200-sxm: the vendors'
    /// published figures) or a TOML file of the same fields. Matmuls run at the device's peak
    /// for --dtype, other work at its memory bandwidth, each layout's traffic over the links it
    /// crosses (tp inside a node where it fits); --memory-per-rank defaults to the device's.
    #[arg(long, value_name = "PRESET|FILE", conflicts_with_all = ["profile", "link_gbps"])]
    hardware: Option<String>,
    /// With --hardware: print its description as TOML (a file to edit) and exit.
    #[arg(long, requires = "hardware")]
    print_hardware: bool,
    /// Compute dtype of the stage graphs planned (default: the profile's, else f32).
    #[arg(long, value_parser = crate::cmd::parse_compute_dtype)]
    dtype: Option<graphpp_graph::DType>,
    /// Bandwidth between ranks in GB/s (gigabytes per second): pipeline hand-overs and the
    /// data-parallel all-reduce.
    #[arg(long, default_value_t = 10.0, allow_hyphen_values = true)]
    link_gbps: f64,
    /// Rows of the table (0: none; the summary and the best strategy's command are printed
    /// whatever the count).
    #[arg(long, default_value_t = 10)]
    top: usize,
}

/// How `plan --strategy` prints the training DAG.
#[derive(Clone, Copy, ValueEnum)]
pub enum DagFormat {
    /// Each rank's program with the graphs its actions run, the edge counts, every hop, the prediction.
    Text,
    /// Graphviz DOT: a cluster per rank.
    Dot,
    /// `{"dag": {...}, "prediction": {...}}`.
    Json,
}

/// `bytes` in binary units, as `--memory-per-rank` takes them and `train` prints them: B below a
/// KiB, KiB below a MiB, else MiB (two decimals below 10, one above).
fn mib(bytes: u64) -> String {
    let (value, unit) = match bytes {
        0..1024 => return format!("{bytes} B"),
        1024..1_048_576 => (bytes as f64 / 1024.0, "KiB"),
        _ => (bytes as f64 / 1_048_576.0, "MiB"),
    };
    if value < 10.0 {
        format!("{value:.2} {unit}")
    } else {
        format!("{value:.1} {unit}")
    }
}

/// Parses a byte count: an integer, or a number with a unit B, KB, MB, GB (powers of 1000) or
/// KiB, MiB, GiB (powers of 1024), in any case. Errors: anything else, naming the text.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "kib" => 1024.0,
        "mib" => 1024.0 * 1024.0,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        u => return Err(format!("`{text}`: unknown unit `{u}` (B, KB, MB, GB, KiB, MiB, GiB)")),
    };
    let n: f64 = number.trim().parse().map_err(|_| format!("`{text}` is not a byte count"))?;
    let bytes = n * scale;
    if !(1.0..1.8e19).contains(&bytes) {
        return Err(format!("`{text}`: a memory size must be at least 1 byte and below 2^64"));
    }
    Ok(bytes as u64)
}

/// One table row; `mfu` the candidate's MFU on a cluster's device.
fn row(i: usize, c: &Candidate, mfu: Option<f64>) -> String {
    let mfu = mfu.map_or("-".to_string(), |m| format!("{:.1}%", 100.0 * m));
    format!(
        "{:>3}  {:<20} {:>3} {:>3} {:>4} {:>3} {:>3} {:>2} {:>4} {:>4}  {:<12} {:>10} {:>8.3} {:>10} {:>6} {:>12}  {}\n",
        i + 1,
        c.kind.name(),
        c.pp,
        c.dp,
        if c.fsdp { "yes" } else { "no" },
        c.tp,
        c.ep,
        c.stages_per_rank,
        c.microbatches,
        c.microbatch_size,
        c.recompute.name(),
        milliseconds(c.step_seconds),
        c.bubble,
        milliseconds(c.exposed_comm_seconds),
        mfu,
        mib(c.peak_bytes),
        if c.fits { "yes" } else { "no" }
    )
}

/// A step time in milliseconds with 4 significant digits (`1234`, `12.34`, `0.01234`): cluster
/// predictions can be far below a millisecond.
fn milliseconds(seconds: f64) -> String {
    let ms = 1e3 * seconds;
    let decimals = if ms <= 0.0 { 2 } else { (3 - ms.log10().floor() as i32).clamp(0, 6) as usize };
    format!("{ms:.decimals$}")
}

/// `value` `unit` with a G or T prefix (`989.5 TFLOP/s`, `43.0 GFLOP/s`).
fn rate(value: f64, unit: &str) -> String {
    if value >= 1e12 {
        format!("{:.1} T{unit}", value / 1e12)
    } else {
        format!("{:.1} G{unit}", value / 1e9)
    }
}

/// The compute dtype a plan asks for: `--dtype`, else the profile's; `None` leaves train's default.
fn compute_dtype(a: &PlanArgs, profile: Option<&Profile>) -> Option<graphpp_graph::DType> {
    a.dtype.or(profile.map(|p| p.dtype))
}

/// A strategy file compiled as `train --strategy` runs it: its run configuration, training DAG,
/// prediction and (on a cluster's device) MFU.
struct Compiled {
    config: graphpp::train::RunConfig,
    dag: TrainingDag,
    prediction: graphpp::plan::Prediction,
    mfu: Option<f64>,
}

/// Compiles the strategy file at `path` for `a`'s model, sequence length and dtype (see
/// [`PlanArgs::strategy`]). Errors: a bad file, a layout the model cannot split, a schedule
/// that cannot be lowered or simulated.
fn compile_strategy(
    a: &PlanArgs,
    path: &std::path::Path,
    profile: Option<&Profile>,
    hardware: Option<&Hardware>,
) -> Result<Compiled> {
    let layers = a.layers.map(|l| l.to_string());
    let seq = a.seq_len.to_string();
    let mut flags = vec!["--model", a.model.as_str(), "--seq-len", seq.as_str()];
    if let Some(l) = &layers {
        flags.extend(["--layers", l.as_str()]);
    }
    // The compute dtype is train's flag, not a strategy directive: --dtype (or the profile's).
    let dtype = compute_dtype(a, profile).map(|d| d.name());
    if let Some(d) = dtype {
        flags.extend(["--dtype", d]);
    }
    let config = crate::cmd::train::strategy_config(path, &flags)?;
    let setup = graphpp::train::train_setup(&config)?;
    setup.check_layout()?;
    // A plan allocates nothing (and may be for other hardware): the run's schedule without this
    // machine's memory check.
    let compute = graphpp_runtime::train::build::compute_schedule(
        setup.kind,
        &setup.shape,
        &setup.options,
        setup.schedule.as_deref(),
    )?;
    let schedule = graphpp_schedule::lower(&compute, &setup.lower_options())?;
    let graphs = graphpp_runtime::train::build::run_stage_graphs(&setup)?;
    let dag = TrainingDag::of(&schedule, &|s| graphs.get(s).is_some_and(|g| g.di_dw.is_some()))?;
    let speed = profile.and_then(Profile::speed).unwrap_or_default();
    let (cost, links) = match hardware {
        Some(h) => (Cost::Device(h, config.dtype), h.links((config.ranks, config.dp, config.tp, config.ep))),
        None => (Cost::Speed(&speed), Links::uniform(a.link_gbps * 1e9)),
    };
    let prediction = predict(&schedule, &graphs, (&config.model, config.dp, config.ep), cost, links)?;
    // Model FLOPs per second over the world's peak (PaLM's MFU), on a cluster's device.
    let mfu = hardware.map(|h| {
        let per_token = graphpp_models::Model::flops_per_token(&config.model, config.seq_len);
        let tokens = config.tokens_per_step();
        h.mfu(per_token, tokens, config.world(), config.dtype, prediction.step_seconds)
    });
    Ok(Compiled { config, dag, prediction, mfu })
}

/// `plan --strategy`: the strategy's training DAG and prediction (see [`PlanArgs::strategy`]).
fn compile(
    a: &PlanArgs,
    path: &std::path::Path,
    profile: Option<&Profile>,
    hardware: Option<&Hardware>,
) -> Result<()> {
    let Compiled { dag, prediction: p, mfu, .. } = compile_strategy(a, path, profile, hardware)?;
    let text = match a.format {
        DagFormat::Text => {
            let peaks: Vec<String> = p.peak_bytes.iter().map(|&b| mib(b)).collect();
            let mfu = mfu.map_or(String::new(), |m| format!(", MFU {:.1}%", 100.0 * m));
            format!(
                "{}predicted: step {:.2} ms, bubble r = {:.3}, exposed communication {:.2} ms{mfu}, peak bytes per rank {}\n",
                dag.to_text(),
                1e3 * p.step_seconds,
                p.bubble,
                1e3 * p.exposed_comm_seconds,
                peaks.join(" ")
            )
        }
        DagFormat::Dot => dag.to_dot(),
        DagFormat::Json => {
            let json = serde_json::json!({ "dag": dag, "prediction": p, "mfu": mfu });
            serde_json::to_string_pretty(&json)? + "\n"
        }
    };
    crate::cmd::emit(&text)
}

/// `plan --against FILE`: the strategy file's prediction beside the `best` candidate's, and by
/// how much the best is faster (or that the file's layout is the best). Errors: a strategy
/// that cannot be compiled, or whose world or global batch differs from the search's.
fn against(
    a: &PlanArgs,
    path: &std::path::Path,
    best: &Candidate,
    (ranks, memory): (usize, u64),
    (profile, hardware): (Option<&Profile>, Option<&Hardware>),
) -> Result<String> {
    let Compiled { config: c, prediction: p, .. } = compile_strategy(a, path, profile, hardware)?;
    let (world, batch) = (c.world(), c.microbatches * c.microbatch_size);
    if (world, batch) != (ranks, a.global_batch) {
        bail!(
            "--against {}: the strategy runs {world} ranks and {batch} sequences a step; the search \
             is for --ranks {ranks} and --global-batch {}",
            path.display(),
            a.global_batch
        );
    }
    let peak = p.peak_bytes.iter().copied().max().unwrap_or(0);
    let fits = if peak <= memory { "fits" } else { "does not fit" };
    let split =
        c.layers_per_stage.as_deref().map_or(String::new(), |l| format!(" (layers {})", layer_list(l)));
    let layout = format!(
        "{} pp {} × dp {}{} × tp {}{}, v {}{split}, m {}, B {}, recompute {}",
        c.kind.name(),
        c.ranks,
        c.dp,
        if c.fsdp { " (FSDP)" } else { "" },
        c.tp,
        if c.ep > 1 { format!(", ep {}", c.ep) } else { String::new() },
        c.stages_per_rank,
        c.microbatches,
        c.microbatch_size,
        c.recompute.name()
    );
    let faster = 1.0 - best.step_seconds / p.step_seconds;
    let verdict = if faster > 0.0 {
        format!(
            "the best strategy takes {:.1}% less time: step {} against {} ms, bubble {:.3} against {:.3}, exposed \
             communication {} against {} ms, peak {} against {}",
            100.0 * faster,
            milliseconds(best.step_seconds),
            milliseconds(p.step_seconds),
            best.bubble,
            p.bubble,
            milliseconds(best.exposed_comm_seconds),
            milliseconds(p.exposed_comm_seconds),
            mib(best.peak_bytes),
            mib(peak)
        )
    } else if peak > memory {
        format!(
            "it would take {:.1}% less time than the best strategy, but needs {} per rank, more than {}",
            100.0 * (1.0 - p.step_seconds / best.step_seconds),
            mib(peak),
            mib(memory)
        )
    } else {
        "no strategy of the search is predicted faster".to_string()
    };
    Ok(format!(
        "against {}: {layout}: step {} ms, bubble {:.3}, exposed communication {} ms, peak/rank {} ({fits}); {verdict}\n",
        path.display(),
        milliseconds(p.step_seconds),
        p.bubble,
        milliseconds(p.exposed_comm_seconds),
        mib(peak)
    ))
}

/// The cost rates a plan used and where they come from (a profile's fit, or assumed).
fn speed_text(a: &PlanArgs, req: &PlanRequest, profile: Option<&Profile>) -> String {
    let rates = format!(
        "{:.1} GFLOP/s of matmuls, {:.2} GB/s of other work, {} GB/s links",
        1e-9 / req.speed.seconds_per_flop,
        1e-9 / req.speed.seconds_per_byte,
        a.link_gbps
    );
    match (profile.filter(|p| p.speed().is_some()), &a.profile) {
        (Some(p), Some(path)) => {
            format!("{rates} (fitted to {}: model {}, {} steps)", path.display(), p.model, p.steps)
        }
        (None, Some(path)) => format!("{rates} (assumed: {} holds no measured step)", path.display()),
        _ => format!("{rates} (assumed; no --profile)"),
    }
}

/// Runs `graphpp plan`.
///
/// # Errors
/// A bad model, profile, strategy or request; no strategy fitting the memory per rank.
pub fn run(a: PlanArgs) -> Result<()> {
    if !(a.link_gbps.is_finite() && a.link_gbps > 0.0 && a.link_gbps <= 1e6) {
        bail!("--link-gbps {}: a bandwidth must be a number in (0, 1e6] GB/s", a.link_gbps);
    }
    let profile = a.profile.as_deref().map(Profile::load).transpose()?;
    if let Some(p) = profile.as_ref().filter(|p| p.model != a.model) {
        eprintln!(
            "warning: the profile is of model {}, the plan for {}: its speed may not carry over",
            p.model, a.model
        );
    }
    if let Some(p) = profile.as_ref().filter(|p| a.dtype.is_some_and(|d| d != p.dtype)) {
        eprintln!(
            "warning: the profile was measured in {}, the plan is for {}: its speed does not carry \
             over (profile a run with --dtype {} for this plan)",
            p.dtype,
            a.dtype.unwrap_or(p.dtype),
            a.dtype.unwrap_or(p.dtype)
        );
    }
    let hardware = a.hardware.as_deref().map(Hardware::load).transpose()?;
    if let Some(h) = hardware.as_ref().filter(|_| a.print_hardware) {
        return crate::cmd::emit(&h.to_toml());
    }
    if let Some(path) = &a.strategy {
        return compile(&a, path, profile.as_ref(), hardware.as_ref());
    }
    let memory = a.memory_per_rank.or(hardware.as_ref().map(|h| h.device.memory_bytes));
    let (Some(ranks), Some(memory_per_rank)) = (a.ranks, memory) else {
        bail!("give --ranks and --memory-per-rank (or --strategy)");
    };
    let model = crate::cmd::model::with_layers(crate::cmd::model::load_config(&a.model)?, a.layers)?;
    let dtype = compute_dtype(&a, profile.as_ref()).unwrap_or(graphpp_graph::DType::F32);
    let speed = match &hardware {
        Some(h) => h.speed(dtype),
        None => profile.as_ref().and_then(Profile::speed).unwrap_or_default(),
    };
    let req = PlanRequest {
        model,
        ranks,
        memory_per_rank,
        global_batch: a.global_batch,
        seq_len: a.seq_len,
        dtype,
        kinds: a.schedule.clone().unwrap_or_else(|| Kind::ALL.to_vec()),
        recompute: a.recompute.clone().unwrap_or_else(|| Recompute::ALL.to_vec()),
        max_microbatches: a.max_microbatches,
        pp: a.pp,
        tp: a.tp,
        ep: a.ep,
        microbatches: a.microbatches,
        speed,
        link_bytes_per_second: a.link_gbps * 1e9,
        hardware: hardware.clone(),
    };
    let all = plan(&req)?;
    let fitting = all.iter().filter(|c| c.fits).count();
    let speed = match &hardware {
        Some(h) => format!(
            "{} of matmuls ({}), {} of other work, links {} in a node of {} and {} between nodes ({})",
            rate(1.0 / req.speed.seconds_per_flop, "FLOP/s"),
            req.dtype,
            rate(1.0 / req.speed.seconds_per_byte, "B/s"),
            rate(h.intra_node.bandwidth, "B/s"),
            h.devices_per_node,
            rate(h.inter_node.bandwidth, "B/s"),
            h.name
        ),
        None => speed_text(&a, &req, profile.as_ref()),
    };
    let mut text = format!(
        "plan: model {}, {ranks} ranks, {} per rank, {} sequences of {} tokens per step; {} strategies, {} fit; costs: {speed}\n",
        a.model,
        mib(memory_per_rank),
        a.global_batch,
        a.seq_len,
        all.len(),
        fitting
    );
    text.push_str("  #  schedule              pp  dp fsdp  tp  ep  v    m    B  recompute     step (ms)   bubble  comm (ms)    MFU    peak/rank  fits\n");
    let per_token = graphpp_models::Model::flops_per_token(&req.model, req.seq_len);
    let tokens = req.global_batch * req.seq_len;
    for (i, c) in all.iter().take(a.top).enumerate() {
        let mfu = hardware.as_ref().map(|h| h.mfu(per_token, tokens, ranks, req.dtype, c.step_seconds));
        text.push_str(&row(i, c, mfu));
    }
    if all.is_empty() {
        bail!(
            "no candidate strategy for {ranks} ranks: every split the pins allow (--pp, --tp, --ep, \
             --microbatches) leaves a schedule kind with more stages than layers, a batch that does \
             not split over the replicas, or (with --ep) a data-parallel degree it does not divide \
             (try more --schedule kinds, fewer pins, another --ranks or --global-batch)"
        );
    }
    let Some(best) = all.first().filter(|c| c.fits) else {
        let least = all.iter().map(|c| c.peak_bytes).min();
        bail!(
            "no strategy fits {} per rank{}",
            mib(memory_per_rank),
            least.map_or(String::new(), |b| format!(" (the least memory any needs is {})", mib(b)))
        );
    };
    if let Some(path) = &a.against {
        let context = (profile.as_ref(), hardware.as_ref());
        text.push_str(&against(&a, path, best, (ranks, memory_per_rank), context)?);
    }
    let mut extra = a.layers.map_or(String::new(), |l| format!(" --layers {l}"));
    if req.dtype != graphpp_graph::DType::F32 {
        extra.push_str(&format!(" --dtype {}", req.dtype.name()));
    }
    let _ = writeln!(text, "best: graphpp train --model {}{extra} {}", a.model, best.train_flags(a.seq_len));
    crate::cmd::emit(&text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts_take_units() {
        assert_eq!(parse_bytes("1000"), Ok(1000));
        assert_eq!(parse_bytes("2MiB"), Ok(2 << 20));
        assert_eq!(parse_bytes("1.5 GB"), Ok(1_500_000_000));
        assert!(parse_bytes("12 parsecs").unwrap_err().contains("unknown unit"));
        assert!(parse_bytes("0").is_err());
        assert!(parse_bytes("-5MB").is_err());
        assert_eq!(parse_bytes("20mib"), Ok(20 << 20));
    }
}
