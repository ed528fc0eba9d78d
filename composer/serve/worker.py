"""The worker: one thread taking jobs from a bounded queue and running them one after another on the generator.

The HTTP loop only queues and reads records; it never waits on generation. A job's CancelToken stops it at the
next transformer block (DELETE, or the request timeout); any exception fails that job alone and the worker
goes on with the next. A live stream (serve/stream.py) is a job too, submitted with its StreamSession: the
worker runs it here, in turn, with stream_video, handing each chunk to the session and writing it to the file.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from composer.cancel import CancelToken
from composer.engine.engine import EngineHook, StepInfo
from composer.errors import Cancelled
from composer.logging import get_logger
from composer.serve.jobs import CANCELLED, COMPLETED, FAILED, IN_PROGRESS, QUEUED, Job, JobStore
from composer.serve.requests import LoraOption
from composer.video import VideoWriter, save_video

logger = get_logger(__name__)


class QueueFull(Exception):
    """The queue holds `max_queue` jobs already."""


class ProgressHook(EngineHook):
    """Engine hook: after each denoising step, the running job's progress and the seconds the step took."""

    def __init__(self, worker: Worker):
        self.worker = worker
        self._last = time.perf_counter()

    def before_step(self, info: StepInfo) -> None:
        if info.index == 0:
            self._last = time.perf_counter()

    def after_step(self, info: StepInfo) -> None:
        now = time.perf_counter()
        self.worker.step_done(now - self._last, (info.index + 1) / max(info.num_steps, 1))
        self._last = now


class Worker:
    """Runs queued jobs in order on `generator` (anything with VideoGenerator's generate_video)."""

    def __init__(self, generator: Any, store: JobStore, max_queue: int, request_timeout: float | None,
                 loras: Sequence[LoraOption] = ()):
        self.generator = generator
        self._lora_paths = {o.name: o.path for o in loras}
        self._lora: list | None = [[o.name, o.scale] for o in loras]  # what the model has now (None: unknown)
        self.store = store
        self.request_timeout = request_timeout
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._tokens: dict[str, CancelToken] = {}
        self._lock = threading.Lock()
        self._running: Job | None = None
        self._streams: dict[str, Any] = {}  # job id -> StreamSession, for live streams
        self._progress_span = (0.0, 1.0)  # a step's progress maps into [lo, lo + span) of the job's
        self._stopping = threading.Event()
        self.step_seconds_sum = 0.0
        self.steps = 0
        self._engines = list(getattr(getattr(generator, "pipeline", None), "engines", []))
        self._hook = ProgressHook(self)
        for engine in self._engines:
            engine.add_hook(self._hook)
        self._thread = threading.Thread(target=self._loop, name="composer-serve-worker", daemon=True)
        self._thread.start()

    @property
    def queue_length(self) -> int:
        return self._queue.qsize()

    def submit(self, job: Job, stream: Any = None) -> None:
        """Queue `job` (QueueFull when the queue is full); `stream`: a live stream's StreamSession."""
        with self._lock:
            self._tokens[job.id] = CancelToken()
            if stream is not None:
                self._streams[job.id] = stream
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            with self._lock:
                self._tokens.pop(job.id, None)
                self._streams.pop(job.id, None)
            raise QueueFull from None

    def jobs_ahead(self, job: Job) -> int:
        """Jobs that run before `job`: the running one and the queued ones before it."""
        with self._queue.mutex:
            waiting = list(self._queue.queue)
        before = waiting[:waiting.index(job)] if job in waiting else []
        return sum(1 for j in before if j is not None and j.status == QUEUED) + (self._running is not None)

    def cancel(self, job: Job) -> bool:
        """Cancel a queued job (it is skipped) or a running one (it stops at the next block); False when done."""
        with self._lock:
            token = self._tokens.get(job.id)
            if token is None or job.status not in (QUEUED, IN_PROGRESS):
                return False
            token.cancel("cancelled by the client")
            queued = job.status == QUEUED
            if queued:  # the worker skips it when it comes up
                self.store.update(job, status=CANCELLED, completed_at=time.time(), error=None)
        if queued:
            self._end_stream(job)
        return True

    def step_done(self, seconds: float, progress: float) -> None:
        job = self._running
        if job is None:  # someone else's call on the same generator
            return
        self.step_seconds_sum += seconds
        self.steps += 1
        low, span = self._progress_span
        self.store.update(job, persist=False, progress=min(low + progress * span, 0.99))

    def stop(self) -> None:
        """Cancel the running job (failed: "the server stopped") and end the thread; queued jobs stay queued on
        disk, and the next start marks them failed ("server restarted")."""
        self._stopping.set()
        with self._lock:
            for token in self._tokens.values():
                token.cancel("the server stopped")
        try:
            self._queue.put_nowait(None)  # wakes an idle worker; a busy one sees _stopping after its job
        except queue.Full:
            pass
        self._thread.join(timeout=30)
        for engine in self._engines:
            if self._hook in engine.hooks:
                engine.hooks.remove(self._hook)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None or self._stopping.is_set():
                return
            with self._lock:
                token = self._tokens.get(job.id)
                skip = token is None or token.cancelled or job.status != QUEUED
                if skip:
                    self._tokens.pop(job.id, None)
                else:
                    self._running = job
                    self.store.update(job, status=IN_PROGRESS, started_at=time.time())
            if skip:
                self._end_stream(job)
                continue
            try:
                self._run(job, token)
            finally:
                with self._lock:
                    self._running = None
                    self._tokens.pop(job.id, None)

    def _run(self, job: Job, token: CancelToken) -> None:
        timer = None
        if self.request_timeout:
            timer = threading.Timer(self.request_timeout, token.cancel, args=("timeout",))
            timer.daemon = True
            timer.start()
        stream = self._streams.get(job.id)
        try:
            self._use_lora(job.lora)
            if stream is not None:
                self._run_stream(job, token, stream)
            else:
                result = self.generator.generate_video(cancel=token, **job.request, **job.inputs)
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

    def _run_stream(self, job: Job, token: CancelToken, session: Any) -> None:
        """A live stream: its chunks to the session (which waits while the client is behind) and to the file."""
        request = {k: v for k, v in job.request.items() if k != "prompt"}  # the session's prompts name them
        chunks = iter(self.generator.stream_video(session.prompts, keep_video=False, cancel=token, **request))
        session.started(job)
        total = max(session.num_blocks, 1)
        self._progress_span = (0.0, 1 / total)
        try:
            with VideoWriter(self.store.video_path(job.id), fps=job.request.get("fps", 16)) as writer:
                for done, chunk in enumerate(chunks, 1):
                    writer.append(chunk.frames)
                    session.chunk(chunk, token)
                    self.store.update(job, persist=False, progress=min(done / total, 0.99))
                    self._progress_span = (done / total, 1 / total)
        finally:
            close = getattr(chunks, "close", None)
            if close is not None:  # the pipeline's stream lets go of the request at once
                close()
            self._progress_span = (0.0, 1.0)

    def _end_stream(self, job: Job) -> None:
        """Tell a live stream's session that its job is over (its last message to the client)."""
        with self._lock:
            session = self._streams.pop(job.id, None)
        if session is not None:
            session.finished(job)

    def _use_lora(self, lora: list) -> None:
        """Switch the model's adapters to the job's [name, scale] pairs when they differ from the last job's."""
        if lora == self._lora:
            return
        self._lora = None  # a switch that fails half way leaves the model in a state we do not name
        if lora:
            described = self.generator.set_lora([self._lora_paths[n] for n, _ in lora], [s for _, s in lora])
        else:
            self.generator.unset_lora()
            described = "LoRA: none"
        logger.info("adapters for the next job: %s", described)
        self._lora = [list(pair) for pair in lora]

    def _finish(self, job: Job, status: str, error: str | None, **changes: Any) -> None:
        self.store.update(job, status=status, error=error, completed_at=time.time(), **changes)
