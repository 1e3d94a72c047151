#!/usr/bin/env python3
"""Dump PyTorch's compute-only pipeline schedules as graphpp conformance fixtures.

Usage (needs PyTorch installed; CPU build is enough, no process group is created):

    python tools/torch/dump_schedules.py [OUT.json]

default OUT: crates/graphpp-schedule/tests/fixtures/torch_schedules.json

For each PyTorch-shipped schedule class and each shape in the sweep (p ranks, v stages per rank,
m microbatches) it records one string per rank: the compute actions (F, B, I, W, OVERLAP_F_B) in
execution order, idle steps and non-compute actions removed, in PyTorch's action text form. A shape
the constructor rejects is recorded with PyTorch's error message.

Where the actions come from:
* multi-stage schedules (`PipelineScheduleMulti` subclasses) compute `pipeline_order` in their
  constructor; the runtime executes that order. We build them from mock stages through PyTorch's
  own `_schedule_visualizer.get_schedule_ops`.
* single-stage schedules (GPipe, 1F1B) execute `_step_microbatches`, not `pipeline_order` (which
  is only used for visualisation). We run `_step_microbatches` of each rank's schedule on a mock
  stage with communication stubbed out and record the order in which it calls
  `forward_one_chunk` / `backward_one_chunk`. When PyTorch's `_get_pipeline_order` disagrees with
  the executed order, the fixture also keeps it (`pipeline_order`) so the difference is visible.
"""

import json
import os
import sys
from unittest import mock

import torch
from torch.distributed.pipelining import schedules as S
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
from torch.distributed.pipelining.stage import PipelineStage

SINGLE = ["ScheduleGPipe", "Schedule1F1B"]
MULTI = ["ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble"]
V_SHAPED = ["ScheduleZBVZeroBubble", "ScheduleDualPipeV"]


def microbatch_sweep(p):
    """The microbatch counts tried for p ranks: around p, 2p, and multiples."""
    ms = {1, p - 1, p, p + 1, 2 * p - 1, 2 * p, 2 * p + 1, 3 * p, 4 * p}
    return sorted(m for m in ms if m >= 1)


def compute_string(actions):
    return " ".join(str(a) for a in actions if a is not None and a.is_compute_op)


def executed_single(cls, p, m):
    """Runs `_step_microbatches` of every rank's single-stage schedule on a recording mock stage."""
    ranks = []
    order = None
    for r in range(p):
        log = []
        stage = mock.create_autospec(PipelineStage, instance=True)
        stage.group_rank, stage.group_size, stage.submod = r, p, None
        stage.stage_index, stage.num_stages = r, p
        stage.is_first, stage.is_last = r == 0, r == p - 1
        stage.forward_one_chunk.side_effect = lambda mb, *a, **k: log.append(S._Action(r, S.F, mb))
        stage.backward_one_chunk.side_effect = lambda mb, *a, **k: log.append(S._Action(r, S.B, mb))
        sched = cls(stage, m)  # may raise: the caller records the rejection
        if order is None:
            order = sched.pipeline_order
        sched._check_inputs = lambda *a, **k: ([()] * m, [{}] * m)
        sched._initialize_stage = lambda *a, **k: None
        with mock.patch.multiple(
            S,
            _batch_p2p=mock.DEFAULT,
            _sorted_batch_p2p=mock.MagicMock(return_value={}),
            _wait_batch_p2p=mock.DEFAULT,
            _wait_and_release_fwd_send=mock.DEFAULT,
        ):
            sched._step_microbatches()
        ranks.append(compute_string(log))
    planned = [compute_string(order[r]) for r in range(p)] if order is not None else None
    return ranks, planned


def case(name, p, v, m):
    cls = getattr(S, name)
    entry = {"schedule": name, "ranks": p, "stages_per_rank": v, "microbatches": m}
    try:
        if name in SINGLE:
            ranks, planned = executed_single(cls, p, m)
            if planned is not None and planned != ranks:
                entry["pipeline_order"] = planned
        else:
            ops = get_schedule_ops(cls, p, m, v)
            ranks = [compute_string(r) for r in ops]
        entry["actions"] = ranks
    except Exception as e:  # noqa: BLE001 - any rejection is recorded with its message
        entry["error"] = f"{type(e).__name__}: {e}"
    return entry


def sweep():
    for p in range(1, 9):
        for m in microbatch_sweep(p):
            for name in SINGLE:
                yield name, p, 1, m
            for name in MULTI:
                for v in (2, 3):
                    yield name, p, v, m
            for name in V_SHAPED:
                yield name, p, 2, m
    # PyTorch's own expected DualPipeV case (crates/graphpp-schedule/tests/data/torch_dualpipev/dualpipev_4rank_10mb.csv)
    yield "ScheduleDualPipeV", 4, 2, 10


def main():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(
        root, "crates/graphpp-schedule/tests/fixtures/torch_schedules.json"
    )
    cases = [case(*c) for c in sweep()]
    doc = {
        "torch_version": torch.__version__,
        "generator": "tools/torch/dump_schedules.py",
        "format": "actions[r] is rank r's compute actions in execution order, idles removed, "
        "space separated; error is PyTorch's rejection message",
        "cases": cases,
    }
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=0)
        f.write("\n")
    ok = sum("actions" in c for c in cases)
    print(f"{len(cases)} cases ({ok} served, {len(cases) - ok} rejected) -> {out}")


if __name__ == "__main__":
    main()
