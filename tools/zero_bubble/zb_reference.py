#!/usr/bin/env python3
"""Record the zero-bubble authors' automatic ZB-1p / ZB-2p heuristic as a graphpp test fixture.

Usage (plain Python 3, no PyTorch, PuLP or Megatron needed):

    python tools/zero_bubble/zb_reference.py PATH_TO_SAIL_SG_CHECKOUT [OUT.json]

default OUT: crates/graphpp-schedule/tests/fixtures/zb_reference.json

PATH_TO_SAIL_SG_CHECKOUT is a checkout (or `git archive` extract) of
github.com/sail-sg/zero-bubble-pipeline-parallelism. The committed fixture was produced from
commit 39f2c186a27580b7051eb51e0f651e1efd0a8170. This script contains none of that code: it
loads the repository's `scheduler/zb.py` (and the stdlib-only `scheduler/graph.py` it imports)
with importlib, bypassing the Megatron package `__init__` files. zb.py imports torch (only for a
type annotation on its `Graph` dataclass) and pulp (only used when turning completion times into
Megatron nodes, which we skip); both are replaced by empty stand-in modules before loading.

What is computed. At that commit `zb.create_schedule` builds the graph and calls
`initial_solution`, which runs the greedy builder `Graph.manual_order` with the three switches
allow_bubble_before_first_b x prioritize_b x no_bubble_greedy, each tried True then False in that
nesting order, and keeps the first result with a strictly smaller `best_time` (no ILP is run on
this path). `best_time` is the longest per-stage span: end of the stage's last W minus start of
its first F. We call `initial_solution` itself (with printing off) and skip only the node
conversion after it. When `initial_solution` raises (one failing flag combination is enough:
`manual_order` raises "Cannot fit memory" when a stage must make room for an F or I but has no W
left to run), the cell records the exception instead of a schedule. Per grid cell:

* `makespan`: the largest end time of the chosen schedule, replayed as soon as possible: an action
  ends at max(rank free + cost, dependency end + c + cost). The script checks that every end
  time equals the reference's own completion time.
* `best_time`: the selection criterion, exactly as the reference returns it.
* `peak`: the highest per-rank activation memory reached while executing the order, in graphpp
  units (see below).
* `order`: one string per rank, that rank's actions in execution order in graphpp / PyTorch action
  text `{stage}{F|I|W}{microbatch}`, space separated (the reference's stage s is graphpp rank s
  and stage s; its "B" is graphpp's I; microbatches are 0-based in both). The order is the
  reference's own per-stage order index; the script checks it agrees with sorting by completion
  time (what the reference's node conversion does).
* `error` instead of `makespan` / `best_time` / `peak` / `order` when the reference raised.

Checks: every rank has 3m actions and every (stage, microbatch) one F, one I and one W; the order
replays with graphpp's dependencies (F(s) after F(s-1); I(s) after F(s) and I(s+1); W(s) after
I(s); +c only between ranks) without deadlock and reproduces the reference's completion times.

Grid: p (the reference's nstages) in {2, 4, 6, 8}; m (nmb) in {p, 2p, 3p, 4p}; costs (F, I, W) in
{(1,1,1), (1,2,1), (2,2,1), (1,1,2)} (I is passed as the reference's cost_b); communication cost
c in {0, 0.1}; memory cap in {p, 2p} M_B (ZB-1p, ZB-2p). 256 cells.

Units. graphpp: F stores M_B = 1, I frees M_B - M_W, W frees M_W, with M_W = 0.5 M_B. The
reference gets mem_f = 2, mem_b = -1, mem_w = -1 per stage and max_mem = 2 * cap, so its counter
is twice graphpp's; `peak` is the counter's peak divided by 2. Costs are passed as floats (the
reference's GraphConfig insists); times are rounded to 9 decimal places to drop binary noise
and written as integers when whole.
"""

import json
import os
import re
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from reference_common import (  # noqa: E402
    COSTS, CS, GRAPH_MOD, PINNED_COMMIT, PS, REPO, SCHED_DIR, clean, load_module, source_commit,
)

# git blob id of scheduler/zb.py at PINNED_COMMIT; lets an extract without .git be identified.
PINNED_ZB_BLOB = "b056cde1881870f6717232523a62b610117193db"
ZB_MOD = "megatron.core.pipeline_parallel.zerobubble.scheduler.zb"

MEM_F, MEM_B, MEM_W = 2, -1, -1
MEM_UNIT = MEM_F  # reference counter per M_B
KIND = "FIW"


def load_reference(checkout):
    sched = os.path.join(checkout, SCHED_DIR)
    zb_path = os.path.join(sched, "zb.py")
    if not os.path.isfile(zb_path):
        sys.exit(f"error: {zb_path} not found; pass a sail-sg checkout")
    # Stand-ins for the two heavy imports of zb.py: torch.Tensor is only a dataclass field
    # annotation, pulp.value is only called by the node conversion we skip.
    torch = types.ModuleType("torch")
    torch.Tensor = object
    pulp = types.ModuleType("pulp")

    def no_pulp(*_args, **_kwargs):
        raise RuntimeError("pulp is stubbed out by zb_reference.py")

    pulp.value = no_pulp
    sys.modules["torch"] = torch
    sys.modules["pulp"] = pulp
    # GraphConfig (and its float / memory-balance checks) comes from the real graph.py.
    load_module(GRAPH_MOD, os.path.join(sched, "graph.py"))
    return load_module(ZB_MOD, zb_path)


def run_cell(zb, p, m, f, i, w, c, cap):
    cell = {"p": p, "m": m, "f": f, "i": i, "w": w, "c": c, "cap": cap}
    config = zb.GraphConfig(
        mem_f=[MEM_F] * p, mem_b=[MEM_B] * p, mem_w=[MEM_W] * p,
        max_mem=[MEM_UNIT * cap] * p,
        cost_f=[float(f)] * p, cost_b=[float(i)] * p, cost_w=[float(w)] * p,
        cost_comm=float(c), n_stages=p, n_micro=m,
    )
    graph = zb.Graph.build_graph(p, m, config)
    try:
        best_time, index, end_time = zb.initial_solution(graph, print_result=False)
    except Exception as e:  # noqa: BLE001 - any reference failure is recorded for the cell
        cell["error"] = f"{type(e).__name__}: {e}"
        return cell
    # (kind, stage, mb) of every reference node id, then each stage's nodes in its order index.
    node = [(k, s, mb) for k in range(3) for s in range(p) for mb in range(m)]
    seqs = []
    for s in range(p):
        ids = [graph.get_id(k, s, mb) for k in range(3) for mb in range(m)]
        by_index = sorted(ids, key=lambda n: index[n])
        if sorted(index[n] for n in ids) != list(range(3 * m)):
            sys.exit(f"error: p={p} m={m} cap={cap} stage {s}: order indices are not 0..{3 * m - 1}")
        if sorted(ids, key=lambda n: end_time[n]) != by_index:
            sys.exit(f"error: p={p} m={m} cap={cap} stage {s}: order index and completion "
                     "times disagree")
        seqs.append([node[n] for n in by_index])
    order = [[f"{s}{KIND[k]}{mb}" for k, s, mb in seq] for seq in seqs]
    check(p, m, order)
    ends = replay(graph, p, m, (f, i, w), c, seqs, end_time, cap)
    mem_delta = (MEM_F, MEM_B, MEM_W)
    peak = 0
    for seq in seqs:
        cur = 0
        for k, _, _ in seq:
            cur += mem_delta[k]
            peak = max(peak, cur)
    cell.update({
        "makespan": clean(max(ends)),
        "best_time": clean(best_time),
        "peak": clean(peak / MEM_UNIT),
        "order": [" ".join(a) for a in order],
    })
    return cell


def replay(graph, p, m, costs, c, seqs, end_time, cap):
    """Replay the per-rank orders ASAP with graphpp's dependency rules; return all end times.

    F(s, mb) after F(s-1, mb); I(s, mb) after F(s, mb) and I(s+1, mb); W(s, mb) after I(s, mb).
    Stage s is on rank s, so only the F(s-1) and I(s+1) dependencies add c. A deadlock or an end
    time different from the reference's means the order (or our reading of it) is wrong.
    """
    done = {}
    pos = [0] * p
    free = [0] * p
    left = sum(len(q) for q in seqs)
    while left:
        moved = False
        for r in range(p):
            while pos[r] < len(seqs[r]):
                k, s, mb = seqs[r][pos[r]]
                if k == 0:
                    deps = [(0, s - 1)] if s > 0 else []
                elif k == 1:
                    deps = [(0, s)] + ([(1, s + 1)] if s < p - 1 else [])
                else:
                    deps = [(1, s)]
                if any((dk, ds, mb) not in done for dk, ds in deps):
                    break
                end = free[r] + costs[k]
                for dk, ds in deps:
                    if ds != r:
                        end = max(end, done[(dk, ds, mb)] + c + costs[k])
                ref = end_time[graph.get_id(k, s, mb)]
                if abs(end - ref) > 1e-9:
                    sys.exit(f"error: p={p} m={m} c={c} cap={cap} {s}{KIND[k]}{mb}: replay ends "
                             f"at {end}, reference at {ref}")
                done[(k, s, mb)] = end
                free[r] = end
                pos[r] += 1
                left -= 1
                moved = True
        if not moved:
            stuck = [seqs[r][pos[r]] for r in range(p) if pos[r] < len(seqs[r])]
            sys.exit(f"error: p={p} m={m} cap={cap} order deadlocks at {stuck}")
    return list(done.values())


def check(p, m, order):
    seen = {}
    for r, acts in enumerate(order):
        if len(acts) != 3 * m:
            sys.exit(f"error: p={p} m={m} rank {r} has {len(acts)} actions, want {3 * m}")
        for a in acts:
            if int(re.match(r"\d+", a).group()) != r:
                sys.exit(f"error: p={p} m={m} rank {r} runs {a} of another stage")
            seen[a] = seen.get(a, 0) + 1
    want = {f"{s}{k}{mb}" for s in range(p) for k in KIND for mb in range(m)}
    if set(seen) != want or any(n != 1 for n in seen.values()):
        bad = sorted(set(seen) ^ want) + sorted(a for a, n in seen.items() if n != 1)
        sys.exit(f"error: p={p} m={m} F/I/W coverage wrong: {bad[:8]}")


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__.split("\n\n")[1])
    checkout = sys.argv[1]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.join(
        root, "crates/graphpp-schedule/tests/fixtures/zb_reference.json"
    )
    zb = load_reference(checkout)
    commit, blob = source_commit(checkout, "zb.py", PINNED_ZB_BLOB)

    cells = []
    for f, i, w in COSTS:
        group = []
        for p in PS:
            for m in (p, 2 * p, 3 * p, 4 * p):
                for c in CS:
                    for cap in (p, 2 * p):
                        group.append(run_cell(zb, p, m, f, i, w, c, cap))
        cells.extend(group)
        ok = [x for x in group if "error" not in x]
        p8 = {(x["c"], x["cap"]): x["makespan"] for x in ok if x["p"] == 8 and x["m"] == 8}
        print(
            f"F={f} I={i} W={w}: {len(group)} cells, {len(group) - len(ok)} errors, "
            f"p=8 m=8 c=0 makespan cap 8 {p8.get((0, 8))} cap 16 {p8.get((0, 16))}, "
            f"cells with peak > cap: {sum(x['peak'] > x['cap'] for x in ok)}"
        )

    header = {
        "source": {
            "repo": REPO,
            "commit": commit,
            "zb_py_blob": blob,
            "function": "zb.initial_solution (as called by zb.create_schedule): best of "
            "Graph.manual_order over allow_bubble_before_first_b x prioritize_b x "
            "no_bubble_greedy, first strictly smallest best_time",
        },
        "generator": "tools/zero_bubble/zb_reference.py",
        "memory": "reference mem_f=2 mem_b=-1 mem_w=-1 max_mem=2*cap per stage; cap and peak in "
        "M_B (F +1, I -0.5, W -0.5, i.e. M_W = 0.5); peak = counter/2",
        "format": "order[r] is rank r's actions in order, space separated, '{stage}{F|I|W}{mb}', "
        "stage r on rank r; makespan = last end time of the reference's ASAP replay; "
        "best_time (max over stages of last W end - first F start) as the reference returns "
        "it; error = the exception the reference raised instead of a schedule",
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
    with open(out) as fh:
        json.load(fh)  # must round-trip
    print(f"{len(cells)} cells (reference {commit[:12]}) -> {out}")


if __name__ == "__main__":
    main()
