"""torch's CPU threads (RuntimeArgs.threads, `--threads` on `composer generate` and `composer serve`): the option sets
torch's intra-op thread count; unset on the CPU, it is the usable cores divided by the runs sharing them (1 for a
generator, --max-concurrent for a server), at least 1; an OMP_NUM_THREADS in the environment is left alone."""

from __future__ import annotations

import os
import threading

import pytest
import torch

import composer.runtime as runtime_module
from composer import VideoGenerator
from composer.cli.main import build_parser
from composer.errors import ConfigError
from composer.runtime import RuntimeArgs, apply_threads, default_threads, usable_cpus


def seen_by_a_new_thread() -> int:
    """torch's thread count in a thread started now (a job's, the request loop's): torch applies the count last set
    to a thread when it first runs an operation, while a thread that ran one keeps its own."""
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


@pytest.fixture
def threads_restored(monkeypatch):
    before = torch.get_num_threads()
    yield monkeypatch
    torch.set_num_threads(before)


def test_the_option_sets_torchs_thread_count(threads_restored):
    VideoGenerator.from_pretrained(None, threads=3, progress=False)  # an OMP_NUM_THREADS does not override it
    assert torch.get_num_threads() == seen_by_a_new_thread() == 3
    VideoGenerator.from_pretrained(None, threads=1, progress=False)
    assert torch.get_num_threads() == seen_by_a_new_thread() == 1


def test_unset_on_the_cpu_it_is_the_usable_cores_divided_by_the_runs(threads_restored):
    monkeypatch = threads_restored
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(runtime_module, "usable_cpus", lambda: 6)
    VideoGenerator.from_pretrained(None, device="cpu", progress=False)
    assert seen_by_a_new_thread() == 6  # one run: every usable core
    cpu = RuntimeArgs.from_kwargs(device="cpu")
    assert [apply_threads(cpu, runs) for runs in (2, 4, 6, 12)] == [3, 1, 1, 1]  # at least 1
    assert seen_by_a_new_thread() == 1
    assert default_threads(3) == 2


def test_a_server_divides_the_cores_by_its_max_concurrent(threads_restored, tmp_path):
    pytest.importorskip("fastapi", reason="composer serve needs the serve extra")
    from serve_support import Server

    from composer.serve.app import ServeConfig

    monkeypatch = threads_restored
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(runtime_module, "usable_cpus", lambda: 8)
    srv = Server(lambda: VideoGenerator.from_pretrained(None, device="cpu", progress=False),
                 ServeConfig(output_dir=tmp_path, max_concurrent=4))
    try:
        srv.wait_ready()  # (the model loads on a thread of its own: its jobs' threads are started after)
        assert seen_by_a_new_thread() == 2
    finally:
        srv.stop()


def test_an_omp_num_threads_in_the_environment_is_left_alone(threads_restored):
    monkeypatch = threads_restored
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    monkeypatch.setattr(runtime_module, "usable_cpus", lambda: 6)
    assert apply_threads(RuntimeArgs.from_kwargs(device="cpu")) is None and seen_by_a_new_thread() == 1


def test_the_usable_cores_follow_the_affinity_mask(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 5}, raising=False)
    assert 1 <= usable_cpus() <= 3  # 3, or less under a cgroup CPU quota


def test_the_flag_is_on_generate_and_serve_and_checked():
    parser = build_parser()
    for verb in ("generate", "serve"):
        args, _ = parser.parse_known_args([verb, "--threads", "2"])
        assert args.threads == "2" and "threads" in args._runtime_names  # a runtime option, coerced with the others
    with pytest.raises(ConfigError, match="threads = 0: expected a positive integer"):
        RuntimeArgs.from_kwargs(threads=0)
