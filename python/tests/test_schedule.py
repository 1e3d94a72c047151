"""The Python schedule API against the CLI it wraps: the same CSV for every kind, the same
messages, the same figures; docstrings on every public name."""

import inspect
import json
import os
import subprocess
from pathlib import Path

import pytest

import graphpp

ROOT = Path(__file__).resolve().parents[2]


def cli() -> str:
    """The graphpp CLI: $GRAPHPP_BIN, else the repository's release or debug build."""
    explicit = os.environ.get("GRAPHPP_BIN")
    if explicit:
        assert Path(explicit).is_file(), f"GRAPHPP_BIN={explicit} is not a file"
        return explicit
    for profile in ("release", "debug"):
        path = ROOT / "target" / profile / "graphpp"
        if path.is_file():
            return str(path)
    pytest.skip("no graphpp CLI built: run `cargo build -p graphpp` or set GRAPHPP_BIN")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([cli(), *args], capture_output=True, text=True, timeout=120)


# (kind, p, m, extra generate kwargs, the same as CLI flags)
CASES = [
    (name, p, m, {}, [])
    for name, *_ in graphpp.kinds()
    if name not in ("grouped-interleaved",)
    for p, m in ((2, 4), (4, 8), (3, 7))
    if not (name in ("dualpipe", "dualpipev") and m < 2 * p) and not (name == "dualpipe" and (p % 2 or m % 2))
] + [
    ("grouped-interleaved", 2, 4, {"group": 2}, ["--group", "2"]),
    ("grouped-interleaved", 4, 8, {"group": 4}, ["--group", "4"]),
    ("interleaved-1f1b", 4, 8, {"stages_per_rank": 3}, ["--stages-per-rank", "3"]),
    ("zb-auto", 4, 8, {"costs": "F=1,I=1,W=3,C=0.2", "mem_cap": 2.5}, ["--costs", "F=1,I=1,W=3,C=0.2", "--mem-cap", "2.5"]),
    ("zbv-auto", 4, 9, {"costs": graphpp.Costs(F=2, I=1, W=4), "mem_cap": 4.5, "m_w": 0.25},
     ["--costs", "F=2,I=1,W=4", "--mem-cap", "4.5", "--m-w", "0.25"]),
]


@pytest.mark.parametrize("kind,p,m,kwargs,flags", CASES, ids=[f"{c[0]}-p{c[1]}-m{c[2]}" for c in CASES])
def test_csv_equals_the_cli_byte_for_byte(kind, p, m, kwargs, flags):
    ours = graphpp.generate(kind, p, m, **kwargs).to_csv()
    theirs = run_cli("schedule", "generate", "--schedule", kind, "--ranks", str(p), "--microbatches", str(m),
                     "--format", "csv", *flags)
    assert theirs.returncode == 0, theirs.stderr
    assert ours == theirs.stdout
    assert ours.count("\n") == p


def test_every_kind_is_covered_by_the_csv_cases():
    # A literal list: a kind the bindings lose, or a new one without a case, fails here.
    kinds = {"gpipe", "1f1b", "interleaved-1f1b", "grouped-interleaved", "zb-h1", "zb-h2", "zb-auto", "zbv",
             "zbv-auto", "v-half", "v-min", "dualpipe", "dualpipev", "looped-bfs", "interleaved-zb"}
    assert {name for name, *_ in graphpp.kinds()} == kinds
    assert {c[0] for c in CASES} == kinds


def test_lowered_csv_and_json_equal_the_cli(tmp_path):
    s = graphpp.generate("interleaved-1f1b", 2, 4)
    path = tmp_path / "s.csv"
    s.save(path)
    lowered = graphpp.lower(graphpp.Schedule.load(path), fsdp_max_unsharded=1)
    theirs = run_cli("schedule", "lower", str(path), "--fsdp-max-unsharded", "1")
    assert theirs.returncode == 0, theirs.stderr
    assert lowered.to_csv() == theirs.stdout
    json_cli = run_cli("schedule", "generate", "--schedule", "interleaved-1f1b", "--ranks", "2", "--microbatches",
                       "4", "--format", "json")
    assert s.to_json() + "\n" == json_cli.stdout
    assert graphpp.Schedule.from_json(s.to_json()) == s


DEADLOCK = "0F0,,,0B0,0F1,0B1\n1F1,1F0,1B0,1B1\n"


def test_validation_errors_carry_the_cli_message(tmp_path):
    with pytest.raises(graphpp.ValidationError) as e:
        graphpp.validate(graphpp.Schedule.from_csv(DEADLOCK))
    msg = str(e.value)
    assert msg == ("deadlock: rank 0 at step 3 (0B0) waits for 1B0 on rank 1; "
                   "rank 1 at step 0 (1F1) waits for 0F1 on rank 0")
    path = tmp_path / "dead.csv"
    path.write_text(DEADLOCK)
    theirs = run_cli("schedule", "validate", str(path))
    assert theirs.returncode != 0
    assert msg in theirs.stderr


def test_missing_stage_names_what_is_missing():
    # Rank 1 never runs stage 1's backward of microbatch 1.
    s = graphpp.Schedule.from_csv("0F0,0F1,0B0,0B1\n1F0,1B0,1F1\n")
    with pytest.raises(graphpp.ValidationError, match=r"1B1 \(or 1I1 with 1W1\) is missing: no rank runs it"):
        graphpp.validate(s, ranks=2)
    assert issubclass(graphpp.ValidationError, ValueError)


def test_summary_reads_the_shape():
    s = graphpp.generate("zbv", 4, 8)
    summary = graphpp.validate(s, ranks=4, stages=8, microbatches=8)
    assert (summary.ranks, summary.stages, summary.microbatches, summary.placement) == (4, 8, 8, "V")
    counts = dict(summary.counts)
    assert counts["F"] == counts["I"] == counts["W"] == 64 and counts["B"] == 0
    assert str(summary) == "valid: 4 ranks, 8 stages (V placement), 8 microbatches, compute-only; 64 F, 64 I, 64 W"
    assert s.stages_on(0) == [0, 7] and s.stages_on(3) == [3, 4]
    lowered = graphpp.validate(graphpp.lower(s))
    assert lowered.lowered and dict(lowered.counts)["SEND"] > 0


def test_route_reads_overlapped_halves_and_dualpipes_two_copies():
    # DualPipeV runs the forward of its last microbatches only inside OVERLAP_F_B actions
    # (microbatch 9 has no plain F at p = 4, m = 10): they must still count.
    v = graphpp.generate("dualpipev", 4, 10)
    assert not any(c and "F9" in c and "OVERLAP" not in c for row in v.ranks for c in row)
    assert all(v.route(mb) == list(range(8)) for mb in range(10))
    # DualPipe sends half the microbatches down each parameter copy.
    d = graphpp.generate("dualpipe", 2, 4)
    assert [d.route(mb) for mb in range(4)] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert d.route(4) == []


def test_simulation_equals_the_cli():
    s = graphpp.generate("1f1b", 4, 8)
    ours = graphpp.simulate(s, costs="F=1,B=2,C=0.1")
    theirs = run_cli("schedule", "simulate", "--schedule", "1f1b", "--ranks", "4", "--microbatches", "8",
                     "--costs", "F=1,B=2,C=0.1", "--format", "json")
    assert theirs.returncode == 0, theirs.stderr
    figures = json.loads(theirs.stdout)
    assert ours.makespan == figures["makespan"]
    assert ours.bubble_ratio == figures["bubble_ratio"]
    assert ours.peak_activations == figures["peak_activations"]
    # 1F1B at p=4, m=8, F=1, B=2 without hop latency: (m + p - 1)(F + B).
    assert graphpp.simulate(s, costs="F=1,B=2").makespan == (8 + 3) * 3
    text = run_cli("schedule", "simulate", "--schedule", "1f1b", "--ranks", "4", "--microbatches", "8",
                   "--costs", "F=1,B=2,C=0.1").stdout
    assert ours.summary() in text


def test_chunk_costs_and_bytes():
    s = graphpp.generate("zbv", 2, 4)
    whole = graphpp.simulate(s)  # the CLI's rule: each of v = 2 chunks runs at 1/2 the stage costs
    per_action = graphpp.simulate(s, chunk_factor=1.0)
    assert per_action.makespan == pytest.approx(2 * whole.makespan)
    held = [{"held_fb": 100, "held_iw": 40, "run_f": 10, "run_b": 20, "run_i": 15, "run_w": 5, "resident": 1000}] * 4
    r = graphpp.simulate(s, stage_bytes=held)
    assert r.peak_bytes is not None and len(r.peak_bytes) == 2
    # Two resident stages per rank (2000). Rank 0 runs 0F0 0F1 0F2 3F0 3I0 ...: after 3F0 it
    # holds 4 x held_fb = 400; 3I0 frees one (300) and runs 15 bytes: 315, the largest candidate
    # (an F runs at most 300 + 10). Rank 1 mirrors it.
    assert r.peak_bytes == [2315, 2315]
    with pytest.raises(graphpp.GraphppError, match="unknown key `held`"):
        graphpp.simulate(s, stage_bytes=[{"held": 1}] * 4)


def test_durations_per_action_override_the_costs():
    s = graphpp.generate("1f1b", 2, 3)
    by_kind = graphpp.simulate(s, costs="F=1,B=3", chunk_factor=1.0)
    durations = {a: (1.0 if "F" in a else 3.0) for row in s.ranks for a in row if a}
    assert graphpp.simulate_durations(s, durations).makespan == by_kind.makespan
    # One slow forward on the last stage delays every later action of that rank: 2 units more.
    durations["1F0"] = 3.0
    assert graphpp.simulate_durations(s, durations).makespan == by_kind.makespan + 2.0
    with pytest.raises(graphpp.CostError):
        graphpp.simulate_durations(s, {"0F0": -1.0})


def test_measured_vs_predicted_round_trip():
    s = graphpp.generate("1f1b", 2, 3)
    sim = graphpp.simulate(s, costs="F=1,B=3", chunk_factor=1.0)
    measured, predicted = graphpp.measured_vs_predicted(s, sim.timeline)
    assert measured.makespan == pytest.approx(sim.makespan)
    assert predicted.makespan == pytest.approx(sim.makespan)
    t = graphpp.Timeline(2, [(0, 0.0, 1.0, "0F0"), (1, 1.0, 2.5, "1F0")])
    assert t.makespan == 2.5 and t.intervals[1] == (1, 1.0, 2.5, "1F0")
    trace = json.loads(t.chrome_trace())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert sorted(e["name"] for e in events if e.get("ph") == "X") == ["0F0", "1F0"]
    with pytest.raises(graphpp.GraphppError, match="rank 2 but the timeline has 2 ranks"):
        graphpp.Timeline(2, [(2, 0.0, 1.0, "0F0")])
    with pytest.raises(graphpp.ScheduleParseError):
        graphpp.Timeline(2, [(0, 0.0, 1.0, "0X0")])


def test_a_microbatch_beyond_the_actions_is_refused_unvalidated():
    # Simulating never sizes per-microbatch tables by a number a file names.
    s = graphpp.Schedule.from_csv("0F4000000000,0B4000000000\n")
    with pytest.raises(graphpp.SimulateError, match="beyond the schedule's 2 actions"):
        graphpp.simulate(s)


def test_bad_inputs_raise_typed_errors(tmp_path):
    with pytest.raises(graphpp.GenerateError, match="needs m >= 2p"):
        graphpp.generate("dualpipev", 4, 4)
    with pytest.raises(graphpp.GenerateError, match="unknown schedule kind `zzz`"):
        graphpp.generate("zzz", 2, 2)
    with pytest.raises(graphpp.GenerateError, match="needs at least 1 rank"):
        graphpp.generate("1f1b", 0, 2)
    with pytest.raises(graphpp.GenerateError, match="ranks = -1: a count cannot be negative"):
        graphpp.generate("zbv", -1, 4)
    with pytest.raises(graphpp.GenerateError, match="needs at least 1 stage per rank"):
        graphpp.generate("interleaved-1f1b", 2, 4, stages_per_rank=0)
    with pytest.raises(graphpp.CostError, match="exceeds B"):
        graphpp.Costs(B=1, I=2)
    with pytest.raises(graphpp.CostError, match="graphpp.Costs or text"):
        graphpp.generate("zb-auto", 2, 4, costs=3)
    with pytest.raises(graphpp.ScheduleParseError, match=r"rank 1 \(line 2\), cell 2"):
        graphpp.Schedule.from_csv('0F0,0B0\n1F0,"x')
    with pytest.raises(OSError, match="cannot read"):
        graphpp.Schedule.load(tmp_path / "missing.csv")
    with pytest.raises(OSError, match="longer than 64 MiB"):
        graphpp.Schedule.load("/dev/zero")  # a device without end: refused at the bound, not read whole
    assert graphpp.generate("ScheduleZBVZeroBubble", 2, 4) == graphpp.generate("zbv", 2, 4)


def test_compare_lists_every_kind():
    rows = graphpp.compare(4, 8)
    assert [r["kind"] for r in rows] == [name for name, *_ in graphpp.kinds()]
    one = next(r for r in rows if r["kind"] == "1f1b")
    assert one["bubble_ratio"] == pytest.approx(3 / 8)  # (p - 1) / m
    dualpipe = next(r for r in rows if r["kind"] == "dualpipe")
    assert dualpipe["stages_per_rank"] == 2 and dualpipe["messages_per_microbatch"] > 0
    assert "error" in graphpp.compare(4, 4)[-1]  # dualpipev needs m >= 2p


def test_every_public_name_has_a_docstring():
    assert graphpp.__doc__ and "generate" in graphpp.__doc__
    for name in graphpp.__all__:
        obj = getattr(graphpp, name)
        assert (obj.__doc__ or "").strip(), name
        if inspect.isclass(obj) and not issubclass(obj, BaseException):
            for attr, member in vars(obj).items():
                if not attr.startswith("_"):
                    assert (getattr(member, "__doc__", "") or "").strip(), f"{name}.{attr}"
    out = subprocess.run([os.sys.executable, "-c", "import graphpp; help(graphpp)"], capture_output=True,
                         text=True, env=dict(os.environ, PAGER="cat"), timeout=60)
    assert out.returncode == 0 and "Generates the schedule of `kind`" in out.stdout
