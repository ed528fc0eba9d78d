"""The worker: jobs from a bounded priority queue run on the generator, up to `max_concurrent` at once.

The HTTP loop only queues and reads records; it never waits on generation. The queue is an admission queue
(composer/admission.py): a ticket per job, ordered by `priority` (higher first), then by arrival; the head starts
when a slot is free and the model has its adapters (`_grant`), on the thread that queued it or ended the job before
it (no dispatcher thread). On one process a video job is a task on the generator's engine core (`submit_video`): no
thread waits for it between its denoising steps, and its file and record are written on the core's stage threads.
A live stream (serve/stream.py) is a job too, submitted with its StreamSession: each chunk a task on the core (or
made on a stream thread where the pipeline cannot), handed to the session, which resumes the stream once its client
has read (no thread waits while the client is behind), and written to the file. A job that must switch the LoRA
adapters first has the switch run on the core's stage threads, then starts the same way. A generator whose
requests are not tasks here (several ranks' RankLeader, whose calls run on every rank at once with the others':
composer/parallel/ranks.py; `num_gpus` workers) has each job's blocking call run on a thread of the worker's pool,
its future ended as a task's, and its streams' chunks made on the stream threads: one way to run a job, one to run
a stream.
A job's CancelToken stops it at the next transformer block (DELETE, or the request timeout); any exception fails
that job alone.

LoRA adapters are the model's, shared by every running job: the jobs whose adapter set is the active one run
together; when the next job in line needs another set, no further job starts until the running ones have
ended, then one thread switches the adapters and the others follow (no thrashing between sets, no starvation).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from composer.admission import AdmissionQueue, Ticket
from composer.cancel import CancelToken
from composer.engine.engine import EngineHook, StepInfo
from composer.engine.scheduler import current_request
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
    """A running job as the worker sees it: its token, where its progress is, when its last step ended."""

    job: Job
    token: CancelToken
    span: tuple[float, float] = (0.0, 1.0)  # a step's progress maps into [lo, lo + span) of the job's
    last_step: float = field(default_factory=time.perf_counter)


@dataclass(eq=False)
class _Streaming:
    """A live stream between its blocks, as the worker keeps it (no thread holds it): the generator's stream, its
    chunk iterator and the file being written."""

    run: _Run
    session: Any
    stream: Any = None
    chunks: Any = None
    writer: Any = None
    timer: threading.Timer | None = None
    total: int = 1
    done: int = 0

    def close(self, error: BaseException | None) -> None:
        """Let go of the generator's stream (and its KV cache) at once; finish the file, or drop it on `error`."""
        try:
            for source in (self.chunks, self.stream):
                close = getattr(source, "close", None)
                if close is not None:
                    close()
        finally:
            if self.writer is not None:
                if error is None:
                    self.writer.close()
                else:
                    self.writer.abort()


def _result(future: Any) -> tuple[Any, BaseException | None]:
    error = future.exception()
    return (None, error) if error is not None else (future.result(), None)


class ProgressHook(EngineHook):
    """Engine hook: after each denoising step, its job's progress and the seconds the step took. The job is the one
    the calling thread runs (a job's own thread), or the one whose cancel token the current request holds (a task,
    whose steps run on the request loop's thread); none: someone else's call."""

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
    it is not as asked when it cannot be (None: as asked or by default)."""
    mode = getattr(getattr(generator, "pipeline", None), "concurrency", "serial")
    if mode == "serial":
        why = "jobs run one at a time: this pipeline runs requests serially (model offload)"
        return 1, why if asked not in (None, 1) else None
    wanted = CONCURRENT_DEFAULT if asked is None else asked
    ranks, slots = getattr(generator, "world_size", 1), getattr(generator, "slots", None)
    if isinstance(ranks, int) and ranks > 1 and isinstance(slots, int) and wanted > slots:
        return slots, (f"at most {slots} jobs at once on {ranks} ranks: each runs in one of the call slots the "
                       "ranks made at start (--max-concurrent)")
    return wanted, None


class Worker(AdmissionQueue):
    """Runs queued jobs on `generator` (anything with VideoGenerator's generate_video), up to `max_concurrent`
    at once (None: 4 when the generator's pipeline lets requests share it, else 1). Its queue is an admission queue
    (composer/admission.py: a ticket per job, in priority then arrival order, only the head started) whose policy
    is the slots and the adapter set (`_grant`)."""

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
        super().__init__()  # the queue's lock (`_cv`) guards everything below and `_lora`
        self._tickets: dict[str, Ticket] = {}  # job id -> its ticket while it is queued
        self._tokens: dict[str, CancelToken] = {}
        self._runs: dict[str, _Run] = {}  # job id -> the running job
        self._streams: dict[str, Any] = {}  # job id -> StreamSession, for live streams
        self._switching = False  # a thread is switching the adapters: no job starts meanwhile
        self._stopping = threading.Event()
        self._local = threading.local()  # the job a job thread (or a stream thread) runs now
        self.step_seconds_sum = 0.0
        self.steps = 0
        self._queued_at: dict[str, float] = {}  # job id -> when it was queued (time.monotonic)
        self.queue_wait_sum = 0.0  # seconds the started jobs waited in the queue
        self.queue_waits = 0
        self._engines = list(getattr(getattr(generator, "pipeline", None), "engines", []))
        self._hook = ProgressHook(self)
        self._hook_handles = [engine.add_hook(self._hook) for engine in self._engines]  # removed at stop
        self._by_token: dict[int, _Run] = {}  # id(cancel token) -> the running job (a task's steps find it so)
        # where an ended task's job is recorded (its video written): the engine core's stage threads when the
        # generator has a core, else a small pool of our own
        core = getattr(generator, "core", None)
        self._finisher = None if core is not None else ThreadPoolExecutor(2, thread_name_prefix="composer-serve-finish")
        self._core = core
        # a generator whose requests are not tasks here (several ranks' RankLeader, num_gpus workers): each job's
        # blocking call on a thread of this pool, its future awaited like a task's
        self._calls: ThreadPoolExecutor | None = None
        self._pumping = threading.local()  # this thread is starting jobs (`_pump`): a nested call leaves it to it
        # live streams (one process): a thread makes each block, none waits for the client (`_stream_blocks`)
        self._stream_pool = ThreadPoolExecutor(max(1, self.max_concurrent), thread_name_prefix="composer-serve-stream")
        self._stream_waits: set[_Streaming] = set()  # streams whose latest chunk waits for the client
        self._watchdog: threading.Thread | None = None

    @property
    def runs_tasks(self) -> bool:
        """Whether text-to-video jobs run as tasks on the generator's engine core (no thread each); else each job's
        call runs on a thread of the worker's pool (a generator that only has the blocking call)."""
        pipeline = getattr(self.generator, "pipeline", None)
        return bool(getattr(pipeline, "runs_tasks", False)) and callable(getattr(self.generator, "submit_video", None))

    # -- what the HTTP side asks -----------------------------------------------------------------------
    @property
    def queue_length(self) -> int:
        """Jobs waiting in the queue."""
        return self.waiting

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

    def tasks_running(self) -> int:
        """Requests running as tasks on the generator's request loop now (jobs, stream chunks, session extends)."""
        loop = getattr(self.generator, "_loop", None)
        return int(getattr(loop, "active", 0) or 0)

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
            if len(self._queue) >= self.max_queue:
                raise QueueFull
            self._tokens[job.id] = CancelToken()
            if stream is not None:
                self._streams[job.id] = stream
            self._queued_at[job.id] = time.monotonic()
            self._tickets[job.id] = self.ticket(job, job.priority, owner=job.id)
        self._pump()  # it starts now, on this thread, if a slot is free: no dispatcher thread in between

    def jobs_ahead(self, job: Job) -> int:
        """Jobs that start or run before `job` does: the queued ones before it (higher priority, or as high and
        earlier), plus the running ones when they hold every slot, or when an adapter switch must wait for them
        (`job`, or one before it, needs other adapters than the active ones)."""
        with self._cv:
            ticket = self._tickets.get(job.id)
            if ticket is None or ticket not in self._queue:
                return 0
            before = self._queue.index(ticket)
            switch = any(t.need.lora != self._lora for t in self._queue[:before + 1])
            blocked = len(self._runs) >= self.max_concurrent or (self._runs and switch)
            return before + (len(self._runs) if blocked else 0)

    def cancel(self, job: Job) -> bool:
        """Cancel a queued job (it leaves the queue) or a running one (it stops at the next block); False when
        done."""
        with self._cv:
            token = self._tokens.get(job.id)
            if token is None or job.status not in (QUEUED, IN_PROGRESS):
                return False
            token.cancel("cancelled by the client")
            ticket = self._tickets.get(job.id)
            queued = ticket is not None and ticket in self._queue
            if queued:
                self.withdraw(ticket)
                self._forget(job)
                self.store.update(job, status=CANCELLED, completed_at=time.time(), error=None)
        if queued:
            self._end_stream(job)
            self._pump()  # the job behind it may be runnable now
        return True

    # -- what the engine hook reports ----------------------------------------------------------------
    def current(self) -> _Run | None:
        """The job this thread runs, or the job of the request this thread runs a step of (None: neither)."""
        run = getattr(self._local, "run", None)
        if run is None:
            request = current_request()
            token = getattr(request, "cancel", None)
            if token is not None:  # (on several ranks: the call's token, on behalf of the job's)
                token = getattr(token, "on_behalf_of", None) or token
                with self._cv:
                    run = self._by_token.get(id(token))
        return run

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
        with self._cv:  # the running jobs end at their next step
            while self._runs and time.monotonic() < deadline:
                self._cv.wait(timeout=max(0.0, deadline - time.monotonic()))
        for pool in (self._finisher, self._calls):
            if pool is not None:
                pool.shutdown(wait=False)
        self._stream_pool.shutdown(wait=False)
        for handle in self._hook_handles:
            handle.remove()

    # -- starting and ending jobs -----------------------------------------------------------------------
    def _forget(self, job: Job) -> None:
        self._tokens.pop(job.id, None)
        self._tickets.pop(job.id, None)
        self._queued_at.pop(job.id, None)

    def _grant(self, ticket: Ticket) -> tuple[_Run, bool] | None:
        """(The queue's head, its lock held) Start the job if it may start now: a slot is free, no adapter switch
        is under way, and the model has its adapters or nothing runs (then it switches them first, and no job starts
        meanwhile). The grant: (its run, whether it must switch the adapters first)."""
        job: Job = ticket.need
        if self._stopping.is_set() or self._switching or len(self._runs) >= self.max_concurrent:
            return None
        if job.lora != self._lora and self._runs:
            return None
        queued = self._queued_at.pop(job.id, None)
        if queued is not None:
            self.queue_wait_sum += time.monotonic() - queued
            self.queue_waits += 1
        switch = job.lora != self._lora
        self._switching = switch  # the others wait for it: no job may start on the old adapters
        run = _Run(job, self._tokens[job.id])
        self._runs[job.id] = run
        self._by_token[id(run.token)] = run
        self._tickets.pop(job.id, None)
        self.store.update(job, status=IN_PROGRESS, started_at=time.time())
        return run, switch

    def _take(self) -> tuple[_Run, bool] | None:
        """The job at the head of the queue, started if it may start now (`_grant`), else None."""
        with self._cv:
            if not self._queue:
                return None
            granted, grant = self.poll(self._queue[0])
            return grant if granted else None

    def _pump(self) -> None:
        """Start every job that may start now, on the calling thread (the request that queued one, the end of a
        job, a cancel, the end of an adapter switch): a task job is submitted to the engine core at once, others
        get a thread. A call made while this thread is already starting jobs leaves it to that loop."""
        if getattr(self._pumping, "on", False):
            self._pumping.again = True
            return
        self._pumping.on = True
        try:
            while True:
                self._pumping.again = False
                taken = self._take()
                if taken is None:
                    if self._pumping.again:
                        continue
                    return
                self._start(*taken)
        finally:
            self._pumping.on = False

    def _start(self, run: _Run, switch: bool) -> None:
        """Start a job the one way every job starts: a future of its video (a task of the engine core, or the
        generator's blocking call on the worker's pool), or a live stream's first chunk."""
        if switch:  # the adapters first (no job runs now, none starts meanwhile), as work on the core's threads
            self._off_loop(self._switch_then_start, run)
        elif run.job.id in self._streams:
            self._stream_pool.submit(self._start_stream, run)
        else:
            self._start_task(run)

    def _switch_then_start(self, run: _Run) -> None:
        """Switch the adapters to the job's, then start it as its kind starts (a task, a stream); a switch that
        fails fails this job alone."""
        try:
            self._switch_lora(run.job.lora)
        except Exception as exc:  # noqa: BLE001 - this job fails, the server goes on (the next switch retries)
            self._conclude(run.job, run.token, exc)
            self._end_stream(run.job)
            self._release(run)
            return
        if run.job.id in self._streams:
            self._start_stream(run)
        else:
            self._start_task(run)

    def _off_loop(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` off the calling thread (which may be the engine core's or the event loop's): on the
        core's stage threads (or our own pool without a core)."""
        if self._core is not None:
            self._core.call(fn, *args)
        else:
            assert self._finisher is not None
            self._finisher.submit(fn, *args)

    def _release(self, run: _Run) -> None:
        """The job is over: its slot is free."""
        with self._cv:
            self._runs.pop(run.job.id, None)
            self._by_token.pop(id(run.token), None)
            self._forget(run.job)
            self._notify()
        self._pump()  # its slot may start the next job

    def _start_timer(self, run: _Run) -> threading.Timer | None:
        if not self.request_timeout:
            return None
        timer = threading.Timer(self.request_timeout, run.token.cancel, args=("timeout",))
        timer.daemon = True
        timer.start()
        return timer

    def _start_task(self, run: _Run) -> None:
        """Submit a text-to-video job (a task, or the blocking call on the worker's pool); its end is recorded off
        the thread that ends it."""
        job, token = run.job, run.token
        timer = self._start_timer(run)
        try:
            future = self._submit(job, token)
        except Exception as exc:  # noqa: BLE001 - refused at once (bad input): this job fails, the server goes on
            self._conclude(job, token, exc)
            if timer is not None:
                timer.cancel()
            self._release(run)
            return
        future.add_done_callback(lambda f: self._finish_later(self._finish_task, run, f, timer))

    def _submit(self, job: Job, token: CancelToken) -> Any:
        """A future of the job's result: a task of the generator's engine core, else its blocking call on a thread
        of the worker's pool (its progress found by its token: `current`)."""
        if self.runs_tasks:
            return self.generator.submit_video(*_request(job), cancel=token, priority=job.priority, **_fields(job))
        with self._cv:
            if self._calls is None:
                self._calls = ThreadPoolExecutor(self.max_concurrent, thread_name_prefix="composer-serve-call")
        return self._calls.submit(self.generator.generate_video, *_request(job), cancel=token, priority=job.priority,
                                  **_fields(job))

    def _finish_later(self, fn: Callable[..., None], *args: Any) -> None:
        """(A done callback, on the engine core's thread: keep it short) Record the job's end off that thread."""
        self._off_loop(fn, *args)

    def _finish_task(self, run: _Run, future: Any, timer: threading.Timer | None) -> None:
        job, token = run.job, run.token
        try:
            self._settle(job, token, lambda: self._save(job, future.result()))
        finally:
            if timer is not None:
                timer.cancel()
            self._release(run)

    def _save(self, job: Job, result: Any) -> None:
        save_video(result.frames, self.store.video_path(job.id), fps=job.request.get("fps", 16))

    def _settle(self, job: Job, token: CancelToken, work: Callable[[], None]) -> None:
        """Run the job's remaining `work` and record how the job ended (an error fails this job alone)."""
        try:
            work()
        except Exception as exc:  # noqa: BLE001 - one failing job must not stop the server
            self._conclude(job, token, exc)
        else:
            self._conclude(job, token, None)

    def _conclude(self, job: Job, token: CancelToken, error: BaseException | None) -> None:
        """Record how the job ended: `error` None (completed), Cancelled (by whom), or the error it failed with."""
        if error is None:
            self._finish(job, COMPLETED, None, progress=1.0)
        elif isinstance(error, Cancelled):
            if token.reason == "timeout":
                self._finish(job, FAILED, f"the job ran past the request timeout ({self.request_timeout:g} s) and "
                             "was cancelled")
            elif token.reason == "the server stopped":
                self._finish(job, FAILED, "the server stopped while the job ran")
            else:
                self._finish(job, CANCELLED, None)
        else:
            logger.warning("job %s failed: %s: %s", job.id, type(error).__name__, error)
            self._finish(job, FAILED, f"{type(error).__name__}: {error}")

    # -- live streams that hold no thread between blocks --------------------------------------------------
    def _start_stream(self, run: _Run) -> None:
        """(A stream thread) Open the generator's stream and start its first chunk."""
        job, token = run.job, run.token
        state = _Streaming(run, self._streams.get(job.id), timer=self._start_timer(run))
        try:
            request = {k: v for k, v in job.request.items() if k != "prompt"}  # the session's prompts name them
            state.stream = self.generator.stream_video(state.session.prompts, keep_video=False, cancel=token,
                                                       priority=job.priority, **request,
                                                       **job.inputs)  # (inputs: an rtmp_url, kept off the record)
            state.session.source = state.stream  # its stats (the frame rate reached) for /metrics and the chunks
            state.chunks = iter(state.stream)
            state.writer = VideoWriter(self.store.video_path(job.id), fps=job.request.get("fps", 16))
            state.session.started(job)
            state.total = max(state.session.num_blocks, 1)
            run.span = (0.0, 1 / state.total)
        except Exception as exc:  # noqa: BLE001 - this stream fails, the server goes on
            self._end_streaming(state, exc)
            return
        self._stream_blocks(state)

    def _stream_blocks(self, state: _Streaming, error: BaseException | None = None) -> None:
        """Start making the stream's next chunk: as a task on the generator's request loop where its pipeline
        allows (no thread held while its passes wait), else on a stream thread. `_stream_chunk` takes it."""
        if error is not None:
            self._end_streaming(state, error)
            return
        try:
            state.run.token.check()
            pipeline = getattr(self.generator, "pipeline", None)
            if getattr(pipeline, "streams_as_tasks", False) and callable(getattr(state.stream, "next_task", None)):
                future = self.generator.core.submit(state.stream.next_task(), state.stream.context)
                future.add_done_callback(lambda f: self._stream_pool.submit(self._stream_chunk, state, *_result(f)))
            else:
                self._stream_pool.submit(self._stream_next_here, state)
        except Exception as exc:  # noqa: BLE001 - this stream fails, the server goes on
            self._end_streaming(state, exc)

    def _stream_next_here(self, state: _Streaming) -> None:
        """(A stream thread) Make the next chunk on this thread."""
        self._local.run = state.run
        try:
            chunk = next(state.chunks, None)
        except Exception as exc:  # noqa: BLE001 - this stream fails, the server goes on
            self._stream_chunk(state, None, exc)
            return
        finally:
            self._local.run = None
        self._stream_chunk(state, chunk, None)

    def _stream_chunk(self, state: _Streaming, chunk: Any, error: BaseException | None) -> None:
        """(A stream thread) A chunk is made (None: the stream is over): write it and hand it to the socket; the
        next one starts at once while the client keeps up, else once it has read (no thread waits meanwhile)."""
        if error is not None or chunk is None:
            self._end_streaming(state, error)
            return
        run = state.run
        try:
            state.writer.append(chunk.frames)
            state.done += 1
            self.store.update(run.job, persist=False, progress=min(state.done / state.total, 0.99))
            run.span = (state.done / state.total, 1 / state.total)
            with self._cv:
                self._stream_waits.add(state)
            if not state.session.offer(chunk, lambda err: self._stream_pool.submit(self._resume_stream, state, err)):
                self._watch()
                return  # the client's next read resumes the stream
            with self._cv:
                self._stream_waits.discard(state)
        except Exception as exc:  # noqa: BLE001 - this stream fails, the server goes on
            self._end_streaming(state, exc)
            return
        self._stream_blocks(state)

    def _resume_stream(self, state: _Streaming, error: BaseException | None) -> None:
        """The client read (or the watchdog ended the wait with `error`): the stream goes on."""
        with self._cv:
            self._stream_waits.discard(state)
        self._stream_blocks(state, error)

    def _watch(self) -> None:
        """Start the watchdog once: one thread that ends the waiting streams whose job was cancelled (DELETE, the
        request timeout, the server stopping). A client that reads nothing is failed by its socket's side, which
        measures what it took (`StreamSession.fail`, composer/serve/stream.py)."""
        with self._cv:
            if self._watchdog is not None:
                return
            self._watchdog = threading.Thread(target=self._watchdog_loop, name="composer-serve-watchdog",
                                              daemon=True)
        self._watchdog.start()

    def _watchdog_loop(self) -> None:
        while True:
            with self._cv:
                waiting = list(self._stream_waits)
                if self._stopping.is_set() and not waiting:
                    return
            now = time.perf_counter()
            for state in waiting:
                session, token = state.session, state.run.token
                waited = session.waited(now)
                if waited is None:
                    continue
                if token.cancelled:
                    session.abandon(Cancelled(f"request cancelled ({token.reason})"))
            time.sleep(0.05)

    def _end_streaming(self, state: _Streaming, error: BaseException | None) -> None:
        run = state.run
        with self._cv:
            self._stream_waits.discard(state)
        try:
            try:
                state.close(error)
            except Exception as exc:  # noqa: BLE001 - the file could not be finished: the stream fails
                error = error or exc
            self._conclude(run.job, run.token, error)
        finally:
            if state.timer is not None:
                state.timer.cancel()
            self._end_stream(run.job)
            self._release(run)

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
            self._pump()  # the jobs that waited for the switch

    def _finish(self, job: Job, status: str, error: str | None, **changes: Any) -> None:
        self.store.update(job, status=status, error=error, completed_at=time.time(), **changes)


def _request(job: Any) -> tuple:
    """The job's request as checked before it was queued (nothing checks it again), when it has one."""
    return () if getattr(job, "checked", None) is None else (job.checked,)


def _fields(job: Any) -> dict[str, Any]:
    """The job's request as fields (checked when it runs: a job without its CheckedRequest), else none."""
    return {**job.request, **job.inputs} if getattr(job, "checked", None) is None else {}
