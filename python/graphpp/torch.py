"""graphpp's schedules under PyTorch's own pipelining runtime (``torch.distributed.pipelining``).

Three pieces, each usable alone:

``schedule(kind, stages, n_microbatches, loss_fn=...)``
    A ``_PipelineScheduleRuntime`` that runs graphpp's schedule of ``kind`` (any kind but
    ``dualpipe``, whose two parameter copies PyTorch's stages cannot hold) on the user's
    ``PipelineStage`` objects. Before the first step graphpp validates the compute-only schedule
    and its lowered program (SEND/RECV added; the cross-rank deadlock check included) against the
    stages' shape, and checks that this rank holds the stages the schedule places on it; a
    failure raises ``graphpp.ValidationError`` (or ``graphpp.GraphppError``) naming rank, step and
    action. The runtime then lowers the same order with its own passes, as ``_load_csv`` does.

``StepRecorder(runtime)``
    Times every F, B, I and W the runtime runs on this rank (wall clock; on CUDA the stage's device
    is synchronised first, so each time is the kernels' own), gathers the ranks' records over the
    pipeline's process group, and compares them with graphpp's simulation of the same schedule
    from the measured durations: ``report()`` gives the measured and predicted bubble, step time
    and slowest rank; ``write_trace(path)`` a Perfetto (Chrome) trace.

``profile(stages, args, target=..., loss_fn=...)``
    Measures the mean F, I (input gradient) and W (weight gradient) times of the user's stages by
    running a zero-bubble schedule with the I/W split (zb-h1 at one stage per rank, zbv at two)
    under the recorder, and the bytes each stage saves for its backward per microbatch (M_B).
    Returns ``Profile(costs=graphpp.Costs, held_bytes=[...])``: hand ``costs`` to
    ``schedule("zbv-auto", ..., costs=profile.costs)``.

All collectives use the process group of the stages (``stage.group``), so the functions work
within a pipeline group of a larger mesh.
"""

from __future__ import annotations

import csv
import io
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.pipelining import schedules as _schedules

import graphpp

__all__ = ["schedule", "StepRecorder", "StepReport", "Profile", "profile", "stage_shape"]

_RECORDED = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def stage_shape(stages) -> tuple[int, int, int]:
    """The pipeline shape of this rank's ``stages``: ``(p, v, S)`` with p the pipeline ranks
    (``group_size``), S the stages (``num_stages``) and v = S / p stages per rank.

    Raises ``graphpp.GraphppError`` when ``stages`` is empty, when the stages disagree on p or S,
    or when p does not divide S.
    """
    stages = list(stages)
    if not stages:
        raise graphpp.GraphppError("no stages: give this rank's PipelineStage objects")
    p, s = stages[0].group_size, stages[0].num_stages
    for st in stages[1:]:
        if (st.group_size, st.num_stages) != (p, s):
            raise graphpp.GraphppError(
                f"stage {st.stage_index} has group_size={st.group_size}, num_stages={st.num_stages} "
                f"but stage {stages[0].stage_index} has {p} and {s}"
            )
    if s % p:
        raise graphpp.GraphppError(f"{s} stages do not split evenly over {p} pipeline ranks")
    return p, s // p, s


def _check_placement(sched: graphpp.Schedule, stages, rank: int) -> None:
    """Raises ``GraphppError`` when ``rank`` holds other stages than ``sched`` places on it."""
    held = sorted(st.stage_index for st in stages)
    placed = sched.stages_on(rank)
    if held != placed:
        raise graphpp.GraphppError(
            f"rank {rank} holds stages {held}, but the {sched.kind or 'given'} schedule places stages "
            f"{placed} on it: build this rank's PipelineStage objects for those stage indices "
            f"(Schedule.stages_on(rank) lists them)"
        )


def schedule(
    kind,
    stages,
    n_microbatches: int,
    loss_fn=None,
    *,
    costs=None,
    m_w: float = 0.5,
    mem_cap: float | None = None,
    group: int | None = None,
    solver: str = "heuristic",
    time_limit: float | None = None,
    scale_grads: bool = True,
    **runtime_kwargs,
):
    """PyTorch's pipelining runtime running graphpp's schedule.

    Args:
        kind: a schedule kind (``"1f1b"``, ``"zbv-auto"``, … or a PyTorch class name; see
            ``graphpp.kinds()``) or a ``graphpp.Schedule`` (e.g. ``graphpp.Schedule.load(path)``).
        stages: this rank's ``PipelineStage`` objects (one per stage it holds).
        n_microbatches: m.
        loss_fn: as for PyTorch's schedules: ``loss_fn(output, target)`` on the last stage.
        costs, m_w, mem_cap, group, solver, time_limit: as for ``graphpp.generate`` (costs per
            action: a ``graphpp.Costs`` such as ``profile(...).costs``).
        scale_grads: divide gradients by the number of microbatches (PyTorch's default).
        runtime_kwargs: passed to ``_PipelineScheduleRuntime`` (e.g. ``defer_pp_recv``).

    Returns:
        a ``torch.distributed.pipelining.schedules._PipelineScheduleRuntime``; its
        ``graphpp_schedule`` attribute is the graphpp ``Schedule`` it runs.

    Raises:
        graphpp.GenerateError: the kind cannot serve the shape (the message names the rule).
        graphpp.ValidationError: the schedule or its lowered program is invalid or deadlocks.
        graphpp.GraphppError: the stages do not match the schedule (shape or placement), or the
            kind is ``dualpipe``.
    """
    p, v, s = stage_shape(stages)
    if isinstance(kind, graphpp.Schedule):
        sched = kind
    else:
        sched = graphpp.generate(
            kind,
            p,
            n_microbatches,
            stages_per_rank=v,
            group=group,
            costs=costs,
            m_w=m_w,
            mem_cap=mem_cap,
            solver=solver,
            time_limit=time_limit,
        )
    if sched.kind == "dualpipe":
        raise graphpp.GraphppError(
            "dualpipe runs two parameter copies per rank, which PyTorch's PipelineStage cannot hold; "
            "use dualpipev (the same schedule folded onto one copy)"
        )
    graphpp.validate(sched, ranks=p, stages=s, microbatches=n_microbatches)
    graphpp.validate(graphpp.lower(sched), ranks=p, stages=s, microbatches=n_microbatches)
    _check_placement(sched, stages, stages[0].group_rank)
    runtime = _schedules._PipelineScheduleRuntime(
        stages, n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads, **runtime_kwargs
    )
    rows = csv.reader(io.StringIO(sched.to_csv()))
    runtime.pipeline_order = {r: [_schedules._Action.from_str(c) for c in row] for r, row in enumerate(rows)}
    runtime._validate_and_set_stage_mapping(runtime.pipeline_order)
    runtime._prepare_schedule_with_comms(runtime.pipeline_order)
    runtime.graphpp_schedule = sched
    return runtime


def _counting_saved(stage, held: dict[int, int], run):
    """Runs ``run()`` counting the bytes of the tensors autograd saves (``stage``'s parameters
    excluded) into ``held[stage.stage_index]`` (the largest count)."""
    params = {q.data_ptr() for q in stage.submod.parameters()}
    seen: set[tuple[int, int, torch.dtype]] = set()
    total = 0

    def pack(t):
        nonlocal total
        key = (t.data_ptr(), t.numel(), t.dtype) if isinstance(t, torch.Tensor) else None
        if key is not None and t.data_ptr() not in params and key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    held[stage.stage_index] = max(held.get(stage.stage_index, 0), total)
    return out


def _sync(stage) -> None:
    device = getattr(stage, "device", None)
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class StepReport:
    """A recorded run beside graphpp's prediction (times in seconds).

    ``measured`` and ``predicted`` are ``graphpp.SimReport`` objects: the measured one from the
    recorded compute intervals (shifted to start at 0), the predicted one simulating the
    schedule with each action's measured mean duration. ``timeline`` is the measured
    ``graphpp.Timeline``; ``steps`` how many steps it holds.
    """

    measured: graphpp.SimReport
    predicted: graphpp.SimReport
    timeline: graphpp.Timeline
    steps: int

    @property
    def slowest_rank(self) -> int:
        """The rank with the most busy time (measured)."""
        busy = self.measured.busy
        return max(range(len(busy)), key=busy.__getitem__)

    def __str__(self) -> str:
        m, pr = self.measured, self.predicted
        per_step = m.makespan / max(self.steps, 1)
        err = (pr.makespan - m.makespan / max(self.steps, 1)) / max(per_step, 1e-12)
        return (
            f"step time      measured {per_step * 1e3:.3f} ms, predicted {pr.makespan * 1e3:.3f} ms "
            f"({err:+.1%})\n"
            f"bubble         measured r_bubble = {m.bubble_ratio:.4f}, predicted {pr.bubble_ratio:.4f}\n"
            f"slowest rank   {self.slowest_rank} (busy {m.busy[self.slowest_rank] / max(self.steps, 1) * 1e3:.3f} ms a step)\n"
        )


class StepRecorder:
    """Records the F/B/I/W actions a ``_PipelineScheduleRuntime`` runs on this rank.

    Use as a context manager around the steps to record (every rank of the pipeline must record
    the same steps)::

        rec = graphpp.torch.StepRecorder(runtime)
        with rec:
            runtime.step(...)
        report = rec.report()            # collective over the pipeline group
        if rank == 0: print(report); rec.write_trace("step.json")

    Each stage's ``forward_one_chunk`` (F), ``backward_one_chunk`` (B, or I when the schedule
    splits the backward) and ``backward_weight_one_chunk`` (W) is timed with
    ``time.perf_counter`` from a barrier at ``__enter__``; on CUDA the device is synchronised
    before and after each, so a time is that action's kernels. An OVERLAP_F_B shows as its F and
    B. Times across hosts assume the barrier releases every rank at once (within its latency).

    With ``saved_bytes=True`` each forward also counts the bytes autograd saves for its backward
    (the stage's parameters excluded) into ``held_bytes[stage_index]`` (the largest over
    microbatches); that adds work, so time with a second recorder.
    """

    def __init__(self, runtime, saved_bytes: bool = False):
        self.runtime = runtime
        self.saved_bytes = saved_bytes
        self.held_bytes: dict[int, int] = {}
        self.stages = list(runtime._stages)
        self.group = self.stages[0].group
        self.rank = self.stages[0].group_rank
        self.ranks = self.stages[0].group_size
        self.intervals: list[tuple[int, float, float, str]] = []
        self.steps = 0
        self._t0 = 0.0
        self._saved: list[tuple[object, str, object]] = []
        self._report: StepReport | None = None

    def _wrap(self, stage, name: str):
        original = getattr(stage, name)
        index = stage.stage_index
        recorder = self

        def timed(chunk, *args, **kwargs):
            _sync(stage)
            start = time.perf_counter()
            if recorder.saved_bytes and name == "forward_one_chunk":
                out = _counting_saved(stage, recorder.held_bytes, lambda: original(chunk, *args, **kwargs))
            else:
                out = original(chunk, *args, **kwargs)
            _sync(stage)
            end = time.perf_counter()
            if name == "forward_one_chunk":
                letter = "F"
            elif name == "backward_weight_one_chunk":
                letter = "W"
            else:
                full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
                letter = "B" if full else "I"
            recorder.intervals.append((recorder.rank, start - recorder._t0, end - recorder._t0, f"{index}{letter}{chunk}"))
            return out

        return original, timed

    def __enter__(self):
        dist.barrier(group=self.group)
        if not self._saved:
            self._t0 = time.perf_counter()
            for stage in self.stages:
                for name in _RECORDED:
                    original, timed = self._wrap(stage, name)
                    self._saved.append((stage, name, original))
                    setattr(stage, name, timed)
        return self

    def __exit__(self, *exc):
        for stage, name, original in self._saved:
            setattr(stage, name, original)
        self._saved.clear()
        self.steps += 1
        return False

    def report(self, hop: float = 0.0) -> StepReport:
        """Gathers every rank's records (a collective over the pipeline group: call it on every
        rank) and returns the ``StepReport``; ``hop`` is the latency of one cross-rank transfer in
        seconds added to the prediction."""
        gathered: list = [None] * self.ranks
        dist.all_gather_object(gathered, self.intervals, group=self.group)
        intervals = [i for part in gathered for i in part]
        timeline = graphpp.Timeline(self.ranks, intervals, unit="s")
        sched = self.runtime.graphpp_schedule
        measured, predicted = graphpp.measured_vs_predicted(sched, timeline, hop=hop)
        self._report = StepReport(measured, predicted, timeline, max(self.steps, 1))
        return self._report

    def write_trace(self, path) -> None:
        """Writes the measured timeline as a Chrome trace (open in Perfetto); after ``report()``."""
        if self._report is None:
            raise graphpp.GraphppError("call report() on every rank before write_trace()")
        with open(path, "w") as f:
            f.write(self._report.timeline.chrome_trace())


@dataclass
class Profile:
    """Measured costs of the user's stages.

    ``costs``: mean F, I, W per action in milliseconds (``B = I + W``), for
    ``schedule(..., costs=...)``; ``held_bytes``: per stage index, the bytes its forward saves
    for the backward for one microbatch (activations; parameters excluded); ``stage_bytes``: per
    rank, the sum over the stages it holds (one full stage's M_B in graphpp's memory model, as
    v chunks make one stage's share of the model); ``timings``: per action kind (F, I, W), every
    measured duration in ms.
    """

    costs: graphpp.Costs
    held_bytes: dict[int, int] = field(default_factory=dict)
    stage_bytes: list[int] = field(default_factory=list)
    timings: dict[str, list[float]] = field(default_factory=dict)

    def mem_cap(self, activation_bytes_per_rank: int) -> float:
        """The memory cap in M_B units (``schedule(..., mem_cap=...)``) that keeps a rank's
        in-flight activations within ``activation_bytes_per_rank`` bytes: the budget over the
        largest rank's M_B bytes. Raises ``GraphppError`` when no held bytes were measured."""
        largest = max(self.stage_bytes, default=0)
        if largest <= 0:
            raise graphpp.GraphppError("the profile measured no held bytes")
        return activation_bytes_per_rank / largest


def profile(stages, *args, target=None, loss_fn=None, n_microbatches: int | None = None, steps: int = 3, **kwargs):
    """Measures F, I, W and the held activation bytes of this rank's ``stages``.

    Runs ``steps + 1`` steps of a schedule with the I/W split — zb-h1 at one stage per rank,
    zbv at two, interleaved-zb at more — with ``StepRecorder``. The first step is a warm-up
    that also counts the bytes each forward saves for its backward (autograd's saved tensors,
    the stage's parameters excluded); the others are timed. ``args``/``target``/``kwargs`` are
    a step's inputs as for ``runtime.step`` (on the ranks that hold the first and the last
    stage), split into ``n_microbatches`` (default 2p). The stages' gradients are zeroed
    afterwards. A collective over the pipeline group: call it on every rank. Returns a
    ``Profile`` (the same on every rank).
    """
    p, v, _ = stage_shape(stages)
    m = n_microbatches or 2 * p
    kind = {1: "zb-h1", 2: "zbv"}.get(v, "interleaved-zb")
    runtime = schedule(kind, stages, m, loss_fn=loss_fn)
    warmup = StepRecorder(runtime, saved_bytes=True)
    with warmup:
        runtime.step(*args, target=target, **kwargs)
    recorder = StepRecorder(runtime)
    for _ in range(steps):
        with recorder:
            runtime.step(*args, target=target, **kwargs)
    report = recorder.report()
    for st in stages:
        st.submod.zero_grad(set_to_none=True)
    gathered: list = [None] * p
    dist.all_gather_object(gathered, warmup.held_bytes, group=stages[0].group)
    held = {k: b for part in gathered for k, b in part.items()}
    timings: dict[str, list[float]] = {"F": [], "I": [], "W": []}
    for _, start, end, action in report.timeline.intervals:
        letter = next(c for c in action if c.isalpha())
        timings.setdefault(letter, []).append((end - start) * 1e3)
    mean = {k: sum(x) / len(x) for k, x in timings.items() if x}
    costs = graphpp.Costs(F=mean["F"], I=mean["I"], W=mean["W"])
    placement = runtime.stage_index_to_group_rank
    per_rank = [sum(b for st, b in held.items() if placement[st] == r) for r in range(p)]
    return Profile(costs=costs, held_bytes=held, stage_bytes=per_rank, timings=timings)
