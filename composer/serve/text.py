"""`composer serve` on a diffusion language model: OpenAI's completions and chat completions APIs.

    POST /v1/completions        {"model", "prompt": str | [str] | [int] | [[int]], "max_tokens", "temperature",
                                 "top_p", "seed", "n", "stop", "stream", "priority"}
    POST /v1/chat/completions   {"model", "messages": [{"role", "content"}], "max_tokens" |
                                 "max_completion_tokens", "temperature", "top_p", "seed", "n", "stop", "stream",
                                 "priority"}
    (and what every server has, composer/serve/server.py: GET /v1/models, /v1/models/{model}, /health, /ready,
    /metrics, API keys)

These routes serve the state's text model (`ServerState.text_generator`): the one model of a text server, or the
text model served beside a video model (`composer serve --text-model-path`), whose /metrics lines then name the
text queue's gauges composer_text_queue_length, composer_text_queue_wait_seconds and composer_text_max_concurrent
(the video ones keep the plain names).

The official `openai` SDK works against it unchanged (`client.chat.completions.create(...)`, `stream=True` as
server-sent events of the text each block makes final). composer's own settings (block_length,
num_inference_steps or steps, threshold, decoding, top_k, editing_threshold, ...) go in the body too (the SDK's
`extra_body`). What a body may hold and how it is checked: composer/serve/text_requests.py.

A request is checked whole before anything runs, a stream's included (its first block is made before the 200, so
an error the library finds before generating has its real status): the fields on the event loop, the tokens on a
worker thread. It then waits for one of --max-concurrent slots (composer/serve/slots.py: an asyncio future, higher
`priority` first, then by arrival; more than --max-queue waiting: 429, as a full video queue) and runs, for at most
--request-timeout seconds (then it is cancelled: a 504, or a stream's error event). A request runs as a task of the
text model's engine core (`TextGenerator.submit_text`, whose future the route awaits: no thread waits for it); a
stream's blocks are awaited one at a time the same way (`astream_text`). Running requests' refinement steps share model forwards
(composer/text/batching.py), and no forward is longer than the model's context allows.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from composer.cancel import CancelToken
from composer.errors import Cancelled, ComposerError
from composer.logging import get_logger
from composer.serve.problems import RequestProblem as _Problem
from composer.serve.responses import error, queue_full, refused
from composer.serve.server import ServeConfig, ServerState, build_app
from composer.serve.slots import ClientGone, QueueFull
from composer.serve.text_requests import TextRequest, body_limit, fit, parse
from composer.serve.uploads import read_json

logger = get_logger(__name__)

DISCONNECT_POLL_S = 0.25  # how often a request looks for its client (waiting for a slot, or running)
TIMEOUT = "timeout"  # the reason a request's CancelToken is cancelled with when it runs past --request-timeout
CLIENT_GONE = 499  # the status logged for a request whose client left while it waited (nginx's "client closed")


def create_text_app(load: Callable[[], Any], config: ServeConfig) -> FastAPI:
    """The app of a text model: what app.py's `create_app(load, config, modality="text")` builds."""
    return build_app(load, config, "text", add_text_routes, text_metric_lines)


def add_text_routes(app: FastAPI, state: ServerState) -> None:
    """A text model's routes (`text_routes`) on the app."""
    app.include_router(text_routes(state))


def _cut(text: str, stop: list[str]) -> tuple[str, bool]:
    """The text up to the first stop string (excluded), and whether one was found."""
    ends = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[: min(ends)], True) if ends else (text, False)


def text_metric_lines(state: ServerState) -> list[str]:
    """A text server's /metrics lines: requests, failures, tokens, forwards and seconds counted; requests running,
    waiting, the slots, and how long the started ones waited. Beside a video model, the queue's and the slots'
    lines are named composer_text_* (the video lines have the plain names: no name twice)."""
    counted, slots = state.counters, state.slots
    lines = [
        "# HELP composer_text_requests_total text requests answered (failed ones too)",
        "# TYPE composer_text_requests_total counter", f"composer_text_requests_total {counted.requests}",
        "# HELP composer_text_failures_total text requests that failed (errors, timeouts, cancelled)",
        "# TYPE composer_text_failures_total counter", f"composer_text_failures_total {counted.failures}",
        "# HELP composer_text_tokens_total tokens made", "# TYPE composer_text_tokens_total counter",
        f"composer_text_tokens_total {counted.tokens}",
        "# HELP composer_text_forwards_total model forwards the requests ran (a shared one counts for each)",
        "# TYPE composer_text_forwards_total counter", f"composer_text_forwards_total {counted.forwards}",
        "# HELP composer_text_seconds_total seconds the requests ran", "# TYPE composer_text_seconds_total counter",
        f"composer_text_seconds_total {counted.seconds:.3f}",
        "# HELP composer_text_requests_running text requests running now (a stream until its last event)",
        "# TYPE composer_text_requests_running gauge", f"composer_text_requests_running {slots.running}",
        "# HELP composer_queue_length requests waiting for a slot", "# TYPE composer_queue_length gauge",
        f"composer_queue_length {slots.waiting}",
        "# HELP composer_queue_wait_seconds seconds each started request waited for its slot",
        "# TYPE composer_queue_wait_seconds summary", f"composer_queue_wait_seconds_sum {slots.wait_seconds:.6f}",
        f"composer_queue_wait_seconds_count {slots.waits}",
        "# HELP composer_max_concurrent requests that may run at once (--max-concurrent)",
        "# TYPE composer_max_concurrent gauge", f"composer_max_concurrent {slots.max_concurrent}"]
    if state.two_models:
        shared = ("composer_queue_length", "composer_queue_wait_seconds", "composer_max_concurrent")
        for name in shared:
            text_name = name.replace("composer_", "composer_text_", 1)
            lines = [line.replace(f" {name}", f" {text_name}", 1) if line.startswith("#") else
                     text_name + line[len(name):] if line.startswith(name) else line for line in lines]
    return lines


def text_routes(state: ServerState) -> APIRouter:
    """POST /v1/completions and /v1/chat/completions over the state's text generator."""
    router = APIRouter()
    config = state.config

    def model_name() -> str:
        return str(state.text_generator.model_path)

    def timed_out(cancel: CancelToken) -> str | None:
        """The message of a request stopped by the request timeout (None: it was not)."""
        if cancel.cancelled and cancel.reason == TIMEOUT:
            return f"the request ran past the request timeout ({config.request_timeout:g} s) and was cancelled"
        return None

    async def admit(checked: TextRequest, cancel: CancelToken, gone: asyncio.Task) -> Callable[[], None] | Response:
        """Wait for a slot (no thread waits: the request awaits a future); the release to call once the request
        ends (it stops the timeout's timer too), or the answer of one that never ran (the queue is full, or the
        client left)."""
        try:
            await state.slots.acquire(checked.priority, gone)
        except QueueFull:
            return queue_full(config.max_queue, "requests")
        except ClientGone:
            return error(CLIENT_GONE, "the client left while its request waited for a slot")
        loop = asyncio.get_running_loop()
        timer = loop.call_later(config.request_timeout, cancel.cancel, TIMEOUT) if config.request_timeout else None
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                if timer is not None:
                    timer.cancel()
                state.slots.release()

        return release

    async def handle(request: Request, chat: bool):
        if (not_ready := state.unready("text")) is not None:  # (a video model served beside it may still load)
            return not_ready
        generator = state.text_generator
        try:
            body = await read_json(request, body_limit(generator, config.max_body_bytes))
            if (other := state.other_model(body, "text")) is not None:  # the video model's name, beside it
                raise other
            checked = parse(body, chat, generator)
            await run_in_threadpool(fit, generator, checked)  # tokenizing: on a worker thread, holding no one
        except _Problem as exc:
            return refused(exc)
        except ComposerError as exc:
            return error(400, str(exc))
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        cancel = CancelToken()  # a client that leaves stops its request: it would take a share of every forward
        gone = asyncio.create_task(_cancel_when_gone(request, cancel))
        try:
            release = await admit(checked, cancel, gone)
            if isinstance(release, Response):  # it never ran
                return release
            if checked.stream:
                return await stream(checked, ident, created, cancel, release, gone)
            try:
                return await complete(checked, chat, ident, created, cancel)
            finally:
                release()
        finally:
            gone.cancel()

    async def complete(checked: TextRequest, chat: bool, ident: str, created: int, cancel: CancelToken):
        generator = state.text_generator
        start = time.perf_counter()
        try:
            results = await asyncio.wrap_future(generator.submit_text(  # a task of the model's core: no thread waits
                **checked.inputs(), **checked.settings, cancel=cancel, priority=checked.priority))
        except ComposerError as exc:
            state.counters.count([], time.perf_counter() - start, failed=True)
            if (late := timed_out(cancel)) is not None:
                return error(504, late)
            if isinstance(exc, Cancelled):
                logger.info("%s stopped: %s", ident, cancel.reason)
            return error(_status(exc), str(exc))
        except BaseException:
            state.counters.count([], time.perf_counter() - start, failed=True)
            raise
        results = results if isinstance(results, list) else [results]
        state.counters.count(results, time.perf_counter() - start)
        choices = []
        for index, result in enumerate(results):
            text, stopped = _cut(result.text, checked.stop)
            reason = "stop" if stopped or result.finished else "length"
            if chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": text},
                                "finish_reason": reason, "logprobs": None})
            else:
                choices.append({"index": index, "text": text, "finish_reason": reason, "logprobs": None})
        prompt_tokens = sum(r.prompt_tokens for r in results) if not chat else results[0].prompt_tokens
        completion = sum(len(r.token_ids) for r in results)
        return {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model_name(), "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                          "total_tokens": prompt_tokens + completion},
                "composer": {"forwards": results[0].stats.forwards, "seed": results[0].seed}}

    async def stream(checked: TextRequest, ident: str, created: int, cancel: CancelToken,
                     release: Callable[[], None], gone: asyncio.Task):
        """Server-sent events, once the first piece is made: what fails before it (the library's checks, the
        tokenizer's) is an error with its status, as the SDK expects, not a 200 with an error event. The slot is
        held until the last event (or the client leaves)."""
        start = time.perf_counter()
        pieces = None
        try:  # each block a task of the text model's core, awaited here: no thread waits for the stream
            pieces = state.text_generator.astream_text(**checked.inputs(), **checked.settings, cancel=cancel,
                                                       priority=checked.priority)
            first = await anext(pieces, None)
        except BaseException as exc:
            if pieces is not None:
                await pieces.aclose()
            release()
            state.counters.count([], time.perf_counter() - start, failed=True)
            if not isinstance(exc, ComposerError):
                raise
            late = timed_out(cancel)
            return error(504, late) if late is not None else error(_status(exc), str(exc))
        gone.cancel()  # from here the response watches its client (StreamingResponse reads the disconnect)

        closing: list = []

        def end() -> None:  # (its callers may both call it)
            release()
            if not closing:  # a client gone mid-stream: the request leaves the pipeline now, not when collected
                closing.append(asyncio.get_running_loop().create_task(pieces.aclose()))

        events = _events(state, pieces, first, checked, ident, created, start, lambda: timed_out(cancel), end)
        return _HeldStream(events, end, media_type="text/event-stream")

    @router.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return router


class _HeldStream(StreamingResponse):
    """A stream whose slot is released however its response ends: after its last event, or when the client left
    (the events may never have started)."""

    def __init__(self, content: AsyncIterator[bytes], end: Callable[[], None], **kwargs: Any):
        super().__init__(content, **kwargs)
        self._end = end

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._end()  # (on the event loop, no piece being made: a thread's next() is awaited before cancelling)


async def _cancel_when_gone(request: Request, cancel: CancelToken) -> None:
    """Cancel the request once its client has disconnected (checked every DISCONNECT_POLL_S)."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    cancel.cancel("its client disconnected")


def _status(exc: ComposerError) -> int:
    """A library error's status: the request's fault (a bad value, something the model cannot do) is a 400."""
    return 400 if isinstance(exc, (ValueError, NotImplementedError)) else 500


async def _events(state: ServerState, pieces: AsyncIterator[Any], first: Any, checked: TextRequest, ident: str,
                  created: int, start: float, timed_out: Callable[[], str | None],
                  end: Callable[[], None]) -> AsyncIterator[bytes]:
    """Server-sent events: the text each block makes final, per choice (from the first piece, already made), then a
    last chunk with each choice's finish reason, then [DONE]. Each next block is a task of the core, awaited; `end`
    (the slot released, the pieces closed) runs before [DONE], or when the client leaves."""
    chat, stop = checked.chat, checked.stop
    kind = "chat.completion.chunk" if chat else "text_completion"
    model = str(state.text_generator.model_path)

    def event(index: int, text: str | None, reason: str | None, first: bool = False) -> bytes:
        if chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "finish_reason": reason, "logprobs": None}
        else:
            choice = {"index": index, "text": text or "", "finish_reason": reason, "logprobs": None}
        payload = {"id": ident, "object": kind, "created": created, "model": model, "choices": [choice]}
        return f"data: {json.dumps(payload)}\n\n".encode()

    sent: dict[int, str] = {}
    stopped: set[int] = set()
    results = []
    try:
        if chat:
            for index in range(checked.rows):
                yield event(index, None, None, first=True)
        piece = first
        while piece is not None:
            row = piece.row
            if row not in stopped:
                so_far, cut = _cut(piece.so_far, stop)
                new = so_far[len(sent.get(row, "")):] if so_far.startswith(sent.get(row, "")) else ""
                if new:
                    yield event(row, new, None)
                    sent[row] = so_far
                if cut:
                    stopped.add(row)
                if piece.done:
                    results.append(piece)
                    finished = cut or (piece.token_ids and piece.token_ids[-1] == state.text_generator.pipeline.stages[-1]
                                       .eos_id)
                    yield event(row, None, "stop" if finished else "length")
            piece = await anext(pieces, None)
        state.counters.count([_Counted(p.token_ids, p.stats) for p in results], time.perf_counter() - start)
    except Exception as exc:  # noqa: BLE001 - the stream is already open: said in an error event
        state.counters.count([], time.perf_counter() - start, failed=True)
        message = timed_out() or str(exc)
        yield f"data: {json.dumps({'error': {'message': message, 'type': 'server_error'}})}\n\n".encode()
    finally:
        end()
    yield b"data: [DONE]\n\n"


class _Counted:
    def __init__(self, token_ids, stats):
        self.token_ids, self.stats = token_ids, stats
