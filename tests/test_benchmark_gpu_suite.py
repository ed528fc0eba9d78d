"""benchmarks/gpu_suite.py --tiny: the GPU suite's own code runs on CPU at tiny sizes, so it never rots between GPU
sessions; a failing part is reported, not fatal to the others."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SUITE = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_suite.py"


@pytest.mark.slow
def test_the_tiny_suite_runs_and_writes_its_table(tmp_path):
    # every part but `memory`, whose measurement is benchmarks/memory_predictor.py (run by tests/test_memory.py at
    # larger sizes) followed by offload = auto under a budget (tests/test_memory_admission.py): 37 s of the 131 here
    run = subprocess.run(
        [sys.executable, str(SUITE), "--tiny", "--only", "dit-1.3b,offload-1.3b,quant-1.3b,cache-1.3b,causal-1.3b,vae,"
         "vae-hunyuan,offload-disk-1.3b", "--out", str(tmp_path), "--repeats", "1", "--budget-scale", "4"],
        capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_suite.json").read_text())["results"]
    parts = ("dit-1.3b", "offload-1.3b", "quant-1.3b", "cache-1.3b", "causal-1.3b", "vae", "vae-hunyuan",
             "offload-disk-1.3b")
    assert {k: v["status"] for k, v in results.items()} == dict.fromkeys(parts, "ok"), results
    dit = results["dit-1.3b"]
    assert dit["forward_max_abs_diff"] <= 1e-5 and dit["cfg_step_max_abs_diff"] <= 1e-4  # composer == diffusers
    assert results["offload-1.3b"]["max_abs_diff"] == 0.0
    assert results["offload-disk-1.3b"]["max_abs_diff"] == 0.0
    vae = results["vae"]["modes"]
    assert vae["exact-tiled-fp32"]["max_uint8_diff_vs_fp32_whole"] <= 1 and vae["streamed-fp32"][
        "max_uint8_diff_vs_fp32_whole"] == 0
    hunyuan = results["vae-hunyuan"]["modes"]  # composer's exact tiles == the whole decode; diffusers' are not
    assert hunyuan["exact-tiled"]["max_uint8_diff_vs_whole"] <= 1 < hunyuan["diffusers-tiled"]["max_uint8_diff_vs_whole"]
    assert results["causal-1.3b"]["fps"] > 0 and results["cache-1.3b"]["modes"]["teacache"]["calls"] == 10
    table = (tmp_path / "gpu_suite.md").read_text()
    assert "| dit-1.3b | DiT forward" in table and "| offload-1.3b |" in table


def test_an_unknown_part_is_refused(tmp_path):
    run = subprocess.run([sys.executable, str(SUITE), "--tiny", "--only", "nope", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "unknown part(s) nope" in run.stderr
