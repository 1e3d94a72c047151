//! `graphpp schedule …`: generate, validate, lower, simulate and compare schedules.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, Subcommand, ValueEnum};
use graphpp::profile::Profile;
use graphpp_schedule::compare::{chunk_cost_factor, scale_costs, schedule_chunk_factor};
use graphpp_schedule::generate::human_bytes;
use graphpp_schedule::render::{chrome_trace, figures, fixed, grid, svg, GridStyle};
use graphpp_schedule::simulate::simulate_with;
use graphpp_schedule::{
    generate, lower, simulate, validate, Costs, Kind, LowerOptions, Memory, Options, Schedule, Shape, Solver,
    SolverError, Summary, ValidateOptions,
};

use crate::cmd::value::count;

/// `graphpp schedule` subcommands.
#[derive(Subcommand)]
pub enum ScheduleCmd {
    /// Print the schedule of a named kind for a pipeline shape.
    Generate {
        #[command(flatten)]
        spec: KindSpec,
        #[command(flatten)]
        model: CostModel,
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
        #[command(flatten)]
        shape: Expected,
    },
    /// Lower a compute-only schedule file: add SEND/RECV (and FSDP actions); prints CSV.
    Lower {
        /// The schedule file.
        file: PathBuf,
        #[command(flatten)]
        shape: Expected,
        /// Add UNSHARD/RESHARD keeping at most N stages unsharded per rank, and REDUCE_GRAD.
        #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
        fsdp_max_unsharded: Option<usize>,
    },
    /// Simulate a generated or stored schedule: makespan, bubbles, peak activations, timeline.
    Simulate {
        #[command(flatten)]
        source: Source,
        #[command(flatten)]
        model: CostModel,
        /// Output format.
        #[arg(long, value_enum, default_value_t = SimFormat::Text)]
        format: SimFormat,
        /// Write to this file instead of standard output.
        #[arg(long)]
        output: Option<PathBuf>,
        /// A profile (`graphpp profile`) of a run with the same stages: each action takes its
        /// stage's measured time in ms (the F/B/I/W of --costs are then unused; its C, in ms,
        /// still adds to every hop), and the peak memory of every rank is given in bytes from
        /// the profile's byte model.
        #[arg(long, value_name = "FILE")]
        profile: Option<PathBuf>,
    },
    /// One table over every schedule kind for one shape: bubble, peak activations, messages.
    Compare {
        /// p: ranks in the pipeline.
        #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
        ranks: usize,
        /// m: microbatches per step.
        #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
        microbatches: usize,
        #[command(flatten)]
        model: CostModel,
    },
}

/// The cost and memory model: what the simulator charges, and what the cost- and memory-aware
/// generators (zb-auto, zbv-auto) build for.
#[derive(Args, Clone)]
pub struct CostModel {
    /// Action costs, e.g. `F=1,B=2,I=1,W=1` (B = I + W: two of them give the third, B alone is
    /// split evenly; OVERLAP defaults to F+B).
    #[arg(long, default_value = "F=1,B=2,I=1,W=1")]
    costs: Costs,
    /// Latency c of one cross-rank hop, in cost units (overrides `C=` in --costs; default 0).
    #[arg(long, allow_hyphen_values = true)]
    comm_latency: Option<f64>,
    /// M_W as a fraction of M_B (activation still held between I and W).
    #[arg(long, default_value_t = 0.5, allow_hyphen_values = true)]
    m_w: f64,
}

impl CostModel {
    /// The costs (with --comm-latency applied) and the memory model (M_B = 1).
    fn resolve(&self) -> Result<(Costs, Memory)> {
        let costs = match self.comm_latency {
            Some(c) => self.costs.with_comm_latency("--comm-latency", c)?,
            None => self.costs,
        };
        let memory = Memory::with_m_w(self.m_w)
            .ok_or_else(|| anyhow!("--m-w must be within [0, 1] (got {})", self.m_w))?;
        Ok((costs, memory))
    }
}

/// The shape a schedule file is meant to have; each one given is checked.
#[derive(Args, Clone, Copy)]
pub struct Expected {
    /// Expected p: this many ranks, each running a compute action (without it, a rank with
    /// none is a warning).
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    ranks: Option<usize>,
    /// Expected S: the stages the compute actions name.
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    stages: Option<usize>,
    /// Expected m (default: inferred from the actions).
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    microbatches: Option<usize>,
}

impl Expected {
    fn options(self) -> Result<ValidateOptions> {
        for (v, flag) in
            [(self.ranks, "--ranks"), (self.stages, "--stages"), (self.microbatches, "--microbatches")]
        {
            if v == Some(0) {
                bail!("{flag} must be at least 1");
            }
        }
        Ok(ValidateOptions { microbatches: self.microbatches, ranks: self.ranks, stages: self.stages })
    }
}

/// A named kind and shape.
#[derive(Args, Clone)]
pub struct KindSpec {
    /// Schedule kind (gpipe, 1f1b, interleaved-1f1b, looped-bfs, grouped-interleaved, zb-h1, zb-h2,
    /// zb-auto, zbv, zbv-auto, v-half, v-min, interleaved-zb, dualpipe, dualpipev; PyTorch class
    /// names accepted). The
    /// same flag as `train --schedule` (`--kind` is accepted too).
    #[arg(long = "schedule", alias = "kind", value_name = "KIND")]
    pub kind: Kind,
    /// p: ranks in the pipeline.
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    pub ranks: usize,
    /// v: stages per rank (default: 2 for interleaved kinds and the V kinds (ZB-V, V-Half, V-Min,
    /// DualPipe(V)), else 1).
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    pub stages_per_rank: Option<usize>,
    /// m: microbatches per step.
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    pub microbatches: usize,
    /// grouped-interleaved: consecutive microbatches per chunk (default p).
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    pub group: Option<usize>,
    /// zb-auto, zbv-auto: activation-memory cap per rank in M_B units (default p).
    #[arg(long, allow_hyphen_values = true)]
    pub mem_cap: Option<f64>,
    #[command(flatten)]
    pub solver: SolverArgs,
}

/// How `zb-auto` finds its order.
#[derive(Args, Clone)]
pub struct SolverArgs {
    /// zb-auto: `heuristic` (the zero-bubble paper's, milliseconds) or `ilp` (the paper's integer
    /// program, solved by HiGHS from the heuristic's schedule: never slower; needs a build with
    /// `--features ilp`).
    #[arg(long, value_enum)]
    solver: Option<SolverName>,
    /// With --solver ilp: wall-clock seconds HiGHS may search (default 10).
    #[arg(long, allow_hyphen_values = true, value_name = "SECONDS")]
    time_limit: Option<f64>,
}

/// `--solver` values.
#[derive(Clone, Copy, ValueEnum)]
enum SolverName {
    Heuristic,
    Ilp,
}

impl SolverArgs {
    /// The generator's solver.
    ///
    /// # Errors
    /// A time limit that is not a finite number of seconds > 0, or one given to the heuristic.
    fn resolve(&self) -> Result<Solver> {
        let ilp = matches!(self.solver, Some(SolverName::Ilp));
        Solver::new(ilp, self.time_limit).map_err(|e| match e {
            SolverError::TimeLimitWithHeuristic => anyhow!("--time-limit applies to --solver ilp only"),
            SolverError::TimeLimit(secs) => {
                anyhow!("--time-limit must be a number of seconds in (0, 1e6], got {secs}")
            }
        })
    }
}

/// Where a schedule comes from: a generator, or a CSV/JSON file.
#[derive(Args, Clone)]
pub struct Source {
    /// Schedule kind to generate (see `generate --help`); needs --ranks and --microbatches
    /// (`--kind` is accepted too).
    #[arg(long = "schedule", alias = "kind", value_name = "KIND")]
    kind: Option<Kind>,
    /// A schedule file: CSV (one row per rank) or JSON (`{"ranks": [[…]]}`).
    #[arg(long, conflicts_with = "kind")]
    file: Option<PathBuf>,
    /// p (with --schedule; with --file, the expected number of ranks, each running a compute action).
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    ranks: Option<usize>,
    /// v (with --schedule).
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>, conflicts_with = "file")]
    stages_per_rank: Option<usize>,
    /// S, the expected number of stages (with --file).
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>, conflicts_with = "kind")]
    stages: Option<usize>,
    /// m (with --schedule; with --file, the expected number of microbatches).
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    microbatches: Option<usize>,
    /// grouped-interleaved: microbatches per chunk group.
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    group: Option<usize>,
    /// zb-auto, zbv-auto: memory cap in M_B units.
    #[arg(long, allow_hyphen_values = true)]
    mem_cap: Option<f64>,
    #[command(flatten)]
    solver: SolverArgs,
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

#[allow(clippy::too_many_arguments)]
fn generate_spec(
    kind: Kind,
    ranks: usize,
    v: Option<usize>,
    m: usize,
    group: Option<usize>,
    mem_cap: Option<f64>,
    solver: &SolverArgs,
    costs: Costs,
    memory: Memory,
) -> Result<Schedule> {
    let shape = Shape::new(ranks, v.unwrap_or_else(|| kind.default_stages_per_rank()), m);
    let opts = Options { group, mem_cap, costs, memory, solver: solver.resolve()? };
    Ok(generate(kind, &shape, &opts)?)
}

/// Reads a CSV or JSON schedule file ([`Schedule::parse`]: JSON when the first non-blank character
/// is `{` or `[`) and validates it against the expected shape: every command that reads a
/// schedule file checks it the same way first. Ranks without a compute action are a warning on
/// standard error when no rank count is expected.
pub fn read_schedule(path: &Path, expected: &ValidateOptions) -> Result<(Schedule, Summary)> {
    let text =
        graphpp::textfile::read_text(path).with_context(|| format!("cannot read {}", path.display()))?;
    let s = Schedule::parse(&text).with_context(|| path.display().to_string())?;
    let summary = validate(&s, expected).with_context(|| format!("{}: invalid schedule", path.display()))?;
    for r in &summary.idle_ranks {
        eprintln!(
            "warning: {}: rank {r} has no compute action (give --ranks to make this an error)",
            path.display()
        );
    }
    Ok((s, summary))
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

/// Runs one `graphpp schedule` subcommand.
pub fn run(cmd: ScheduleCmd) -> Result<()> {
    match cmd {
        ScheduleCmd::Generate { spec, model, lowered, fsdp_max_unsharded, format } => {
            let (costs, memory) = model.resolve()?;
            let mut s = generate_spec(
                spec.kind,
                spec.ranks,
                spec.stages_per_rank,
                spec.microbatches,
                spec.group,
                spec.mem_cap,
                &spec.solver,
                costs,
                memory,
            )?;
            if lowered {
                s = lower(&s, &LowerOptions { fsdp_max_unsharded, ..Default::default() })?;
            } else if fsdp_max_unsharded.is_some() {
                bail!("--fsdp-max-unsharded needs --lowered");
            }
            crate::cmd::emit(&format_schedule(&s, format))
        }
        ScheduleCmd::Validate { file, shape } => {
            let (_, summary) = read_schedule(&file, &shape.options()?)?;
            crate::cmd::emit(&format!("{}: {summary}\n", file.display()))
        }
        ScheduleCmd::Lower { file, shape, fsdp_max_unsharded } => {
            let (s, _) = read_schedule(&file, &shape.options()?)?;
            crate::cmd::emit(&lower(&s, &LowerOptions { fsdp_max_unsharded, ..Default::default() })?.to_csv())
        }
        ScheduleCmd::Simulate { source, model, format, output, profile } => {
            simulate_cmd(&source, &model, format, output.as_deref(), profile.as_deref())
        }
        ScheduleCmd::Compare { ranks, microbatches, model } => {
            if ranks == 0 || microbatches == 0 {
                bail!("--ranks and --microbatches must be at least 1 (got {ranks} and {microbatches})");
            }
            let (costs, memory) = model.resolve()?;
            crate::cmd::emit(&crate::cmd::compare::table(ranks, microbatches, &costs, &memory)?)
        }
    }
}

/// The schedule `graphpp schedule simulate` runs: `--schedule`'s generated one, or `--file`
/// read and validated against the shape given.
fn simulated_schedule(source: &Source, costs: Costs, memory: Memory) -> Result<Schedule> {
    Ok(match (&source.kind, &source.file) {
        (Some(k), _) => {
            let (Some(ranks), Some(m)) = (source.ranks, source.microbatches) else {
                bail!("--schedule needs --ranks and --microbatches");
            };
            let (v, group, cap) = (source.stages_per_rank, source.group, source.mem_cap);
            generate_spec(*k, ranks, v, m, group, cap, &source.solver, costs, memory)?
        }
        (None, Some(f)) => {
            if source.group.is_some() || source.mem_cap.is_some() || source.solver.solver.is_some() {
                bail!("--group, --mem-cap and --solver apply to --schedule, not to a schedule --file");
            }
            let expected =
                Expected { ranks: source.ranks, stages: source.stages, microbatches: source.microbatches };
            read_schedule(f, &expected.options()?)?.0
        }
        (None, None) => bail!("give --schedule (with --ranks and --microbatches) or --file"),
    })
}

/// Runs `graphpp schedule simulate`: the schedule under the cost model (or a profile's
/// measured times), printed as text, JSON, SVG or a Chrome trace.
fn simulate_cmd(
    source: &Source,
    model: &CostModel,
    format: SimFormat,
    output: Option<&Path>,
    profile: Option<&Path>,
) -> Result<()> {
    let (stage_costs, memory) = model.resolve()?;
    // The costs are a whole stage's, as `schedule compare` takes them: each of a rank's v chunks
    // runs at chunk_cost_factor of them, so every kind does the same work per rank.
    let generating = source.kind.map_or(1.0, |k| {
        chunk_cost_factor(k, source.stages_per_rank.unwrap_or_else(|| k.default_stages_per_rank()))
    });
    let s = simulated_schedule(source, scale_costs(&stage_costs, generating), memory)?;
    let factor = schedule_chunk_factor(source.kind, &s);
    let costs = scale_costs(&stage_costs, factor);
    let profiled = profile.map(Profile::load).transpose()?;
    let (report, peak_bytes) = match &profiled {
        Some(p) => {
            let path = profile.unwrap_or(Path::new(""));
            p.check(&s, source.kind).with_context(|| format!("--profile {}", path.display()))?;
            let r = simulate_with(&s, |a| 1e3 * p.duration(a), costs.comm, &memory)?;
            (r, Some(p.bytes.peak_bytes(&s)?))
        }
        None => (simulate(&s, &costs, &memory)?, None),
    };
    let text = match format {
        SimFormat::Text => {
            let style = GridStyle {
                color: output.is_none() && std::io::stdout().is_terminal(),
                ..GridStyle::default()
            };
            let bytes = peak_bytes.as_ref().map_or(String::new(), |b| {
                let each: Vec<String> = b.iter().map(|&x| human_bytes(u128::from(x))).collect();
                format!("peak memory         {} (bytes, from the profile; times in ms)\n", each.join(" "))
            });
            let convention = match (&profiled, factor < 1.0) {
                (Some(_), _) => String::new(),
                (None, true) => format!(
                    "costs               per whole stage ({}); each chunk runs at {} of them, as in `schedule compare`\n",
                    stage_costs,
                    fixed(factor, 3)
                ),
                (None, false) => format!("costs               per whole stage ({})\n", stage_costs),
            };
            format!("{convention}{}{bytes}\n{}", figures(&report), grid(&report.timeline, &style))
        }
        SimFormat::Json => {
            let value = match &peak_bytes {
                Some(b) => serde_json::json!({ "report": &report, "peak_bytes": b }),
                None => serde_json::to_value(&report)?,
            };
            serde_json::to_string_pretty(&value)? + "\n"
        }
        SimFormat::Svg => svg(&report.timeline),
        SimFormat::Chrome => chrome_trace(&report.timeline),
    };
    write_out(output, &text)
}
