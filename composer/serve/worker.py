"""The worker: N threads taking jobs from a bounded priority queue and running them on the generator at once.

The HTTP loop only queues and reads records; it never waits on generation. Each worker thread runs one job at a
time; the generator's step scheduler (composer/engine/scheduler.py) batches the denoising steps of the jobs that
run together. The queue is ordered by `priority` (higher first), then by arrival. A job's CancelToken stops it at
the next transformer block (DELETE, or the request timeout); any exception fails that job alone and its thread
goes on with the next. A live stream (serve/stream.py) is a job too, submitted with its StreamSession: a worker
thread runs it with stream_video, handing each chunk to the session (which waits while its client is behind:
only that thread waits) and writing it to the file.

LoRA adapters are the model's, shared by every running job: the jobs whose adapter set is the active one run
together; when the next job in line needs another set, no further job starts until the running ones have
ended, then one thread switches the adapters and the others follow (no thrashing between sets, no starvation).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from composer.cancel import CancelToken
from composer.engine.engine import EngineHook, StepInfo
from composer.errors import Cancelled
from composer.logging import get_logger
from composer.serve.jobs import CANCELLED, COMPLETED, FAILED, IN_PROGRESS, QUEUED, Job, JobStore
from composer.serve.requests import LoraOption
from composer.video import VideoWriter, save_video

logger = get_logger(__name__)

CONCURRENT_DEFAULT = 4  # jobs at once on a generator whose requests may share it (concurrency "batch")


class QueueFull(Exception):
    """The queue holds `max_queue` jobs already."""


@dataclass(eq=False)
class _Run:
    """A running job as its worker thread sees it: its token, where its progress is, when its last step ended."""

    job: Job
    token: CancelToken
    span: tuple[float, float] = (0.0, 1.0)  # a step's progress maps into [lo, lo + span) of the job's
    last_step: float = field(default_factory=time.perf_counter)


class ProgressHook(EngineHook):
    """Engine hook: after each denoising step, its job's progress and the seconds the step took. Steps run on
    their request's thread, so the job is the one the calling worker thread runs (none: someone else's call)."""

    def __init__(self, worker: Worker):
        self.worker = worker

    def before_step(self, info: StepInfo) -> None:
        run = self.worker.current()
        if run is not None and info.index == 0:
            run.last_step = time.perf_counter()

    def after_step(self, info: StepInfo) -> None:
        run = self.worker.current()
        if run is None:
            return
        now = time.perf_counter()
        self.worker.step_done(run, now - run.last_step, (info.index + 1) / max(info.num_steps, 1))
        run.last_step = now


def concurrency_for(generator: Any, asked: int | None) -> tuple[int, str | None]:
    """How many jobs may run at once on `generator` (`asked`: --max-concurrent, None for the default), and why
    it is 1 when it must be (None: as asked or by default)."""
    ranks = getattr(generator, "world_size", 1)
    if isinstance(ranks, int) and ranks > 1:
        return 1, (f"jobs run one at a time on {ranks} ranks: rank 0 sends each call to the others, which must "
                   "see the same calls in the same order")
    mode = getattr(getattr(generator, "pipeline", None), "concurrency", "serial")
    if mode == "serial":
        why = "jobs run one at a time: this pipeline runs requests serially (model offload)"
        return 1, why if asked not in (None, 1) else None
    return (CONCURRENT_DEFAULT if asked is None else asked), None


class Worker:
    """Runs queued jobs on `generator` (anything with VideoGenerator's generate_video), up to `max_concurrent`
    at once (None: 4 when the generator's pipeline lets requests share it, else 1)."""

    def __init__(self, generator: Any, store: JobStore, max_queue: int, request_timeout: float | None,
                 loras: Sequence[LoraOption] = (), max_concurrent: int | None = None):
        self.generator = generator
        self._lora_paths = {o.name: o.path for o in loras}
        self._lora: list | None = [[o.name, o.scale] for o in loras]  # what the model has now (None: unknown)
        self.store = store
        self.request_timeout = request_timeout
        self.max_queue = max_queue
        self.max_concurrent, why = concurrency_for(generator, max_concurrent)
        if why:
            logger.info("%s", why)
        self._cv = threading.Condition()  # guards everything below and `_lora`
        self._waiting: list[Job] = []  # queued jobs, in arrival order
        self._arrival: dict[str, int] = {}
        self._arrivals = 0
        self._tokens: dict[str, CancelToken] = {}
        self._runs: dict[str, _Run] = {}  # job id -> the running job
        self._streams: dict[str, Any] = {}  # job id -> StreamSession, for live streams
        self._switching = False  # a thread is switching the adapters: no job starts meanwhile
        self._stopping = threading.Event()
        self._local = threading.local()  # the job this worker thread runs
        self.step_seconds_sum = 0.0
        self.steps = 0
        self._queued_at: dict[str, float] = {}  # job id -> when it was queued (time.monotonic)
        self.queue_wait_sum = 0.0  # seconds the started jobs waited in the queue
        self.queue_waits = 0
        self._engines = list(getattr(getattr(generator, "pipeline", None), "engines", []))
        self._hook = ProgressHook(self)
        for engine in self._engines:
            engine.add_hook(self._hook)
        self._threads = [threading.Thread(target=self._loop, name=f"composer-serve-worker-{i}", daemon=True)
                         for i in range(self.max_concurrent)]
        for thread in self._threads:
            thread.start()

    # -- what the HTTP side asks -----------------------------------------------------------------------
    @property
    def queue_length(self) -> int:
        """Jobs waiting for a worker thread."""
        with self._cv:
            return len(self._waiting)

    @property
    def running(self) -> int:
        """Jobs running now."""
        with self._cv:
            return len(self._runs)

    def scheduler_stats(self) -> tuple[int, int, int, int]:
        """Over the generator's step schedulers: transformer calls, units (a request's step), units that shared
        a call with another request's, and the most units one call ran."""
        calls = units = batched = largest = 0
        for engine in self._engines:
            stats = getattr(getattr(engine, "scheduler", None), "stats", None)
            if stats is not None:
                calls, units, batched = calls + stats.calls, units + stats.units, batched + stats.batched_units
                largest = max(largest, stats.largest_batch)
        return calls, units, batched, largest

    def kv_pool_stats(self) -> Any:
        """The causal model's KV page pool (KVPoolStats), or None when the model has none."""
        stage = getattr(getattr(self.generator, "pipeline", None), "stage", None)
        if not callable(stage):
            return None
        try:
            pool = getattr(stage("CausalDenoisingStage"), "kv_pool", None)
        except KeyError:  # not a causal model
            return None
        return pool.stats() if pool is not None else None

    def submit(self, job: Job, stream: Any = None) -> None:
        """Queue `job` (QueueFull when the queue is full); `stream`: a live stream's StreamSession."""
        with self._cv:
            if len(self._waiting) >= self.max_queue:
                raise QueueFull
            self._tokens[job.id] = CancelToken()
            if stream is not None:
                self._streams[job.id] = stream
            self._arrival[job.id] = self._arrivals
            self._arrivals += 1
            self._queued_at[job.id] = time.monotonic()
            self._waiting.append(job)
            self._cv.notify_all()

    def jobs_ahead(self, job: Job) -> int:
        """Jobs that start or run before `job` does: the queued ones before it (higher priority, or as high and
        earlier), plus the running ones when they hold every slot, or when an adapter switch must wait for them
        (`job`, or one before it, needs other adapters than the active ones)."""
        with self._cv:
            if job not in self._waiting:
                return 0
            key = self._order(job)
            before = [j for j in self._waiting if self._order(j) < key]
            switch = any(j.lora != self._lora for j in [*before, job])
            blocked = len(self._runs) >= self.max_concurrent or (self._runs and switch)
            return len(before) + (len(self._runs) if blocked else 0)

    def cancel(self, job: Job) -> bool:
        """Cancel a queued job (it leaves the queue) or a running one (it stops at the next block); False when
        done."""
        with self._cv:
            token = self._tokens.get(job.id)
            if token is None or job.status not in (QUEUED, IN_PROGRESS):
                return False
            token.cancel("cancelled by the client")
            queued = job in self._waiting
            if queued:
                self._waiting.remove(job)
                self._forget(job)
                self.store.update(job, status=CANCELLED, completed_at=time.time(), error=None)
                self._cv.notify_all()  # the job behind it may be runnable now
        if queued:
            self._end_stream(job)
        return True

    # -- what the engine hook reports ----------------------------------------------------------------
    def current(self) -> _Run | None:
        """The job this thread runs (None on any other thread)."""
        return getattr(self._local, "run", None)

    def step_done(self, run: _Run, seconds: float, progress: float) -> None:
        with self._cv:
            self.step_seconds_sum += seconds
            self.steps += 1
        low, span = run.span
        self.store.update(run.job, persist=False, progress=min(low + progress * span, 0.99))

    def stop(self) -> None:
        """Cancel the running jobs (failed: "the server stopped") and end the threads; queued jobs stay queued on
        disk, and the next start marks them failed ("server restarted")."""
        self._stopping.set()
        with self._cv:
            for run in self._runs.values():
                run.token.cancel("the server stopped")
            self._cv.notify_all()
        deadline = time.monotonic() + 30
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        for engine in self._engines:
            if self._hook in engine.hooks:
                engine.hooks.remove(self._hook)

    # -- the worker threads ----------------------------------------------------------------------------
    def _order(self, job: Job) -> tuple[int, int]:
        return -job.priority, self._arrival[job.id]

    def _forget(self, job: Job) -> None:
        self._tokens.pop(job.id, None)
        self._arrival.pop(job.id, None)
        self._queued_at.pop(job.id, None)

    def _runnable(self) -> Job | None:
        """The next job in line, if it may start now: the model has its adapters, or nothing runs (it switches)."""
        if self._switching or not self._waiting:
            return None
        head = min(self._waiting, key=self._order)
        return head if head.lora == self._lora or not self._runs else None

    def _take(self) -> tuple[_Run, bool] | None:
        """Wait for a job this thread may start; (its run, whether it must switch the adapters first), or None
        once the server stops."""
        with self._cv:
            while True:
                if self._stopping.is_set():
                    return None
                job = self._runnable()
                if job is not None:
                    break
                self._cv.wait()
            self._waiting.remove(job)
            queued = self._queued_at.pop(job.id, None)
            if queued is not None:
                self.queue_wait_sum += time.monotonic() - queued
                self.queue_waits += 1
            switch = job.lora != self._lora
            self._switching = switch  # the others wait for it: no job may start on the old adapters
            run = _Run(job, self._tokens[job.id])
            self._runs[job.id] = run
            self.store.update(job, status=IN_PROGRESS, started_at=time.time())
            return run, switch

    def _loop(self) -> None:
        while True:
            taken = self._take()
            if taken is None:
                return
            run, switch = taken
            self._local.run = run
            try:
                self._run(run, switch)
            finally:
                self._local.run = None
                with self._cv:
                    self._runs.pop(run.job.id, None)
                    self._forget(run.job)
                    self._cv.notify_all()

    def _run(self, run: _Run, switch: bool) -> None:
        job, token = run.job, run.token
        timer = None
        if self.request_timeout:
            timer = threading.Timer(self.request_timeout, token.cancel, args=("timeout",))
            timer.daemon = True
            timer.start()
        stream = self._streams.get(job.id)
        try:
            if switch:
                self._switch_lora(job.lora)
            if stream is not None:
                self._run_stream(run, stream)
            else:
                result = self.generator.generate_video(cancel=token, priority=job.priority, **job.request,
                                                       **job.inputs)
                save_video(result.frames, self.store.video_path(job.id), fps=job.request.get("fps", 16))
        except Cancelled:
            if token.reason == "timeout":
                self._finish(job, FAILED, f"the job ran past the request timeout ({self.request_timeout:g} s) and "
                             "was cancelled")
            elif token.reason == "the server stopped":
                self._finish(job, FAILED, "the server stopped while the job ran")
            else:
                self._finish(job, CANCELLED, None)
        except Exception as exc:  # noqa: BLE001 - one failing job must not stop the server
            logger.warning("job %s failed: %s: %s", job.id, type(exc).__name__, exc)
            self._finish(job, FAILED, f"{type(exc).__name__}: {exc}")
        else:
            self._finish(job, COMPLETED, None, progress=1.0)
        finally:
            if timer is not None:
                timer.cancel()
            self._end_stream(job)

    def _run_stream(self, run: _Run, session: Any) -> None:
        """A live stream: its chunks to the session (which waits while the client is behind) and to the file."""
        job, token = run.job, run.token
        request = {k: v for k, v in job.request.items() if k != "prompt"}  # the session's prompts name them
        stream = self.generator.stream_video(session.prompts, keep_video=False, cancel=token, priority=job.priority,
                                             **request)
        session.source = stream  # its stats (the frame rate reached) for /metrics and the chunk messages
        chunks = iter(stream)
        session.started(job)
        total = max(session.num_blocks, 1)
        run.span = (0.0, 1 / total)
        try:
            with VideoWriter(self.store.video_path(job.id), fps=job.request.get("fps", 16)) as writer:
                for done, chunk in enumerate(chunks, 1):
                    writer.append(chunk.frames)
                    session.chunk(chunk, token)
                    self.store.update(job, persist=False, progress=min(done / total, 0.99))
                    run.span = (done / total, 1 / total)
        finally:
            for source in (chunks, stream):  # the pipeline's stream lets go of the request (and its KV cache) at once
                close = getattr(source, "close", None)
                if close is not None:
                    close()

    def _end_stream(self, job: Job) -> None:
        """Tell a live stream's session that its job is over (its last message to the client)."""
        with self._cv:
            session = self._streams.pop(job.id, None)
        if session is not None:
            session.finished(job)

    def _switch_lora(self, lora: list) -> None:
        """Switch the model's adapters to the job's [name, scale] pairs. Called with no other job running and
        no job starting (`_switching`), which it clears whatever happens."""
        try:
            with self._cv:
                self._lora = None  # a switch that fails half way leaves the model in a state we do not name
            if lora:
                described = self.generator.set_lora([self._lora_paths[n] for n, _ in lora], [s for _, s in lora])
            else:
                self.generator.unset_lora()
                described = "LoRA: none"
            logger.info("adapters from now on: %s", described)
            with self._cv:
                self._lora = [list(pair) for pair in lora]
        finally:
            with self._cv:
                self._switching = False
                self._cv.notify_all()

    def _finish(self, job: Job, status: str, error: str | None, **changes: Any) -> None:
        self.store.update(job, status=status, error=error, completed_at=time.time(), **changes)
