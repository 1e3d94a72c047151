#!/usr/bin/env python3
"""Time PyTorch building a schedule (the constructor computes `pipeline_order` and lowers it with
communication via `_prepare_schedule_with_comms`) for large shapes.

Usage: python tools/torch/time_generation.py [--order-only] [P V M [SCHEDULE ...]]
default: p=64, v=2, m=1024 for ScheduleZBVZeroBubble and ScheduleInterleaved1F1B.

Two timings per schedule: "order" is the constructor with `_prepare_schedule_with_comms` stubbed out
(only the compute-only `pipeline_order`, what graphpp's generators produce); "constructor" is the real
constructor (adds SEND/RECV, UNSHARD/RESHARD and send waits; quadratic in the actions per rank in
PyTorch 2.15, most of it in `_add_unshard_reshard`). `--order-only` skips the second.

Stages are mocks (as in PyTorch's `_schedule_visualizer.get_schedule_ops`); no process group is made.
Prints one line per schedule: constructor wall time in seconds, and the compute actions it holds.
"""

import sys
import time
from unittest import mock

import torch
from torch.distributed.pipelining import schedules as S
from torch.distributed.pipelining.stage import PipelineStage


def build(name, p, v, m, lower=True):
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod = 0, p, None
    stage.num_stages = p * v
    stages = [stage] * v
    cls = getattr(S, name)
    t0 = time.perf_counter()
    if lower:
        sched = cls(stages, m)
    else:
        with mock.patch.object(S._PipelineScheduleRuntime, "_prepare_schedule_with_comms"):
            sched = cls(stages, m)
    elapsed = time.perf_counter() - t0
    n = sum(1 for r in sched.pipeline_order.values() for a in r if a is not None and a.is_compute_op)
    return elapsed, n


def main():
    args = [a for a in sys.argv[1:] if a != "--order-only"]
    lower = "--order-only" not in sys.argv[1:]
    p, v, m = (int(x) for x in args[:3]) if len(args) >= 3 else (64, 2, 1024)
    names = args[3:] or ["ScheduleZBVZeroBubble", "ScheduleInterleaved1F1B"]
    print(f"torch {torch.__version__}, p={p} v={v} m={m}")
    for name in names:
        elapsed, n = build(name, p, v, m, lower=False)
        print(f"{name}: order {elapsed:.2f} s, {n} compute actions", flush=True)
        if lower:
            elapsed, _ = build(name, p, v, m)
            print(f"{name}: constructor {elapsed:.2f} s", flush=True)


if __name__ == "__main__":
    main()
