"""What zbv_reference.py and zb_reference.py share: the pinned sail-sg commit, the grid, loading a
scheduler module from a checkout without Megatron's package __init__ files, identifying the
source, and rounding binary noise out of times."""

import hashlib
import importlib.util
import os
import subprocess
import sys

PINNED_COMMIT = "39f2c186a27580b7051eb51e0f651e1efd0a8170"
REPO = "github.com/sail-sg/zero-bubble-pipeline-parallelism"
SCHED_DIR = "megatron/core/pipeline_parallel/zerobubble/scheduler"
GRAPH_MOD = "megatron.core.pipeline_parallel.zerobubble.scheduler.graph"

PS = [2, 4, 6, 8]
COSTS = [(1, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2)]
CS = [0, 0.1]


def load_module(name, path):
    """Imports the file at `path` as module `name` (registered in sys.modules)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def source_commit(checkout, filename, pinned_blob):
    """(commit, git blob id of scheduler/`filename`); without .git, the pinned commit when the
    blob matches `pinned_blob`."""
    with open(os.path.join(checkout, SCHED_DIR, filename), "rb") as f:
        data = f.read()
    blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    try:
        commit = subprocess.run(
            ["git", "-C", checkout, "rev-parse", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = PINNED_COMMIT if blob == pinned_blob else "unknown"
    return commit, blob


def clean(x):
    """Integers stay integers; floats lose binary noise (0.1 sums)."""
    if isinstance(x, float):
        r = round(x, 9)
        return int(r) if r == int(r) else r
    return x
