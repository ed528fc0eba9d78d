"""benchmarks/families_vs_diffusers.py runs: one two-expert family through both engines prints its row, with the
two videos within 1 uint8 (the benchmark's sanity column)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_families_benchmark_prints_a_row_per_family():
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    run = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "families_vs_diffusers.py"), "--families",
                          "wan2.2-a14b", "--steps", "2", "--repeats", "1", "--threads", "1"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split() for line in run.stdout.splitlines() if line.startswith("wan2.2-a14b ")]
    assert len(rows) == 1, run.stdout
    assert int(rows[0][-1]) <= 1  # max uint8 difference between the engines' videos


def test_an_unknown_family_is_refused_before_any_work():
    run = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "families_vs_diffusers.py"), "--families",
                          "wan9"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "unknown wan9" in run.stderr
