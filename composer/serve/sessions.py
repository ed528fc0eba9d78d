"""Sessions over HTTP (`/v1/sessions`): causal videos that live across requests, forked, snapshotted to the output
folder and resumed after a restart (composer/session.py is the Python side).

    POST   /v1/sessions                      open one (sampling fields as for a stream: seed, height, width, ...)
    GET    /v1/sessions                      the open sessions, and the snapshots in the output folder
    GET    /v1/sessions/{id}                 one session: blocks, frames, busy, when it was last used
    POST   /v1/sessions/{id}/extend          {"prompt": ..., "num_blocks": n}: the next blocks; the answer comes when
                                             they are made, with the segment's video URL
    GET    /v1/sessions/{id}/segments/{n}    the video of the session's n-th segment (mp4; 1 is the first)
    GET    /v1/sessions/{id}/video           the whole video so far (mp4)
    POST   /v1/sessions/{id}/fork            a new session continuing the same video independently
    POST   /v1/sessions/{id}/snapshot        write `<output>/sessions/<name>.session` (name: the id, or "name")
    POST   /v1/sessions/resume               {"snapshot": name}: a new session from a snapshot of the output folder
    DELETE /v1/sessions/{id}                 close it (its KV pages go back to the pool)

Under API keys (`--api-key`, `--api-keys`) a session belongs to the key that opened it (or forked or resumed it):
another key gets a 404 for it, sees only its own in the list, and its snapshots are written to and resumed from
its own folder, `sessions/<key name>/`; a key's `sessions=N` limits how many it holds open at once (429).

A session runs one extend at a time (a second gets 409); its extends run as tasks on the generator's request loop
(on a worker thread where the pipeline's streams cannot be tasks) beside the jobs and streams, their steps
scheduled with theirs. Idle sessions are closed after `ttl_s` (snapshot first to keep one);
at most `max_sessions` are open at once (429). Snapshot names are plain names inside the output folder's
`sessions/` directory: never paths.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import (
    Request,  # the serve extra (app.py imports it first); routes' annotations must resolve here
)
from fastapi.responses import FileResponse, JSONResponse
from starlette.concurrency import run_in_threadpool

from composer.errors import ComposerError, InvalidInputError
from composer.logging import get_logger
from composer.serve.jobs import new_id

logger = get_logger(__name__)

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
SUFFIX = ".session"


class SessionProblem(ComposerError):
    """A session request that cannot be served: `status` is the HTTP status, `param` the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


@dataclass
class Held:
    """An open session and what the server knows of it."""

    id: str
    session: Any  # composer.session.Session
    sampling: dict[str, Any]
    created: float = field(default_factory=time.time)
    used: float = field(default_factory=time.monotonic)
    busy: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    owner: str | None = None  # the API key's name that opened it (None without keys)

    def to_json(self) -> dict[str, Any]:
        frames = self.session.frames
        return {"id": self.id, "object": "session", "blocks": self.session.blocks, "frames": int(len(frames)),
                "segments": len(self.session.segments), "fps": self.session.fps, "busy": self.busy,
                "created_at": int(self.created), "idle_seconds": round(time.monotonic() - self.used, 1),
                "sampling": self.sampling}

    def segment_url(self, number: int) -> str:
        """Where a client fetches the session's `number`-th segment (1 is the first)."""
        return f"/v1/sessions/{self.id}/segments/{number}"


class SessionStore:
    """The server's open sessions over one generator."""

    def __init__(self, generator: Any, output_dir: Path, max_sessions: int = 16, ttl_s: float = 600.0,
                 replica: str | None = None, owned: bool = False,
                 limit_of: Callable[[str], int | None] | None = None):
        self.generator = generator
        # owned (API keys): each session is its opener's; `owner` arguments are key names, `limit_of(name)` a key's
        # sessions=N (None: no limit of its own)
        self.owned = owned
        self.limit_of = limit_of
        self.replica = replica  # the server's --replica: session ids name it, `sess_<replica>-<hex>`
        self.output_dir = Path(output_dir)
        self.snapshots = self.output_dir / "sessions"
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._held: dict[str, Held] = {}
        self._lock = threading.Lock()
        self._count = 0
        self._making: Counter[str | None] = Counter()  # slots held while sessions are made, per owner
        self.limited: Counter[str] = Counter()  # sessions refused by their key's sessions=N, per key name

    # -- open / close ----------------------------------------------------------------------------------
    def _new_id(self) -> str:
        return new_id("sess", self.replica, 16)

    def _admit(self, make, owner: str | None = None) -> Held:
        """Make a session with `make()` (which may wait: a fork or resume waits for KV pages) in a reserved slot."""
        self.reap()
        limit = self.limit_of(owner) if (self.owned and self.limit_of is not None and owner is not None) else None
        with self._lock:
            if len(self._held) + self._count >= self.max_sessions:
                raise SessionProblem(429, f"{self.max_sessions} sessions are open (the most this server keeps); "
                                          "close one (DELETE /v1/sessions/{id}) or wait for idle ones to expire")
            if limit is not None:
                mine = sum(1 for h in self._held.values() if h.owner == owner) + self._making[owner]
                if mine >= limit:
                    self.limited[owner] += 1
                    raise SessionProblem(429, f"API key {owner!r} has {mine} sessions open, its limit (sessions="
                                              f"{limit}); close one (DELETE /v1/sessions/{{id}}) first")
            self._count += 1  # a slot held while it is made
            self._making[owner] += 1
        try:
            session, sampling = make()
            held = Held(self._new_id(), session, sampling, owner=owner)
            with self._lock:
                self._held[held.id] = held
            return held
        finally:
            with self._lock:
                self._count -= 1
                self._making[owner] -= 1

    def open(self, sampling: dict[str, Any], inputs: dict[str, Any] | None = None, owner: str | None = None) -> Held:
        """`sampling`: checked JSON-safe fields (the record); `inputs`: decoded images (a start image); `owner`: the
        API key's name (sessions owned: only that key sees it)."""
        def make():
            return self.generator.open_session(**sampling, **(inputs or {})), dict(sampling)

        try:
            return self._admit(make, owner)
        except ComposerError as exc:  # open_session's checks (the request's were made before)
            if isinstance(exc, SessionProblem):
                raise
            raise SessionProblem(400, str(exc)) from None

    def open_of(self, owner: str) -> int:
        """The sessions `owner` (a key name) holds open."""
        with self._lock:
            return sum(1 for h in self._held.values() if h.owner == owner)

    def _sees(self, held: Held | None, owner: str | None) -> bool:
        """Whether `owner` may see `held`: always without keys; under keys, its own key's only (owner None: a caller
        in the server's process, not a request: every session)."""
        return held is not None and (not self.owned or owner is None or held.owner == owner)

    def get(self, session_id: str, owner: str | None = None) -> Held:
        with self._lock:
            held = self._held.get(session_id)
        if not self._sees(held, owner):  # another key's session: as if it did not exist
            raise SessionProblem(404, f"no open session {session_id!r}", "id")
        return held

    def close(self, session_id: str, owner: str | None = None) -> Held:
        with self._lock:
            held = self._held.get(session_id)
            if not self._sees(held, owner):
                held = None
            else:
                self._held.pop(session_id)
        if held is None:
            raise SessionProblem(404, f"no open session {session_id!r}", "id")
        if not held.lock.acquire(timeout=0):
            with self._lock:
                self._held[session_id] = held
            raise SessionProblem(409, f"session {session_id} is extending; close it when the extend is done", "id")
        try:
            held.session.close()
        finally:
            held.lock.release()
        return held

    def close_all(self) -> None:
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for h in held:
            try:
                h.session.close()
            except Exception:  # noqa: BLE001 - shutting down
                logger.warning("closing session %s failed", h.id, exc_info=True)

    def reap(self) -> list[str]:
        """Close the sessions idle for longer than `ttl_s`; their ids."""
        now = time.monotonic()
        with self._lock:
            old = [h for h in self._held.values() if not h.busy and now - h.used > self.ttl_s]
        closed = []
        for h in old:
            try:
                self.close(h.id, h.owner)
                closed.append(h.id)
                logger.info("session %s closed after %.0f s idle", h.id, now - h.used)
            except SessionProblem:
                pass
        return closed

    def list(self, owner: str | None = None) -> dict[str, Any]:
        self.reap()
        with self._lock:
            held = [h for h in self._held.values() if self._sees(h, owner)]
        folder = self.snapshot_folder(owner)
        snapshots = sorted(p.name[:-len(SUFFIX)] for p in folder.glob(f"*{SUFFIX}")) if folder.is_dir() else []
        return {"object": "list", "data": [h.to_json() for h in held], "snapshots": snapshots}

    def snapshot_folder(self, owner: str | None) -> Path:
        """Where `owner`'s snapshots live: `sessions/` without keys, `sessions/<key name>/` with them (key names are
        plain names: keys.NAME)."""
        if not self.owned or owner is None:  # (owner None: a caller in the server's process)
            return self.snapshots
        if not NAME.match(owner):
            raise SessionProblem(403, "sessions under API keys need a key with a plain name")
        return self.snapshots / owner

    # -- work ------------------------------------------------------------------------------------------
    def _busy(self, held: Held):
        if not held.lock.acquire(timeout=0):
            raise SessionProblem(409, f"session {held.id} is already extending; wait for that extend to finish", "id")
        held.busy = True

    def _idle(self, held: Held) -> None:
        held.busy = False
        held.used = time.monotonic()
        held.lock.release()

    def extend(self, session_id: str, prompt: Any, num_blocks: Any, owner: str | None = None) -> dict[str, Any]:
        """Make the next `num_blocks` blocks of `prompt` (blocking: run it on a worker thread)."""
        held = self._checked_extend(session_id, prompt, num_blocks, owner)
        self._busy(held)
        with self._idle_on_error(held):
            start = time.perf_counter()
            chunks = list(held.session.extend(prompt, num_blocks))
        return self.finish_extend(held, chunks, start)

    @contextmanager
    def _idle_on_error(self, held: Held) -> Iterator[None]:
        """A busy session's work: on any error the session is free again (a refused extend: a 400)."""
        try:
            yield
        except InvalidInputError as exc:
            self._idle(held)
            raise SessionProblem(400, str(exc)) from None
        except BaseException:
            self._idle(held)
            raise

    def _checked_extend(self, session_id: str, prompt: Any, num_blocks: Any, owner: str | None = None) -> Held:
        held = self.get(session_id, owner)
        if not isinstance(prompt, str) or not prompt.strip():
            raise SessionProblem(400, f"prompt = {prompt!r}: expected a non-empty string", "prompt")
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise SessionProblem(400, f"num_blocks = {num_blocks!r}: expected an integer >= 1", "num_blocks")
        return held

    @property
    def runs_tasks(self) -> bool:
        """Whether extends run as tasks on the generator's request loop (no thread waits for them)."""
        return bool(getattr(getattr(self.generator, "pipeline", None), "streams_as_tasks", False))

    def start_extend(self, session_id: str, prompt: Any, num_blocks: Any,
                     owner: str | None = None) -> tuple[Held, Any, float]:
        """Begin an extend as a task: (the session, the future of its chunks, when it began). The session is busy
        until `finish_extend` or `release`."""
        held = self._checked_extend(session_id, prompt, num_blocks, owner)
        self._busy(held)
        with self._idle_on_error(held):
            task = held.session.extend_task(prompt, num_blocks)
            future = self.generator.core.submit(task, held.session.context)
        return held, future, time.perf_counter()

    def finish_extend(self, held: Held, chunks: list, start: float) -> dict[str, Any]:
        """(Blocking: a worker thread) Write the extend's segment and describe it; the session is free again."""
        try:
            number = len(held.session.segments)  # this extend's segment, once it made a frame
            if chunks:
                self._write(np.concatenate([c.frames for c in chunks]), self._segment_path(held, number),
                            held.session.fps)
            frames = sum(len(c.frames) for c in chunks)
            return {"id": held.id, "object": "session.extend", "blocks": held.session.blocks, "new_frames": frames,
                    "frames": int(len(held.session.frames)), "segments": number,
                    "seconds": round(time.perf_counter() - start, 3),
                    "video": held.segment_url(number) if chunks else None}
        finally:
            self._idle(held)

    def release(self, held: Held) -> None:
        self._idle(held)

    def _segment_path(self, held: Held, number: int) -> Path:
        return self.output_dir / held.id / f"segment-{number:03d}.mp4"

    @staticmethod
    def _write(frames: Any, path: Path, fps: int) -> Path:
        """`frames` as an mp4 at `fps`, written beside `path` and moved into place: a reader never gets half."""
        from composer.video import save_video

        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.stem}-{threading.get_ident()}-{time.monotonic_ns()}{path.suffix}")
        try:
            save_video(frames, partial, fps=fps)
            partial.replace(path)
        finally:
            partial.unlink(missing_ok=True)
        return path

    def segment(self, session_id: str, number: Any, owner: str | None = None) -> Path:
        """The video of the session's `number`-th segment (1 is the first). A fork or a resumed session holds its
        source's segments too: theirs are written from its frames when first asked for."""
        held = self.get(session_id, owner)
        count = len(held.session.segments)
        if not isinstance(number, str) or not re.fullmatch(r"[0-9]{1,9}", number) or not 1 <= int(number) <= count:
            held_text = f"1 to {count}" if count else "none yet (extend it first)"
            raise SessionProblem(404, f"session {session_id} has no segment {number!r}; its segments: {held_text}",
                                 "segment")
        number = int(number)
        path = self._segment_path(held, number)
        if path.is_file():
            return path
        if held.busy and number == count:
            raise SessionProblem(409, f"segment {number} of session {session_id} is being made; fetch it when the "
                                      "extend answers", "segment")
        start = sum(s.frames for s in held.session.segments[:number - 1])
        end = start + held.session.segments[number - 1].frames
        frames = held.session.frames
        if len(frames) < end:
            raise SessionProblem(404, f"session {session_id} does not keep the frames of segment {number}", "segment")
        return self._write(frames[start:end], path, held.session.fps)

    def video(self, session_id: str, owner: str | None = None) -> Path:
        """The whole video so far, written to the output folder."""
        held = self.get(session_id, owner)
        frames = held.session.frames
        if not len(frames):
            raise SessionProblem(409, f"session {session_id} has no frames yet (extend it first)", "id")
        return self._write(frames, self.output_dir / held.id / "video.mp4", held.session.fps)

    def fork(self, session_id: str, owner: str | None = None) -> Held:
        held = self.get(session_id, owner)
        self._busy(held)
        try:
            return self._admit(lambda: (held.session.fork(), dict(held.sampling)), owner)
        finally:
            self._idle(held)

    def snapshot(self, session_id: str, name: str | None = None, owner: str | None = None) -> dict[str, Any]:
        held = self.get(session_id, owner)
        name = held.id if name is None else name
        if not isinstance(name, str) or not NAME.match(name):
            raise SessionProblem(400, f"name = {name!r}: expected a plain name (letters, digits, _ . -; at most 64)",
                                 "name")
        self._busy(held)
        try:
            try:
                data = held.session.snapshot()
            except InvalidInputError as exc:
                raise SessionProblem(400, str(exc)) from None
        finally:
            self._idle(held)
        folder = self.snapshot_folder(owner)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{name}{SUFFIX}"
        partial = path.with_suffix(".partial")
        partial.write_bytes(data)
        partial.replace(path)  # a reader never sees half a snapshot
        return {"id": held.id, "object": "session.snapshot", "name": name, "bytes": len(data)}

    def resume(self, name: Any, owner: str | None = None) -> Held:
        if not isinstance(name, str) or not NAME.match(name):
            raise SessionProblem(400, f"snapshot = {name!r}: expected the name of a snapshot in the output folder",
                                 "snapshot")
        path = self.snapshot_folder(owner) / f"{name}{SUFFIX}"
        if not path.is_file():
            where = self.snapshots if not self.owned else "this key's snapshots"
            raise SessionProblem(404, f"no snapshot named {name!r} in {where}", "snapshot")
        data = path.read_bytes()

        def make():
            session = self.generator.resume_session(data)
            return session, dict(session._sampling)

        try:
            return self._admit(make, owner)
        except InvalidInputError as exc:  # a damaged, cut-off or foreign file (SnapshotError), another model, ...
            raise SessionProblem(400, f"snapshot {name!r}: {exc}", "snapshot") from None


def add_session_routes(router: Any, state: Any, store_of) -> None:
    """Register `/v1/sessions` on `router` (the video routes); `store_of()` gives the SessionStore (None until the
    model is loaded)."""
    from composer.serve.requests import RequestProblem, ServerLimits, check_body

    def problem(status: int, message: str, param: str | None = None) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param}},
                            status_code=status)

    def owner_of(request: Request) -> str | None:
        """The name of the API key the request came with (auth.py sets it; None without keys)."""
        return getattr(request.state, "api_key_name", None)

    async def body_of(request: Request) -> dict | JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            return problem(400, "the body must be JSON")
        if not isinstance(body, dict):
            return problem(400, f"the body must be a JSON object, not {type(body).__name__}")
        return body

    def ready():
        store = store_of()
        if store is None:
            generator = getattr(state, "generator", None)
            if generator is None:
                return None, problem(503, "the model is still loading")
            return None, problem(400, "sessions need a causal (block-by-block) model served by one process; this "
                                      "server's model makes whole videos, or runs on several ranks")
        return store, None

    async def with_body(request: Request, optional: bool = False):
        """(store, JSON object body, None), or (None, None, the error response)."""
        store, refused = ready()
        if refused:
            return None, None, refused
        if optional and not (await request.body()).strip():
            return store, {}, None
        body = await body_of(request)
        if isinstance(body, JSONResponse):
            return None, None, body
        return store, body, None

    async def run(fn, *args, status: int = 200):
        try:
            result = await run_in_threadpool(fn, *args)
        except SessionProblem as exc:
            return problem(exc.status, str(exc), exc.param)
        if isinstance(result, Held):
            result = result.to_json()
        return JSONResponse(result, status_code=status)

    @router.post("/v1/sessions")
    async def open_session(request: Request):
        store, body, refused = await with_body(request)
        if refused:
            return refused
        limits = state.config.limits if hasattr(state, "config") else ServerLimits()
        uploads = getattr(getattr(state, "config", None), "uploads", None)
        try:  # the stream/job field rules (uploads decoded off the loop); no prompt until the first extend
            checked = await run_in_threadpool(check_body, {**body, "prompt": body.get("prompt") or "(session)"},
                                              store.generator, limits, (), uploads)
        except RequestProblem as exc:
            return problem(400, str(exc), exc.field)
        sampling = {k: v for k, v in checked.params.items() if k in body and k != "prompt"}
        sampling["seed"] = checked.params["seed"]
        if checked.priority:
            sampling["priority"] = checked.priority
        return await run(store.open, sampling, checked.inputs, owner_of(request), status=201)

    @router.get("/v1/sessions")
    async def list_sessions(request: Request):
        store, refused = ready()
        return refused or await run(store.list, owner_of(request))

    @router.get("/v1/sessions/{session_id}")
    async def get_session(session_id: str, request: Request):
        store, refused = ready()
        return refused or await run(store.get, session_id, owner_of(request))

    @router.post("/v1/sessions/{session_id}/extend")
    async def extend(session_id: str, request: Request):
        store, body, refused = await with_body(request)
        if refused:
            return refused
        unknown = [k for k in body if k not in ("prompt", "num_blocks")]
        if unknown:
            return problem(400, f"unknown field {unknown[0]!r}: an extend takes prompt and num_blocks", unknown[0])
        if not store.runs_tasks:
            return await run(store.extend, session_id, body.get("prompt"), body.get("num_blocks", 1),
                             owner_of(request))
        try:  # a task on the generator's request loop: no thread waits for the blocks
            held, future, start = await run_in_threadpool(store.start_extend, session_id, body.get("prompt"),
                                                          body.get("num_blocks", 1), owner_of(request))
        except SessionProblem as exc:
            return problem(exc.status, str(exc), exc.param)
        try:
            chunks = await asyncio.wrap_future(future)
        except InvalidInputError as exc:
            store.release(held)
            return problem(400, str(exc))
        except BaseException:
            store.release(held)
            raise
        return await run(store.finish_extend, held, chunks, start)

    @router.get("/v1/sessions/{session_id}/segments/{number}")
    async def segment(session_id: str, number: str, request: Request):
        store, refused = ready()
        if refused:
            return refused
        try:
            path = await run_in_threadpool(store.segment, session_id, number, owner_of(request))
        except SessionProblem as exc:
            return problem(exc.status, str(exc), exc.param)
        return FileResponse(path, media_type="video/mp4")

    @router.get("/v1/sessions/{session_id}/video")
    async def video(session_id: str, request: Request):
        store, refused = ready()
        if refused:
            return refused
        try:
            path = await run_in_threadpool(store.video, session_id, owner_of(request))
        except SessionProblem as exc:
            return problem(exc.status, str(exc), exc.param)
        return FileResponse(path, media_type="video/mp4")

    @router.post("/v1/sessions/{session_id}/fork")
    async def fork(session_id: str, request: Request):
        store, refused = ready()
        return refused or await run(store.fork, session_id, owner_of(request), status=201)

    @router.post("/v1/sessions/{session_id}/snapshot")
    async def snapshot(session_id: str, request: Request):
        store, body, refused = await with_body(request, optional=True)
        if refused:
            return refused
        return await run(store.snapshot, session_id, body.get("name"), owner_of(request))

    @router.post("/v1/sessions/resume")
    async def resume(request: Request):
        store, body, refused = await with_body(request)
        if refused:
            return refused
        return await run(store.resume, body.get("snapshot"), owner_of(request), status=201)

    @router.delete("/v1/sessions/{session_id}")
    async def close(session_id: str, request: Request):
        store, refused = ready()
        if refused:
            return refused
        owner = owner_of(request)
        return await run(lambda: {**store.close(session_id, owner).to_json(), "closed": True})
