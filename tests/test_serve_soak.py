"""benchmarks/serve_soak.py runs a small soak: concurrent clients, malformed and cancelled requests, every
completed video fetched and decoded, no crash, no lost job (its exit status says so); and a tiny live-stream soak:
streams and jobs at once, with and without a stalled stream client that must pause only its own stream."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="the `serve` extra (fastapi, uvicorn) is not installed")
pytest.importorskip("uvicorn", reason="the `serve` extra (fastapi, uvicorn) is not installed")

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_a_small_soak_loses_nothing():
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    run = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "serve_soak.py"), "--requests", "12",
                          "--clients", "3", "--malformed", "2", "--cancel", "2", "--steps", "1", "--max-queue", "2",
                          "--uploads", "3", "--bad-uploads", "2", "--timeout", "180"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "server crashes: 0; lost jobs: 0; failed checks: 0" in run.stdout
    assert "(3 videos, 3 multipart, 2 malformed, 2 broken uploads, 2 cancelled)" in run.stdout
    assert "malformed refused with a 4xx: 4" in run.stdout  # the malformed bodies and the broken uploads


@pytest.mark.slow
def test_a_tiny_stream_soak_with_a_stalled_client_loses_nothing_and_pauses_only_that_stream():
    pytest.importorskip("websockets", reason="live streams need the serve extra (fastapi, uvicorn, websockets)")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    run = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "serve_soak.py"), "--streams", "2",
                          "--stream-blocks", "4", "--stalled", "--requests", "2", "--clients", "1", "--num-frames", "9",
                          "--timeout", "180"], capture_output=True, text=True, env=env, timeout=400)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "server crashes: 0; lost jobs: 0; failed checks: 0" in run.stdout
    assert "round 1 without the stalled client: 2/2 streams ok" in run.stdout
    assert "round 1 with the stalled client: 2/2 streams ok" in run.stdout
    # the client leaves while its stream waits for it: the stream fails as stalled (docs/serving.md), it is not lost
    assert "moved 0 time(s) while the others ran, ended failed" in run.stdout
    assert "with / without the stalled client: streams' fps" in run.stdout
