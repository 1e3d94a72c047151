#!/usr/bin/env python3
"""Hugging Face Llama fixtures for `graphpp train --init-from DIR`.

Builds two tiny `transformers.LlamaForCausalLM` models with configs that exercise every Llama
field graphpp implements, saves each with `save_pretrained` (config.json + model.safetensors, HF
tensor names, [out, in] layout) into crates/graphpp/tests/fixtures/<name>/, and writes the
model's logits for a fixed token sequence next to it (logits.safetensors):

  hf-tiny-llama-gelu       f32 weights; hidden 24, 4 heads of head_dim 8 (!= 24/4), 2 kv heads
                           (grouped-query attention), attention_bias, mlp_bias, hidden_act gelu
                           (exact erf), tie_word_embeddings, rope_theta 500, rms_norm_eps 1e-5
  hf-tiny-llama-tanh-bf16  bf16 weights; hidden 16, 4 heads (head_dim 4), 1 kv head, no biases,
                           hidden_act gelu_pytorch_tanh, untied LM head, default rope_theta and
                           rms_norm_eps (1e-6)

Both have vocab_size 256 (graphpp's byte tokenizer) and 2 decoder layers. Weights: seed 0, then
every matrix redrawn from normal(0, 0.3), every bias from normal(0, 0.1), every norm weight from
1 + normal(0, 0.1), so biases, norms and attention patterns all matter (HF's own init, 0.02 and
zero biases, gives almost uniform logits). The logits come from the saved folder reloaded with
`from_pretrained(dir, dtype=torch.float32)`: the bf16 model's weights converted to f32, which is
what graphpp loads.

logits.safetensors holds
  tokens, targets  int64 [2, 8]        (seed 1; targets = the next token, last one random)
  logits           f32 [16, 256]       the f32 model's logits (eager attention), rows = B*T
  logits_f64       f64 [16, 256]       the same model in float64 throughout (see all_float64:
                                       transformers otherwise keeps RoPE, RMSNorm and softmax in f32)
  loss             f32 scalar          mean cross-entropy of `logits` against `targets`
  loss_f64         f64 scalar          the same from `logits_f64`

Run from the repository root (CPU, no GPU needed; a few seconds), in a virtual environment with
`pip install torch transformers safetensors` (all from PyPI):
  python tools/torch/hf_llama_logits.py
The committed fixtures were made with torch 2.15.0, transformers 5.24.0, safetensors 0.8.0 on
Python 3.11; rerunning with those versions reproduces them byte for byte.
"""
import contextlib
import json
import os

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama as ml

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "..", "..", "crates", "graphpp", "tests", "fixtures")

FIXTURES = {
    "hf-tiny-llama-gelu": dict(
        dtype=torch.float32,
        config=dict(
            vocab_size=256,
            hidden_size=24,
            intermediate_size=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            attention_bias=True,
            mlp_bias=True,
            hidden_act="gelu",
            tie_word_embeddings=True,
            rope_theta=500.0,
            rms_norm_eps=1e-5,
            max_position_embeddings=64,
        ),
    ),
    "hf-tiny-llama-tanh-bf16": dict(
        dtype=torch.bfloat16,
        config=dict(
            vocab_size=256,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            hidden_act="gelu_pytorch_tanh",
            tie_word_embeddings=False,
            max_position_embeddings=64,
        ),
    ),
}

B, T = 2, 8


@contextlib.contextmanager
def all_float64():
    """transformers computes three things in f32 even in a float64 model: the RoPE tables
    (LlamaRotaryEmbedding.forward), RMSNorm (LlamaRMSNorm.forward casts to f32) and the eager
    attention softmax (dtype=torch.float32). Inside this block they run in the model's dtype, with
    the same formulas, so a float64 model is float64 throughout."""
    rope, norm, softmax = ml.LlamaRotaryEmbedding.forward, ml.LlamaRMSNorm.forward, F.softmax

    def rope64(self, x, position_ids):
        dim = self.inv_freq.shape[0] * 2
        base = self.config.rope_parameters["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        emb = position_ids[..., None].double() * inv_freq
        emb = torch.cat((emb, emb), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def norm64(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    ml.LlamaRotaryEmbedding.forward, ml.LlamaRMSNorm.forward = rope64, norm64
    torch.nn.functional.softmax = lambda x, dim=None, dtype=None: softmax(x, dim=dim)
    try:
        yield
    finally:
        ml.LlamaRotaryEmbedding.forward, ml.LlamaRMSNorm.forward = rope, norm
        torch.nn.functional.softmax = softmax


def perturb(model):
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.3 * noise)


def main():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, 256, (B, T + 1), generator=g)
    tokens, targets = seq[:, :T].contiguous(), seq[:, 1:].contiguous()
    for name, spec in FIXTURES.items():
        out = os.path.join(FIX, name)
        os.makedirs(out, exist_ok=True)
        cfg = LlamaConfig(**spec["config"], attn_implementation="eager")
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).eval()
        perturb(model)
        model = model.to(spec["dtype"])
        model.save_pretrained(out, safe_serialization=True)
        # The reference is what transformers computes from the saved folder in f32 (the stored
        # weights converted to f32, RoPE tables computed afresh: a bf16 model's own inv_freq
        # buffer was rounded to bf16).
        model = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
        with torch.no_grad():
            logits = model(input_ids=tokens).logits.reshape(B * T, -1)
            with all_float64():
                logits64 = model.double()(input_ids=tokens).logits.reshape(B * T, -1)
        loss = F.cross_entropy(logits, targets.reshape(-1))
        loss64 = F.cross_entropy(logits64, targets.reshape(-1))
        save_file(
            {
                "tokens": tokens,
                "targets": targets,
                "logits": logits.contiguous(),
                "logits_f64": logits64.contiguous(),
                "loss": loss.reshape(()),
                "loss_f64": loss64.reshape(()),
            },
            os.path.join(out, "logits.safetensors"),
        )
        for extra in ("generation_config.json",):
            path = os.path.join(out, extra)
            if os.path.exists(path):
                os.remove(path)
        with open(os.path.join(out, "config.json")) as f:
            written = json.load(f)
        print(
            f"{name}: loss {loss.item():.6f} (f64 {loss64.item():.9f}), "
            f"max |f32 - f64 logits| {(logits.double() - logits64).abs().max().item():.3e}, "
            f"tensors {sorted(model.state_dict().keys())[:3]}..., config keys {sorted(written)}"
        )
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")


if __name__ == "__main__":
    main()
