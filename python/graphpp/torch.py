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
import inspect
import io
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.pipelining import schedules as _schedules

import graphpp

__all__ = ["schedule", "as_schedule", "StepRecorder", "StepReport", "Profile", "profile", "stage_shape"]

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


def as_schedule(order) -> graphpp.Schedule:
    """A PyTorch schedule's order as a ``graphpp.Schedule``: ``order`` is a
    ``{rank: [_Action | None, ...]}`` such as a runtime's ``pipeline_order`` (compute only) or
    ``pipeline_order_with_comms`` (lowered). Raises ``graphpp.ScheduleParseError`` for an action
    graphpp cannot read."""
    rows = [",".join("" if a is None else str(a) for a in order[r]) for r in sorted(order)]
    return graphpp.Schedule.from_csv("\n".join(rows) + "\n")


def schedule(
    kind,
    stages,
    n_microbatches: int,
    loss_fn=None,
    *,
    costs=None,
    m_w: float | None = None,
    mem_cap: float | None = None,
    group: int | None = None,
    solver: str | None = None,
    time_limit: float | None = None,
    scale_grads: bool = True,
    **runtime_kwargs,
):
    """PyTorch's pipelining runtime running graphpp's schedule.

    Args:
        kind: a schedule kind (``"1f1b"``, ``"zbv-auto"``, … or a PyTorch class name; see
            ``graphpp.kinds()``) or a ``graphpp.Schedule`` (e.g. ``graphpp.Schedule.load(path)``).
        stages: this rank's ``PipelineStage`` objects (one per stage it holds).
        n_microbatches: m, the microbatches each ``step`` splits its batch into.
        loss_fn: as for PyTorch's schedules: ``loss_fn(output, target)`` on the last stage.
        costs, m_w, mem_cap, group, solver, time_limit: as for ``graphpp.generate`` (``costs``
            per action, e.g. ``profile(...).costs``; ``group`` is grouped-interleaved's
            microbatches per chunk, not a process group); only with a kind name.
        scale_grads: divide gradients by the number of microbatches (PyTorch's default).
        runtime_kwargs: passed to ``_PipelineScheduleRuntime`` (e.g. ``defer_pp_recv``).

    Returns:
        a ``torch.distributed.pipelining.schedules._PipelineScheduleRuntime``; its
        ``graphpp_schedule`` attribute is the graphpp ``Schedule`` it runs.

    Before returning, graphpp validates the compute-only schedule against the stages' p, S and
    m, checks that this rank holds ``Schedule.stages_on(rank)``, and, once PyTorch has lowered
    the order with its own passes (with ``runtime_kwargs``), validates that lowered program —
    the one the runtime will run, SEND/RECV/WAIT and FSDP actions included — for deadlocks.

    Raises:
        graphpp.GenerateError: the kind cannot serve the shape (the message names the rule).
        graphpp.ValidationError: the schedule or PyTorch's lowered program is invalid or
            deadlocks (the message names rank, step and action).
        graphpp.GraphppError: the stages do not match the schedule (shape or placement); a
            schedule with two parameter copies (DualPipe); generator options with a Schedule.
    """
    stages = list(stages)
    p, v, s = stage_shape(stages)
    options = dict(group=group, costs=costs, m_w=m_w, mem_cap=mem_cap, solver=solver, time_limit=time_limit)
    given = {k: o for k, o in options.items() if o is not None}
    if isinstance(kind, graphpp.Schedule):
        if given:
            raise graphpp.GraphppError(
                f"{', '.join(sorted(given))} apply to generating a kind, not to a given Schedule"
            )
        sched = kind
    else:
        sched = graphpp.generate(kind, p, n_microbatches, stages_per_rank=v, **given)
    graphpp.validate(sched, ranks=p, stages=s, microbatches=n_microbatches)
    visited = sched.route(0)
    if visited != list(range(s)):
        raise graphpp.GraphppError(
            f"microbatch 0 visits stages {visited}, not all {s}: a schedule "
            "with two parameter copies (DualPipe), which PyTorch's PipelineStage cannot hold; use "
            "dualpipev (the same schedule folded onto one copy)"
        )
    _check_placement(sched, stages, stages[0].group_rank)
    runtime = _schedules._PipelineScheduleRuntime(
        stages, n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads, **runtime_kwargs
    )
    rows = csv.reader(io.StringIO(sched.to_csv()))
    runtime.pipeline_order = {r: [_schedules._Action.from_str(c) for c in row] for r, row in enumerate(rows)}
    runtime._prepare_schedule_with_comms(runtime.pipeline_order)
    graphpp.validate(as_schedule(runtime.pipeline_order_with_comms), ranks=p, stages=s, microbatches=n_microbatches)
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


def _tensor_bytes(value) -> int:
    """Bytes of the tensors in ``value`` (a tensor, or a tuple/list of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _hop_latency(stages, nbytes: int, rounds: int = 20) -> float:
    """One hop's time in ms: half the mean round trip of ``nbytes`` between pipeline ranks 0 and 1
    over the stages' process group (gloo, NCCL, …), after a warm-up round; 0 for one rank. A
    collective over the group."""
    group, rank, p = stages[0].group, stages[0].group_rank, stages[0].group_size
    if p < 2:
        return 0.0
    device = getattr(stages[0], "device", "cpu")
    buf = torch.zeros(max(nbytes, 1), dtype=torch.uint8, device=device)
    dist.barrier(group=group)
    elapsed = 0.0
    if rank in (0, 1):
        peer = 1 - rank
        for i in range(rounds + 1):
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, group_dst=peer, group=group)
                dist.recv(buf, group_src=peer, group=group)
            else:
                dist.recv(buf, group_src=peer, group=group)
                dist.send(buf, group_dst=peer, group=group)
            _sync(stages[0])
            if i > 0:
                elapsed += time.perf_counter() - t0
    times: list = [None] * p
    dist.all_gather_object(times, elapsed, group=group)
    return times[0] / rounds / 2 * 1e3


def _sync(stage) -> None:
    """Waits for the work queued on ``stage``'s current CUDA stream (not the whole device: a
    communication stream's pending send must not block); nothing on a CPU."""
    device = getattr(stage, "device", None)
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.current_stream(device).synchronize()


@dataclass
class StepReport:
    """Recorded steps beside graphpp's prediction of one step (times in seconds).

    ``measured`` and ``predicted`` are ``graphpp.SimReport`` objects: the measured one from the
    recorded compute intervals, the recorded steps laid back to back (each step from its
    starting barrier to its last action on any rank), the predicted one simulating one step of
    the schedule with each action's measured mean duration. ``timeline`` is the measured
    ``graphpp.Timeline``; ``steps`` how many steps it holds.
    """

    measured: graphpp.SimReport
    predicted: graphpp.SimReport
    timeline: graphpp.Timeline
    steps: int

    @property
    def step_time(self) -> float:
        """Measured seconds per step: the recorded steps' span over their number."""
        return self.measured.makespan / self.steps

    @property
    def slowest_rank(self) -> int:
        """The rank with the most busy time (measured)."""
        busy = self.measured.busy
        return max(range(len(busy)), key=busy.__getitem__)

    def __str__(self) -> str:
        m, pr, per_step = self.measured, self.predicted, self.step_time
        err = (pr.makespan - per_step) / max(per_step, 1e-12)
        busy = m.busy[self.slowest_rank] / self.steps
        return (
            f"step time      measured {per_step * 1e3:.3f} ms, predicted {pr.makespan * 1e3:.3f} ms ({err:+.1%})\n"
            f"bubble         measured r_bubble = {m.bubble_ratio:.4f}, predicted {pr.bubble_ratio:.4f}\n"
            f"slowest rank   {self.slowest_rank} (busy {busy * 1e3:.3f} ms a step)\n"
        )


class StepRecorder:
    """Records the F/B/I/W actions a ``_PipelineScheduleRuntime`` runs on this rank.

    Use as a context manager around each step to record (every rank of the pipeline must record
    the same steps)::

        rec = graphpp.torch.StepRecorder(runtime)
        with rec:
            runtime.step(...)
        report = rec.report()            # collective over the pipeline group
        if rank == 0: print(report); rec.write_trace("step.json")

    Each stage's ``forward_one_chunk`` (F), ``backward_one_chunk`` (B, or I when called with
    ``full_backward=False``) and ``backward_weight_one_chunk`` (W) is timed with
    ``time.perf_counter`` from a barrier at ``__enter__``; on CUDA the stage's current stream
    is synchronised before and after each, so a time is that action's kernels. The last
    stage's loss runs outside ``forward_one_chunk`` and is not in its F. An OVERLAP_F_B shows
    as its F and B. Times across hosts assume the barrier releases every rank at once (within
    its latency). The runtime may be any ``_PipelineScheduleRuntime``: one that
    ``schedule()`` did not build is compared with its own ``pipeline_order``.

    With ``saved_bytes=True`` each forward also counts the bytes autograd saves for its backward
    (the stage's parameters excluded) into ``held_bytes[stage_index]`` and the bytes of its
    output into ``output_bytes[stage_index]`` (the largest over microbatches); that adds work, so
    time with a second recorder.
    """

    def __init__(self, runtime, saved_bytes: bool = False):
        self.runtime = runtime
        self.saved_bytes = saved_bytes
        self.held_bytes: dict[int, int] = {}
        self.output_bytes: dict[int, int] = {}
        self.stages = list(runtime._stages)
        self.group = self.stages[0].group
        self.rank = self.stages[0].group_rank
        self.ranks = self.stages[0].group_size
        # (step, rank, start, end, action): times from the step's starting barrier.
        self.intervals: list[tuple[int, int, float, float, str]] = []
        self.steps = 0
        self._t0 = 0.0
        self._patched: list[tuple[object, str, bool, object]] = []
        self._report: StepReport | None = None

    def _wrap(self, stage, name: str):
        original = getattr(stage, name)
        signature = inspect.signature(original)
        index = stage.stage_index
        recorder = self

        def timed(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            chunk = next(iter(bound.arguments.values()))
            _sync(stage)
            start = time.perf_counter()
            if recorder.saved_bytes and name == "forward_one_chunk":
                out = _counting_saved(stage, recorder.held_bytes, lambda: original(*args, **kwargs))
                sent = recorder.output_bytes.get(index, 0)
                recorder.output_bytes[index] = max(sent, _tensor_bytes(out))
            else:
                out = original(*args, **kwargs)
            _sync(stage)
            end = time.perf_counter()
            if name == "forward_one_chunk":
                letter = "F"
            elif name == "backward_weight_one_chunk":
                letter = "W"
            else:
                letter = "B" if bound.arguments.get("full_backward", True) else "I"
            t0 = recorder._t0
            recorder.intervals.append((recorder.steps, recorder.rank, start - t0, end - t0, f"{index}{letter}{chunk}"))
            return out

        return timed

    def __enter__(self):
        dist.barrier(group=self.group)
        self._t0 = time.perf_counter()
        for stage in self.stages:
            for name in _RECORDED:
                own = name in vars(stage)
                self._patched.append((stage, name, own, vars(stage).get(name)))
                setattr(stage, name, self._wrap(stage, name))
        return self

    def __exit__(self, *exc):
        for stage, name, own, original in self._patched:
            if own:
                setattr(stage, name, original)
            else:
                delattr(stage, name)
        self._patched.clear()
        self.steps += 1
        return False

    def report(self, hop_ms: float = 0.0) -> StepReport:
        """Gathers every rank's records and returns the ``StepReport``; ``hop_ms`` is one
        cross-rank hop's latency in ms (``Costs.C`` of a ``profile``) added to the prediction.

        A collective over the pipeline group: call it on every rank after the same steps.
        Raises ``graphpp.GraphppError`` when no step was recorded, ``graphpp.SimulateError``
        when the schedule cannot be simulated.
        """
        if self.steps == 0:
            raise graphpp.GraphppError("no step recorded: run the steps inside `with recorder:`")
        gathered: list = [None] * self.ranks
        dist.all_gather_object(gathered, self.intervals, group=self.group)
        records = [i for part in gathered for i in part]
        span = [0.0] * self.steps
        for step, _, _, end, _ in records:
            span[step] = max(span[step], end)
        offset = [sum(span[:k]) for k in range(self.steps)]
        intervals = [(rank, start + offset[k], end + offset[k], a) for k, rank, start, end, a in records]
        timeline = graphpp.Timeline(self.ranks, intervals, unit="s")
        sched = getattr(self.runtime, "graphpp_schedule", None) or as_schedule(self.runtime.pipeline_order)
        measured, predicted = graphpp.measured_vs_predicted(sched, timeline, hop=hop_ms / 1e3)
        self._report = StepReport(measured, predicted, timeline, self.steps)
        return self._report

    def write_trace(self, path) -> None:
        """Writes the measured timeline as a Chrome trace (open in Perfetto); after ``report()``.
        Raises ``graphpp.GraphppError`` before it, ``OSError`` when the file cannot be written."""
        if self._report is None:
            raise graphpp.GraphppError("call report() on every rank before write_trace()")
        with open(path, "w") as f:
            f.write(self._report.timeline.chrome_trace())


@dataclass
class Profile:
    """Measured costs of the user's stages.

    ``costs``: mean F, I, W per action in milliseconds (``B = I + W``) and ``C``, one hop's
    latency (half a round trip of a stage's output between ranks 0 and 1), for
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
    zbv for stages in V placement (r and S-1-r), interleaved-zb for loop placement — with
    ``StepRecorder``. The first step is a warm-up
    that also counts the bytes each forward saves for its backward (autograd's saved tensors,
    the stage's parameters excluded) and the bytes it sends on; the others are timed. Then ranks
    0 and 1 time 20 round trips of the largest stage output: half the mean is the hop latency
    C. ``args``/``target``/``kwargs`` are
    a step's inputs as for ``runtime.step`` (on the ranks that hold the first and the last
    stage), split into ``n_microbatches`` (default 2p). The stages' gradients are zeroed
    afterwards. A collective over the pipeline group: call it on every rank. Returns a
    ``Profile`` (the same on every rank).

    Raises what ``schedule`` raises for stages that do not form a pipeline, and PyTorch's
    errors from running the steps.
    """
    stages = list(stages)
    p, v, s = stage_shape(stages)
    m = n_microbatches or 2 * p
    rank = stages[0].group_rank
    held = sorted(st.stage_index for st in stages)
    kind = "zb-h1" if v == 1 else "zbv" if held == sorted({rank, s - 1 - rank}) else "interleaved-zb"
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
    held_bytes = {k: b for part in gathered for k, b in part.items()}
    timings: dict[str, list[float]] = {"F": [], "I": [], "W": []}
    for _, start, end, action in report.timeline.intervals:
        letter = next(c for c in action if c.isalpha())
        timings.setdefault(letter, []).append((end - start) * 1e3)
    mean = {k: sum(x) / len(x) for k, x in timings.items() if x}
    sent: list = [None] * p
    dist.all_gather_object(sent, max(warmup.output_bytes.values(), default=0), group=stages[0].group)
    hop = _hop_latency(stages, max(sent))
    costs = graphpp.Costs(F=mean["F"], I=mean["I"], W=mean["W"], C=hop)
    placement = runtime.stage_index_to_group_rank
    per_rank = [sum(b for st, b in held_bytes.items() if placement[st] == r) for r in range(p)]
    return Profile(costs=costs, held_bytes=held_bytes, stage_bytes=per_rank, timings=timings)
