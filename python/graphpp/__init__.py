"""graphpp: pipeline-parallel schedules you can generate, check, lower and simulate.

The schedule toolchain of the graphpp project (its Rust crate ``graphpp-schedule``), as Python
objects. A *schedule* lists, per rank, the actions it runs in order: ``F`` (forward), ``B`` (full
backward), ``I`` (input gradient), ``W`` (weight gradient), ``OVERLAP_F_B``, and after lowering
``SEND``/``RECV`` and FSDP's ``UNSHARD``/``RESHARD``/``REDUCE_GRAD``. Its CSV is the one PyTorch's
``torch.distributed.pipelining`` runtime loads (``_PipelineScheduleRuntime._load_csv``).

Functions:
    kinds()                   every schedule kind: name, PyTorch class, constraints, v, placement
    generate(kind, p, m, ...) a named kind's schedule (gpipe, 1f1b, zb-h1, zb-auto, zbv, zbv-auto,
                              interleaved-1f1b, looped-bfs, interleaved-zb, v-half, v-min,
                              dualpipev, ...) with costs and a memory cap for the cost-aware kinds
    validate(s, ...)          every check of ``graphpp schedule validate``; raises ValidationError
    lower(s, ...)             add SEND/RECV (and FSDP actions) as ``graphpp schedule lower``
    simulate(s, ...)          makespan, bubbles, peak activations (and bytes), the timeline
    simulate_durations(s, d)  the same with a measured duration per action
    measured_vs_predicted(s, t)  a measured timeline beside the simulator's prediction
    compare(p, m, ...)        every kind at one shape, as ``graphpp schedule compare``

Classes: Schedule, Costs, Summary, SimReport, Timeline. Errors: GraphppError (a ValueError) and
its subclasses ScheduleParseError, GenerateError, ValidationError, LowerError, SimulateError,
CostError; their messages are the CLI's.

``graphpp.torch`` (needs PyTorch) runs any of these schedules with PyTorch's own pipelining
runtime, validates the lowered program (deadlocks included) before the first step, profiles
F/I/W of the user's stages, and reports a run's measured bubble against graphpp's prediction.
See docs/python.md in the graphpp repository.
"""

from graphpp._graphpp import (
    CostError,
    Costs,
    GenerateError,
    GraphppError,
    LowerError,
    Schedule,
    ScheduleParseError,
    SimReport,
    SimulateError,
    Summary,
    Timeline,
    ValidationError,
    compare,
    generate,
    kinds,
    lower,
    measured_vs_predicted,
    simulate,
    simulate_durations,
    validate,
)

__all__ = [
    "CostError",
    "Costs",
    "GenerateError",
    "GraphppError",
    "LowerError",
    "Schedule",
    "ScheduleParseError",
    "SimReport",
    "SimulateError",
    "Summary",
    "Timeline",
    "ValidationError",
    "compare",
    "generate",
    "kinds",
    "lower",
    "measured_vs_predicted",
    "simulate",
    "simulate_durations",
    "validate",
]
