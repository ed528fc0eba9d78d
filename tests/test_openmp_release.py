"""An idle thread gives its OpenMP workers back (composer/platform/openmp.py): libgomp throttles every team's
spinning while the process holds more workers than CPUs, so the engine core's threads and the callers that only wait
on it free theirs. Here: the call frees exactly the calling thread's team, and one request's threads each call it
where they go idle (the caller before it waits, the stage and decode lanes after their work, the core before it
sleeps)."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import composer.engine.batcher as batcher_module
import composer.engine.core as core_module
from composer import VideoGenerator
from composer.platform import openmp


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_release_frees_the_calling_threads_openmp_workers_only(two_threads):
    if openmp.runtime_name() is None:
        pytest.skip("torch's OpenMP runtime here is not libgomp: nothing to release")
    x = torch.randn(64, 256, 256)
    seen = {}

    def work():
        base = _os_threads()
        (x * 2).sum()  # a parallel region: this thread's team starts one worker (2 threads per operation)
        seen["with_team"] = _os_threads() - base
        seen["released"] = openmp.release_workers()
        seen["after"] = _os_threads() - base
        (x * 2).sum()  # computing again makes a new team: still correct
        seen["again"] = _os_threads() - base
        openmp.release_workers()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen == {"with_team": 1, "released": True, "after": 0, "again": 1}


def test_one_requests_threads_release_their_teams_where_they_go_idle(tiny_wan_dir, monkeypatch):
    calls: list[str] = []
    core_idle = threading.Event()

    def record() -> bool:
        name = threading.current_thread().name
        calls.append(name)
        if name == "composer-core":
            core_idle.set()
        return True

    monkeypatch.setattr(core_module, "release_workers", record)
    monkeypatch.setattr(batcher_module, "release_workers", record)
    gen = VideoGenerator.from_pretrained(tiny_wan_dir, progress=False)
    assert gen.pipeline.runs_tasks
    gen.generate_video("a red ball", seed=1, num_inference_steps=2, num_frames=5, height=32, width=32)
    assert core_idle.wait(30), "the core never went idle after the request"
    caller = threading.current_thread().name
    assert caller in calls  # before it waited on the core
    assert any(n.startswith("composer-core-stage") for n in calls)  # text encoding and the other stages' work
    assert any(n.startswith("composer-core-side") for n in calls)  # the VAE decode on the side lane
    gen.core.close()
