//! `graphpp profile`: a few steps of a training run (the `train` flags), then a profile of them —
//! per-stage F/B/I/W/OVERLAP_F_B times, the byte model of the stage graphs and the measured peak
//! bytes per rank — as JSON ([`graphpp::profile::Profile`]).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use crate::cmd::train::TrainArgs;

/// Arguments of `graphpp profile`: those of `graphpp train`, the profile's path and length.
#[derive(Args)]
pub struct ProfileArgs {
    #[command(flatten)]
    train: TrainArgs,
    /// Write the profile (JSON) here.
    #[arg(long, value_name = "FILE")]
    output: PathBuf,
    /// Steps to run; the times are means over all but the first (its warm-up).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..))]
    profile_steps: u64,
}

/// Runs `graphpp profile`.
///
/// # Errors
/// As `graphpp train`; the profile cannot be written.
pub fn run(a: ProfileArgs) -> Result<()> {
    crate::cmd::train::profile(a.train, a.profile_steps, a.output)
}
