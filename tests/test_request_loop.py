"""Requests as tasks (composer/engine/loop.py): `submit_video` / `agenerate_video` run text-to-video requests on the
generator's request loop. No thread waits for a request between its steps; their steps share transformer calls with
each other's and with threads' `generate_video` calls; each video equals its solo run; a cancelled or failing request
ends alone; priorities order the steps; pipelines whose requests cannot be tasks run each on a thread."""

from __future__ import annotations

import asyncio
import threading
import time
from multiprocessing.pool import ThreadPool

import numpy as np
import pytest
import torch
from helpers import held, until

from composer import VideoGenerator
from composer.admission import AdmissionQueue
from composer.cancel import CancelToken
from composer.engine.core import EngineCore
from composer.engine.loop import Admit, Blocking, drive, wait_for
from composer.engine.scheduler import RequestContext
from composer.errors import Cancelled, InvalidInputError

KW = dict(num_inference_steps=3, num_frames=9, height=64, width=64)
STEPS = KW["num_inference_steps"]


class CallCounter:
    def __init__(self, module: torch.nn.Module):
        self.calls = 0
        module.register_forward_pre_hook(self)

    def __call__(self, module, args):
        self.calls += 1


@pytest.fixture(scope="module")
def gen(tiny_wan_dir, one_thread):
    # one stage thread: requests outnumber the threads the loop has
    generator = VideoGenerator.from_pretrained(tiny_wan_dir, progress=False, stage_threads=1)
    return generator, CallCounter(generator.pipeline.modules["transformer"])


@pytest.fixture(scope="module")
def solo(gen):
    generator, _ = gen
    return {i: generator.generate_video(f"prompt {i}", seed=i, **KW) for i in range(6)}


def assert_same(got, want):
    assert got.frames.shape == want.frames.shape
    assert np.abs(got.frames.astype(np.int16) - want.frames.astype(np.int16)).max() <= 1
    assert (got.latents - want.latents).abs().max().item() <= 1e-5


def test_submitted_requests_equal_their_solo_runs_and_share_calls(gen, solo):
    generator, counter = gen
    assert generator.pipeline.runs_tasks
    counter.calls = 0
    with held(generator, 6):
        futures = {i: generator.submit_video(f"prompt {i}", seed=i, **KW) for i in range(6)}
    results = {i: f.result(timeout=300) for i, f in futures.items()}
    for i, result in results.items():
        assert_same(result, solo[i])
        assert result.seed == i
    assert counter.calls < 6 * STEPS  # steps of different requests shared calls


def test_requests_waiting_between_steps_hold_no_thread(gen, solo):
    """Six requests on a loop with one stage thread: besides the caller, only the loop's thread and its one stage
    thread exist while they run, yet their steps still batch (they were all waiting at once, on no thread)."""
    generator, counter = gen
    before = {t.ident for t in threading.enumerate()}
    seen: set[str] = set()
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen.update(t.name for t in threading.enumerate() if t.ident not in before)
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, name="watcher")
    watcher.start()
    counter.calls = 0
    try:
        with held(generator, 6):
            futures = [generator.submit_video(f"prompt {i}", seed=i, **KW) for i in range(6)]
        results = [f.result(timeout=300) for f in futures]
    finally:
        stop.set()
        watcher.join()
    for i, result in enumerate(results):
        assert_same(result, solo[i])
    assert counter.calls < 6 * STEPS
    assert seen - {"watcher"} <= {"composer-loop", "composer-loop-stage_0"}, seen


def test_tasks_and_threads_share_calls_and_stay_exact(gen, solo):
    generator, counter = gen
    counter.calls = 0
    got = {}
    thread = threading.Thread(target=lambda: got.setdefault(2, generator.generate_video("prompt 2", seed=2, **KW)))
    with held(generator, 3):
        futures = [generator.submit_video(f"prompt {i}", seed=i, **KW) for i in (0, 1)]
        thread.start()
    thread.join(timeout=300)
    results = [f.result(timeout=300) for f in futures]
    assert_same(results[0], solo[0])
    assert_same(results[1], solo[1])
    assert_same(got[2], solo[2])
    assert counter.calls < 3 * STEPS


def test_agenerate_video_awaits_together(gen, solo):
    generator, counter = gen
    counter.calls = 0

    async def main():
        with held(generator, 3):  # all three queue their first step before any call runs
            tasks = [asyncio.ensure_future(generator.agenerate_video(f"prompt {i}", seed=i, **KW)) for i in range(3)]
            scheduler = generator.pipeline.engines[0].scheduler
            assert await asyncio.to_thread(scheduler.wait_for_units, 3, 120)
        return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    for i, result in enumerate(results):
        assert_same(result, solo[i])
    assert counter.calls < 3 * STEPS


def test_bad_input_raises_at_submit(gen):
    generator, _ = gen
    with pytest.raises(InvalidInputError):
        generator.submit_video("a cat", num_frames=0)
    with pytest.raises(InvalidInputError):
        generator.submit_video("a cat", priority="high")


def test_a_cancelled_request_ends_alone(gen, solo):
    generator, _ = gen
    token = CancelToken()
    engine = generator.pipeline.engines[0]

    class CancelAtStep1:
        def after_step(self, info):
            from composer.engine.scheduler import current_request

            request = current_request()
            if request is not None and request.cancel is token and info.index == 0:
                token.cancel("test")

    hook = CancelAtStep1()
    engine.add_hook(hook)
    try:
        futures = [generator.submit_video(f"prompt {i}", seed=i, **KW) for i in (0, 1)]
        doomed = generator.submit_video("prompt 5", seed=5, cancel=token, **KW)
        with pytest.raises(Cancelled):
            doomed.result(timeout=300)
        results = [f.result(timeout=300) for f in futures]
    finally:
        engine.hooks.remove(hook)
    assert_same(results[0], solo[0])
    assert_same(results[1], solo[1])
    # the generator goes on
    assert_same(generator.submit_video("prompt 5", seed=5, **KW).result(timeout=300), solo[5])


def test_a_failing_request_fails_alone(gen, solo, monkeypatch):
    generator, _ = gen
    stage = generator.pipeline.stage("DecodingStage")
    forward = stage.forward

    def failing(batch):
        if batch.prompt == ["boom"]:
            raise RuntimeError("decode failed for this request")
        return forward(batch)

    monkeypatch.setattr(stage, "forward", failing)
    futures = [generator.submit_video(f"prompt {i}", seed=i, **KW) for i in (0, 1)]
    bad = generator.submit_video("boom", seed=3, **KW)
    with pytest.raises(RuntimeError, match="decode failed"):
        bad.result(timeout=300)
    for i, future in zip((0, 1), futures):
        assert_same(future.result(timeout=300), solo[i])


def test_higher_priority_request_finishes_first(gen):
    """Two requests that cannot share a call (different sizes): the later, higher-priority one gets each call
    first and so ends first; the low-priority one is still exact."""
    generator, _ = gen
    slow = dict(num_inference_steps=60, num_frames=9, height=64, width=64)
    alone = generator.generate_video("slow", seed=7, **slow)
    order: list[str] = []
    low = generator.submit_video("slow", seed=7, **slow)
    low.add_done_callback(lambda f: order.append("low"))
    high = generator.submit_video("fast", seed=8, num_inference_steps=3, num_frames=9, height=96, width=96,
                                  priority=5)
    high.add_done_callback(lambda f: order.append("high"))
    high.result(timeout=300)
    assert_same(low.result(timeout=300), alone)
    assert order == ["high", "low"]


def test_prompt_lists_and_output_files(gen, solo, tmp_path):
    generator, _ = gen
    results = generator.submit_video(["prompt 0", "prompt 1"], seed=0, output_path=str(tmp_path / "clip.mp4"),
                                     **KW).result(timeout=300)
    assert [r.seed for r in results] == [0, 1]
    assert_same(results[0], solo[0])
    assert_same(results[1], solo[1])
    assert all(r.output_path and r.output_path.exists() for r in results)


def test_whole_videos_of_a_causal_model_run_as_tasks(tiny_causal_dir, one_thread):
    generator = VideoGenerator.from_pretrained(tiny_causal_dir, progress=False)
    assert generator.pipeline.runs_tasks
    want = {s: generator.generate_video("a cat", seed=s, num_frames=13, height=64, width=64) for s in (3, 4)}
    futures = {s: generator.submit_video("a cat", seed=s, num_frames=13, height=64, width=64) for s in (3, 4)}
    for s, future in futures.items():
        got = future.result(timeout=300)
        assert np.abs(got.frames.astype(np.int16) - want[s].frames.astype(np.int16)).max() <= 1


def test_a_serial_pipelines_requests_are_tasks_one_at_a_time(tiny_wan_dir, one_thread):
    """Model offload runs requests one at a time: they are tasks on the engine core all the same (the core runs the
    running one's steps itself, there being no step scheduler); the others wait for their place in the gate's queue
    holding no thread, and each video is the one a call alone makes."""
    generator = VideoGenerator.from_pretrained(tiny_wan_dir, progress=False, offload="model")
    assert generator.pipeline.concurrency == "serial" and generator.pipeline.runs_tasks
    want = {seed: generator.generate_video("a cat", seed=seed, **KW) for seed in (3, 4, 5)}
    gate, threads = generator.pipeline.gate, len(threading.enumerate())
    cancel = CancelToken()
    with gate.exclusive("a test"):  # nobody may start: the tasks queue for their places
        futures = {seed: generator.submit_video("a cat", seed=seed, **KW) for seed in (3, 4, 5)}
        doomed = generator.submit_video("a dog", seed=6, cancel=cancel, **KW)
        assert until(lambda: gate.waiting == 4)
        assert len(threading.enumerate()) == threads  # the waiting requests hold no thread
        cancel.cancel()  # a queued request's cancel ends its wait at once, its place never taken
        with pytest.raises(Cancelled):
            doomed.result(timeout=30)
        assert gate.waiting == 3
    for seed, future in futures.items():
        assert np.array_equal(future.result(timeout=300).frames, want[seed].frames)
    assert gate.running == 0


def test_a_wait_raises_its_error_where_the_task_reads_it():
    log = []

    def task():
        work = Blocking(lambda: 1 / 0)
        yield work
        try:
            work.outcome()
        except ZeroDivisionError:
            log.append("caught")
        value = yield from wait_for(Blocking(lambda: 41))
        return value + 1

    assert drive(task()) == 42
    assert log == ["caught"]
    loop = EngineCore(lambda: [], stage_threads=1)
    assert loop.submit(task(), RequestContext()).result(timeout=30) == 42
    assert log == ["caught", "caught"]
    loop.close()


def test_a_loop_refuses_what_it_cannot_wait_for():
    loop = EngineCore(lambda: [], stage_threads=1)

    def task():
        yield "nothing"

    future = loop.submit(task(), RequestContext())
    with pytest.raises(TypeError, match="expected a Wait"):
        future.result(timeout=30)

    loop.close()
    with pytest.raises(RuntimeError, match="closed"):
        loop.submit(task(), RequestContext())



class Tokens(AdmissionQueue):
    """A test queue: `capacity` tokens; a ticket's need is how many it takes."""

    def __init__(self, capacity: int):
        super().__init__()
        self.free = capacity

    def _grant(self, ticket):
        if ticket.need > self.free:
            return None
        self.free -= ticket.need
        return ticket.need

    def give_back(self, n: int) -> None:
        with self._cv:
            self.free += n
            self._notify()


def test_tasks_waiting_for_admission_hold_no_thread_and_go_in_priority_order():
    """Tasks yield `Admit` on a queue with one token: the engine core holds their tickets (no thread waits for
    them), grants them in priority then arrival order as the token comes back, and a cancelled waiting task ends
    with Cancelled, its ticket withdrawn, without blocking the others."""
    queue, core, order = Tokens(1), EngineCore(lambda: [], stage_threads=1), []
    release = {name: threading.Event() for name in "abcde"}

    def task(name, priority, cancel=None):
        got = yield from wait_for(Admit(queue, 1, priority, cancel))
        order.append(name)
        yield from wait_for(Blocking(lambda: release[name].wait(30)))  # holds the token (and the stage thread)
        queue.give_back(got)
        return name

    first = core.submit(task("a", 0), RequestContext())
    assert until(lambda: order == ["a"])
    cancel = CancelToken()
    futures = {"b": core.submit(task("b", 0), RequestContext()),
               "c": core.submit(task("c", 5), RequestContext(priority=5)),
               "d": core.submit(task("d", 0, cancel), RequestContext(cancel=cancel)),
               "e": core.submit(task("e", 0), RequestContext())}
    assert until(lambda: queue.waiting == 4)
    assert len(core._pool._threads) == 1  # the one stage thread, a's: the four waiting tasks hold no thread
    cancel.cancel()
    with pytest.raises(Cancelled):
        futures["d"].result(timeout=30)
    assert queue.waiting == 3
    for name in "acbe":
        release[name].set()
    assert first.result(timeout=30) == "a" and [futures[n].result(timeout=30) for n in "cbe"] == ["c", "b", "e"]
    assert order == ["a", "c", "b", "e"] and queue.free == 1
    release["f"] = threading.Event()
    release["f"].set()
    assert drive(task("f", 0)) == "f" and queue.free == 1  # on a thread (drive), the thread itself waits
    core.close()


def test_stage_threads_must_be_a_positive_integer():
    from composer.errors import ConfigError
    from composer.runtime import RuntimeArgs

    for bad in (0, -2):
        with pytest.raises(ConfigError, match="stage_threads"):
            RuntimeArgs.from_kwargs(stage_threads=bad)
    assert RuntimeArgs.from_kwargs(stage_threads=2).stage_threads == 2


# -- causal streams as tasks: each chunk made on the loop, no thread held between the passes of a block ----------

STREAM = dict(num_frames=13, height=64, width=64)


@pytest.fixture(scope="module")
def causal(tiny_causal_dir, one_thread):
    generator = VideoGenerator.from_pretrained(tiny_causal_dir, progress=False, stage_threads=1)
    return generator, CallCounter(generator.pipeline.modules["transformer"])


@pytest.fixture(scope="module")
def solo_streams(causal):
    generator, _ = causal
    return {i: np.concatenate([c.frames for c in generator.stream_video(f"prompt {i}", seed=i, **STREAM)])
            for i in range(3)}


def read_as_tasks(generator, stream) -> np.ndarray:
    chunks = []
    while (chunk := generator.core.submit(stream.next_task(), stream.context).result(timeout=300)) is not None:
        chunks.append(chunk.frames)
    return np.concatenate(chunks)


def test_streams_read_as_tasks_equal_their_solo_streams_with_shared_calls(causal, solo_streams):
    generator, counter = causal
    assert generator.pipeline.streams_as_tasks
    counter.calls = 0
    list(generator.stream_video("prompt 0", seed=0, **STREAM))
    one_stream = counter.calls  # one stream's transformer calls
    streams = [generator.stream_video(f"prompt {i}", seed=i, **STREAM) for i in range(3)]
    counter.calls = 0
    with ThreadPool(3) as pool:  # three readers, each waiting on its futures; the chunks are made on the loop
        with held(generator, 3):
            pending = pool.map_async(lambda s: read_as_tasks(generator, s), streams)
        frames = pending.get(timeout=300)
    for i, got in enumerate(frames):
        want = solo_streams[i]
        assert got.shape == want.shape
        assert np.abs(got.astype(np.int16) - want.astype(np.int16)).max() <= 1
    assert counter.calls < 3 * one_stream  # the streams' passes shared calls
    assert all(s.stats.frames == STREAM["num_frames"] for s in streams)


def test_astream_video_runs_its_chunks_on_the_loop(causal, solo_streams):
    generator, _ = causal

    async def read(i):
        return np.concatenate([c.frames async for c in generator.astream_video(f"prompt {i}", seed=i, **STREAM)])

    async def main():
        return await asyncio.gather(*(read(i) for i in range(2)))

    for i, got in enumerate(asyncio.run(main())):
        assert np.abs(got.astype(np.int16) - solo_streams[i].astype(np.int16)).max() <= 1


def test_a_cancelled_stream_task_ends_alone(causal, solo_streams):
    generator, _ = causal
    token = CancelToken()
    doomed = generator.stream_video("prompt 2", seed=2, cancel=token, **STREAM)
    other = generator.stream_video("prompt 1", seed=1, **STREAM)
    first = generator.core.submit(doomed.next_task(), doomed.context).result(timeout=300)
    assert first is not None
    token.cancel("test")
    with pytest.raises(Cancelled):
        while generator.core.submit(doomed.next_task(), doomed.context).result(timeout=300) is not None:
            pass
    got = read_as_tasks(generator, other)
    assert np.abs(got.astype(np.int16) - solo_streams[1].astype(np.int16)).max() <= 1


def test_session_extends_as_tasks_continue_as_the_linear_stream(causal):
    generator, _ = causal
    want = np.concatenate([c.frames for c in generator.stream_video([("a cat", 2), ("a dog", 1)], seed=4,
                                                                     height=64, width=64)])
    session = generator.open_session(seed=4, height=64, width=64)
    first = generator.core.submit(session.extend_task("a cat", 2), session.context).result(timeout=300)
    second = list(session.extend("a dog", 1))  # a blocking extend after a task's: the same stream goes on
    got = np.concatenate([c.frames for c in first + second])
    assert session.blocks == 3
    assert np.abs(got.astype(np.int16) - want.astype(np.int16)).max() <= 1
    with pytest.raises(InvalidInputError):
        session.extend_task("", 1)
    session.close()


def test_streams_waiting_for_kv_pages_never_hold_the_stage_threads(tiny_causal_dir, causal, solo_streams):
    """A KV budget for one stream and one stage thread: three streams read as tasks. The two that wait for pages
    wait in the pool's queue on the engine core (`Admit`), holding no thread, so the one holding the pages can
    still decode its chunks and finish; each then runs exactly as alone."""
    generator, _ = causal
    need = generator.stream_video("prompt 0", seed=0, **STREAM)
    list(need)
    budget = need.stats.kv_cache_bytes
    tight = VideoGenerator.from_pretrained(tiny_causal_dir, progress=False, stage_threads=1, kv_cache_memory=budget)
    streams = [tight.stream_video(f"prompt {i}", seed=i, **STREAM) for i in range(3)]
    with ThreadPool(3) as pool:
        frames = pool.map(lambda s: read_as_tasks(tight, s), streams)
    for i, got in enumerate(frames):
        assert np.abs(got.astype(np.int16) - solo_streams[i].astype(np.int16)).max() <= 1
    stats = tight.pipeline.stage("CausalDenoisingStage").kv_pool.stats()
    assert stats.waits >= 1 and stats.peak_used_bytes == budget and stats.used_bytes == 0


def test_a_stream_read_on_a_thread_is_made_as_tasks_on_the_core(causal, solo_streams):
    """stream_video read by a thread: each chunk is a task on the engine core (its denoising loop advances on the
    core's thread, not the reader's), and its frames are the stream's."""
    generator, _ = causal
    seen: set[str] = set()

    class Where:
        def before_step(self, info):
            seen.add(threading.current_thread().name)

    handle = generator.pipeline.engines[0].add_hook(Where())
    try:
        frames = np.concatenate([c.frames for c in generator.stream_video("prompt 1", seed=1, **STREAM)])
    finally:
        handle.remove()
    assert seen and all(name.startswith("composer-core") for name in seen), seen
    assert threading.current_thread().name not in seen
    assert np.array_equal(frames, solo_streams[1])


def test_a_ready_step_does_not_wait_for_requests_whose_decode_is_queued(causal):
    """A ready transformer call waits a moment (settle_s) only for requests that may queue a unit soon: the busy
    requests less those whose VAE decode is queued or running (they cannot join before it ends). Waiting for them
    cost 8 streams a quarter of their frames/s on the CPU (docs/scheduling.md)."""
    generator, _ = causal
    pipeline = generator.pipeline
    decoder = next(s.batcher for s in pipeline.stages if getattr(s, "batcher", None) is not None)
    gate = pipeline.gate
    keys = [("test", i) for i in range(3)]
    for key in keys:
        assert gate.try_enter(key)
    errors = []

    def decode():
        try:
            decoder.submit("a key no decode has", object())  # never runs the VAE: the payload is not latents
        except Exception as exc:  # noqa: BLE001 - what the payload makes the decode raise
            errors.append(exc)

    try:
        with decoder.held():
            assert pipeline._in_denoising() == 3 and decoder.in_flight() == 0
            thread = threading.Thread(target=decode)
            thread.start()
            assert until(lambda: decoder.in_flight() == 1)
            assert pipeline._in_denoising() == 2  # the decoding request is not waited for
        thread.join(timeout=60)
        assert decoder.in_flight() == 0 and len(errors) == 1
    finally:
        for key in keys:
            gate.leave(key)


def test_blocking_work_that_waits_for_each_other_finds_a_stage_thread_each():
    """A parallel layout's sync points wait on stage threads for the other ranks: ensure_stage_threads gives every
    call at once a thread (three pieces of blocking work that meet at a barrier all run, also when the core had
    started with one thread)."""
    core = EngineCore(lambda: [], stage_threads=1)
    assert core.run(iter_task(lambda: "warm"), RequestContext()) == "warm"  # started, with one stage thread
    core.ensure_stage_threads(3)
    barrier = threading.Barrier(3, timeout=30)
    futures = [core.submit(iter_task(barrier.wait), RequestContext()) for _ in range(3)]
    assert sorted(f.result(timeout=60) for f in futures) == [0, 1, 2]
    core.close()


def iter_task(fn):
    return (yield from wait_for(Blocking(fn)))
