"""What every `composer serve` server has, whatever its models' modalities: its settings (`ServeConfig`), its one
piece of mutable state (`ServerState`), and the app built over them (`build_app`) with what is installed once
(API keys, OpenAI-style errors, /health, /ready, /metrics, /v1/models). The routes of a modality are added by
their own module (video: app.py, which also picks the modalities in `create_app`; text: text.py), which imports
this one and never the other way round.

A server serves one model, or a video model and a text model together (`composer serve --model-path VIDEO
--text-model-path TEXT`): one state holding both generators (each with its own engine core), both loaded at start
in the one loading thread, the text model first (the video model's start then sets torch's CPU threads for the
jobs that may run at once, as on a video server); /ready once both are."""

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
    """The app's one piece of mutable state (`app.state.composer`): the models once loaded (or why one failed), and
    what the routes of each modality keep. A video model: the job store, the worker, the sessions of a causal
    model and the live streams' shared state. A text model: the slots its requests wait for, and its counters.

    `modality` is the served model's (`load()` makes it); with `text_load` (a video server only) a text model is
    served beside it. `generator` is the first model (the video one of two: what the video routes use) and
    `text_generator` the text model, whichever way it is served."""

    def __init__(self, load: Callable[[], Any], config: ServeConfig, modality: str = "video",
                 text_load: Callable[[], Any] | None = None):
        if modality not in MODALITIES:
            raise ValueError(f"modality = {modality!r}: expected one of {', '.join(MODALITIES)}")
        if text_load is not None and modality != "video":
            raise ValueError("a text model is served beside a video model: modality must be 'video' with text_load")
        self.config = config
        self.modality = modality  # the first model's
        self.modalities: tuple[str, ...] = (modality, "text") if text_load is not None else (modality,)
        self.models: dict[str, Any] = {}  # modality -> its generator, once loaded
        self.load_errors: dict[str, str] = {}  # modality -> why its model failed to load
        self.generator: Any = None  # the first model, once loaded (and started)
        self.auth: Any = None  # the API keys' Guard (auth.py), when the server has keys
        # a video model
        self.store = JobStore(config.output_dir) if "video" in self.modalities else None
        self.worker: Worker | None = None
        self.sessions: SessionStore | None = None  # /v1/sessions, for a causal model
        self.streams: Any = None  # stream.StreamRoutes: /v1/streams' open streams and metrics
        # a text model
        self.slots = Slots(config.max_concurrent or TEXT_CONCURRENT_DEFAULT, config.max_queue) \
            if "text" in self.modalities else None
        self.counters = Counters()
        # the text model first: the video model's start (after its load) sets torch's CPU threads for its jobs
        self._loads = {**({"text": text_load} if text_load is not None else {}), modality: load}
        self._load = load  # the first model's
        self._thread = threading.Thread(target=self._load_models, name="composer-serve-load", daemon=True)

    @property
    def two_models(self) -> bool:
        """Whether a video model and a text model are served together."""
        return len(self.modalities) > 1

    @property
    def text_generator(self) -> Any:
        """The text model once loaded (None: loading, failed, or no text model served)."""
        return self.models.get("text")

    @property
    def load_error(self) -> str | None:
        """Why the first model (the video one of two) failed to load, or None."""
        return self.load_errors.get(self.modality)

    def start(self) -> None:
        self._thread.start()

    def _load_models(self) -> None:
        """Load each model in turn (a text model beside a video one first), on the loading thread: one that fails
        is reported by /health and the other still loads."""
        for modality, load in self._loads.items():
            try:
                generator = load()
            except Exception as exc:  # noqa: BLE001 - reported by /health; the CLI checks flags before this
                logger.error("loading the %s model failed: %s", modality, exc)
                self.load_errors[modality] = f"{type(exc).__name__}: {exc}"
                continue
            if modality == "video":
                self._start_video(generator)
            self.models[modality] = generator
            if modality == self.modality:
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

    def unready(self, modality: str | None = None) -> JSONResponse | None:
        """None once the model of `modality` serves (None: every model this server serves); else the 503 to answer
        (loading, failed to load, or the ranks of a multi-rank server lost contact)."""
        waiting = []
        for name in (modality,) if modality is not None else self.modalities:
            which = f"the {name} model" if self.two_models else "the model"
            if name in self.load_errors:
                waiting.append(f"{which} failed to load: {self.load_errors[name]}")
            elif name not in self.models:
                waiting.append(f"{which} is loading")
        if waiting:
            return error(503, "; ".join(waiting), headers={"Retry-After": "5"})
        for name in (modality,) if modality is not None else self.modalities:
            unhealthy = getattr(self.models[name], "unhealthy", None)  # set by a multi-rank generator (ranks.py)
            if isinstance(unhealthy, str):
                return error(503, unhealthy)
        return None

    def other_model(self, body: Any, modality: str) -> RequestProblem | None:
        """On a two-model server, the refusal of a request to `modality`'s routes whose `model` names the other
        model: the status and field a wrong name gets on those routes (video 422, text 404 model_not_found), with
        a message saying which routes serve the model it named. None otherwise (the routes' own check follows)."""
        if not self.two_models or not isinstance(body, dict) or not isinstance(body.get("model"), str):
            return None
        from composer.serve.text_requests import served_names

        other = "text" if modality == "video" else "video"
        mine, theirs = self.models.get(modality), self.models.get(other)
        if mine is None or theirs is None or body["model"] not in served_names(theirs):
            return None
        routes = {"video": "/v1/videos, /v1/streams and /v1/sessions", "text": "/v1/completions and "
                  "/v1/chat/completions"}
        return RequestProblem(f"model = {body['model']!r} is this server's {other} model (served at {routes[other]}); "
                              f"these routes serve the {modality} model {str(mine.model_path)!r}: leave model out or "
                              "name that one", "model", status=422 if modality == "video" else 404)

    def model_states(self) -> list[dict[str, Any]]:
        """Each served model's modality and state (loading, failed with its error, or ready with its path and
        family): what /health lists under `models`."""
        states = []
        for name in self.modalities:
            generator = self.models.get(name)
            if generator is not None:
                states.append({"modality": name, "status": "ready", "model": str(generator.model_path),
                               "family": generator.family})
            elif name in self.load_errors:
                states.append({"modality": name, "status": "failed", "error": self.load_errors[name]})
            else:
                states.append({"modality": name, "status": "loading"})
        return states

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop()
        if self.sessions is not None:
            self.sessions.close_all()


def build_app(load: Callable[[], Any], config: ServeConfig, modality: str,
              add_routes: Callable[[FastAPI, ServerState], None],
              metric_lines: Callable[[ServerState], list[str]],
              text_load: Callable[[], Any] | None = None) -> FastAPI:
    """The app serving the model `load()` returns (called once, in a background thread at startup), and with
    `text_load` a text model beside a video one: what every server has installed once (API keys, OpenAI-style
    errors, /health, /ready, /metrics, /v1/models), then the routes of the models' modalities, which
    `add_routes(app, state)` adds; `metric_lines(state)` are their /metrics lines. `create_app` (app.py) picks
    both by the modalities."""
    state = ServerState(load, config, modality, text_load)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.start()
        yield
        state.stop()

    app = FastAPI(title="composer serve", description=" ".join(DESCRIPTIONS[m] for m in state.modalities),
                  lifespan=lifespan)
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
    the modalities' routes)."""
    router = APIRouter()
    config = state.config

    @router.get("/health")
    async def health():
        """200 once the model (a two-model server: both) is loaded, 503 while loading (or when loading failed, or
        the ranks of a multi-rank server lost contact; two models: the message says each one's state). Open
        without an API key."""
        if (not_ready := state.unready()) is not None:
            return not_ready
        answer = {"status": "ok", "model": state.generator.model_path, "family": state.generator.family,
                  "modality": state.modality, "replica": config.replica}
        if state.two_models:  # each model: modality, status, path, family
            answer["models"] = state.model_states()
        return answer

    @router.get("/ready")
    async def ready():
        """A readiness probe: 200 once requests are served (by every served model), else 503 (as /health; open
        without an API key)."""
        return state.unready() or {"status": "ready"}

    @router.get("/v1/models")
    async def models():
        """The served models (one, or the video and the text model), as OpenAI lists models
        (`client.models.list()`)."""
        return state.unready() or {"object": "list",
                                   "data": [_model_card(state.models[m]) for m in state.modalities]}

    @router.get("/v1/models/{name:path}")
    async def model(name: str):
        """A served model under any of the names a request may give it (`client.models.retrieve`), else 404
        (`model_not_found`, as OpenAI answers)."""
        if (not_ready := state.unready()) is not None:
            return not_ready
        from composer.serve.text_requests import check_model

        problem = None
        for modality in state.modalities:
            try:
                check_model(name, state.models[modality])
            except RequestProblem as exc:
                problem = problem or exc
                continue
            return _model_card(state.models[modality])
        return refused(problem)

    @router.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        """Prometheus text format: whether the models are loaded, the lines of their modalities' routes (video:
        jobs, queue, steps, batches, KV pool, memory, streams; text: requests, tokens, forwards, queue), and with
        API keys the per-key lines."""
        lines = ["# HELP composer_ready 1 once the model is loaded (two models: both)", "# TYPE composer_ready gauge",
                 f"composer_ready {int(all(m in state.models for m in state.modalities))}"]
        lines += metric_lines(state)
        if state.auth is not None:  # API keys: requests, 401s, 429s, jobs and streams per key
            lines += state.auth.metric_lines()
        return "\n".join(lines) + "\n"

    return router


def _model_card(generator: Any) -> dict[str, Any]:
    return {"id": str(generator.model_path), "object": "model", "created": 0, "owned_by": "composer"}
