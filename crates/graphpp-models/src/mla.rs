//! DeepSeek's multi-head latent attention (MLA: DeepSeek-V2 report, Liu et al. 2024, §2.1;
//! DeepSeek-V3 report §2.1.1) and the YaRN RoPE scaling its configs carry (Peng et al. 2023,
//! "YaRN", §3.2–3.4; Hugging Face `_compute_yarn_parameters` and `yarn_apply_mscale`).
//!
//! Hugging Face `DeepseekV3Config` / `DeepseekV2Config` field names: `q_lora_rank` (null: a
//! full-rank `q_proj`, as DeepSeek-V2-Lite), `kv_lora_rank`, `qk_nope_head_dim`,
//! `qk_rope_head_dim`, `v_head_dim`, `rope_interleave`. The graph is
//! [`graphpp_graph::layers::latent_attention`]; the RoPE tables are `[T, qk_rope_head_dim]`
//! (HF sets `head_dim = qk_rope_head_dim` for these models, and so does [`MlaConfig::apply`]).

use graphpp_graph::layers::{latent_attention, LatentAttentionDims, LatentAttentionWeights, LatentQuery};
use graphpp_graph::{GraphBuilder, ValueId};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::config::ModelError;
use crate::llama::{projection, ParamsAt, SelfAttention};

/// Epsilon of MLA's two latent RMSNorms: HF builds `q_a_layernorm` and `kv_a_layernorm` with
/// `DeepseekV3RMSNorm`'s default, not `rms_norm_eps` (and so does DeepSeek's reference model).
pub const LATENT_NORM_EPS: f64 = 1e-6;

fn default_true() -> bool {
    true
}

/// The MLA fields of a DeepSeek config (see the module doc). Defaults are HF
/// `DeepseekV3Config`'s where a DeepSeek `model_type` leaves a field out.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct MlaConfig {
    /// Query latent width `r_q`; `None`: queries from a full-rank `q_proj`.
    #[serde(default)]
    pub q_lora_rank: Option<usize>,
    /// Key/value latent width `r_kv`.
    pub kv_lora_rank: usize,
    /// Per-head query/key width without RoPE.
    pub qk_nope_head_dim: usize,
    /// Per-head query/key width with RoPE (one RoPE key shared by all heads; even).
    pub qk_rope_head_dim: usize,
    /// Per-head value width.
    pub v_head_dim: usize,
    /// RoPE dims stored as interleaved pairs (HF default true: DeepSeek's checkpoints).
    #[serde(default = "default_true")]
    pub rope_interleave: bool,
}

/// The HF config fields [`MlaConfig`] reads.
pub const MLA_FIELDS: [&str; 6] =
    ["q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave"];

impl MlaConfig {
    /// Reads the MLA fields of `obj` (removing them), HF defaults for absent ones (`q_lora_rank`
    /// 1536 — null, not absent, asks for a full-rank `q_proj` — `kv_lora_rank` 512,
    /// `qk_nope_head_dim` 128, `qk_rope_head_dim` 64, `v_head_dim` 128, `rope_interleave` true).
    /// Errors: [`ModelError::Field`] for a value that is not a count.
    pub fn take(obj: &mut serde_json::Map<String, Value>) -> Result<Self, ModelError> {
        let mut count = |field: &'static str, default: usize| -> Result<Option<usize>, ModelError> {
            match obj.remove(field) {
                None => Ok(Some(default)),
                Some(Value::Null) => Ok(None),
                Some(v) => v
                    .as_u64()
                    .map(|n| Some(n as usize))
                    .ok_or_else(|| ModelError::Field { field, reason: format!("{v} is not a count") }),
            }
        };
        let q_lora_rank = count("q_lora_rank", 1536)?;
        let need = |v: Option<usize>, field: &'static str| {
            v.ok_or_else(|| ModelError::Field { field, reason: "must be a count, not null".into() })
        };
        let kv_lora_rank = need(count("kv_lora_rank", 512)?, "kv_lora_rank")?;
        let qk_nope_head_dim = need(count("qk_nope_head_dim", 128)?, "qk_nope_head_dim")?;
        let qk_rope_head_dim = need(count("qk_rope_head_dim", 64)?, "qk_rope_head_dim")?;
        let v_head_dim = need(count("v_head_dim", 128)?, "v_head_dim")?;
        let rope_interleave = match obj.remove("rope_interleave") {
            None | Some(Value::Null) => true,
            Some(v) => v.as_bool().ok_or_else(|| ModelError::Field {
                field: "rope_interleave",
                reason: format!("{v} is not true or false"),
            })?,
        };
        let cfg = MlaConfig {
            q_lora_rank,
            kv_lora_rank,
            qk_nope_head_dim,
            qk_rope_head_dim,
            v_head_dim,
            rope_interleave,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the sizes. Errors: [`ModelError::Field`] naming the field.
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |field, reason: &str| Err(ModelError::Field { field, reason: reason.into() });
        if self.q_lora_rank == Some(0) {
            return bad("q_lora_rank", "must be > 0 (or null for a full-rank q_proj)");
        }
        if self.kv_lora_rank == 0 {
            return bad("kv_lora_rank", "must be > 0");
        }
        if self.qk_rope_head_dim == 0 || !self.qk_rope_head_dim.is_multiple_of(2) {
            return bad("qk_rope_head_dim", "must be even and > 0 (RoPE rotates pairs)");
        }
        if self.v_head_dim == 0 {
            return bad("v_head_dim", "must be > 0");
        }
        Ok(())
    }

    /// Query/key width per head `d_nope + d_rope`.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Sets the decoder fields MLA decides: `head_dim` becomes `qk_rope_head_dim` (the RoPE
    /// tables' width, as HF's `DeepseekV3Config` sets it) and the key/value heads the query heads.
    pub fn apply(&self, base: &mut crate::config::LlamaConfig) {
        base.head_dim = Some(self.qk_rope_head_dim);
        base.num_key_value_heads = None;
    }
}

/// YaRN RoPE scaling as DeepSeek's configs give it (`rope_scaling` or transformers 5's
/// `rope_parameters` with `rope_type` / `type` `yarn`; HF `_compute_yarn_parameters`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Yarn {
    /// Context extension factor `s`.
    pub factor: f64,
    /// The pre-training context `L` the correction range is computed against.
    pub original_max_position_embeddings: usize,
    /// Rotations above which a frequency is kept (α; default 32).
    #[serde(default)]
    pub beta_fast: Option<f64>,
    /// Rotations below which a frequency is interpolated (β; default 1).
    #[serde(default)]
    pub beta_slow: Option<f64>,
    /// `mscale` of the cos/sin factor's numerator.
    #[serde(default)]
    pub mscale: Option<f64>,
    /// `mscale_all_dim` of its denominator and of the softmax scale (MLA: `scale · m²`).
    #[serde(default)]
    pub mscale_all_dim: Option<f64>,
    /// An explicit cos/sin factor (wins over the mscale rule).
    #[serde(default)]
    pub attention_factor: Option<f64>,
    /// Round the correction range outward (HF default true).
    #[serde(default)]
    pub truncate: Option<bool>,
}

/// YaRN's `0.1 · m · ln s + 1` (1 for `s ≤ 1`): YaRN paper eq. 21, HF `yarn_get_mscale`.
fn get_mscale(scale: f64, m: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * m * scale.ln() + 1.0
    }
}

impl Yarn {
    /// Reads YaRN from `rope_scaling` or `rope_parameters` of `obj` (removing `rope_scaling`,
    /// and moving `rope_parameters.rope_theta` to `rope_theta`); `None` when neither asks for a
    /// scaling. Errors: [`ModelError::Unsupported`] for a scaling other than YaRN,
    /// [`ModelError::Field`] for a malformed one.
    pub fn take(obj: &mut serde_json::Map<String, Value>) -> Result<Option<Self>, ModelError> {
        let mut spec = obj.remove("rope_scaling").filter(|v| !v.is_null());
        if let Some(mut params) = obj.remove("rope_parameters").filter(|v| !v.is_null()) {
            if let Some(theta) = params.get("rope_theta").filter(|t| !t.is_null()).cloned() {
                obj.insert("rope_theta".into(), theta);
            }
            let kind = params.get("rope_type").or_else(|| params.get("type")).and_then(|t| t.as_str());
            if kind.is_some_and(|k| k != "default") && spec.is_none() {
                if let Some(p) = params.as_object_mut() {
                    p.remove("rope_theta");
                }
                spec = Some(params);
            }
        }
        let Some(spec) = spec else { return Ok(None) };
        let kind = spec.get("rope_type").or_else(|| spec.get("type")).cloned().unwrap_or(Value::Null);
        if kind.as_str() != Some("yarn") {
            let reason = "DeepSeek models support YaRN (rope_type yarn) or no scaling";
            return Err(ModelError::Unsupported { field: "rope_scaling", value: kind.to_string(), reason });
        }
        let yarn: Yarn = serde_json::from_value(spec).map_err(|e| ModelError::Field {
            field: "rope_scaling",
            reason: format!("YaRN needs factor and original_max_position_embeddings: {e}"),
        })?;
        if !(yarn.factor.is_finite() && yarn.factor > 0.0) || yarn.original_max_position_embeddings == 0 {
            let reason = format!(
                "factor {} must be > 0 and original_max_position_embeddings {} > 0",
                yarn.factor, yarn.original_max_position_embeddings
            );
            return Err(ModelError::Field { field: "rope_scaling", reason });
        }
        Ok(Some(yarn))
    }

    /// The inverse frequencies `[d/2]` of a RoPE of width `d` and base `theta`: each blends the
    /// original `θ^(−2i/d)` and the interpolated `θ^(−2i/d)/s` by a linear ramp over the
    /// correction range of dims `[⌊low⌋, ⌈high⌉]` (YaRN §3.2, "NTK-by-parts").
    pub fn inv_freq(&self, d: usize, theta: f64) -> Vec<f64> {
        let (fast, slow) = (self.beta_fast.unwrap_or(32.0), self.beta_slow.unwrap_or(1.0));
        let l = self.original_max_position_embeddings as f64;
        let dim = d as f64;
        let correction = |rot: f64| dim * (l / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln());
        let (mut low, mut high) = (correction(fast), correction(slow));
        if self.truncate.unwrap_or(true) {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
        if low == high {
            high += 0.001;
        }
        (0..d / 2)
            .map(|i| {
                let base = theta.powf(2.0 * i as f64 / dim);
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                let keep = 1.0 - ramp;
                (1.0 / (self.factor * base)) * (1.0 - keep) + (1.0 / base) * keep
            })
            .collect()
    }

    /// The factor on the cos/sin tables: `attention_factor`, else `mscale(s, mscale) /
    /// mscale(s, mscale_all_dim)` when both are given and non-zero, else `mscale(s, 1)`.
    pub fn attention_factor(&self) -> f64 {
        if let Some(f) = self.attention_factor {
            return f;
        }
        match (self.mscale, self.mscale_all_dim) {
            (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                get_mscale(self.factor, m) / get_mscale(self.factor, all)
            }
            _ => get_mscale(self.factor, 1.0),
        }
    }

    /// MLA's factor on the softmax scale: `mscale(s, mscale_all_dim)²` when `mscale_all_dim` is
    /// set and non-zero, else 1 (HF `yarn_apply_mscale`).
    pub fn softmax_factor(&self) -> f64 {
        match self.mscale_all_dim {
            Some(all) if all != 0.0 => get_mscale(self.factor, all).powi(2),
            _ => 1.0,
        }
    }
}

/// MLA as a decoder's self-attention block ([`SelfAttention`]): the [`MlaConfig`], the rest of
/// the decoder's config (heads, width `D`, `attention_bias` on `q_a_proj`,
/// `kv_a_proj_with_mqa` and `o_proj`) and the YaRN scaling, which scales the softmax.
pub(crate) struct LatentAttention<'a> {
    /// The MLA sizes.
    pub mla: &'a MlaConfig,
    /// The decoder's config.
    pub base: &'a crate::config::LlamaConfig,
    /// YaRN, when the config scales RoPE.
    pub yarn: Option<&'a Yarn>,
}

impl SelfAttention for LatentAttention<'_> {
    fn parameters(&self, pre: &str, out: &mut Vec<(String, Vec<usize>)>) {
        let m = self.mla;
        let (d, h, bias) = (self.base.hidden_size, self.base.num_attention_heads, self.base.attention_bias);
        let qk = h * m.qk_head_dim();
        match m.q_lora_rank {
            None => projection(out, format!("{pre}.q_proj"), qk, d, false),
            Some(r) => {
                projection(out, format!("{pre}.q_a_proj"), r, d, bias);
                out.push((format!("{pre}.q_a_layernorm.weight"), vec![r]));
                projection(out, format!("{pre}.q_b_proj"), qk, r, false);
            }
        }
        let kv_a = m.kv_lora_rank + m.qk_rope_head_dim;
        projection(out, format!("{pre}.kv_a_proj_with_mqa"), kv_a, d, bias);
        out.push((format!("{pre}.kv_a_layernorm.weight"), vec![m.kv_lora_rank]));
        projection(
            out,
            format!("{pre}.kv_b_proj"),
            h * (m.qk_nope_head_dim + m.v_head_dim),
            m.kv_lora_rank,
            false,
        );
        projection(out, format!("{pre}.o_proj"), d, h * m.v_head_dim, bias);
    }

    /// Replicated under tensor parallelism (its split is not built yet).
    fn splits_over_tp(&self) -> bool {
        false
    }

    fn build(
        &self,
        b: &mut GraphBuilder,
        h: ValueId,
        p: ParamsAt,
        bufs: &[ValueId],
        _tp: crate::TensorShard,
    ) -> Result<ValueId, ModelError> {
        let m = self.mla;
        let query = match m.q_lora_rank {
            None => LatentQuery::Full { q: p.weight("q_proj") },
            Some(_) => LatentQuery::LowRank {
                a: p.weight("q_a_proj"),
                a_bias: p.bias("q_a_proj"),
                norm: p.weight("q_a_layernorm"),
                b: p.weight("q_b_proj"),
            },
        };
        let weights = LatentAttentionWeights {
            query,
            kv_a: p.weight("kv_a_proj_with_mqa"),
            kv_a_bias: p.bias("kv_a_proj_with_mqa"),
            kv_norm: p.weight("kv_a_layernorm"),
            kv_b: p.weight("kv_b_proj"),
            o: p.weight("o_proj"),
            o_bias: p.bias("o_proj"),
        };
        let softmax_factor = self.yarn.map_or(1.0, Yarn::softmax_factor);
        let dims = LatentAttentionDims {
            heads: self.base.num_attention_heads,
            kv_lora_rank: m.kv_lora_rank,
            nope: m.qk_nope_head_dim,
            rope: m.qk_rope_head_dim,
            v: m.v_head_dim,
            norm_eps: LATENT_NORM_EPS,
            interleave: m.rope_interleave,
            scale: softmax_factor / (m.qk_head_dim() as f64).sqrt(),
        };
        Ok(latent_attention(b, h, &weights, dims, bufs[0], bufs[1], bufs[2])?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(text: &str) -> serde_json::Map<String, Value> {
        crate::config::json_object(text).unwrap()
    }

    #[test]
    fn hf_defaults_and_null_query_rank() {
        let m = MlaConfig::take(&mut obj("{}")).unwrap();
        assert_eq!(
            (m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim(), m.v_head_dim),
            (Some(1536), 512, 192, 128)
        );
        assert!(m.rope_interleave);
        let mut o = obj(
            r#"{"q_lora_rank":null,"kv_lora_rank":32,"qk_rope_head_dim":6,"rope_interleave":false,"x":1}"#,
        );
        let m = MlaConfig::take(&mut o).unwrap();
        assert_eq!(
            (m.q_lora_rank, m.kv_lora_rank, m.qk_rope_head_dim, m.rope_interleave),
            (None, 32, 6, false)
        );
        assert_eq!(o.keys().collect::<Vec<_>>(), ["x"], "the MLA fields are taken out");
        let e = MlaConfig::take(&mut obj(r#"{"qk_rope_head_dim":5}"#)).unwrap_err();
        assert!(matches!(e, ModelError::Field { field: "qk_rope_head_dim", .. }), "{e}");
        let e = MlaConfig::take(&mut obj(r#"{"kv_lora_rank":null}"#)).unwrap_err();
        assert!(matches!(e, ModelError::Field { field: "kv_lora_rank", .. }), "{e}");
    }

    /// DeepSeek-V3's published `rope_scaling` (factor 40, original 4096, β 32/1, mscale 1/1):
    /// the frequencies below the correction range are the originals, above it divided by 40;
    /// the cos/sin factor is 1 and the softmax factor `(0.1·ln 40 + 1)²`.
    #[test]
    fn yarn_of_deepseek_v3() {
        let mut o = obj(
            r#"{"rope_theta":10000,"rope_scaling":{"type":"yarn","factor":40,"original_max_position_embeddings":4096,
                "beta_fast":32,"beta_slow":1,"mscale":1.0,"mscale_all_dim":1.0}}"#,
        );
        let y = Yarn::take(&mut o).unwrap().unwrap();
        assert!(!o.contains_key("rope_scaling"));
        let f = y.inv_freq(64, 10000.0);
        // Correction range: low = ⌊64·ln(4096/(64π))/(2 ln 1e4)⌋ = 10, high = ⌈…(2π)…⌉ = 23.
        let base = |i: usize| 10000f64.powf(-(2.0 * i as f64) / 64.0);
        assert!((f[3] - base(3)).abs() < 1e-15 && (f[10] - base(10)).abs() < 1e-15);
        assert!((f[31] - base(31) / 40.0).abs() < 1e-18 && (f[23] - base(23) / 40.0).abs() < 1e-18);
        let mid = (16.0 - 10.0) / 13.0;
        assert!((f[16] - (base(16) / 40.0 * mid + base(16) * (1.0 - mid))).abs() < 1e-15);
        assert_eq!(y.attention_factor(), 1.0);
        let m = 0.1 * 40f64.ln() + 1.0;
        assert!((y.softmax_factor() - m * m).abs() < 1e-15);
        // transformers 5 form, θ taken out of rope_parameters.
        let mut o = obj(
            r#"{"rope_parameters":{"rope_type":"yarn","rope_theta":500,"factor":4,"original_max_position_embeddings":64}}"#,
        );
        let y = Yarn::take(&mut o).unwrap().unwrap();
        assert_eq!((y.factor, o["rope_theta"].as_f64()), (4.0, Some(500.0)));
        assert!((y.attention_factor() - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-15);
        let e = Yarn::take(&mut obj(r#"{"rope_scaling":{"rope_type":"llama3","factor":8}}"#)).unwrap_err();
        assert!(matches!(e, ModelError::Unsupported { field: "rope_scaling", .. }), "{e}");
        assert!(Yarn::take(&mut obj(r#"{"rope_parameters":{"rope_type":"default","rope_theta":1}}"#))
            .unwrap()
            .is_none());
    }
}
