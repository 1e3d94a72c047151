//! Model FLOPs per token of training, for the achieved-FLOP/s figure (model FLOPs per token ×
//! tokens/s, the "model FLOPs utilisation" numerator of PaLM, Chowdhery et al. 2022, Appendix B).

use crate::config::LlamaConfig;
use crate::llama::{stage_parameters, StageSpec};

/// Training FLOPs per token of a Llama-style decoder at sequence length `seq`:
/// `6·N + 12·L·H·hd·T`, where `N` counts the weights that multiply activations (every decoder
/// layer matrix and the LM head `V×D`; the embedding is a lookup) and the second term is the
/// attention scores and their weighted sum (`2·T·hd` each per head and token forward, as PaLM
/// counts them: the whole `T×T` product, not its causal half). Forward = 1/3 of it, backward
/// 2/3. Recomputation is not counted: these are model FLOPs, not hardware FLOPs.
pub fn flops_per_token(cfg: &LlamaConfig, seq: usize) -> f64 {
    let all = StageSpec::whole(cfg.num_hidden_layers);
    let layer_weights: usize = stage_parameters(cfg, &all)
        .iter()
        .filter(|(name, shape)| name.starts_with("model.layers.") && shape.len() == 2)
        .map(|(_, shape)| shape.iter().product::<usize>())
        .sum();
    let n = (layer_weights + cfg.vocab_size * cfg.hidden_size) as f64;
    let attention = (cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim() * seq) as f64;
    6.0 * n + 12.0 * attention
}

/// [`flops_per_token`] of a MoE decoder: `N` counts the weights *one token* multiplies — in a
/// MoE layer the gate (`E·D`), its `k` routed experts (`3·D·F_e` each) and the shared experts
/// (`3·D·F_s`) — not every expert's. With multi-head latent attention `N` counts MLA's
/// projections instead of Llama's, and the attention products are `6·L·H·T·(d_qk + d_v)`
/// (scores over the q·k width `d_qk = d_nope + d_rope`, the weighted sum over the value width;
/// Llama's `12·L·H·hd·T` is the case `d_qk = d_v = hd`), as the graph's attention node runs them.
/// The multi-token-prediction module's work is not counted: model FLOPs are the main model's.
pub fn moe_flops_per_token(cfg: &crate::moe::MoeConfig, seq: usize) -> f64 {
    let base = &cfg.base;
    let moe_layers = cfg.num_moe_layers();
    let (d, fe) = (base.hidden_size, cfg.moe_intermediate_size);
    let dense_mlp = 3 * d * base.intermediate_size;
    let moe_mlp = cfg.n_routed_experts * d + (cfg.num_experts_per_tok + cfg.n_shared_experts) * 3 * d * fe;
    let delta = moe_layers as f64 * (moe_mlp as f64 - dense_mlp as f64);
    let Some(mla) = &cfg.mla else { return flops_per_token(base, seq) + 6.0 * delta };
    let all = StageSpec::whole(base.num_hidden_layers);
    // The main model's: the multi-token-prediction module is left out of model FLOPs.
    let main = crate::moe::MoeConfig { mtp_loss_weight: 0.0, ..cfg.clone() };
    let attention_weights: usize = main
        .stage_parameters(&all)
        .iter()
        .filter(|(name, shape)| name.contains(".self_attn.") && shape.len() == 2)
        .map(|(_, shape)| shape.iter().product::<usize>())
        .sum();
    let dense_mlps = base.num_hidden_layers * dense_mlp;
    let n = attention_weights + dense_mlps + base.vocab_size * d;
    let products =
        base.num_hidden_layers * base.num_attention_heads * (mla.qk_head_dim() + mla.v_head_dim) * seq;
    6.0 * n as f64 + 6.0 * products as f64 + 6.0 * delta
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llama::{build_stage, StageOptions};

    /// One third of the closed form is exactly the matmul FLOPs of the whole model's forward
    /// graph per token (every linear layer, the LM head and the two attention products).
    #[test]
    fn a_third_is_the_forward_graphs_matmul_flops() {
        for cfg in [LlamaConfig::tiny(), LlamaConfig { num_key_value_heads: Some(2), ..LlamaConfig::small() }]
        {
            let (b, t) = (2, 16);
            let all = StageSpec::whole(cfg.num_hidden_layers);
            let fw = build_stage(&cfg, &all, &StageOptions::new(b, t)).unwrap();
            let per_token = fw.matmul_flops() as f64 / (b * t) as f64;
            assert_eq!(flops_per_token(&cfg, t) / 3.0, per_token);
        }
        // tiny: D=64, F=176, L=4, V=256: N = 4·(4·64² + 3·64·176) + 256·64 = 217,088.
        assert_eq!(flops_per_token(&LlamaConfig::tiny(), 64), 6.0 * 217_088.0 + 12.0 * (4 * 64 * 64) as f64);
    }
}
