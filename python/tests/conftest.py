"""Shared helpers of the graphpp Python tests: launching gloo pipelines as processes."""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str, ranks: int, args: list[str], timeout: float = 600) -> list[str]:
    """Runs `python script args...` as `ranks` processes of one gloo group on 127.0.0.1 and
    returns their outputs. Fails the test with every rank's output as soon as one rank exits
    non-zero (the others are killed) or when the group outlives `timeout` seconds."""
    port = free_port()
    procs, logs = [], []
    for r in range(ranks):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        log = tempfile.TemporaryFile(mode="w+")
        procs.append(subprocess.Popen([sys.executable, str(HERE / script), *args], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, text=True))
        logs.append(log)
    deadline = time.monotonic() + timeout
    why = None
    try:
        while why is None and any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                why = f"rank {failed[0]} exited {procs[failed[0]].returncode}"
            elif time.monotonic() > deadline:
                why = f"the ranks ran past {timeout} s"
            time.sleep(0.05)
        if why is None and any(p.returncode != 0 for p in procs):
            r = next(r for r, p in enumerate(procs) if p.returncode != 0)
            why = f"rank {r} exited {procs[r].returncode}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outs = []
    for log in logs:
        log.seek(0)
        outs.append(log.read())
        log.close()
    if why is not None:
        shown = "\n\n".join(f"rank {r} (exit {p.returncode}):\n{out[-3000:]}" for r, (p, out) in enumerate(zip(procs, outs)))
        pytest.fail(f"{why}\n{shown}")
    return outs


def run_cases(tmp_path, ranks: int, cases: list[dict]) -> list[dict]:
    """Runs `pipeline_worker.py` over `cases` at `ranks` ranks; returns rank 0's report."""
    cases_file, out = tmp_path / f"cases{ranks}.json", tmp_path / f"out{ranks}.json"
    cases_file.write_text(json.dumps(cases))
    run_ranks("pipeline_worker.py", ranks, [str(out), str(cases_file)])
    return json.loads(out.read_text())
