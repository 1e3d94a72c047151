//! Pretrained weights from a Hugging Face model folder, Llama-style or DeepSeek-V2/V3 (`graphpp
//! train --init-from DIR`, `graphpp verify --init-from DIR`).
//!
//! The folder holds `config.json` (parsed by [`ModelConfig::from_json`], which refuses settings
//! graphpp does not implement) and the weights: `model.safetensors`, or the shards a
//! `model.safetensors.index.json` lists (`weight_map`), as `save_pretrained` writes them. Tensor
//! names and layouts are Hugging Face's (`model.layers.0.self_attn.q_proj.weight`, `[out, in]`),
//! which are graphpp's parameter names; f32, f16, bf16 and f64 tensors are converted to f32.
//!
//! The tensors must be exactly the parameters the config describes ([`Model::stage_parameters`]
//! of the whole model), plus, for a MoE model, optionally each MoE layer's routing bias
//! (`…mlp.gate.e_score_correction_bias`, a buffer HF saves; absent ones start at zero): a
//! missing tensor, one of another shape and an extra one are errors naming them. Three
//! tolerances, all about what the checkpoints hold: `…rotary_emb.inv_freq` buffers (older
//! `transformers` saved them; graphpp computes RoPE from the config) are skipped; with
//! `tie_word_embeddings` an `lm_head.weight` equal to `model.embed_tokens.weight` is dropped; and
//! with `num_nextn_predict_layers` = n the layers `L..L+n` (DeepSeek-V3's multi-token-prediction
//! module) are skipped where graphpp does not build the module (`mtp_loss_weight` 0), else its
//! layer is read but for its copies of the embedding and the head (shared in graphpp).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use graphpp_models::{split_layers, Model, ModelConfig, ModelError, EMBED, LM_HEAD};

/// The config file of a model folder.
pub const CONFIG_FILE: &str = "config.json";
/// The single-file weights of a model folder.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The index of sharded weights (`{"weight_map": {tensor name: shard file}}`).
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Why a model folder could not be loaded; each names the file and the tensor or field.
#[derive(Debug, thiserror::Error)]
pub enum PretrainedError {
    /// A file the folder must hold is not there.
    #[error("{}: missing (a Hugging Face model folder holds {CONFIG_FILE} and {WEIGHTS_FILE} or {INDEX_FILE})", path.display())]
    MissingFile {
        /// The missing file.
        path: PathBuf,
    },
    /// A file could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// `config.json` is malformed or asks for something graphpp does not implement.
    #[error("{}: {source}", path.display())]
    Config {
        /// The config file.
        path: PathBuf,
        /// The model error (names the field).
        source: ModelError,
    },
    /// A weights file or the shard index is not valid.
    #[error("{}: not a valid weights file: {reason}", path.display())]
    Format {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// A tensor of an element type that is not converted.
    #[error("{}: tensor `{name}` has dtype {dtype}; f32, f16, bf16 and f64 are read", path.display())]
    DType {
        /// The weights file.
        path: PathBuf,
        /// Tensor name.
        name: String,
        /// Its dtype.
        dtype: String,
    },
    /// A tensor holding NaN or infinite values: training from it fails at the first step, and
    /// would name no tensor.
    #[error("{}: tensor `{name}` holds {count} NaN or infinite value(s) of {total}", path.display())]
    NotFinite {
        /// The weights file.
        path: PathBuf,
        /// Tensor name.
        name: String,
        /// Values that are NaN or infinite.
        count: usize,
        /// Values in the tensor.
        total: usize,
    },
    /// Parameters of the model the config describes that no file holds.
    #[error("{}: {} tensor(s) missing that the config's model needs: {}", dir.display(), names.len(), list(names))]
    MissingTensors {
        /// The model folder.
        dir: PathBuf,
        /// The missing names.
        names: Vec<String>,
    },
    /// A tensor whose shape is not the one the config gives.
    #[error("{}: tensor `{name}` has shape {found:?}, the config gives {expected:?}", dir.display())]
    Shape {
        /// The model folder.
        dir: PathBuf,
        /// Tensor name.
        name: String,
        /// Shape in the file.
        found: Vec<usize>,
        /// Shape from the config.
        expected: Vec<usize>,
    },
    /// Tensors that are not parameters of the model the config describes.
    #[error("{}: {} unexpected tensor(s), not in the model the config describes: {}", dir.display(), names.len(), list(names))]
    Unexpected {
        /// The model folder.
        dir: PathBuf,
        /// The extra names.
        names: Vec<String>,
    },
    /// `tie_word_embeddings` is set but the file's `lm_head.weight` is another matrix.
    #[error("{}: tie_word_embeddings is true but `{LM_HEAD}` differs from `{EMBED}`", dir.display())]
    TiedMismatch {
        /// The model folder.
        dir: PathBuf,
    },
    /// A tensor operation failed.
    #[error("tensor: {0}")]
    Tensor(#[from] candle_core::Error),
}

/// Up to 8 names, then how many more.
fn list(names: &[String]) -> String {
    let mut s = names.iter().take(8).map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ");
    if names.len() > 8 {
        s.push_str(&format!(" and {} more", names.len() - 8));
    }
    s
}

/// A loaded model folder.
#[derive(Debug, Clone)]
pub struct Pretrained {
    /// The model from `config.json`.
    pub config: ModelConfig,
    /// Every parameter by HF name (once; a tied LM head reads `model.embed_tokens.weight`), f32
    /// CPU tensors of the shapes of [`model_parameters`], and the MoE routing biases the folder
    /// holds (`[E]` each).
    pub tensors: BTreeMap<String, Tensor>,
}

/// Names and shapes of every parameter of `cfg`'s model, in interface order (one stage holding
/// every layer).
///
/// # Errors
/// [`ModelError::Split`] for a config without decoder layers.
pub fn model_parameters(cfg: &dyn Model) -> Result<Vec<(String, Vec<usize>)>, ModelError> {
    let spec = split_layers(cfg.num_layers(), 1, None)?.remove(0);
    Ok(cfg.stage_parameters(&spec))
}

/// Names and shapes (`[E]`) of the MoE routing biases of `cfg`'s model (buffers a folder may
/// hold beside the parameters: HF `e_score_correction_bias`), in layer order.
pub fn model_biases(cfg: &dyn Model) -> Vec<(String, Vec<usize>)> {
    cfg.moe_layers().into_iter().filter_map(|(l, e)| Some((cfg.balance_bias(l)?, vec![e]))).collect()
}

fn read(path: &Path) -> Result<Vec<u8>, PretrainedError> {
    if !path.is_file() {
        return Err(PretrainedError::MissingFile { path: path.to_path_buf() });
    }
    std::fs::read(path).map_err(|source| PretrainedError::Io { path: path.to_path_buf(), source })
}

/// Reads `DIR/config.json`.
///
/// # Errors
/// [`PretrainedError::MissingFile`], [`PretrainedError::Io`], [`PretrainedError::Config`] (bad
/// JSON, an unsupported field such as `rope_scaling` named with its value, bad sizes).
pub fn load_config(dir: &Path) -> Result<ModelConfig, PretrainedError> {
    let path = dir.join(CONFIG_FILE);
    let bytes = read(&path)?;
    let text = String::from_utf8_lossy(&bytes);
    ModelConfig::from_json(&text).map_err(|source| PretrainedError::Config { path, source })
}

/// The layer index of a `model.layers.<l>.…` name.
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("model.layers.")?.split('.').next()?.parse().ok()
}

/// The weight files of `dir`: `model.safetensors`, else the shards of the index.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, PretrainedError> {
    let single = dir.join(WEIGHTS_FILE);
    let index = dir.join(INDEX_FILE);
    if single.is_file() || !index.is_file() {
        return Ok(vec![single]);
    }
    let bad = |reason: String| PretrainedError::Format { path: index.clone(), reason };
    let v: serde_json::Value =
        serde_json::from_slice(&read(&index)?).map_err(|e| bad(format!("JSON: {e}")))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("no `weight_map` object".into()))?;
    let mut files = BTreeSet::new();
    for (name, file) in map {
        let file = file.as_str().ok_or_else(|| bad(format!("`{name}` maps to {file}, not a file name")))?;
        if file.contains(['/', '\\']) || file.starts_with('.') {
            return Err(bad(format!("`{name}` maps to {file:?}, not a file in the folder")));
        }
        files.insert(dir.join(file));
    }
    Ok(files.into_iter().collect())
}

/// Reads every tensor of one safetensors file but those `skip` names, converted to f32 (a
/// skipped tensor is neither converted nor checked).
fn read_tensors(path: &Path, skip: impl Fn(&str) -> bool) -> Result<Vec<(String, Tensor)>, PretrainedError> {
    let bytes = read(path)?;
    let bad = |reason: String| PretrainedError::Format { path: path.to_path_buf(), reason };
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
    let mut out = Vec::new();
    for (name, view) in st.tensors().into_iter().filter(|(name, _)| !skip(name)) {
        use safetensors::Dtype as S;
        let dtype = match view.dtype() {
            S::F32 => DType::F32,
            S::F16 => DType::F16,
            S::BF16 => DType::BF16,
            S::F64 => DType::F64,
            other => {
                return Err(PretrainedError::DType {
                    path: path.to_path_buf(),
                    name,
                    dtype: format!("{other:?}"),
                })
            }
        };
        let t = Tensor::from_raw_buffer(view.data(), dtype, view.shape(), &Device::Cpu)
            .map_err(|e| bad(format!("tensor `{name}`: {e}")))?
            .to_dtype(DType::F32)?;
        let values = t.flatten_all()?.to_vec1::<f32>()?;
        let count = values.iter().filter(|x| !x.is_finite()).count();
        if count > 0 {
            return Err(PretrainedError::NotFinite {
                path: path.to_path_buf(),
                name,
                count,
                total: values.len(),
            });
        }
        out.push((name, t));
    }
    Ok(out)
}

/// Reads the weights of `dir` for the model `cfg` and checks them against it (see the module
/// doc): every parameter present with its shape, nothing else.
///
/// # Errors
/// [`PretrainedError::MissingFile`] (no `model.safetensors` nor index, or a shard), `Io`,
/// `Format`, `DType`, `NotFinite`, `MissingTensors`, `Shape`, `Unexpected`, `TiedMismatch`.
pub fn load_weights(dir: &Path, cfg: &ModelConfig) -> Result<BTreeMap<String, Tensor>, PretrainedError> {
    let expected = model_parameters(cfg)
        .map_err(|source| PretrainedError::Config { path: dir.join(CONFIG_FILE), source })?;
    let layers = cfg.num_layers();
    let mtp = layers..layers + cfg.mtp_layers();
    // A built MTP module (`mtp_loss_weight` > 0) reads its layer's tensors, less the copies of
    // the embedding and head DeepSeek's checkpoints keep in it (graphpp shares the model's).
    let built = cfg.mtp_loss_weight() > 0.0;
    let copy =
        |name: &str| name.ends_with(".embed_tokens.weight") || name.ends_with(".shared_head.head.weight");
    let skip = |name: &str| {
        name.ends_with(".rotary_emb.inv_freq")
            || layer_of(name).is_some_and(|l| mtp.contains(&l) && (!built || copy(name)))
    };
    let mut tensors = BTreeMap::new();
    for file in weight_files(dir)? {
        tensors.extend(read_tensors(&file, skip)?);
    }
    if cfg.base().tie_word_embeddings {
        if let (Some(head), Some(embed)) = (tensors.get(LM_HEAD), tensors.get(EMBED)) {
            let same = head.dims() == embed.dims() && head.eq(embed)?.min_all()?.to_scalar::<u8>()? == 1;
            if !same {
                return Err(PretrainedError::TiedMismatch { dir: dir.to_path_buf() });
            }
            tensors.remove(LM_HEAD);
        }
    }
    let missing: Vec<String> =
        expected.iter().filter(|(n, _)| !tensors.contains_key(n)).map(|(n, _)| n.clone()).collect();
    if !missing.is_empty() {
        return Err(PretrainedError::MissingTensors { dir: dir.to_path_buf(), names: missing });
    }
    // The routing biases are optional (every parameter is present by now); present, `[E]`.
    let biases = model_biases(cfg.as_model());
    for (name, shape) in expected.iter().chain(&biases) {
        if let Some(t) = tensors.get(name).filter(|t| t.dims() != shape.as_slice()) {
            return Err(PretrainedError::Shape {
                dir: dir.to_path_buf(),
                name: name.clone(),
                found: t.dims().to_vec(),
                expected: shape.clone(),
            });
        }
    }
    let known: BTreeSet<&String> = expected.iter().chain(&biases).map(|(n, _)| n).collect();
    let extra: Vec<String> = tensors.keys().filter(|n| !known.contains(n)).cloned().collect();
    if !extra.is_empty() {
        return Err(PretrainedError::Unexpected { dir: dir.to_path_buf(), names: extra });
    }
    Ok(tensors)
}

/// Reads a whole model folder: [`load_config`] then [`load_weights`].
///
/// # Errors
/// Those of [`load_config`] and [`load_weights`].
pub fn load(dir: &Path) -> Result<Pretrained, PretrainedError> {
    let config = load_config(dir)?;
    let tensors = load_weights(dir, &config)?;
    Ok(Pretrained { config, tensors })
}
