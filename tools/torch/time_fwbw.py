#!/usr/bin/env python3
"""PyTorch timing of one forward + backward of graphpp's `small` (or `tiny`) preset on one stage,
written as PyTorch users write the model: `nn.Embedding`, `nn.Linear(bias=False)`,
`F.rms_norm`, rotate-half RoPE, `F.scaled_dot_product_attention(is_causal=True)`, SwiGLU,
cross-entropy — eager or under `torch.compile` (--mode), in f32 or under bf16 autocast (--dtype,
`torch.autocast("cpu", dtype=torch.bfloat16)`: f32 master weights, bf16 matmuls).

The same shapes as `cargo run --release -p graphpp-runtime --example fwbw` (which runs this script
beside graphpp when given `--torch PYTHON`, alternating, once per mode): B sequences of 64 tokens
(--batch), all layers. Prints the median over N runs (after warm-up runs; `torch.compile`
compiles during its warm-up).

With --device cuda the model runs on the GPU (bf16 under `torch.autocast("cuda")`), each run
ended by `torch.cuda.synchronize()`; --config takes a Hugging Face Llama config.json instead of a
preset, --seq another sequence length.

Usage: python tools/torch/time_fwbw.py [--model small|tiny] [--config FILE] [--batch B] [--seq T]
                                      [--dtype f32|bf16] [--mode eager|compile] [--runs N]
                                      [--threads K] [--device cpu|cuda]
"""
import argparse
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

SMALL = {
    "vocab_size": 256, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 8,
    "num_attention_heads": 8, "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
}
TINY = dict(SMALL, hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4)
SEQ = 64


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, f = cfg["hidden_size"], cfg["intermediate_size"]
        self.h, self.kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd = d // self.h
        self.eps = cfg["rms_norm_eps"]
        self.input_layernorm = nn.Parameter(torch.ones(d))
        self.post_attention_layernorm = nn.Parameter(torch.ones(d))
        self.q_proj = nn.Linear(d, self.h * self.hd, bias=False)
        self.k_proj = nn.Linear(d, self.kv * self.hd, bias=False)
        self.v_proj = nn.Linear(d, self.kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.h * self.hd, d, bias=False)
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        hs = F.rms_norm(x, (d,), self.input_layernorm, self.eps)
        q = self.q_proj(hs).view(b, t, self.h, self.hd).transpose(1, 2)
        k = self.k_proj(hs).view(b, t, self.kv, self.hd).transpose(1, 2)
        v = self.v_proj(hs).view(b, t, self.kv, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != self.h)
        x = x + self.o_proj(o.transpose(1, 2).reshape(b, t, d))
        hs = F.rms_norm(x, (d,), self.post_attention_layernorm, self.eps)
        return x + self.down_proj(F.silu(self.gate_proj(hs)) * self.up_proj(hs))


class Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, v = cfg["hidden_size"], cfg["vocab_size"]
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(v, d)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.norm = nn.Parameter(torch.ones(d))
        self.lm_head = nn.Linear(d, v, bias=False)
        hd = d // cfg["num_attention_heads"]
        inv = 1.0 / cfg["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        ang = torch.arange(SEQ, dtype=torch.float32)[:, None] * inv[None, :]
        ang = torch.cat([ang, ang], dim=-1)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, tokens, targets):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        x = F.rms_norm(x, (x.shape[-1],), self.norm, self.cfg["rms_norm_eps"])
        logits = self.lm_head(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["small", "tiny"], default="small")
    ap.add_argument("--config", help="a Hugging Face Llama config.json (replaces --model)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--batch", type=int, default=2, help="sequences of --seq tokens")
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--mode", choices=["eager", "compile"], default="eager")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = default)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    global SEQ
    SEQ = a.seq
    if a.config:
        with open(a.config) as f:
            hf = json.load(f)
        cfg = {k: hf[k] for k in SMALL if k in hf}
        cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
        cfg.setdefault("rms_norm_eps", 1e-5)
        cfg.setdefault("rope_theta", 10000.0)
        name = a.config
    else:
        cfg = SMALL if a.model == "small" else TINY
        name = a.model
    dev = torch.device(a.device)
    torch.manual_seed(0)
    model = Model(cfg).to(dev)
    for p in model.parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
    step_model = torch.compile(model) if a.mode == "compile" else model
    tokens = torch.randint(0, cfg["vocab_size"], (a.batch, SEQ), device=dev)
    targets = torch.randint(0, cfg["vocab_size"], (a.batch, SEQ), device=dev)

    def step():
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
            loss = step_model(tokens, targets)
        loss.backward()
        for p in model.parameters():
            p.grad = None
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return loss

    warm = 3 if a.mode == "eager" else 6
    times = []
    for i in range(a.runs + warm):
        t0 = time.perf_counter()
        loss = step()
        dt = time.perf_counter() - t0
        if i >= warm:
            times.append(dt)
    assert math.isfinite(loss.item())
    print(f"torch {torch.__version__} {a.mode} {a.dtype} threads={torch.get_num_threads()} {name} fw+bw "
          f"B={a.batch} T={SEQ} on {a.device}: median {statistics.median(times) * 1e3:.2f} ms over {a.runs} runs "
          f"(min {min(times) * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
