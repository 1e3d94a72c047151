#!/usr/bin/env python3
"""`graphpp train` beside PyTorch pipelining, alternating in one run: a training
step benchmark that prints graphpp and the reference side by side.

Each round runs, for every schedule asked for, `graphpp train --model M --ranks 2
--threads-per-rank 1 --schedule S --steps N --eval-every 0 --dtype D` and then
`pipelining_tokens_per_sec.py --model M --schedule S' --steps K --warmup W --dtype D` (this folder; the
same model, shape and schedule under torch.distributed.pipelining + gloo, 2 processes × 1
thread), and prints both throughputs and their ratio. graphpp's figure is its "tokens/s after
the first 5 steps" (the steps' own time, as the torch script times its steps after --warmup
untimed ones); its whole-run figure (start-up included) is printed beside it. The medians over
the rounds end the output.

Needs a release build of graphpp (`cargo build --release -p graphpp`) and a python with torch
(run this script with it). On a shared machine alternate several rounds: speed drifts.

Usage:
  python tools/torch/compare_train.py [--graphpp target/release/graphpp] [--model tiny]
      [--schedules 1f1b,zbv] [--rounds 2] [--steps 60] [--torch-steps 20] [--warmup 5]
      [--dtype f32|bf16]
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

# graphpp's schedule names and torch.distributed.pipelining's.
TORCH_NAME = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved-1f1b": "Interleaved1F1B", "zbv": "ZBVZeroBubble"}

GRAPHPP_LINE = re.compile(r"steps? in [0-9.]+ s: ([0-9]+) tokens/s(?:; ([0-9]+) tokens/s after the first)?")
TORCH_LINE = re.compile(r"torch pipelining .*: ([0-9.]+) tokens/s")


def run(cmd):
    """stdout of `cmd`; exits with its output if it fails."""
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return r.stdout + r.stderr


def graphpp_tokens(a, schedule):
    """(steady, whole-run) tokens/s of one graphpp run."""
    out = run([a.graphpp, "train", "--model", a.model, "--ranks", "2", "--threads-per-rank", "1",
               "--schedule", schedule, "--steps", str(a.steps), "--eval-every", "0", "--dtype", a.dtype])
    m = GRAPHPP_LINE.search(out)
    if not m:
        sys.exit(f"no throughput line in graphpp's output:\n{out}")
    whole = float(m.group(1))
    return (float(m.group(2)) if m.group(2) else whole), whole


def torch_tokens(a, schedule):
    """tokens/s of one run of the torch reference."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pipelining_tokens_per_sec.py")
    out = run([sys.executable, script, "--model", a.model, "--schedule", TORCH_NAME[schedule],
               "--steps", str(a.torch_steps), "--warmup", str(a.warmup), "--dtype", a.dtype])
    m = TORCH_LINE.search(out)
    if not m:
        sys.exit(f"no throughput line in the torch reference's output:\n{out}")
    return float(m.group(1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--graphpp", default="target/release/graphpp")
    ap.add_argument("--model", choices=["tiny", "small"], default="tiny")
    ap.add_argument("--schedules", default="1f1b,zbv", help="comma-separated: " + ", ".join(TORCH_NAME))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", choices=["f32", "bf16"], default="f32",
                    help="bf16: graphpp's --dtype bf16 beside the reference under bf16 autocast")
    ap.add_argument("--steps", type=int, default=60, help="graphpp's steps (5 of them warm-up)")
    ap.add_argument("--torch-steps", type=int, default=20, help="the torch reference's timed steps")
    ap.add_argument("--warmup", type=int, default=5, help="the torch reference's untimed steps")
    a = ap.parse_args()
    schedules = a.schedules.split(",")
    unknown = [s for s in schedules if s not in TORCH_NAME]
    if unknown:
        ap.error(f"unknown schedule(s) {unknown}: use {', '.join(TORCH_NAME)}")
    if a.steps <= 5 or a.rounds < 1:
        ap.error("--steps must exceed the 5 warm-up steps and --rounds be at least 1")
    if not os.path.exists(a.graphpp):
        ap.error(f"{a.graphpp} not found: cargo build --release -p graphpp")
    ratios = {s: [] for s in schedules}
    for r in range(a.rounds):
        for s in schedules:
            steady, whole = graphpp_tokens(a, s)
            ref = torch_tokens(a, s)
            ratios[s].append(steady / ref)
            print(f"round {r}, {a.model} {s}: graphpp {steady:.0f} tokens/s after 5 steps ({whole:.0f} whole run), "
                  f"torch {ref:.0f}: {steady / ref:.2f}x ({whole / ref:.2f}x whole run)", flush=True)
    for s in schedules:
        print(f"{a.model} {s} {a.dtype}, 2 ranks x 1 thread: graphpp / torch {statistics.median(ratios[s]):.2f}x "
              f"(median of {a.rounds}; {min(ratios[s]):.2f}-{max(ratios[s]):.2f})")


if __name__ == "__main__":
    main()
