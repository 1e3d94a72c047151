//! Llama-style decoder configuration with Hugging Face `config.json` field names
//! (DESIGN.md "Models, data, training").

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Errors of model configuration and stage splitting.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum ModelError {
    /// The JSON text does not parse as a config.
    #[error("config JSON: {0}")]
    Json(String),
    /// A field has an unusable value.
    #[error("config field `{field}`: {reason}")]
    Field {
        /// HF field name.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// An unknown preset name.
    #[error("unknown preset `{0}` (known: tiny, small)")]
    Preset(String),
    /// The stage split is impossible.
    #[error("stage split: {0}")]
    Split(String),
    /// The microbatch shape does not fit the model (e.g. `T` above `max_position_embeddings`).
    #[error("microbatch shape: {0}")]
    Shape(String),
    /// Building the graph failed.
    #[error(transparent)]
    Graph(#[from] graphpp_graph::GraphError),
}

fn default_eps() -> f64 {
    1e-5
}
fn default_theta() -> f64 {
    10000.0
}
fn default_max_pos() -> usize {
    2048
}

/// Llama-style dense decoder config (`LlamaConfig` field names).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    /// Vocabulary size `V`.
    pub vocab_size: usize,
    /// Model width `D`.
    pub hidden_size: usize,
    /// SwiGLU inner width.
    pub intermediate_size: usize,
    /// Decoder layers `L`.
    pub num_hidden_layers: usize,
    /// Query heads `H`.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention); defaults to `num_attention_heads`.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// RMSNorm epsilon.
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// RoPE base θ.
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    /// Longest sequence supported.
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    /// Whether the LM head reuses the embedding (unsupported: must be false).
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

impl LlamaConfig {
    /// `tiny`: V=256, D=64, 4 layers, 4 heads, inner 176 — runs in seconds on a CPU.
    pub fn tiny() -> Self {
        LlamaConfig {
            vocab_size: 256,
            hidden_size: 64,
            intermediate_size: 176,
            num_hidden_layers: 4,
            num_attention_heads: 4,
            num_key_value_heads: None,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            max_position_embeddings: 512,
            tie_word_embeddings: false,
        }
    }

    /// `small`: V=256, D=256, 8 layers, 8 heads, inner 688.
    pub fn small() -> Self {
        LlamaConfig {
            hidden_size: 256,
            intermediate_size: 688,
            num_hidden_layers: 8,
            num_attention_heads: 8,
            ..Self::tiny()
        }
    }

    /// A preset by name (`tiny`, `small`). Errors: [`ModelError::Preset`].
    pub fn preset(name: &str) -> Result<Self, ModelError> {
        match name {
            "tiny" => Ok(Self::tiny()),
            "small" => Ok(Self::small()),
            other => Err(ModelError::Preset(other.into())),
        }
    }

    /// Parses HF-style JSON (unknown fields ignored) and validates it.
    pub fn from_json(text: &str) -> Result<Self, ModelError> {
        let c: LlamaConfig = serde_json::from_str(text).map_err(|e| ModelError::Json(e.to_string()))?;
        c.validate()?;
        Ok(c)
    }

    /// Key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Per-head width `hd = D / H`.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// Checks sizes. Errors: [`ModelError::Field`] naming the field.
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |field, reason: String| Err(ModelError::Field { field, reason });
        if self.vocab_size == 0 {
            return bad("vocab_size", "must be > 0".into());
        }
        if self.hidden_size == 0 {
            return bad("hidden_size", "must be > 0".into());
        }
        if self.num_attention_heads == 0 || !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return bad("num_attention_heads", format!("must divide hidden_size {}", self.hidden_size));
        }
        if !self.head_dim().is_multiple_of(2) {
            return bad("hidden_size", "head dim must be even for RoPE".into());
        }
        if self.kv_heads() == 0 || !self.num_attention_heads.is_multiple_of(self.kv_heads()) {
            return bad("num_key_value_heads", "must divide num_attention_heads".into());
        }
        if self.num_hidden_layers == 0 || self.intermediate_size == 0 {
            return bad("num_hidden_layers", "layers and intermediate_size must be > 0".into());
        }
        if self.tie_word_embeddings {
            return bad("tie_word_embeddings", "tied embeddings are not supported".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_hf_names_and_rejects_bad_heads() {
        let c = LlamaConfig::from_json(
            r#"{"vocab_size":32,"hidden_size":16,"intermediate_size":32,"num_hidden_layers":2,
                "num_attention_heads":2,"num_key_value_heads":1,"model_type":"llama"}"#,
        )
        .unwrap();
        assert_eq!((c.kv_heads(), c.head_dim(), c.rms_norm_eps), (1, 8, 1e-5));
        let e = LlamaConfig::from_json(r#"{"vocab_size":32,"hidden_size":16,"intermediate_size":32,"num_hidden_layers":2,"num_attention_heads":3}"#)
            .unwrap_err();
        assert!(matches!(e, ModelError::Field { field: "num_attention_heads", .. }));
        assert!(matches!(LlamaConfig::preset("huge"), Err(ModelError::Preset(_))));
        let zero = LlamaConfig { hidden_size: 0, ..LlamaConfig::tiny() };
        assert!(matches!(zero.validate(), Err(ModelError::Field { field: "hidden_size", .. })));
    }
}
