"""Requests as tasks: a request's state is a suspended Python generator, advanced one unit at a time by one loop.

A *task* is a generator that yields what it waits for, and reads the answer from that object once resumed:

    step = ModelStep(engine, latents, timestep, branches, merged, kind, step_info)
    yield step; pred = step.outcome()                 # a transformer unit (or: pred = yield from wait_for(step))
    work = Blocking(fn)
    yield work; value = work.outcome()                # other work (a stage, a decode, a file)

The answer travels on the object (`result`, or `error`, which `outcome()` raises where the task waits), so a
wait can pass unchanged through generators that only relay it: a causal stream's blocks go through the decoding
stage's `for block in upstream` loop, which yields the waits it meets as they are.

`drive(task)` runs a task on the calling thread: each ModelStep goes to its engine at once (through the step
scheduler when there is one, waiting in `StepScheduler.submit` as a thread-per-request caller does), each Blocking
runs inline. This is how `generate_video` runs: the code of a task *is* the code of the blocking call.

`RequestLoop` runs many tasks on one thread, none of them holding a thread between units:
- a ModelStep is queued on its engine's scheduler (`StepScheduler.enqueue`) and the loop runs the scheduler's
  iterations (`StepScheduler.poll`): compatible units of every task (and of any thread calling `generate_video`
  meanwhile) share transformer calls exactly as threads' units do, so each output is the one a lone call makes;
- a Blocking (text encoding, the VAE decode, waiting for KV pages, writing a file) runs on a pool of
  `stage_threads` threads, which a task holds only while that work runs;
- each resumption runs with the task's RequestContext as the thread's request (its cancel token, its priority) and
  under `torch.inference_mode`.

`VideoGenerator.submit_video` / `agenerate_video`, `VideoStream.next_task` and `composer serve`'s jobs and streams
run this way.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from composer.engine.scheduler import RequestContext, running_request
from composer.logging import get_logger

logger = get_logger(__name__)

Task = Generator[Any, Any, Any]
MAX_WAITERS = 1024  # threads for Blocking work that waits on other requests (made only while such work waits)


class Wait:
    """What a task waits for; whoever does it sets `result` or `error`, then the task reads `outcome()`."""

    result: Any = None
    error: BaseException | None = None

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.result

    def run_here(self, request: RequestContext) -> None:
        """Do it on this thread, now; the answer (or the error) on the object."""
        try:
            self.result = self._run(request)
        except BaseException as exc:  # noqa: BLE001 - the task's, raised where it waits
            self.error = exc

    def _run(self, request: RequestContext) -> Any:
        raise NotImplementedError


def wait_for(item: Wait):
    """In a task: `value = yield from wait_for(item)`."""
    yield item
    return item.outcome()


def is_wait(item: Any) -> bool:
    return isinstance(item, Wait)


@dataclass(eq=False)
class ModelStep(Wait):
    """A task waits for its engine's transformer to predict its guidance branches (one output per branch)."""

    engine: Any  # composer.engine.engine.DenoisingEngine
    latents: torch.Tensor
    timestep: torch.Tensor
    branches: list
    merged: Any
    kind: str
    step: Any

    @torch.inference_mode()
    def _run(self, request: RequestContext) -> list[torch.Tensor]:
        """On the calling thread (a task driven by `drive`): what a thread-per-request loop does (under inference
        mode, as every transformer call is)."""
        engine = self.engine
        if engine.scheduler is None:
            previous, engine._step = engine._step, self.step
            try:
                return engine._forward_branches(self.latents, self.timestep, self.branches, self.kind, self.merged)
            finally:
                engine._step = previous
        return engine.scheduler.submit(self.latents, self.timestep, self.branches, self.merged, self.kind, request,
                                       self.step)


@dataclass(eq=False)
class Blocking(Wait):
    """A task waits for `fn()` (work that is not a transformer unit: a stage, a file write). `waits`: `fn` may wait
    for other requests to make progress (a place at the gate during an adapter switch, KV pages under a memory
    budget): a RequestLoop runs it off its stage threads, which those requests need to finish."""

    fn: Callable[[], Any]
    waits: bool = False

    def _run(self, request: RequestContext) -> Any:
        return self.fn()


def drive(task: Task, request: RequestContext | None = None) -> Any:
    """Run `task` to its end on this thread (each thing it waits for is done here, now); its return value."""
    from composer.engine.scheduler import current_request

    while True:
        try:
            item = next(task)
        except StopIteration as stop:
            return stop.value
        if not isinstance(item, Wait):
            task.close()
            raise TypeError(f"a task yielded {type(item).__name__}; expected ModelStep or Blocking")
        item.run_here(request or current_request() or RequestContext())


@dataclass(eq=False)
class _Task:
    gen: Task
    context: RequestContext
    future: Future


class RequestLoop:
    """Advances tasks on one thread (see the module docstring). `schedulers()`: the step schedulers whose
    iterations this loop runs (the pipeline's engines'). Started on the first `submit`; a daemon thread."""

    def __init__(self, schedulers: Callable[[], list], stage_threads: int = 4, name: str = "composer-loop"):
        if stage_threads < 1:
            raise ValueError(f"stage_threads must be >= 1, got {stage_threads}")
        self._schedulers = schedulers
        self.stage_threads = stage_threads
        self.name = name
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._ready: deque[_Task] = deque()
        self._tasks: set[_Task] = set()
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._waiters: ThreadPoolExecutor | None = None
        self._closed = False

    # -- what callers use ------------------------------------------------------------------------------
    def submit(self, task: Task, context: RequestContext) -> Future:
        """Start `task` (a generator not yet started) as request `context`; a Future of its return value. The
        future's callbacks run on the loop's thread: keep them short (hand longer work to another thread)."""
        future: Future = Future()
        future.set_running_or_notify_cancel()
        entry = _Task(task, context, future)
        with self._lock:
            if self._closed:
                raise RuntimeError("this generator's request loop is closed")
            self._tasks.add(entry)
            if self._thread is None:
                self._pool = ThreadPoolExecutor(self.stage_threads, thread_name_prefix=f"{self.name}-stage")
                # work that waits on other requests (Blocking.waits): never on the stage threads they need
                self._waiters = ThreadPoolExecutor(MAX_WAITERS, thread_name_prefix=f"{self.name}-wait")
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        self._resume(entry)
        return future

    @property
    def active(self) -> int:
        """Tasks submitted and not finished."""
        with self._lock:
            return len(self._tasks)

    def close(self, timeout: float = 30.0) -> None:
        """Refuse new tasks, let the running ones end, stop the thread and the stage pool."""
        with self._lock:
            self._closed = True
            thread, pool = self._thread, self._pool
        self._wake.set()
        if thread is not None:
            thread.join(timeout=timeout)
        if pool is not None:
            pool.shutdown(wait=False)
        if self._waiters is not None:
            self._waiters.shutdown(wait=False)

    # -- the loop thread ---------------------------------------------------------------------------------
    def _resume(self, entry: _Task) -> None:
        """(Any thread) `entry`'s wait is over (its answer is on the object it yielded): the loop resumes it."""
        with self._lock:
            self._ready.append(entry)
        self._wake.set()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - a bug here must fail the tasks, never leave them waiting
            logger.exception("the request loop stopped")
            with self._lock:
                self._closed = True
                tasks, self._tasks = list(self._tasks), set()
            for entry in tasks:
                if not entry.future.done():
                    entry.future.set_exception(RuntimeError(f"the request loop stopped: {type(exc).__name__}: {exc}"))

    def _loop(self) -> None:
        for scheduler in self._schedulers():  # a call another thread runs may leave one of ours due: wake up then
            scheduler.listeners.append(self._wake.set)
        with torch.inference_mode():
            while True:
                self._wake.clear()
                advanced = self._advance_ready()
                ran, wait = self._run_iterations()
                with self._lock:
                    if self._closed and not self._tasks:
                        return
                    busy = bool(self._ready)
                if advanced or ran or busy:
                    continue
                self._wake.wait(timeout=wait if wait is not None else 1.0)

    def _advance_ready(self) -> bool:
        with self._lock:
            ready = list(self._ready)
            self._ready.clear()
        for entry in ready:
            self._advance(entry)
        return bool(ready)

    def _run_iterations(self) -> tuple[bool, float | None]:
        """Run every scheduler iteration that is due; (whether one ran, the shortest wait until one may be)."""
        ran, wait = False, None
        for scheduler in self._schedulers():
            try:
                left = scheduler.poll()
            except Exception:  # noqa: BLE001 - a call's error went to its units; the loop must go on
                logger.exception("a scheduler iteration failed")
                left = 0.0
            if left == 0.0:
                ran = True
            elif left is not None:
                wait = left if wait is None else min(wait, left)
        return ran, wait

    def _advance(self, entry: _Task) -> None:
        """Run `entry` up to its next wait and start that wait (or finish it)."""
        try:
            with running_request(entry.context):
                item = next(entry.gen)
        except StopIteration as stop:
            self._finish(entry, result=stop.value)
            return
        except BaseException as exc:  # noqa: BLE001 - the task's error is its future's
            self._finish(entry, error=exc)
            return
        try:
            if isinstance(item, ModelStep):
                scheduler = item.engine.scheduler
                if scheduler is None or scheduler.planner is not None:
                    raise RuntimeError("a task's transformer unit needs its engine's step scheduler (not planned)")

                def done(unit, item=item) -> None:
                    item.result, item.error = unit.result, unit.error
                    self._resume(entry)

                scheduler.enqueue(item.latents, item.timestep, item.branches, item.merged, item.kind, entry.context,
                                  item.step, on_done=done)
            elif isinstance(item, Blocking):
                assert self._pool is not None and self._waiters is not None
                work = (self._waiters if item.waits else self._pool).submit(_blocking, item, entry.context)
                work.add_done_callback(lambda _: self._resume(entry))
            else:
                raise TypeError(f"a task yielded {type(item).__name__}; expected ModelStep or Blocking")
        except BaseException as exc:  # noqa: BLE001 - the wait could not start: the task ends with the error
            with running_request(entry.context):
                entry.gen.close()
            self._finish(entry, error=exc)

    def _finish(self, entry: _Task, result: Any = None, error: BaseException | None = None) -> None:
        with self._lock:
            self._tasks.discard(entry)
        if error is not None:
            entry.future.set_exception(error)
        else:
            entry.future.set_result(result)


def _blocking(item: Blocking, context: RequestContext) -> None:
    with running_request(context), torch.inference_mode():
        item.run_here(context)
