"""`composer serve` on a diffusion language model: OpenAI's completions and chat completions APIs.

    POST /v1/completions        {"model", "prompt": str | [str], "max_tokens", "temperature", "top_p", "seed",
                                 "n", "stop", "stream"}
    POST /v1/chat/completions   {"model", "messages": [{"role", "content"}], "max_tokens" |
                                 "max_completion_tokens", "temperature", "top_p", "seed", "n", "stop", "stream"}
    GET  /v1/models, /health, /metrics

The official `openai` SDK works against it unchanged (`client.chat.completions.create(...)`, `stream=True` as
server-sent events of the text each block makes final). composer's own settings (block_length,
num_inference_steps or steps, threshold, decoding, top_k, editing_threshold, ...) go in the body too (the SDK's
`extra_body`). OpenAI fields composer cannot honour (logprobs, penalties, logit_bias, tools, response_format) are
refused when set; bookkeeping ones (user, metadata, store, stream_options) are accepted.

Requests run on a thread each; their refinement steps share model forwards (composer/text/batching.py).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from composer.errors import ComposerError
from composer.logging import get_logger
from composer.serve.app import ServeConfig, _read_json, add_error_handlers, error
from composer.serve.requests import RequestProblem as _Problem


def RequestProblem(message: str, field: str | None = None) -> _Problem:  # noqa: N802 - an exception's maker
    """A refused request: 400, as OpenAI's API answers invalid requests."""
    return _Problem(message, field=field, status=400)

logger = get_logger(__name__)

UNSUPPORTED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "presence_penalty": (None, 0, 0.0),
               "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "tools": (None, []),
               "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}), "echo": (None, False),
               "best_of": (None, 1), "suffix": (None, "")}
IGNORED = {"model", "user", "metadata", "store", "stream_options", "parallel_tool_calls", "service_tier"}
ALIASES = {"steps": "num_inference_steps"}


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


def _settings(body: dict, chat: bool) -> tuple[dict[str, Any], int, list[str]]:
    """The generate_text settings of an OpenAI body, the number of choices (`n`) and the stop strings."""
    from composer.text.sampling import TextSamplingParam

    fields = set(TextSamplingParam.__dataclass_fields__) - {"prompt"}
    settings: dict[str, Any] = {}
    for key, value in body.items():
        if key in ("prompt", "messages", "stream", "n", "stop", "max_tokens", "max_completion_tokens"):
            continue
        if key in UNSUPPORTED:
            if value not in UNSUPPORTED[key]:
                raise RequestProblem(f"{key} is not supported by composer's diffusion language models", field=key)
            continue
        if key in IGNORED:
            continue
        name = ALIASES.get(key, key)
        if name not in fields:
            raise RequestProblem(f"unknown field {key!r} (composer's text settings: {', '.join(sorted(fields))})",
                                 field=key)
        settings[name] = value
    limit = body.get("max_completion_tokens") if chat else None
    limit = limit if limit is not None else body.get("max_tokens")
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0:
            raise RequestProblem(f"max_tokens = {limit!r}: a positive integer", field="max_tokens")
        settings["gen_length"] = limit
    n = body.get("n", 1) or 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 16:
        raise RequestProblem(f"n = {n!r}: an integer from 1 to 16", field="n")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise RequestProblem("stop: a string or a list of up to 4 non-empty strings", field="stop")
    return settings, n, stop


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
        return {"object": "list", "data": [{"id": model_name(), "object": "model", "created": 0,
                                            "owned_by": "composer"}]}

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
        try:
            body = await _read_json(request, config.max_body_bytes)
            if not isinstance(body, dict):
                raise RequestProblem("the body must be a JSON object")
            settings, n, stop = _settings(body, chat)
            if chat:
                messages = body.get("messages")
                if not isinstance(messages, list) or not messages:
                    raise RequestProblem("messages: a non-empty list of {role, content}", field="messages")
                inputs = {"messages": [_message(m) for m in messages] if n == 1 else
                          [[_message(m) for m in messages]] * n}
            else:
                prompt = body.get("prompt")
                if isinstance(prompt, str):
                    prompt = [prompt] * n if n > 1 else prompt
                elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
                    prompt = [p for p in prompt for _ in range(n)]
                else:
                    raise RequestProblem("prompt: a string or a non-empty list of strings", field="prompt")
                inputs = {"prompt": prompt}
            # the whole request is checked before anything runs (a bad value: 400, nothing lost)
            state.generator.sampling_param(**settings)
        except _Problem as exc:
            return error(exc.status, str(exc), exc.field)
        except ComposerError as exc:
            return error(400, str(exc))
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if body.get("stream"):
            return StreamingResponse(_events(state, inputs, settings, stop, ident, created, chat, n),
                                     media_type="text/event-stream")
        start = time.perf_counter()
        state.began()
        try:
            results = await run_in_threadpool(lambda: state.generator.generate_text(**inputs, **settings))
        except ComposerError as exc:
            state.count([], time.perf_counter() - start, failed=True)
            return error(400, str(exc))
        finally:
            state.began(-1)
        results = results if isinstance(results, list) else [results]
        state.count(results, time.perf_counter() - start)
        choices = []
        for index, result in enumerate(results):
            text, stopped = _cut(result.text, stop)
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

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


def _message(message: Any) -> dict[str, str]:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestProblem("messages: each a {role, content} object", field="messages")
    content = message.get("content")
    if isinstance(content, list):  # OpenAI's content parts: the text ones
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict)
                          and part.get("type") == "text")
    if not isinstance(content, str):
        raise RequestProblem("messages: each content a string (or text parts)", field="messages")
    return {"role": message["role"], "content": content}


def _events(state: TextServerState, inputs: dict, settings: dict, stop: list[str], ident: str, created: int,
            chat: bool, n: int) -> Iterator[bytes]:
    """Server-sent events: the text each block makes final, per choice, then a last chunk with each choice's
    finish reason, then [DONE]. Run by Starlette on a thread (a sync iterator)."""
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

    start = time.perf_counter()
    state.began()
    sent: dict[int, str] = {}
    stopped: set[int] = set()
    results = []
    try:
        if chat:
            for index in range(n):
                yield event(index, None, None, first=True)
        for piece in state.generator.stream_text(**inputs, **settings):
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
    yield b"data: [DONE]\n\n"


class _Counted:
    def __init__(self, token_ids, stats):
        self.token_ids, self.stats = token_ids, stats
