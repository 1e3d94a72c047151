"""graphpp.torch: refusals before the first step, and the profiler and step recorder on a real
gloo pipeline."""

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

import graphpp  # noqa: E402
import graphpp.torch as gt  # noqa: E402
from conftest import run_ranks  # noqa: E402


def stages(p, S, rank, indices):
    """Stand-ins for PipelineStage: what graphpp.torch.schedule reads before building the runtime."""
    return [SimpleNamespace(group_size=p, num_stages=S, group_rank=rank, stage_index=i) for i in indices]


def test_a_deadlocking_schedule_is_refused_with_its_cycle():
    dead = graphpp.Schedule.from_csv("0F0,,,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n")
    with pytest.raises(graphpp.ValidationError, match=r"deadlock: rank 0 at step 3 \(0B0\) waits for 1B0 on rank 1"):
        gt.schedule(dead, stages(2, 2, 0, [0]), 2)


def test_a_csv_with_a_missing_stage_is_refused():
    # The stages are 4 (v = 2) but the CSV names only stages 0 and 1.
    missing = graphpp.Schedule.from_csv("0F0,0B0\n1F0,1B0\n")
    with pytest.raises(graphpp.ValidationError, match=r"name 2 stages \(0..2\), expected 4"):
        gt.schedule(missing, stages(2, 4, 0, [0, 3]), 1)
    # A microbatch whose last backward no rank runs.
    short = graphpp.Schedule.from_csv("0F0,0F1,0B0,0B1\n1F0,1B0,1F1\n")
    with pytest.raises(graphpp.ValidationError, match=r"1B1 \(or 1I1 with 1W1\) is missing"):
        gt.schedule(short, stages(2, 2, 0, [0]), 2)


def test_stages_that_do_not_match_the_placement_are_refused():
    with pytest.raises(graphpp.GraphppError, match=r"rank 0 holds stages \[0, 1\], but the zbv schedule places stages \[0, 3\]"):
        gt.schedule("zbv", stages(2, 4, 0, [0, 1]), 4)
    with pytest.raises(graphpp.GraphppError, match="do not split evenly"):
        gt.schedule("1f1b", stages(2, 3, 0, [0]), 4)
    with pytest.raises(graphpp.GraphppError, match="use dualpipev"):
        gt.schedule("dualpipe", stages(2, 4, 0, [0, 3]), 4)
    with pytest.raises(graphpp.GenerateError, match="needs m >= 2p"):
        gt.schedule("dualpipev", stages(2, 4, 0, [0, 3]), 2)
    # DualPipe read from a CSV (no kind attached) is told by its routes.
    two_copies = graphpp.Schedule.from_csv(graphpp.generate("dualpipe", 2, 4).to_csv())
    with pytest.raises(graphpp.GraphppError, match=r"microbatch 0 visits stages \[0, 1\], not all 4"):
        gt.schedule(two_copies, stages(2, 4, 0, two_copies.stages_on(0)), 4)
    with pytest.raises(graphpp.GraphppError, match="costs, mem_cap apply to generating a kind"):
        gt.schedule(graphpp.generate("zbv", 2, 4), stages(2, 4, 0, [0, 3]), 4, costs="F=1", mem_cap=2)


def test_every_public_name_of_graphpp_torch_has_a_docstring():
    assert gt.__doc__
    for name in gt.__all__:
        obj = getattr(gt, name)
        assert (obj.__doc__ or "").strip(), name
        for attr, member in vars(obj).items() if isinstance(obj, type) else []:
            if not attr.startswith("_") and callable(member):
                assert (member.__doc__ or "").strip(), f"{name}.{attr}"


def test_profile_and_step_recorder(tmp_path):
    out = tmp_path / "out.json"
    run_ranks("recorder_worker.py", 2, [str(out)])
    r = json.loads(out.read_text())
    f, i, w, b, c = r["costs"]
    assert f > 0 and i > 0 and w > 0 and b == pytest.approx(i + w)
    assert 0 < c < 1e3  # a gloo round trip on one host: some microseconds, never a second
    # Each stage's forward saves Linear's input and tanh's output (the second Linear's input is
    # the same tensor): 2 x rows x dim f64 values per microbatch; parameters are not counted.
    per_stage = 2 * r["rows"] * r["dim"] * 8
    assert r["held_bytes"] == {str(s): per_stage for s in range(4)}
    assert r["stage_bytes"] == [2 * per_stage, 2 * per_stage]
    # The cap of a fixed budget: 10,000 bytes over the largest rank's M_B bytes.
    assert r["mem_cap_of_10000_bytes"] == pytest.approx(10_000 / (2 * per_stage))
    # zbv over 2 timed steps: 4 stages x 4 microbatches of each of F, I, W per step.
    assert r["timings"] == {"F": 32, "I": 32, "W": 32}
    assert r["grads_zeroed"]
    assert r["csv"] == r["expected_csv"]
    assert r["steps"] == 2
    actions = sorted(a for _, _, _, a in r["intervals"])
    expected = sorted(
        a for row in graphpp.Schedule.from_csv(r["csv"]).ranks for a in row if a for _ in range(2)
    )
    assert actions == expected
    # Each rank runs one action at a time, and the second step follows the first.
    for rank in (0, 1):
        spans = sorted((start, end) for rk, start, end, _ in r["intervals"] if rk == rank)
        assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:])), spans
    assert r["step_time"] * 2 == pytest.approx(r["measured_makespan"], rel=1e-6)
    assert 0 < r["predicted_makespan"] < r["measured_makespan"]
    assert r["measured_bubble"] >= 0 and r["slowest_rank"] in (0, 1)
    assert "step time      measured" in r["text"] and "predicted" in r["text"]
    assert r["trace_bytes"] > 100
