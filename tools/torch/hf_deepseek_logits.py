#!/usr/bin/env python3
"""A Hugging Face DeepSeek-V3 fixture for `graphpp train/verify --init-from DIR`.

Builds a tiny `transformers.DeepseekV3ForCausalLM` (multi-head latent attention with a query
latent, YaRN RoPE with interleaved pairs, q.k width 12 != value width 6, MoE layers 1-2 of 8 routed
experts, 2 per token, in 4 groups of which each token keeps 2, one shared expert), saves it with
`save_pretrained` into crates/graphpp/tests/fixtures/hf-tiny-deepseek-v3/ (config.json +
model.safetensors, HF names; the routing biases `mlp.gate.e_score_correction_bias` included), and
writes the model's logits for a fixed token sequence next to it (logits.safetensors: tokens,
targets int64 [2, 8]; logits f32 [16, 256], eager attention; loss f32). Weights: every matrix
redrawn from normal(0, 0.3), every norm weight from 1 + normal(0, 0.1), every routing bias from
normal(0, 0.1); the draw is repeated until every token's routing decision (the kept groups and
the k-th against the (k+1)-th expert) has a margin above 1e-3, so that f32 rounding elsewhere
cannot flip a choice.

Run from the repository root (CPU, a few seconds), with `pip install torch transformers
safetensors`:  python tools/torch/hf_deepseek_logits.py
Made with torch 2.15.0, transformers 5.25.0.
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mla_reference import limit_groups  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "..", "crates", "graphpp", "tests", "fixtures", "hf-tiny-deepseek-v3")
B, T = 2, 8
CONFIG = dict(
    vocab_size=256, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1,
    num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
    q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
    max_position_embeddings=64, rms_norm_eps=1e-5,
    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
                         beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8),
)


def perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * noise)
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".weight"):
                p.copy_(0.3 * noise)


def routing_margin(model, tokens):
    """The smallest margin of any routing decision of `model` on `tokens`."""
    margins, k = [], model.config.num_experts_per_tok
    cfg = dict(n_group=model.config.n_group, topk_group=model.config.topk_group, topk_method="noaux_tc")

    def hook(gate, _inp, out):
        scores = out[0].sigmoid() + gate.e_score_correction_bias
        choice, group_margin = limit_groups(scores, cfg)
        top = choice.topk(k + 1, dim=-1).values
        margins.extend([group_margin, (top[:, k - 1] - top[:, k]).min().item()])

    hooks = [layer.mlp.gate.register_forward_hook(hook) for layer in model.model.layers
             if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        model(input_ids=tokens)
    for h in hooks:
        h.remove()
    return min(margins)


def main():
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, 256, (B, T + 1), generator=g)
    tokens, targets = seq[:, :T].contiguous(), seq[:, 1:].contiguous()
    cfg = DeepseekV3Config(**CONFIG, attn_implementation="eager")
    for seed in range(100):
        torch.manual_seed(0)
        model = DeepseekV3ForCausalLM(cfg).eval()
        perturb(model, seed)
        margin = routing_margin(model, tokens)
        if margin > 1e-3:
            break
    else:
        raise SystemExit("no seed gives routing margins above 1e-3")
    os.makedirs(OUT, exist_ok=True)
    model.save_pretrained(OUT, safe_serialization=True)
    model = DeepseekV3ForCausalLM.from_pretrained(OUT, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.reshape(B * T, -1)
    loss = F.cross_entropy(logits, targets.reshape(-1))
    save_file({"tokens": tokens, "targets": targets, "logits": logits.contiguous(), "loss": loss.reshape(())},
              os.path.join(OUT, "logits.safetensors"))
    path = os.path.join(OUT, "generation_config.json")
    if os.path.exists(path):
        os.remove(path)
    with open(os.path.join(OUT, "config.json")) as f:
        keys = sorted(json.load(f))
    print(f"seed {seed}, routing margin {margin:.2e}, loss {loss.item():.6f}, config keys {keys}")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")


if __name__ == "__main__":
    main()
