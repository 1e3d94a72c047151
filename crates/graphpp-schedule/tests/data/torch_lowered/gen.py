"""Writes PyTorch's own lowered schedules (compute + SEND/RECV + FSDP actions) as CSV fixtures.

Usage: python gen.py OUT_DIR   (needs PyTorch; CPU build is enough, no process group is created)

Each file is `{class}_p{p}_v{v}_m{m}.csv`: one row per rank, one action per cell, exactly as
PyTorch's `_schedule_visualizer.get_schedule_ops(..., with_comms=True)` returns it. PyTorch 2.15's
lowered form also holds WAIT_* actions (completion waits of asynchronous sends / reductions),
which graphpp's schedule IR does not have; the test drops those cells before parsing.
"""

import sys

from torch.distributed.pipelining import schedules as S
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

CASES = [
    ("ScheduleInterleaved1F1B", 4, 2, 8),
    ("ScheduleInterleaved1F1B", 3, 3, 6),
    ("ScheduleLoopedBFS", 3, 2, 6),
    ("ScheduleInterleavedZeroBubble", 4, 2, 8),
    ("ScheduleZBVZeroBubble", 4, 2, 8),
    ("ScheduleDualPipeV", 4, 2, 8),
    ("ScheduleDualPipeV", 3, 2, 9),
]

out = sys.argv[1]
for name, p, v, m in CASES:
    ops = get_schedule_ops(getattr(S, name), p, m, num_stages_per_rank=v, with_comms=True)
    with open(f"{out}/{name}_p{p}_v{v}_m{m}.csv", "w") as f:
        f.write("\n".join(",".join("" if a is None else str(a) for a in row) for row in ops) + "\n")
