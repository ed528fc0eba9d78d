"""`VideoGenerator.from_pretrained(..., num_gpus=2)` outside a launch: two worker processes (gloo on CPU), on the
rank protocol of composer/parallel/ranks.py, run every request and equal one process; bad input is raised and loses
nothing; a rank that fails alone gives a WorkerError naming it and the workers go on; a rank that dies gives a
WorkerError naming it within a bounded time and stops them all; no worker process is ever left behind."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import threading
import time

import numpy as np
import pytest
import torch

from composer import VideoGenerator
from composer.errors import ConfigError, InvalidInputError, UnsupportedError, WorkerError
from composer.parallel.workers import WorkerVideoGenerator
from composer.runtime import RuntimeArgs
from composer.testing import build_tiny_wan

# 48 x 80 pixels -> 3 x 5 = 15 tokens a frame: divides by neither rank count
REQUEST = dict(prompt="a red ball moves left", negative_prompt="blurry", height=48, width=80, num_frames=9,
               num_inference_steps=3, guidance_scale=5.0, seed=1234)
RUNTIME = dict(dtype="fp32", progress=False)
BOUND_S = 30  # a failure is reported within this (grace period 2 s, the model's steps take well under 1 s)


@pytest.fixture(scope="module")
def wan4_dir(tmp_path_factory):
    return build_tiny_wan(tmp_path_factory.mktemp("models") / "tiny-wan-4h", num_heads=4, head_dim=16, seed=3)


@pytest.fixture(scope="module")
def single(wan4_dir, one_thread):
    return VideoGenerator.from_pretrained(wan4_dir, **RUNTIME)


@pytest.fixture(scope="module")
def reference(single):
    return single.generate_video(**REQUEST)


@pytest.fixture(scope="module")
def workers(wan4_dir):
    gen = VideoGenerator.from_pretrained(wan4_dir, num_gpus=2, **RUNTIME)
    yield gen
    gen.close()


@pytest.fixture(autouse=True)
def no_children_left():
    before = {p.pid for p in _live_workers()}  # the module's shared generator may be running
    yield
    assert {p.pid for p in _live_workers()} <= before, "a test left worker processes behind"


def _live_workers():
    return [p for p in multiprocessing.active_children() if p.name.startswith("composer-rank")]


def _start(folder, worker_setup=None, grace_s=2.0, **runtime):
    kwargs = dict(RUNTIME, num_gpus=2, **runtime)
    gen = WorkerVideoGenerator.start(str(folder), RuntimeArgs.from_kwargs(**kwargs), kwargs,
                                     worker_setup=worker_setup)
    gen.failure_grace_s = grace_s
    return gen


def _assert_gone(pids):
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        raise AssertionError(f"worker {pid} is still running")


# worker_setup hooks: run in each worker before it loads (importable, so spawned workers can unpickle them)

def fail_once_on_rank1(rank: int, world_size: int) -> None:
    """Rank 1's latent preparation raises, the first time only; rank 0 meets its failure at the first step's sync
    point (before any all-to-all)."""
    if rank == 1:
        from composer.stages.latents import LatentPreparationStage

        original = LatentPreparationStage.forward
        calls = []

        def broken(self, batch):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("injected failure on rank 1")
            return original(self, batch)

        LatentPreparationStage.forward = broken


def stall_on_rank1(rank: int, world_size: int) -> None:
    """Rank 1 stalls before denoising (so the test can kill it in the middle of a request)."""
    if rank == 1:
        from composer.stages.latents import LatentPreparationStage

        original = LatentPreparationStage.forward

        def slow(self, batch):
            time.sleep(60)
            return original(self, batch)

        LatentPreparationStage.forward = slow


# ------------------------------------------------------------------------------------------------ tests

def test_two_workers_equal_one_process_and_write_once(workers, reference, tmp_path):
    out = tmp_path / "video.mp4"
    result = workers.generate_video(**REQUEST, output_path=str(out))
    torch.testing.assert_close(result.latents, reference.latents, atol=1e-5, rtol=0)
    assert np.abs(result.frames.astype(int) - reference.frames.astype(int)).max() <= 1
    assert result.output_path == out and out.is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["video.mp4"]  # one file, no second writer's leftovers
    again = workers.generate_video(**REQUEST)  # the generator serves the next request
    torch.testing.assert_close(again.latents, reference.latents, atol=1e-5, rtol=0)
    assert pickle.loads(pickle.dumps(again)).seed == REQUEST["seed"]


def test_api_parity(workers):
    assert workers.sampling_param(height=64).height == 64
    assert workers.default_sampling.num_inference_steps > 0 and workers.family
    assert len(workers.worker_pids) == 2 and os.getpid() not in workers.worker_pids
    results = workers.generate_video(["one", "two"], **{k: v for k, v in REQUEST.items() if k != "prompt"})
    assert [r.seed for r in results] == [REQUEST["seed"], REQUEST["seed"] + 1]
    with pytest.raises(UnsupportedError, match="torchrun"):
        workers.stream_video("a cat")
    from composer.cancel import CancelToken

    with pytest.raises(UnsupportedError, match="cancel"):
        workers.generate_video(**REQUEST, cancel=CancelToken())


@pytest.mark.slow
def test_calls_from_threads_run_at_once_and_each_equals_its_solo_run(workers, single):
    """Three requests of different seeds and one bad request from four threads: the workers run them at once
    (rank 0 plans their batched steps on both ranks); each good one equals its run alone in one process, the bad
    one raises what one process raises."""
    seeds = (5, 6, 7)
    expected = {seed: single.generate_video(**{**REQUEST, "seed": seed}).latents for seed in seeds}
    got: dict = {}

    def run(name, request):
        try:
            got[name] = workers.generate_video(**request)
        except Exception as exc:  # noqa: BLE001 - checked below
            got[name] = exc

    threads = [threading.Thread(target=run, args=(seed, {**REQUEST, "seed": seed})) for seed in seeds]
    threads.append(threading.Thread(target=run, args=("bad", {**REQUEST, "height": 50})))
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for seed in seeds:
        assert not isinstance(got[seed], Exception), got[seed]
        torch.testing.assert_close(got[seed].latents, expected[seed], atol=1e-5, rtol=0)
        assert got[seed].seed == seed
    assert isinstance(got["bad"], InvalidInputError)
    assert not workers.closed


@pytest.mark.parametrize("bad", [dict(height=50), dict(num_inference_steps=-1)], ids=["height", "steps"])
def test_bad_input_raises_like_one_process_and_loses_nothing(bad, workers, single, reference):
    with pytest.raises(Exception) as expected:
        single.generate_video(**{**REQUEST, **bad})
    with pytest.raises(InvalidInputError) as got:
        workers.generate_video(**{**REQUEST, **bad})
    assert type(got.value) is type(expected.value) and str(got.value) == str(expected.value)
    result = workers.generate_video(**REQUEST)
    torch.testing.assert_close(result.latents, reference.latents, atol=1e-5, rtol=0)


def test_lora_switch_reaches_every_rank(workers, single, reference, tmp_path):
    from test_lora import lora_weights, write_lora

    from composer.errors import ModelNotFoundError

    lora = write_lora(tmp_path / "lora.safetensors", "original",
                      lora_weights(single.pipeline.modules["transformer"], seed=1))
    single.set_lora(lora)
    expected = single.generate_video(**REQUEST)
    single.unset_lora()
    with pytest.raises(ModelNotFoundError, match="does not exist"):  # on every rank alike: the workers go on
        workers.set_lora(tmp_path / "nowhere.safetensors")
    assert "lora.safetensors" in workers.set_lora(lora)
    torch.testing.assert_close(workers.generate_video(**REQUEST).latents, expected.latents, atol=1e-5, rtol=0)
    workers.unset_lora()
    torch.testing.assert_close(workers.generate_video(**REQUEST).latents, reference.latents, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_worker_killed_between_requests(wan4_dir):
    gen = _start(wan4_dir)
    pids = gen.worker_pids
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 of 2 .*SIGKILL") as info:
        gen.generate_video(**REQUEST)
    assert time.monotonic() - start < BOUND_S and info.value.rank == 1
    _assert_gone(pids)
    with pytest.raises(WorkerError, match="stopped"):
        gen.generate_video(**REQUEST)
    gen.close()  # idempotent after a failure


@pytest.mark.slow
def test_worker_killed_during_request(wan4_dir):
    gen = _start(wan4_dir, worker_setup=stall_on_rank1)
    pids = gen.worker_pids
    threading.Timer(2.0, os.kill, (pids[1], signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 of 2 .*SIGKILL"):
        gen.generate_video(**REQUEST)
    assert time.monotonic() - start < BOUND_S
    _assert_gone(pids)


@pytest.mark.slow
def test_a_failure_on_one_rank_names_it_and_the_workers_go_on(wan4_dir, reference):
    with _start(wan4_dir, worker_setup=fail_once_on_rank1) as gen:
        start = time.monotonic()
        with pytest.raises(WorkerError, match=r"failed on 1 of 2 ranks \(rank 1: RuntimeError: injected") as info:
            gen.generate_video(**REQUEST)
        assert time.monotonic() - start < BOUND_S and info.value.rank == 1
        assert "every rank is ready for the next request" in str(info.value)
        assert not gen.closed
        # the ranks left the call together and are together again: the next request is one process's
        torch.testing.assert_close(gen.generate_video(**REQUEST).latents, reference.latents, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_a_taken_port_is_retried(wan4_dir, monkeypatch):
    import socket

    from composer.parallel import workers as workers_module

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    real = workers_module._free_port
    monkeypatch.setattr(workers_module, "_free_port", lambda: next(ports, None) or real())
    try:
        with _start(wan4_dir) as gen:
            assert gen.generate_video(**REQUEST).frames.shape[0] == REQUEST["num_frames"]
        assert next(ports, None) is None  # the taken port was tried first
    finally:
        taken.close()


@pytest.mark.slow
def test_load_error_is_raised_and_leaves_no_process(tmp_path):
    folder = build_tiny_wan(tmp_path / "tiny-wan-3h", num_heads=3, head_dim=16)
    before = set(_live_workers())
    with pytest.raises(ConfigError, match="ulysses_degree 2 does not divide"):
        VideoGenerator.from_pretrained(folder, num_gpus=2, **RUNTIME)
    assert set(_live_workers()) == before


def test_bad_degrees_fail_before_any_process(wan4_dir):
    before = multiprocessing.active_children()
    with pytest.raises(ConfigError, match="num_gpus = 3"):
        VideoGenerator.from_pretrained(wan4_dir, num_gpus=3, ulysses_degree=2, **RUNTIME)
    assert multiprocessing.active_children() == before


@pytest.mark.slow  # moved to the full tier: the quick tier must stay under 5 minutes
def test_context_manager_and_close_leave_no_process(wan4_dir):
    with VideoGenerator.from_pretrained(wan4_dir, num_gpus=2, **RUNTIME) as gen:
        pids = gen.worker_pids
        assert {p.pid for p in _live_workers()} >= set(pids)
    _assert_gone(pids)
    assert gen.closed
    gen.close()  # idempotent
    with pytest.raises(WorkerError, match="close"):
        gen.generate_video(**REQUEST)


EXIT_SCRIPT = """
import gc
import os
import sys

from composer import VideoGenerator

if __name__ == "__main__":
    gen = VideoGenerator.from_pretrained(sys.argv[1], num_gpus=2, dtype="fp32", progress=False)
    pids = gen.worker_pids
    del gen
    gc.collect()
    for pid in pids:  # garbage-collected: its workers were stopped and reaped
        try:
            os.kill(pid, 0)
            sys.exit(f"worker {pid} outlived its generator")
        except ProcessLookupError:
            pass
    gen = VideoGenerator.from_pretrained(sys.argv[1], num_gpus=2, dtype="fp32", progress=False)
    print(" ".join(map(str, gen.worker_pids)), flush=True)
    # no close(): interpreter exit stops the workers
"""


@pytest.mark.slow
def test_garbage_collection_and_interpreter_exit_stop_the_workers(wan4_dir, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "leave.py"
    script.write_text(EXIT_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), COMPOSER_LOG_LEVEL="WARNING")
    done = subprocess.run([sys.executable, str(script), str(wan4_dir)], env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr
    _assert_gone(int(pid) for pid in done.stdout.split())
