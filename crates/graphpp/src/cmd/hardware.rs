//! `graphpp hardware`: cluster descriptions for `plan --hardware` ([`graphpp::hardware`]).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};

/// `graphpp hardware …`.
#[derive(Args, Debug)]
pub struct HardwareArgs {
    #[command(subcommand)]
    command: HardwareCommand,
}

#[derive(Subcommand, Debug)]
enum HardwareCommand {
    /// Measure this machine (each core a device: matmul FLOP/s in f32 and bf16, the bytes per
    /// second of elementwise work, the threads communicator's bandwidth and latency) and write
    /// it as a TOML file for `plan --hardware`.
    Probe {
        /// The TOML file to write.
        #[arg(long)]
        output: PathBuf,
    },
    /// Print a preset (h100-sxm, h200-sxm) or a file as TOML.
    Show {
        /// A preset name or a TOML file.
        hardware: String,
    },
}

/// Runs `graphpp hardware`.
///
/// # Errors
/// A measurement, an unknown preset or an unreadable file; the output file cannot be written.
pub fn run(a: HardwareArgs) -> Result<()> {
    match a.command {
        HardwareCommand::Probe { output } => {
            // Before seconds of measuring.
            crate::cmd::train::check_output_file("--output", &output)?;
            // One intra-op thread per core-rank, as a training run of that many ranks uses.
            let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
            crate::cmd::set_op_threads(cores, None);
            let p = graphpp::hardware::probe().map_err(|e| anyhow::anyhow!("hardware probe: {e}"))?;
            graphpp::checkpoint::write_file_atomic(&output, p.hardware.to_toml().as_bytes())
                .with_context(|| format!("--output {}", output.display()))?;
            let d = &p.hardware.device;
            crate::cmd::emit(&format!(
                "probed in {:.1} s: {:.1} GFLOP/s f32, {:.1} GFLOP/s bf16 matmuls, {:.2} GB/s elementwise, \
                 links {:.2} GB/s and {:.1} µs, {} devices (cores): {}\n",
                p.seconds,
                d.flops_f32 / 1e9,
                d.flops_bf16 / 1e9,
                d.memory_bandwidth / 1e9,
                p.hardware.intra_node.bandwidth / 1e9,
                p.hardware.intra_node.latency_us,
                p.hardware.devices_per_node,
                output.display()
            ))
        }
        HardwareCommand::Show { hardware } => {
            crate::cmd::emit(&graphpp::hardware::Hardware::load(&hardware)?.to_toml())
        }
    }
}
