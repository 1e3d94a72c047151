"""Shared helpers of the graphpp Python tests: launching gloo pipelines as processes."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str, ranks: int, args: list[str], timeout: float = 600) -> list[subprocess.CompletedProcess]:
    """Runs `python script args...` as `ranks` processes of one gloo group on 127.0.0.1; fails the
    test (with every rank's output) when any exits non-zero or the group outlives `timeout`."""
    port = free_port()
    procs = []
    for r in range(ranks):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(HERE / script), *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append((p.returncode, out))
    finally:
        for p in procs:
            p.kill()
    failed = [f"rank {r} exited {code}:\n{out[-3000:]}" for r, (code, out) in enumerate(outs) if code != 0]
    if failed:
        pytest.fail("\n\n".join(failed))
    return outs


def run_cases(tmp_path, ranks: int, cases: list[dict]) -> list[dict]:
    """Runs `pipeline_worker.py` over `cases` at `ranks` ranks; returns rank 0's report."""
    cases_file, out = tmp_path / f"cases{ranks}.json", tmp_path / f"out{ranks}.json"
    cases_file.write_text(json.dumps(cases))
    run_ranks("pipeline_worker.py", ranks, [str(out), str(cases_file)])
    return json.loads(out.read_text())
