//! Bytes a Llama-style model needs for one microbatch, from its config and the microbatch shape
//! alone, so that a shape too large to run is refused before any tensor is allocated
//! (`--microbatch-size 100000` once asked the allocator for 1.6 GB per tensor, `--seq-len 100000`
//! for an 80 GB mask).
//!
//! All figures are f32 (4 bytes a value) with token ids u32. With `B` sequences of `T` tokens,
//! `D = hidden_size`, `F = intermediate_size`, `H = num_attention_heads`, `KV =
//! num_key_value_heads`, `V = vocab_size`:
//! - activations saved from the forward for the backward, per decoder layer,
//!   `4·B·T·(11·D + 2·KV·hd + H·hd + 5·F + 4)` bytes (residual stream, norms, q/k/v and their
//!   rotations, the attention's k and v operands `KV·hd` each per token — grouped-query
//!   attention reads them unrepeated — the attention output `H·hd`, the SwiGLU intermediates;
//!   no `[B, H, T, T]`
//!   probabilities: attention is one node whose backward recomputes them,
//!   [`graphpp_graph::Op::Attention`]); plus `4·B·T` for the token ids on the
//!   first stage and `4·B·T·(V + 3·D + 3)` for the final norm, the log-probabilities (one
//!   log-softmax node) and the loss on the last stage. This is exactly what the graphs save
//!   under `RecomputePolicy::SaveAll` (tested against the stage graphs), and a bound
//!   on what the default `RecomputePolicy::Pointwise` saves (`2·F + 2·D` fewer values per token
//!   and layer, `D` fewer on the last stage: `graphpp-runtime`'s `tests/compiled.rs`);
//! - buffers of each stage: the causal mask `T²` and the RoPE tables `2·T·hd` values, built in f64
//!   before the cast ([`crate::stage_buffers`]).

use crate::config::LlamaConfig;
use crate::llama::StageSpec;

/// Bytes of one f32 value.
const F32: u128 = 4;

/// Saved-activation bytes of one microbatch of `batch` sequences of `seq` tokens through the layers
/// of `spec` (with the embedding's token ids on a first stage and the head on a last stage),
/// counting the stage's input as saved. Saturating.
pub fn stage_activation_bytes(cfg: &LlamaConfig, spec: &StageSpec, batch: usize, seq: usize) -> u128 {
    let (b, t) = (batch as u128, seq as u128);
    let (d, f) = (cfg.hidden_size as u128, cfg.intermediate_size as u128);
    let heads = (cfg.num_attention_heads * cfg.head_dim()) as u128;
    let kv_heads = (cfg.kv_heads() * cfg.head_dim()) as u128;
    let per_token_layer = 11 * d + 2 * kv_heads + heads + 5 * f + 4;
    let layer = t.saturating_mul(per_token_layer);
    let mut values = layer.saturating_mul(spec.layers.len() as u128);
    if spec.is_first() {
        values = values.saturating_add(t);
    }
    if spec.is_last() {
        values = values.saturating_add(head_values(cfg, seq));
    }
    values.saturating_mul(b).saturating_mul(F32)
}

/// Values per sequence the final norm, the log-probabilities (one log-softmax node) and the loss
/// save on a last stage: `T·(V + 3·D + 3)`.
fn head_values(cfg: &LlamaConfig, seq: usize) -> u128 {
    let (d, v) = (cfg.hidden_size as u128, cfg.vocab_size as u128);
    (seq as u128).saturating_mul(v + 3 * d + 3)
}

/// Saved-activation bytes of one microbatch through the whole model (all layers on one stage).
pub fn model_activation_bytes(cfg: &LlamaConfig, batch: usize, seq: usize) -> u128 {
    let whole = StageSpec::whole(cfg.num_hidden_layers);
    stage_activation_bytes(cfg, &whole, batch, seq)
}

/// Bytes of one stage's buffers (mask and RoPE tables) in f32; building them takes twice that
/// again for a moment (their f64 values, [`crate::stage_buffers`]).
pub fn buffer_bytes(cfg: &LlamaConfig, seq: usize) -> u128 {
    let t = seq as u128;
    let values =
        t.saturating_mul(t).saturating_add(2u128.saturating_mul(t).saturating_mul(cfg.head_dim() as u128));
    values.saturating_mul(F32)
}

/// Number of parameters of the whole model (one copy).
pub fn parameter_count(cfg: &LlamaConfig) -> u128 {
    let whole = StageSpec::whole(cfg.num_hidden_layers);
    count(&crate::llama::stage_parameters(cfg, &whole))
}

/// Elements of all `params` (saturating).
pub fn count(params: &[(String, Vec<usize>)]) -> u128 {
    params
        .iter()
        .map(|(_, shape)| shape.iter().fold(1u128, |n, &x| n.saturating_mul(x as u128)))
        .fold(0u128, u128::saturating_add)
}

/// Saved-activation bytes of one microbatch through stage `spec` of a MoE decoder: the Llama
/// figure ([`stage_activation_bytes`]) with each MoE layer's dense MLP (`5·F` values per token)
/// replaced by what the MoE block saves: per token `E + k·(2·D + 5·F_e + 3) + 5·F_s − D` (the
/// gate's E scores; per routed copy the row, its sorted order, the two projections, the
/// activation, the product and the output put back; the shared experts; the block's input is
/// saved once, where the dense layer counted it as the MLP's), `k + 1` more with
/// `norm_topk_prob` (the weights before and after renormalising), `E + 1` more with a balance
/// loss (its scores); and per layer whatever the tokens, the `E` expert counts and, with the
/// sequence-wise balance loss, `B·E` (`F_e` = `moe_intermediate_size`, `F_s` =
/// `n_shared_experts · F_e`). Exactly what the graphs save under `RecomputePolicy::SaveAll`
/// (tested on six configurations, whole and split, at two microbatch shapes; found by varying
/// one size at a time).
///
/// With multi-head latent attention each layer's Llama attention values (`2·KV·hd + H·hd` and
/// the `3·D` of q, k and v: [`stage_activation_bytes`]) are replaced by MLA's
/// ([`mla_attention_values`]).
pub fn moe_stage_activation_bytes(
    cfg: &crate::moe::MoeConfig,
    spec: &StageSpec,
    batch: usize,
    seq: usize,
) -> u128 {
    // The multi-token-prediction module on a last stage: one more MoE layer (L, where the stage's
    // layers end) and a second head (an estimate; not in the exactness tests).
    let mtp = cfg.mtp().is_some() && spec.is_last();
    let extended =
        StageSpec { layers: spec.layers.start..spec.layers.end + usize::from(mtp), ..spec.clone() };
    let spec = &extended;
    let second_head = if mtp { head_values(&cfg.base, seq) * batch as u128 * F32 } else { 0 };
    let mut dense = stage_activation_bytes(&cfg.base, spec, batch, seq).saturating_add(second_head);
    if let Some(mla) = &cfg.mla {
        let b = &cfg.base;
        let llama = (2 * b.kv_heads() * b.head_dim()
            + b.num_attention_heads * b.head_dim()
            + 3 * b.hidden_size) as u128;
        let per_layer = (batch as u128).saturating_mul(seq as u128).saturating_mul(F32);
        let layers = spec.layers.len() as u128;
        let latent = mla_attention_values(mla, b.num_attention_heads) as u128;
        dense = dense
            .saturating_sub(per_layer.saturating_mul(llama).saturating_mul(layers))
            .saturating_add(per_layer.saturating_mul(latent).saturating_mul(layers));
    }
    let moe_layers = spec.layers.clone().filter(|&l| cfg.is_moe(l)).count() as u128;
    let (e, k, d) =
        (cfg.n_routed_experts as u128, cfg.num_experts_per_tok as u128, cfg.base.hidden_size as u128);
    let (fe, f) = (cfg.moe_intermediate_size as u128, cfg.base.intermediate_size as u128);
    let fs = fe * cfg.n_shared_experts as u128;
    let aux = cfg.aux_loss_alpha > 0.0;
    let normalised = if cfg.norm_topk_prob { k + 1 } else { 0 };
    // Per token: the gate's scores, the routed copies, the shared experts, the renormalisation,
    // the balance loss's scores; the block's input is saved once, not as the dense MLP's.
    let moe =
        (e + k * (2 * d + 5 * fe + 3) + 5 * fs + normalised + if aux { e + 1 } else { 0 }).saturating_sub(d);
    // Per layer, whatever the tokens: the expert counts, and the sequence-wise balance loss's
    // per-sequence share of each expert.
    let per_layer = e.saturating_add(if aux { (batch as u128).saturating_mul(e) } else { 0 });
    let tokens = (batch as u128).saturating_mul(seq as u128);
    let values = tokens.saturating_mul(moe).saturating_add(per_layer);
    dense
        .saturating_sub(tokens.saturating_mul(F32).saturating_mul(5 * f).saturating_mul(moe_layers))
        .saturating_add(values.saturating_mul(F32).saturating_mul(moe_layers))
}

/// Values per token one layer of multi-head latent attention saves for its backward (f32,
/// `RecomputePolicy::SaveAll`), `H` heads: the query latent, its normalisation and the normed
/// latent (`3·r_q + 2`, with a query latent), the same of the key/value latent (`3·r_kv + 2`),
/// the attention's q and k (`d_qk` each), v and output (`d_v` each) and the heads' values into
/// `o_proj` (`H·(2·d_qk + 3·d_v)`). RoPE saves nothing per head (its tables are buffers). Fitted
/// to the graphs' saved values by varying one size at a time (exact, tested with the MoE
/// figures).
pub fn mla_attention_values(mla: &crate::mla::MlaConfig, heads: usize) -> usize {
    let query = mla.q_lora_rank.map_or(0, |r| 3 * r + 2);
    query + 3 * mla.kv_lora_rank + 2 + heads * (2 * mla.qk_head_dim() + 3 * mla.v_head_dim)
}

/// Bytes of the values the forward graph `fw` saves for its backward under
/// `RecomputePolicy::SaveAll` (the figure the estimates are tested against).
#[cfg(test)]
pub(crate) fn saved_bytes(fw: &graphpp_graph::Graph) -> u128 {
    let sg = graphpp_graph::stage_graphs(fw, &graphpp_graph::RecomputePolicy::SaveAll).unwrap();
    sg.fw
        .outputs
        .iter()
        .filter(|o| graphpp_graph::names::is_saved(&o.name))
        .map(|o| sg.fw.node(o.value).ty.size_bytes() as u128)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llama::{split_layers, StageOptions};

    /// Bytes of the values a stage's forward saves for its backward, from the graph itself.
    fn graph_saved_bytes(cfg: &LlamaConfig, stages: usize, stage: usize, b: usize, t: usize) -> u128 {
        let spec = &split_layers(cfg.num_hidden_layers, stages, None).unwrap()[stage];
        saved_bytes(&crate::build_stage(cfg, spec, &StageOptions::new(b, t)).unwrap())
    }

    #[test]
    fn formula_matches_the_saved_values_of_the_graphs() {
        let gqa = LlamaConfig {
            num_key_value_heads: Some(2),
            intermediate_size: 96,
            vocab_size: 300,
            ..LlamaConfig::tiny()
        };
        for cfg in [LlamaConfig::tiny(), LlamaConfig::small(), gqa] {
            for (b, t) in [(1, 8), (2, 16), (3, 5)] {
                assert_eq!(
                    model_activation_bytes(&cfg, b, t),
                    graph_saved_bytes(&cfg, 1, 0, b, t),
                    "B={b} T={t}"
                );
                // Split in stages: each stage saves the same, less its input (an input, not a saved
                // value of the graph, though the runtime keeps it for the backward all the same).
                let stages = 2;
                for spec in split_layers(cfg.num_hidden_layers, stages, None).unwrap() {
                    let input = if spec.is_first() { 0 } else { (4 * b * t * cfg.hidden_size) as u128 };
                    let got = graph_saved_bytes(&cfg, stages, spec.stage, b, t);
                    assert_eq!(
                        stage_activation_bytes(&cfg, &spec, b, t) - input,
                        got,
                        "stage {}",
                        spec.stage
                    );
                }
            }
        }
    }

    #[test]
    fn tiny_figures() {
        let tiny = LlamaConfig::tiny();
        // graphpp graph --stats: 1938432 bytes per microbatch at B=1, T=64 (2135040 while the
        // attention probabilities, 4 heads × 64² per layer, were saved instead of the output).
        assert_eq!(model_activation_bytes(&tiny, 1, 64), 1_938_432);
        // --microbatch-size 100000: 194 GB for one microbatch.
        assert_eq!(model_activation_bytes(&tiny, 100_000, 64), 193_843_200_000);
        // --seq-len 100000: the mask alone is 10^10 values (40 GB in f32, 80 GB in f64).
        assert_eq!(buffer_bytes(&tiny, 100_000), 4 * (100_000u128 * 100_000 + 2 * 100_000 * 16));
        assert_eq!(parameter_count(&tiny), 234_048);
        assert_eq!(model_activation_bytes(&tiny, usize::MAX, usize::MAX), u128::MAX);
    }
}
