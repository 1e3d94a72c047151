#!/usr/bin/env python3
"""PyTorch eager timing of one forward + backward of graphpp's `small` (or `tiny`) preset on one stage.

Same architecture as llama_fixture.py (imported from it), f32, B=2 (--batch), T=64, all layers,
the same shapes as `cargo run --release -p graphpp-runtime --example fwbw` (which runs this script
beside graphpp when given `--torch PYTHON`; `--batch 8` is `graphpp train`'s microbatch, beside
`examples/opprof --batch 8`). Prints the median over N runs.

Usage: python tools/torch/time_fwbw.py [--model small|tiny] [--batch B] [--runs N] [--threads K]
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_fixture  # noqa: E402
from llama_fixture import forward, param_shapes  # noqa: E402

_rope64 = llama_fixture.rope_tables
# The fixture evaluates in float64; time the f32 model like graphpp's benchmark.
llama_fixture.rope_tables = lambda seq, hd, theta: tuple(x.float() for x in _rope64(seq, hd, theta))

SMALL = {
    "vocab_size": 256, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 8,
    "num_attention_heads": 8, "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
}
TINY = dict(SMALL, hidden_size=64, intermediate_size=176, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=4)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["small", "tiny"], default="small")
    ap.add_argument("--batch", type=int, default=2, help="sequences of 64 tokens")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0 = default)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = SMALL if a.model == "small" else TINY
    torch.manual_seed(0)
    p = {k: (0.02 * torch.randn(s)).requires_grad_(True) for k, s in param_shapes(cfg).items()}
    tokens = torch.randint(0, cfg["vocab_size"], (a.batch, 64))
    targets = torch.randint(0, cfg["vocab_size"], (a.batch, 64))
    times = []
    for i in range(a.runs + 3):
        t0 = time.perf_counter()
        loss = forward(p, cfg, tokens, targets)
        loss.backward()
        dt = time.perf_counter() - t0
        for v in p.values():
            v.grad = None
        if i >= 3:
            times.append(dt)
    print(f"torch {torch.__version__} threads={torch.get_num_threads()} {a.model} fw+bw B={a.batch} T=64: "
          f"median {statistics.median(times) * 1e3:.2f} ms over {a.runs} runs (min {min(times) * 1e3:.2f} ms)")


if __name__ == "__main__":
    main()
