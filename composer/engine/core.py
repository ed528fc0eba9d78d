"""EngineCore: one per loaded model, the only thing that runs its model work.

    client (generate_video on any thread, submit_video, agenerate_video, a server's job, TextGenerator)
        -- submit(task) / a unit --> EngineCore -- a Future, or the unit's result --> client

The core owns its pipeline's *unit queues* (composer/engine/batcher.py `UnitQueue`): every denoising engine's step
scheduler (transformer steps and causal passes), every decoding stage's batcher (VAE decodes, streamed chunks) and
a text model's forward batcher. Each queue is a policy: `due()` says when its next batch may start, `take()` which
units it holds (priorities, deadlines, compatibility, row, token and memory budgets), `execute()` runs it,
`finish()` hands results back. The core's executor thread is the one place those batches run:

    loop   advance every task whose wait is over (its Python generator, up to its next wait)
           schedule: every queue's policy gives the batch due now (taken off its queue), nothing runs yet
           execute: each batch runs on the core's thread ("main" lane: the device's work, in order) or on its
           second lane ("side": long work such as a VAE decode, so the others' steps go on meanwhile)
           sleep until a unit is queued, a batch ends or a queue's wait is over

A request is either a *task* (a generator yielding `ModelStep` and `Blocking` waits: composer/engine/loop.py), which
no thread holds between its units, or code on a caller's thread whose units wait in their queue (`submit` blocks
that thread until the core has run the unit): the batches are the same either way, so a request's output does not
depend on how it was submitted. Blocking work (text encoding, writing a file) runs on the core's stage threads
(`stage_threads`), held only while it runs. A task that waits for admission (a memory reservation, KV pages, a
place on the pipeline: `Admit`) leaves its ticket with the core, which polls it when its queue changes (its cancel
token within CANCEL_POLL_S). Nothing waits inside the core on behalf of a request.

Parallel layouts: rank 0's core runs its queues' batches and announces each one on the process's PlanChannel first
(composer/parallel/plan.py); on the other ranks the core receives rank 0's next plan whenever a unit waits and runs
exactly that batch (`_follow`): one executor per rank, and every rank's calls in rank 0's order.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from composer.admission import CANCEL_POLL_S
from composer.engine.loop import Admit, Blocking, ModelStep, Queued, Task
from composer.engine.scheduler import RequestContext, running_request
from composer.logging import get_logger
from composer.parallel.plan import Follow
from composer.platform.openmp import release_workers

logger = get_logger(__name__)

FOLLOW_POLL_S = 0.01  # a follower core whose plan channel another core of the process holds looks again this soon


@dataclass(eq=False)
class _Task:
    gen: Task
    context: RequestContext
    future: Future


class EngineCore:
    """The executor of one loaded model's unit queues and tasks (see the module docstring). `queues()`: the unit
    queues it runs (asked again whenever the loop starts an iteration, so queues made later join); the thread is
    started by the first submit or queued unit; a daemon thread."""

    def __init__(self, queues: Callable[[], list], stage_threads: int = 4, name: str = "composer-core",
                 device: Any = None):
        if stage_threads < 1:
            raise ValueError(f"stage_threads must be >= 1, got {stage_threads}")
        self._queues = queues
        self.stage_threads = stage_threads
        self.name = name
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._ready: deque[_Task] = deque()
        self._tasks: set[_Task] = set()
        self._admitting: list[tuple[_Task, Admit]] = []  # tasks whose ticket waits in an admission queue
        self._admission_changed = False  # a queue they wait on changed since they were last polled
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._side: ThreadPoolExecutor | None = None
        self._closed = False
        self.submitted = 0  # tasks submitted since the core was made
        # a CUDA device's index is per thread: the core's threads work on the model's device (a rank's own GPU)
        self.device = torch.device(device) if device is not None else None
        self.attach()

    # -- what clients use ------------------------------------------------------------------------------
    def attach(self) -> list:
        """Make this core the executor of every queue `queues()` lists (idempotent); the queues."""
        queues = [q for q in self._queues() if q is not None]
        for queue in queues:
            if queue.core is not self:
                queue.core = self
        return queues

    def submit(self, task: Task, context: RequestContext) -> Future:
        """Start `task` (a generator not yet started) as request `context`; a Future of its return value. The
        future's callbacks run on the core's thread: keep them short (hand longer work to another thread)."""
        future: Future = Future()
        future.set_running_or_notify_cancel()
        entry = _Task(task, context, future)
        with self._lock:
            if self._closed:
                raise RuntimeError("this model's engine core is closed")
            self._tasks.add(entry)
            self.submitted += 1
        self._start()
        self._resume(entry)
        return future

    def run(self, task: Task, context: RequestContext) -> Any:
        """`submit(task)` and wait for its result on this thread (a blocking call)."""
        if self.on_core_thread():
            raise RuntimeError("a blocking call was made on the engine core's own thread")
        future = self.submit(task, context)
        release_workers()  # this thread only waits now: its OpenMP team would slow the core's (platform/openmp.py)
        return future.result()

    def call(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run `fn(*args)` on one of the core's stage threads (work a client hands the core that is not a request's
        unit: a served body's check, a finished job's record); a Future of its result."""
        self._start()
        if self._pool is None:  # closed before it ever started
            raise RuntimeError("this model's engine core is closed")
        return self._pool.submit(_called, fn, args)

    def ensure_stage_threads(self, count: int) -> None:
        """At least `count` stage threads (blocking work that waits for other processes, as a parallel layout's
        sync points do, must always find one: each request at once may hold one)."""
        with self._lock:
            if count <= self.stage_threads:
                return
            self.stage_threads = count
            if self._pool is not None:  # started: a larger pool from now on (the old one's work runs to its end)
                old, self._pool = self._pool, ThreadPoolExecutor(count, thread_name_prefix=f"{self.name}-stage",
                                                                 initializer=self._on_device)
                old.shutdown(wait=False)

    def wake(self) -> None:
        """A unit was queued, a hold released or a batch ended: the loop looks at its queues again."""
        self._start()
        self._wake.set()

    @property
    def running(self) -> bool:
        """Whether the executor thread runs (a queue's caller then only waits for its unit)."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def on_core_thread(self) -> bool:
        return threading.current_thread() is self._thread

    @property
    def active(self) -> int:
        """Tasks submitted and not finished."""
        with self._lock:
            return len(self._tasks)

    def close(self, timeout: float = 30.0) -> None:
        """Refuse new tasks, let the running ones end, stop the thread and the lanes."""
        with self._lock:
            self._closed = True
            thread = self._thread
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=timeout)
        for pool in (self._pool, self._side):
            if pool is not None:
                pool.shutdown(wait=False)

    # -- the executor ----------------------------------------------------------------------------------
    def _start(self) -> None:
        with self._lock:
            if self._thread is not None or self._closed:
                return
            start = self._on_device
            self._pool = ThreadPoolExecutor(self.stage_threads, thread_name_prefix=f"{self.name}-stage", initializer=start)
            self._side = ThreadPoolExecutor(1, thread_name_prefix=f"{self.name}-side", initializer=start)
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def _resume(self, entry: _Task) -> None:
        """(Any thread) `entry`'s wait is over (its answer is on the object it yielded): the loop resumes it."""
        with self._lock:
            self._ready.append(entry)
        self._wake.set()

    def _on_device(self) -> None:
        if self.device is not None and self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)

    def _run(self) -> None:
        try:
            self._on_device()
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - a bug here must fail the tasks, never leave them waiting
            logger.exception("the engine core stopped")
            with self._lock:
                self._closed = True
                tasks, self._tasks = list(self._tasks), set()
            for entry in tasks:
                if not entry.future.done():
                    entry.future.set_exception(RuntimeError(f"the engine core stopped: {type(exc).__name__}: {exc}"))
            for queue in self.attach():  # callers waiting on their units run the batches themselves again
                with queue._cv:
                    queue._cv.notify_all()

    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                self._wake.clear()
                self._admit_waiting()
                advanced = self._advance_ready()
                ran, wait = self._run_due()
                with self._lock:
                    if self._closed and not self._tasks:
                        return
                    busy = bool(self._ready)
                    if self._admitting:  # a waiting ticket's cancel is seen within CANCEL_POLL_S
                        wait = CANCEL_POLL_S if wait is None else min(wait, CANCEL_POLL_S)
                if advanced or ran or busy:
                    continue
                release_workers()  # idle: the lanes' OpenMP teams spin only while no idle one is held
                self._wake.wait(timeout=wait if wait is not None else 1.0)

    def _advance_ready(self) -> bool:
        with self._lock:
            ready = list(self._ready)
            self._ready.clear()
        for entry in ready:
            self._advance(entry)
        return bool(ready)

    def _admit_waiting(self) -> None:
        """Poll every waiting ticket (its queue's order decides: only a head is granted); a granted or cancelled
        task is resumed with its grant or its error."""
        with self._lock:
            waiting = list(self._admitting)
        if not waiting:
            return
        changed, self._admission_changed = self._admission_changed, False
        done = []
        for entry, item in waiting:
            try:
                granted = False
                if changed:
                    granted, item.result = item.queue.poll(item.ticket)
                if not granted and item.cancel is not None:
                    item.cancel.check()
            except BaseException as exc:  # noqa: BLE001 - cancelled (or the policy failed): the task's error
                item.queue.withdraw(item.ticket)
                item.result, item.error, granted = None, exc, True
            if granted:
                done.append((entry, item))
        if done:
            with self._lock:
                for pair in done:
                    self._admitting.remove(pair)
            for entry, _ in done:
                self._resume(entry)

    def _queue_changed(self) -> None:
        """(Any thread, an admission queue's lock held: never blocks.) A queue a ticket of ours waits in may grant."""
        self._admission_changed = True
        self._wake.set()

    def _run_due(self) -> tuple[bool, float | None]:
        """One iteration of the executor: `schedule()` then `execute()`; (whether a batch started, the shortest wait
        until one may be)."""
        queues = self.attach()
        followed = self._follow(queues)
        if followed is Follow.RAN:
            return True, None
        plan, wait = self.schedule(queues)
        if followed is Follow.BUSY:  # another core of this process is receiving or running a plan: look again soon
            wait = FOLLOW_POLL_S if wait is None else min(wait, FOLLOW_POLL_S)
        self.execute(plan)
        return bool(plan), wait

    def schedule(self, queues: list) -> tuple[list[tuple[Any, Any]], float | None]:
        """Decide this iteration, running nothing: every queue's batch that is due now (its policy: priorities,
        deadlines, compatible units, row / token / memory budgets; taken off its queue), in the queues' order; and
        the shortest wait until another may be due (None: until something wakes the core)."""
        plan, wait = [], None
        for queue in queues:
            try:
                batch, left = queue.next_batch()
            except Exception as exc:  # noqa: BLE001 - a bug in a queue's policy: its units fail, the loop goes on
                logger.exception("a unit queue failed")
                queue.fail_pending(exc)
                continue
            if batch is not None:
                plan.append((queue, batch))
            elif left is not None:
                wait = left if wait is None else min(wait, left)
        return plan, wait

    def execute(self, plan: list[tuple[Any, Any]]) -> None:
        """Run the batches `schedule` took: the device's work here, in order ("main" lane); a "side" queue's (a VAE
        decode) on the side lane, so the others' steps go on meanwhile. Each batch's end hands its units back and
        wakes the core."""
        for queue, batch in plan:
            if queue.lane == "main":
                queue._run_batch(batch)
            else:
                self._side_lane(lambda queue=queue, batch=batch: queue._run_batch(batch))

    def _follow(self, queues: list) -> Follow:
        """A rank other than 0 of a parallel layout: while any of its queues holds a unit (or a plan received waits
        for its units), follow rank 0's plans (PlanChannel.follow: the batch a plan names runs once this rank's
        callers submitted its units, whichever queue of the process it is; every rank runs the same batches in the
        same order). Meanwhile the unplanned queues and the tasks go on; a unit queued wakes its core, which runs
        the plan if it was waiting for it. A peer that failed (no plan can come) fails the waiting units."""
        followers = [q for q in queues if q.planner is not None and not q.planner.leader]
        if not followers:
            return Follow.NOTHING
        planner = followers[0].planner
        waiting = [q for q in followers if q._pending]
        if not waiting and not planner.outstanding:
            return Follow.NOTHING
        try:
            return planner.follow(stop=lambda: not any(q._pending for q in followers), wake=self._wake.set)
        except BaseException as exc:  # noqa: BLE001 - no plan can come: nobody here goes on
            logger.warning("no plan from rank 0: %s: %s", type(exc).__name__, exc)
            for queue in queues:
                if queue.planner is not None:
                    queue.fail_pending(exc)
            return Follow.RAN

    def _side_lane(self, work: Callable[[], None]) -> None:
        assert self._side is not None
        self._side.submit(_logged, work)

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
                if scheduler is None:  # a serial pipeline (one request at a time): its step runs here, now
                    with running_request(entry.context):
                        item.run_here(entry.context)
                    self._resume(entry)
                    return

                def done(unit, item=item) -> None:
                    item.result, item.error = unit.result, unit.error
                    self._resume(entry)

                scheduler.enqueue(item.latents, item.timestep, item.branches, item.merged, item.kind, entry.context,
                                  item.step, on_done=done)
            elif isinstance(item, Queued):
                def answered(call, item=item) -> None:
                    item.result, item.error = call.result, call.error
                    self._resume(entry)

                item.queue.enqueue(*item.args, on_done=answered)
            elif isinstance(item, Admit):
                item.queue.listen(self._queue_changed)  # a release there wakes this core, which polls the ticket
                item.ticket = item.queue.ticket(item.need, item.priority, owner=entry.context)
                with self._lock:
                    self._admitting.append((entry, item))
                self._queue_changed()
            elif isinstance(item, Blocking):
                assert self._pool is not None
                work = self._pool.submit(_blocking, item, entry.context)
                work.add_done_callback(lambda _: self._resume(entry))
            else:
                raise TypeError(f"a task yielded {type(item).__name__}; expected a Wait (ModelStep, Queued, Blocking, "
                                "Admit)")
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
    try:
        with running_request(context), torch.inference_mode():
            item.run_here(context)
    finally:
        release_workers()  # a lane thread between pieces of work holds no OpenMP team (platform/openmp.py)


def _called(fn: Callable[..., Any], args: tuple) -> Any:
    try:
        with torch.inference_mode():
            return fn(*args)
    finally:
        release_workers()


def _logged(work: Callable[[], None]) -> None:
    try:
        with torch.inference_mode():
            work()
    except Exception:  # noqa: BLE001 - a batch's error went to its units
        logger.exception("a batch on the side lane failed")
    finally:
        release_workers()


def unit_queues(pipeline: Any) -> list:
    """A pipeline's unit queues: each denoising engine's step scheduler and each stage's batcher (the decodes)."""
    from composer.engine.batcher import UnitQueue

    queues = [e.scheduler for e in getattr(pipeline, "engines", ()) if e.scheduler is not None]
    for stage in getattr(pipeline, "stages", ()):
        batcher = getattr(stage, "batcher", None)
        if isinstance(batcher, UnitQueue) and batcher not in queues:
            queues.append(batcher)
    batcher = getattr(pipeline, "batcher", None)  # a text model's forward batcher
    if isinstance(batcher, UnitQueue) and batcher not in queues:
        queues.append(batcher)
    return queues
