"""Live streams of causal models over a WebSocket (`/v1/streams`): each decoded block goes to the client as JPEG
frames while the next block is made, and the client may switch the prompt or stop as it watches.

A stream is a job like any other: the worker runs it alongside the other jobs (each chunk a task on the generator's
request loop), it is listed by GET /v1/videos with `"kind": "stream"`, DELETE cancels it, and its whole video is
written to the output folder. Between the worker (the producer) and the socket (the consumer) sits a buffer of at
most `BUFFERED_CHUNKS` chunks: a slow client pauses its own stream's generation (its next chunk waits in
`StreamSession.offer`, holding no thread; the other jobs go on) instead of letting the server hold the video in
memory. A chunk leaves the buffer once the client has taken what was sent before it (`ClientBacklog`: the bytes
still in the server's transport and kernel buffers), not when it is handed to the socket, whose buffers would
otherwise absorb a stalled client's stream for minutes.
The protocol is in docs/serving.md ("Live streams").
"""

from __future__ import annotations

import asyncio
import io
import json
import math
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from starlette.concurrency import run_in_threadpool

from composer.cancel import CancelToken
from composer.errors import ComposerError
from composer.logging import get_logger
from composer.request_check import ModelLimits, text_length_problem
from composer.serve.jobs import CANCELLED, COMPLETED, FINISHED, IN_PROGRESS, QUEUED, STATES, Job, new_job_id
from composer.serve.requests import RequestProblem, check_body
from composer.serve.worker import QueueFull

logger = get_logger(__name__)

STREAM = "stream"  # Job.kind of a stream
BUFFERED_CHUNKS = 2  # chunks made but not yet sent, at most, per stream
MAX_PENDING_SWITCHES = 16
FIRST_MESSAGE_TIMEOUT = 60.0  # seconds a new socket may take to send its request
STALL_TIMEOUT = 60.0  # seconds a stream waits for a client that reads nothing (at most the request timeout)
BEHIND_BYTES = 64 * 1024  # a chunk is taken once at most this much (or the chunk's size) is left unsent before it
CLOSE_GRACE = 5.0  # seconds a stalled client's connection may take to close before it is aborted
JPEG_QUALITY = 90
# WebSocket close codes: 1000 normal (done, cancelled), 1008 policy violation (a refused request),
# 1011 server error (the generation failed), 1013 try again later (loading, queue full)
NORMAL, REFUSED, FAILED_CODE, TRY_LATER = 1000, 1008, 1011, 1013


class StreamStalled(ComposerError):
    """The client read nothing for longer than the server waits: its stream is failed."""


def _kernel_unsent_request() -> int | None:
    try:  # Linux: SIOCOUTQ (the tty TIOCOUTQ number) gives a TCP socket's unsent and unacknowledged bytes
        import sys
        import termios

        return termios.TIOCOUTQ if sys.platform.startswith("linux") else None
    except (ImportError, AttributeError):
        return None


_SIOCOUTQ = _kernel_unsent_request()


class ClientBacklog:
    """What a WebSocket client has not taken yet of what the server sent it: the bytes in the connection's asyncio
    transport (its write buffer) plus, on Linux, the kernel's send queue (bytes the client's machine has not
    acknowledged). Found through the ASGI server's protocol object behind `receive`/`send` (uvicorn's has a
    `transport`); `measured` is False when there is none, and then only the server's own flow control (a send
    that waits) shows a slow client. What the client's own socket buffer holds is not seen: for a client that
    reads nothing, the receive window it opened (tens of KiB)."""

    def __init__(self, ws: Any):
        self.transport = _transport_of(ws)
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        self._fd = sock.fileno() if sock is not None and _SIOCOUTQ is not None else None
        self._last = 0

    @property
    def measured(self) -> bool:
        return self.transport is not None

    def __call__(self) -> int:
        """Bytes sent and not yet taken (0 when not measured; once the connection is closing, what it was then: a
        connection the keepalive dropped has not had its bytes taken)."""
        if self.transport is None:
            return 0
        if self.transport.is_closing():
            return self._last
        size = self.transport.get_write_buffer_size()
        if self._fd is not None:
            import fcntl

            try:
                size += struct.unpack("i", fcntl.ioctl(self._fd, _SIOCOUTQ, b"\0\0\0\0"))[0]
            except OSError:  # not a TCP socket (a Unix socket), or closed
                self._fd = None
        self._last = size
        return size

    def abort(self) -> None:
        """Drop the connection now, unsent bytes and all (a client that reads nothing never takes a close)."""
        if self.transport is not None:
            self.transport.abort()


def _transport_of(ws: Any) -> Any:
    for call in (getattr(ws, "_receive", None), getattr(ws, "_send", None)):  # middleware wraps send, not receive
        transport = getattr(getattr(call, "__self__", None), "transport", None)
        if callable(getattr(transport, "get_write_buffer_size", None)):
            return transport
    return None


def error_message(message: str, param: str | None = None) -> dict[str, Any]:
    return {"type": "error", "error": {"message": message, "param": param}}


class LivePrompts:
    """The segments of a stream, read by the causal sampler as it goes (a live source for `stream_video`).

    The stream is `num_blocks` blocks long. Each prompt switch the client sends waits in order; the sampler
    takes the next one when it reads its next segment, which is before the next block when the running
    segment is open-ended (a switch without `blocks`), or when the running one's `blocks` are done. With no
    switch waiting, the prompt in use goes on. `stop()` ends the stream after the block being made.
    Thread-safe: the socket's task switches, the worker's sampler reads.
    """

    def __init__(self, prompt: str, num_blocks: int, announce: Callable[[dict], None] = lambda message: None):
        self.prompt = prompt
        self.num_blocks = num_blocks
        self.announce = announce  # called with {"type": "prompt", ...} as each switch takes effect
        self._lock = threading.Lock()
        self._switches: deque[tuple[str, int | None]] = deque()
        self._stopped = False
        self._read = False  # the first segment was handed out
        self._end = 0  # the block the running segment ends before
        self._open = True  # the running segment lasts until the next switch

    @property
    def pending(self) -> int:
        """Prompt switches waiting to take effect."""
        with self._lock:
            return len(self._switches)

    @property
    def stopped(self) -> bool:
        return self._stopped

    def switch(self, prompt: str, blocks: int | None = None) -> None:
        """Queue a switch to `prompt` (for `blocks` blocks, or until the next switch)."""
        with self._lock:
            if len(self._switches) >= MAX_PENDING_SWITCHES:
                raise RequestProblem(f"{MAX_PENDING_SWITCHES} prompt switches are already waiting; send the next "
                                     "once one is acknowledged", "prompt")
            self._switches.append((prompt, blocks))

    def stop(self) -> None:
        with self._lock:
            self._stopped = True

    def __iter__(self) -> LivePrompts:
        return self

    def __next__(self) -> tuple[str, int]:
        with self._lock:
            start = self._end if self._read else 0
            rest = self.num_blocks - start
            if (self._stopped and self._read) or rest <= 0:
                raise StopIteration
            switched = bool(self._switches)
            if switched:
                self.prompt, blocks = self._switches.popleft()
            else:
                blocks = None
            self._read, self._open = True, blocks is None
            count = rest if blocks is None else min(blocks, rest)
            self._end = start + count
            prompt = self.prompt
        if switched:
            self.announce({"type": "prompt", "prompt": prompt, "from_block": start})
        return prompt, count

    def ends_segment(self, block_index: int) -> bool:
        """Asked by the sampler before each block of a segment after its first: end the segment here?"""
        with self._lock:
            if self._stopped or (self._open and self._switches):
                self._end = block_index
                return True
            return False


def encode_jpeg(frame: np.ndarray, quality: int = JPEG_QUALITY) -> bytes:
    """One uint8 [H, W, 3] frame as JPEG (4:4:4, so thin coloured edges survive)."""
    import PIL.Image

    out = io.BytesIO()
    PIL.Image.fromarray(frame).save(out, format="JPEG", quality=quality, subsampling=0)
    return out.getvalue()


class StreamSession:
    """The bridge between the worker (which calls `started`, `chunk`, `finished` from its thread) and one
    socket (whose task takes the messages with `next_item` and calls `sent` after each chunk).

    Messages go through one queue on the socket's event loop, in order; chunks also take one of
    `BUFFERED_CHUNKS` slots, released once the client has taken what was sent before the chunk, so the worker
    waits (generation pauses) while the client is behind. A client that takes nothing for the stall timeout
    fails the stream (`fail`, StreamStalled: the socket's side decides)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, job: Job, prompts: LivePrompts,
                 buffered: int = BUFFERED_CHUNKS):
        self.loop = loop
        self.job = job
        self.prompts = prompts
        self.num_blocks = prompts.num_blocks
        self.queue: asyncio.Queue = asyncio.Queue()
        self._slots = threading.Semaphore(buffered)
        self._lock = threading.Lock()
        self.buffered = 0  # chunks made and not yet sent
        self.max_buffered = 0
        self.chunks = 0  # chunks handed to the socket
        self.frames = 0  # their frames
        self.source: Any = None  # the generator's VideoStream (its stats.fps), set by the worker
        self._began: float | None = None  # when the worker started the stream (time.perf_counter)
        self._last: float | None = None  # when its latest chunk was made
        self.closed = threading.Event()  # the socket is gone: nothing more to post
        self._waiter: tuple | None = None  # (chunk, jpegs, on_room, since): a chunk `offer` kept for a slot
        self.failure: BaseException | None = None  # set by `fail`: the stream ends with it at its next chunk
        self.backlog = 0  # bytes sent that the client had not taken, when last measured
        self.behind_since: float | None = None  # when the socket began waiting for the client (None: not waiting)
        prompts.announce = self.post_message

    # -- the worker's side --------------------------------------------------------------------------
    def _post(self, item: tuple) -> None:
        if self.closed.is_set():
            return
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: the server stopped
            self.closed.set()

    def post_message(self, message: dict) -> None:
        self._post(("message", message))

    @property
    def fps(self) -> float | None:
        """The frame rate the stream reached (its stats' `fps`: frames made per second from its first read to its
        latest chunk; None before the first chunk)."""
        stats = getattr(self.source, "stats", None)
        fps = getattr(stats, "fps", None)
        if isinstance(fps, (int, float)):
            return float(fps)
        if self.frames and self._began is not None and self._last is not None and self._last > self._began:
            return self.frames / (self._last - self._began)  # a source without stats: the same count, made here
        return None

    def started(self, job: Job) -> None:
        self._began = time.perf_counter()
        req = job.request
        message = {"type": "started", "id": job.id, "seed": req.get("seed"), "fps": req.get("fps"),
                   "height": req.get("height"), "width": req.get("width"), "num_blocks": self.num_blocks}
        if req.get("target_fps") is not None:
            message["target_fps"] = req["target_fps"]
        self.post_message(message)

    def chunk(self, chunk: Any, token: CancelToken) -> None:
        """Encode a decoded chunk and queue it for the socket, waiting for a free slot (cancellable; `fail` ends the
        wait with its error). For a worker that runs the stream on a thread of its own (several ranks); see `offer`
        for the waiting without one."""
        self._last = time.perf_counter()
        jpegs = [encode_jpeg(frame) for frame in np.asarray(chunk.frames)]
        while self.failure is None and not self._slots.acquire(timeout=0.05):
            token.check()
        if self.failure is not None:
            raise self.failure
        with self._lock:
            self._queue_locked(chunk, jpegs)

    def offer(self, chunk: Any, on_room: Callable[[BaseException | None], None]) -> bool:
        """Encode a decoded chunk and queue it if a slot is free (True). Otherwise keep it and return False at once:
        no thread waits. When the client frees a slot (`sent`), the chunk is queued and `on_room(None)` is called;
        `abandon(error)` (a cancel, a stall: the worker's watchdog) calls `on_room(error)` instead."""
        self._last = time.perf_counter()
        jpegs = [encode_jpeg(frame) for frame in np.asarray(chunk.frames)]
        with self._lock:
            if self.failure is not None:
                raise self.failure
            if self._slots.acquire(blocking=False):
                self._queue_locked(chunk, jpegs)
                return True
            self._waiter = (chunk, jpegs, on_room, time.perf_counter())
            return False

    def waited(self, now: float) -> float | None:
        """Seconds a chunk kept by `offer` has waited for a slot (None: none waits)."""
        with self._lock:
            return None if self._waiter is None else now - self._waiter[3]

    def fail(self, error: BaseException) -> None:
        """End the stream with `error` (its client stopped reading): the chunk waiting for a slot at once, else the
        next chunk the worker offers."""
        with self._lock:
            self.failure = error
        self.abandon(error)

    def abandon(self, error: BaseException) -> bool:
        """Drop the chunk waiting for a slot and call its `on_room(error)`; False when none waits (any more)."""
        with self._lock:
            waiter, self._waiter = self._waiter, None
        if waiter is None:
            return False
        waiter[2](error)
        return True

    def _queue_locked(self, chunk: Any, jpegs: list[bytes]) -> None:
        index, self.chunks = self.chunks, self.chunks + 1
        self.buffered += 1
        self.max_buffered = max(self.max_buffered, self.buffered)
        self.frames += len(jpegs)
        fps = self.fps
        header = {"type": "chunk", "index": index, "block": chunk.block_index, "frames": len(jpegs),
                  "first_frame": chunk.start_frame, "prompt": chunk.prompt,
                  "fps": None if fps is None else round(fps, 2)}
        self._post(("chunk", header, jpegs))

    def finished(self, job: Job) -> None:
        """The job ended (completed, failed or cancelled, queued or running): the last message."""
        if job.status == COMPLETED:
            message = {"type": "done", "id": job.id, "frames": self.frames, "video": f"/v1/videos/{job.id}/content"}
            code = NORMAL
        elif job.status == CANCELLED:
            message, code = error_message(f"stream {job.id} was cancelled"), NORMAL
        else:
            message, code = error_message(f"stream {job.id} failed: {job.error}"), FAILED_CODE
        self._post(("end", message, code))

    # -- the socket's side --------------------------------------------------------------------------
    def sent(self) -> None:
        """A chunk went out: its slot is free again, or passes straight to the chunk `offer` kept."""
        with self._lock:
            self.buffered -= 1
            waiter, self._waiter = self._waiter, None
            if waiter is not None:
                self._queue_locked(waiter[0], waiter[1])
        if waiter is None:
            self._slots.release()
        else:
            waiter[2](None)


class StreamRoutes:
    """The `/v1/streams` route's shared state (`app.state.streams`, `ServerState.streams`): the open streams, how
    long a stream waits for a client that reads nothing, how far behind a client may be before its stream waits,
    and the metrics /metrics shows."""

    def __init__(self, state: Any):
        self.state = state
        self.open: dict[str, StreamSession] = {}
        timeout = state.config.request_timeout
        self.stall_timeout: float | None = STALL_TIMEOUT if timeout is None else min(STALL_TIMEOUT, timeout)
        self.behind_bytes = BEHIND_BYTES
        self.close_grace = CLOSE_GRACE
        self.first_chunk_sum = 0.0
        self.first_chunk_count = 0
        self.max_buffered = 0  # the most chunks any stream had made and not yet sent

    def metric_lines(self) -> list[str]:
        """Prometheus lines: streams by state, open streams, chunks buffered, time to first chunk, and each running
        stream's frame rate (and target), labelled by its id: series only for the streams running now, so at most
        --max-concurrent of them at a time."""
        counts = dict.fromkeys(STATES, 0)
        for job in self.state.store.all():
            if job.kind == STREAM:
                counts[job.status] += 1
        sessions = list(self.open.values())
        lines = ["# HELP composer_streams live streams (jobs of kind stream) by state", "# TYPE composer_streams gauge"]
        lines += [f'composer_streams{{state="{s}"}} {counts[s]}' for s in STATES]
        lines += ["# HELP composer_streams_open WebSocket streams connected now", "# TYPE composer_streams_open gauge",
                  f"composer_streams_open {len(sessions)}",
                  "# HELP composer_stream_buffered_chunks chunks made and not yet sent, over the open streams",
                  "# TYPE composer_stream_buffered_chunks gauge",
                  f"composer_stream_buffered_chunks {sum(s.buffered for s in sessions)}",
                  "# HELP composer_stream_client_backlog_bytes bytes sent that the clients had not taken (the "
                  "server's transport and kernel buffers), over the open streams",
                  "# TYPE composer_stream_client_backlog_bytes gauge",
                  f"composer_stream_client_backlog_bytes {sum(s.backlog for s in sessions)}",
                  "# HELP composer_streams_waiting_for_client open streams whose client is behind (generation paused)",
                  "# TYPE composer_streams_waiting_for_client gauge",
                  f"composer_streams_waiting_for_client {sum(s.behind_since is not None for s in sessions)}",
                  "# HELP composer_stream_first_chunk_seconds from a stream starting to run to its first chunk sent",
                  "# TYPE composer_stream_first_chunk_seconds summary",
                  f"composer_stream_first_chunk_seconds_sum {self.first_chunk_sum:.6f}",
                  f"composer_stream_first_chunk_seconds_count {self.first_chunk_count}"]
        running = [(s.job.id, s.fps, s.job.request.get("target_fps")) for s in sessions
                   if s.job.status == IN_PROGRESS]
        lines += ["# HELP composer_stream_fps frames per second a running stream reached (from its first read to its "
                  "latest chunk), by stream id; only streams running now", "# TYPE composer_stream_fps gauge"]
        lines += [f'composer_stream_fps{{stream="{sid}"}} {fps:.3f}' for sid, fps, _ in running if fps is not None]
        lines += ["# HELP composer_stream_target_fps the frame rate a running stream asked for (target_fps), by "
                  "stream id", "# TYPE composer_stream_target_fps gauge"]
        lines += [f'composer_stream_target_fps{{stream="{sid}"}} {target:g}' for sid, _, target in running
                  if target is not None]
        return lines


def add_stream_routes(router: APIRouter, state: Any) -> StreamRoutes:
    """Register `/v1/streams` on `router` (the video routes; its ServerState is `state`); returns the routes'
    shared state (the app keeps it as `app.state.streams`, its metrics go to /metrics)."""
    routes = StreamRoutes(state)

    @router.websocket("/v1/streams")
    async def stream(ws: WebSocket):
        """A live stream of a causal model's blocks (docs/serving.md, "Live streams")."""
        await ws.accept()
        generator = state.generator
        if generator is None:
            why = f"the model failed to load: {state.load_error}" if state.load_error else "the model is loading"
            return await _refuse(ws, why, None, TRY_LATER)
        if not getattr(generator.pipeline, "can_stream", False):
            return await _refuse(ws, f"{generator.family} makes whole videos and cannot stream; live streams need a "
                                 "causal (block-autoregressive) model: POST /v1/videos for this one", "model")
        try:
            text = await asyncio.wait_for(ws.receive_text(), FIRST_MESSAGE_TIMEOUT)
        except asyncio.TimeoutError:
            return await _refuse(ws, f"no request within {FIRST_MESSAGE_TIMEOUT:g} s of connecting", None)
        except WebSocketDisconnect:
            return
        except KeyError:  # a binary message
            return await _refuse(ws, "the first message must be a JSON text message with the request", None)
        try:
            body = _parse(text)
            checked, num_blocks = await run_in_threadpool(_check_stream_body, body, generator, state.config)
        except RequestProblem as exc:
            return await _refuse(ws, str(exc), exc.field)

        job = Job(new_job_id(state.config.replica), checked.params, model=str(generator.model_path), kind=STREAM,
                  lora=checked.lora, priority=checked.priority, warnings=checked.warnings,
                  owner=getattr(ws.state, "api_key_name", None))  # the API key's name (auth.py; None: no keys)
        if "rtmp_url" in checked.inputs:  # its stream key is a secret: kept out of the record GET /v1/videos shows
            job.inputs["rtmp_url"] = checked.inputs["rtmp_url"]
        prompts = LivePrompts(checked.params["prompt"], num_blocks)
        session = StreamSession(asyncio.get_running_loop(), job, prompts)
        state.store.add(job)
        try:
            state.worker.submit(job, stream=session)
        except QueueFull:
            state.store.remove(job.id)
            return await _refuse(ws, f"the queue is full ({state.config.max_queue} jobs waiting); retry later", None,
                                 TRY_LATER)
        routes.open[job.id] = session
        send_lock = asyncio.Lock()  # a chunk's header and its frames go out together
        backlog = ClientBacklog(ws)
        try:
            ahead = state.worker.jobs_ahead(job)
            if job.status == QUEUED and ahead:
                await ws.send_text(json.dumps({"type": "queued", "id": job.id, "position": ahead}))
            pump = asyncio.create_task(_pump(ws, session, send_lock, routes, backlog))
            listen = asyncio.create_task(_listen(ws, session, send_lock, state))
            done, pending = await asyncio.wait({pump, listen}, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    logger.info("stream %s: the socket closed (%s)", job.id, task.exception())
        finally:
            session.closed.set()
            routes.open.pop(job.id, None)
            _client_left(session, state)
            if session.failure is not None and backlog.measured:  # its close may never be read: drop it in a while
                asyncio.get_running_loop().call_later(routes.close_grace, _abort_unread, backlog)

    return routes


async def _refuse(ws: WebSocket, message: str, param: str | None, code: int = REFUSED) -> None:
    try:
        await ws.send_text(json.dumps(error_message(message, param)))
        await ws.close(code)
    except (WebSocketDisconnect, RuntimeError, OSError):  # the client left first
        pass


def _parse(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise RequestProblem(f"the message is not valid JSON ({exc})") from None


def _check_stream_body(body: Any, generator: Any, config: Any) -> tuple[Any, int]:
    """The first message -> (the checked request, the stream's length in blocks). `num_blocks` stands for the
    num_frames it implies, so the server's --max-frames bounds a stream as it bounds a video."""
    if not isinstance(body, dict):
        raise RequestProblem(f"the first message must be a JSON object of request fields, not {type(body).__name__}")
    limits = ModelLimits.from_pipeline(generator.pipeline)
    per_block, temporal = limits.frames_per_block or 1, limits.temporal_factor or 1
    body = dict(body)
    blocks = body.pop("num_blocks", None)
    target_fps = body.pop("target_fps", None)
    rtmp_url = _checked_rtmp_url(body.pop("rtmp_url", None), config)
    if target_fps is not None and (isinstance(target_fps, bool) or not isinstance(target_fps, (int, float))
                                   or not math.isfinite(target_fps) or target_fps <= 0):
        raise RequestProblem(f"target_fps = {target_fps!r}: expected a number of frames per second > 0 (or leave it "
                             "out: no target)", "target_fps")
    if blocks is not None:
        if isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1:
            raise RequestProblem(f"num_blocks = {blocks!r}: expected an integer >= 1", "num_blocks")
        given = [key for key in ("num_frames", "seconds") if key in body]
        if given:
            raise RequestProblem(f"give num_blocks or {given[0]}, not both", "num_blocks")
        body["num_frames"] = (blocks * per_block - 1) * temporal + 1
    try:
        checked = check_body(body, generator, config.limits, config.loras, config.uploads)
    except RequestProblem as exc:
        if blocks is not None and exc.field == "num_frames":
            raise RequestProblem(f"num_blocks = {blocks} is {body['num_frames']} frames; {exc}", "num_blocks") from None
        raise
    if target_fps is not None:  # stream_video's own argument: the worker passes the record's fields on
        checked.params["target_fps"] = float(target_fps)
    if rtmp_url is not None:  # stream_video's too, passed on from the job's inputs (not its record)
        checked.inputs["rtmp_url"] = rtmp_url
    latent = (checked.params["num_frames"] - 1) // temporal + 1
    return checked, latent // per_block


def _checked_rtmp_url(url: Any, config: Any) -> str | None:
    """The first message's `rtmp_url`: only under a prefix the server allows (`--rtmp-allow`), so a client cannot make
    the server connect where it likes (SSRF); messages show it without its stream key."""
    if url is None:
        return None
    from composer.rtmp import check_rtmp_url, redact_url, url_allowed

    allowed = list(getattr(config, "rtmp_allow", None) or [])
    if not allowed:
        raise RequestProblem("rtmp_url: this server pushes streams to no RTMP URL (start it with --rtmp-allow PREFIX "
                             "to allow some)", "rtmp_url")
    try:
        url = check_rtmp_url(url, "rtmp_url")
    except ComposerError as exc:
        raise RequestProblem(str(exc), "rtmp_url") from None
    if not url_allowed(url, allowed):
        raise RequestProblem(f"rtmp_url = {redact_url(url)!r}: not under a prefix this server allows (its "
                             "--rtmp-allow)", "rtmp_url")
    return url


def _client_left(session: StreamSession, state: Any) -> None:
    """The socket is done with: a stream still running is cancelled (the client left), or failed as stalled when
    its client had stopped reading (the connection was dropped while the stream waited for it: uvicorn's keepalive
    closes a connection whose client answers no ping within 20 s)."""
    job = session.job
    if job.status in FINISHED or state.worker is None:
        return
    if session.failure is None and session.behind_since is not None:
        waited = time.perf_counter() - session.behind_since
        error = StreamStalled(f"the client stopped reading ({session.backlog} bytes sent were not taken for "
                              f"{waited:.0f} s) and its connection closed; the stream was stopped")
        logger.warning("stream %s: %s", job.id, error)
        session.fail(error)
    if session.failure is not None and job.status == IN_PROGRESS:
        return  # the stream fails with it at its next chunk (at once when one waits for a slot)
    if session.failure is None:
        logger.info("stream %s: the client disconnected; the stream is cancelled", job.id)
    state.worker.cancel(job)  # stop within one block


def _abort_unread(backlog: ClientBacklog) -> None:
    if backlog():  # the close frame is still unsent: the client reads nothing
        backlog.abort()


async def _until_taken(session: StreamSession, backlog: ClientBacklog, limit: int, stall_timeout: float | None) -> bool:
    """Wait until at most `limit` bytes sent are left for the client to take (False: it took nothing for
    `stall_timeout`, and the stream is failed). Polled, every 2 ms growing to 50 ms, only while it is behind."""
    left = session.backlog = backlog()
    since = session.behind_since = time.perf_counter() if left > limit else None
    delay = 0.002
    while left > limit and session.job.status not in FINISHED:
        if session.failure is not None:
            return False
        now = time.perf_counter()
        if stall_timeout is not None and now - since > stall_timeout:
            _stalled(session, stall_timeout)
            return False
        await asyncio.sleep(delay)
        delay = min(2 * delay, 0.05)
        now_left = backlog()
        if now_left < left:  # it took some: the stall clock starts again
            since = time.perf_counter()
        left = session.backlog = now_left
    session.behind_since = None
    return True


def _stalled(session: StreamSession, waited: float) -> None:
    error = StreamStalled(f"the client read nothing for {waited:g} s ({session.backlog} bytes sent were not "
                          "taken); the stream was stopped")
    logger.warning("stream %s: %s", session.job.id, error)
    session.fail(error)


async def _send(ws: WebSocket, session: StreamSession, send: Any, timeout: float | None) -> bool:
    """One message; False when the server's own flow control held it for `timeout` (the client read nothing
    meanwhile: the stream is failed, if it is not already)."""
    if timeout is None:
        await send
        return True
    try:
        await asyncio.wait_for(send, timeout)
    except asyncio.TimeoutError:
        if session.failure is None:
            _stalled(session, timeout)
        return False
    return True


async def _pump(ws: WebSocket, session: StreamSession, lock: asyncio.Lock, routes: StreamRoutes,
                backlog: ClientBacklog) -> None:
    """Send the session's messages in order until its last one, then close. A chunk's slot is freed once the
    client has taken what was sent before it; a client that takes nothing for the stall timeout fails its
    stream, and the chunks still queued are dropped on the way to the last message."""
    first = True
    while True:
        kind, *rest = await session.queue.get()
        if session.failure is not None and kind != "end":
            continue  # the client stopped reading: only the last message is still sent
        stall = routes.stall_timeout
        if kind == "message":
            async with lock:
                await _send(ws, session, ws.send_text(json.dumps(rest[0])), stall)
        elif kind == "chunk":
            header, jpegs = rest
            async with lock:
                sent = await _send(ws, session, ws.send_text(json.dumps(header)), stall)
                for data in jpegs:
                    sent = sent and await _send(ws, session, ws.send_bytes(data), stall)
            size = sum(map(len, jpegs))
            if not (sent and await _until_taken(session, backlog, max(routes.behind_bytes, size), stall)):
                continue
            routes.max_buffered = max(routes.max_buffered, session.max_buffered)
            session.sent()
            if first and session.job.started_at is not None:
                routes.first_chunk_sum += time.time() - session.job.started_at
                routes.first_chunk_count += 1
            first = False
        else:  # "end"
            message, code = rest
            grace = routes.close_grace if session.failure is not None else None  # a stalled client may never read
            async with lock:
                if await _send(ws, session, ws.send_text(json.dumps(message)), grace):
                    await _send(ws, session, ws.close(code), grace)
            return


async def _listen(ws: WebSocket, session: StreamSession, lock: asyncio.Lock, state: Any) -> None:
    """Take the client's messages (prompt switches, stop) until it disconnects; a bad one gets an error
    message and the stream goes on."""
    while True:
        message = await ws.receive()
        if message["type"] == "websocket.disconnect":
            return
        text = message.get("text")
        try:
            if text is None:
                raise RequestProblem("expected a JSON text message ({\"type\": \"prompt\", ...} or {\"type\": "
                                     "\"stop\"}), got binary data")
            _client_message(_parse(text), session, state)
        except RequestProblem as exc:
            async with lock:
                await ws.send_text(json.dumps(error_message(str(exc), exc.field)))


def _client_message(body: Any, session: StreamSession, state: Any) -> None:
    """Act on one message from the client: {"type": "prompt", "prompt", "blocks"?} or {"type": "stop"}."""
    if not isinstance(body, dict):
        raise RequestProblem(f"expected a JSON object with a type, not {type(body).__name__}", "type")
    kind = body.get("type")
    if kind == "stop":
        extra = sorted(set(body) - {"type"})
        if extra:
            raise RequestProblem(f"unknown field {extra[0]!r} in a stop message", extra[0])
        session.prompts.stop()
        if session.job.status == QUEUED:  # nothing made yet: nothing to keep
            state.worker.cancel(session.job)
        return
    if kind != "prompt":
        raise RequestProblem(f"type = {kind!r}: expected \"prompt\" (switch the prompt) or \"stop\"", "type")
    extra = sorted(set(body) - {"type", "prompt", "blocks"})
    if extra:
        raise RequestProblem(f"unknown field {extra[0]!r} in a prompt message (fields: type, prompt, blocks)", extra[0])
    prompt, blocks = body.get("prompt"), body.get("blocks")
    if not isinstance(prompt, str) or not prompt.strip():
        raise RequestProblem(f"prompt = {prompt!r}: expected a non-empty string", "prompt")
    if problem := text_length_problem("prompt", prompt):  # the limit every request's text has
        raise RequestProblem(problem, "prompt")
    if blocks is not None and (isinstance(blocks, bool) or not isinstance(blocks, int) or blocks < 1):
        raise RequestProblem(f"blocks = {blocks!r}: expected an integer >= 1 (or leave it out: until the next "
                             "switch)", "blocks")
    session.prompts.switch(prompt, blocks)
