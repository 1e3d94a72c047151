//! A graphpp checkpoint as a Hugging Face model folder (`graphpp export`): `config.json` and
//! `model.safetensors` with the model's parameters under their Hugging Face names — what
//! `transformers`' `from_pretrained` and graphpp's own `--init-from` read
//! ([`crate::pretrained`]). graphpp already names every parameter as Hugging Face does
//! (`model.layers.0.self_attn.q_proj.weight`), so the export selects the parameters (not the
//! AdamW moments) and writes the config with the fields Hugging Face needs to pick the class
//! (`model_type`, `architectures`) and the sizes graphpp derives (`head_dim`,
//! `num_key_value_heads`) spelled out.

use std::path::{Path, PathBuf};

use graphpp_models::ModelConfig;

use crate::checkpoint::{self, CheckpointError, NamedTensor};
use crate::pretrained::{model_parameters, CONFIG_FILE, WEIGHTS_FILE};

/// Why a checkpoint cannot be exported.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// Reading the checkpoint (missing, damaged) or writing a file.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The checkpoint's sidecar does not record a graphpp run.
    #[error("{path}: not a graphpp training checkpoint ({reason})")]
    NotARun {
        /// The sidecar.
        path: PathBuf,
        /// What is missing.
        reason: String,
    },
    /// A parameter of the model is missing from the checkpoint or has another shape.
    #[error("{path}: parameter {name}: {reason}")]
    Parameter {
        /// The sidecar.
        path: PathBuf,
        /// The parameter.
        name: String,
        /// What is wrong.
        reason: String,
    },
    /// The output folder already holds a model (nothing is overwritten).
    #[error("{0}: already exists; export into a new or empty folder")]
    Exists(PathBuf),
}

/// What [`export_hf`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct Exported {
    /// The sidecar of the checkpoint exported (the newest loadable one of a folder).
    pub checkpoint: PathBuf,
    /// The optimizer step it was saved after.
    pub step: u64,
    /// Tensors written (parameters and MoE routing biases).
    pub tensors: usize,
    /// Parameters in all.
    pub parameters: u64,
}

/// The Hugging Face `config.json` object of `model`: graphpp's config (Hugging Face field names)
/// with `model_type` and `architectures` (`llama` / `LlamaForCausalLM`, or `deepseek_v3` /
/// `DeepseekV3ForCausalLM` for the MoE decoder), `head_dim` and `num_key_value_heads` resolved,
/// `torch_dtype` float32, and a YaRN `rope_scaling` typed `yarn`.
pub fn hf_config(model: &ModelConfig) -> serde_json::Value {
    let mut v = serde_json::to_value(model).unwrap_or_default();
    let (model_type, architecture) = match model {
        ModelConfig::Llama(_) => ("llama", "LlamaForCausalLM"),
        ModelConfig::Moe(_) => ("deepseek_v3", "DeepseekV3ForCausalLM"),
    };
    if let Some(o) = v.as_object_mut() {
        let base = model.base();
        o.insert("model_type".into(), model_type.into());
        o.insert("architectures".into(), serde_json::json!([architecture]));
        o.insert("head_dim".into(), base.head_dim().into());
        o.insert("num_key_value_heads".into(), base.kv_heads().into());
        o.insert("torch_dtype".into(), "float32".into());
        // graphpp keeps YaRN's parameters; Hugging Face picks the scaling by its type.
        if let Some(rope) = o.get_mut("rope_scaling").and_then(|r| r.as_object_mut()) {
            rope.insert("type".into(), "yarn".into());
            rope.insert("rope_type".into(), "yarn".into());
        }
    }
    v
}

/// Exports checkpoint `path` (a sidecar `step-N.json`, or a checkpoint folder: its newest one
/// that loads) into the folder `out` (created; it must not hold a `config.json` or
/// `model.safetensors` yet) as a Hugging Face model: [`hf_config`] and the model's parameters
/// and routing biases in f32, under their Hugging Face names, in the model's order.
///
/// # Errors
/// [`ExportError::Checkpoint`] (missing, damaged, unwritable); [`ExportError::NotARun`] for a
/// sidecar without a run's settings; [`ExportError::Parameter`] for a parameter the checkpoint
/// lacks or holds in another shape; [`ExportError::Exists`].
pub fn export_hf(path: &Path, out: &Path) -> Result<Exported, ExportError> {
    if path.extension().is_some_and(|e| e == "safetensors") {
        let reason = format!("give its sidecar {} (or the folder)", path.with_extension("json").display());
        return Err(ExportError::NotARun { path: path.to_path_buf(), reason });
    }
    for file in [CONFIG_FILE, WEIGHTS_FILE] {
        if out.join(file).exists() {
            return Err(ExportError::Exists(out.join(file)));
        }
    }
    // One read and check of the tensors (a folder resolves to its newest loadable checkpoint).
    let mut ck = checkpoint::load(path)?;
    let sidecar = ck.path.clone();
    let saved = crate::train::saved_run(ck.sidecar.clone(), &sidecar)
        .map_err(|e| ExportError::NotARun { path: sidecar.clone(), reason: e.to_string() })?;
    let model = saved.config.model;
    let bad = |name: &str, reason: String| ExportError::Parameter {
        path: sidecar.clone(),
        name: name.into(),
        reason,
    };
    let mut names: Vec<(String, Vec<usize>)> = model_parameters(model.as_model())
        .map_err(|e| ExportError::NotARun { path: sidecar.clone(), reason: e.to_string() })?;
    names.extend(crate::pretrained::model_biases(model.as_model()));
    let mut tensors = Vec::with_capacity(names.len());
    for (name, shape) in names {
        let t = ck.tensors.remove(&name).ok_or_else(|| bad(&name, "not in the checkpoint".into()))?;
        if t.shape != shape {
            return Err(bad(
                &name,
                format!("shape {:?} in the checkpoint, the model's is {shape:?}", t.shape),
            ));
        }
        tensors.push(NamedTensor { name, shape, data: t.data });
    }
    std::fs::create_dir_all(out).map_err(|source| CheckpointError::Io { path: out.into(), source })?;
    let weights = out.join(WEIGHTS_FILE);
    checkpoint::write_atomic(&weights, &checkpoint::safetensors_bytes(&tensors, &weights)?)?;
    let config = serde_json::to_vec_pretty(&hf_config(&model)).unwrap_or_default();
    checkpoint::write_atomic(&out.join(CONFIG_FILE), &config)?;
    let parameters = tensors.iter().map(|t| t.data.len() as u64).sum();
    Ok(Exported { checkpoint: sidecar, step: ck.sidecar.step, tensors: tensors.len(), parameters })
}
