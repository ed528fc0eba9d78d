"""API keys for `composer serve` (`--api-key`, `--api-keys FILE`): who may use the server, and how much.

keys.py reads the keys into a `KeyRing` (each an `ApiKey`: its secret, its name, its limits). `install_auth` puts
`AuthMiddleware` in front of the app: every HTTP request and WebSocket but the open paths (/health, /ready, the web
page's files, the API docs) needs a key, as `Authorization: Bearer KEY`, a WebSocket subprotocol `bearer.KEY` or an
`api_key` query parameter; the middleware takes the key out of the request before the app (and uvicorn's access
log) sees it. `Guard` keeps each key's limits (jobs queued or running,
live streams open, requests per minute) and its counters for /metrics. The key file format and the behaviour
are documented in docs/serving.md ("API keys").
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
import urllib.parse
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from composer.serve.jobs import IN_PROGRESS, QUEUED
from composer.serve.keys import LIMITS, ApiKey, KeyRing

# Paths anyone may read: the health and readiness checks, the web page's static files (its API calls need the key)
# and the API description (/docs shows how to authenticate; it holds no data).
OPEN_PATHS = ("/health", "/ready", "/", "/docs", "/docs/oauth2-redirect", "/openapi.json", "/redoc")
OPEN_PREFIXES = ("/static/",)
STREAMS_PATH = "/v1/streams"
# POSTs that create a job: they count against the key's `queued` limit
JOB_POSTS = re.compile(r"^/v1/videos(/edits|/extensions|/[^/]+/remix)?/?$")
SUBPROTOCOL_PREFIX = "bearer."
WINDOW_S = 60.0
QUEUED_RETRY_S, STREAMS_RETRY_S = 5, 10


# -- limits and counters ------------------------------------------------------------------------------------------
@dataclass
class Refusal:
    """A request over one of its key's limits: a 429 with this message and Retry-After."""

    limit: str
    message: str
    retry_after: int


class Guard:
    """Each key's limits and counters, shared by every request. Thread-safe.

    `admit` checks one authenticated request and, when it passes, counts it: in the key's last minute, and while
    it runs as a job POST (so two POSTs at once cannot both take the last slot; a job already stored counts
    twice until its POST answers) or as an open stream. Call the returned release when the request ends."""

    def __init__(self, keys: KeyRing, state: Any = None, clock: Callable[[], float] = time.monotonic):
        self.keys = keys
        self.state = state  # the app's ServerState: its job store counts each key's jobs
        self.clock = clock
        self._lock = threading.Lock()
        self._recent: dict[str, deque[float]] = {name: deque() for name in keys.names}
        self._posting: Counter[str] = Counter()
        self._streams: Counter[str] = Counter()
        self.requests: Counter[str] = Counter()
        self.limited: Counter[tuple[str, str]] = Counter()
        self.unauthorized: Counter[str] = Counter()

    def jobs_of(self, name: str) -> int:
        """The key's jobs queued or running (streams count as streams, not here)."""
        store = getattr(self.state, "store", None)
        if store is None:
            return 0
        return sum(1 for job in store.all()
                   if job.owner == name and job.status in (QUEUED, IN_PROGRESS) and job.kind != "stream")

    def admit(self, key: ApiKey, kind: str, method: str, path: str) -> tuple[Refusal | None, Callable[[], None]]:
        """(None, release) for a request within its key's limits; (the refusal, a no-op) for one over them."""
        posts_job = kind == "http" and method == "POST" and JOB_POSTS.match(path) is not None
        streams = kind == "websocket" and path.rstrip("/") == STREAMS_PATH
        with self._lock:
            self.requests[key.name] += 1
            now = self.clock()
            recent = self._recent[key.name]
            while recent and recent[0] <= now - WINDOW_S:
                recent.popleft()
            refusal = None
            if key.rpm is not None and len(recent) >= key.rpm:
                wait = max(1, math.ceil(recent[0] + WINDOW_S - now))
                refusal = Refusal("rpm", f"API key {key.name!r} made {len(recent)} requests in the last minute, its "
                                  f"limit (rpm={key.rpm}); retry in {wait} s", wait)
            elif posts_job and key.max_queued is not None and \
                    (held := self.jobs_of(key.name) + self._posting[key.name]) >= key.max_queued:
                refusal = Refusal("queued", f"API key {key.name!r} has {held} jobs queued or running, its limit "
                                  f"(queued={key.max_queued}); wait for one to finish or cancel one "
                                  "(DELETE /v1/videos/{id})", QUEUED_RETRY_S)
            elif streams and key.max_streams is not None and self._streams[key.name] >= key.max_streams:
                refusal = Refusal("streams", f"API key {key.name!r} has {self._streams[key.name]} live streams open, "
                                  f"its limit (streams={key.max_streams}); close one first", STREAMS_RETRY_S)
            if refusal is not None:
                self.limited[(key.name, refusal.limit)] += 1
                return refusal, _nothing
            recent.append(now)
            held_in = self._posting if posts_job else self._streams if streams else None
            if held_in is not None:
                held_in[key.name] += 1
        if held_in is None:
            return None, _nothing
        released = threading.Event()

        def release() -> None:
            with self._lock:
                if not released.is_set():
                    released.set()
                    held_in[key.name] -= 1

        return None, release

    def count_unauthorized(self, reason: str) -> None:
        with self._lock:
            self.unauthorized[reason] += 1

    def open_streams(self, name: str) -> int:
        with self._lock:
            return self._streams[name]

    def metric_lines(self) -> list[str]:
        """Prometheus lines per key name: requests, 401s (by reason: no key has a name), 429s by limit, jobs
        queued or running, streams and sessions open."""
        names = self.keys.names
        sessions = getattr(self.state, "sessions", None)  # the server's SessionStore (a causal model only)
        with self._lock:
            requests, limited = dict(self.requests), dict(self.limited)
            unauthorized, streams = dict(self.unauthorized), dict(self._streams)
        if sessions is not None:  # refused by the session store, where sessions are counted
            limited.update({(n, "sessions"): c for n, c in sessions.limited.items()})
        lines = ["# HELP composer_api_requests_total requests made with each API key (refused ones too)",
                 "# TYPE composer_api_requests_total counter"]
        lines += [f'composer_api_requests_total{{key="{n}"}} {requests.get(n, 0)}' for n in names]
        lines += ["# HELP composer_api_unauthorized_total requests refused with 401: no key (missing) or a key that "
                  "is not one of the server's (wrong)", "# TYPE composer_api_unauthorized_total counter"]
        lines += [f'composer_api_unauthorized_total{{reason="{r}"}} {unauthorized.get(r, 0)}'
                  for r in ("missing", "wrong")]
        lines += ["# HELP composer_api_limited_total requests refused with 429 by their key's limit",
                  "# TYPE composer_api_limited_total counter"]
        lines += [f'composer_api_limited_total{{key="{n}",limit="{limit}"}} {limited.get((n, limit), 0)}'
                  for n in names for limit in LIMITS]
        lines += ["# HELP composer_api_jobs jobs queued or running per API key", "# TYPE composer_api_jobs gauge"]
        lines += [f'composer_api_jobs{{key="{n}"}} {self.jobs_of(n)}' for n in names]
        lines += ["# HELP composer_api_streams live streams open per API key", "# TYPE composer_api_streams gauge"]
        lines += [f'composer_api_streams{{key="{n}"}} {streams.get(n, 0)}' for n in names]
        lines += ["# HELP composer_api_sessions sessions open per API key", "# TYPE composer_api_sessions gauge"]
        lines += [f'composer_api_sessions{{key="{n}"}} {sessions.open_of(n) if sessions is not None else 0}'
                  for n in names]
        return lines


def _nothing() -> None:
    pass


# -- the middleware -----------------------------------------------------------------------------------------------
class AuthMiddleware:
    """Pure ASGI, for HTTP and WebSocket scopes: 401 without a valid key, 429 over a key's limit, else the app
    with `scope["state"]["api_key_name"]` set (what `request.state.api_key_name` reads)."""

    def __init__(self, app: Any, guard: Guard):
        self.app = app
        self.guard = guard

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        kind = scope["type"]
        path = scope.get("path", "")
        if kind not in ("http", "websocket") or path in OPEN_PATHS or path.startswith(OPEN_PREFIXES):
            return await self.app(scope, receive, send)
        offered_before = len(scope.get("subprotocols") or ())
        given, offered = take_credentials(scope)
        key = self.guard.keys.match(given)
        if key is None:
            reason = "missing" if given is None else "wrong"
            self.guard.count_unauthorized(reason)
            message = ("this server needs an API key: send Authorization: Bearer KEY (WebSockets: the subprotocol "
                       "bearer.KEY or ?api_key=KEY)" if given is None else
                       "the API key sent is not one of this server's keys")
            challenge = "Bearer" if given is None else 'Bearer error="invalid_token"'
            return await _deny(scope, receive, send, 401, message, {"WWW-Authenticate": challenge})
        scope.setdefault("state", {})["api_key_name"] = key.name
        refusal, release = self.guard.admit(key, kind, scope.get("method", ""), path)
        if refusal is not None:
            return await _deny(scope, receive, send, 429, refusal.message, {"Retry-After": str(refusal.retry_after)})
        if kind == "websocket" and offered and len(offered) < offered_before:  # a bearer.KEY was offered too
            send = _choosing_subprotocol(send, offered)
        try:
            await self.app(scope, receive, send)
        finally:
            release()


def take_credentials(scope: dict) -> tuple[bytes | None, list[str]]:
    """The key a request carries (its Authorization header, a `bearer.KEY` subprotocol of a WebSocket, or an
    `api_key` query parameter, in that order; None: none) and the subprotocols offered besides. The key is taken
    out of the scope, in place: the app never sees it, and uvicorn's access log line, which reads this same
    scope (path and query string) after the app ran, never shows it."""
    given: bytes | None = None
    headers = scope.get("headers") or []
    kept = []
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            # another scheme (Basic ...) or an empty token: a credential, but not a key of ours
            given = token.strip() if scheme.lower() == b"bearer" and token.strip() else b""
            continue
        kept.append((name, value))
    if len(kept) != len(headers):
        scope["headers"] = kept
    offered = list(scope.get("subprotocols") or [])
    if scope["type"] == "websocket" and offered:
        bearer = [p for p in offered if p.lower().startswith(SUBPROTOCOL_PREFIX)]
        offered = [p for p in offered if p not in bearer]
        scope["subprotocols"] = offered
        if given is None and bearer:
            given = bearer[0][len(SUBPROTOCOL_PREFIX):].encode()
    query = scope.get("query_string") or b""
    if b"api_key" in query.lower():
        pairs = urllib.parse.parse_qsl(query.decode("latin-1"), keep_blank_values=True)
        keys = [v for k, v in pairs if k.lower() == "api_key"]
        if keys:
            scope["query_string"] = urllib.parse.urlencode([(k, v) for k, v in pairs if k.lower() != "api_key"]
                                                           ).encode("latin-1")
            if given is None:
                given = keys[0].encode("utf-8", "surrogateescape")
    return given, offered


def _choosing_subprotocol(send: Callable, offered: list[str]) -> Callable:
    """A client that offered `bearer.KEY` with other subprotocols needs one chosen (a browser drops a connection
    whose answer names none); the app does not choose: the first other one offered is."""
    async def wrapped(message: dict) -> None:
        if message["type"] == "websocket.accept" and not message.get("subprotocol"):
            message = {**message, "subprotocol": offered[0]}
        await send(message)

    return wrapped


async def _deny(scope: dict, receive: Callable, send: Callable, status: int, message: str,
                headers: dict[str, str]) -> None:
    """An OpenAI-style error answer (responses.error's): as the HTTP response, or for a WebSocket as the
    handshake's response where the server supports that (uvicorn with websockets does), else a close before
    accepting (the client then sees a 403)."""
    from composer.serve.responses import error

    response = error(status, message, headers=headers)
    if scope["type"] == "http":
        return await response(scope, receive, send)
    await receive()  # websocket.connect
    if "websocket.http.response" in (scope.get("extensions") or {}):
        await send({"type": "websocket.http.response.start", "status": status, "headers": response.raw_headers})
        await send({"type": "websocket.http.response.body", "body": response.body})
    else:
        await send({"type": "websocket.close", "code": 1008})
    _DENIED.set(True)  # read by Redactor, in this same task, when uvicorn logs what follows


# uvicorn's websockets-sansio protocol logs "ASGI callable returned without completing handshake." at ERROR after
# every denial response (uvicorn pull request 3138); set in the task of a connection this middleware denied, so
# that line is dropped for those and kept for any other.
_DENIED: ContextVar[bool] = ContextVar("composer_auth_denied", default=False)
SPURIOUS_HANDSHAKE_ERROR = "ASGI callable returned without completing handshake."


# -- logs ---------------------------------------------------------------------------------------------------------
LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "websockets.server", "websockets.protocol")
_BEARER = re.compile(r"(?i)\b(bearer)([ .=:]+)(?!(?:error|realm|scope)=)[^\s,\"'&]+")  # not a challenge's params
_QUERY_KEY = re.compile(r"(?i)\b(api_key=)[^\s&\"']*")
REDACTED = "[redacted]"


class Redactor(logging.Filter):
    """Takes API keys out of log records of the server's loggers: every configured key, and any bearer token or
    api_key parameter (a wrong key may be a real key mistyped). Keeps the args' shape: uvicorn's access
    formatter unpacks them."""

    def __init__(self):
        super().__init__()
        self.secrets: set[str] = set()
        self._lock = threading.Lock()

    def add(self, secrets: Iterable[str]) -> None:
        with self._lock:
            self.secrets = self.secrets | set(secrets)

    def redact(self, text: str) -> str:
        for secret in self.secrets:
            if secret in text:
                text = text.replace(secret, REDACTED)
        return _QUERY_KEY.sub(r"\1" + REDACTED, _BEARER.sub(r"\1\2" + REDACTED, text))

    def _value(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.redact(value)
        if isinstance(value, bytes):
            return self.redact(value.decode("latin-1")).encode("latin-1")
        return value

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == SPURIOUS_HANDSHAKE_ERROR and _DENIED.get():
            return False
        record.msg = self._value(record.msg)
        if isinstance(record.args, tuple):
            record.args = tuple(self._value(a) for a in record.args)
        elif isinstance(record.args, Mapping):
            record.args = {k: self._value(v) for k, v in record.args.items()}
        return True


REDACTOR = Redactor()


def install_log_filter(secrets: Iterable[str]) -> None:
    """Redact `secrets` (and any bearer token) from what uvicorn and websockets log; once per logger."""
    REDACTOR.add(secrets)
    for name in LOGGERS:
        target = logging.getLogger(name)
        if REDACTOR not in target.filters:
            target.addFilter(REDACTOR)


def install_auth(app: Any, state: Any, keys: KeyRing) -> Guard:
    """Require `keys` on `app` (before it starts): the middleware, the log filter, `state.auth` (its /metrics
    lines), and the bearer scheme in the OpenAPI description (/docs' Authorize button)."""
    guard = Guard(keys, state)
    state.auth = guard
    app.add_middleware(AuthMiddleware, guard=guard)
    install_log_filter(keys.secrets())
    describe = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = describe()
            schema.setdefault("components", {}).setdefault("securitySchemes", {})["apiKey"] = {
                "type": "http", "scheme": "bearer", "description": "an API key of this server (--api-key)"}
            schema["security"] = [{"apiKey": []}]
            for path in OPEN_PATHS:
                for operation in schema.get("paths", {}).get(path, {}).values():
                    operation["security"] = []
        return app.openapi_schema

    app.openapi = openapi
    return guard
