"""benchmarks/parallel.py runs: its quick mode's smallest configuration (one process and Ulysses on 2 gloo ranks)
prints both rows, and the bytes it counts equal its formulas."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_quick_parallel_benchmark_prints_the_layout_rows(tmp_path):
    out = tmp_path / "parallel.json"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    run = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "parallel.py"), "--quick", "--only",
                          "ulysses2", "--steps", "2", "--json", str(out)],
                         capture_output=True, text=True, env=env, timeout=150)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    for row in ("one-process", "ulysses2"):
        assert sum(line.startswith(row + " ") for line in lines) == 2, run.stdout  # time table and bytes table
    assert "overhead, not GPU speedup" in run.stdout
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"one-process", "ulysses2"}
    ulysses = rows["ulysses2"]
    assert ulysses["formula_matches"] and ulysses["bytes_equal_every_step"]
    assert ulysses["bytes_measured"]["layer"]["all_to_all"] > 0
    assert ulysses["max_abs_diff"] <= 1e-5
