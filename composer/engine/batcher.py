"""CallBatcher: concurrent calls of one function batched as they queue up (the VAE decode of concurrent requests).

A call made while no call runs runs at once, alone. A call made while another runs waits; when the running call
ends, every waiting call with the same key (up to `max_rows` rows) runs as one batched call. An idle batcher waits
for partners at most `settle_s` (and at most a quarter of a recent run's time), and only while `active()` says other
requests are running.

Under a parallel layout whose decodes hold collectives (a VAE decode split over the ranks), rank 0 plans every call:
its batcher announces each batch (the calls' `plan_key`s: request key and position, the same on every rank) on the
process's PlanChannel (composer/parallel/plan.py), in one order with the transformer calls, and the other ranks run
exactly those batches (`run_planned`), so their collectives meet.

`module_lock(module)`: one lock per module object, shared by everything in the process that must not run a
module's stateful calls concurrently (diffusers' Wan VAE keeps its causal cache on the module).
"""

from __future__ import annotations

import itertools
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

_locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_locks_guard = threading.Lock()


def module_lock(module: Any) -> threading.Lock:
    """The process-wide lock of `module` (made on first use)."""
    with _locks_guard:
        lock = _locks.get(module)
        if lock is None:
            lock = _locks[module] = threading.Lock()
        return lock


@dataclass(eq=False)
class _Call:
    key: Any
    payload: Any
    rows: int
    seq: int
    plan_key: Any = None  # the call's identity on every rank of a parallel layout (planned batchers)
    result: Any = None
    error: BaseException | None = None
    done: bool = False


class Holdable:
    """`held()` and `wait_for_units(n)` for a batcher whose callers wait on `self._cv` for `self._pending` (the
    decode's CallBatcher, the StepScheduler, the text ForwardBatcher): while held no call starts and the units
    submitted meanwhile gather, so the first call after release takes them together. This is what makes "these
    requests share a call" independent of two threads overlapping in time (tests, and callers that submit several
    requests as one)."""

    _holds = 0  # while above 0 no call starts

    def pending_count(self) -> int:
        """(Lock held) What `wait_for_units` counts: the units queued."""
        return len(self._pending)

    def on_release(self) -> None:
        """(Lock held) Called when the last hold ends, after the waiting callers were woken."""

    @contextmanager
    def held(self) -> Iterator[None]:
        """No call starts while held."""
        with self._cv:
            self._holds += 1
        try:
            yield
        finally:
            with self._cv:
                self._holds -= 1
                self._cv.notify_all()
                self.on_release()

    def wait_for_units(self, count: int, timeout: float) -> bool:
        """Wait until `pending_count()` reaches `count` (with `held()`); False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self.pending_count() >= count, timeout)


class CallBatcher(Holdable):
    """`submit(key, payload, rows)` -> `run_batch([payload, ...])[i]`, batching calls of equal keys that queue up
    while another runs (see the module docstring). `lock`: held around every run (a module's lock)."""

    def __init__(self, run_batch: Callable[[list[Any]], list[Any]], lock: Any = None, max_rows: int | None = None,
                 settle_s: float = 0.0, active: Callable[[], int] | None = None):
        self.run_batch = run_batch
        self.lock = lock
        self.max_rows = max_rows
        self.settle_s = settle_s  # an idle batcher waits this long for more calls while `active()` says others run
        self.active = active
        self.run_seconds = 0.0  # a running average of a run's time: settling never costs more than 1/4 of one
        self.calls = 0
        self.batched_calls = 0  # calls that ran together with at least one other
        self._cv = threading.Condition()
        self._pending: list[_Call] = []
        self._running = False
        self._seq = itertools.count()
        # A parallel layout's PlanChannel when the calls hold collectives (set by the parallel hook): rank 0 plans
        # each batch, the other ranks run the batches it names.
        self.planner: Any = None
        self.plan_index: int | None = None
    def submit(self, key: Any, payload: Any, rows: int = 1, plan_key: Any = None) -> Any:
        """`plan_key`: what names this call on every rank (a request key and a position), for planned batchers."""
        call = _Call(key, payload, rows, next(self._seq), plan_key)
        arrived = time.monotonic()
        with self._cv:
            self._pending.append(call)
            self._cv.notify_all()
            while not call.done:
                if self.planner is not None and not self.planner.leader:
                    self._follow(call)
                    continue
                if self._running or self._holds:
                    self._cv.wait()
                    continue
                others = (self.active() if self.active is not None else 0) - len(self._pending)
                left = min(self.settle_s, 0.25 * self.run_seconds) - (time.monotonic() - arrived)
                if others > 0 and left > 0:
                    self._cv.wait(timeout=left)
                    continue
                self._run_once()
        if call.error is not None:
            raise call.error
        return call.result

    def _take(self) -> list[_Call]:
        first = self._pending[0]
        chosen, rows = [first], first.rows
        if first.key is not None:
            for call in self._pending[1:]:
                if call.key == first.key and (self.max_rows is None or rows + call.rows <= self.max_rows):
                    chosen.append(call)
                    rows += call.rows
        taken = {id(c) for c in chosen}
        self._pending = [c for c in self._pending if id(c) not in taken]
        return chosen

    def _run_once(self) -> None:
        calls = self._take()
        self._running = True
        self._cv.release()
        started = time.perf_counter()
        try:
            if self.planner is None:
                self._run(calls)
            else:  # rank 0: the other ranks are told this batch before it runs, in one order with every other call
                self.planner.lead(self, [c.plan_key for c in calls], lambda: self._run(calls))
        except BaseException as exc:  # noqa: BLE001 - the plan could not go out: every call of the batch fails
            for call in calls:
                call.error = call.error or exc
        finally:
            self._cv.acquire()
            self._finished(calls, started)

    def _run(self, calls: list[_Call]) -> None:
        try:
            with self.lock if self.lock is not None else nullcontext():
                results = self.run_batch([c.payload for c in calls])
            for call, result in zip(calls, results):
                call.result = result
        except BaseException as exc:  # noqa: BLE001 - every call of the failed batch gets the error
            for call in calls:
                call.error = exc

    def _finished(self, calls: list[_Call], started: float) -> None:
        """(Lock held) Hand out a batch's results and wake its callers."""
        self._running = False
        elapsed = time.perf_counter() - started
        self.run_seconds = elapsed if not self.calls else 0.8 * self.run_seconds + 0.2 * elapsed
        self.calls += len(calls)
        if len(calls) > 1:
            self.batched_calls += len(calls)
        for call in calls:
            call.done = True
        self._cv.notify_all()

    # -- another rank than 0 of a parallel layout: rank 0's plans decide every batch ---------------------
    def _follow(self, call: _Call) -> None:
        """(Lock held, this rank is not 0) Until `call` is done: whichever waiting thread of the process gets the
        plan channel receives rank 0's next plan and runs it (this batcher's or a step scheduler's)."""
        self._cv.release()
        try:
            if not self.planner.follow_once(stop=lambda: call.done):
                time.sleep(0.002)
        except BaseException as exc:  # noqa: BLE001 - no plan can come (a peer failed): nobody here goes on
            with self._cv:
                for waiting in self._pending:
                    waiting.error, waiting.done = exc, True
                self._pending = []
                call.error, call.done = call.error or exc, True
                self._cv.notify_all()
        finally:
            self._cv.acquire()

    def run_planned(self, plan: list[Any]) -> None:
        """(No lock held; this rank is not 0) Take the calls rank 0's plan names, in its order (waiting for this
        rank's threads to submit them), run them as one batch and hand out the results."""
        with self._cv:
            calls = self._take_planned(plan)
            self._running = True
        started = time.perf_counter()
        self._run(calls)
        with self._cv:
            self._finished(calls, started)

    def _take_planned(self, plan: list[Any]) -> list[_Call]:
        from composer.parallel.plan import take_planned

        chosen, self._pending = take_planned(self._pending, plan, lambda c: c.plan_key, self._cv,
                                             self.planner.timeout_s, "a decode of a video")
        return chosen
