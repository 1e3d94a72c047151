"""One rank of a 2-rank gloo ZB-V pipeline for the profiler and step-recorder test: profiles
the stages (graphpp.torch.profile), then records 2 steps of zbv-auto built from the measured
costs and writes rank 0's figures as JSON.

Usage (every rank; RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set): python recorder_worker.py OUT.json
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

import graphpp
import graphpp.torch as gt
from pipeline_worker import DIM, ROWS_PER_MICROBATCH, batch, loss_fn, stage_modules

M = 4


def main():
    out = sys.argv[1]
    rank, p = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=p)
    S = 2 * p
    mods = stage_modules(S)
    placed = graphpp.generate("zbv", p, M).stages_on(rank)
    stages = [PipelineStage(mods[s], s, S, torch.device("cpu")) for s in placed]
    x, y = batch(M)
    args = (x,) if 0 in placed else ()
    target = y if S - 1 in placed else None
    prof = gt.profile(stages, *args, target=target, loss_fn=loss_fn, n_microbatches=M, steps=2)
    grads_zeroed = all(q.grad is None for st in stages for q in st.submod.parameters())
    runtime = gt.schedule("zbv-auto", stages, M, loss_fn=loss_fn, costs=prof.costs)
    rec = gt.StepRecorder(runtime)
    for _ in range(2):
        with rec:
            runtime.step(*args, target=target)
    report = rec.report()
    if rank == 0:
        trace = os.path.join(os.path.dirname(out), "trace.json")
        rec.write_trace(trace)
        json.dump({
            "costs": [prof.costs.F, prof.costs.I, prof.costs.W, prof.costs.B, prof.costs.C],
            "held_bytes": {str(k): v for k, v in prof.held_bytes.items()},
            "stage_bytes": prof.stage_bytes,
            "mem_cap_of_10000_bytes": prof.mem_cap(10_000),
            "timings": {k: len(v) for k, v in prof.timings.items()},
            "grads_zeroed": grads_zeroed,
            "intervals": report.timeline.intervals,
            "steps": report.steps,
            "measured_makespan": report.measured.makespan,
            "step_time": report.step_time,
            "predicted_makespan": report.predicted.makespan,
            "measured_bubble": report.measured.bubble_ratio,
            "slowest_rank": report.slowest_rank,
            "text": str(report),
            "trace_bytes": os.path.getsize(trace),
            "csv": runtime.graphpp_schedule.to_csv(),
            "expected_csv": graphpp.generate("zbv-auto", p, M, costs=prof.costs).to_csv(),
            "rows": ROWS_PER_MICROBATCH,
            "dim": DIM,
        }, open(out, "w"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
