//! The `graphpp` binary: a thin command-line layer over the graphpp crates.

use clap::error::ErrorKind;
use clap::{Parser, Subcommand};

mod cmd;

/// Tensors come from mimalloc (`graphpp_runtime::malloc` says why, with figures).
#[global_allocator]
static ALLOCATOR: graphpp_runtime::malloc::MiMalloc = graphpp_runtime::malloc::MiMalloc;

/// graphpp: graph-based pipeline-parallel training.
#[derive(Parser)]
#[command(name = "graphpp", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate, check, lower, simulate and compare pipeline schedules.
    #[command(subcommand)]
    Schedule(cmd::schedule::ScheduleCmd),
    /// Show a model stage's graphs (fw, full_bw, bw_di, bw_dw, overlap) and their statistics.
    Graph(cmd::graph::GraphArgs),
    /// Train a model on text under a pipeline schedule (ranks as threads of this process, or one process each under mpirun).
    Train(Box<cmd::train::TrainArgs>),
    /// Run one step pipelined and on one device; compare losses and gradients (exit 1 above tolerance).
    Verify(cmd::verify::VerifyArgs),
    /// Run a few training steps (the train flags) and write their per-stage times and memory as a
    /// profile (JSON) for `schedule simulate --profile` and `plan --profile`.
    Profile(Box<cmd::profile::ProfileArgs>),
    /// Find the best strategy for a model on N ranks under a memory cap: every feasible schedule,
    /// pp × dp × tp, microbatch count and recompute policy, simulated and ranked.
    Plan(cmd::plan::PlanArgs),
    /// Write a training checkpoint as a Hugging Face model folder (config.json and
    /// model.safetensors), for `from_pretrained` and `--init-from`.
    Export(cmd::export::ExportArgs),
    /// Cluster descriptions for `plan --hardware`: measure this machine, or print a preset.
    Hardware(cmd::hardware::HardwareArgs),
}

fn main() {
    let cli = Cli::try_parse().unwrap_or_else(|e| exit_for(e));
    let result = match cli.command {
        Command::Schedule(c) => cmd::schedule::run(c),
        Command::Graph(a) => cmd::graph::run(a),
        Command::Verify(a) => cmd::verify::run(a),
        Command::Train(a) => cmd::train::run(*a),
        Command::Profile(a) => cmd::profile::run(*a),
        Command::Plan(a) => cmd::plan::run(a),
        Command::Export(a) => cmd::export::run(a),
        Command::Hardware(a) => cmd::hardware::run(a),
    };
    if let Err(e) = result {
        if let Some(stopped) = e.downcast_ref::<graphpp::stop::Interrupted>() {
            // The leader reports what was saved; the other ranks of a run say nothing.
            if !cmd::is_quiet() {
                cmd::report(&stopped.to_string());
            }
            std::process::exit(stopped.signal.exit_status());
        }
        // A rank of a multi-process run wrote its error before it stopped the others.
        if e.downcast_ref::<cmd::Reported>().is_none() {
            cmd::report(&cmd::error_line(&e));
        }
        std::process::exit(1);
    }
}

/// Prints clap's error and exits: status 1 when a value graphpp parses was rejected (`--ranks -1`,
/// `--schedule nope`, `--costs F=1,F=2`: an input graphpp rejects, and the message names the flag and
/// the problem), else clap's own status (2 for a malformed command line, 0 for `--help`).
fn exit_for(e: clap::Error) -> ! {
    let code = if e.kind() == ErrorKind::ValueValidation { 1 } else { e.exit_code() };
    let _ = e.print();
    std::process::exit(code)
}
