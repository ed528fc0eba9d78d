"""`composer serve` on a diffusion language model: OpenAI's completions and chat completions APIs.

    POST /v1/completions        {"model", "prompt": str | [str] | [int] | [[int]], "max_tokens", "temperature",
                                 "top_p", "seed", "n", "stop", "stream"}
    POST /v1/chat/completions   {"model", "messages": [{"role", "content"}], "max_tokens" |
                                 "max_completion_tokens", "temperature", "top_p", "seed", "n", "stop", "stream"}
    GET  /v1/models, /v1/models/{model}, /health, /metrics

The official `openai` SDK works against it unchanged (`client.chat.completions.create(...)`, `stream=True` as
server-sent events of the text each block makes final). composer's own settings (block_length,
num_inference_steps or steps, threshold, decoding, top_k, editing_threshold, ...) go in the body too (the SDK's
`extra_body`). What a body may hold and how it is checked: composer/serve/text_requests.py.

A request is checked whole before anything runs, a stream's included (its first block is made before the 200, so
an error the library finds before generating has its real status): the fields on the event loop, the tokens on a
worker thread. Requests then run on a thread each; their refinement steps share model forwards
(composer/text/batching.py), and no forward is longer than the model's context allows.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from composer.cancel import CancelToken
from composer.errors import Cancelled, ComposerError
from composer.logging import get_logger
from composer.serve.app import ServeConfig, _read_json, add_error_handlers, error
from composer.serve.requests import RequestProblem as _Problem
from composer.serve.text_requests import TextRequest, body_limit, check_model, fit, parse

logger = get_logger(__name__)

DISCONNECT_POLL_S = 0.25  # how often a running request looks for its client


class TextServerState:
    def __init__(self, load: Callable[[], Any], config: ServeConfig):
        self.config = config
        self.generator: Any = None
        self.load_error: str | None = None
        self.requests = self.failures = self.tokens = self.forwards = 0
        self.seconds = 0.0
        self.running = 0
        self._lock = threading.Lock()
        self._load = load
        self._thread = threading.Thread(target=self._load_model, name="composer-serve-load", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _load_model(self) -> None:
        try:
            self.generator = self._load()
        except Exception as exc:  # noqa: BLE001 - reported by /health
            logger.error("loading the model failed: %s", exc)
            self.load_error = f"{type(exc).__name__}: {exc}"

    def began(self, delta: int = 1) -> None:
        """A request started (1) or ended (-1): the running gauge, counted from the requests' threads."""
        with self._lock:
            self.running += delta

    def count(self, results: list[Any], seconds: float, failed: bool = False) -> None:
        with self._lock:
            self.requests += 1
            self.failures += failed
            self.seconds += seconds
            if results:
                self.tokens += sum(len(r.token_ids) for r in results)
                self.forwards += results[0].stats.forwards


def _cut(text: str, stop: list[str]) -> tuple[str, bool]:
    """The text up to the first stop string (excluded), and whether one was found."""
    ends = [i for i in (text.find(s) for s in stop) if i >= 0]
    return (text[: min(ends)], True) if ends else (text, False)


def create_text_app(load: Callable[[], Any], config: ServeConfig) -> FastAPI:
    state = TextServerState(load, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start()
        yield

    app = FastAPI(title="composer serve (text)", description="Diffusion language models (OpenAI completions API "
                  "shaped).", lifespan=lifespan)
    app.state.composer = state

    add_error_handlers(app)

    def ready():
        if state.generator is None:
            why = f"the model failed to load: {state.load_error}" if state.load_error else "the model is loading"
            return error(503, why, headers={"Retry-After": "5"})
        return None

    def model_name() -> str:
        return str(state.generator.model_path)

    @app.get("/health")
    async def health():
        return ready() or {"status": "ok", "model": model_name(), "family": state.generator.family,
                           "modality": "text"}

    @app.get("/v1/models")
    async def models():
        if (not_ready := ready()) is not None:
            return not_ready
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        """The served model under any of the names a request may give it (`client.models.retrieve`), else 404."""
        if (not_ready := ready()) is not None:
            return not_ready
        try:
            check_model(name, state.generator)
        except _Problem as exc:
            return _refused(exc)
        return model_card()

    def model_card() -> dict[str, Any]:
        return {"id": model_name(), "object": "model", "created": 0, "owned_by": "composer"}

    @app.get("/metrics")
    async def metrics():
        lines = ["# TYPE composer_ready gauge", f"composer_ready {int(state.generator is not None)}",
                 "# TYPE composer_text_requests_total counter", f"composer_text_requests_total {state.requests}",
                 "# TYPE composer_text_failures_total counter", f"composer_text_failures_total {state.failures}",
                 "# TYPE composer_text_tokens_total counter", f"composer_text_tokens_total {state.tokens}",
                 "# TYPE composer_text_forwards_total counter", f"composer_text_forwards_total {state.forwards}",
                 "# TYPE composer_text_seconds_total counter", f"composer_text_seconds_total {state.seconds:.3f}",
                 "# TYPE composer_text_requests_running gauge", f"composer_text_requests_running {state.running}"]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def handle(request: Request, chat: bool):
        if (not_ready := ready()) is not None:
            return not_ready
        generator = state.generator
        try:
            body = await _read_json(request, body_limit(generator, config.max_body_bytes))
            checked = parse(body, chat, generator)
            await run_in_threadpool(fit, generator, checked)  # tokenizing: on a worker thread, holding no one
        except _Problem as exc:
            return _refused(exc)
        except ComposerError as exc:
            return error(400, str(exc))
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if checked.stream:
            return await stream(checked, ident, created)
        start = time.perf_counter()
        state.began()
        cancel = CancelToken()  # a client that leaves stops its request: it would take a share of every forward
        watcher = asyncio.create_task(_cancel_when_gone(request, cancel))
        try:
            results = await run_in_threadpool(lambda: generator.generate_text(**checked.inputs(), **checked.settings,
                                                                              cancel=cancel))
        except ComposerError as exc:
            state.count([], time.perf_counter() - start, failed=True)
            if isinstance(exc, Cancelled):
                logger.info("%s stopped: %s", ident, cancel.reason)
            return error(_status(exc), str(exc))
        except BaseException:
            state.count([], time.perf_counter() - start, failed=True)
            raise
        finally:
            watcher.cancel()
            state.began(-1)
        results = results if isinstance(results, list) else [results]
        state.count(results, time.perf_counter() - start)
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

    async def stream(checked: TextRequest, ident: str, created: int):
        """Server-sent events, once the first piece is made: what fails before it (the library's checks, the
        tokenizer's) is an error with its status, as the SDK expects, not a 200 with an error event."""
        def begin() -> tuple[Iterator[Any], Any]:
            pieces = state.generator.stream_text(**checked.inputs(), **checked.settings)
            return pieces, next(pieces, None)

        start = time.perf_counter()
        state.began()
        try:
            pieces, first = await run_in_threadpool(begin)
        except ComposerError as exc:
            state.count([], time.perf_counter() - start, failed=True)
            return error(_status(exc), str(exc))
        except BaseException:
            state.count([], time.perf_counter() - start, failed=True)
            raise
        finally:
            state.began(-1)
        return StreamingResponse(_events(state, pieces, first, checked, ident, created, start),
                                 media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


async def _cancel_when_gone(request: Request, cancel: CancelToken) -> None:
    """Cancel the request once its client has disconnected (checked every DISCONNECT_POLL_S)."""
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
    cancel.cancel("its client disconnected")


def _status(exc: ComposerError) -> int:
    """A library error's status: the request's fault (a bad value, something the model cannot do) is a 400."""
    return 400 if isinstance(exc, (ValueError, NotImplementedError)) else 500


def _refused(exc: _Problem) -> JSONResponse:
    """A refused request as OpenAI answers it (another model's name: 404 `model_not_found`)."""
    if exc.status == 404:
        return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error", "param": exc.field,
                                       "code": "model_not_found"}}, 404)
    return error(exc.status, str(exc), exc.field)


def _events(state: TextServerState, pieces: Iterator[Any], first: Any, checked: TextRequest, ident: str,
            created: int, start: float) -> Iterator[bytes]:
    """Server-sent events: the text each block makes final, per choice (from the first piece, already made), then a
    last chunk with each choice's finish reason, then [DONE]. Run by Starlette on a thread (a sync iterator)."""
    chat, stop = checked.chat, checked.stop
    kind = "chat.completion.chunk" if chat else "text_completion"
    model = str(state.generator.model_path)

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

    state.began()
    sent: dict[int, str] = {}
    stopped: set[int] = set()
    results = []
    try:
        if chat:
            for index in range(checked.rows):
                yield event(index, None, None, first=True)
        for piece in itertools.chain([first] if first is not None else [], pieces):
            row = piece.row
            if row in stopped:
                continue
            so_far, cut = _cut(piece.so_far, stop)
            new = so_far[len(sent.get(row, "")):] if so_far.startswith(sent.get(row, "")) else ""
            if new:
                yield event(row, new, None)
                sent[row] = so_far
            if cut:
                stopped.add(row)
            if piece.done:
                results.append(piece)
                finished = cut or (piece.token_ids and piece.token_ids[-1] == state.generator.pipeline.stages[-1]
                                   .eos_id)
                yield event(row, None, "stop" if finished else "length")
        state.count([_Counted(p.token_ids, p.stats) for p in results], time.perf_counter() - start)
    except Exception as exc:  # noqa: BLE001 - the stream is already open: said in an error event
        state.count([], time.perf_counter() - start, failed=True)
        yield f"data: {json.dumps({'error': {'message': str(exc), 'type': 'server_error'}})}\n\n".encode()
    finally:
        state.began(-1)
        close = getattr(pieces, "close", None)
        if close is not None:  # a client gone mid-stream: the request leaves the pipeline now, not when collected
            close()
    yield b"data: [DONE]\n\n"


class _Counted:
    def __init__(self, token_ids, stats):
        self.token_ids, self.stats = token_ids, stats
