import sys
from torch.distributed.pipelining.schedules import ScheduleDualPipeV
out = sys.argv[1]
for p in range(1, 7):
    for m in range(2 * p, 2 * p + 9):
        s = object.__new__(ScheduleDualPipeV)
        s.pp_group_size = p
        s._n_microbatches = m
        rows = []
        for r in range(p):
            ops = s._calculate_single_rank_operations(r)
            rows.append(",".join("" if a is None else str(a) for a in ops))
        with open(f"{out}/dualpipev_{p}rank_{m}mb.csv", "w") as f:
            f.write("\n".join(rows) + "\n")
