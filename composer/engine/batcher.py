"""Unit queues: what the engine core runs (composer/engine/core.py).

`UnitQueue` is the protocol of the step scheduler (engine/scheduler.py), the decode batcher (`CallBatcher`, below)
and the text forward batcher (text/batching.py): units queued under one condition, a policy (`due`: when the next
batch may start; `take`: which units it holds), `execute` (the batch's one call) and `finish` (results handed back).
The model's engine core is the only executor of every queue; `held()` gathers units so the first batch after the
hold takes them together.

CallBatcher: concurrent calls of one function (the VAE decode of concurrent requests) batched as they queue up.
A call made while no call runs runs at once, alone; calls made while one runs wait, and the next batch takes every
waiting call with the same key (up to `max_rows` rows). An idle batcher waits for partners at most `settle_s` (and at
most a quarter of a recent run's time), and only while `active()` says other requests are running. Its batches run
on the core's side lane.

Under a parallel layout whose decodes hold collectives (a VAE decode split over the ranks), rank 0 plans every call:
its batcher announces each batch (the calls' `plan_key`s: request key and position, the same on every rank) on the
process's PlanChannel (composer/parallel/plan.py), in one order with the transformer calls, and the other ranks run
exactly those batches (`take_planned` once this rank has them, `run_taken`), so their collectives meet.

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

from composer.logging import get_logger
from composer.platform.openmp import release_workers

logger = get_logger(__name__)

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
    priority: int = 0
    arrived: float = 0.0
    result: Any = None
    error: BaseException | None = None
    done: bool = False
    on_done: Callable[[_Call], None] | None = None  # a task's (enqueue): called once done, the queue's lock held


class UnitQueue:
    """What the step scheduler, the decode batcher and the text forward batcher share: units queued under one
    condition `_cv`, a policy that says when a batch is due (`due`) and which units it takes (`take`), how a batch
    runs (`execute`, no lock held) and how its units are handed back (`finish`).

    Who runs the batches: the queue's `core` (composer/engine/core.py), one executor per loaded model, on its own
    thread (`lane` "main": the device's work, in plan order) or its second lane ("side": long work such as a VAE
    decode, so the others' steps go on meanwhile). A caller that submits from a thread waits for its unit's
    result and never runs a batch (on a rank other than 0 of a parallel layout the core runs the batches rank 0's
    plans name). Only a queue without a running core (used on its own) runs batches on the waiting caller's thread."""

    core: Any = None  # the EngineCore running this queue's batches (set by EngineCore.attach)
    lane: str = "main"
    planner: Any = None  # a parallel layout's PlanChannel (composer/parallel/plan.py)
    _running: bool = False

    # -- holding: while held no batch starts and the units submitted meanwhile gather, so the first batch after
    # release takes them together (what makes "these requests share a call" independent of two threads
    # overlapping in time: tests, and callers that submit several requests as one)
    _holds = 0  # while above 0 no call starts

    def pending_count(self) -> int:
        """(Lock held) What `wait_for_units` counts: the units queued."""
        return len(self._pending)

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
            self._wake_core()

    def wait_for_units(self, count: int, timeout: float) -> bool:
        """Wait until `pending_count()` reaches `count` (with `held()`); False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self.pending_count() >= count, timeout)

    def _wake_core(self) -> None:
        if self.core is not None:
            self.core.wake()

    # -- the policy (lock held) -------------------------------------------------------------------------
    def due(self) -> float | None:
        """0.0: a batch should start now; a float: look again in that many seconds; None: nothing to run now
        (empty, held, or a batch running: its end wakes the executor)."""
        if self._running or self._holds or not self._pending:
            return None
        return 0.0

    def take(self) -> Any:
        """The next batch's units, off the queue (the queue is marked running)."""
        raise NotImplementedError

    def execute(self, batch: Any) -> None:
        """Run a batch (no lock held): each unit gets its result or the batch's error."""
        raise NotImplementedError

    def finish(self, batch: Any) -> None:
        """(Lock held) The batch ran: its units are done and their waiters woken."""
        raise NotImplementedError

    # -- who runs it ----------------------------------------------------------------------------------
    def next_batch(self) -> tuple[Any, float | None]:
        """The scheduler's question (EngineCore.schedule): (the batch due now, taken off the queue and the queue
        marked running; or None, with how long until one may be: None when nothing can run, or a batch runs and its
        end wakes the executor). Nothing runs here."""
        if self.planner is not None and not self.planner.leader:
            return None, None  # a follower's batches are the ones rank 0 names (EngineCore._follow runs them)
        with self._cv:
            wait = self.due()
            if wait != 0.0:
                return None, wait
            return self.take(), 0.0

    def _run_batch(self, batch: Any) -> None:
        try:
            if self.planner is None:
                self.execute(batch)
            else:  # rank 0: the other ranks are told this batch before it runs, in one order with every other call
                self.planner.lead(self, self.plan_of(batch), lambda: self.execute(batch))
        except BaseException as exc:  # noqa: BLE001 - the plan could not go out: every unit of the batch fails
            for unit in self.units_of(batch):
                unit.error = unit.error or exc
        finally:
            with self._cv:
                self.finish(batch)
            self._wake_core()

    def units_of(self, batch: Any) -> list:
        return list(batch)

    def fail_pending(self, error: BaseException) -> None:
        """Every queued unit ends with `error` (the queue's policy itself failed: nobody is left waiting)."""
        with self._cv:
            for unit in self._pending:
                unit.error, unit.done = error, True
                on_done = getattr(unit, "on_done", None)
                if on_done is not None:
                    on_done(unit)
            self._pending = []
            self._cv.notify_all()

    def plan_of(self, batch: Any) -> list:
        """What names this batch's units on every rank (rank 0's plan)."""
        return [self.plan_name(u) for u in self.units_of(batch)]

    def plan_name(self, unit: Any) -> Any:
        """A unit's name on every rank (a request's key and its position in it)."""
        raise NotImplementedError

    def batch_of(self, units: list) -> Any:
        """A batch of these units, as `take` makes one (the queue marked running)."""
        return units

    what = "a unit of a request"  # what a planned unit is, in the error when rank 0 names one this rank never gets

    # -- another rank than 0 of a parallel layout: rank 0's plans decide every batch ---------------------
    def take_planned(self, plan: list) -> Any:
        """(No lock held; this rank is not 0) The batch of the units rank 0's plan names, in its order, off the
        queue (marked running), or None while this rank's callers have not submitted them all."""
        from composer.parallel.plan import match_planned

        with self._cv:
            if self._running:
                return None
            found = match_planned(self._pending, plan, self.plan_name)
            if found is None:
                return None
            units, self._pending = found
            self._running = True
            return self.batch_of(units)

    def run_taken(self, batch: Any) -> None:
        """(No lock held) Run a batch `take_planned` gave, as rank 0 did, and hand out the results."""
        try:
            self.execute(batch)
        finally:
            with self._cv:
                self.finish(batch)

    def _queue(self, unit: Any) -> None:
        """(Lock held) Add a unit and tell whoever runs batches."""
        self._pending.append(unit)
        self._cv.notify_all()
        self._wake_core()

    def _await(self, unit: Any) -> None:
        """(Lock held) Until `unit` is done: the core runs it (this thread only waits; on a rank other than 0 the
        core runs the batches rank 0's plans name). Without a running core (a queue used on its own, a core that
        stopped) this thread runs a batch itself when one is due."""
        released = False
        while not unit.done:
            if self.core is not None and self.core.running and not self.core.on_core_thread():
                if not released:  # this thread only waits: its OpenMP team would slow the core's (not under the
                    released = True  # lock: freeing a team joins its threads, and the core takes batches under it)
                    self._cv.release()
                    try:
                        release_workers()
                    finally:
                        self._cv.acquire()
                    continue  # the unit may be done meanwhile
                self._cv.wait(timeout=1.0)
                continue
            if self.planner is not None and not self.planner.leader:
                raise RuntimeError("a follower rank's unit needs its engine core, which runs rank 0's plans")
            wait = self.due()
            if wait == 0.0:
                batch = self.take()
                self._cv.release()
                try:
                    self._run_batch(batch)
                finally:
                    self._cv.acquire()
            else:
                self._cv.wait(timeout=wait)


class CallBatcher(UnitQueue):
    """`submit(key, payload, rows)` -> `run_batch([payload, ...])[i]`, batching calls of equal keys that queue up
    while another runs (see the module docstring). `lock`: held around every run (a module's lock). `lane`: where
    the core runs its batches ("side", the decodes': a decode does not hold up the other requests' steps; "main",
    the text forwards'). `by_priority`: a batch starts with the highest-priority call (else the oldest); `fits(rows,
    calls, call)`: a budget beside `max_rows` that a call must fit to join (the text forwards' padded tokens)."""

    def __init__(self, run_batch: Callable[[list[Any]], list[Any]], lock: Any = None, max_rows: int | None = None,
                 settle_s: float = 0.0, active: Callable[[], int] | None = None, lane: str = "side",
                 by_priority: bool = False, fits: Callable[[int, list[Any], Any], bool] | None = None):
        self.lane = lane
        self.by_priority = by_priority
        self.fits = fits
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
        self._current: list[_Call] = []  # the calls of the batch running now
        self._seq = itertools.count()
        # A parallel layout's PlanChannel when the calls hold collectives (set by the parallel hook): rank 0 plans
        # each batch, the other ranks run the batches it names.
        self.planner: Any = None
        self.plan_index: int | None = None

    def submit(self, key: Any, payload: Any, rows: int = 1, plan_key: Any = None, priority: int = 0) -> Any:
        """`plan_key`: what names this call on every rank (a request key and a position), for planned batchers."""
        call = _Call(key, payload, rows, next(self._seq), plan_key, priority, arrived=time.monotonic())
        with self._cv:
            self._queue(call)
            self._await(call)
        if call.error is not None:
            raise call.error
        return call.result

    def enqueue(self, key: Any, payload: Any, rows: int = 1, plan_key: Any = None, priority: int = 0, *,
                on_done: Callable[[_Call], None]) -> _Call:
        """As `submit`, without waiting: `on_done(call)` once it has run (its `result` or `error` set), on the thread
        that ran it (a task of the engine core: composer/engine/loop.py `Queued`)."""
        call = _Call(key, payload, rows, next(self._seq), plan_key, priority, arrived=time.monotonic(),
                     on_done=on_done)
        with self._cv:
            self._queue(call)
        return call

    def due(self) -> float | None:
        if self._running or self._holds or not self._pending:
            return None
        others = (self.active() if self.active is not None else 0) - len(self._pending)
        left = min(self.settle_s, 0.25 * self.run_seconds) - (time.monotonic() - self._pending[0].arrived)
        if others > 0 and left > 0:
            return left
        return 0.0

    def take(self) -> tuple[list[_Call], float]:
        order = sorted(self._pending, key=lambda c: (-c.priority, c.seq)) if self.by_priority else self._pending
        first = order[0]
        chosen, rows = [first], first.rows
        if first.key is not None:
            for call in order[1:]:
                if (call.key == first.key and (self.max_rows is None or rows + call.rows <= self.max_rows)
                        and (self.fits is None or self.fits(rows, chosen, call))):
                    chosen.append(call)
                    rows += call.rows
        taken = {id(c) for c in chosen}
        self._pending = [c for c in self._pending if id(c) not in taken]
        self._running, self._current = True, chosen
        return chosen, time.perf_counter()

    def in_flight(self) -> int:
        """Calls queued or running now (each a request's: those requests are busy here, not in a denoising loop).
        Read without the lock: a hint for another queue's policy."""
        return len(self._pending) + len(self._current)

    def units_of(self, batch: tuple[list[_Call], float]) -> list[_Call]:
        return batch[0]

    def plan_name(self, call: _Call) -> Any:
        return call.plan_key

    def batch_of(self, calls: list[_Call]) -> tuple[list[_Call], float]:
        self._current = calls
        return calls, time.perf_counter()

    what = "a decode of a video"

    def execute(self, batch: tuple[list[_Call], float]) -> None:
        calls = batch[0]
        try:
            with self.lock if self.lock is not None else nullcontext():
                results = self.run_batch([c.payload for c in calls])
            for call, result in zip(calls, results):
                call.result = result
        except BaseException as exc:  # noqa: BLE001 - every call of the failed batch gets the error
            for call in calls:
                call.error = exc

    def finish(self, batch: tuple[list[_Call], float]) -> None:
        """(Lock held) Hand out a batch's results and wake its callers."""
        calls, started = batch
        self._running, self._current = False, []
        elapsed = time.perf_counter() - started
        self.run_seconds = elapsed if not self.calls else 0.8 * self.run_seconds + 0.2 * elapsed
        self.calls += len(calls)
        if len(calls) > 1:
            self.batched_calls += len(calls)
        for call in calls:
            call.done = True
            if call.on_done is not None:
                try:
                    call.on_done(call)
                except Exception:  # noqa: BLE001 - a waiter's callback must not break the batch's other calls
                    logger.exception("a call's completion callback failed")
        self._cv.notify_all()
