"""One rank of a gloo pipeline for the tests: for every case (a schedule kind at p ranks, v stages
per rank, m microbatches) it builds this rank's PipelineStage objects from the same seeded f64
model, runs one step of ``graphpp.torch.schedule`` and sends its gradients to rank 0, which
compares them with one process's gradients of the same model and batch and writes a JSON
report.

Usage (every rank; RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set):
    python pipeline_worker.py OUT.json CASES.json
CASES.json: a list of {"kind", "v", "m"} (optional "group"); the report: a list of
{"kind", "v", "m", "error"} or {"kind", "v", "m", "max_rel"} in the same order.
"""

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

import graphpp
import graphpp.torch as gt

DIM = 6
ROWS_PER_MICROBATCH = 2


def stage_modules(stages: int) -> list[nn.Module]:
    """The model: `stages` blocks Linear → tanh → Linear, f64, seeded."""
    torch.manual_seed(1234)
    return [nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM)).double() for _ in range(stages)]


def batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    x = torch.randn(m * ROWS_PER_MICROBATCH, DIM, generator=g, dtype=torch.float64)
    y = torch.randn(m * ROWS_PER_MICROBATCH, DIM, generator=g, dtype=torch.float64)
    return x, y


def loss_fn(out, target):
    return torch.nn.functional.mse_loss(out, target)


def reference_grads(stages: int, m: int) -> dict[int, list[torch.Tensor]]:
    """One process: the mean over microbatches of each microbatch's loss (what PyTorch's
    schedules compute with scale_grads=True)."""
    mods = stage_modules(stages)
    model = nn.Sequential(*mods)
    x, y = batch(m)
    total = sum(loss_fn(model(xm), ym) for xm, ym in zip(x.chunk(m), y.chunk(m))) / m
    total.backward()
    return {s: [p.grad.clone() for p in mod.parameters()] for s, mod in enumerate(mods)}


def run_case(case: dict, rank: int, p: int) -> dict:
    kind, v, m = case["kind"], case["v"], case["m"]
    S = p * v
    try:
        sched = graphpp.generate(kind, p, m, stages_per_rank=v, group=case.get("group"))
    except graphpp.GenerateError as e:
        return {"error": f"GenerateError: {e}"}
    mods = stage_modules(S)
    stages = [
        PipelineStage(copy.deepcopy(mods[s]), s, S, torch.device("cpu")) for s in sched.stages_on(rank)
    ]
    runtime = gt.schedule(sched, stages, m, loss_fn=loss_fn)
    ran_graphpp_order = gt.as_schedule(runtime.pipeline_order) == sched
    x, y = batch(m)
    holds = {st.stage_index for st in stages}
    args = (x,) if 0 in holds else ()
    target = y if S - 1 in holds else None
    runtime.step(*args, target=target)
    grads = {st.stage_index: [q.grad.clone() for q in st.submod.parameters()] for st in stages}
    gathered = [None] * p if rank == 0 else None
    dist.gather_object(grads, gathered, dst=0)
    orders = [None] * p if rank == 0 else None
    dist.gather_object(ran_graphpp_order, orders, dst=0)
    if rank != 0:
        return {}
    if not all(orders):
        return {"error": f"the runtime's pipeline_order differs from graphpp's schedule on ranks {orders}"}
    ref = reference_grads(S, m)
    got = {s: g for part in gathered for s, g in part.items()}
    if sorted(got) != list(range(S)):
        return {"error": f"gradients of stages {sorted(got)} came back, expected 0..{S - 1}"}
    worst = 0.0
    for s in range(S):
        for a, b in zip(got[s], ref[s]):
            scale = b.abs().max().item() or 1.0
            worst = max(worst, (a - b).abs().max().item() / scale)
    return {"max_rel": worst}


def main():
    out, cases_path = sys.argv[1], sys.argv[2]
    rank, p = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=p)
    cases = json.load(open(cases_path))
    results = []
    for case in cases:
        r = run_case(case, rank, p)
        results.append({**case, **r})
        dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
