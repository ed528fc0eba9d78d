"""Many requests on one generator (docs/scheduling.md): threads calling generate_video / stream_video at once have
their steps scheduled together; compatible steps share one transformer call; each video equals its solo run;
priorities pick the next step; a cancelled request leaves the others exact; modes that keep per-request state run
requests one at a time."""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext

import numpy as np
import pytest
import torch
from helpers import held

from composer import VideoGenerator
from composer.cancel import CancelToken
from composer.engine.inputs import ModelInputs
from composer.engine.scheduler import RequestContext, StepScheduler
from composer.errors import Cancelled, InvalidInputError

REQUEST = dict(prompt="a red circle moving left", num_inference_steps=8)


def run_threads(fn, args_list, hold=None):
    """Each call on its thread; with `hold` (a generator) its scheduler is held until every call has a unit queued, so
    they share their first call whatever the threads' timing."""
    results, errors = {}, {}

    def target(key, *args):
        try:
            results[key] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors[key] = exc

    threads = [threading.Thread(target=target, args=(a[0], *a)) for a in args_list]
    with held(hold, len(threads)) if hold is not None else nullcontext():
        for t in threads:
            t.start()
    for t in threads:
        t.join(timeout=300)
    return results, errors


class CallCounter:
    def __init__(self, module: torch.nn.Module):
        self.calls = 0
        self.rows = []
        module.register_forward_pre_hook(self)

    def __call__(self, module, args):
        self.calls += 1
        self.rows.append(int(args[0].shape[0]))


@pytest.fixture(scope="module")
def t2v(one_thread):
    gen = VideoGenerator.from_pretrained(None, progress=False)
    return gen, CallCounter(gen.pipeline.modules["transformer"])


def assert_same_video(got, solo):
    assert got.frames.shape == solo.frames.shape
    assert np.abs(got.frames.astype(np.int16) - solo.frames.astype(np.int16)).max() <= 1
    scale = max(1.0, solo.latents.abs().max().item())
    assert (got.latents - solo.latents).abs().max().item() <= 1e-5 * scale


def test_concurrent_videos_equal_their_solo_runs_with_fewer_transformer_calls(t2v):
    gen, counter = t2v
    seeds = (11, 12, 13)
    counter.calls = 0
    solo = {s: gen.generate_video(seed=s, **REQUEST) for s in seeds}
    solo_calls = counter.calls
    counter.calls, counter.rows = 0, []
    results, errors = run_threads(lambda s: gen.generate_video(seed=s, **REQUEST), [(s,) for s in seeds], hold=gen)
    assert not errors, errors
    for s in seeds:
        assert_same_video(results[s], solo[s])
    assert counter.calls < solo_calls  # steps shared calls
    assert max(counter.rows) > 2  # more than one request's CFG pair in a call


def test_mixed_sizes_run_side_by_side_and_stay_exact(t2v):
    gen, counter = t2v
    sizes = {"a": dict(height=64, width=64, num_frames=17), "b": dict(height=48, width=64, num_frames=9),
             "c": dict(height=64, width=64, num_frames=17)}
    solo = {k: gen.generate_video(seed=5, **REQUEST, **sizes[k]) for k in ("a", "b")}
    solo["c"] = solo["a"]  # the same request
    counter.rows = []
    results, errors = run_threads(lambda k: gen.generate_video(seed=5, **REQUEST, **sizes[k]), [(k,) for k in sizes],
                                  hold=gen)
    assert not errors, errors
    for k in sizes:
        assert_same_video(results[k], solo[k])
    assert 4 in counter.rows  # a and c (one size) shared calls; b (another size) ran beside them


def test_a_cancelled_request_leaves_the_others_exact(t2v):
    gen, _ = t2v
    solo = {s: gen.generate_video(seed=s, **REQUEST) for s in (21, 22)}
    token = CancelToken()
    threading.Timer(0.05, token.cancel).start()

    def run(key):
        if key == "cancelled":
            return gen.generate_video(seed=23, cancel=token, **{**REQUEST, "num_inference_steps": 400})
        return gen.generate_video(seed=key, **REQUEST)

    results, errors = run_threads(run, [("cancelled",), (21,), (22,)])
    assert isinstance(errors.get("cancelled"), Cancelled), errors
    assert set(results) == {21, 22}
    for s in (21, 22):
        assert_same_video(results[s], solo[s])


@pytest.mark.slow  # (the quick tier's priority case: test_request_loop.py)
def test_a_high_priority_request_started_later_finishes_first(t2v):
    gen, _ = t2v
    long_request = dict(REQUEST, num_inference_steps=60, height=48, width=48)
    short_request = dict(REQUEST, num_inference_steps=4)  # another size: never in the same call
    solo = gen.generate_video(seed=3, **long_request)
    finished = []
    started = threading.Event()
    scheduler = gen.pipeline.engines[0].scheduler
    calls_before = scheduler.stats.calls

    def run(key):
        if key == "low":
            result = gen.generate_video(seed=3, **long_request)
        else:
            started.wait(60)
            result = gen.generate_video(seed=4, priority=10, **short_request)
        finished.append(key)
        return result

    def start_when_the_low_one_runs():
        while scheduler.stats.calls < calls_before + 3:
            time.sleep(0.001)
        started.set()

    threading.Thread(target=start_when_the_low_one_runs).start()
    results, errors = run_threads(run, [("low",), ("high",)])
    assert not errors, errors
    assert finished == ["high", "low"]
    assert_same_video(results["low"], solo)


def test_max_batch_size_bounds_the_videos_in_a_call(tmp_path, one_thread):
    gen = VideoGenerator.from_pretrained(None, progress=False, max_batch_size=1)
    counter = CallCounter(gen.pipeline.modules["transformer"])
    results, errors = run_threads(lambda s: gen.generate_video(seed=s, **REQUEST), [(s,) for s in (1, 2)], hold=gen)
    assert not errors, errors
    assert max(counter.rows) == 2  # one video's CFG pair per call
    assert gen.pipeline.engines[0].scheduler.stats.largest_batch == 1


def unit_tokens(shape, patch_size) -> int:
    """Transformer tokens of a call over inputs of `shape` [rows, C, F, H, W]: rows x patches, counted here
    from the shape and the model's patch size (what max_batch_tokens documents)."""
    rows, _, *axes = shape
    return rows * int(np.prod([n // p for n, p in zip(axes, patch_size)]))


@pytest.fixture(scope="module")
def step_tokens(t2v):
    """The tokens of one REQUEST step (its CFG pair) on the default model."""
    gen, _ = t2v
    shapes = []
    handle = gen.pipeline.modules["transformer"].register_forward_pre_hook(
        lambda module, args: shapes.append(tuple(args[0].shape)))
    try:
        gen.generate_video(seed=0, **dict(REQUEST, num_inference_steps=1))
    finally:
        handle.remove()
    assert shapes[0][0] == 2  # one video's CFG pair
    return unit_tokens(shapes[0], gen.pipeline.modules["transformer"].config.patch_size)


@pytest.mark.slow  # (the quick tier keeps max_batch_size's bound)
@pytest.mark.parametrize("units_per_call", [1, 2])
def test_max_batch_tokens_bounds_the_tokens_in_a_call(t2v, step_tokens, units_per_call, one_thread):
    solo_gen, _ = t2v
    seeds = (41, 42, 43)
    solo = {s: solo_gen.generate_video(seed=s, **REQUEST) for s in seeds}
    gen = VideoGenerator.from_pretrained(None, progress=False, max_batch_tokens=units_per_call * step_tokens)
    assert gen.pipeline.runtime.max_batch_tokens == units_per_call * step_tokens
    counter = CallCounter(gen.pipeline.modules["transformer"])
    results, errors = run_threads(lambda s: gen.generate_video(seed=s, **REQUEST), [(s,) for s in seeds], hold=gen)
    assert not errors, errors
    for s in seeds:
        assert_same_video(results[s], solo[s])
    stats = gen.pipeline.engines[0].scheduler.stats
    assert max(counter.rows) == 2 * units_per_call  # at most the budget's CFG pairs in a call, ...
    assert stats.largest_batch == units_per_call  # ... and the budget filled when requests were in step
    assert counter.calls >= len(seeds) * REQUEST["num_inference_steps"] / units_per_call


def test_max_batch_tokens_is_a_positive_integer_or_unset():
    from composer.errors import ConfigError
    from composer.runtime import RuntimeArgs

    assert RuntimeArgs.from_kwargs(max_batch_tokens="4096").max_batch_tokens == 4096  # a CLI flag's string
    for bad in (0, -1, "many", 1.5):
        with pytest.raises(ConfigError, match="max_batch_tokens"):
            RuntimeArgs.from_kwargs(max_batch_tokens=bad)


def test_max_batch_tokens_is_one_name_for_the_flag_the_preset_and_the_keyword(cli, tmp_path):
    preset = tmp_path / "preset.yaml"
    preset.write_text("runtime:\n  max_batch_tokens: 0\n")
    for args in (["generate", "--prompt", "x", "--max-batch-tokens", "0"], ["generate", "--prompt", "x", "--config",
                 preset], ["serve", "--max-batch-tokens", "0"]):
        code, _, err = cli(*args)  # refused before anything loads
        assert code != 0 and "max_batch_tokens = 0: expected a positive integer" in err, (args, err)


@pytest.mark.slow  # 4 s; the quick tier keeps concurrent videos (and the serve tests' streams)
def test_concurrent_streams_equal_their_solo_streams(one_thread):
    gen = VideoGenerator.from_pretrained("shapes-causal", progress=False)
    prompts = ["a red circle moving left", "a blue square moving right", "a green triangle moving up"]

    def stream(i):
        s = gen.stream_video(prompts[i], seed=i, num_frames=17)
        return np.concatenate([c.frames for c in s])

    solo = {i: stream(i) for i in range(3)}
    stats = gen.pipeline.engines[0].scheduler.stats
    batched_before = stats.batched_units
    results, errors = run_threads(stream, [(i,) for i in range(3)], hold=gen)
    assert not errors, errors
    for i in range(3):
        assert results[i].shape == solo[i].shape
        assert np.abs(results[i].astype(np.int16) - solo[i].astype(np.int16)).max() <= 1
    assert stats.batched_units > batched_before  # blocks of different streams shared calls (KVCacheGroup)
    whole, errors = run_threads(lambda i: gen.generate_video(prompts[i], seed=i, num_frames=17).frames,
                                [(0,), (1,)])  # whole videos of a causal model at once
    assert not errors, errors
    for i in (0, 1):
        assert np.abs(whole[i].astype(np.int16) - solo[i].astype(np.int16)).max() <= 1


def test_a_cache_group_writes_and_reads_each_cache_as_alone():
    from composer.cache import KVCache, KVCacheGroup, KVCacheSpec

    spec = KVCacheSpec(num_layers=2, batch_size=2, capacity_frames=6, tokens_per_frame=3, num_heads=2, head_dim=4,
                       window_frames=4, sink_frames=1)
    alone, grouped = [KVCache(spec, torch.float32, "cpu") for _ in range(2)], [KVCache(spec, torch.float32, "cpu")
                                                                              for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    for start in range(0, 6, 2):
        k = torch.randn(4, 6, 2, 4, generator=g)
        v = torch.randn(4, 6, 2, 4, generator=g)
        expected = []
        for cache, kp, vp in zip(alone, k.split(2), v.split(2)):
            with cache.pass_over(start, 2):
                expected.append(cache.layer(1).update(kp, vp))
        group = KVCacheGroup(grouped)
        with group.pass_over(start, 2):
            got_k, got_v = group.layer(1).update(k, v)
        assert torch.equal(got_k, torch.cat([e[0] for e in expected]))
        assert torch.equal(got_v, torch.cat([e[1] for e in expected]))
    assert [c.end_frame for c in grouped] == [6, 6]


@pytest.mark.parametrize("cache", [pytest.param("teacache", marks=pytest.mark.slow), "dbcache"])
def test_step_cached_requests_run_together_each_deciding_for_itself(one_thread, cache):
    """A step cache keeps a plan, residuals and counts per request: concurrent requests are scheduled together
    (one request per call) and each one's latents equal its solo run's bit for bit."""
    gen = VideoGenerator.from_pretrained(None, progress=False, cache=cache, cache_threshold=0.3)
    assert gen.pipeline.concurrency == "interleave" and gen.pipeline.engines[0].scheduler is not None
    hook = next(h for h in gen.pipeline.hooks if h.name == "cache").hooks[0]
    seeds, request = (1, 2, 3), dict(REQUEST, num_inference_steps=10)
    solo, plans = {}, {}
    for s in seeds:
        solo[s] = gen.generate_video(seed=s, **request)
        plans[s] = dict(hook.stats.per_run)
    assert any(not ran for plan in plans.values() for ran in plan[0])  # some steps were skipped alone
    counter = CallCounter(gen.pipeline.modules["transformer"])
    results, errors = run_threads(lambda s: gen.generate_video(seed=s, **request), [(s,) for s in seeds])
    assert not errors, errors
    for s in seeds:
        assert torch.equal(results[s].latents, solo[s].latents)  # the denoising is the solo one, bit for bit
        assert_same_video(results[s], solo[s])  # frames: decodes of concurrent videos may share a VAE batch
    assert set(counter.rows) == {2}  # one request (its CFG pair) per call
    skipped_alone = sum(not ran for plan in plans.values() for ran in plan[0])
    if cache == "teacache":  # planned before the loop: a skipped step makes no call
        assert counter.calls == len(seeds) * request["num_inference_steps"]
    assert skipped_alone > 0


def test_priority_must_be_an_integer(t2v):
    gen, _ = t2v
    for bad in ("high", 1.5, True):
        with pytest.raises(InvalidInputError, match="priority"):
            gen.generate_video(priority=bad, **REQUEST)


def test_the_scheduler_picks_by_priority_then_arrival_and_batches_only_compatible_units():
    order = []

    def solo(unit):
        order.append([unit.request.priority])
        return [unit.latents]

    def batch(units):
        order.append([u.request.priority for u in units])
        return [[u.latents] for u in units]

    scheduler = StepScheduler(solo, batch, gather_s=0.2)
    text = ModelInputs(text=torch.zeros(1, 3, 4))

    def submit(priority, shape):
        scheduler.submit(torch.zeros(shape), torch.zeros(1), [text], None, "step", RequestContext(priority=priority))

    args = [(0, (1, 2)), (1, (1, 3)), (2, (1, 2))]  # priorities 0 and 2 are compatible, 1 is not
    threads = [threading.Thread(target=submit, args=a) for a in args]
    ctx = RequestContext()
    with scheduler.denoising(ctx):  # a fourth request in its loop, not submitting: the gather window runs out
        with scheduler.held():  # they arrive in a known order, and all before the first call
            for i, t in enumerate(threads, start=1):
                t.start()
                assert scheduler.wait_for_units(i, timeout=60)
        for t in threads:
            t.join()
    assert order == [[2, 0], [1]]
    assert scheduler.stats.batched_units == 2 and scheduler.stats.largest_batch == 2


def fake_unit(scheduler, name, *, priority=0, deadline=None, shape=(1, 4, 2, 8, 8), branches=2, seq=None):
    """A pending unit as `submit` makes it (batch key, tokens), for a request named `name`."""
    from composer.engine.scheduler import Unit, batch_key, token_count

    latents, timestep = torch.zeros(shape), torch.zeros(shape[0])
    inputs = [ModelInputs(text=torch.zeros(shape[0], 3, 4)) for _ in range(branches)]
    request = RequestContext(priority=priority, deadline=deadline)
    request.name = name
    unit = Unit(latents, timestep, inputs, None, "step", request, batch_key(latents, timestep, inputs, "step"),
                next(scheduler._seq) if seq is None else seq, 0.0,
                tokens=token_count(latents, branches, scheduler.patch_size))
    scheduler._pending.append(unit)
    return unit


def picked(scheduler, now=100.0):
    return [u.request.name for u in scheduler._pick(now=now)]


def test_a_unit_counts_rows_times_patches_as_its_tokens():
    from composer.engine.engine import transformer_patch_size
    from composer.engine.scheduler import token_count

    assert token_count(torch.zeros(1, 16, 5, 8, 12), 2, (1, 2, 2)) == 2 * 5 * 4 * 6
    assert token_count(torch.zeros(3, 16, 4, 8, 8), 1, (2, 2, 2)) == 3 * 2 * 4 * 4
    from types import SimpleNamespace

    gen = VideoGenerator.from_pretrained(None, progress=False)
    stated = tuple(gen.pipeline.modules["transformer"].config.patch_size)  # shapes-t2v: (1, 1, 1)
    assert transformer_patch_size(gen.pipeline.modules["transformer"]) == stated
    assert gen.pipeline.engines[0].scheduler.patch_size == stated
    model = torch.nn.Linear(1, 1)
    assert transformer_patch_size(model) == (1, 1, 1)  # no config: tokens are latent positions
    model.config = SimpleNamespace(patch_size=[1, 2, 2])  # Wan
    assert transformer_patch_size(model) == (1, 2, 2)
    model.config = SimpleNamespace(patch_size=2, patch_size_t=1)  # HunyuanVideo
    assert transformer_patch_size(model) == (1, 2, 2)


def test_the_token_budget_takes_units_in_pick_order_and_never_starves_a_large_one():
    scheduler = StepScheduler(None, None, max_batch_tokens=2 * 64, patch_size=(1, 2, 2))  # two units of 64
    for name in "abc":
        fake_unit(scheduler, name)  # [1, 4, 2, 8, 8], CFG pair: 2 rows x 2 x 4 x 4 = 64 tokens
    assert scheduler._pending[0].tokens == 64
    assert picked(scheduler) == ["a", "b"] and picked(scheduler) == ["c"]
    fake_unit(scheduler, "big", shape=(1, 4, 4, 16, 16))  # 512 tokens: over the budget alone
    fake_unit(scheduler, "small")
    assert picked(scheduler) == ["big"]  # runs, alone
    assert picked(scheduler) == ["small"]
    scheduler.max_batch_tokens, scheduler.max_batch_size = 64 * 3, 2  # the videos' budget binds first
    for name in "xyz":
        fake_unit(scheduler, name)
    assert picked(scheduler) == ["x", "y"]


def test_a_realtime_stream_that_is_due_goes_before_equal_and_lower_priority_work():
    scheduler = StepScheduler(None, None)
    job, low, urgent = (1, 4, 2, 8, 12), (1, 4, 2, 12, 12), (1, 4, 2, 16, 8)  # shapes: never in the stream's call
    fake_unit(scheduler, "job", shape=job)
    fake_unit(scheduler, "low", priority=-1, shape=low)
    fake_unit(scheduler, "stream", deadline=100.5)
    assert picked(scheduler, now=100.0) == ["job"]  # not due yet: by arrival
    fake_unit(scheduler, "job2", shape=job)
    assert picked(scheduler, now=100.5) == ["stream"]  # due (deadline == now): first among priority 0
    fake_unit(scheduler, "late", deadline=99.0)
    fake_unit(scheduler, "later", deadline=98.0)
    fake_unit(scheduler, "urgent", priority=1, shape=urgent)
    assert picked(scheduler, now=100.0) == ["urgent"]  # a higher priority still goes first
    assert picked(scheduler, now=100.0) == ["later", "late"]  # earliest deadline first; compatible: one call
    assert picked(scheduler, now=100.0) == ["job2"]
    assert picked(scheduler, now=100.0) == ["low"]  # a due stream of priority 0 would beat it too
    fake_unit(scheduler, "behind", priority=-1, deadline=50.0, shape=low)
    fake_unit(scheduler, "on time", shape=job)
    assert picked(scheduler, now=100.0) == ["on time"]  # a deadline never lifts a request above a priority


def test_a_stream_with_a_target_frame_rate_goes_first_when_due_and_stays_exact(one_thread):
    gen = VideoGenerator.from_pretrained("shapes-causal", progress=False)
    stream_request = dict(seed=1, num_frames=17)
    job_request = dict(seed=2, num_frames=9, height=48, width=64)  # another size: never in the stream's calls
    solo_stream = np.concatenate([c.frames for c in gen.stream_video("a red circle moving left", **stream_request)])
    solo_job = gen.generate_video("a blue square moving right", **job_request)
    scheduler = gen.pipeline.engines[0].scheduler
    picks, pick = [], scheduler._pick

    def recording_pick(now=None):
        now = time.monotonic()
        due = [u for u in scheduler._pending if u.request.due(now)]
        chosen = pick(now)
        picks.append((bool(due), chosen[0].request.due(now), chosen[0].request.target_fps))
        return chosen

    scheduler._pick = recording_pick
    streams = {}

    def run(key):
        if key == "stream":  # 1000 frames/s: never reached here, so its next frames are always due
            streams[key] = gen.stream_video("a red circle moving left", target_fps=1000, **stream_request)
            return np.concatenate([c.frames for c in streams[key]])
        return gen.generate_video("a blue square moving right", **job_request)

    try:
        results, errors = run_threads(run, [("stream",), ("job",)])
    finally:
        del scheduler._pick
    assert not errors, errors
    assert np.abs(results["stream"].astype(np.int16) - solo_stream.astype(np.int16)).max() <= 1
    assert_same_video(results["job"], solo_job)
    assert any(due for due, _, _ in picks) and any(fps is None for _, _, fps in picks)  # they did overlap
    assert all(first_due for due, first_due, _ in picks if due)  # a due stream unit waiting: it went first
    stats = streams["stream"].stats
    assert stats.target_fps == 1000.0 and 0 < stats.fps < 1000
    assert "target of 1000" in stats.summary()
    assert streams["stream"].pace.context.deadline is None  # the stream is over: nothing is due


def test_target_fps_must_be_a_positive_finite_number(one_thread):
    gen = VideoGenerator.from_pretrained("shapes-causal", progress=False)
    for bad in (0, -5, float("nan"), float("inf"), "30", True):
        with pytest.raises(InvalidInputError, match="target_fps"):
            gen.stream_video("a red circle moving left", target_fps=bad)
    with pytest.raises(InvalidInputError, match="target_fps"):
        gen.open_session(target_fps=0)
    stream = gen.stream_video("a red circle moving left", seed=0, num_frames=9, target_fps=24)
    chunks = list(stream)
    assert stream.stats.fps == pytest.approx(sum(len(c.frames) for c in chunks) / stream.pace.seconds)
    assert stream.stats.target_fps == 24.0


def test_a_session_paused_between_extends_does_not_count_the_pause_in_its_frame_rate(one_thread):
    gen = VideoGenerator.from_pretrained("shapes-causal", progress=False)
    with gen.open_session(seed=3, target_fps=8) as session:
        list(session.extend("a red circle moving left", 2))
        assert session._stream.pace.context.deadline is None  # paused between extends: nothing is due
        time.sleep(0.5)
        list(session.extend("a blue square moving up", 1))
        stats = session.stats
    pace = session._stream.pace
    assert stats.target_fps == 8.0 and stats.fps == pytest.approx(stats.frames / pace.seconds)
    assert pace.seconds < stats.total_seconds - 0.5 + 1e-3  # the 0.5 s between the extends left out


def test_the_asyncio_forms_are_scheduled_together(t2v, one_thread):
    import asyncio

    gen, _ = t2v
    solo = {s: gen.generate_video(seed=s, **REQUEST) for s in (31, 32)}

    async def main():
        return await asyncio.gather(*(gen.agenerate_video(seed=s, **REQUEST) for s in (31, 32)))

    for s, got in zip((31, 32), asyncio.run(main())):
        assert_same_video(got, solo[s])


def test_astream_video_yields_the_stream_chunks(one_thread):
    import asyncio

    gen = VideoGenerator.from_pretrained("shapes-causal", progress=False)
    solo = np.concatenate([c.frames for c in gen.stream_video("a red circle moving left", seed=0, num_frames=17)])

    async def main():
        return [c.frames async for c in gen.astream_video("a red circle moving left", seed=0, num_frames=17)]

    assert np.array_equal(np.concatenate(asyncio.run(main())), solo)


def test_a_session_extended_twice_is_the_stream_of_both_segments(one_thread):
    gen = VideoGenerator.from_pretrained("shapes-causal", progress=False)
    p0, p1 = "a red circle moving left", "a blue square moving up"
    stream = np.concatenate([c.frames for c in gen.stream_video([(p0, 2), (p1, 3)], seed=7)])
    with gen.open_session(seed=7) as session:
        first = [c.frames for c in session.extend(p0, 2)]
        second = [c.frames for c in session.extend(p1, 3)]
        assert session.blocks == 5
        assert np.array_equal(session.frames, stream)
    assert np.array_equal(np.concatenate(first + second), stream)
    with pytest.raises(InvalidInputError, match="closed"):
        session.extend(p0, 1)
    with gen.open_session(seed=7) as other, pytest.raises(InvalidInputError, match="num_blocks"):
        other.extend(p0, 0)


def test_concurrent_decodes_share_one_vae_call(one_thread):
    gen = VideoGenerator.from_pretrained("shapes-causal", progress=False)
    prompts = ["a red circle moving left", "a blue square moving right"]

    def stream(i):
        return np.concatenate([c.frames for c in gen.stream_video(prompts[i], seed=i, num_frames=17)])

    solo = {i: stream(i) for i in range(2)}
    batcher = gen.pipeline.stage("DecodingStage").batcher
    before = batcher.batched_calls
    with batcher.held():  # both streams' first chunks wait for their decode together
        results, errors = {}, {}
        threads = [threading.Thread(target=lambda i=i: results.update({i: stream(i)})) for i in (0, 1)]
        for t in threads:
            t.start()
        assert batcher.wait_for_units(2, timeout=120)
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    sched = gen.pipeline.engines[0].scheduler.stats
    assert batcher.batched_calls > before, sched  # streamed chunks of both streams decoded as one batch
    for i in range(2):
        assert np.abs(results[i].astype(np.int16) - solo[i].astype(np.int16)).max() <= 1


def test_the_call_batcher_batches_calls_that_queue_while_one_runs():
    from composer.engine.batcher import CallBatcher

    started, release, seen = threading.Event(), threading.Event(), []

    def run(payloads):
        seen.append(list(payloads))
        if payloads == ["first"]:
            started.set()
            release.wait(10)
        return [p.upper() for p in payloads]

    batcher = CallBatcher(run)
    out = {}
    first = threading.Thread(target=lambda: out.setdefault("first", batcher.submit("k", "first")))
    first.start()
    started.wait(10)
    others = [threading.Thread(target=lambda p=p, k=k: out.setdefault(p, batcher.submit(k, p)))
              for p, k in (("a", "k"), ("b", "k"), ("c", "other"))]
    for t in others:
        t.start()
    while len(batcher._pending) < 3:
        time.sleep(0.001)
    release.set()
    for t in [first, *others]:
        t.join(10)
    assert out == {"first": "FIRST", "a": "A", "b": "B", "c": "C"}
    assert seen == [["first"], ["a", "b"], ["c"]]


def test_a_parallel_layouts_gate_refuses_a_second_request_instead_of_risking_a_hang():
    from composer.errors import UnsupportedError
    from composer.pipelines.base import RequestGate

    gate = RequestGate(refuse_overlap=True)
    inside, leave = threading.Event(), threading.Event()

    def hold():
        with gate.request():
            inside.set()
            leave.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    inside.wait(10)
    try:
        with pytest.raises(UnsupportedError, match="one at a time in the same order on every rank"):
            with gate.request():
                pass
    finally:
        leave.set()
        holder.join(10)
    with gate.request():  # alone again: admitted
        pass


@pytest.mark.slow
def test_under_compile_calls_hold_power_of_two_videos_and_stop_recompiling(one_thread):
    """torch.compile: concurrent requests are batched in power-of-two groups (3 requests: a call of 2 and one of
    1 per step), each equals its solo compiled run, and a second round of the same traffic compiles nothing."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    gen = VideoGenerator.from_pretrained(None, progress=False, compile="regional")
    counter = CallCounter(gen.pipeline.modules["transformer"])
    request = dict(REQUEST, num_inference_steps=4)
    seeds = (21, 22, 23)
    solo = {s: gen.generate_video(seed=s, **request) for s in seeds}
    for round_ in range(2):
        counter.rows = []
        graphs = int(counters["stats"]["unique_graphs"])
        results, errors = run_threads(lambda s: gen.generate_video(seed=s, **request), [(s,) for s in seeds],
                                      hold=gen)
        assert not errors, errors
        for s in seeds:
            assert_same_video(results[s], solo[s])
        assert set(counter.rows) <= {2, 4}  # CFG rows: 1 or 2 videos per call, never 3
        if round_ == 1:
            assert int(counters["stats"]["unique_graphs"]) == graphs, "recompiled in steady state"
    assert 4 in counter.rows  # two requests shared calls


def test_a_stream_whose_reader_holds_its_chunk_is_parked_and_no_call_waits_for_it():
    """A reader that stops reading (a stalled client, a session between extends) keeps its stream's place at the
    gate, but past the grace the step scheduler and the decode batcher no longer count it among the requests they
    wait a moment for; it counts again as soon as it reads on, and it keeps its frames."""
    from composer.pipelines.base import RequestGate

    gate = RequestGate(park_grace_s=0.05)
    with gate.request():
        gate.park(1)
        assert gate.running == gate.busy == 1  # within the grace: a reader about to come back
        time.sleep(0.06)
        assert (gate.running, gate.busy) == (1, 0)
        gate.unpark(1)
        assert gate.busy == 1

    gen = VideoGenerator.from_pretrained("shapes-causal", progress=False)
    scheduler = gen.pipeline.engines[0].scheduler
    solo = np.concatenate([c.frames for c in gen.stream_video("a red circle moving left", seed=3, num_frames=9)])
    stream = gen.stream_video("a red circle moving left", seed=3, num_frames=9)
    chunks = iter(stream)
    frames = [next(chunks).frames]
    time.sleep(2 * gen.pipeline.gate.park_grace_s)  # the reader holds the chunk: the stream is parked
    assert gen.pipeline.gate.running == 1 and scheduler.active_requests() == 0
    settled = scheduler.stats.settle_seconds
    other = gen.generate_video("a blue square moving right", seed=1, num_frames=5)  # runs as if alone
    assert other.frames.shape[0] == 5
    assert scheduler.stats.settle_seconds == settled  # none of its calls waited for the parked stream
    frames += [c.frames for c in chunks]
    assert np.array_equal(np.concatenate(frames), solo)
    assert gen.pipeline.gate.running == 0 and scheduler.active_requests() == 0

    session = gen.open_session(seed=3)
    list(session.extend("a red circle moving left", 1))
    time.sleep(2 * gen.pipeline.gate.park_grace_s)  # between extends: parked too
    assert gen.pipeline.gate.running == 1 and scheduler.active_requests() == 0
    session.close()
    assert gen.pipeline.gate.running == 0


def test_a_due_realtime_stream_does_not_wait_for_the_gather_window():
    """Gathering waits (up to gather_s) for the requests inside a loop to submit, so their steps share a call; a
    realtime stream whose frames are due goes at once instead, with whatever is waiting."""
    scheduler = StepScheduler(lambda u: [u.latents], lambda us: [[u.latents] for u in us], gather_s=10.0)
    elsewhere = RequestContext()
    with scheduler.denoising(elsewhere):  # a request in its loop, its next unit not here yet
        batch_job = fake_unit(scheduler, "job")
        batch_job.arrived = time.monotonic()
        assert scheduler.due() > 5.0  # gathering for `elsewhere`
        later = fake_unit(scheduler, "stream", deadline=time.monotonic() + 60.0)
        later.arrived = time.monotonic()
        assert scheduler.due() > 5.0  # a stream not yet due gathers too
        due = fake_unit(scheduler, "late stream", deadline=time.monotonic() - 0.01)
        due.arrived = time.monotonic()
        assert scheduler.due() == 0.0
        assert picked(scheduler, now=time.monotonic())[0] == "late stream"
