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
    /// second of elementwise work, the threads communicator's bandwidth and latency; under
    /// `mpirun`, the MPI link between ranks 0 and 1) and write it as a TOML file for
    /// `plan --hardware`.
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
        HardwareCommand::Probe { output } => crate::cmd::launch(|_| false, |launch| probe(launch, &output)),
        HardwareCommand::Show { hardware } => {
            crate::cmd::emit(&graphpp::hardware::Hardware::load(&hardware)?.to_toml())
        }
    }
}

/// `graphpp hardware probe --output FILE`: this machine into FILE (under `mpirun`, ranks 0 and 1
/// measure the MPI link between them first — the network's where rank 1 is the first process of
/// another host, else the processes' link in one host — and rank 0 alone the rest).
fn probe(launch: &graphpp::launch::Launch, output: &std::path::Path) -> Result<()> {
    // Before seconds of measuring; the leader alone writes it.
    if launch.is_leader() {
        crate::cmd::train::check_output_file("--output", output)?;
    }
    let process_link = match launch.comm() {
        Some(c) => graphpp::hardware::probe_process_link(&*c, graphpp::launch::local_rank())
            .map_err(|e| anyhow::anyhow!("hardware probe: MPI link: {e}"))?,
        None => None,
    };
    if !launch.is_leader() {
        return Ok(());
    }
    // One intra-op thread per core-rank, as a training run of that many ranks uses.
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    crate::cmd::set_op_threads(cores, None);
    let mut p = graphpp::hardware::probe().map_err(|e| anyhow::anyhow!("hardware probe: {e}"))?;
    let threads = p.hardware.intra_node;
    let mpi = process_link.map_or(String::new(), |measured| {
        let (link, across) = (measured.link, measured.across_hosts);
        let h = &mut p.hardware;
        h.inter_node = link;
        if !across {
            h.intra_node = link;
        }
        let which = if across { "inter_node" } else { "intra_node and inter_node" };
        h.source
            .push_str(&format!("; {which} measured over MPI between ranks 0 and 1 of {}", launch.world()));
        format!(
            "; MPI between ranks 0 and 1: {:.2} GB/s and {:.1} µs ({which})",
            link.bandwidth / 1e9,
            link.latency_us
        )
    });
    graphpp::checkpoint::write_file_atomic(output, p.hardware.to_toml().as_bytes())
        .with_context(|| format!("--output {}", output.display()))?;
    let d = &p.hardware.device;
    crate::cmd::emit(&format!(
        "probed in {:.1} s: {:.1} GFLOP/s f32, {:.1} GFLOP/s bf16 matmuls, {:.2} GB/s elementwise, \
         threads' links {:.2} GB/s and {:.1} µs{mpi}, {} devices (cores): {}\n",
        p.seconds,
        d.flops_f32 / 1e9,
        d.flops_bf16 / 1e9,
        d.memory_bandwidth / 1e9,
        threads.bandwidth / 1e9,
        threads.latency_us,
        p.hardware.devices_per_node,
        output.display()
    ))
}
