#!/usr/bin/env python3
"""Reference numerics for graphpp's Llama-style decoder, computed by PyTorch.

Writes crates/graphpp-runtime/tests/fixtures/llama_fixture.safetensors holding, for the config in
llama_fixture.json (Hugging Face field names):
  * every parameter under its HF name (f32; norm weights perturbed around 1 so they matter),
  * `tokens`, `targets` (u32, [B, T]),
  * `loss` (f32 scalar, mean cross-entropy over the B*T tokens),
  * `grad.<param>` for every parameter (f32).
The forward is a plain re-statement of the architecture (token embedding, RMSNorm, causal
multi-head attention with rotate-half RoPE and grouped key/value heads, SwiGLU MLP, final norm,
LM head, cross-entropy), evaluated in float64 from the stored f32 weights.

Usage: python tools/torch/llama_fixture.py   (PyTorch 2.x; no other packages)
"""
import json
import math
import os
import struct

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
FIX = os.path.join(HERE, "..", "..", "crates", "graphpp-runtime", "tests", "fixtures")


def rms_norm(x, w, eps):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w


def rope_tables(seq, hd, theta):
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.arange(seq, dtype=torch.float64)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def attention_block(x, p, cfg, pre):
    """x + self-attention of layer `pre` on the input-normed x (RoPE, grouped k/v heads)."""
    b, t, d = x.shape
    h, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = d // h
    cos, sin = rope_tables(t, hd, cfg["rope_theta"])
    causal = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
    hs = rms_norm(x, p[f"{pre}.input_layernorm.weight"], cfg["rms_norm_eps"])
    q = (hs @ p[f"{pre}.self_attn.q_proj.weight"].T).view(b, t, h, hd).transpose(1, 2)
    k = (hs @ p[f"{pre}.self_attn.k_proj.weight"].T).view(b, t, kv, hd).transpose(1, 2)
    v = (hs @ p[f"{pre}.self_attn.v_proj.weight"].T).view(b, t, kv, hd).transpose(1, 2)
    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    k = k.repeat_interleave(h // kv, dim=1)
    v = v.repeat_interleave(h // kv, dim=1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    s = s.masked_fill(causal, float("-inf"))
    o = (s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
    return x + o @ p[f"{pre}.self_attn.o_proj.weight"].T


def forward(p, cfg, tokens, targets):
    b, t = tokens.shape
    x = p["model.embed_tokens.weight"][tokens]
    for l in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{l}"
        x = attention_block(x, p, cfg, pre)
        hs = rms_norm(x, p[f"{pre}.post_attention_layernorm.weight"], cfg["rms_norm_eps"])
        g = hs @ p[f"{pre}.mlp.gate_proj.weight"].T
        u = hs @ p[f"{pre}.mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(g) * u) @ p[f"{pre}.mlp.down_proj.weight"].T
    x = rms_norm(x, p["model.norm.weight"], cfg["rms_norm_eps"])
    logits = x @ p["lm_head.weight"].T
    return torch.nn.functional.cross_entropy(logits.reshape(b * t, -1), targets.reshape(-1))


def param_shapes(cfg):
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kvd = cfg["num_key_value_heads"] * (d // cfg["num_attention_heads"])
    shapes = {"model.embed_tokens.weight": (v, d)}
    for l in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{l}"
        shapes.update({
            f"{pre}.input_layernorm.weight": (d,),
            f"{pre}.self_attn.q_proj.weight": (d, d),
            f"{pre}.self_attn.k_proj.weight": (kvd, d),
            f"{pre}.self_attn.v_proj.weight": (kvd, d),
            f"{pre}.self_attn.o_proj.weight": (d, d),
            f"{pre}.post_attention_layernorm.weight": (d,),
            f"{pre}.mlp.gate_proj.weight": (f, d),
            f"{pre}.mlp.up_proj.weight": (f, d),
            f"{pre}.mlp.down_proj.weight": (d, f),
        })
    shapes["model.norm.weight"] = (d,)
    shapes["lm_head.weight"] = (v, d)
    return shapes


def save_safetensors(path, tensors):
    """Minimal safetensors writer (header JSON + little-endian row-major data)."""
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        if t.dtype == torch.float32:
            blob, dt = struct.pack(f"<{t.numel()}f", *t.flatten().tolist()), "F32"
        elif t.dtype == torch.float64:
            blob, dt = struct.pack(f"<{t.numel()}d", *t.flatten().tolist()), "F64"
        else:
            blob, dt = struct.pack(f"<{t.numel()}I", *t.flatten().tolist()), "U32"
        header[name] = {"dtype": dt, "shape": list(t.shape), "data_offsets": [off, off + len(blob)]}
        blobs.append(blob)
        off += len(blob)
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * ((8 - len(hj) % 8) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(hj)) + hj + b"".join(blobs))


def main():
    with open(os.path.join(FIX, "llama_fixture.json")) as fh:
        cfg = json.load(fh)
    torch.manual_seed(0)
    b, t = cfg["graphpp_batch"], cfg["graphpp_seq"]
    params32 = {}
    for name, shape in param_shapes(cfg).items():
        if len(shape) == 1:
            params32[name] = (1.0 + 0.1 * torch.randn(shape)).float()
        else:
            params32[name] = (0.2 * torch.randn(shape)).float()
    tokens = torch.randint(0, cfg["vocab_size"], (b, t))
    targets = torch.randint(0, cfg["vocab_size"], (b, t))
    p64 = {k: v.double().requires_grad_(True) for k, v in params32.items()}
    loss = forward(p64, cfg, tokens, targets)
    loss.backward()
    out = dict(params32)
    out["tokens"] = tokens.to(torch.int32)  # written as u32
    out["targets"] = targets.to(torch.int32)
    out["loss"] = loss.detach().float().reshape(())
    for k, v in p64.items():
        out[f"grad.{k}"] = v.grad.float()
    path = os.path.join(FIX, "llama_fixture.safetensors")
    save_safetensors(path, out)
    print(f"loss {loss.item():.6f}; wrote {path} ({os.path.getsize(path)} bytes) with torch {torch.__version__}")


if __name__ == "__main__":
    main()
