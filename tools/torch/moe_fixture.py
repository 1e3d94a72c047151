#!/usr/bin/env python3
"""Reference numerics for graphpp's DeepSeek-style MoE decoder, computed by PyTorch.

Writes crates/graphpp-runtime/tests/fixtures/NAME.safetensors holding, for the config in NAME.json
(Hugging Face DeepSeek-V3 field names; NAME is moe_fixture by default, moe_softmax_fixture for
the softmax scorer without weight normalisation):
  * every parameter under its HF name (f32), and each MoE layer's load-balancing bias
    `model.layers.<l>.mlp.gate.e_score_correction_bias` (f32, non-zero so that it changes the
    choice of experts),
  * `tokens`, `targets` (u32, [B, T]),
  * `loss` (f32 scalar, mean cross-entropy over the B*T tokens),
  * with `aux_loss_alpha` > 0 in the config (NAME moe_aux_fixture): `aux_loss` (f32 scalar, the
    MoE layers' sequence-wise balance losses summed, DeepSeek-V3 eqs. 17-20: per sequence
    alpha * sum_i f_i P_i with f_i = E/(k T) * tokens routed to expert i and P_i the mean over
    the sequence of the normalised scores s_i / sum_j s_j; averaged over the B sequences),
  * `grad.<param>` for every parameter (f32): of loss + aux_loss.
The forward is the Llama decoder of llama_fixture.py with the MLP of layers >= first_k_dense_replace
replaced by the MoE block of Hugging Face's DeepseekV3MoE, restated here: sigmoid gate scores (a
softmax over the experts with scoring_func softmax, as DeepSeek-V2), top-k of (scores + bias),
weights = the unbiased scores of the chosen experts, normalised to sum 1 when norm_topk_prob,
times routed_scaling_factor, every routed expert a SwiGLU MLP applied to the
tokens routed to it (a plain loop over experts, as HF's reference implementation does), plus the
shared experts. Evaluated in float64 from the stored f32 weights. The script re-draws the weights
until every token's k-th and (k+1)-th choice differ by more than 1e-3, so that f32 rounding in
graphpp cannot flip a routing decision.

With MLA fields in the config (kv_lora_rank ...; NAME mla_fixture, mla_v2_fixture) the attention is
DeepSeek's multi-head latent attention of mla_reference.py (YaRN RoPE when rope_scaling is given),
and the loss, aux loss and gradients are written in float64. With n_group > 1 the routing is
group-limited (mla_reference.limit_groups); the script then also requires a token whose experts
differ from a plain top-k, and writes `expert_load.<l>` (tokens per expert, u32) and
`plain_topk_load.<l>` (what a plain top-k would give) per MoE layer.

Usage: python tools/torch/moe_fixture.py [NAME]   (PyTorch 2.x; no other packages)
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_fixture import FIX, attention_block, rms_norm, save_safetensors  # noqa: E402
from mla_reference import limit_groups, mla_block, mla_shapes  # noqa: E402


def swiglu(x, p, pre):
    g = x @ p[f"{pre}.gate_proj.weight"].T
    u = x @ p[f"{pre}.up_proj.weight"].T
    return (torch.nn.functional.silu(g) * u) @ p[f"{pre}.down_proj.weight"].T


def seq_aux_loss(scores, idx, cfg, b):
    """Sequence-wise balance loss of one layer for scores [N, E] and chosen experts idx [N, k]."""
    e, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    t = scores.shape[0] // b
    share = (scores / scores.sum(-1, keepdim=True)).reshape(b, t, e).mean(1)
    counts = torch.zeros(b, e, dtype=scores.dtype).scatter_add(
        1, idx.reshape(b, t * k), torch.ones(b, t * k, dtype=scores.dtype))
    f = counts * e / (k * t)
    return cfg["aux_loss_alpha"] * (f * share).sum(1).mean()


def grouped(cfg):
    return cfg.get("n_group", 1) > 1 and cfg.get("topk_method") != "greedy"


def moe(x, p, bufs, cfg, pre, margins, aux, b, loads):
    """DeepseekV3MoE on x [N, D] (b sequences); appends each token's choice margin to `margins`,
    with aux_loss_alpha > 0 the layer's balance loss to `aux`, and to `loads` the tokens per
    expert of the choice made and of a plain top-k that ignores the groups."""
    e, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    logits = x @ p[f"{pre}.gate.weight"].T
    scores = logits.softmax(-1) if cfg.get("scoring_func") == "softmax" else torch.sigmoid(logits)
    choice = scores + bufs[f"{pre}.gate.e_score_correction_bias"]
    plain = torch.topk(choice.detach(), k, dim=-1).indices
    if grouped(cfg):
        choice, group_margin = limit_groups(choice.detach(), cfg)
        margins.append(group_margin)
    top = torch.topk(choice.detach(), k + 1, dim=-1)
    margins.append((top.values[:, k - 1] - top.values[:, k]).min().item())
    idx = top.indices[:, :k]
    loads.append((torch.bincount(idx.flatten(), minlength=e), torch.bincount(plain.flatten(), minlength=e)))
    if cfg.get("aux_loss_alpha", 0) > 0:
        aux.append(seq_aux_loss(scores, idx, cfg, b))
    w = scores.gather(1, idx)
    if cfg["norm_topk_prob"]:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    w = w * cfg["routed_scaling_factor"]
    out = torch.zeros_like(x)
    for j in range(e):
        tok, slot = torch.nonzero(idx == j, as_tuple=True)
        if tok.numel():
            y = swiglu(x[tok], p, f"{pre}.experts.{j}")
            out = out.index_add(0, tok, y * w[tok, slot].unsqueeze(-1))
    if cfg["n_shared_experts"] > 0:
        out = out + swiglu(x, p, f"{pre}.shared_experts")
    return out


def forward(p, bufs, cfg, tokens, targets, margins, aux, loads):
    b, t = tokens.shape
    d = cfg["hidden_size"]
    x = p["model.embed_tokens.weight"][tokens]
    for l in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{l}"
        x = mla_block(x, p, cfg, pre) if "kv_lora_rank" in cfg else attention_block(x, p, cfg, pre)
        hs = rms_norm(x, p[f"{pre}.post_attention_layernorm.weight"], cfg["rms_norm_eps"])
        if l < cfg["first_k_dense_replace"]:
            x = x + swiglu(hs, p, f"{pre}.mlp")
        else:
            y = moe(hs.reshape(b * t, d), p, bufs, cfg, f"{pre}.mlp", margins, aux, b, loads)
            x = x + y.reshape(b, t, d)
    x = rms_norm(x, p["model.norm.weight"], cfg["rms_norm_eps"])
    logits = x @ p["lm_head.weight"].T
    return torch.nn.functional.cross_entropy(logits.reshape(b * t, -1), targets.reshape(-1))


def param_shapes(cfg):
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    fe, e = cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    fs = fe * cfg["n_shared_experts"]
    kvd = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * (d // cfg["num_attention_heads"])
    mlp = lambda pre, inner: {  # noqa: E731
        f"{pre}.gate_proj.weight": (inner, d),
        f"{pre}.up_proj.weight": (inner, d),
        f"{pre}.down_proj.weight": (d, inner),
    }
    shapes = {"model.embed_tokens.weight": (v, d)}
    for l in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{l}"
        shapes[f"{pre}.input_layernorm.weight"] = (d,)
        if "kv_lora_rank" in cfg:
            shapes.update(mla_shapes(cfg, pre))
        else:
            shapes.update({
                f"{pre}.self_attn.q_proj.weight": (d, d),
                f"{pre}.self_attn.k_proj.weight": (kvd, d),
                f"{pre}.self_attn.v_proj.weight": (kvd, d),
                f"{pre}.self_attn.o_proj.weight": (d, d),
            })
        shapes[f"{pre}.post_attention_layernorm.weight"] = (d,)
        if l < cfg["first_k_dense_replace"]:
            shapes.update(mlp(f"{pre}.mlp", f))
        else:
            shapes[f"{pre}.mlp.gate.weight"] = (e, d)
            for j in range(e):
                shapes.update(mlp(f"{pre}.mlp.experts.{j}", fe))
            if fs:
                shapes.update(mlp(f"{pre}.mlp.shared_experts", fs))
    shapes["model.norm.weight"] = (d,)
    shapes["lm_head.weight"] = (v, d)
    return shapes


def main():
    fixture = sys.argv[1] if len(sys.argv) > 1 else "moe_fixture"
    with open(os.path.join(FIX, f"{fixture}.json")) as fh:
        cfg = json.load(fh)
    b, t = cfg["graphpp_batch"], cfg["graphpp_seq"]
    for seed in range(100):
        torch.manual_seed(seed)
        params32 = {}
        for name, shape in param_shapes(cfg).items():
            scale = 0.1 if len(shape) == 1 else 0.3
            params32[name] = ((1.0 if len(shape) == 1 else 0.0) + scale * torch.randn(shape)).float()
        bufs32 = {
            f"model.layers.{l}.mlp.gate.e_score_correction_bias": (0.1 * torch.randn(cfg["n_routed_experts"])).float()
            for l in range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"])
        }
        tokens = torch.randint(0, cfg["vocab_size"], (b, t))
        targets = torch.randint(0, cfg["vocab_size"], (b, t))
        p64 = {k: v.double().requires_grad_(True) for k, v in params32.items()}
        b64 = {k: v.double() for k, v in bufs32.items()}
        margins, aux, loads = [], [], []
        loss = forward(p64, b64, cfg, tokens, targets, margins, aux, loads)
        # A grouped fixture must route some token differently from a plain top-k.
        differs = any(not torch.equal(got, plain) for got, plain in loads)
        if min(margins) > 1e-3 and (differs or not grouped(cfg)):
            break
    else:
        raise SystemExit("no seed gives routing margins above 1e-3")
    aux_loss = sum(aux) if aux else None
    (loss + aux_loss if aux else loss).backward()
    out = dict(params32)
    out.update(bufs32)
    out["tokens"] = tokens.to(torch.int32)  # written as u32
    out["targets"] = targets.to(torch.int32)
    # MLA fixtures keep the float64 results, for a comparison in f64 to 1e-10.
    wide = (lambda v: v.detach()) if "kv_lora_rank" in cfg else (lambda v: v.detach().float())
    out["loss"] = wide(loss).reshape(())
    if aux:
        out["aux_loss"] = wide(aux_loss).reshape(())
    for k, v in p64.items():
        # An expert no token reached has no gradient: zero.
        out[f"grad.{k}"] = wide(v.grad if v.grad is not None else torch.zeros_like(v))
    if grouped(cfg):
        layers = range(cfg["first_k_dense_replace"], cfg["num_hidden_layers"])
        for l, (got, plain) in zip(layers, loads):
            out[f"expert_load.{l}"] = got.to(torch.int32)
            out[f"plain_topk_load.{l}"] = plain.to(torch.int32)
    path = os.path.join(FIX, f"{fixture}.safetensors")
    save_safetensors(path, out)
    print(f"seed {seed}, min routing margin {min(margins):.2e}, loss {loss.item():.6f}; wrote {path} "
          f"({os.path.getsize(path)} bytes) with torch {torch.__version__}")


if __name__ == "__main__":
    main()
