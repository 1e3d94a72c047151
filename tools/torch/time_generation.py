#!/usr/bin/env python3
"""Time PyTorch building a schedule (the constructor computes `pipeline_order` and lowers it with
communication via `_prepare_schedule_with_comms`) for large shapes.

Usage: python tools/torch/time_generation.py [P V M [SCHEDULE ...]]
default: p=64, v=2, m=1024 for ScheduleZBVZeroBubble and ScheduleInterleaved1F1B.

Stages are mocks (as in PyTorch's `_schedule_visualizer.get_schedule_ops`); no process group is made.
Prints one line per schedule: constructor wall time in seconds, and the compute actions it holds.
"""

import sys
import time
from unittest import mock

import torch
from torch.distributed.pipelining import schedules as S
from torch.distributed.pipelining.stage import PipelineStage


def build(name, p, v, m):
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod = 0, p, None
    stage.num_stages = p * v
    stages = [stage] * v
    t0 = time.perf_counter()
    sched = getattr(S, name)(stages, m)
    elapsed = time.perf_counter() - t0
    n = sum(1 for r in sched.pipeline_order.values() for a in r if a is not None and a.is_compute_op)
    return elapsed, n


def main():
    args = sys.argv[1:]
    p, v, m = (int(x) for x in args[:3]) if len(args) >= 3 else (64, 2, 1024)
    names = args[3:] or ["ScheduleZBVZeroBubble", "ScheduleInterleaved1F1B"]
    print(f"torch {torch.__version__}, p={p} v={v} m={m}")
    for name in names:
        elapsed, n = build(name, p, v, m)
        print(f"{name}: constructor {elapsed:.2f} s, {n} compute actions")


if __name__ == "__main__":
    main()
