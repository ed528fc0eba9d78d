"""A served video job crosses two thread hand-offs: the server's event loop hands the body to the model's engine core
(its check, the job queued and started there) and the answer comes back; the job's steps, its video and its record
are the core's work. No dispatcher or finisher thread of the server's own takes part. A real server on 127.0.0.1
over the embedded shapes model."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("fastapi", reason="composer serve needs the serve extra (fastapi, uvicorn)")
pytest.importorskip("uvicorn", reason="composer serve needs the serve extra (fastapi, uvicorn)")
from serve_support import Server

import composer.serve.app as app_module
from composer.generator import VideoGenerator
from composer.serve.app import ServeConfig
from composer.serve.jobs import JobStore
from composer.serve.requests import ServerLimits
from composer.serve.worker import Worker

SMALL = {"num_inference_steps": 2, "num_frames": 5}


@pytest.fixture(scope="module")
def t2v():
    return VideoGenerator.from_pretrained(None, progress=False)


def test_a_served_job_touches_the_event_loop_and_the_engine_core_only(t2v, tmp_path, monkeypatch):
    touched: list[tuple[str, str]] = []  # (what, the thread it ran on), in order
    guard = threading.Lock()

    def note(what: str) -> None:
        with guard:
            touched.append((what, threading.current_thread().name))

    read_body, check_body = app_module.read_body, app_module.check_body

    async def reading(*args, **kwargs):
        note("read the body")
        return await read_body(*args, **kwargs)

    def checking(*args, **kwargs):
        note("check the body")
        return check_body(*args, **kwargs)

    monkeypatch.setattr(app_module, "read_body", reading)
    monkeypatch.setattr(app_module, "check_body", checking)
    save, update = Worker._save, JobStore.update

    def saving(self, job, result):
        note("write the video")
        return save(self, job, result)

    def updating(self, job, persist=True, **changes):
        if "status" in changes:
            note(f"record {changes['status']}")
        return update(self, job, persist, **changes)

    monkeypatch.setattr(Worker, "_save", saving)
    monkeypatch.setattr(JobStore, "update", updating)

    class Steps:
        def before_step(self, info):
            note("a step")

    spy = Steps()
    engine = t2v.pipeline.engines[0]
    engine.add_hook(spy)
    srv = Server(lambda: t2v, ServeConfig(output_dir=tmp_path / "serve", limits=ServerLimits(max_steps=1000)))
    try:
        srv.wait_ready()
        reply = srv.request("POST", "/v1/videos", {"prompt": "a red circle", "seed": 1, **SMALL})
        assert reply.status == 200 and reply.json["status"] == "queued", reply.body
        job = srv.wait(reply.json["id"])
        assert job["status"] == "completed", job
        names = {t.name for t in threading.enumerate()}
    finally:
        srv.stop()
        engine.hooks.remove(spy)

    whats = [what for what, _ in touched]
    assert whats[:2] == ["read the body", "check the body"], touched
    assert {"a step", "write the video", "record completed"} <= set(whats), touched
    loop = touched[0][1]  # the event loop's thread: the route reads the body there
    core = {name for _, name in touched[1:]}
    assert loop not in core, touched  # everything after the body was read ran off the event loop ...
    assert all(name.startswith("composer-core") for name in core), touched  # ... on the engine core's threads
    # 2 hand-offs: event loop -> core (the check, the job queued and started) -> event loop (the answer, awaited
    # there); the server has no dispatcher or finisher threads of its own
    assert not any(n.startswith(("composer-serve-dispatch", "composer-serve-finish")) for n in names), names
