#!/usr/bin/env python3
"""Reference numerics for graphpp's AdamW and global gradient-norm clipping, computed by PyTorch.

Runs torch.optim.AdamW (decoupled weight decay, non-default betas) on two small f32 parameters for
several steps. Each step takes a fixed gradient (seeded; some steps scaled up so clipping triggers,
others small so it does not), clips it with torch.nn.utils.clip_grad_norm_, sets the step's learning
rate (warm-up then decay, passed explicitly), and steps. Writes
crates/graphpp-runtime/tests/fixtures/adamw_fixture.json holding:
  * config: lr per step, betas, eps, weight_decay, max_norm;
  * init: the initial parameters (name -> {shape, data});
  * steps[i]: grads (before clipping), total_norm (clip_grad_norm_'s return), clip_coef (applied
    factor, min(1, max_norm/(norm+1e-6))), params after the step;
  * final_state: exp_avg / exp_avg_sq per parameter after the last step, and the step count.
All floats are f32 values written as exact decimal doubles.

Usage: python tools/torch/adamw_fixture.py   (PyTorch 2.x; no other packages)
"""
import json
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "..", "crates", "graphpp-runtime", "tests", "fixtures", "adamw_fixture.json")

SHAPES = {"layer.weight": [3, 4], "layer.bias": [5]}
LRS = [1e-2, 2e-2, 3e-2, 2.5e-2, 1.5e-2, 1e-2]
# Gradient magnitude per step: steps with a large factor exceed max_norm and are clipped.
GRAD_SCALE = [0.1, 5.0, 0.2, 3.0, 0.05, 10.0]
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1
MAX_NORM = 1.0


def dump(t):
    return {"shape": list(t.shape), "data": [float(x) for x in t.detach().reshape(-1).tolist()]}


def main():
    torch.manual_seed(1234)
    params = {n: torch.nn.Parameter(torch.randn(s, dtype=torch.float32)) for n, s in SHAPES.items()}
    init = {n: dump(p) for n, p in params.items()}
    opt = torch.optim.AdamW(
        list(params.values()), lr=LRS[0], betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, foreach=False
    )
    steps = []
    for lr, scale in zip(LRS, GRAD_SCALE):
        grads = {n: (torch.randn(s, dtype=torch.float32) * scale) for n, s in SHAPES.items()}
        for n, p in params.items():
            p.grad = grads[n].clone()
        norm = torch.nn.utils.clip_grad_norm_(list(params.values()), MAX_NORM)
        coef = min(1.0, MAX_NORM / (float(norm) + 1e-6))
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        steps.append(
            {
                "lr": lr,
                "grads": {n: dump(g) for n, g in grads.items()},
                "total_norm": float(norm),
                "clip_coef": coef,
                "params": {n: dump(p) for n, p in params.items()},
            }
        )
    final_state = {}
    for n, p in params.items():
        st = opt.state[p]
        final_state[n] = {"exp_avg": dump(st["exp_avg"]), "exp_avg_sq": dump(st["exp_avg_sq"])}
    out = {
        "torch_version": torch.__version__,
        "betas": list(BETAS),
        "eps": EPS,
        "weight_decay": WEIGHT_DECAY,
        "max_norm": MAX_NORM,
        "init": init,
        "steps": steps,
        "final_state": final_state,
        "final_step": len(steps),
    }
    with open(OUT, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {os.path.normpath(OUT)}: {len(steps)} steps, norms {[round(s['total_norm'], 4) for s in steps]}")


if __name__ == "__main__":
    main()
