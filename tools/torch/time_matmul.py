#!/usr/bin/env python3
"""PyTorch's CPU matmul speed on graphpp's `small` linear-layer shapes, beside
`cargo run --release -p graphpp-runtime --example matmul` (same shapes, same hot loop: each
product --reps times after 50 warm-up products, operands in L2).

Usage: python tools/torch/time_matmul.py [--threads 1] [--reps 400]
"""
import argparse
import time

import torch

# (m, k, n, lhs transposed, rhs transposed), as SHAPES in the Rust example.
SHAPES = [(128, 256, 688, False, True), (128, 256, 688, False, False), (256, 128, 688, True, False),
          (128, 256, 256, False, True), (128, 688, 256, False, True)]


def operand(r, c, t):
    return torch.randn(c, r).t() if t else torch.randn(r, c)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=400)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {a.threads} thread(s), ms per product (GFLOP/s), hot")
    for m, k, n, ta, tb in SHAPES:
        x, y = operand(m, k, ta), operand(k, n, tb)
        for _ in range(50):
            x @ y
        t0 = time.perf_counter()
        for _ in range(a.reps):
            x @ y
        ms = (time.perf_counter() - t0) * 1e3 / a.reps
        print(f"{m}x{k}{'T' if ta else ''} . {k}x{n}{'T' if tb else ''}: hot {ms:.3f} ms "
              f"({2 * m * n * k / ms / 1e6:.0f})")


if __name__ == "__main__":
    main()
