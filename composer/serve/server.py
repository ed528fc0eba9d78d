"""What every `composer serve` server has, whatever its model's modality: its settings (`ServeConfig`), its one
piece of mutable state (`ServerState`), and the app built over them (`build_app`) with what is installed once
(API keys, OpenAI-style errors, /health, /ready, /metrics, /v1/models). The routes of a modality are added by
their own module (video: app.py, which also picks the modality in `create_app`; text: text.py), which imports
this one and never the other way round."""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI  # the serve extra: `composer serve` checks it first
from fastapi.responses import JSONResponse, PlainTextResponse

from composer.logging import get_logger
from composer.serve.jobs import JobStore
from composer.serve.problems import RequestProblem
from composer.serve.requests import LoraOption, ServerLimits
from composer.serve.responses import add_error_handlers, error, refused
from composer.serve.sessions import SessionStore
from composer.serve.slots import Slots
from composer.serve.uploads import UploadLimits
from composer.serve.worker import Worker

logger = get_logger(__name__)

MAX_BODY_BYTES = 96 * 2**20  # room for a 64 MiB video upload as base64 JSON
TEXT_CONCURRENT_DEFAULT = 4  # text requests running at once without --max-concurrent (their forwards are shared)
MODALITIES = ("video", "text")
DESCRIPTIONS = {"video": "Video generation jobs (OpenAI video API shaped).",
                "text": "Diffusion language models (OpenAI completions API shaped)."}


@dataclass
class ServeConfig:
    """How a server runs: where jobs go, how many may wait, the per-request limits and timeout."""

    output_dir: Path = Path("outputs/serve")
    max_queue: int = 16  # jobs (text: requests) that may wait for a slot; one more is a 429
    limits: ServerLimits = field(default_factory=ServerLimits)
    request_timeout: float | None = 1800.0  # seconds a job or text request may run (None: no limit)
    max_body_bytes: int = MAX_BODY_BYTES
    loras: list[LoraOption] = field(default_factory=list)  # the adapters loaded at start (--lora-path)
    max_concurrent: int | None = None  # jobs (text: requests) running at once (None: 4 if the model's requests
    # can share it, else 1; text: 4)
    max_sessions: int = 16  # sessions open at once (/v1/sessions)
    session_ttl: float = 600.0  # seconds an idle session stays open
    uploads: UploadLimits = field(default_factory=UploadLimits)  # what an uploaded image or video may be
    keys: Any = None  # composer.serve.auth.KeyRing (--api-key / --api-keys); None: no authentication
    replica: str | None = None  # this replica's name (--replica): job and session ids start with it (docs/deploy.md)
    rtmp_allow: list[str] = field(default_factory=list)  # URL prefixes a live stream may push to (--rtmp-allow)


class Counters:
    """What the text routes count (on the event loop, where their requests end): requests, failures, tokens made,
    model forwards and seconds."""

    def __init__(self):
        self.requests = self.failures = self.tokens = self.forwards = 0
        self.seconds = 0.0

    def count(self, results: list[Any], seconds: float, failed: bool = False) -> None:
        self.requests += 1
        self.failures += failed
        self.seconds += seconds
        if results:
            self.tokens += sum(len(r.token_ids) for r in results)
            self.forwards += results[0].stats.forwards


class ServerState:
    """The app's one piece of mutable state (`app.state.composer`): the model once loaded (or why it failed), and
    what the routes of its modality keep. A video model: the job store, the worker, the sessions of a causal
    model and the live streams' shared state. A text model: the slots its requests wait for, and its counters."""

    def __init__(self, load: Callable[[], Any], config: ServeConfig, modality: str = "video"):
        if modality not in MODALITIES:
            raise ValueError(f"modality = {modality!r}: expected one of {', '.join(MODALITIES)}")
        self.config = config
        self.modality = modality
        self.generator: Any = None
        self.load_error: str | None = None
        self.auth: Any = None  # the API keys' Guard (auth.py), when the server has keys
        # a video model
        self.store = JobStore(config.output_dir) if modality == "video" else None
        self.worker: Worker | None = None
        self.sessions: SessionStore | None = None  # /v1/sessions, for a causal model
        self.streams: Any = None  # stream.StreamRoutes: /v1/streams' open streams and metrics
        # a text model
        self.slots = Slots(config.max_concurrent or TEXT_CONCURRENT_DEFAULT, config.max_queue) \
            if modality == "text" else None
        self.counters = Counters()
        self._load = load
        self._thread = threading.Thread(target=self._load_model, name="composer-serve-load", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _load_model(self) -> None:
        try:
            generator = self._load()
        except Exception as exc:  # noqa: BLE001 - reported by /health; the CLI checks flags before this
            logger.error("loading the model failed: %s", exc)
            self.load_error = f"{type(exc).__name__}: {exc}"
            return
        if self.modality == "video":
            self._start_video(generator)
        self.generator = generator

    def _start_video(self, generator: Any) -> None:
        self.worker = Worker(generator, self.store, self.config.max_queue, self.config.request_timeout,
                             self.config.loras, self.config.max_concurrent)
        runtime = getattr(getattr(generator, "pipeline", None), "runtime", None)
        if runtime is not None:  # torch's CPU threads: the cores shared by the jobs that may run at once (on every
            import os  # rank torchrun started on this machine)

            from composer.runtime import apply_threads

            apply_threads(runtime, self.worker.max_concurrent * int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
        ranks = getattr(generator, "world_size", 1)
        if getattr(getattr(generator, "pipeline", None), "can_stream", False) and not (
                isinstance(ranks, int) and ranks > 1):  # several ranks: sessions are not sent to the others
            keys = self.config.keys
            limits = {k.name: k.max_sessions for k in keys.keys} if keys is not None else {}
            self.sessions = SessionStore(generator, self.config.output_dir, self.config.max_sessions,
                                         self.config.session_ttl, replica=self.config.replica,
                                         owned=keys is not None, limit_of=limits.get)

    def unready(self) -> JSONResponse | None:
        """None once the model serves; else the 503 to answer (loading, failed to load, or the ranks of a multi-rank
        server lost contact)."""
        if self.generator is None:
            why = f"the model failed to load: {self.load_error}" if self.load_error else "the model is loading"
            return error(503, why, headers={"Retry-After": "5"})
        unhealthy = getattr(self.generator, "unhealthy", None)  # set by a multi-rank generator (parallel/ranks.py)
        if isinstance(unhealthy, str):
            return error(503, unhealthy)
        return None

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop()
        if self.sessions is not None:
            self.sessions.close_all()


def build_app(load: Callable[[], Any], config: ServeConfig, modality: str,
              add_routes: Callable[[FastAPI, ServerState], None],
              metric_lines: Callable[[ServerState], list[str]]) -> FastAPI:
    """The app serving the model `load()` returns (called once, in a background thread at startup): what every
    server has installed once (API keys, OpenAI-style errors, /health, /ready, /metrics, /v1/models), then the
    routes of the model's `modality`, which `add_routes(app, state)` adds; `metric_lines(state)` are that
    modality's /metrics lines. `create_app` (app.py) picks both by the modality."""
    state = ServerState(load, config, modality)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start()
        yield
        state.stop()

    app = FastAPI(title="composer serve", description=DESCRIPTIONS[modality], lifespan=lifespan)
    app.state.composer = state
    if config.keys is not None:  # Authorization: Bearer on every route but the open ones (auth.py)
        from composer.serve.auth import install_auth

        install_auth(app, state, config.keys)
    add_error_handlers(app)
    app.include_router(common_routes(state, metric_lines))
    add_routes(app, state)
    return app


def common_routes(state: ServerState, metric_lines: Callable[[ServerState], list[str]]) -> APIRouter:
    """/health, /ready, /metrics and /v1/models: the same on every server (`metric_lines`: the /metrics lines of
    the modality's routes)."""
    router = APIRouter()
    config = state.config

    @router.get("/health")
    async def health():
        """200 once the model is loaded, 503 while loading (or when loading failed, or the ranks of a multi-rank
        server lost contact). Open without an API key."""
        return state.unready() or {"status": "ok", "model": state.generator.model_path,
                                   "family": state.generator.family, "modality": state.modality,
                                   "replica": config.replica}

    @router.get("/ready")
    async def ready():
        """A readiness probe: 200 once requests are served, else 503 (as /health; open without an API key)."""
        return state.unready() or {"status": "ready"}

    @router.get("/v1/models")
    async def models():
        """The served model, as OpenAI lists models (`client.models.list()`)."""
        return state.unready() or {"object": "list", "data": [_model_card(state)]}

    @router.get("/v1/models/{name:path}")
    async def model(name: str):
        """The served model under any of the names a request may give it (`client.models.retrieve`), else 404
        (`model_not_found`, as OpenAI answers)."""
        if (not_ready := state.unready()) is not None:
            return not_ready
        from composer.serve.text_requests import check_model

        try:
            check_model(name, state.generator)
        except RequestProblem as exc:
            return refused(exc)
        return _model_card(state)

    @router.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        """Prometheus text format: whether the model is loaded, the lines of its modality's routes (video: jobs,
        queue, steps, batches, KV pool, memory, streams; text: requests, tokens, forwards, queue), and with API
        keys the per-key lines."""
        lines = ["# HELP composer_ready 1 once the model is loaded", "# TYPE composer_ready gauge",
                 f"composer_ready {int(state.generator is not None)}"]
        lines += metric_lines(state)
        if state.auth is not None:  # API keys: requests, 401s, 429s, jobs and streams per key
            lines += state.auth.metric_lines()
        return "\n".join(lines) + "\n"

    return router


def _model_card(state: ServerState) -> dict[str, Any]:
    return {"id": str(state.generator.model_path), "object": "model", "created": 0, "owned_by": "composer"}

