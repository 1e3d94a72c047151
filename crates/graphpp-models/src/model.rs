//! [`Model`]: what the runtime needs of a model to pipeline it — the unit of its stage split,
//! each stage's forward graph, the names, shapes and initial values of its parameters, its
//! buffers, and the sizes the pre-flight checks estimate (docs/ARCHITECTURE.md "Models, data,
//! training"). The runtime (trainer, verification, memory checks) holds an `Arc<dyn Model>` and
//! is not typed on any one model; [`LlamaConfig`] implements it.

use graphpp_graph::Graph;

use crate::config::{LlamaConfig, ModelError};
use crate::llama::{StageOptions, StageSpec};
use crate::moe::MoeConfig;

/// A model the runtime can split into pipeline stages and train (see the module doc).
///
/// A stage covers a contiguous range of decoder layers ([`StageSpec`]); the first stage also
/// embeds the token ids, the last also computes the logits and the loss. Parameter names are
/// global (the same name on every stage that holds the parameter, e.g. a tied embedding), so
/// any split of the same model has the same parameters.
pub trait Model: std::fmt::Debug + Send + Sync {
    /// A short description for logs (`llama, 4 layers, hidden 64`).
    fn describe(&self) -> String;

    /// Vocabulary size: token ids and targets are below it.
    fn vocab_size(&self) -> usize;

    /// Decoder layers, the unit of the stage split.
    fn num_layers(&self) -> usize;

    /// The longest sequence the model takes (its position table).
    fn max_seq_len(&self) -> usize;

    /// The forward graph of stage `spec` for microbatches of `opts.batch × opts.seq` tokens.
    ///
    /// # Errors
    /// [`ModelError`] for a shape or option the model cannot serve.
    fn build_stage(&self, spec: &StageSpec, opts: &StageOptions) -> Result<Graph, ModelError>;

    /// Names and shapes of the parameters of stage `spec`, in the stage graph's input order.
    fn stage_parameters(&self, spec: &StageSpec) -> Vec<(String, Vec<usize>)>;

    /// Deterministic initial values of the parameters of `spec` from `seed`, row-major f32,
    /// seeded per parameter name (any split gives the same weights).
    fn init_parameters(&self, spec: &StageSpec, seed: u64) -> Vec<(String, Vec<usize>, Vec<f32>)>;

    /// The stage graphs' buffers (inputs that are neither parameters nor data, e.g. RoPE tables
    /// and the causal mask) for sequences of `seq` tokens: name, shape, row-major values.
    fn stage_buffers(&self, seq: usize) -> Vec<(String, Vec<usize>, Vec<f64>)>;

    /// Parameters of the whole model (one copy of each).
    fn parameter_count(&self) -> u128;

    /// Saved-activation bytes (f32) of one microbatch of `batch × seq` tokens through stage
    /// `spec` (an estimate for the pre-flight memory check).
    fn stage_activation_bytes(&self, spec: &StageSpec, batch: usize, seq: usize) -> u128;

    /// Bytes (f32) of one stage's buffers at `seq` tokens.
    fn buffer_bytes(&self, seq: usize) -> u128;

    /// Model FLOPs per trained token at `seq` tokens (forward and backward).
    fn flops_per_token(&self, seq: usize) -> f64;

    /// The dtype buffer `name` is stored and fed in when the stage computes in `compute`:
    /// `compute` except for state that must not round (a MoE balancing bias stays f32 under bf16).
    fn buffer_dtype(&self, name: &str, compute: graphpp_graph::DType) -> graphpp_graph::DType {
        let _ = name;
        compute
    }

    /// The mixture-of-experts layers, `(layer, experts)`, in layer order; each one's stage graph
    /// outputs `expert_load.<layer>` ([`graphpp_graph::names::EXPERT_LOAD`]). None for a dense model.
    fn moe_layers(&self) -> Vec<(usize, usize)> {
        Vec::new()
    }

    /// The decoder layers stage `spec` runs: its `spec.layers`, and on a last stage the
    /// multi-token-prediction module's layer `L` where the model builds one.
    fn stage_layers(&self, spec: &StageSpec) -> Vec<usize> {
        spec.layers.clone().collect()
    }

    /// λ of the multi-token-prediction loss when the model builds that module (its last stage
    /// outputs [`graphpp_graph::names::MTP_LOSS`], λ times the cross-entropy), else 0.
    fn mtp_loss_weight(&self) -> f64 {
        0.0
    }

    /// The buffer `[E]` of MoE layer `layer` that biases its routing for load balance (updated by
    /// the trainer outside the gradient, DeepSeek-V3's auxiliary-loss-free balancing); `None`
    /// for a dense layer.
    fn balance_bias(&self, layer: usize) -> Option<String> {
        let _ = layer;
        None
    }

    /// Checks that the model's routed experts split evenly over expert-parallel degree `ep`
    /// (a model without routed experts accepts any: it has nothing to split).
    ///
    /// # Errors
    /// [`ModelError::Field`] naming `n_routed_experts`.
    fn check_ep(&self, ep: usize) -> Result<(), ModelError> {
        let _ = ep;
        Ok(())
    }

    /// The routed expert (`0..E`) parameter `name` belongs to; `None` for a parameter every
    /// expert-parallel rank holds (attention, norms, gate, shared experts, dense layers).
    fn expert_of(&self, name: &str) -> Option<usize> {
        let _ = name;
        None
    }

    /// Routed experts per MoE layer `E` (0 for a dense model).
    fn routed_experts(&self) -> usize {
        0
    }

    /// How tensor parallelism over `tp` ranks splits parameter `name`, `None` where every rank
    /// of the group holds it whole ([`crate::tensor_parallel::split_of`]).
    fn tensor_parallel_split(&self, name: &str, tp: usize) -> Option<crate::tensor_parallel::Split> {
        let _ = (name, tp);
        None
    }

    /// Checks that tensor-parallel degree `tp` splits the model's heads, key/value heads and
    /// MLP width evenly ([`crate::tensor_parallel::check_divides`]).
    ///
    /// # Errors
    /// [`ModelError::TensorParallel`] naming the field.
    fn check_tp(&self, tp: usize) -> Result<(), ModelError> {
        crate::tensor_parallel::check_divides(tp, &[], None)
    }
}

impl Model for LlamaConfig {
    fn describe(&self) -> String {
        format!("llama, {} layers, hidden {}", self.num_hidden_layers, self.hidden_size)
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    fn num_layers(&self) -> usize {
        self.num_hidden_layers
    }

    fn max_seq_len(&self) -> usize {
        self.max_position_embeddings
    }

    fn build_stage(&self, spec: &StageSpec, opts: &StageOptions) -> Result<Graph, ModelError> {
        crate::llama::build_stage(self, spec, opts)
    }

    fn stage_parameters(&self, spec: &StageSpec) -> Vec<(String, Vec<usize>)> {
        crate::llama::stage_parameters(self, spec)
    }

    fn init_parameters(&self, spec: &StageSpec, seed: u64) -> Vec<(String, Vec<usize>, Vec<f32>)> {
        crate::llama::init_parameters(self, spec, seed)
    }

    fn stage_buffers(&self, seq: usize) -> Vec<(String, Vec<usize>, Vec<f64>)> {
        crate::llama::stage_buffers(self, seq)
    }

    fn parameter_count(&self) -> u128 {
        crate::memory::parameter_count(self)
    }

    fn stage_activation_bytes(&self, spec: &StageSpec, batch: usize, seq: usize) -> u128 {
        crate::memory::stage_activation_bytes(self, spec, batch, seq)
    }

    fn buffer_bytes(&self, seq: usize) -> u128 {
        crate::memory::buffer_bytes(self, seq)
    }

    fn flops_per_token(&self, seq: usize) -> f64 {
        crate::flops::flops_per_token(self, seq)
    }
    fn tensor_parallel_split(&self, name: &str, tp: usize) -> Option<crate::tensor_parallel::Split> {
        crate::tensor_parallel::split_of(name, true, self.kv_heads(), tp)
    }
    fn check_tp(&self, tp: usize) -> Result<(), ModelError> {
        crate::tensor_parallel::check_divides(tp, &self.tensor_parallel_sizes(), Some(self.kv_heads()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// Through the trait object the Llama model answers as its own functions do.
    #[test]
    fn llama_through_the_trait_object() {
        let m: Arc<dyn Model> = Arc::new(LlamaConfig::tiny());
        assert_eq!((m.vocab_size(), m.num_layers()), (256, 4));
        assert_eq!(m.parameter_count(), 234_048);
        let spec = crate::split_layers(4, 2, None).unwrap().remove(1);
        let names: Vec<String> = m.stage_parameters(&spec).into_iter().map(|(n, _)| n).collect();
        assert!(names.contains(&"lm_head.weight".to_string()) && !names.iter().any(|n| n.contains("embed")));
        assert_eq!(m.init_parameters(&spec, 1).len(), names.len());
        assert!(m.describe().starts_with("llama, 4 layers"));
    }
}

/// The models graphpp builds, chosen by preset name or config file: a Llama-style dense decoder
/// or the DeepSeek-style MoE decoder. Serialised as its config object (untagged: an object with
/// the MoE fields is a MoE config), so run records written before the MoE model still read.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(untagged)]
// A config is built once per run and passed by reference: the MoE variant's size costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum ModelConfig {
    /// DeepSeek-style MoE decoder ([`MoeConfig`]).
    Moe(MoeConfig),
    /// Llama-style dense decoder ([`LlamaConfig`]).
    Llama(LlamaConfig),
}

impl ModelConfig {
    /// The presets: `tiny`, `small` (dense), `moe-tiny`, `moe-small` (MoE, Llama attention),
    /// `moe-mla-tiny`, `moe-mla-small` (MoE with multi-head latent attention) and
    /// `deepseek-v3-16b` (the seed's model; too large to train here).
    pub const PRESETS: [&'static str; 7] =
        ["tiny", "small", "moe-tiny", "moe-small", "moe-mla-tiny", "moe-mla-small", "deepseek-v3-16b"];

    /// A preset by name. Errors: [`ModelError::Preset`].
    pub fn preset(name: &str) -> Result<Self, ModelError> {
        match name {
            "tiny" | "small" => Ok(ModelConfig::Llama(LlamaConfig::preset(name)?)),
            _ => Ok(ModelConfig::Moe(MoeConfig::preset(name)?)),
        }
    }

    /// Parses a `config.json`: a MoE config when it has `n_routed_experts` or `model_type`
    /// `deepseek_v3` / `deepseek_v2` ([`MoeConfig::from_json`]), else a Llama one
    /// ([`LlamaConfig::from_json`]). Errors: as those.
    pub fn from_json(text: &str) -> Result<Self, ModelError> {
        let obj = crate::config::json_object(text)?;
        let deepseek = |t: &str| crate::moe::DEEPSEEK_TYPES.contains(&t);
        let moe = obj.contains_key("n_routed_experts")
            || obj.get("model_type").and_then(|v| v.as_str()).is_some_and(deepseek);
        Ok(if moe {
            ModelConfig::Moe(MoeConfig::from_json(text)?)
        } else {
            ModelConfig::Llama(LlamaConfig::from_json(text)?)
        })
    }

    /// The decoder fields (attention, norms, vocabulary, dense MLP).
    pub fn base(&self) -> &LlamaConfig {
        match self {
            ModelConfig::Moe(m) => &m.base,
            ModelConfig::Llama(l) => l,
        }
    }

    /// The decoder fields, to change (e.g. `--layers`).
    pub fn base_mut(&mut self) -> &mut LlamaConfig {
        match self {
            ModelConfig::Moe(m) => &mut m.base,
            ModelConfig::Llama(l) => l,
        }
    }

    /// The model as the runtime takes it.
    pub fn as_model(&self) -> &dyn Model {
        match self {
            ModelConfig::Moe(m) => m,
            ModelConfig::Llama(l) => l,
        }
    }

    /// Multi-token-prediction modules a checkpoint of this model holds after its last layer
    /// (DeepSeek-V3's `num_nextn_predict_layers`; built when `mtp_loss_weight` is above 0); 0 for Llama.
    pub fn mtp_layers(&self) -> usize {
        match self {
            ModelConfig::Moe(m) => m.num_nextn_predict_layers,
            ModelConfig::Llama(_) => 0,
        }
    }

    /// Checks the config. Errors: [`ModelError::Field`], [`ModelError::Unsupported`].
    pub fn validate(&self) -> Result<(), ModelError> {
        match self {
            ModelConfig::Moe(m) => m.validate(),
            ModelConfig::Llama(l) => l.validate(),
        }
    }
}

impl Model for ModelConfig {
    fn describe(&self) -> String {
        self.as_model().describe()
    }
    fn vocab_size(&self) -> usize {
        self.as_model().vocab_size()
    }
    fn num_layers(&self) -> usize {
        self.as_model().num_layers()
    }
    fn max_seq_len(&self) -> usize {
        self.as_model().max_seq_len()
    }
    fn build_stage(&self, spec: &StageSpec, opts: &StageOptions) -> Result<Graph, ModelError> {
        self.as_model().build_stage(spec, opts)
    }
    fn stage_parameters(&self, spec: &StageSpec) -> Vec<(String, Vec<usize>)> {
        self.as_model().stage_parameters(spec)
    }
    fn init_parameters(&self, spec: &StageSpec, seed: u64) -> Vec<(String, Vec<usize>, Vec<f32>)> {
        self.as_model().init_parameters(spec, seed)
    }
    fn stage_buffers(&self, seq: usize) -> Vec<(String, Vec<usize>, Vec<f64>)> {
        self.as_model().stage_buffers(seq)
    }
    fn parameter_count(&self) -> u128 {
        self.as_model().parameter_count()
    }
    fn stage_activation_bytes(&self, spec: &StageSpec, batch: usize, seq: usize) -> u128 {
        self.as_model().stage_activation_bytes(spec, batch, seq)
    }
    fn buffer_bytes(&self, seq: usize) -> u128 {
        self.as_model().buffer_bytes(seq)
    }
    fn flops_per_token(&self, seq: usize) -> f64 {
        self.as_model().flops_per_token(seq)
    }
    fn moe_layers(&self) -> Vec<(usize, usize)> {
        self.as_model().moe_layers()
    }
    fn stage_layers(&self, spec: &StageSpec) -> Vec<usize> {
        self.as_model().stage_layers(spec)
    }
    fn mtp_loss_weight(&self) -> f64 {
        self.as_model().mtp_loss_weight()
    }
    fn buffer_dtype(&self, name: &str, compute: graphpp_graph::DType) -> graphpp_graph::DType {
        self.as_model().buffer_dtype(name, compute)
    }
    fn balance_bias(&self, layer: usize) -> Option<String> {
        self.as_model().balance_bias(layer)
    }
    fn check_ep(&self, ep: usize) -> Result<(), ModelError> {
        self.as_model().check_ep(ep)
    }
    fn expert_of(&self, name: &str) -> Option<usize> {
        self.as_model().expert_of(name)
    }
    fn routed_experts(&self) -> usize {
        self.as_model().routed_experts()
    }
    fn tensor_parallel_split(&self, name: &str, tp: usize) -> Option<crate::tensor_parallel::Split> {
        self.as_model().tensor_parallel_split(name, tp)
    }
    fn check_tp(&self, tp: usize) -> Result<(), ModelError> {
        self.as_model().check_tp(tp)
    }
}
