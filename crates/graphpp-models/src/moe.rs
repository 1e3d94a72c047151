//! DeepSeek-style mixture-of-experts decoder (DeepSeek-V3 technical report, Liu et al. 2024,
//! §2.1.2 "DeepSeekMoE with auxiliary-loss-free load balancing"; Hugging Face
//! `DeepseekV3Config` field names and `modeling_deepseek_v3.py` semantics): a Llama decoder
//! ([`crate::llama`]: attention, norms, embedding and head) whose layers from
//! `first_k_dense_replace` on replace the dense MLP by `n_shared_experts` shared experts and
//! `n_routed_experts` routed experts, `num_experts_per_tok` of them per token.
//!
//! **Routing** (per token `x`, `E` routed experts, `k` per token): scores `s = σ(x·W_gᵀ)` (or a
//! softmax with `scoring_func = "softmax"`); the experts are the top `k` of `s + b`, where `b` is
//! the load-balancing bias (buffer `…mlp.gate.e_score_correction_bias`, updated outside the
//! gradient); their weights are the *unbiased* scores, normalised to sum 1 when `norm_topk_prob`,
//! times `routed_scaling_factor`. The output is `Σ_k w_k · expert_k(x) + shared(x)`; each expert
//! and the shared block is a SwiGLU MLP (`moe_intermediate_size` wide; the shared one
//! `n_shared_experts` times as wide). Gradients reach the gate through the weights, not through
//! the choice.
//!
//! **Dropless, static shapes.** Every token's `k` copies (`R = B·T·k` rows in all) are sorted by
//! expert ([`Op::SortByExpert`]), each expert multiplies its contiguous segment
//! ([`Op::SegmentMatmul`], segment lengths from [`Op::Bincount`]), and the rows are put back and
//! weighted. No token is dropped and every tensor the graph sees has a static shape; only the
//! segment lengths depend on the data.
//!
//! **Group-limited routing** (DeepSeek-V2 §2.1.3 "device-limited routing", V3 §2.1.2
//! "node-limited routing"; HF `n_group`, `topk_group`, `topk_method`): with `n_group > 1` the
//! `E` experts form `n_group` groups of `E / n_group`; each group is scored (V3 `noaux_tc`: the
//! sum of its two best biased scores; V2 `group_limited_greedy`: its best score), only the
//! experts of the token's best `topk_group` groups stay candidates, and the top `k` is taken
//! among them. V2's `greedy` ignores the groups.
//!
//! **Attention** is multi-head latent attention ([`crate::mla`]) where the config has MLA fields
//! or a DeepSeek `model_type` (`deepseek_v3`, `deepseek_v2`, whose HF configs default to MLA),
//! else Llama's grouped-query attention (graphpp's `moe-tiny` and `moe-small`).
//!
//! [`Op::SortByExpert`]: graphpp_graph::Op::SortByExpert
//! [`Op::SegmentMatmul`]: graphpp_graph::Op::SegmentMatmul
//! [`Op::Bincount`]: graphpp_graph::Op::Bincount

use std::collections::HashMap;

use graphpp_graph::layers::{activation, linear};
use graphpp_graph::names::{AUX_LOSS, EXPERT_LOAD};
use graphpp_graph::{
    CollectiveKind, CommGroup, Graph, GraphBuilder, InputKind, MeshAxis, Region, TensorType, ValueId,
};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::{json_object, LlamaConfig, ModelError};
use crate::llama::{
    build_decoder, decoder_parameters, init_values, mlp_at, mlp_parameters, DenseMlp, ExpertShard,
    FeedForward, GroupedQueryAttention, ParamsAt, SelfAttention, StageOptions, StageSpec,
};
use crate::mla::{LatentAttention, MlaConfig, Yarn, MLA_FIELDS};
use crate::tensor_parallel::{shard_values, split_of, Split, TensorShard};

/// How the gate turns logits into scores (HF `scoring_func`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScoringFunc {
    /// Independent sigmoid per expert (DeepSeek-V3).
    #[default]
    Sigmoid,
    /// Softmax over the experts (DeepSeek-V2, Mixtral-style).
    Softmax,
}

/// How a token's experts are chosen among groups (HF `topk_method`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TopkMethod {
    /// Top `k` of all experts, groups ignored (DeepSeek-V2's `greedy`).
    Greedy,
    /// Groups scored by their best expert (DeepSeek-V2's `group_limited_greedy`).
    GroupLimitedGreedy,
    /// Groups scored by the sum of their two best biased scores (DeepSeek-V3's `noaux_tc`).
    #[default]
    NoauxTc,
}

fn default_true() -> bool {
    true
}
fn default_one() -> usize {
    1
}
fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// The MoE decoder's config: the Llama fields ([`LlamaConfig`], flattened: the same JSON object)
/// plus DeepSeek-V3's MoE fields. The five size fields have no default: a config that lacks one
/// is refused naming it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    /// Attention, norms, embedding, head and the dense layers' MLP.
    #[serde(flatten)]
    pub base: LlamaConfig,
    /// Routed experts `E` per MoE layer.
    pub n_routed_experts: usize,
    /// Shared experts (one SwiGLU MLP `n_shared_experts × moe_intermediate_size` wide; 0: none).
    pub n_shared_experts: usize,
    /// Routed experts per token `k`.
    pub num_experts_per_tok: usize,
    /// Inner width of each expert's SwiGLU MLP.
    pub moe_intermediate_size: usize,
    /// Layers `0..first_k_dense_replace` keep the dense MLP (`intermediate_size` wide).
    pub first_k_dense_replace: usize,
    /// Factor on the routed experts' weights.
    pub routed_scaling_factor: f64,
    /// Gate scores: sigmoid (default) or softmax.
    #[serde(default)]
    pub scoring_func: ScoringFunc,
    /// Normalise the `k` chosen weights to sum 1 (HF default true).
    #[serde(default = "default_true")]
    pub norm_topk_prob: bool,
    /// Expert groups for group-limited routing (1: none).
    #[serde(default = "default_one")]
    pub n_group: usize,
    /// Groups a token may route to.
    #[serde(default = "default_one")]
    pub topk_group: usize,
    /// How groups are scored (or ignored).
    #[serde(default)]
    pub topk_method: TopkMethod,
    /// Weight α of the sequence-wise auxiliary balance loss (DeepSeek-V3 §2.1.2, eqs. 17–20;
    /// HF `aux_loss_alpha`, `seq_aux` true); 0 (the default): none, balancing is auxiliary-loss-free
    /// only. See [`MoeConfig::aux_loss`].
    #[serde(default)]
    pub aux_loss_alpha: f64,
    /// Multi-head latent attention in place of Llama's ([`crate::mla`]); `None`: Llama attention.
    #[serde(flatten, default)]
    pub mla: Option<MlaConfig>,
    /// YaRN RoPE scaling (HF `rope_scaling`; MLA configs only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<Yarn>,
    /// Multi-token-prediction modules after the last layer (DeepSeek-V3 §2.2; HF
    /// `num_nextn_predict_layers`): built (one, as layer `L`) when [`MoeConfig::mtp_loss_weight`]
    /// is above 0; otherwise read so that a checkpoint's layers `L..L + n` are known for what
    /// they are (`--init-from` skips them).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub num_nextn_predict_layers: usize,
    /// λ, the weight of the multi-token-prediction loss in the objective (DeepSeek-V3 §2.2, eq.
    /// 25: 0.3, then 0.1, in its pre-training); graphpp's own field, not Hugging Face's. 0 (the
    /// default): the module is not built.
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub mtp_loss_weight: f64,
}

fn is_zero_f64(x: &f64) -> bool {
    *x == 0.0
}

/// The `model_type`s of DeepSeek's MoE configs.
pub(crate) const DEEPSEEK_TYPES: [&str; 2] = ["deepseek_v3", "deepseek_v2"];

impl MoeConfig {
    /// `moe-tiny`: the `tiny` decoder (D=64, 4 layers, 4 heads) with layers 1–3 MoE: 8 routed
    /// experts, 2 per token, 1 shared, each 48 wide (active FFN width 3·48 = 144, dense 176).
    pub fn tiny() -> Self {
        MoeConfig {
            base: LlamaConfig::tiny(),
            n_routed_experts: 8,
            n_shared_experts: 1,
            num_experts_per_tok: 2,
            moe_intermediate_size: 48,
            first_k_dense_replace: 1,
            routed_scaling_factor: 1.0,
            scoring_func: ScoringFunc::Sigmoid,
            norm_topk_prob: true,
            n_group: 1,
            topk_group: 1,
            topk_method: TopkMethod::NoauxTc,
            aux_loss_alpha: 0.0,
            mla: None,
            rope_scaling: None,
            num_nextn_predict_layers: 0,
            mtp_loss_weight: 0.0,
        }
    }

    /// `moe-small`: the `small` decoder (D=256, 8 layers) with layers 1–7 MoE: 16 routed experts,
    /// 2 per token, 1 shared, each 192 wide.
    pub fn small() -> Self {
        MoeConfig {
            base: LlamaConfig::small(),
            n_routed_experts: 16,
            moe_intermediate_size: 192,
            ..Self::tiny()
        }
    }

    /// `moe-mla-tiny`: `moe-tiny` with multi-head latent attention (query latent 48, key/value
    /// latent 32, per head 16 + 8 RoPE query/key dims and 16 value dims) and group-limited
    /// routing (4 groups of 2 experts, the best 2 groups per token).
    pub fn mla_tiny() -> Self {
        let mla = MlaConfig {
            q_lora_rank: Some(48),
            kv_lora_rank: 32,
            qk_nope_head_dim: 16,
            qk_rope_head_dim: 8,
            v_head_dim: 16,
            rope_interleave: true,
        };
        let mut cfg = MoeConfig { n_group: 4, topk_group: 2, mla: Some(mla), ..Self::tiny() };
        cfg.apply_mla();
        cfg
    }

    /// `moe-mla-small`: `moe-small` with the 16B's attention and routing at small scale: MLA with a
    /// full-rank `q_proj`, key/value latent 64, per head 32 + 16 query/key dims and 32 value
    /// dims; softmax scores, weights not renormalised.
    pub fn mla_small() -> Self {
        let mla = MlaConfig {
            q_lora_rank: None,
            kv_lora_rank: 64,
            qk_nope_head_dim: 32,
            qk_rope_head_dim: 16,
            v_head_dim: 32,
            rope_interleave: true,
        };
        let mut cfg = MoeConfig {
            scoring_func: ScoringFunc::Softmax,
            norm_topk_prob: false,
            mla: Some(mla),
            ..Self::small()
        };
        cfg.apply_mla();
        cfg
    }

    /// `deepseek-v3-16b`: the seed's DeepSeek-V3 16B (TorchTitan's `deepseek_v3` flavour `16B`,
    /// DeepSeek-V2-Lite's shape): V=102400, D=2048, 27 layers (the first dense, 10944 wide), 16
    /// heads of MLA (full-rank `q_proj`, key/value latent 512, 128 + 64 query/key dims, 128
    /// value dims), 64 routed experts of 1408 with 6 per token and 2 shared, softmax scores not
    /// renormalised, YaRN ×40 over a 4096-token original context (mscale 0.707 both). 15.7 B
    /// parameters: for `graph --stats`, `profile`, `plan` and the simulator; too large to train here.
    pub fn deepseek_v3_16b() -> Self {
        let base = LlamaConfig {
            vocab_size: 102_400,
            hidden_size: 2048,
            intermediate_size: 10_944,
            num_hidden_layers: 27,
            num_attention_heads: 16,
            rms_norm_eps: 1e-6,
            max_position_embeddings: 163_840,
            ..LlamaConfig::tiny()
        };
        let mla = MlaConfig {
            q_lora_rank: None,
            kv_lora_rank: 512,
            qk_nope_head_dim: 128,
            qk_rope_head_dim: 64,
            v_head_dim: 128,
            rope_interleave: true,
        };
        let yarn = Yarn {
            factor: 40.0,
            original_max_position_embeddings: 4096,
            beta_fast: Some(32.0),
            beta_slow: Some(1.0),
            mscale: Some(0.707),
            mscale_all_dim: Some(0.707),
            attention_factor: None,
            truncate: None,
        };
        let mut cfg = MoeConfig {
            base,
            n_routed_experts: 64,
            n_shared_experts: 2,
            num_experts_per_tok: 6,
            moe_intermediate_size: 1408,
            first_k_dense_replace: 1,
            routed_scaling_factor: 1.0,
            scoring_func: ScoringFunc::Softmax,
            norm_topk_prob: false,
            n_group: 1,
            topk_group: 1,
            topk_method: TopkMethod::Greedy,
            aux_loss_alpha: 0.0,
            mla: Some(mla),
            rope_scaling: Some(yarn),
            num_nextn_predict_layers: 0,
            mtp_loss_weight: 0.0,
        };
        cfg.apply_mla();
        cfg
    }

    /// A preset by name (`moe-tiny`, `moe-small`, `moe-mla-tiny`, `moe-mla-small`,
    /// `deepseek-v3-16b`). Errors: [`ModelError::Preset`].
    pub fn preset(name: &str) -> Result<Self, ModelError> {
        match name {
            "moe-tiny" => Ok(Self::tiny()),
            "moe-small" => Ok(Self::small()),
            "moe-mla-tiny" => Ok(Self::mla_tiny()),
            "moe-mla-tiny-mtp" => {
                Ok(Self { num_nextn_predict_layers: 1, mtp_loss_weight: 0.3, ..Self::mla_tiny() })
            }
            "moe-mla-small" => Ok(Self::mla_small()),
            "deepseek-v3-16b" => Ok(Self::deepseek_v3_16b()),
            other => Err(ModelError::Preset(other.into())),
        }
    }

    /// Sets the decoder fields that MLA decides ([`MlaConfig::apply`]); nothing without MLA.
    fn apply_mla(&mut self) {
        if let Some(m) = &self.mla {
            m.apply(&mut self.base);
        }
    }

    /// Parses a `config.json` with DeepSeek MoE fields: `model_type` absent, `deepseek_v3` or
    /// `deepseek_v2`; multi-head latent attention when a DeepSeek `model_type` or any MLA field
    /// is given ([`MlaConfig::take`], HF defaults for absent fields), with YaRN from
    /// `rope_scaling` ([`Yarn::take`]); `topk_method` defaulting to `greedy` for `deepseek_v2`
    /// and `noaux_tc` otherwise; `moe_layer_freq` 1, `seq_aux` absent or true; the Llama fields
    /// as [`LlamaConfig::from_json`] reads them. Errors: [`ModelError::Json`] (naming a missing
    /// field), [`ModelError::Unsupported`], [`ModelError::Field`].
    pub fn from_json(text: &str) -> Result<Self, ModelError> {
        let mut obj = json_object(text)?;
        let set =
            |obj: &serde_json::Map<String, Value>, k: &str| obj.get(k).filter(|v| !v.is_null()).cloned();
        let model_type = set(&obj, "model_type");
        if let Some(v) = &model_type {
            if !v.as_str().is_some_and(|t| DEEPSEEK_TYPES.contains(&t)) {
                let reason =
                    "a MoE config is DeepSeek style (model_type deepseek_v3 or deepseek_v2, or none)";
                return Err(ModelError::Unsupported { field: "model_type", value: v.to_string(), reason });
            }
            obj.remove("model_type");
        }
        let v2 = model_type.as_ref().and_then(|v| v.as_str()) == Some("deepseek_v2");
        let mla = (model_type.is_some() || MLA_FIELDS.iter().any(|f| obj.contains_key(*f)))
            .then(|| MlaConfig::take(&mut obj))
            .transpose()?;
        let rope_scaling = if mla.is_some() { Yarn::take(&mut obj)? } else { None };
        if v2 && !obj.contains_key("topk_method") {
            obj.insert("topk_method".into(), Value::String("greedy".into()));
        }
        let alpha = set(&obj, "aux_loss_alpha").and_then(|v| v.as_f64()).unwrap_or(0.0);
        if let Some(v) = set(&obj, "seq_aux").filter(|v| v.as_bool() == Some(false) && alpha != 0.0) {
            let reason = "only the sequence-wise auxiliary loss is implemented (seq_aux true)";
            return Err(ModelError::Unsupported { field: "seq_aux", value: v.to_string(), reason });
        }
        obj.remove("seq_aux");
        if let Some(v) = set(&obj, "moe_layer_freq").filter(|v| v.as_f64() != Some(1.0)) {
            let reason = "every layer from first_k_dense_replace on is MoE (moe_layer_freq 1)";
            return Err(ModelError::Unsupported { field: "moe_layer_freq", value: v.to_string(), reason });
        }
        crate::config::check_supported(&obj)?;
        obj.retain(|_, v| !v.is_null());
        let mut cfg: MoeConfig = serde_json::from_value(Value::Object(obj.clone()))
            .map_err(|e| ModelError::Json(e.to_string()))?;
        cfg.base = LlamaConfig::from_object(obj)?;
        (cfg.mla, cfg.rope_scaling) = (mla, rope_scaling);
        cfg.apply_mla();
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the MoE fields (and the Llama ones). Errors: [`ModelError::Field`] naming the field,
    /// [`ModelError::Unsupported`] for group-limited routing.
    pub fn validate(&self) -> Result<(), ModelError> {
        self.base.validate()?;
        let bad = |field, reason: String| Err(ModelError::Field { field, reason });
        let w = self.mtp_loss_weight;
        if !(w.is_finite() && w >= 0.0) {
            return bad("mtp_loss_weight", format!("{w} must be a finite number ≥ 0"));
        }
        if w > 0.0 && self.num_nextn_predict_layers != 1 {
            return bad(
                "num_nextn_predict_layers",
                format!(
                    "{} with mtp_loss_weight {w}: one multi-token-prediction module is built (set it to 1)",
                    self.num_nextn_predict_layers
                ),
            );
        }
        if self.n_routed_experts == 0 {
            return bad("n_routed_experts", "must be > 0".into());
        }
        if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.n_routed_experts {
            return bad(
                "num_experts_per_tok",
                format!(
                    "{} must be in 1..={} (n_routed_experts)",
                    self.num_experts_per_tok, self.n_routed_experts
                ),
            );
        }
        if self.moe_intermediate_size == 0 {
            return bad("moe_intermediate_size", "must be > 0".into());
        }
        if self.first_k_dense_replace > self.base.num_hidden_layers {
            return bad(
                "first_k_dense_replace",
                format!(
                    "{} exceeds num_hidden_layers {}",
                    self.first_k_dense_replace, self.base.num_hidden_layers
                ),
            );
        }
        if !(self.routed_scaling_factor.is_finite() && self.routed_scaling_factor > 0.0) {
            return bad(
                "routed_scaling_factor",
                format!("{} must be a finite number > 0", self.routed_scaling_factor),
            );
        }
        if !(self.aux_loss_alpha.is_finite() && self.aux_loss_alpha >= 0.0) {
            return bad("aux_loss_alpha", format!("{} must be a finite number ≥ 0", self.aux_loss_alpha));
        }
        if self.num_moe_layers() == 0 {
            return bad(
                "first_k_dense_replace",
                format!(
                    "{} leaves no MoE layer in {} layers (a dense model is a llama config)",
                    self.first_k_dense_replace, self.base.num_hidden_layers
                ),
            );
        }
        self.validate_groups()?;
        if let Some(m) = &self.mla {
            m.validate()?;
            // RoPE runs over the query/key RoPE dims: HF sets head_dim to them ([`MlaConfig::apply`]).
            if self.base.head_dim() != m.qk_rope_head_dim {
                let reason = format!(
                    "{} must equal qk_rope_head_dim {} with multi-head latent attention",
                    self.base.head_dim(),
                    m.qk_rope_head_dim
                );
                return Err(ModelError::Field { field: "head_dim", reason });
            }
        } else if self.rope_scaling.is_some() {
            let reason = "YaRN is implemented for multi-head latent attention (DeepSeek) configs only";
            return Err(ModelError::Unsupported { field: "rope_scaling", value: "yarn".into(), reason });
        }
        Ok(())
    }

    /// Checks group-limited routing: `n_group` divides `E`, `topk_group` is in `1..=n_group`,
    /// the kept groups hold `k` experts at least, and `noaux_tc` groups two at least (their
    /// score sums the best two). Errors: [`ModelError::Field`].
    fn validate_groups(&self) -> Result<(), ModelError> {
        let (e, g, tg) = (self.n_routed_experts, self.n_group, self.topk_group);
        let bad = |field, reason: String| Err(ModelError::Field { field, reason });
        if g == 0 || !e.is_multiple_of(g) {
            return bad("n_group", format!("{g} must divide n_routed_experts {e}"));
        }
        if !self.grouped() {
            return Ok(());
        }
        if tg == 0 || tg > g {
            return bad("topk_group", format!("{tg} must be in 1..={g} (n_group)"));
        }
        if tg * (e / g) < self.num_experts_per_tok {
            let k = self.num_experts_per_tok;
            return bad("topk_group", format!("{tg} groups of {} experts cannot hold {k} per token", e / g));
        }
        if self.topk_method == TopkMethod::NoauxTc && e / g < 2 {
            return bad(
                "n_group",
                format!("noaux_tc scores a group by its best two experts; {g} groups of {e} have one"),
            );
        }
        Ok(())
    }

    /// Whether routing is group-limited: more than one group and a grouped `topk_method`.
    pub fn grouped(&self) -> bool {
        self.n_group > 1 && self.topk_method != TopkMethod::Greedy
    }

    /// The self-attention block: MLA with its config, else Llama's.
    fn attention(&self) -> Box<dyn SelfAttention + '_> {
        match &self.mla {
            Some(mla) => {
                Box::new(LatentAttention { mla, base: &self.base, yarn: self.rope_scaling.as_ref() })
            }
            None => Box::new(GroupedQueryAttention(&self.base)),
        }
    }

    /// Checks that an expert-parallel degree `ep` splits the routed experts evenly. Errors:
    /// [`ModelError::Field`] naming `n_routed_experts`.
    pub fn check_ep(&self, ep: usize) -> Result<(), ModelError> {
        if ep == 0 || !self.n_routed_experts.is_multiple_of(ep) {
            let reason = format!(
                "{} routed experts do not split evenly over an expert-parallel degree of {ep}",
                self.n_routed_experts
            );
            return Err(ModelError::Field { field: "n_routed_experts", reason });
        }
        Ok(())
    }

    /// Number of MoE layers (`num_hidden_layers − first_k_dense_replace`, 0 if that is negative).
    pub fn num_moe_layers(&self) -> usize {
        self.base.num_hidden_layers.saturating_sub(self.first_k_dense_replace)
    }

    /// Whether decoder layer `layer` is a MoE layer.
    pub fn is_moe(&self, layer: usize) -> bool {
        layer >= self.first_k_dense_replace
    }

    /// The multi-token-prediction module, when built ([`MoeConfig::mtp_loss_weight`] above 0):
    /// layer `L` (after the `L` decoder layers, as DeepSeek-V3's checkpoints number it), a MoE
    /// layer, weighted by λ.
    pub fn mtp(&self) -> Option<crate::llama::Mtp> {
        (self.mtp_loss_weight > 0.0)
            .then_some(crate::llama::Mtp { layer: self.base.num_hidden_layers, weight: self.mtp_loss_weight })
    }

    /// The MoE layers: `first_k_dense_replace..L`, and the multi-token-prediction module's.
    fn moe_layer_ids(&self) -> impl Iterator<Item = usize> + '_ {
        let mtp = self.mtp().map(|m| m.layer);
        (0..self.base.num_hidden_layers).filter(|&l| self.is_moe(l)).chain(mtp)
    }

    /// Name of layer `layer`'s load-balancing bias buffer `[E]`.
    pub fn bias_name(layer: usize) -> String {
        format!("model.layers.{layer}.mlp.gate.e_score_correction_bias")
    }

    /// Parameters of stage `spec` in the stage graph's input order (see [`crate::stage_parameters`]).
    pub fn stage_parameters(&self, spec: &StageSpec) -> Vec<(String, Vec<usize>)> {
        decoder_parameters(&self.base, spec, &*self.attention(), self, self.mtp())
    }

    /// How tensor parallelism over `tp` ranks splits parameter `name`
    /// ([`crate::tensor_parallel::split_of`]): the grouped-query attention, the dense layers'
    /// MLPs, the embedding and the head split; multi-head latent attention, the router and the
    /// experts are replicated.
    pub fn tensor_parallel_split(&self, name: &str, tp: usize) -> Option<Split> {
        split_of(name, self.mla.is_none(), self.base.kv_heads(), tp)
    }

    /// The forward graph of stage `spec` ([`crate::build_stage`]'s interface; a MoE layer also
    /// reads its bias buffer). Errors: config, shape, or graph building.
    pub fn build_stage(&self, spec: &StageSpec, opts: &StageOptions) -> Result<Graph, ModelError> {
        self.validate()?;
        self.check_ep(spec.ep.size)?;
        build_decoder(&self.base, spec, opts, &*self.attention(), self, self.mtp())
    }

    /// Initial parameters ([`crate::init_parameters`]' rules; the gate and every expert matrix
    /// normal(0, `initializer_range`)).
    pub fn init_parameters(&self, spec: &StageSpec, seed: u64) -> Vec<(String, Vec<usize>, Vec<f32>)> {
        let whole = StageSpec { tp: TensorShard::WHOLE, ..spec.clone() };
        let values = init_values(self.stage_parameters(&whole), self.base.initializer_range, seed);
        shard_values(values, spec.tp, |n| self.tensor_parallel_split(n, spec.tp.size))
    }

    /// Buffers: the Llama ones ([`crate::stage_buffers`]) and a zero bias `[E]` per MoE layer.
    pub fn stage_buffers(&self, seq: usize) -> Vec<(String, Vec<usize>, Vec<f64>)> {
        let mut out = crate::llama::scaled_buffers(&self.base, seq, self.rope_scaling.as_ref());
        let e = self.n_routed_experts;
        out.extend(self.moe_layer_ids().map(|l| (Self::bias_name(l), vec![e], vec![0.0; e])));
        out
    }
}

impl FeedForward for MoeConfig {
    fn parameters(&self, layer: usize, ep: ExpertShard, out: &mut Vec<(String, Vec<usize>)>) {
        if !self.is_moe(layer) {
            return DenseMlp(&self.base).parameters(layer, ep, out);
        }
        let (d, f, pre) =
            (self.base.hidden_size, self.moe_intermediate_size, format!("model.layers.{layer}.mlp"));
        out.push((format!("{pre}.gate.weight"), vec![self.n_routed_experts, d]));
        for e in ep.experts(self.n_routed_experts) {
            mlp_parameters(out, &format!("{pre}.experts.{e}"), d, f, false);
        }
        if self.n_shared_experts > 0 {
            mlp_parameters(out, &format!("{pre}.shared_experts"), d, f * self.n_shared_experts, false);
        }
    }

    fn build(
        &self,
        b: &mut GraphBuilder,
        layer: usize,
        (ep, tp): (ExpertShard, TensorShard),
        h: ValueId,
        params: &HashMap<String, ValueId>,
    ) -> Result<ValueId, ModelError> {
        if !self.is_moe(layer) {
            return DenseMlp(&self.base).build(b, layer, (ep, tp), h, params);
        }
        let pre = format!("model.layers.{layer}.mlp");
        let p = ParamsAt { all: params, pre: &pre };
        let shape = b.shape(h);
        let (n, d) = (shape[..shape.len() - 1].iter().product::<usize>(), self.base.hidden_size);
        let x = b.reshape(h, vec![n, d])?;
        b.push_scope("gate");
        // The bias is state updated by ±γ steps: kept in the wide dtype (f32 under bf16).
        let wide = TensorType::new(b.ty(x).dtype.wide(), vec![self.n_routed_experts]);
        let bias = b.input_typed(&Self::bias_name(layer), InputKind::Buffer, wide)?;
        let (ids, weights, scores) = self.route(b, x, p.weight("gate"), bias)?;
        if self.aux_loss_alpha > 0.0 {
            let aux = self.aux_loss(b, scores, ids, &shape)?;
            b.output(&format!("{AUX_LOSS}{layer}"), aux);
        }
        b.pop_scope();
        b.push_scope("experts");
        let w = |e: usize, s: &str| p.weight(&format!("experts.{e}.{s}"));
        let routed = self.experts(b, layer, ep, x, ids, weights, &w)?;
        b.pop_scope();
        // The shared experts follow the dense rules under tensor parallelism (column-parallel
        // gate/up, row-parallel down, an all-reduce after it); the router and the routed experts
        // are computed whole on every tp rank.
        let y = if self.n_shared_experts > 0 {
            let shared = format!("{pre}.shared_experts");
            let s = b.scoped("shared_experts", |b| {
                let x = tp.enter(b, x)?;
                let s = mlp_at(b, x, params, &shared, self.base.hidden_act)?;
                tp.exit(b, s, None)
            })?;
            b.add2(routed, s)?
        } else {
            routed
        };
        Ok(b.reshape(y, shape)?)
    }
}

impl MoeConfig {
    /// The gate: for `x [N, D]`, the chosen experts `[N, k]` (u32), their weights `[N, k]` and
    /// every expert's score `[N, E]` (wide dtype).
    fn route(
        &self,
        b: &mut GraphBuilder,
        x: ValueId,
        gate: ValueId,
        bias: ValueId,
    ) -> Result<(ValueId, ValueId, ValueId), ModelError> {
        let k = self.num_experts_per_tok;
        // The gate in the wide dtype (f32 under bf16), as Hugging Face casts its input and
        // weight before the gate's linear: a bf16 rounding must not change the choice.
        let dtype = b.ty(x).dtype;
        let (xw, gw) = (b.cast(x, dtype.wide())?, b.cast(gate, dtype.wide())?);
        let logits = linear(b, xw, gw)?;
        let scores = match self.scoring_func {
            ScoringFunc::Sigmoid => b.sigmoid(logits)?,
            ScoringFunc::Softmax => b.softmax(logits, 1)?,
        };
        let bias = b.cast(bias, dtype.wide())?;
        let choice = b.add2(scores, bias)?;
        let choice = if self.grouped() { self.limit_groups(b, choice)? } else { choice };
        let ids = b.topk(choice, k)?;
        let mut w = b.gather(scores, ids, 1)?;
        if self.norm_topk_prob {
            let sum = b.sum(w, 1, true)?;
            let sum = b.affine(sum, 1.0, 1e-20)?;
            w = b.div(w, sum)?;
        }
        let w = b.scale(w, self.routed_scaling_factor)?;
        Ok((ids, b.cast(w, dtype)?, scores))
    }

    /// Group-limited routing's candidates: `choice [N, E]` with every expert outside the token's
    /// best `topk_group` groups pushed down by 1e30 (HF masks them with −∞), so that the top `k`
    /// comes from those groups only. A group's score is the sum of its two best entries
    /// (`noaux_tc`) or its best (`group_limited_greedy`). No gradient flows here: the choice only
    /// feeds [`graphpp_graph::Op::TopK`].
    fn limit_groups(&self, b: &mut GraphBuilder, choice: ValueId) -> Result<ValueId, ModelError> {
        const FAR: f64 = 1e30;
        let [n, e] = b.shape(choice)[..] else { unreachable!("choice is [N, E]") };
        let (g, tg) = (self.n_group, self.topk_group);
        b.push_scope("group_limit");
        let groups = b.reshape(choice, vec![n, g, e / g])?;
        let score = if self.topk_method == TopkMethod::NoauxTc {
            let best2 = b.topk(groups, 2)?;
            let best2 = b.gather(groups, best2, 2)?;
            b.sum(best2, 2, false)?
        } else {
            b.max(groups, 2, false)?
        };
        let kept = b.topk(score, tg)?;
        let zero = b.full_like(0.0, score)?;
        let one = b.full(1.0, vec![n, tg])?;
        let one = b.cast(one, b.ty(score).dtype)?;
        let mask = b.scatter_add(zero, kept, one, 1)?;
        let penalty = b.affine(mask, FAR, -FAR)?;
        let penalty = b.reshape(penalty, vec![n, g, 1])?;
        let penalty = b.broadcast(penalty, vec![n, g, e / g])?;
        let penalty = b.reshape(penalty, vec![n, e])?;
        let limited = b.add2(choice, penalty)?;
        b.pop_scope();
        Ok(limited)
    }

    /// The sequence-wise auxiliary balance loss of one layer (DeepSeek-V3 §2.1.2, eqs. 17–20),
    /// averaged over the microbatch's `B` sequences of `T` tokens (`shape` = `[B, T, D]`):
    /// `α · Σ_i f_i · P_i` with `f_i = E / (k·T) · (tokens of the sequence routed to expert i)`
    /// and `P_i = 1/T · Σ_t s_{i,t} / Σ_j s_{j,t}` (`scores [N, E]`, `ids [N, k]`). `f` counts the
    /// experts actually chosen — with the balancing bias, as Megatron-LM's sequence aux loss does
    /// — and carries no gradient; `P` does. A scalar in the scores' (wide) dtype.
    fn aux_loss(
        &self,
        b: &mut GraphBuilder,
        scores: ValueId,
        ids: ValueId,
        shape: &[usize],
    ) -> Result<ValueId, ModelError> {
        let (e, k) = (self.n_routed_experts, self.num_experts_per_tok);
        let [batch, t, _] = shape[..] else {
            return Err(ModelError::Field {
                field: "hidden_size",
                reason: format!("MoE input {shape:?} is not [B, T, D]"),
            });
        };
        b.push_scope("aux_loss");
        let wide = b.ty(scores).dtype;
        let total = b.sum(scores, 1, true)?;
        let share = b.div(scores, total)?;
        let share = b.reshape(share, vec![batch, t, e])?;
        let p = b.sum(share, 1, false)?;
        let ids = b.reshape(ids, vec![batch, t * k])?;
        let zero = b.full_like(0.0, p)?;
        let one = b.full(1.0, vec![batch, t * k])?;
        let one = b.cast(one, wide)?;
        let f = b.scatter_add(zero, ids, one, 1)?;
        let fp = b.mul(f, p)?;
        let per_seq = b.sum(fp, 1, false)?;
        let sum = b.sum(per_seq, 0, false)?;
        // f's E/(k·T), P's 1/T, the mean over B sequences, and α.
        let c = self.aux_loss_alpha * e as f64 / (k * t * t * batch) as f64;
        let aux = b.scale(sum, c)?;
        b.pop_scope();
        Ok(aux)
    }

    /// The routed experts: each token's `k` rows sorted by expert, one SwiGLU per segment, put
    /// back and summed with their weights. `w(e, proj)` is expert `e`'s matrix (held for the
    /// experts of `ep`). The segment lengths are also the output `expert_load.<layer>`. Under
    /// expert parallelism the sorted rows go to the ranks holding their experts and come back
    /// ([`MoeConfig::dispatch`], [`MoeConfig::combine`]).
    #[allow(clippy::too_many_arguments)]
    fn experts(
        &self,
        b: &mut GraphBuilder,
        layer: usize,
        ep: ExpertShard,
        x: ValueId,
        ids: ValueId,
        weights: ValueId,
        w: &dyn Fn(usize, &str) -> ValueId,
    ) -> Result<ValueId, ModelError> {
        let (e, k) = (self.n_routed_experts, self.num_experts_per_tok);
        let [n, d] = b.shape(x)[..] else { unreachable!("x is [N, D]") };
        let flat = b.reshape(ids, vec![n * k])?;
        let order = b.sort_by_expert(flat, e)?;
        let counts = b.bincount(flat, e)?;
        b.output(&format!("{EXPERT_LOAD}{layer}"), counts);
        let rows = b.reshape(x, vec![n, 1, d])?;
        let rows = b.broadcast(rows, vec![n, k, d])?;
        let rows = b.reshape(rows, vec![n * k, d])?;
        let sorted = b.index_select(rows, order, 0)?;
        let held = ep.experts(e);
        let stack = |b: &mut GraphBuilder, proj: &str| -> Result<ValueId, ModelError> {
            let mats: Vec<ValueId> = held
                .clone()
                .map(|i| {
                    let m = w(i, proj);
                    let s = b.shape(m);
                    b.reshape(m, vec![1, s[0], s[1]])
                })
                .collect::<Result<_, _>>()?;
            Ok(b.concat(&mats, 0)?)
        };
        let (wg, wu, wd) = (stack(b, "gate_proj")?, stack(b, "up_proj")?, stack(b, "down_proj")?);
        let dispatched = (ep.size > 1).then(|| self.dispatch(b, ep, sorted, counts)).transpose()?;
        let (input, segments) = dispatched.as_ref().map_or((sorted, counts), |t| (t.rows, t.segments));
        let g = b.segment_matmul(input, wg, segments, true)?;
        let u = b.segment_matmul(input, wu, segments, true)?;
        let a = activation(b, g, self.base.hidden_act.activation())?;
        let hsw = b.mul(a, u)?;
        let out = b.segment_matmul(hsw, wd, segments, true)?;
        let out = match &dispatched {
            Some(t) => self.combine(b, ep, out, t, n * k)?,
            None => out,
        };
        let zero = b.full_like(0.0, out)?;
        let back = b.index_add(zero, order, out, 0)?;
        let back = b.reshape(back, vec![n, k, d])?;
        let wk = b.reshape(weights, vec![n, k, 1])?;
        let weighted = b.mul(back, wk)?;
        Ok(b.sum(weighted, 1, false)?)
    }

    /// Expert parallelism's dispatch (comm region `ep.dispatch`): the rows `sorted [R, D]`
    /// (sorted by expert, `counts [E]` per expert) go to the members of the `ep` group holding
    /// their experts (member j holds experts `j·E/G .. (j+1)·E/G`). First the counts are
    /// exchanged (an all-to-all of `[G, E/G]`: row j of the result is what member j sends here
    /// per local expert), then the rows (a variable-count all-to-all into `G·R` static rows:
    /// every member could route all its rows here). The received rows are one run of local
    /// expert segments per source member — counts `[G, E/G]` that
    /// [`graphpp_graph::Op::SegmentMatmul`] takes as they are.
    fn dispatch(
        &self,
        b: &mut GraphBuilder,
        ep: ExpertShard,
        sorted: ValueId,
        counts: ValueId,
    ) -> Result<Dispatched, ModelError> {
        let group = CommGroup::new(MeshAxis::Expert, ep.size);
        let rows = b.shape(sorted)[0];
        b.set_region(Region::Comm("ep.dispatch".into()));
        let per_member = b.reshape(counts, vec![ep.size, self.n_routed_experts / ep.size])?;
        let send = b.sum(per_member, 1, false)?;
        let segments = b.collective(CollectiveKind::AllToAll, &group, 0, per_member)?;
        let recv = b.sum(segments, 1, false)?;
        let received = b.all_to_all_v(&group, sorted, send, recv, ep.size * rows)?;
        b.set_region(Region::Compute);
        Ok(Dispatched { rows: received, segments, send, recv })
    }

    /// Expert parallelism's combine (comm region `ep.combine`): the experts' outputs go back to
    /// the members the rows came from, `rows` of them here, in this member's sorted order.
    fn combine(
        &self,
        b: &mut GraphBuilder,
        ep: ExpertShard,
        out: ValueId,
        d: &Dispatched,
        rows: usize,
    ) -> Result<ValueId, ModelError> {
        let group = CommGroup::new(MeshAxis::Expert, ep.size);
        b.set_region(Region::Comm("ep.combine".into()));
        let back = b.all_to_all_v(&group, out, d.recv, d.send, rows)?;
        b.set_region(Region::Compute);
        Ok(back)
    }
}

/// What [`MoeConfig::dispatch`] produced.
struct Dispatched {
    /// Received rows `[G·R, D]` (padded).
    rows: ValueId,
    /// Received counts `[G, E/G]` (per source member, per local expert).
    segments: ValueId,
    /// Rows sent to each member `[G]`.
    send: ValueId,
    /// Rows received from each member `[G]`.
    recv: ValueId,
}

impl crate::model::Model for MoeConfig {
    fn describe(&self) -> String {
        format!(
            "moe, {} layers ({} MoE: {} routed experts, {} per token, {} shared), hidden {}",
            self.base.num_hidden_layers,
            self.num_moe_layers(),
            self.n_routed_experts,
            self.num_experts_per_tok,
            self.n_shared_experts,
            self.base.hidden_size
        )
    }

    fn vocab_size(&self) -> usize {
        self.base.vocab_size
    }

    fn num_layers(&self) -> usize {
        self.base.num_hidden_layers
    }

    fn max_seq_len(&self) -> usize {
        self.base.max_position_embeddings
    }

    fn build_stage(&self, spec: &StageSpec, opts: &StageOptions) -> Result<Graph, ModelError> {
        MoeConfig::build_stage(self, spec, opts)
    }

    fn stage_parameters(&self, spec: &StageSpec) -> Vec<(String, Vec<usize>)> {
        MoeConfig::stage_parameters(self, spec)
    }

    fn init_parameters(&self, spec: &StageSpec, seed: u64) -> Vec<(String, Vec<usize>, Vec<f32>)> {
        MoeConfig::init_parameters(self, spec, seed)
    }

    fn stage_buffers(&self, seq: usize) -> Vec<(String, Vec<usize>, Vec<f64>)> {
        MoeConfig::stage_buffers(self, seq)
    }

    fn parameter_count(&self) -> u128 {
        let whole = StageSpec::whole(self.base.num_hidden_layers);
        crate::memory::count(&self.stage_parameters(&whole))
    }

    fn stage_activation_bytes(&self, spec: &StageSpec, batch: usize, seq: usize) -> u128 {
        crate::memory::moe_stage_activation_bytes(self, spec, batch, seq)
    }

    fn buffer_bytes(&self, seq: usize) -> u128 {
        let biases = self.num_moe_layers() * self.n_routed_experts;
        crate::memory::buffer_bytes(&self.base, seq).saturating_add(4 * biases as u128)
    }

    fn flops_per_token(&self, seq: usize) -> f64 {
        crate::flops::moe_flops_per_token(self, seq)
    }

    fn moe_layers(&self) -> Vec<(usize, usize)> {
        self.moe_layer_ids().map(|l| (l, self.n_routed_experts)).collect()
    }

    fn stage_layers(&self, spec: &StageSpec) -> Vec<usize> {
        let mtp = self.mtp().filter(|_| spec.is_last()).map(|m| m.layer);
        spec.layers.clone().chain(mtp).collect()
    }

    fn balance_bias(&self, layer: usize) -> Option<String> {
        self.is_moe(layer).then(|| Self::bias_name(layer))
    }

    fn mtp_loss_weight(&self) -> f64 {
        self.mtp().map_or(0.0, |m| m.weight)
    }

    fn check_ep(&self, ep: usize) -> Result<(), ModelError> {
        MoeConfig::check_ep(self, ep)
    }

    fn expert_of(&self, name: &str) -> Option<usize> {
        let rest = name.strip_prefix("model.layers.")?;
        let (_, rest) = rest.split_once(".mlp.experts.")?;
        rest.split_once('.')?.0.parse().ok()
    }

    fn routed_experts(&self) -> usize {
        self.n_routed_experts
    }

    fn buffer_dtype(&self, name: &str, compute: graphpp_graph::DType) -> graphpp_graph::DType {
        if name.ends_with(".e_score_correction_bias") {
            compute.wide()
        } else {
            compute
        }
    }
    fn tensor_parallel_split(&self, name: &str, tp: usize) -> Option<Split> {
        MoeConfig::tensor_parallel_split(self, name, tp)
    }
    /// The grouped-query attention's heads (not multi-head latent attention's: replicated), the
    /// dense layers' MLP width (when the model has dense layers) and the vocabulary.
    fn check_tp(&self, tp: usize) -> Result<(), ModelError> {
        if tp > 1 && self.mtp().is_some() {
            return Err(ModelError::Field {
                field: "mtp_loss_weight",
                reason: "the multi-token-prediction module is not built under tensor parallelism".into(),
            });
        }
        let base = &self.base;
        let mut sizes = Vec::new();
        if self.mla.is_none() {
            sizes.push(("num_attention_heads", base.num_attention_heads));
        }
        if self.first_k_dense_replace > 0 {
            sizes.push(("intermediate_size", base.intermediate_size));
        }
        sizes.push(("vocab_size", base.vocab_size));
        if self.n_shared_experts > 0 {
            sizes.push((
                "moe_intermediate_size × n_shared_experts",
                self.moe_intermediate_size * self.n_shared_experts,
            ));
        }
        let kv = self.mla.is_none().then(|| base.kv_heads());
        crate::tensor_parallel::check_divides(tp, &sizes, kv)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Model;
    use crate::split_layers;
    use graphpp_graph::names::grad_of;
    use graphpp_graph::RecomputePolicy;

    const BASE: &str = r#""vocab_size":32,"hidden_size":16,"intermediate_size":32,"num_hidden_layers":3,"num_attention_heads":2"#;
    const MOE: &str = r#""n_routed_experts":4,"n_shared_experts":1,"num_experts_per_tok":2,"moe_intermediate_size":8,"first_k_dense_replace":1,"routed_scaling_factor":2.5"#;

    fn with(extra: &str) -> Result<MoeConfig, ModelError> {
        MoeConfig::from_json(&format!("{{{BASE},{MOE}{}{extra}}}", if extra.is_empty() { "" } else { "," }))
    }

    #[test]
    fn parses_deepseek_fields_and_names_what_is_wrong() {
        let c =
            with(r#""model_type":"deepseek_v3","scoring_func":"softmax","norm_topk_prob":false,"n_group":1"#)
                .unwrap();
        assert_eq!((c.n_routed_experts, c.num_experts_per_tok, c.routed_scaling_factor), (4, 2, 2.5));
        assert_eq!((c.scoring_func, c.norm_topk_prob, c.base.hidden_size), (ScoringFunc::Softmax, false, 16));
        // A DeepSeek model_type means MLA, with HF's defaults; RoPE over qk_rope_head_dim.
        let mla = c.mla.as_ref().expect("deepseek_v3 is MLA");
        assert_eq!((mla.q_lora_rank, mla.kv_lora_rank, mla.qk_head_dim()), (Some(1536), 512, 192));
        assert_eq!((c.base.head_dim(), c.topk_method), (64, TopkMethod::NoauxTc));
        // deepseek_v2 routes greedily unless told otherwise.
        let v2 = with(r#""model_type":"deepseek_v2","q_lora_rank":null"#).unwrap();
        assert_eq!((v2.topk_method, v2.mla.unwrap().q_lora_rank), (TopkMethod::Greedy, None));
        // Defaults: sigmoid scores, normalised weights, Llama attention without a model_type.
        let d = with("").unwrap();
        assert_eq!((d.scoring_func, d.norm_topk_prob, d.mla.is_none()), (ScoringFunc::Sigmoid, true, true));
        let g = with(r#""n_group":2,"topk_group":1"#).unwrap();
        assert!(g.grouped());
        // A missing MoE field is named.
        let e =
            MoeConfig::from_json(&format!("{{{BASE},{}}}", MOE.replace(r#""moe_intermediate_size":8,"#, "")))
                .unwrap_err();
        assert!(e.to_string().contains("missing field `moe_intermediate_size`"), "{e}");
        let big = MoeConfig { num_experts_per_tok: 5, ..MoeConfig::tiny() };
        let big = MoeConfig { n_routed_experts: 4, ..big };
        assert!(matches!(big.validate(), Err(ModelError::Field { field: "num_experts_per_tok", .. })));
        for (extra, field) in [
            (r#""model_type":"mixtral""#, "model_type"),
            (r#""moe_layer_freq":2"#, "moe_layer_freq"),
            (r#""aux_loss_alpha":0.001,"seq_aux":false"#, "seq_aux"),
            (
                r#""rope_scaling":{"type":"yarn","factor":4,"original_max_position_embeddings":8}"#,
                "rope_scaling",
            ),
            (r#""kv_lora_rank":8,"rope_scaling":{"type":"dynamic","factor":4}"#, "rope_scaling"),
        ] {
            match with(extra).unwrap_err() {
                ModelError::Unsupported { field: f, .. } => assert_eq!(f, field, "{extra}"),
                other => panic!("{extra}: {other:?}"),
            }
        }
        for (extra, field) in [
            (r#""aux_loss_alpha":-0.1"#, "aux_loss_alpha"),
            (r#""first_k_dense_replace":3"#, "first_k_dense_replace"),
            (r#""n_group":8"#, "n_group"),
            (r#""n_group":2,"topk_group":3"#, "topk_group"),
            (r#""n_group":4,"topk_group":1,"num_experts_per_tok":2"#, "topk_group"),
            (r#""n_group":4,"topk_group":2"#, "n_group"),
            (r#""kv_lora_rank":8,"qk_rope_head_dim":3"#, "qk_rope_head_dim"),
        ] {
            match with(extra).unwrap_err() {
                ModelError::Field { field: f, .. } => assert_eq!(f, field, "{extra}"),
                other => panic!("{extra}: {other:?}"),
            }
        }
        let aux = with(r#""aux_loss_alpha":0.001,"seq_aux":true"#).unwrap();
        assert_eq!(aux.aux_loss_alpha, 0.001);
    }

    /// The multi-token-prediction module (`moe-mla-tiny-mtp`): only the last stage holds it, as
    /// layer L = 4 with DeepSeek-V3's names and the shared embedding, outputs `aux_loss.mtp` and
    /// seeds its backward; it is a MoE layer (its expert load and routing bias); the pre-flight
    /// estimate stays within 15% of what its save-all graph saves; λ without the module, or a
    /// negative λ, is refused naming the field.
    #[test]
    fn the_mtp_module_sits_on_the_last_stage() {
        use graphpp_graph::names::{grad_of, MTP_LOSS};
        let m = MoeConfig::preset("moe-mla-tiny-mtp").unwrap();
        assert_eq!(m.mtp(), Some(crate::llama::Mtp { layer: 4, weight: 0.3 }));
        let specs = crate::split_layers(4, 2, None).unwrap();
        let names = |s: &StageSpec| m.stage_parameters(s).into_iter().map(|(n, _)| n).collect::<Vec<_>>();
        let (first, last) = (names(&specs[0]), names(&specs[1]));
        assert!(!first.iter().any(|n| n.starts_with("model.layers.4.")), "{first:?}");
        for n in
            ["model.layers.4.enorm.weight", "model.layers.4.hnorm.weight", "model.layers.4.eh_proj.weight"]
        {
            assert!(last.iter().any(|x| x == n), "{n} missing: {last:?}");
        }
        assert!(last.iter().any(|x| x == "model.layers.4.mlp.experts.0.up_proj.weight"), "MoE: {last:?}");
        assert!(
            last.iter().any(|x| x == "model.embed_tokens.weight")
                && first.contains(&"model.embed_tokens.weight".to_string())
        );
        assert!(
            m.moe_layers().iter().any(|&(l, _)| l == 4)
                && m.stage_buffers(8).iter().any(|(n, ..)| *n == MoeConfig::bias_name(4))
        );
        let opts = StageOptions::new(2, 8);
        let fw = m.build_stage(&specs[1], &opts).unwrap();
        assert!(fw.output_names().contains(&MTP_LOSS.to_string()));
        assert!(!m.build_stage(&specs[0], &opts).unwrap().output_names().contains(&MTP_LOSS.to_string()));
        let sg = graphpp_graph::stage_graphs(&fw, &graphpp_graph::RecomputePolicy::SaveAll).unwrap();
        assert!(
            sg.full_bw.input_specs().iter().any(|i| i.name == grad_of(MTP_LOSS)),
            "the backward takes its seed"
        );
        let input = (4 * 2 * 8 * m.base.hidden_size) as u128;
        let est = Model::stage_activation_bytes(&m, &specs[1], 2, 8) - input;
        let saved = crate::memory::saved_bytes(&fw);
        let ratio = est as f64 / saved as f64;
        assert!((0.85..=1.15).contains(&ratio), "estimate {est} against the graph's {saved}");
        let bad = |c: MoeConfig| c.validate().unwrap_err().to_string();
        assert!(
            bad(MoeConfig { mtp_loss_weight: 0.3, ..MoeConfig::tiny() }).contains("num_nextn_predict_layers")
        );
        let negative = MoeConfig { mtp_loss_weight: -1.0, num_nextn_predict_layers: 1, ..MoeConfig::tiny() };
        assert!(bad(negative).contains("mtp_loss_weight"));
    }

    /// With α > 0 each MoE layer's forward outputs its scalar `aux_loss.<layer>` and the backward
    /// takes its seed `grad.aux_loss.<layer>`; with α = 0 neither exists.
    #[test]
    fn the_aux_loss_is_an_output_per_moe_layer() {
        let spec = crate::StageSpec::whole(3);
        let opts = StageOptions::new(2, 4);
        let names = |alpha: f64| {
            let m = MoeConfig { aux_loss_alpha: alpha, ..with("").unwrap() };
            let g = m.build_stage(&spec, &opts).unwrap();
            let bw = graphpp_graph::stage_graphs(&g, &RecomputePolicy::SaveAll).unwrap().full_bw;
            let outs: Vec<String> =
                g.output_names().into_iter().filter(|n| n.starts_with(AUX_LOSS)).collect();
            let seeds: Vec<String> = bw.input_names().into_iter().filter(|n| n.contains(AUX_LOSS)).collect();
            (outs, seeds)
        };
        assert_eq!(names(0.0), (vec![], vec![]));
        let (outs, seeds) = names(0.01);
        assert_eq!(outs, ["aux_loss.1", "aux_loss.2"]);
        assert_eq!(seeds, [grad_of("aux_loss.1"), grad_of("aux_loss.2")]);
    }

    #[test]
    fn tiny_stage_graphs_have_the_hf_parameters() {
        let m = MoeConfig::tiny();
        let specs = split_layers(4, 2, None).unwrap();
        let names: Vec<String> = m.stage_parameters(&specs[0]).into_iter().map(|(n, _)| n).collect();
        // Layer 0 dense, layer 1 MoE: 1 gate + 8·3 expert matrices + 3 shared.
        assert!(names.contains(&"model.layers.0.mlp.gate_proj.weight".to_string()));
        assert!(names.contains(&"model.layers.1.mlp.experts.7.down_proj.weight".to_string()));
        assert!(names.contains(&"model.layers.1.mlp.shared_experts.up_proj.weight".to_string()));
        let moe = names.iter().filter(|n| n.starts_with("model.layers.1.mlp.")).count();
        assert_eq!(moe, 1 + 8 * 3 + 3);
        // tiny: 234,048; three layers trade the dense MLP (3·64·176) for the MoE block
        // (8·64 + 9·3·64·48).
        assert_eq!(Model::parameter_count(&m), 234_048 + 3 * (8 * 64 + 27 * 64 * 48) - 3 * 3 * 64 * 176);
        for spec in &specs {
            let g = m.build_stage(spec, &StageOptions::new(2, 8)).unwrap();
            let biases =
                g.input_specs().into_iter().filter(|s| s.name.ends_with("e_score_correction_bias")).count();
            assert_eq!(biases, spec.layers.clone().filter(|&l| m.is_moe(l)).count());
        }
    }

    /// Expert parallelism: a stage of block i of 2 holds experts 4i..4i+4 of every MoE layer (and
    /// all shared weights); its graph exchanges tokens in the `ep` group; the answers reach the
    /// runtime through [`crate::ModelConfig`] too.
    #[test]
    fn expert_shards_hold_their_block() {
        let m = MoeConfig::tiny();
        let cfg = crate::ModelConfig::Moe(m.clone());
        let whole = StageSpec::whole(4);
        let all = m.stage_parameters(&whole).len();
        for index in 0..2 {
            let spec = StageSpec { ep: ExpertShard { index, size: 2 }, ..whole.clone() };
            let names: Vec<String> =
                Model::stage_parameters(&cfg, &spec).into_iter().map(|(n, _)| n).collect();
            let experts: Vec<usize> = names.iter().filter_map(|n| Model::expert_of(&cfg, n)).collect();
            assert!(experts.iter().all(|e| (4 * index..4 * index + 4).contains(e)), "{experts:?}");
            // Half of the 3 layers × 8 experts × 3 matrices are gone.
            assert_eq!(names.len(), all - 3 * 4 * 3);
            let g = Model::build_stage(&cfg, &spec, &StageOptions::new(2, 8)).unwrap();
            let ep_ops = g
                .nodes
                .iter()
                .filter(|n| matches!(&n.op, graphpp_graph::Op::CollectiveStart { group, .. } if group.mesh_axis == MeshAxis::Expert))
                .count();
            // Per MoE layer: the counts exchange, the dispatch and the combine.
            assert_eq!(ep_ops, 3 * 3);
            // Balanced routing fills 1/2 of the 2·R static rows a member may receive: its expert
            // products count the R rows one member computes without expert parallelism.
            let one = Model::build_stage(&cfg, &whole, &StageOptions::new(2, 8)).unwrap();
            assert_eq!(g.matmul_flops(), one.matmul_flops());
        }
        assert_eq!(Model::expert_of(&cfg, "model.layers.2.mlp.experts.7.up_proj.weight"), Some(7));
        assert_eq!(Model::expert_of(&cfg, "model.layers.2.mlp.shared_experts.up_proj.weight"), None);
        assert_eq!(Model::routed_experts(&cfg), 8);
        assert!(Model::check_ep(&cfg, 3).is_err() && Model::check_ep(&cfg, 4).is_ok());
    }

    /// Saved bytes from the graph against the estimate; FLOPs: a third is the forward graph's.
    #[test]
    fn estimates_follow_the_graphs() {
        // MLA with equal q·k and value widths, and (mla_tiny) a narrower value: the attention
        // node takes both widths, so the graph's matmul FLOPs are the model FLOPs exactly.
        let mut square = MoeConfig::mla_tiny();
        square.mla.as_mut().unwrap().v_head_dim = 24;
        let mut full_q = MoeConfig::mla_small();
        full_q.base.num_hidden_layers = 4;
        let routing = MoeConfig {
            n_routed_experts: 16,
            num_experts_per_tok: 3,
            norm_topk_prob: false,
            aux_loss_alpha: 0.01,
            ..MoeConfig::tiny()
        };
        for m in [
            MoeConfig::tiny(),
            MoeConfig { n_shared_experts: 0, num_experts_per_tok: 3, ..MoeConfig::tiny() },
            MoeConfig::mla_tiny(),
            square,
            full_q,
            routing,
        ] {
            let whole = StageSpec::whole(4);
            let (b, t) = (2, 16);
            let fw = m.build_stage(&whole, &StageOptions::new(b, t)).unwrap();
            let per_token = fw.matmul_flops() as f64 / (b * t) as f64;
            assert_eq!(Model::flops_per_token(&m, t) / 3.0, per_token, "{}", m.describe());
            // The estimate is what the graphs save under save-all, exactly: whole, and split in
            // two stages (less the second stage's input, which the runtime keeps as the stage's
            // input rather than as a saved value); at two microbatch shapes, since the expert
            // counts and the sequence-wise balance loss do not scale with the tokens.
            for (b, t) in [(b, t), (3, 5)] {
                let fw = m.build_stage(&whole, &StageOptions::new(b, t)).unwrap();
                let saved = crate::memory::saved_bytes(&fw);
                assert_eq!(Model::stage_activation_bytes(&m, &whole, b, t), saved, "{}", m.describe());
                for spec in crate::split_layers(4, 2, None).unwrap() {
                    let fw = m.build_stage(&spec, &StageOptions::new(b, t)).unwrap();
                    let input = if spec.is_first() { 0 } else { (4 * b * t * m.base.hidden_size) as u128 };
                    let est = Model::stage_activation_bytes(&m, &spec, b, t) - input;
                    assert_eq!(est, crate::memory::saved_bytes(&fw), "{} stage {}", m.describe(), spec.stage);
                }
            }
        }
    }
}

#[cfg(test)]
mod deepseek_16b {
    use super::*;
    use crate::model::Model;
    use graphpp_graph::{InputKind, Op};

    /// `graphpp graph --model deepseek-v3-16b --stages 4 --stage 1 --layers-per-stage 7,7,7,6
    /// --stats` against a count by hand. One MoE layer: norms 2·2048; MLA `q_proj` 16·192×2048,
    /// `kv_a_proj_with_mqa` (512 + 64)×2048, `kv_a_layernorm` 512, `kv_b_proj` 16·256×512,
    /// `o_proj` 2048×16·128; gate 64×2048, 64 experts of 3·2048·1408, shared 3·2048·2816.
    #[test]
    fn parameters_agree_with_a_hand_count() {
        let m = MoeConfig::deepseek_v3_16b();
        let attention: u64 = 3072 * 2048 + 576 * 2048 + 512 + 4096 * 512 + 2048 * 2048;
        let moe = 64 * 2048 + 64 * 3 * 2048 * 1408 + 3 * 2048 * 2816;
        let layer = 2 * 2048 + attention + moe;
        assert_eq!(layer, 584_847_872);
        let specs = crate::split_layers(27, 4, Some(&[7, 7, 7, 6])).unwrap();
        let stage1: u128 = crate::memory::count(&m.stage_parameters(&specs[1]));
        assert_eq!(stage1, 7 * layer as u128);
        let dense_layer = 2 * 2048 + attention + 3 * 2048 * 10_944;
        let whole = 2 * 102_400 * 2048 + 2048 + dense_layer + 26 * layer;
        assert_eq!(m.parameter_count(), whole as u128);
        assert_eq!(whole, 15_706_484_224, "15.7 B, DeepSeek-V2-Lite's count");
        // The graph's inputs are those parameters, and the saved activations of a microbatch
        // (B=1, T=64, `RecomputePolicy::SaveAll`) are the hand count, to the byte. Per token and
        // layer: the Llama layer's 11·D + 4 less q, k, v (3·D), MLA's 3·512 + 2 + 16·(2·192 +
        // 3·128) = 13,826, and the MoE block's E + k·(2·D + 5·F_e + 3) + 5·F_s − D = 64 + 6 ·
        // 11,139 + 14,080 − 2,048 = 78,930 (softmax scores without renormalisation, no balance
        // loss): 109,144 values; plus the 64 expert counts per layer. 7 layers × (64 × 109,144
        // + 64) × 4 bytes, less the stage's input (64 × 2,048 × 4, kept as the input): the
        // estimate `memory::moe_stage_activation_bytes` counts the same (it was 2.0% above
        // before the MoE block was counted value by value; the values were padded to q·k's
        // 192 columns before the attention took their own width).
        let fw = m.build_stage(&specs[1], &StageOptions::new(1, 64)).unwrap();
        let params: usize = fw
            .nodes
            .iter()
            .filter(|n| matches!(&n.op, Op::Input { kind: InputKind::Parameter, .. }))
            .map(|n| n.ty.numel())
            .sum();
        assert_eq!(params as u128, stage1);
        let saved = crate::memory::saved_bytes(&fw);
        let input = 4 * 64 * 2048;
        let est = m.stage_activation_bytes(&specs[1], 1, 64) - input;
        assert_eq!(saved, 7 * (64 * 109_144 + 64) * 4 - 64 * 2048 * 4);
        assert_eq!(est, saved);
    }
}

#[cfg(test)]
mod published {
    use super::*;
    use crate::model::Model;

    /// deepseek-ai/DeepSeek-V3's `config.json` as published (the `auto_map` left out).
    const V3: &str = r#"{"architectures":["DeepseekV3ForCausalLM"],"attention_bias":false,"attention_dropout":0.0,
        "aux_loss_alpha":0.001,"bos_token_id":0,"eos_token_id":1,"ep_size":1,"first_k_dense_replace":3,"hidden_act":"silu",
        "hidden_size":7168,"initializer_range":0.02,"intermediate_size":18432,"kv_lora_rank":512,"max_position_embeddings":163840,
        "model_type":"deepseek_v3","moe_intermediate_size":2048,"moe_layer_freq":1,"n_group":8,"n_routed_experts":256,
        "n_shared_experts":1,"norm_topk_prob":true,"num_attention_heads":128,"num_experts_per_tok":8,"num_hidden_layers":61,
        "num_key_value_heads":128,"num_nextn_predict_layers":1,"q_lora_rank":1536,"qk_nope_head_dim":128,"qk_rope_head_dim":64,
        "quantization_config":{"activation_scheme":"dynamic","fmt":"e4m3","quant_method":"fp8","weight_block_size":[128,128]},
        "rms_norm_eps":1e-06,"rope_scaling":{"beta_fast":32,"beta_slow":1,"factor":40,"mscale":1.0,"mscale_all_dim":1.0,
        "original_max_position_embeddings":4096,"type":"yarn"},"rope_theta":10000,"routed_scaling_factor":2.5,
        "scoring_func":"sigmoid","seq_aux":true,"tie_word_embeddings":false,"topk_group":4,"topk_method":"noaux_tc",
        "torch_dtype":"bfloat16","transformers_version":"4.33.1","use_cache":true,"v_head_dim":128,"vocab_size":129280}"#;

    /// deepseek-ai/DeepSeek-V2-Lite's `config.json` as published (the `auto_map` left out).
    const V2_LITE: &str = r#"{"architectures":["DeepseekV2ForCausalLM"],"attention_bias":false,"attention_dropout":0.0,
        "aux_loss_alpha":0.001,"bos_token_id":100000,"eos_token_id":100001,"first_k_dense_replace":1,"hidden_act":"silu",
        "hidden_size":2048,"initializer_range":0.02,"intermediate_size":10944,"kv_lora_rank":512,"max_position_embeddings":163840,
        "model_type":"deepseek_v2","moe_intermediate_size":1408,"moe_layer_freq":1,"n_group":1,"n_routed_experts":64,
        "n_shared_experts":2,"norm_topk_prob":false,"num_attention_heads":16,"num_experts_per_tok":6,"num_hidden_layers":27,
        "num_key_value_heads":16,"pretraining_tp":1,"q_lora_rank":null,"qk_nope_head_dim":128,"qk_rope_head_dim":64,
        "rms_norm_eps":1e-06,"rope_scaling":{"beta_fast":32,"beta_slow":1,"factor":40,"mscale":0.707,"mscale_all_dim":0.707,
        "original_max_position_embeddings":4096,"type":"yarn"},"rope_theta":10000,"routed_scaling_factor":1.0,
        "scoring_func":"softmax","seq_aux":true,"tie_word_embeddings":false,"topk_group":1,"topk_method":"greedy",
        "torch_dtype":"bfloat16","transformers_version":"4.39.3","use_cache":true,"v_head_dim":128,"vocab_size":102400}"#;

    /// Both published configs load as the models their reports describe: V3 671 B parameters
    /// without the MTP module (§1: "671B total"; its MTP module, 14 B more, is not built),
    /// group-limited over 8 groups keeping 4; V2-Lite 15.7 B, the `deepseek-v3-16b` preset's shape.
    #[test]
    fn published_configs_load() {
        let v3 = MoeConfig::from_json(V3).unwrap();
        let billions = v3.parameter_count() as f64 / 1e9;
        assert!((670.0..672.0).contains(&billions), "{billions} B");
        assert!(v3.grouped() && v3.topk_method == TopkMethod::NoauxTc && v3.topk_group == 4);
        assert_eq!((v3.mla.as_ref().unwrap().q_lora_rank, v3.num_nextn_predict_layers), (Some(1536), 1));
        let lite = MoeConfig::from_json(V2_LITE).unwrap();
        assert_eq!(lite.parameter_count(), 15_706_484_224);
        let preset = MoeConfig::deepseek_v3_16b();
        assert_eq!(
            (&lite.mla, &lite.rope_scaling, lite.topk_method),
            (&preset.mla, &preset.rope_scaling, preset.topk_method)
        );
        assert_eq!(
            lite.stage_parameters(&StageSpec::whole(27)),
            preset.stage_parameters(&StageSpec::whole(27))
        );
    }
}
