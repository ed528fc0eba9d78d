"""`composer serve` end to end: a real server on 127.0.0.1 over the embedded shapes model (2 steps, 5 frames).

Jobs that must stay queued or running for a while, or must fail, run on a scripted wrapper of the loaded
generator (prompts starting "gate" wait for the test, "boom" raise); the rest generate real videos."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="composer serve needs the serve extra (fastapi, uvicorn)")
pytest.importorskip("uvicorn", reason="composer serve needs the serve extra (fastapi, uvicorn)")
from serve_support import Scripted, Server

from composer.generator import VideoGenerator
from composer.serve.app import ServeConfig
from composer.serve.requests import ServerLimits
from composer.video import read_frames

SMALL = {"num_inference_steps": 2, "num_frames": 5}


@pytest.fixture(scope="module")
def generator():
    return VideoGenerator.from_pretrained(None, progress=False)


@pytest.fixture
def scripted(generator):
    return Scripted(generator, gated_overrides=SMALL)


@pytest.fixture
def server(scripted, tmp_path):
    config = ServeConfig(output_dir=tmp_path / "serve", limits=ServerLimits(max_steps=1000))
    srv = Server(lambda: scripted, config)
    srv.wait_ready()
    yield srv
    scripted.gate.set()
    srv.stop()


@pytest.fixture
def serial_server(scripted, tmp_path):
    """One job at a time (--max-concurrent 1): a second job stays queued behind a running one."""
    config = ServeConfig(output_dir=tmp_path / "serve", max_concurrent=1)
    srv = Server(lambda: scripted, config)
    srv.wait_ready()
    yield srv
    scripted.gate.set()
    srv.stop()


def submit(srv: Server, prompt: str, **fields) -> str:
    reply = srv.request("POST", "/v1/videos", {"prompt": prompt, "seed": 3, **SMALL, **fields})
    assert reply.status == 200, reply.body
    assert reply.json["status"] == "queued"
    return reply.json["id"]


def test_a_failing_job_fails_alone_and_the_next_gives_generate_videos_frames(server, generator, tmp_path):
    bad = submit(server, "boom")
    good = submit(server, "a red circle moving right", seed=7)
    failed = server.wait(bad)
    assert failed["status"] == "failed" and "boom: the transformer exploded" in failed["error"]["message"]
    assert server.request("GET", f"/v1/videos/{bad}/content").status == 409
    done = server.wait(good)
    assert done["status"] == "completed", done
    assert done["progress"] == 100 and done["seed"] == 7 and done["size"] == "64x64"
    reply = server.request("GET", f"/v1/videos/{good}/content")
    assert reply.status == 200 and reply.headers["content-type"] == "video/mp4"
    (tmp_path / "served.mp4").write_bytes(reply.body)
    direct = generator.generate_video("a red circle moving right", seed=7, output_path=str(tmp_path / "direct.mp4"),
                                      **SMALL)
    served = read_frames(tmp_path / "served.mp4")
    assert served.shape == direct.frames.shape
    np.testing.assert_array_equal(served, read_frames(tmp_path / "direct.mp4"))
    listed = [job["id"] for job in server.request("GET", "/v1/videos?order=asc").json["data"]]
    assert listed == [bad, good]
    metrics = server.request("GET", "/metrics").body.decode()
    assert 'composer_jobs{state="completed"} 1' in metrics and 'composer_jobs{state="failed"} 1' in metrics
    assert "composer_step_seconds_count 2" in metrics


def test_cancel_a_queued_job_and_a_running_one(serial_server, scripted):
    server = serial_server
    running = submit(server, "gate one")
    server.wait(running, ("in_progress",))
    queued = submit(server, "a blue square")
    reply = server.request("DELETE", f"/v1/videos/{queued}")
    assert reply.status == 200 and reply.json["status"] == "cancelled"
    assert server.request("GET", f"/v1/videos/{queued}/content").status == 409
    assert server.request("DELETE", f"/v1/videos/{running}").status == 200
    assert server.wait(running)["status"] == "cancelled"
    deleted = server.request("DELETE", f"/v1/videos/{running}")  # finished: deleted, as OpenAI's API does
    assert deleted.status == 200 and deleted.json == {"id": running, "object": "video.deleted", "deleted": True}
    assert server.request("GET", f"/v1/videos/{running}").status == 404


def test_cancel_stops_a_real_generation_at_the_next_step(server):
    job = submit(server, "a green triangle", num_inference_steps=1000)
    deadline = time.time() + 60
    while server.request("GET", f"/v1/videos/{job}").json["progress_fraction"] == 0:
        assert time.time() < deadline
        time.sleep(0.02)
    assert 0 < server.request("GET", f"/v1/videos/{job}").json["progress_fraction"] < 0.1
    start = time.time()
    server.request("DELETE", f"/v1/videos/{job}")
    assert server.wait(job)["status"] == "cancelled"
    assert time.time() - start < 20


def test_queue_full_gives_429_with_retry_after(scripted, tmp_path):
    srv = Server(lambda: scripted, ServeConfig(output_dir=tmp_path / "serve", max_queue=1, max_concurrent=1))
    try:
        srv.wait_ready()
        running = submit(srv, "gate running")
        srv.wait(running, ("in_progress",))
        submit(srv, "gate waiting")
        reply = srv.request("POST", "/v1/videos", {"prompt": "one too many"})
        assert reply.status == 429 and int(reply.headers["retry-after"]) > 0
        assert "queue is full" in reply.json["error"]["message"]
        assert len(srv.request("GET", "/v1/videos").json["data"]) == 2  # the refused job left no record
    finally:
        for job in srv.request("GET", "/v1/videos").json["data"]:
            srv.request("DELETE", f"/v1/videos/{job['id']}")
        srv.stop()


def test_a_job_past_the_request_timeout_is_cancelled_and_failed(scripted, tmp_path):
    srv = Server(lambda: scripted, ServeConfig(output_dir=tmp_path / "serve", request_timeout=0.3))
    try:
        srv.wait_ready()
        job = srv.wait(submit(srv, "gate forever"))
        assert job["status"] == "failed" and "request timeout" in job["error"]["message"]
    finally:
        srv.stop()


def test_restart_keeps_completed_jobs_and_fails_unfinished_ones(scripted, tmp_path):
    out = tmp_path / "serve"
    first = Server(lambda: scripted, ServeConfig(output_dir=out, max_concurrent=1))
    try:
        first.wait_ready()
        done = submit(first, "gate released")
        scripted.gate.set()
        assert first.wait(done)["status"] == "completed"
        video = first.request("GET", f"/v1/videos/{done}/content").body
        scripted.gate.clear()
        held = submit(first, "gate held at stop")
        first.wait(held, ("in_progress",))
        waiting = submit(first, "queued at stop")
    finally:
        first.stop()
    # a job that was running when the server died
    crashed = json.loads((out / "jobs" / f"{done}.json").read_text())
    crashed["fields"].update(id="video_crashed", status="in_progress")  # the record's own fields
    (out / "jobs" / "video_crashed.json").write_text(json.dumps(crashed))
    second = Server(lambda: scripted, ServeConfig(output_dir=out))
    try:
        assert second.request("GET", f"/v1/videos/{done}").json["status"] == "completed"  # before the model loads
        assert second.request("GET", f"/v1/videos/{done}/content").body == video
        lost = second.request("GET", "/v1/videos/video_crashed").json
        assert lost["status"] == "failed" and lost["error"]["message"] == "server restarted"
        stopped = second.request("GET", f"/v1/videos/{held}").json
        assert stopped["status"] == "failed" and "server stopped" in stopped["error"]["message"]
        assert second.request("GET", f"/v1/videos/{waiting}").json["error"]["message"] == "server restarted"
    finally:
        second.stop()


def test_health_is_503_while_the_model_loads(scripted, tmp_path):
    loaded = threading.Event()

    def load():
        loaded.wait(30)
        return scripted

    srv = Server(load, ServeConfig(output_dir=tmp_path / "serve"))
    try:
        assert srv.request("GET", "/health").status == 503
        reply = srv.request("POST", "/v1/videos", {"prompt": "too early"})
        assert reply.status == 503 and "loading" in reply.json["error"]["message"]
        assert "composer_ready 0" in srv.request("GET", "/metrics").body.decode()
        loaded.set()
        srv.wait_ready()
        assert srv.request("GET", "/health").json["status"] == "ok"
        assert srv.request("GET", "/docs").status == 200
        assert "/v1/videos" in srv.request("GET", "/openapi.json").json["paths"]
    finally:
        loaded.set()
        srv.stop()


def test_cli_refuses_bad_serve_flags_before_loading(capsys):
    from composer.cli.main import main

    assert main(["serve", "--max-queue", "0"]) == 1
    assert "--max-queue 0: expected an integer >= 1" in capsys.readouterr().err
    assert main(["serve", "--max-concurrent", "0"]) == 1
    assert "--max-concurrent 0: expected an integer >= 1" in capsys.readouterr().err
    assert main(["serve", "--dtype", "fp13"]) == 1
    assert "dtype" in capsys.readouterr().err
    assert main(["serve", "--num-gpus", "2"]) == 1
    assert "torchrun --nproc-per-node 2 -m composer serve" in capsys.readouterr().err


def test_serve_hands_kv_cache_memory_and_max_batch_tokens_to_its_generator(monkeypatch):
    """--kv-cache-memory and --max-batch-tokens are RuntimeArgs flags: the served generator's KV pool has that
    budget and its step scheduler that token budget."""
    import uvicorn

    from composer.cli.main import main

    served = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: served.append(self.config.app.state.composer))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["serve", "--model-path", "shapes-causal", "--port", str(port), "--no-progress",
                 "--kv-cache-memory", "5e7", "--max-batch-tokens", "4096"]) == 0
    generator = served[0]._load()  # what the app loads in the background once it starts
    assert generator.pipeline.runtime.kv_cache_memory == 5e7
    assert generator.pipeline.stage("CausalDenoisingStage").kv_pool.stats().budget_bytes == 50_000_000
    assert generator.pipeline.engines[0].scheduler.max_batch_tokens == 4096


def test_serve_refuses_a_bad_kv_cache_memory_or_max_batch_tokens_before_binding_or_loading(monkeypatch, capsys):
    from composer.cli import serve
    from composer.cli.main import main
    from composer.generator import VideoGenerator

    touched = []
    monkeypatch.setattr(VideoGenerator, "from_pretrained", lambda *a, **k: touched.append("load"))
    monkeypatch.setattr(serve, "bind_port", lambda *a: touched.append("bind"))
    for flag, words in (("--kv-cache-memory=0", "kv_cache_memory = 0.0: expected a positive number of bytes"),
                        ("--kv-cache-memory=-1e9", "kv_cache_memory = -1000000000.0: expected a positive number"),
                        ("--kv-cache-memory=nan", "kv_cache_memory = nan: expected a number of bytes"),
                        ("--kv-cache-memory=1.5", "kv_cache_memory = 1.5: expected a whole number of bytes"),
                        ("--kv-cache-memory=lots", "kv_cache_memory = 'lots': expected float"),
                        ("--max-batch-tokens=0", "max_batch_tokens = 0: expected a positive integer")):
        assert main(["serve", "--model-path", "shapes-causal", flag]) == 1, flag
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, (flag, err)  # one line, before anything else
    assert touched == []


def test_cli_refuses_a_port_out_of_range_or_in_use_before_loading(monkeypatch, capsys, tmp_path):
    """--port 70000 and a port another process listens on: one line naming the port, exit 1, nothing loaded (the
    socket is bound before the model loads and handed to uvicorn)."""
    import socket

    from composer.cli.main import main
    from composer.generator import VideoGenerator

    loads = []
    monkeypatch.setattr(VideoGenerator, "from_pretrained", lambda *a, **k: loads.append(a))
    assert main(["serve", "--port", "70000"]) == 1
    assert capsys.readouterr().err == "composer: error: --port 70000: expected a port number in [1, 65535]\n"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port), "--output-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--port {port}: 127.0.0.1:{port} is already in use" in err, err
    assert main(["serve", "--host", "203.0.113.9", "--output-dir", str(tmp_path)]) == 1  # TEST-NET: not ours
    assert "--host 203.0.113.9: not an address of this machine" in capsys.readouterr().err
    assert loads == []


@pytest.mark.slow  # moved to the full tier: the quick tier must stay under 5 minutes
def test_cli_serves_on_the_socket_it_bound(tmp_path):
    """The real command: the port bound before loading is the one uvicorn answers on; SIGINT stops it (130, as a
    Ctrl-C does in every composer command)."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "composer.cli.main", "serve", "--port", str(port), "--output-dir",
                             str(tmp_path), "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None and time.time() < deadline, proc.stdout.read().decode() if proc.poll() else ""
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130


def test_cli_without_the_serve_extra_says_how_to_install_it(monkeypatch, capsys):
    import sys

    from composer.cli.main import main

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if it were not installed
    assert main(["serve"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "pip install 'composer[serve]'" in err and "uvicorn" in err


def test_serve_says_when_live_streams_cannot_work(monkeypatch):
    import importlib.util
    import io
    import logging

    from composer.cli.serve import _check_websockets

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logging.getLogger("composer").addHandler(handler)
    try:
        _check_websockets()
        assert stream.getvalue() == ""  # installed with the serve extra
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)  # as if neither were installed
        _check_websockets()
    finally:
        logging.getLogger("composer").removeHandler(handler)
    assert "live streams (/v1/streams) need the websockets package" in stream.getvalue()
