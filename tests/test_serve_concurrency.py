"""`composer serve` runs jobs and streams at once (--max-concurrent): a short job is not held behind a long one,
jobs that run together share transformer calls and still give generate_video's frames, a stalled stream holds
only itself, and the queue goes by priority. A real server on 127.0.0.1 over the embedded shapes models."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from helpers import held

pytest.importorskip("fastapi", reason="composer serve needs the serve extra (fastapi, uvicorn)")
pytest.importorskip("uvicorn", reason="composer serve needs the serve extra (fastapi, uvicorn)")
from serve_support import Scripted, Server

from composer.generator import VideoGenerator
from composer.serve.app import ServeConfig
from composer.serve.requests import ServerLimits
from composer.video import read_frames

SMALL = {"num_inference_steps": 2, "num_frames": 5}


@pytest.fixture(scope="module")
def t2v():
    return VideoGenerator.from_pretrained(None, progress=False)


@pytest.fixture
def gated(t2v):
    return Scripted(t2v)  # gated prompts run with their own fields


def start(generator, tmp_path, **config) -> Server:
    srv = Server(lambda: generator, ServeConfig(output_dir=tmp_path / "serve", limits=ServerLimits(max_steps=1000),
                                                **config))
    srv.wait_ready()
    return srv


def submit(srv: Server, prompt: str, **fields) -> dict:
    reply = srv.request("POST", "/v1/videos", {"prompt": prompt, **fields})
    assert reply.status == 200, reply.body
    return reply.json


def served_frames(srv: Server, job_id: str, path) -> np.ndarray:
    reply = srv.request("GET", f"/v1/videos/{job_id}/content")
    assert reply.status == 200, reply.body
    path.write_bytes(reply.body)
    return read_frames(path)


def direct_frames(generator, path, prompt: str, **fields) -> np.ndarray:
    """generate_video's frames, alone, through the same mp4 writer as the server's."""
    generator.generate_video(prompt, output_path=str(path), **fields)
    return read_frames(path)


def metric(text: str, name: str) -> float:
    return next(float(line.split()[1]) for line in text.splitlines() if line.split(" ")[0] == name)


def wait_metric(srv: Server, name: str, value: float, timeout: float = 30) -> None:
    """Poll /metrics until `name` reads `value` (a job's thread lets go of its slot just after its record ends)."""
    deadline = time.time() + timeout
    while metric(srv.request("GET", "/metrics").body.decode(), name) != value:
        assert time.time() < deadline, f"{name} never read {value}"
        time.sleep(0.02)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


@pytest.mark.slow  # moved to the full tier: the quick tier must stay under 5 minutes
def test_a_short_job_submitted_after_a_long_one_finishes_first_with_its_solo_frames(t2v, tmp_path):
    srv = start(t2v, tmp_path)
    try:
        long = submit(srv, "a red circle moving right", seed=1, num_inference_steps=150, num_frames=9)
        srv.wait(long["id"], ("in_progress",))
        short = submit(srv, "a blue square moving left", seed=2, **SMALL)
        done_short = srv.wait(short["id"], timeout=120)
        done_long = srv.wait(long["id"], timeout=300)
        assert done_short["status"] == done_long["status"] == "completed"
        # they ran at the same time: the short one started and ended while the long one ran
        assert done_long["started_at"] < done_short["started_at"] < done_short["times"]["completed_at"] \
            < done_long["times"]["completed_at"]
        assert metric(srv.request("GET", "/metrics").body.decode(), "composer_max_concurrent") == 4
        wait_metric(srv, "composer_jobs_running", 0)
        # other latent shapes: never in one call, so each video is its solo run's, bit for bit
        np.testing.assert_array_equal(served_frames(srv, long["id"], tmp_path / "long.mp4"),
                                      direct_frames(t2v, tmp_path / "long-ref.mp4", "a red circle moving right",
                                                    seed=1, num_inference_steps=150, num_frames=9))
        np.testing.assert_array_equal(served_frames(srv, short["id"], tmp_path / "short.mp4"),
                                      direct_frames(t2v, tmp_path / "short-ref.mp4", "a blue square moving left",
                                                    seed=2, **SMALL))
    finally:
        srv.stop()


@pytest.mark.slow  # (the quick tier's served jobs sharing calls: test_text_to_video_jobs_run_as_tasks_with_no_thread_each)
def test_jobs_released_together_share_transformer_calls_and_give_their_solo_frames(gated, t2v, tmp_path):
    srv = start(gated, tmp_path)
    fields = {"num_inference_steps": 12, "num_frames": 5}
    prompts = [("gate a red circle", 1), ("gate a blue square", 2), ("gate a green triangle", 3)]
    try:
        before = metric(srv.request("GET", "/metrics").body.decode(), "composer_batched_units_total")
        jobs = [submit(srv, p, seed=s, **fields)["id"] for p, s in prompts]
        for job in jobs:  # all three hold a slot at once
            srv.wait(job, ("in_progress",))
        metrics = srv.request("GET", "/metrics").body.decode()
        assert metric(metrics, "composer_jobs_running") == 3 and metric(metrics, "composer_queue_length") == 0
        with held(t2v, 3):  # released together: their first steps share a call whatever the threads' timing
            gated.gate.set()
        done = [srv.wait(job, timeout=120) for job in jobs]
        assert [d["status"] for d in done] == ["completed"] * 3 and all(d["progress"] == 100 for d in done)
        metrics = srv.request("GET", "/metrics").body.decode()
        for name in ("composer_transformer_calls_total", "composer_scheduled_units_total",
                     "composer_batched_units_total"):
            assert f"# TYPE {name} counter" in metrics
        # the steps of jobs in step share a call: fewer calls than units
        assert metric(metrics, "composer_batched_units_total") > before
        assert metric(metrics, "composer_step_seconds_count") == 3 * 12
        # the batch size: units per call (the mean is _sum / _count), and the largest batch
        assert "# TYPE composer_batch_size summary" in metrics and "# TYPE composer_batch_size_max gauge" in metrics
        assert metric(metrics, "composer_batch_size_sum") == metric(metrics, "composer_scheduled_units_total")
        assert metric(metrics, "composer_batch_size_count") == metric(metrics, "composer_transformer_calls_total")
        assert metric(metrics, "composer_batch_size_sum") > metric(metrics, "composer_batch_size_count")
        assert metric(metrics, "composer_batch_size_max") >= 2
        for i, ((prompt, seed), job) in enumerate(zip(prompts, jobs)):
            served = served_frames(srv, job, tmp_path / f"served{i}.mp4")
            solo = direct_frames(t2v, tmp_path / f"solo{i}.mp4", prompt, seed=seed, **fields)
            # a batched call may move a value by one level (composer/engine/scheduler.py); here they were identical
            assert served.shape == solo.shape and psnr(served, solo) > 40
    finally:
        gated.gate.set()
        srv.stop()


def test_text_to_video_jobs_run_as_tasks_with_no_thread_each(t2v, tmp_path):
    """Six jobs at once (--max-concurrent 6) on a model whose requests are tasks: no job gets a thread of its own
    (only the dispatcher, the request loop and its stage threads, the finishers), their steps share calls, each job
    reports its steps' progress, and each video is generate_video's."""
    srv = start(t2v, tmp_path, max_concurrent=6)
    fields = {"num_inference_steps": 6, "num_frames": 5}
    seen: set[str] = set()
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen.update(t.name for t in threading.enumerate())
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, name="watcher")
    try:
        before = srv.request("GET", "/metrics").body.decode()
        watcher.start()
        with held(t2v, 6):  # all six queue their first step before any call: they share calls whatever the timing
            jobs = [submit(srv, f"a red circle moving {d}", seed=i, **fields)["id"]
                    for i, d in enumerate(["left", "right", "up", "down", "left", "right"])]
        done = [srv.wait(job, timeout=120) for job in jobs]
        stop.set()
        watcher.join()
        assert [d["status"] for d in done] == ["completed"] * 6 and all(d["progress"] == 100 for d in done)
        assert not [n for n in seen if n.startswith("composer-serve-job")], seen
        after = srv.request("GET", "/metrics").body.decode()
        assert "# TYPE composer_tasks_running gauge" in after and metric(after, "composer_tasks_running") == 0
        steps = metric(after, "composer_step_seconds_count") - metric(before, "composer_step_seconds_count")
        assert steps == 6 * 6
        assert metric(after, "composer_batched_units_total") > metric(before, "composer_batched_units_total")
        served = served_frames(srv, jobs[1], tmp_path / "served.mp4")
        solo = direct_frames(t2v, tmp_path / "solo.mp4", "a red circle moving right", seed=1, **fields)
        assert served.shape == solo.shape and psnr(served, solo) > 40
    finally:
        stop.set()
        srv.stop()


def test_with_one_slot_a_higher_priority_job_queued_later_starts_first(gated, tmp_path):
    srv = start(gated, tmp_path, max_concurrent=1)
    try:
        running = submit(srv, "gate running", seed=1, **SMALL)["id"]
        srv.wait(running, ("in_progress",))
        low = submit(srv, "a red circle", seed=2, **SMALL)
        high = submit(srv, "a blue square", seed=3, priority=5, **SMALL)
        also_high = submit(srv, "a green triangle", seed=4, priority=5, **SMALL)
        assert (low["priority"], high["priority"]) == (0, 5)
        metrics = srv.request("GET", "/metrics").body.decode()
        assert metric(metrics, "composer_max_concurrent") == 1 and metric(metrics, "composer_queue_length") == 3
        assert "# TYPE composer_queue_wait_seconds summary" in metrics
        assert metric(metrics, "composer_queue_wait_seconds_count") == 1  # the running job, started at once
        waited_before = metric(metrics, "composer_queue_wait_seconds_sum")
        worker = srv.app.state.composer.worker
        ahead = {name: worker.jobs_ahead(srv.app.state.composer.store.get(job["id"]))
                 for name, job in (("low", low), ("high", high), ("also_high", also_high))}
        assert ahead == {"high": 1, "also_high": 2, "low": 3}  # the running job, then by priority, then arrival
        gated.gate.set()
        done = {name: srv.wait(job["id"]) for name, job in (("low", low), ("high", high), ("also_high", also_high))}
        assert all(d["status"] == "completed" for d in done.values())
        order = sorted(done, key=lambda name: done[name]["started_at"])
        assert order == ["high", "also_high", "low"]
        metrics = srv.request("GET", "/metrics").body.decode()
        assert metric(metrics, "composer_queue_wait_seconds_count") == 4
        # the three waited behind the gated job at least: low for as long as it stood in line
        waited = metric(metrics, "composer_queue_wait_seconds_sum") - waited_before
        assert waited >= done["low"]["started_at"] - low["times"]["created_at"] - 0.05
    finally:
        gated.gate.set()
        srv.stop()


# -- a stalled stream ------------------------------------------------------------------------------------------

class Bulky:
    """The real causal generator; a stream whose prompt starts "bulky" is made by the model, but each chunk's
    frames are swapped for random 256x256 ones (big JPEGs, so a client that reads nothing fills the socket soon)."""

    def __init__(self, generator: VideoGenerator):
        self._generator = generator

    def __getattr__(self, name):
        return getattr(self._generator, name)

    def stream_video(self, prompts, **kwargs):
        stream = self._generator.stream_video(prompts, **kwargs)
        return self._bulky(stream) if prompts.prompt.startswith("bulky") else stream

    @staticmethod
    def _bulky(stream):
        rng = np.random.default_rng(0)
        pieces = iter(stream)
        try:
            for chunk in pieces:
                frames = rng.integers(0, 256, (len(chunk.frames), 256, 256, 3), dtype=np.uint8)
                yield SimpleNamespace(frames=frames, block_index=chunk.block_index, start_frame=chunk.start_frame,
                                      prompt=chunk.prompt)
        finally:
            if hasattr(pieces, "close"):  # the pipeline's request ends at once, as the worker's own close does
                pieces.close()


def holding_stream_threads() -> list[str]:
    """Threads inside the worker's stream code now (making a block, or waiting for a client)."""
    import sys

    names = {t.ident: t.name for t in threading.enumerate()}
    holding = []
    for ident, frame in sys._current_frames().items():
        while frame is not None:
            if frame.f_code.co_name in ("_stream_blocks", "_stream_next_here", "_stream_chunk"):
                holding.append(names.get(ident, str(ident)))
                break
            frame = frame.f_back
    return holding


def test_a_stalled_stream_holds_only_itself_the_other_stream_and_a_job_go_on_unwaited(tmp_path):
    """Two streams and a job at once; one stream's client reads nothing. Its stream pauses (its buffer full, its
    progress still) while the other stream and the job run to the end, and no call of theirs waits for the stalled
    one: from the moment it stalls, the step scheduler counts it out of the requests it waits a moment for (it
    used to count it in, and every call of the others settled for it)."""
    pytest.importorskip("websockets", reason="live streams need the serve extra (fastapi, uvicorn, websockets)")
    import socket

    from websockets.sync.client import connect

    causal = VideoGenerator.from_pretrained("shapes-causal", progress=False)
    scheduler, gate = causal.pipeline.engines[0].scheduler, causal.pipeline.gate
    srv = Server(lambda: Bulky(causal), ServeConfig(output_dir=tmp_path / "serve",
                                                    limits=ServerLimits(max_frames=200)))
    srv.wait_ready()
    srv.app.state.streams.stall_timeout = 300  # the client stalls; the stream must not fail during the test
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 * 1024)
    sock.connect(("127.0.0.1", srv.port))
    seen: list[tuple[int, int]] = []  # (requests holding a place, requests the scheduler waited for) at each ask

    def asked():
        counts = gate.counts()
        seen.append(counts)
        return counts[1]

    try:
        with connect(f"ws://127.0.0.1:{srv.port}/v1/streams", sock=sock, max_queue=2, open_timeout=30,
                     close_timeout=1) as ws:  # the server's close waits behind what the client never read
            ws.send(json.dumps({"prompt": "bulky red circle", "num_blocks": 40, "guidance_scale": 1.0, "seed": 5}))
            started = json.loads(ws.recv(timeout=60))
            assert started["type"] == "started"
            routes = srv.app.state.streams
            deadline = time.time() + 60
            while routes.open[started["id"]].buffered < 2 or gate.counts() != (1, 0):  # stalled, and parked
                assert time.time() < deadline, f"never stalled and parked: {gate.counts()} (running, busy)"
                time.sleep(0.05)
            stalled = srv.request("GET", f"/v1/videos/{started['id']}").json
            # while its client is behind, the stream holds no thread: its latest chunk waits with the session
            deadline = time.time() + 30
            while holding_stream_threads():
                assert time.time() < deadline, "a thread still holds the stalled stream"
                time.sleep(0.02)
            scheduler.active_requests = asked
            other: dict = {}

            def watch():  # the other stream, read as it comes
                with connect(f"ws://127.0.0.1:{srv.port}/v1/streams", open_timeout=30) as live:
                    live.send(json.dumps({"prompt": "a green triangle moving up", "num_blocks": 6,
                                          "guidance_scale": 1.0, "seed": 7}))
                    other["messages"] = [m if isinstance(m, bytes) else json.loads(m) for m in live]

            watcher = threading.Thread(target=watch)
            watcher.start()
            job = submit(srv, "a blue square moving left", seed=2, guidance_scale=1.0, num_frames=5)
            done = srv.wait(job["id"], timeout=120)
            watcher.join(timeout=120)
            assert done["status"] == "completed"
            events = [m for m in other["messages"] if isinstance(m, dict)]
            assert [e["type"] for e in events] == ["started"] + ["chunk"] * 6 + ["done"]
            assert sum(isinstance(m, bytes) for m in other["messages"]) == events[-1]["frames"] == 21
            now = srv.request("GET", f"/v1/videos/{started['id']}").json
            assert now["status"] == "in_progress" and now["progress_fraction"] == stalled["progress_fraction"] < 0.9  # still held
            assert seen and all(busy < running for running, busy in seen), seen  # the stalled one never counted
            wait_metric(srv, "composer_jobs_running", 1)  # the stalled stream
        # its connection closed while the stream waited for it: failed as stalled, not cancelled (docs/serving.md)
        ended = srv.wait(started["id"], timeout=60)
        assert ended["status"] == "failed" and "stopped reading" in str(ended.get("error")), ended
    finally:
        scheduler.active_requests = lambda: gate.busy
        srv.stop()


# -- adapter sets ------------------------------------------------------------------------------------------------

class Adapters:
    """A stand-in generator whose jobs run until the test releases them (by prompt), recording the adapters each
    one started with and every switch the worker made."""

    def __init__(self):
        self.pipeline = SimpleNamespace(concurrency="batch", engines=[])
        self.adapters = [("a.safetensors", "b.safetensors")]  # the start set: every loaded adapter
        self.switches: list = []
        self.started: dict[str, tuple] = {}
        self.release: dict[str, threading.Event] = {}

    def set_lora(self, paths, scales=None):
        self.adapters = [tuple(paths)]
        self.switches.append(tuple(paths))
        return f"LoRA: {paths}"

    def unset_lora(self):
        self.adapters = [()]
        self.switches.append(())

    def generate_video(self, prompt=None, *, cancel=None, priority=0, **kwargs):
        self.started[prompt] = self.adapters[0]
        event = self.release.setdefault(prompt, threading.Event())
        while not event.wait(0.01):
            cancel.check()
        return SimpleNamespace(frames=np.zeros((1, 16, 16, 3), np.uint8))


def test_jobs_with_the_active_adapters_run_together_and_another_set_waits_its_turn(tmp_path):
    from composer.serve.jobs import Job, JobStore
    from composer.serve.requests import LoraOption
    from composer.serve.worker import Worker

    fake = Adapters()
    store = JobStore(tmp_path / "serve")
    worker = Worker(fake, store, max_queue=8, request_timeout=None,
                    loras=[LoraOption("a", "a.safetensors", 1.0), LoraOption("b", "b.safetensors", 1.0)])
    A, B = [["a", 1.0], ["b", 1.0]], [["b", 1.0]]  # A: the start set

    def job(name, lora):
        j = Job(name, {"prompt": name, "fps": 8}, model="fake", lora=lora)
        store.add(j)
        worker.submit(j)
        return j

    def wait(j, status):
        deadline = time.time() + 30
        while j.status != status:
            assert time.time() < deadline, f"{j.id} stayed {j.status}"
            time.sleep(0.01)

    try:
        first, second = job("a1", A), job("a2", A)
        wait(first, "in_progress"), wait(second, "in_progress")  # the active set: together
        other, after = job("b1", B), job("a3", A)
        time.sleep(0.3)  # nothing may start: b1 waits for the running jobs, a3 waits behind b1 (no starvation)
        assert other.status == after.status == "queued" and fake.switches == []
        assert worker.jobs_ahead(other) == 2 and worker.jobs_ahead(after) == 3
        fake.release.setdefault("a1", threading.Event()).set()
        wait(first, "completed")
        assert other.status == "queued"  # a2 still runs on the old adapters
        fake.release.setdefault("a2", threading.Event()).set()
        wait(other, "in_progress")
        deadline = time.time() + 30
        while "b1" not in fake.started:  # in progress from its start; it calls the generator after the switch
            assert time.time() < deadline, "b1 never reached the generator"
            time.sleep(0.01)
        assert fake.started["b1"] == ("b.safetensors",) and after.status == "queued"
        fake.release.setdefault("b1", threading.Event()).set()
        wait(after, "in_progress")
        fake.release.setdefault("a3", threading.Event()).set()
        wait(after, "completed")
        both = ("a.safetensors", "b.safetensors")
        assert fake.started == {"a1": both, "a2": both, "b1": ("b.safetensors",), "a3": both}
        assert fake.switches == [("b.safetensors",), both]  # one switch each way, no more
    finally:
        for event in fake.release.values():
            event.set()
        worker.stop()


def test_how_many_jobs_run_at_once_on_one_rank_or_several():
    """--max-concurrent as asked, 4 by default; 1 for a serial pipeline (saying why when more was asked); on
    several ranks at most the call slots the ranks made (saying so)."""
    from composer.serve.worker import CONCURRENT_DEFAULT, concurrency_for

    def generator(mode, **more):
        return SimpleNamespace(pipeline=SimpleNamespace(concurrency=mode), **more)

    assert concurrency_for(generator("batch"), None) == (CONCURRENT_DEFAULT, None)
    assert concurrency_for(generator("batch"), 7) == (7, None)
    assert concurrency_for(generator("serial"), None) == (1, None)
    count, why = concurrency_for(generator("serial"), 3)
    assert count == 1 and "serially" in why
    ranks = generator("batch", world_size=2, slots=6)
    assert concurrency_for(ranks, None) == (CONCURRENT_DEFAULT, None)
    assert concurrency_for(ranks, 6) == (6, None)
    count, why = concurrency_for(ranks, 8)
    assert count == 6 and "6 jobs at once on 2 ranks" in why
