//! Llama-style decoder configuration with Hugging Face `config.json` field names
//! (docs/ARCHITECTURE.md "Models, data, training").

use serde::{Deserialize, Serialize};
use serde_json::Value;
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
    /// A Hugging Face field whose value asks for something graphpp does not implement; training
    /// would silently run another architecture than the config says, so it is refused.
    #[error("config field `{field}` = {value}: not supported ({reason})")]
    Unsupported {
        /// HF field name (`rope_scaling`, `model_type`, `hidden_act`, …).
        field: &'static str,
        /// The value given, as JSON.
        value: String,
        /// What graphpp supports instead.
        reason: &'static str,
    },
    /// A size the tensor-parallel degree does not divide (heads, key/value heads, MLP width), or
    /// a degree of 0.
    #[error(
        "tensor parallelism: config field `{field}` = {value} does not split over tp = {tp} (tp must be at least 1 and divide it{})",
        if *field == "num_key_value_heads" { ", or be a multiple of it" } else { "" }
    )]
    TensorParallel {
        /// HF field name (`num_attention_heads`, `num_key_value_heads`, `intermediate_size`).
        field: &'static str,
        /// Its value.
        value: usize,
        /// The tensor-parallel degree asked for.
        tp: usize,
    },
    /// An unknown preset name.
    #[error("unknown preset `{0}` (known: tiny, small, moe-tiny, moe-small, moe-mla-tiny, moe-mla-small, deepseek-v3-16b)")]
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

/// HF `LlamaConfig` default of `rms_norm_eps`.
fn default_eps() -> f64 {
    1e-6
}
fn default_theta() -> f64 {
    10000.0
}
fn default_max_pos() -> usize {
    2048
}
fn default_init_range() -> f64 {
    0.02
}

/// The MLP activation (HF `hidden_act`, resolved as `transformers.activations.ACT2FN` does).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum HiddenAct {
    /// `silu` (alias `swish`): `x · σ(x)`.
    #[default]
    #[serde(rename = "silu", alias = "swish")]
    Silu,
    /// `gelu`: exact GELU `x · ½ (1 + erf(x/√2))`.
    #[serde(rename = "gelu")]
    Gelu,
    /// `gelu_pytorch_tanh` (alias `gelu_new`, the same formula): tanh-approximated GELU.
    #[serde(rename = "gelu_pytorch_tanh", alias = "gelu_new")]
    GeluPytorchTanh,
}

impl HiddenAct {
    /// HF names accepted for `hidden_act`.
    pub const NAMES: [&'static str; 5] = ["silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new"];

    /// The graph layer computing it.
    pub fn activation(self) -> graphpp_graph::layers::Activation {
        use graphpp_graph::layers::Activation;
        match self {
            HiddenAct::Silu => Activation::Silu,
            HiddenAct::Gelu => Activation::Gelu,
            HiddenAct::GeluPytorchTanh => Activation::GeluTanh,
        }
    }
}

/// Llama-style dense decoder config (`LlamaConfig` field names and defaults, the semantics of
/// `transformers`' `modeling_llama.py`). Fields `LlamaConfig` has but graphpp does not implement
/// are refused by [`LlamaConfig::from_json`] when set to anything but their default (see
/// [`check_supported`]); other unknown fields (`torch_dtype`, `architectures`, token ids, …)
/// do not change the math and are ignored.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    /// Vocabulary size `V`.
    pub vocab_size: usize,
    /// Model width `D`.
    pub hidden_size: usize,
    /// Gated-MLP inner width `F`.
    pub intermediate_size: usize,
    /// Decoder layers `L`.
    pub num_hidden_layers: usize,
    /// Query heads `H`.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention); defaults to `num_attention_heads`.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Per-head width `hd`; defaults to `hidden_size / num_attention_heads`. `q_proj` has
    /// `H·hd` outputs and `o_proj` `H·hd` inputs, which may differ from `D`.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// RMSNorm epsilon (HF default 1e-6).
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// RoPE base θ.
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    /// Longest sequence supported.
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    /// MLP activation.
    #[serde(default)]
    pub hidden_act: HiddenAct,
    /// Biases on `q_proj`, `k_proj`, `v_proj` and `o_proj`.
    #[serde(default)]
    pub attention_bias: bool,
    /// Biases on `gate_proj`, `up_proj` and `down_proj`.
    #[serde(default)]
    pub mlp_bias: bool,
    /// The LM head reuses the embedding matrix `model.embed_tokens.weight` (no `lm_head.weight`).
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Standard deviation of the normal initialisation of the matrices.
    #[serde(default = "default_init_range")]
    pub initializer_range: f64,
}

/// The JSON object of a `config.json` text. Errors: [`ModelError::Json`].
pub(crate) fn json_object(text: &str) -> Result<serde_json::Map<String, Value>, ModelError> {
    let v: Value = serde_json::from_str(text).map_err(|e| ModelError::Json(e.to_string()))?;
    match v {
        Value::Object(obj) => Ok(obj),
        _ => Err(ModelError::Json("a config must be a JSON object".into())),
    }
}

/// Checks the fields of an HF `config.json` object that ask for something graphpp does not
/// implement (source: `transformers` `LlamaConfig` and `modeling_llama.py`):
/// - `model_type` other than `llama` (absent is fine);
/// - `rope_scaling` other than null, and `rope_parameters.rope_type` other than `default`
///   (transformers ≥ 5 writes `rope_parameters: {rope_type, rope_theta}`);
/// - `hidden_act` other than [`HiddenAct::NAMES`];
/// - `pretraining_tp` other than 1, `attention_dropout` other than 0.
///
/// Errors: [`ModelError::Unsupported`] naming the first such field and its value.
pub fn check_supported(obj: &serde_json::Map<String, Value>) -> Result<(), ModelError> {
    let refuse =
        |field, v: &Value, reason| Err(ModelError::Unsupported { field, value: v.to_string(), reason });
    let set = |k: &str| obj.get(k).filter(|v| !v.is_null());
    if let Some(v) = set("model_type") {
        if v.as_str() != Some("llama") {
            return refuse(
                "model_type",
                v,
                "a dense config is Llama-style (model_type llama); a MoE one deepseek_v3 with its MoE fields",
            );
        }
    }
    if let Some(v) = set("rope_scaling") {
        return refuse(
            "rope_scaling",
            v,
            "graphpp implements plain RoPE only; remove the field or set it to null",
        );
    }
    if let Some(v) = set("rope_parameters") {
        let ty = v.get("rope_type").or_else(|| v.get("type")).filter(|t| !t.is_null());
        if let Some(t) = ty.filter(|t| t.as_str() != Some("default")) {
            return refuse(
                "rope_parameters.rope_type",
                t,
                "graphpp implements plain RoPE only (rope_type default)",
            );
        }
    }
    if let Some(v) = set("hidden_act") {
        if !v.as_str().is_some_and(|a| HiddenAct::NAMES.contains(&a)) {
            return refuse("hidden_act", v, "supported: silu (swish), gelu, gelu_pytorch_tanh (gelu_new)");
        }
    }
    if let Some(v) = set("pretraining_tp") {
        if v.as_f64() != Some(1.0) {
            return refuse("pretraining_tp", v, "graphpp does not split the projections; only 1");
        }
    }
    if let Some(v) = set("attention_dropout") {
        if v.as_f64() != Some(0.0) {
            return refuse("attention_dropout", v, "graphpp has no dropout; only 0");
        }
    }
    Ok(())
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
            head_dim: None,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            max_position_embeddings: 512,
            hidden_act: HiddenAct::Silu,
            attention_bias: false,
            mlp_bias: false,
            tie_word_embeddings: false,
            initializer_range: 0.02,
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

    /// Parses an HF `config.json` text: refuses unimplemented settings ([`check_supported`]),
    /// reads the known fields (unknown ones ignored; θ from `rope_parameters.rope_theta` when
    /// given, else from `rope_theta`, as transformers 5 standardizes it) and validates the sizes. Errors: [`ModelError::Json`],
    /// [`ModelError::Unsupported`], [`ModelError::Field`].
    pub fn from_json(text: &str) -> Result<Self, ModelError> {
        let obj = json_object(text)?;
        check_supported(&obj)?;
        Self::from_object(obj)
    }

    /// [`LlamaConfig::from_json`] of a parsed object whose unsupported fields were checked.
    /// Errors: [`ModelError::Json`], [`ModelError::Field`].
    pub(crate) fn from_object(mut obj: serde_json::Map<String, Value>) -> Result<Self, ModelError> {
        // transformers ≥ 5 keeps θ in `rope_parameters`, which wins over a top-level `rope_theta`.
        let nested = obj.get("rope_parameters").and_then(|p| p.get("rope_theta")).filter(|t| !t.is_null());
        if let Some(theta) = nested.cloned() {
            obj.insert("rope_theta".into(), theta);
        }
        // HF writes `null` for unset optional fields; treat it as absent so defaults apply.
        obj.retain(|_, v| !v.is_null());
        let c: LlamaConfig =
            serde_json::from_value(Value::Object(obj)).map_err(|e| ModelError::Json(e.to_string()))?;
        c.validate()?;
        Ok(c)
    }

    /// Key/value heads.
    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Per-head width `hd`: `head_dim`, else `D / H`.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// The sizes tensor parallelism splits evenly, by HF field name: query heads, the MLP
    /// width and the vocabulary (the key/value heads have their own rule:
    /// [`crate::tensor_parallel::check_divides`]).
    pub fn tensor_parallel_sizes(&self) -> Vec<(&'static str, usize)> {
        vec![
            ("num_attention_heads", self.num_attention_heads),
            ("intermediate_size", self.intermediate_size),
            ("vocab_size", self.vocab_size),
        ]
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
        if self.num_attention_heads == 0 {
            return bad("num_attention_heads", "must be > 0".into());
        }
        match self.head_dim {
            Some(0) => return bad("head_dim", "must be > 0".into()),
            Some(hd) if !hd.is_multiple_of(2) => {
                return bad("head_dim", format!("{hd} must be even for RoPE"))
            }
            Some(_) => {}
            None if !self.hidden_size.is_multiple_of(self.num_attention_heads) => {
                return bad(
                    "num_attention_heads",
                    format!("must divide hidden_size {} (or give head_dim)", self.hidden_size),
                );
            }
            None if !self.head_dim().is_multiple_of(2) => {
                return bad("hidden_size", "head dim must be even for RoPE".into());
            }
            None => {}
        }
        if self.kv_heads() == 0 || !self.num_attention_heads.is_multiple_of(self.kv_heads()) {
            return bad("num_key_value_heads", "must divide num_attention_heads".into());
        }
        if self.num_hidden_layers == 0 || self.intermediate_size == 0 {
            return bad("num_hidden_layers", "layers and intermediate_size must be > 0".into());
        }
        if !(self.rms_norm_eps >= 0.0 && self.rms_norm_eps.is_finite()) {
            return bad("rms_norm_eps", format!("{} must be a finite number >= 0", self.rms_norm_eps));
        }
        if !(self.rope_theta > 0.0 && self.rope_theta.is_finite()) {
            return bad("rope_theta", format!("{} must be a finite number > 0", self.rope_theta));
        }
        if !(self.initializer_range >= 0.0 && self.initializer_range.is_finite()) {
            return bad(
                "initializer_range",
                format!("{} must be a finite number >= 0", self.initializer_range),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#""vocab_size":32,"hidden_size":16,"intermediate_size":32,"num_hidden_layers":2,"num_attention_heads":2"#;

    fn with(extra: &str) -> Result<LlamaConfig, ModelError> {
        LlamaConfig::from_json(&format!("{{{BASE}{}{extra}}}", if extra.is_empty() { "" } else { "," }))
    }

    #[test]
    fn parses_hf_names_and_rejects_bad_heads() {
        let c = with(r#""num_key_value_heads":1,"model_type":"llama""#).unwrap();
        // HF LlamaConfig defaults: rms_norm_eps 1e-6, rope_theta 1e4, silu, no biases, untied.
        assert_eq!((c.kv_heads(), c.head_dim(), c.rms_norm_eps, c.rope_theta), (1, 8, 1e-6, 1e4));
        assert_eq!(
            (c.hidden_act, c.attention_bias, c.mlp_bias, c.tie_word_embeddings),
            (HiddenAct::Silu, false, false, false)
        );
        let e = LlamaConfig::from_json(r#"{"vocab_size":32,"hidden_size":16,"intermediate_size":32,"num_hidden_layers":2,"num_attention_heads":3}"#)
            .unwrap_err();
        assert!(matches!(e, ModelError::Field { field: "num_attention_heads", .. }));
        assert!(matches!(LlamaConfig::preset("huge"), Err(ModelError::Preset(_))));
        let zero = LlamaConfig { hidden_size: 0, ..LlamaConfig::tiny() };
        assert!(matches!(zero.validate(), Err(ModelError::Field { field: "hidden_size", .. })));
    }

    #[test]
    fn reads_the_implemented_fields() {
        let c = with(
            r#""head_dim":6,"num_key_value_heads":1,"hidden_act":"gelu","attention_bias":true,"mlp_bias":true,
               "tie_word_embeddings":true,"rope_theta":500.0,"rms_norm_eps":1e-5,"initializer_range":0.1"#,
        )
        .unwrap();
        assert_eq!((c.head_dim(), c.kv_heads(), c.hidden_act), (6, 1, HiddenAct::Gelu));
        assert!(c.attention_bias && c.mlp_bias && c.tie_word_embeddings);
        assert_eq!((c.rope_theta, c.rms_norm_eps, c.initializer_range), (500.0, 1e-5, 0.1));
        for (name, act) in [
            ("silu", HiddenAct::Silu),
            ("swish", HiddenAct::Silu),
            ("gelu_pytorch_tanh", HiddenAct::GeluPytorchTanh),
            ("gelu_new", HiddenAct::GeluPytorchTanh),
        ] {
            assert_eq!(with(&format!(r#""hidden_act":"{name}""#)).unwrap().hidden_act, act, "{name}");
        }
        // transformers 5 writes θ inside rope_parameters; it wins over a top-level rope_theta.
        let c =
            with(r#""rope_theta":1.0,"rope_parameters":{"rope_theta":250.0,"rope_type":"default"}"#).unwrap();
        assert_eq!(c.rope_theta, 250.0);
        // An odd explicit head_dim cannot rotate in pairs.
        assert!(matches!(with(r#""head_dim":5"#), Err(ModelError::Field { field: "head_dim", .. })));
        // hidden 16 with 3 heads is fine once head_dim is given (q_proj has 3·4 outputs).
        let c = LlamaConfig::from_json(r#"{"vocab_size":32,"hidden_size":16,"intermediate_size":32,"num_hidden_layers":2,"num_attention_heads":3,"head_dim":4,"num_key_value_heads":1}"#).unwrap();
        assert_eq!(c.head_dim(), 4);
    }

    #[test]
    fn fields_that_do_not_change_the_math_are_accepted() {
        let c = with(
            r#""torch_dtype":"bfloat16","dtype":"float32","architectures":["LlamaForCausalLM"],"bos_token_id":1,
               "eos_token_id":[2,3],"pad_token_id":null,"transformers_version":"5.24.0","use_cache":true,
               "model_type":"llama","rope_scaling":null,"pretraining_tp":1,"attention_dropout":0.0,
               "num_key_value_heads":null,"head_dim":null"#,
        )
        .unwrap();
        assert_eq!((c.kv_heads(), c.head_dim()), (2, 8));
    }

    #[test]
    fn unimplemented_fields_are_refused_by_name() {
        let cases = [
            (r#""rope_scaling":{"rope_type":"llama3","factor":8.0}"#, "rope_scaling", "llama3"),
            (
                r#""rope_parameters":{"rope_type":"yarn","rope_theta":1e4}"#,
                "rope_parameters.rope_type",
                "yarn",
            ),
            (r#""model_type":"gpt2""#, "model_type", "gpt2"),
            (r#""hidden_act":"relu""#, "hidden_act", "relu"),
            (r#""pretraining_tp":2"#, "pretraining_tp", "2"),
            (r#""attention_dropout":0.1"#, "attention_dropout", "0.1"),
        ];
        for (extra, field, value) in cases {
            let e = with(extra).unwrap_err();
            match &e {
                ModelError::Unsupported { field: f, value: v, .. } => {
                    assert_eq!(*f, field, "{extra}");
                    assert!(v.contains(value), "{extra}: {v}");
                }
                other => panic!("{extra}: {other:?}"),
            }
            let msg = e.to_string();
            assert!(msg.contains(&format!("`{field}`")) && msg.contains(value), "{msg}");
        }
    }
}
