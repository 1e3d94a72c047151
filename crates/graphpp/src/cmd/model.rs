//! The model flags: which model a command builds (`--model`, a preset or a config file), its
//! decoder layers (`--layers`) and, for `train` and `verify`, a Hugging Face folder to start from
//! (`--init-from`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle_core::Tensor;
use clap::Args;
use graphpp_models::ModelConfig;

use crate::cmd::value::count;

/// `--model`, `--layers` and `--init-from` of `train` and `verify`.
#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model: a preset (`tiny`, `small`, `moe-tiny`, `moe-small`, `moe-mla-tiny`,
    /// `moe-mla-tiny-mtp` (with multi-token prediction), `moe-mla-small`, `deepseek-v3-16b`) or a
    /// JSON config file with Hugging Face field names (DeepSeek-V2/V3 MoE
    /// fields make it a MoE model; MLA fields or a DeepSeek model_type, multi-head latent attention).
    #[arg(long, default_value = "tiny")]
    pub model: String,
    /// Override the model's number of decoder layers (it must be at least the model stages).
    #[arg(long, allow_hyphen_values = true, value_parser = count::<usize>)]
    pub layers: Option<usize>,
    /// Start from a Hugging Face model folder (config.json + model.safetensors): its config is
    /// the model and its weights the initial parameters (excludes --model and --layers).
    #[arg(long, value_name = "DIR", conflicts_with_all = ["model", "layers"])]
    pub init_from: Option<PathBuf>,
}

impl ModelArgs {
    /// The model's name in logs and records: the preset or config path, or the folder.
    pub fn name(&self) -> String {
        self.init_from.as_ref().map_or(self.model.clone(), |d| d.display().to_string())
    }

    /// The model's config: the folder's, or `--model`'s with `--layers` applied.
    ///
    /// # Errors
    /// An unreadable or bad config or folder; a bad `--layers`.
    pub fn config(&self) -> Result<ModelConfig> {
        match &self.init_from {
            Some(dir) => Ok(graphpp::pretrained::load_config(dir).context("--init-from")?),
            None => with_layers(load_config(&self.model)?, self.layers),
        }
    }

    /// [`ModelArgs::config`] and, with `--init-from`, the folder's weights.
    ///
    /// # Errors
    /// As [`ModelArgs::config`], and the folder's weights.
    pub fn load(&self) -> Result<(ModelConfig, Option<BTreeMap<String, Tensor>>)> {
        match &self.init_from {
            Some(dir) => {
                let p = graphpp::pretrained::load(dir).context("--init-from")?;
                Ok((p.config, Some(p.tensors)))
            }
            None => Ok((self.config()?, None)),
        }
    }
}

/// Loads a preset or a JSON config file (dense Llama, or MoE when the file has MoE fields).
///
/// # Errors
/// A path that does not exist, an unreadable or bad file, an unknown preset.
pub fn load_config(model: &str) -> Result<ModelConfig> {
    let looks_like_path = model.contains('/') || model.ends_with(".json");
    if looks_like_path && !Path::new(model).exists() {
        anyhow::bail!(
            "model config file {model} does not exist (or give a preset: {})",
            ModelConfig::PRESETS.join(", ")
        );
    }
    if Path::new(model).is_file() {
        let text =
            graphpp::textfile::read_text(Path::new(model)).with_context(|| format!("cannot read {model}"))?;
        return ModelConfig::from_json(&text).with_context(|| format!("{model}: bad model config"));
    }
    Ok(ModelConfig::preset(model)?)
}

/// `model` with `layers` decoder layers when given, checked.
///
/// # Errors
/// A layer count the config refuses, named as `--layers`.
pub fn with_layers(mut model: ModelConfig, layers: Option<usize>) -> Result<ModelConfig> {
    if let Some(l) = layers {
        model.base_mut().num_hidden_layers = l;
        model.validate().context("--layers")?;
    }
    Ok(model)
}
