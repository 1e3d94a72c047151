"""The runnable example of docs/python.md runs as written (2 processes over gloo) and prints what
the page says it prints."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from conftest import free_port  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "python.md"


def example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    found = [b for b in blocks if b.startswith("# pp_example.py")]
    assert len(found) == 1, "docs/python.md lost its pp_example.py block"
    return found[0]


def test_the_example_runs(tmp_path):
    script = tmp_path / "pp_example.py"
    script.write_text(example())
    env = dict(os.environ, MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert re.search(r"measured costs \(ms\): F=[0-9.]+ I=[0-9.]+ W=[0-9.]+ C=[0-9.]+", text), text
    # Each block saves Linear's input and GELU's input (8 rows x 64 f32 each); the first stage's
    # input needs no grad but Linear still saves it.
    assert "held bytes per stage: {0: 4096, 3: 4096, 1: 4096, 2: 4096}" in text, text
    assert "step time      measured" in text and "slowest rank" in text
    assert (tmp_path / "pp_step.json").stat().st_size > 100
