//! `graphpp schedule …`: generate, validate, lower, simulate and compare schedules.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand, ValueEnum};
use graphpp_schedule::render::{chrome_trace, fixed, grid, svg, GridStyle};
use graphpp_schedule::{
    generate, lower, simulate, validate, Costs, Kind, LowerOptions, Memory, Options, Schedule, Shape,
    SimReport, ValidateOptions,
};

use crate::cmd::value::count;

/// `graphpp schedule` subcommands.
#[derive(Subcommand)]
pub enum ScheduleCmd {
    /// Print the schedule of a named kind for a pipeline shape.
    Generate {
        #[command(flatten)]
        spec: KindSpec,
        /// Add SEND/RECV (and with --fsdp-max-unsharded, FSDP actions) before printing.
        #[arg(long)]
        lowered: bool,
        /// With --lowered: add UNSHARD/RESHARD keeping at most N stages unsharded per rank, and
        /// REDUCE_GRAD after each stage's last backward.
        #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
        fsdp_max_unsharded: Option<usize>,
        /// Output format.
        #[arg(long, value_enum, default_value_t = ScheduleFormat::Text)]
        format: ScheduleFormat,
    },
    /// Check a schedule file (CSV or JSON): exit 0 with a one-line summary, or exit 1 with the error.
    Validate {
        /// The schedule file.
        file: PathBuf,
        /// Expected number of microbatches (default: inferred from the actions).
        #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
        microbatches: Option<usize>,
    },
    /// Lower a compute-only schedule file: add SEND/RECV (and FSDP actions); prints CSV.
    Lower {
        /// The schedule file.
        file: PathBuf,
        /// Add UNSHARD/RESHARD keeping at most N stages unsharded per rank, and REDUCE_GRAD.
        #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
        fsdp_max_unsharded: Option<usize>,
    },
    /// Simulate a generated or stored schedule: makespan, bubbles, peak activations, timeline.
    Simulate {
        #[command(flatten)]
        source: Source,
        /// Action costs, e.g. `F=1,B=2,I=1,W=1` (a missing B is I+W; OVERLAP defaults to F+B).
        #[arg(long, default_value = "F=1,B=2,I=1,W=1")]
        costs: Costs,
        /// Latency c of one cross-rank hop, in cost units (overrides `C=` in --costs; default 0).
        #[arg(long, allow_hyphen_values = true)]
        comm_latency: Option<f64>,
        /// M_W as a fraction of M_B (activation still held between I and W).
        #[arg(long, default_value_t = 0.5, allow_hyphen_values = true)]
        m_w: f64,
        /// Output format.
        #[arg(long, value_enum, default_value_t = SimFormat::Text)]
        format: SimFormat,
        /// Write to this file instead of standard output.
        #[arg(long)]
        output: Option<PathBuf>,
    },
    /// One table over every schedule kind for one shape: bubble, peak activations, messages.
    Compare {
        /// p: ranks in the pipeline.
        #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
        ranks: usize,
        /// m: microbatches per step.
        #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
        microbatches: usize,
        /// Action costs, e.g. `F=1,B=2,I=1,W=1`.
        #[arg(long, default_value = "F=1,B=2,I=1,W=1")]
        costs: Costs,
        /// Latency c of one cross-rank hop (overrides `C=` in --costs; default 0).
        #[arg(long, allow_hyphen_values = true)]
        comm_latency: Option<f64>,
    },
}

/// A named kind and shape.
#[derive(Args, Clone)]
pub struct KindSpec {
    /// Schedule kind (gpipe, 1f1b, interleaved-1f1b, looped-bfs, grouped-interleaved, zb-h1, zb-h2,
    /// zb-auto, zbv, interleaved-zb, dualpipe, dualpipev; PyTorch class names accepted).
    #[arg(long)]
    pub kind: Kind,
    /// p: ranks in the pipeline.
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    pub ranks: usize,
    /// v: stages per rank (default: 2 for interleaved kinds, ZB-V and DualPipe(V), else 1).
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    pub stages_per_rank: Option<usize>,
    /// m: microbatches per step.
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    pub microbatches: usize,
    /// grouped-interleaved: consecutive microbatches per chunk (default p).
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    pub group: Option<usize>,
    /// zb-auto: activation-memory cap per rank in M_B units (default p).
    #[arg(long, allow_hyphen_values = true)]
    pub mem_cap: Option<f64>,
}

/// Where a schedule comes from: a generator, or a CSV/JSON file.
#[derive(Args, Clone)]
pub struct Source {
    /// Schedule kind to generate (see `generate --help`); needs --ranks and --microbatches.
    #[arg(long)]
    kind: Option<Kind>,
    /// A schedule file: CSV (one row per rank) or JSON (`{"ranks": [[…]]}`).
    #[arg(long, conflicts_with = "kind")]
    file: Option<PathBuf>,
    /// p (with --kind).
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    ranks: Option<usize>,
    /// v (with --kind).
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    stages_per_rank: Option<usize>,
    /// m (with --kind).
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    microbatches: Option<usize>,
    /// grouped-interleaved: microbatches per chunk group.
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    group: Option<usize>,
    /// zb-auto: memory cap in M_B units.
    #[arg(long, allow_hyphen_values = true)]
    mem_cap: Option<f64>,
}

/// Schedule output formats.
#[derive(Clone, Copy, ValueEnum)]
pub enum ScheduleFormat {
    /// One line per rank, `.` for idle steps.
    Text,
    /// One row per rank, empty cell for idle steps.
    Csv,
    /// `{"ranks": [["0F0", null, …], …]}`.
    Json,
}

/// Simulation output formats.
#[derive(Clone, Copy, ValueEnum)]
pub enum SimFormat {
    /// Figures and a terminal timeline grid.
    Text,
    /// The figures as JSON.
    Json,
    /// An SVG timeline.
    Svg,
    /// A Chrome trace (Perfetto, chrome://tracing).
    Chrome,
}

fn generate_spec(
    kind: Kind,
    ranks: usize,
    v: Option<usize>,
    m: usize,
    group: Option<usize>,
    mem_cap: Option<f64>,
    costs: Costs,
) -> Result<Schedule> {
    let shape = Shape::new(ranks, v.unwrap_or_else(|| kind.default_stages_per_rank()), m);
    let opts = Options { group, mem_cap, costs, ..Options::default() };
    Ok(generate(kind, &shape, &opts)?)
}

/// Reads a CSV or JSON schedule file ([`Schedule::parse`]: JSON when the first non-blank character
/// is `{` or `[`).
pub fn read_schedule(path: &Path) -> Result<Schedule> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    Schedule::parse(&text).with_context(|| path.display().to_string())
}

fn write_out(output: Option<&Path>, text: &str) -> Result<()> {
    match output {
        Some(p) => std::fs::write(p, text).with_context(|| format!("cannot write {}", p.display())),
        None => crate::cmd::emit(text),
    }
}

fn format_schedule(s: &Schedule, format: ScheduleFormat) -> String {
    match format {
        ScheduleFormat::Text => s.to_string(),
        ScheduleFormat::Csv => s.to_csv(),
        ScheduleFormat::Json => s.to_json() + "\n",
    }
}

/// The figures block of `simulate --format text`.
pub fn summary(r: &SimReport) -> String {
    let fmt = |v: &[f64]| v.iter().map(|&x| fixed(x, 3)).collect::<Vec<_>>().join(" ");
    format!(
        "makespan            {}\n\
         bubble (in-iteration) r_bubble = {:.4}, idle fraction = {:.2}%\n\
         bubble (steady-state) r_bubble = {:.4}\n\
         busy per rank       {}\n\
         idle per rank       {}\n\
         peak activations    {} (M_B units)\n",
        fixed(r.makespan, 3),
        r.bubble_ratio,
        r.idle_fraction * 100.0,
        r.steady_bubble_ratio,
        fmt(&r.busy),
        fmt(&r.idle),
        fmt(&r.peak_activations),
    )
}

/// Runs one `graphpp schedule` subcommand.
pub fn run(cmd: ScheduleCmd) -> Result<()> {
    match cmd {
        ScheduleCmd::Generate { spec, lowered, fsdp_max_unsharded, format } => {
            let mut s = generate_spec(
                spec.kind,
                spec.ranks,
                spec.stages_per_rank,
                spec.microbatches,
                spec.group,
                spec.mem_cap,
                Costs::default(),
            )?;
            if lowered {
                s = lower(&s, &LowerOptions { fsdp_max_unsharded, ..Default::default() })?;
            } else if fsdp_max_unsharded.is_some() {
                bail!("--fsdp-max-unsharded needs --lowered");
            }
            crate::cmd::emit(&format_schedule(&s, format))
        }
        ScheduleCmd::Validate { file, microbatches } => {
            if microbatches == Some(0) {
                bail!("--microbatches must be at least 1");
            }
            let s = read_schedule(&file)?;
            let summary = validate(&s, &ValidateOptions { microbatches, ..Default::default() })
                .with_context(|| format!("{}: invalid schedule", file.display()))?;
            crate::cmd::emit(&format!("{}: {summary}\n", file.display()))
        }
        ScheduleCmd::Lower { file, fsdp_max_unsharded } => {
            let s = read_schedule(&file)?;
            validate(&s, &ValidateOptions::default())
                .with_context(|| format!("{}: invalid schedule", file.display()))?;
            crate::cmd::emit(&lower(&s, &LowerOptions { fsdp_max_unsharded, ..Default::default() })?.to_csv())
        }
        ScheduleCmd::Simulate { source, mut costs, comm_latency, m_w, format, output } => {
            if let Some(c) = comm_latency {
                costs = costs.with_comm_latency("--comm-latency", c)?;
            }
            if !(0.0..=1.0).contains(&m_w) {
                bail!("--m-w must be within [0, 1] (got {m_w})");
            }
            let s = match (&source.kind, &source.file) {
                (Some(k), _) => {
                    let (Some(ranks), Some(m)) = (source.ranks, source.microbatches) else {
                        bail!("--kind needs --ranks and --microbatches");
                    };
                    generate_spec(*k, ranks, source.stages_per_rank, m, source.group, source.mem_cap, costs)?
                }
                (None, Some(f)) => read_schedule(f)?,
                (None, None) => bail!("give --kind (with --ranks and --microbatches) or --file"),
            };
            let report = simulate(&s, &costs, &Memory { m_b: 1.0, m_w })?;
            let text = match format {
                SimFormat::Text => {
                    let style = GridStyle {
                        color: output.is_none() && std::io::stdout().is_terminal(),
                        ..GridStyle::default()
                    };
                    format!("{}\n{}", summary(&report), grid(&report.timeline, &style))
                }
                SimFormat::Json => serde_json::to_string_pretty(&report)? + "\n",
                SimFormat::Svg => svg(&report.timeline),
                SimFormat::Chrome => chrome_trace(&report.timeline),
            };
            write_out(output.as_deref(), &text)
        }
        ScheduleCmd::Compare { ranks, microbatches, mut costs, comm_latency } => {
            if ranks == 0 || microbatches == 0 {
                bail!("--ranks and --microbatches must be at least 1 (got {ranks} and {microbatches})");
            }
            if let Some(c) = comm_latency {
                costs = costs.with_comm_latency("--comm-latency", c)?;
            }
            crate::cmd::emit(&crate::cmd::compare::table(ranks, microbatches, &costs)?)
        }
    }
}
