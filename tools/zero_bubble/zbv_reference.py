#!/usr/bin/env python3
"""Record the zero-bubble authors' ZB-V heuristic as a graphpp test fixture.

Usage (plain Python 3, no PyTorch or Megatron needed):

    python tools/zero_bubble/zbv_reference.py PATH_TO_SAIL_SG_CHECKOUT [OUT.json]

default OUT: crates/graphpp-schedule/tests/fixtures/zbv_reference.json

PATH_TO_SAIL_SG_CHECKOUT is a checkout (or `git archive` extract) of
github.com/sail-sg/zero-bubble-pipeline-parallelism. The committed fixture was produced from
commit 39f2c186a27580b7051eb51e0f651e1efd0a8170. This script contains none of that code: it
loads the repository's `scheduler/zbv.py` (and the stdlib-only `scheduler/graph.py` it imports)
with importlib, bypassing the Megatron package `__init__` files, which would pull in torch.

What is computed. The reference builds a ZB-V schedule with `PipelineGraph.try_v_schedule`, a
greedy list scheduler that is run with the two switches fill_b / fill_f; its `create_schedule`
tries fill_b in (True, False) x fill_f in (True, False), in that order, and keeps the first result
with a strictly smaller max bubble. We repeat only that selection loop (not the Megatron node
objects built afterwards) and record, per grid cell:

* `makespan`: the largest end time of the chosen schedule. The reference's end times are an
  as-soon-as-possible replay of its own order: an action ends at
  max(rank free + cost, dependency end + c + cost).
* `max_bubble`: the selection criterion, exactly as the reference returns it.
* `peak`: the highest per-rank activation memory reached while executing the order, in graphpp
  units (see below).
* `order`: one string per rank, that rank's actions in execution order in graphpp / PyTorch action
  text `{stage}{F|I|W}{microbatch}`, space separated. The reference's "stage" is graphpp's rank.
  cat 0/1/2 is F / I (input gradient, the reference's "B") / W; microbatch = micro (0-based).
  V placement: model chunk 0 of rank r is stage r, model chunk 1 is stage 2p-1-r. For F the
  reference's chunk is the model chunk; for I and W it is reversed (its backward chunk 0 is the
  backward of model chunk 1, as its own `create_schedule` maps with `max_chunks - 1 - chunk`).
  The script checks the mapping by replaying the order with graphpp's dependencies: it must not
  deadlock and every action must end exactly when the reference says.

Grid: p (the reference's n_stage) in {2, 4, 6, 8}; m (n_micro) in {p, 2p, 3p, 4p}; costs
(F, I, W) in {(1,1,1), (1,2,1), (2,2,1), (1,1,2)} (I is passed as the reference's b_cost);
communication cost c in {0, 0.1}. 128 cells.

Units. The reference counts memory with f_mem = 2, b_mem = -1, w_mem = -1 and its default cap
max_mem = 2 * f_mem * p = 4p. In graphpp a whole stage's activations are M_B = 1 and one V chunk
holds half of that, so F stores 0.5 M_B, I frees 0.25 M_B, W frees the other 0.25 M_B (M_W = 0.5
of a chunk), and the cap is p M_B. `peak` is the reference counter's peak divided by
2 * f_mem = 4. Times are in the cost units above; with c = 0.1 they are floats and are rounded to
9 decimal places to drop binary noise.
"""

import json
import os
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_common import (  # noqa: E402
    COSTS, CS, GRAPH_MOD, PINNED_COMMIT, PS, REPO, SCHED_DIR, clean, load_module, source_commit,
)

# git blob id of scheduler/zbv.py at PINNED_COMMIT; lets an extract without .git be identified.
PINNED_ZBV_BLOB = "b76a8635f8da8818c0103a3b8636829603138d46"
ZBV_MOD = "megatron.core.pipeline_parallel.zerobubble.scheduler.zbv"

F_MEM, B_MEM, W_MEM = 2, -1, -1
MEM_UNIT = 2 * F_MEM  # reference counter per M_B
KIND = "FIW"


def load_reference(checkout):
    sched = os.path.join(checkout, SCHED_DIR)
    zbv_path = os.path.join(sched, "zbv.py")
    if not os.path.isfile(zbv_path):
        sys.exit(f"error: {zbv_path} not found; pass a sail-sg checkout")
    # zbv.py imports ScheduledNode, F, B, W, FuncType from graph.py; they are only used when
    # building Megatron nodes, which we skip. graph.py is stdlib-only at the pinned commit; if a
    # later version stops importing cleanly, stand in a stub with those names.
    try:
        load_module(GRAPH_MOD, os.path.join(sched, "graph.py"))
    except Exception as e:  # noqa: BLE001 - any import failure falls back to the stub
        print(f"note: graph.py did not load ({e!r}); using a stub", file=sys.stderr)
        stub = types.ModuleType(GRAPH_MOD)
        stub.ScheduledNode = object
        stub.FuncType = object
        stub.F, stub.B, stub.W = "F", "B", "W"
        sys.modules[GRAPH_MOD] = stub
    return load_module(ZBV_MOD, zbv_path)


def run_cell(zbv, p, m, f, i, w, c):
    graph = zbv.PipelineGraph(
        n_stage=p, n_micro=m, f_cost=f, b_cost=i, w_cost=w, c_cost=c,
        f_mem=F_MEM, b_mem=B_MEM, w_mem=W_MEM, max_mem=None,
    )
    best = None
    for fill_b in (True, False):
        for fill_f in (True, False):
            sched, end_time, bubble = graph.try_v_schedule(fill_b=fill_b, fill_f=fill_f)
            if best is None or bubble < best[2]:
                best = (sched, end_time, bubble)
    sched, end_time, bubble = best
    makespan = max(t for t in end_time if t >= 0)
    mem_delta = (F_MEM, B_MEM, W_MEM)
    peak = 0
    order = []
    for r in range(p):
        cur = 0
        acts = []
        for cat, chunk, micro in sched[r]:
            cur += mem_delta[cat]
            peak = max(peak, cur)
            acts.append(f"{graphpp_stage(p, r, cat, chunk)}{KIND[cat]}{micro}")
        order.append(acts)
    check(p, m, order)
    replay_check(graph, p, m, (f, i, w), c, sched, end_time)
    return {
        "p": p, "m": m, "f": f, "i": i, "w": w, "c": c,
        "makespan": clean(makespan),
        "max_bubble": clean(bubble),
        "peak": clean(peak / MEM_UNIT),
        "order": [" ".join(a) for a in order],
    }


def graphpp_stage(p, r, cat, chunk):
    """graphpp stage of the reference's (cat, chunk) on rank r.

    The reference numbers backward chunks in the direction they flow: its B/W chunk 0 runs
    from rank 0 upwards, i.e. it is the backward of model chunk 1 (stages p..2p-1), and its B/W
    chunk 1 is the backward of model chunk 0. Its `create_schedule` maps the chunk of cat 1 and
    2 to `max_chunks - 1 - chunk` for the same reason. Model chunk 0 of rank r is stage r, model
    chunk 1 is stage 2p-1-r.
    """
    model_chunk = chunk if cat == 0 else 1 - chunk
    return r if model_chunk == 0 else 2 * p - 1 - r


def replay_check(graph, p, m, costs, c, sched, end_time):
    """Replay the order as a graphpp schedule and compare every end time with the reference.

    Dependencies in graphpp terms: F(s, mb) after F(s-1, mb); I(s, mb) after F(s, mb) and
    I(s+1, mb); W(s, mb) after I(s, mb). A dependency on another rank adds c. A deadlock or a
    different end time means the chunk-to-stage mapping (or the reference) is not what we think.
    """
    rank_of = [s if s < p else 2 * p - 1 - s for s in range(2 * p)]
    seqs = [[(cat, graphpp_stage(p, r, cat, ch), mb, graph.get_id(cat, ch, r, mb))
             for cat, ch, mb in sched[r]] for r in range(p)]
    done = {}
    pos = [0] * p
    free = [0] * p
    left = sum(len(q) for q in seqs)
    while left:
        moved = False
        for r in range(p):
            while pos[r] < len(seqs[r]):
                cat, s, mb, ref_id = seqs[r][pos[r]]
                if cat == 0:
                    deps = [(0, s - 1)] if s > 0 else []
                elif cat == 1:
                    deps = [(0, s)] + ([(1, s + 1)] if s < 2 * p - 1 else [])
                else:
                    deps = [(1, s)]
                if any((k, d, mb) not in done for k, d in deps):
                    break
                end = free[r] + costs[cat]
                for k, d in deps:
                    if rank_of[d] != r:
                        end = max(end, done[(k, d, mb)] + c + costs[cat])
                if abs(end - end_time[ref_id]) > 1e-9:
                    sys.exit(f"error: p={p} m={m} c={c} {s}{KIND[cat]}{mb}: replay ends at "
                             f"{end}, reference at {end_time[ref_id]}")
                done[(cat, s, mb)] = end
                free[r] = end
                pos[r] += 1
                left -= 1
                moved = True
        if not moved:
            stuck = [seqs[r][pos[r]][:3] for r in range(p) if pos[r] < len(seqs[r])]
            sys.exit(f"error: p={p} m={m} order deadlocks at {stuck}")


def check(p, m, order):
    seen = {}
    for r, acts in enumerate(order):
        if len(acts) != 3 * 2 * m:
            sys.exit(f"error: p={p} m={m} rank {r} has {len(acts)} actions, want {6 * m}")
        for a in acts:
            seen[a] = seen.get(a, 0) + 1
    want = {f"{s}{k}{mb}" for s in range(2 * p) for k in KIND for mb in range(m)}
    if set(seen) != want or any(n != 1 for n in seen.values()):
        bad = sorted(set(seen) ^ want) + sorted(a for a, n in seen.items() if n != 1)
        sys.exit(f"error: p={p} m={m} F/I/W coverage wrong: {bad[:8]}")


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__.split("\n\n")[1])
    checkout = sys.argv[1]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.join(
        root, "crates/graphpp-schedule/tests/fixtures/zbv_reference.json"
    )
    zbv = load_reference(checkout)
    commit, blob = source_commit(checkout, "zbv.py", PINNED_ZBV_BLOB)

    cells = []
    for f, i, w in COSTS:
        group = []
        for p in PS:
            for m in (p, 2 * p, 3 * p, 4 * p):
                for c in CS:
                    group.append(run_cell(zbv, p, m, f, i, w, c))
        cells.extend(group)
        p8 = {x["c"]: x["makespan"] for x in group if x["p"] == 8 and x["m"] == 8}
        print(
            f"F={f} I={i} W={w}: {len(group)} cells, p=8 m=8 makespan c=0 {p8[0]} c=0.1 {p8[0.1]}, "
            f"peak max {max(x['peak'] for x in group)} M_B"
        )

    header = {
        "source": {
            "repo": REPO,
            "commit": commit,
            "zbv_py_blob": blob,
            "function": "PipelineGraph.try_v_schedule, best of fill_b x fill_f as in create_schedule",
        },
        "generator": "tools/zero_bubble/zbv_reference.py",
        "memory": "reference f_mem=2 b_mem=-1 w_mem=-1 max_mem=4p; peak = counter/4 in M_B "
        "(F +0.5, I -0.25, W -0.25 per V chunk; cap p M_B)",
        "format": "order[r] is rank r's actions in order, space separated, '{stage}{F|I|W}{mb}', "
        "rank r holds stages r and 2p-1-r (V); makespan = last end time of the "
        "reference's ASAP replay; max_bubble as the reference returns it",
    }
    lines = ["{"]
    for k in sorted(header):
        lines.append(f"{json.dumps(k)}: {json.dumps(header[k], sort_keys=True)},")
    lines.append('"cells": [')
    body = [json.dumps(x, sort_keys=True, separators=(",", ":")) for x in cells]
    lines.append(",\n".join(body))
    lines.append("]")
    lines.append("}")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    json.load(open(out))  # must round-trip
    print(f"{len(cells)} cells (reference {commit[:12]}) -> {out}")


if __name__ == "__main__":
    main()
