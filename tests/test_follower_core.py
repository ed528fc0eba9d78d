"""A follower rank's engine core (composer/engine/core.py `_follow`, composer/parallel/plan.py `PlanChannel.follow`)
without torchrun: rank 0's plans come from a script. A plan names units this rank's threads have not queued yet, and
one of those threads first waits for unplanned work (a decode) that only the same core runs: the core must go on
with that work while the plan waits, then run the plan once its units are there, in rank 0's order. (Waiting inside
the plan instead deadlocked a stream under torchrun until the plan's timeout: CI, 2026-11-27.) Rank 0's plans are
received on the channel's receiver thread: the core never blocks for one."""

from __future__ import annotations

import queue
import threading

import pytest

from composer.engine.batcher import CallBatcher
from composer.engine.core import EngineCore
from composer.errors import WorkerError
from composer.parallel.plan import PlanChannel


class ScriptedChannel(PlanChannel):
    """A follower's plan channel whose plans are rank 0's script (no process group)."""

    def __init__(self, plans: list, timeout_s: float = 30.0):
        self.rank, self.world, self.leader, self.timeout_s = 1, 2, False, timeout_s
        self.schedulers = []
        self._turn = threading.Lock()
        self._next = None
        self._init_receiver()
        self._plans: queue.Queue = queue.Queue()
        for plan in plans:
            self._plans.put(plan)
        self.received = threading.Event()

    def _share(self, plan):
        got = self._plans.get(timeout=self.timeout_s)
        self.received.set()
        return got


def _batcher(log: list, name: str) -> CallBatcher:
    def run(payloads):
        log.append((name, list(payloads)))
        return [f"{name}:{p}" for p in payloads]

    return CallBatcher(run)


def test_the_core_runs_unplanned_work_while_a_plan_waits_for_its_units_then_runs_plans_in_order():
    log: list = []
    planned, decodes = _batcher(log, "step"), _batcher(log, "decode")
    channel = ScriptedChannel([(0, [["stream", 1]]), (0, [["job", 0]])])
    channel.register(planned)
    core = EngineCore(lambda: [planned, decodes], name="test-follower")
    results: dict = {}

    def job():  # a unit rank 0 plans second: queued first, so the core receives the first plan at once
        results["job"] = planned.submit("k", "job step", plan_key=("job", 0))

    def stream():  # waits for its decode (unplanned: this core's side lane), then queues the step planned first
        assert channel.received.wait(30), "the core never received rank 0's first plan"
        results["decode"] = decodes.submit("d", "stream decode")
        results["stream"] = planned.submit("k", "stream step", plan_key=("stream", 1))

    threads = [threading.Thread(target=job), threading.Thread(target=stream)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    core.close()
    assert not any(t.is_alive() for t in threads), "a follower waiting inside a plan left a thread hanging"
    assert results == {"job": "step:job step", "decode": "decode:stream decode", "stream": "step:stream step"}
    assert [entry for entry in log if entry[0] == "step"] == [("step", ["stream step"]), ("step", ["job step"])]
    assert log.index(("decode", ["stream decode"])) < log.index(("step", ["stream step"]))


def test_a_plan_whose_units_never_come_fails_the_waiting_units_after_the_timeout():
    log: list = []
    planned = _batcher(log, "step")
    channel = ScriptedChannel([(0, [["other", 0]])], timeout_s=0.5)
    channel.register(planned)
    core = EngineCore(lambda: [planned], name="test-follower-timeout")
    try:
        with pytest.raises(WorkerError, match="this rank has not made"):
            planned.submit("k", "mine", plan_key=("mine", 0))
    finally:
        core.close()
    assert log == []


def test_the_core_goes_on_while_rank_0s_next_plan_is_on_its_way():
    """A unit of this rank waits, so its core asks for rank 0's next plan, which has not been sent yet: the receive
    waits on the channel's own thread, and the core runs other work meanwhile (a decode completes); the plan's
    arrival wakes the core, which runs it."""
    log: list = []
    planned, decodes = _batcher(log, "step"), _batcher(log, "decode")
    channel = ScriptedChannel([])  # rank 0 has sent nothing yet
    channel.register(planned)
    core = EngineCore(lambda: [planned, decodes], name="test-follower-receiving")
    results: dict = {}
    job = threading.Thread(target=lambda: results.setdefault("job", planned.submit("k", "job step",
                                                                                   plan_key=("job", 0))))
    try:
        job.start()
        decoded = threading.Thread(target=lambda: results.setdefault("decode", decodes.submit("d", "a decode")))
        decoded.start()
        decoded.join(timeout=30)
        assert not decoded.is_alive(), "the core blocked receiving rank 0's plan and ran nothing else"
        assert results == {"decode": "decode:a decode"} and channel.outstanding
        channel._plans.put((0, [["job", 0]]))  # rank 0 sends the plan
        job.join(timeout=30)
        assert not job.is_alive()
    finally:
        core.close()
    assert results["job"] == "step:job step"
