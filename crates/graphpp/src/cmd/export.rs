//! `graphpp export`: a training checkpoint as a Hugging Face model folder
//! ([`graphpp::export`]).

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

/// `graphpp export CHECKPOINT --output DIR`.
#[derive(Args, Debug)]
pub struct ExportArgs {
    /// A checkpoint: its sidecar (`step-000100.json`) or a `--checkpoint-dir` folder (its
    /// newest checkpoint that loads).
    checkpoint: PathBuf,
    /// The Hugging Face model folder to write (created; it must not hold a model yet).
    #[arg(long)]
    output: PathBuf,
}

/// Runs `graphpp export`.
///
/// # Errors
/// Those of [`graphpp::export::export_hf`].
pub fn run(a: ExportArgs) -> Result<()> {
    let e = graphpp::export::export_hf(&a.checkpoint, &a.output)?;
    crate::cmd::emit(&format!(
        "exported {} (step {}): {} tensors, {} parameters, to {} (config.json, model.safetensors)\n",
        e.checkpoint.display(),
        e.step,
        e.tensors,
        e.parameters,
        a.output.display()
    ))
}
