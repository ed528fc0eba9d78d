"""Concurrent requests admitted against one memory budget (composer/memory/admission.py): the weights counted once,
each running request's predicted share reserved, a request that does not fit beside the running ones waiting (in
priority order) instead of being refused, a batched call only as large as the memory allows, /metrics; and
`offload = auto` under torchrun: one plan for every rank. Budgets here are computed from the predictor's own
numbers (shapes and dtypes only), never from the machine's free memory."""

from __future__ import annotations

import logging
import re
import threading
import time

import numpy as np
import pytest
import torch
from helpers import held

from composer import VideoGenerator
from composer.cancel import CancelToken
from composer.engine.scheduler import StepScheduler
from composer.errors import Cancelled, MemoryBudgetError
from composer.memory import HEADROOM, MemoryAdmission, MemoryShare, RequestMemory, fmt_bytes
from composer.memory.predict import StageMemory

SHORT = dict(num_inference_steps=3)  # the shapes model's 17x64x64 default video
WIDE_IN_TIME = dict(num_inference_steps=3, num_frames=385, height=16, width=16)  # its transformer calls are its peak


@pytest.fixture(scope="module")
def plain():
    return VideoGenerator.from_pretrained(None, device="cpu", progress=False)


@pytest.fixture(scope="module")
def one_at_a_time():
    """The shapes model under a budget that holds one of its default videos beside the weights, not two: a room
    of 1.5 times the predictor's share of one."""
    probe = VideoGenerator.from_pretrained(None, device="cpu", memory_budget=1 << 40, progress=False)
    share = probe._checked("a", None, None, dict(SHORT), 0)[2]
    budget = budget_for(share.peak + share.peak // 2, probe.memory_guard.admission.weights)
    return VideoGenerator.from_pretrained(None, device="cpu", memory_budget=budget, progress=False)


def budget_for(room: int, weights: int) -> int:
    """The memory_budget whose room (after headroom, less the weights) is `room`."""
    return int((room + weights) * (1 + HEADROOM)) + 16


def wait_until(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def wait_for_waiting(admission: MemoryAdmission, count: int) -> None:
    wait_until(lambda: admission.stats().waiting == count)


# -- the admission on its own ---------------------------------------------------------------------------------


def test_a_request_share_holds_its_stages_and_counts_its_calls_apart():
    request = RequestMemory([StageMemory("TextEncodingStage", ("text_encoder",), 10, 0),
                             StageMemory("DenoisingStage", ("transformer",), 70, 5, calls=True),
                             StageMemory("DecodingStage", ("vae",), 40, 8)])
    share = MemoryShare.of(request)
    assert share.held == 48 and share.excess == 75 - 48 and share.peak == request.peak == 75
    decode_bound = RequestMemory([StageMemory("DenoisingStage", ("transformer",), 20, 5, calls=True),
                                  StageMemory("DecodingStage", ("vae",), 90, 8)])
    assert MemoryShare.of(decode_bound) == MemoryShare(98, 25 - 98)  # its calls fit in what it holds anyway


def test_waiting_requests_are_admitted_in_priority_then_arrival_order():
    admission = MemoryAdmission(room=100)
    first = admission.reserve(MemoryShare(60))
    order, threads = [], []

    def wait(name, priority):
        reservation = admission.reserve(MemoryShare(60), priority)
        order.append(name)
        reservation.release()

    for name, priority in (("low", 0), ("high", 5), ("low2", 0)):
        threads.append(threading.Thread(target=wait, args=(name, priority)))
        threads[-1].start()
        wait_for_waiting(admission, len(threads))
    assert admission.try_reserve(MemoryShare(60), priority=9) is None  # does not fit now
    assert admission.try_reserve(MemoryShare(30), priority=0) is None  # fits, but others wait before it
    assert admission.stats().reserved == 60 and admission.stats().waits == 3
    first.release()
    for thread in threads:
        thread.join(timeout=10)
    assert order == ["high", "low", "low2"]
    assert admission.stats().reserved == 0 and admission.stats().running == 0


def test_a_waiting_request_leaves_the_line_when_cancelled():
    admission = MemoryAdmission(room=100)
    held = admission.reserve(MemoryShare(80))
    token, errors = CancelToken(), []

    def wait():
        try:
            admission.reserve(MemoryShare(50), cancel=token)
        except Cancelled as exc:
            errors.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    wait_until(lambda: admission.stats().waiting == 1)
    token.cancel("test")
    thread.join(timeout=10)
    assert errors and admission.stats().waiting == 0
    held.release()
    held.release()  # twice: nothing more
    assert admission.stats().reserved == 0


def test_a_batched_call_takes_partners_only_while_their_activations_fit():
    from test_scheduler import fake_unit, picked

    admission = MemoryAdmission(room=80)
    scheduler, other = StepScheduler(None, None), StepScheduler(None, None)
    scheduler.call_memory = admission
    held = {name: admission.reserve(MemoryShare(15, 25)) for name in "abc"}  # 45 held + 25 for any one call

    def unit(name, request=None):
        fake_unit(scheduler, name).request.memory = held.get(request or name)

    for name in "abc":
        unit(name)
    assert admission.stats().reserved == 70
    assert picked(scheduler) == ["a"] and picked(scheduler) == ["b"]  # two calls: 45 + 50 > 80
    assert picked(scheduler) == ["c"]
    held.pop("c").release()  # 30 held: two calls' 50 fit
    unit("a2", "a"), unit("b2", "b"), unit("stream", "none")  # a stream holds no reservation: it adds nothing
    assert picked(scheduler) == ["a2", "b2", "stream"]
    # another scheduler's batched call in flight (Wan2.2's second expert): counted, and a lone unit waits for it
    unit("a3", "a"), unit("b3", "b")
    admission.started(other, list(scheduler._pending))
    assert admission.stats().in_flight == 50
    assert admission.try_reserve(MemoryShare(1)) is None  # 30 + 1 + 50 > 80 while that call runs
    assert not admission.admits(scheduler, scheduler._pending[:1]) and scheduler.due() > 0
    admission.ended(other)
    assert admission.admits(scheduler, scheduler._pending[:1]) and picked(scheduler) == ["a3", "b3"]


# -- requests on the shapes model ---------------------------------------------------------------------------


def test_two_requests_that_do_not_fit_together_run_one_after_the_other_each_as_alone(plain, one_at_a_time):
    """A task (submit_video) and a call on a thread (generate_video) under one budget: the later one waits for the
    earlier one to end. (A reservation held by the test stands for a running request until both have queued, so
    the order does not depend on the machine's speed.)"""
    gen = one_at_a_time
    admission, waits = gen.memory_guard.admission, gen.memory_guard.admission.stats().waits
    batched = gen.pipeline.engines[0].scheduler.stats.batched_units
    share = gen._checked("a", None, None, dict(SHORT), 0)[2]
    assert admission.room // 2 < share.peak <= admission.room  # one fits the budget, two do not
    hold = admission.reserve(share)
    first = gen.submit_video("a red circle moving left", seed=1, **SHORT)
    wait_for_waiting(admission, 1)
    second: dict = {}
    thread = threading.Thread(target=lambda: second.setdefault(
        "result", gen.generate_video("a blue square moving right", seed=2, **SHORT)))
    thread.start()
    wait_for_waiting(admission, 2)
    hold.release()
    wait_until(lambda: admission.stats().running == 1)
    assert admission.stats().waiting == 1 and admission.stats().reserved == share.held  # the task runs, alone
    a = first.result(timeout=120)
    thread.join(timeout=120)
    b = second["result"]
    assert admission.stats().waits == waits + 2 and admission.stats().reserved == 0
    assert gen.pipeline.engines[0].scheduler.stats.batched_units == batched  # never a step together
    np.testing.assert_array_equal(a.frames, plain.generate_video("a red circle moving left", seed=1, **SHORT).frames)
    np.testing.assert_array_equal(b.frames, plain.generate_video("a blue square moving right", seed=2,
                                                                 **SHORT).frames)


def test_a_request_that_cannot_fit_even_alone_is_refused_with_the_numbers(one_at_a_time):
    gen = one_at_a_time
    budget = re.escape(fmt_bytes(gen.memory_guard.plan.budget))
    with pytest.raises(MemoryBudgetError, match=rf"needs about .* Decoding .* more than the budget of {budget}"):
        gen.submit_video("a red circle", height=128, width=128, **SHORT)
    stats = gen.memory_guard.admission.stats()
    assert stats.running == stats.waiting == stats.reserved == 0


def test_waiting_requests_start_in_priority_order(plain, one_at_a_time):
    gen = one_at_a_time
    admission, done = gen.memory_guard.admission, []
    hold = admission.reserve(gen._checked("a", None, None, dict(SHORT), 0)[2])  # a running request, for the test
    futures = {}
    for name, priority in (("low", 0), ("high", 3)):
        futures[name] = gen.submit_video(f"a {name} square", seed=2, priority=priority, **SHORT)
        futures[name].add_done_callback(lambda _, n=name: done.append(n))
        wait_for_waiting(admission, len(futures))
    hold.release()
    for name in futures:
        futures[name].result(timeout=120)
    assert done == ["high", "low"]  # the later, higher-priority request first; one at a time
    np.testing.assert_array_equal(futures["low"].result().frames,
                                  plain.generate_video("a low square", seed=2, **SHORT).frames)


@pytest.mark.slow
def test_requests_admitted_together_share_a_call_only_while_its_activations_fit(plain, one_at_a_time):
    """Long thin videos, whose transformer calls are their peak: the budget holds both requests and one call's
    activations, not two: both run at once, their steps never in one call, each video its solo run's."""
    share = one_at_a_time._checked("a", None, None, dict(WIDE_IN_TIME), 0)[2]
    assert share.excess > 0
    weights = one_at_a_time.memory_guard.admission.weights
    room = 2 * share.held + share.excess + share.excess // 2
    gen = VideoGenerator.from_pretrained(None, device="cpu", memory_budget=budget_for(room, weights), progress=False)
    admission = gen.memory_guard.admission
    requests = (("a red circle", 1), ("a blue square", 2))
    futures = [gen.submit_video(p, seed=s, **WIDE_IN_TIME) for p, s in requests]
    results = [f.result(timeout=120) for f in futures]
    stats = gen.pipeline.engines[0].scheduler.stats
    assert admission.stats().waits == 0 and stats.batched_units == 0 and stats.units == 6
    # without a budget the same two share their calls
    before = plain.pipeline.engines[0].scheduler.stats.batched_units
    with held(plain, 2):
        futures = [plain.submit_video(p, seed=s, **WIDE_IN_TIME) for p, s in requests]
    for future in futures:
        future.result(timeout=120)
    assert plain.pipeline.engines[0].scheduler.stats.batched_units > before
    for (prompt, seed), result in zip(requests, results):
        np.testing.assert_array_equal(result.frames, plain.generate_video(prompt, seed=seed, **WIDE_IN_TIME).frames)


def test_the_server_shows_reserved_memory_and_the_requests_waiting_for_it(one_at_a_time, tmp_path):
    pytest.importorskip("fastapi")
    from serve_support import Server

    from composer.serve.app import ServeConfig
    from composer.serve.requests import ServerLimits

    gen, admission = one_at_a_time, one_at_a_time.memory_guard.admission
    waits = admission.stats().waits
    srv = Server(lambda: gen, ServeConfig(output_dir=tmp_path / "serve", limits=ServerLimits(max_steps=1000)))
    srv.wait_ready()

    def metric(name: str) -> float:
        text = srv.request("GET", "/metrics").body.decode()
        return next(float(line.split()[1]) for line in text.splitlines() if line.split(" ")[0] == name)

    share = gen._checked("a", None, None, dict(SHORT), 0)[2]
    hold = admission.reserve(share)  # a running request, for the test: both jobs wait for it
    try:
        jobs = [srv.request("POST", "/v1/videos", {"prompt": p, "seed": 1, **SHORT}).json
                for p in ("a red circle", "a blue square")]
        wait_until(lambda: metric("composer_memory_waiting") == 2)
        assert metric("composer_memory_reserved_bytes") == share.held
        assert metric("composer_memory_weights_bytes") == admission.weights
        assert metric("composer_memory_room_bytes") == admission.room
        hold.release()
        for job in jobs:
            assert srv.wait(job["id"], timeout=120)["status"] == "completed"
        wait_until(lambda: metric("composer_memory_reserved_bytes") == 0)
        assert metric("composer_memory_waiting") == 0 and metric("composer_memory_waits_total") == waits + 2
    finally:
        hold.release()
        srv.stop()


# -- offload = auto under torchrun ----------------------------------------------------------------------------

TORCHRUN_REQUEST = dict(prompt="a red circle moving left", seed=4, num_inference_steps=2)


def _auto_worker(rank: int, world: int, budgets: list[int], out_dir: str) -> None:
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler = Keep(level=logging.INFO)
    logging.getLogger("composer").addHandler(handler)
    try:
        gen = VideoGenerator.from_pretrained("shapes-t2v", device="cpu", offload="auto", memory_budget=budgets[rank],
                                             ulysses_degree=2, progress=False)
    finally:
        logging.getLogger("composer").removeHandler(handler)
    result = gen.generate_video(**TORCHRUN_REQUEST)
    torch.save({"offload": gen.pipeline.runtime.offload, "budget": gen.memory_guard.plan.budget,
                "latents": result.latents, "frames": torch.from_numpy(result.frames),
                "plans": [line for line in lines if line.startswith("memory plan")]}, f"{out_dir}/rank{rank}.pt")


@pytest.mark.slow
def test_offload_auto_under_torchrun_gives_every_rank_one_plan_and_one_process_video(plain, tmp_path):
    """Rank 1's budget fits only the disk tier, rank 0's everything: both ranks take disk and rank 1's budget,
    rank 0 logs the plan once, and the video equals one process's without offload."""
    from composer.memory import device_peak
    from composer.testing.distributed import spawn

    probe = VideoGenerator.from_pretrained(None, device="cpu", memory_budget=1e9, progress=False)
    guard = probe.memory_guard
    resident = device_peak(guard.predictor, "none", guard.plan.request)[0]
    streamed = device_peak(guard.predictor, "disk", guard.plan.request)[0]
    assert streamed < resident
    small = int((resident + streamed) / 2 * (1 + HEADROOM))
    spawn(_auto_worker, 2, [int(1e9), small], str(tmp_path), timeout_s=300)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [r["offload"] for r in ranks] == ["disk", "disk"] and [r["budget"] for r in ranks] == [small, small]
    assert len(ranks[0]["plans"]) == 1 and "rank 0: none" in ranks[0]["plans"][0] \
        and "rank 1: disk" in ranks[0]["plans"][0] and not ranks[1]["plans"]
    expected = plain.generate_video(**TORCHRUN_REQUEST)
    for rank, got in enumerate(ranks):
        torch.testing.assert_close(got["latents"], expected.latents, atol=1e-5, rtol=0)
        diff = np.abs(got["frames"].numpy().astype(int) - expected.frames.astype(int)).max()
        assert diff <= 1, f"rank {rank}: frames differ by {diff}"
