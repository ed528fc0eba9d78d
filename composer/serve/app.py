"""The FastAPI app of `composer serve`: one app over one loaded model, whatever its modality, or over a video model
and a text model together (`create_app(load, config, text_load=...)`, `composer serve --text-model-path`).

`create_app` installs what every server has once (API keys, OpenAI-style errors, /health, /ready, /metrics,
/v1/models: server.py's `build_app`), then mounts the routes of each model's modality, each group an APIRouter over
the same state:
    video   /v1/videos (jobs), the web page and /v1/model (page.py), and for a causal model /v1/streams
            (stream.py) and /v1/sessions (sessions.py)
    text    /v1/completions and /v1/chat/completions (text.py), their requests admitted by `Slots` (slots.py)
Everything mutable lives on the one `ServerState` (server.py) held by the app (`app.state.composer`): the models
(loaded in a background thread, so /health answers 503 until they are ready) and what each modality's routes keep.
With two models, the video routes go to the video model and the text routes to the text model; a `model` naming
the other one is refused as a wrong name is (with a message saying which routes serve it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request  # the serve extra: `composer serve` checks it first
from fastapi.responses import FileResponse, Response
from starlette.concurrency import run_in_threadpool

from composer.logging import get_logger
from composer.serve.jobs import COMPLETED, FINISHED, STATES, Job, new_job_id, replica_in
from composer.serve.page import add_page_routes
from composer.serve.problems import RequestProblem
from composer.serve.requests import check_body, derive_body
from composer.serve.responses import error, queue_full, refused
from composer.serve.server import (  # (importable from here, where they were defined before)
    DESCRIPTIONS,
    MAX_BODY_BYTES,
    MODALITIES,
    TEXT_CONCURRENT_DEFAULT,
    Counters,
    ServeConfig,
    ServerState,
    build_app,
)
from composer.serve.sessions import add_session_routes
from composer.serve.stream import add_stream_routes
from composer.serve.uploads import read_body
from composer.serve.worker import QueueFull

__all__ = ["DESCRIPTIONS", "MAX_BODY_BYTES", "MODALITIES", "TEXT_CONCURRENT_DEFAULT", "Counters", "ServeConfig",
           "ServerState", "add_video_routes", "create_app", "error", "queue_full", "refused", "thumbnail",
           "video_routes"]

logger = get_logger(__name__)


def create_app(load: Callable[[], Any], config: ServeConfig, modality: str = "video",
               text_load: Callable[[], Any] | None = None) -> FastAPI:
    """The app serving the model `load()` returns (called once, in a background thread at startup): what every
    server has installed once (API keys, OpenAI-style errors, /health, /ready, /metrics, /v1/models: server.py's
    `build_app`), then the routes of the model's `modality`, a router per group: "video" (jobs, live streams and
    sessions of a causal model, the web page) or "text" (completions and chat completions, composer/serve/text.py).

    `text_load` (a video `modality` only): a text model served beside the video one, loaded after it on the same
    loading thread, with the text routes added too."""
    if modality == "text":
        if text_load is not None:
            raise ValueError("text_load serves a text model beside a video model: modality must be 'video'")
        from composer.serve.text import add_text_routes, text_metric_lines

        return build_app(load, config, modality, add_text_routes, text_metric_lines)
    if text_load is None:
        return build_app(load, config, modality, add_video_routes, _video_metric_lines)
    from composer.serve.text import add_text_routes, text_metric_lines

    def add_routes(app: FastAPI, state: ServerState) -> None:
        add_video_routes(app, state)
        add_text_routes(app, state)

    def metric_lines(state: ServerState) -> list[str]:  # (the text lines' names differ from the video ones')
        return _video_metric_lines(state) + text_metric_lines(state)

    return build_app(load, config, modality, add_routes, metric_lines, text_load)


def add_video_routes(app: FastAPI, state: ServerState) -> None:
    """A video model's routes: the web page and /v1/model (page.py), /v1/videos (jobs), and the live streams
    (stream.py) and sessions (sessions.py) of a causal model."""
    add_page_routes(app, state)  # the web page at / and GET /v1/model (page.py)
    app.include_router(video_routes(state))  # /v1/videos: jobs
    streams, sessions = APIRouter(), APIRouter()
    state.streams = app.state.streams = add_stream_routes(streams, state)  # WebSocket /v1/streams (stream.py)
    add_session_routes(sessions, state, lambda: state.sessions)  # /v1/sessions (sessions.py)
    app.include_router(streams)  # (both answer a clear error on a model that is not causal)
    app.include_router(sessions)


def video_routes(state: ServerState) -> APIRouter:
    """A video model's jobs: /v1/videos (create, remix, edit, extend, list, get, content, cancel, delete)."""
    router = APIRouter()
    config = state.config

    def unready() -> Any:
        return state.unready("video")  # (a text model served beside it may still be loading)

    def owner_of(request: Request) -> str | None:
        """The name of the API key a request came with (auth.py sets it; None without keys)."""
        return getattr(request.state, "api_key_name", None)

    def find(job_id: str, request: Request, param: str = "id") -> Job | Any:
        """The job, if it exists and the request's key may see it (a key sees only its own jobs); else a 404."""
        job = state.store.get(job_id)
        if job is not None and (config.keys is None or job.owner == owner_of(request)):
            return job
        return error(404, f"no video {job_id!r} (GET /v1/videos lists the videos)", param)

    async def on_core(fn: Callable[[], Any]) -> Any:
        """`fn()` on the model's engine core (its stage threads), awaited: a generator without a core (the ranks'
        or the worker processes' front) runs it on the server's thread pool."""
        core = getattr(state.generator, "core", None)
        if core is None:
            return await run_in_threadpool(fn)
        return await asyncio.wrap_future(core.call(fn))

    def queue(job: Job) -> dict | Any:
        """Store and queue a checked job: its video object as created (queued: the worker may start it at once), or
        429 when the queue is full (nothing kept)."""
        state.store.add(job)
        created = job.to_json()
        try:
            state.worker.submit(job)
        except QueueFull:
            state.store.remove(job.id)
            return queue_full(config.max_queue)
        return created

    def new_job(checked: Any, request: Request, remixed_from: str | None = None) -> Job:
        return Job(new_job_id(config.replica), checked.params, model=str(state.generator.model_path),
                   inputs=checked.inputs, lora=checked.lora, priority=checked.priority, owner=owner_of(request),
                   remixed_from=remixed_from, warnings=checked.warnings, checked=checked.request)

    @router.post("/v1/videos", status_code=200)
    async def create_video(request: Request):
        """Queue a video. The body is JSON or multipart/form-data (what the `openai` SDK sends): generate_video's
        fields (prompt, height, width, num_frames, ...), OpenAI's `size` ("WIDTHxHEIGHT"), `seconds` and `model`,
        and image / video inputs as files or base64 (`image`, `last_image`, `start_image`, `start_video`, `video`,
        or OpenAI's `input_reference`: the model's first frame or input video)."""
        if (not_ready := unready()) is not None:
            return not_ready
        try:
            body = await read_body(request, config.max_body_bytes)
            if (other := state.other_model(body, "video")) is not None:
                raise other

            def accept() -> dict | Any:
                checked = check_body(body, state.generator, config.limits, config.loras, config.uploads)
                return queue(new_job(checked, request))

            # uploads decoded, the request checked, the job queued (and started when a slot is free) by the model's
            # engine core, off the event loop: other clients keep being answered, and the job's only hand-offs are
            # this one and the answer's way back
            return await on_core(accept)
        except RequestProblem as exc:
            return error(exc.status, str(exc), exc.field)

    @router.post("/v1/videos/{job_id}/remix", status_code=200)
    async def remix_video(job_id: str, request: Request):
        """A new video from a completed one and a new prompt (other fields as in POST /v1/videos; the rest are the
        source's): a causal model continues it (starting from its last frames), a video-to-video model redraws it
        (`strength`); other models answer 422."""
        return await derived(request, job_id, None)

    @router.post("/v1/videos/edits", status_code=200)
    async def edit_video(request: Request):
        """OpenAI's edit: video-to-video of `video` (an uploaded video, or {"id": a completed video's id})."""
        return await derived(request, None, "edit")

    @router.post("/v1/videos/extensions", status_code=200)
    async def extend_video(request: Request):
        """OpenAI's extension: a causal model continues `video` (an uploaded video, or {"id": a completed video's id})
        for `seconds` more."""
        return await derived(request, None, "extend")

    async def derived(request: Request, source_id: str | None, mode: str | None):
        if (not_ready := unready()) is not None:
            return not_ready
        try:
            body = await read_body(request, config.max_body_bytes)
            if not isinstance(body, dict):
                raise RequestProblem(f"the body must be a JSON object of request fields, not {type(body).__name__}")
            if (other := state.other_model(body, "video")) is not None:
                raise other
            source = None
            if source_id is None:  # edits / extensions: `video` is an upload or a reference to a completed video
                ref = body.get("video")
                if isinstance(ref, dict):
                    if set(ref) != {"id"} or not isinstance(ref.get("id"), str):
                        raise RequestProblem('video: expected an uploaded video or {"id": a completed video\'s id}',
                                             "video")
                    source_id = ref["id"]
                    body = {k: v for k, v in body.items() if k != "video"}
                    owner = replica_in(source_id)
                    if config.replica is not None and owner is not None and owner != config.replica:
                        # behind the proxy, which routes by the path, not the body: send the client to the replica
                        # holding the video (307: the same method and body; the openai SDK and curl -L follow it)
                        query = f"?{request.url.query}" if request.url.query else ""
                        return Response(status_code=307, headers={
                            "Location": f"/replicas/{owner}{request.url.path}{query}"})
                elif ref is None:
                    raise RequestProblem('video is required: an uploaded video or {"id": a completed video\'s id}',
                                         "video")
            if source_id is not None:
                source = find(source_id, request, "video" if mode else "id")
                if not isinstance(source, Job):
                    return source
                if source.status != COMPLETED:
                    return error(409, f"video {source_id} is {source.status}: only a completed video can be "
                                 f"{'remixed' if mode is None else mode + 'ed'}", "id")

            def accept() -> dict | Any:
                checked = derive_body(body, source, state.store, state.generator, config, mode)
                return queue(new_job(checked, request, source.id if source is not None else None))

            return await on_core(accept)
        except RequestProblem as exc:
            return error(exc.status, str(exc), exc.field)

    @router.get("/v1/videos")
    async def list_videos(request: Request, after: str | None = None, limit: str = "20", order: str = "desc"):
        """The videos, OpenAI's page: `data`, `first_id`, `last_id`, `has_more`; `order` asc or desc (by creation,
        default desc), `limit` 1..100 (default 20), `after` a video id (the page after it)."""
        try:
            count = int(limit)
        except ValueError:
            count = 0
        if not 1 <= count <= 100:
            return error(400, f"limit = {limit!r}: expected an integer in [1, 100]", "limit")
        if order not in ("asc", "desc"):
            return error(400, f"order = {order!r}: expected 'asc' or 'desc'", "order")
        jobs = [job for job in state.store.all() if config.keys is None or job.owner == owner_of(request)]
        if order == "desc":
            jobs.reverse()
        if after is not None:
            ids = [job.id for job in jobs]
            if after not in ids:
                return error(400, f"after = {after!r}: no such video in this list", "after")
            jobs = jobs[ids.index(after) + 1:]
        page = jobs[:count]
        return {"object": "list", "data": [job.to_json() for job in page],
                "first_id": page[0].id if page else None, "last_id": page[-1].id if page else None,
                "has_more": len(jobs) > count}

    @router.get("/v1/videos/{job_id}")
    async def get_video(job_id: str, request: Request):
        """A video's status: queued, in_progress (progress 0..100), completed, failed (with the error), cancelled."""
        job = find(job_id, request)
        return job.to_json() if isinstance(job, Job) else job

    @router.get("/v1/videos/{job_id}/content")
    async def get_content(job_id: str, request: Request, variant: str = "video"):
        """The finished video (mp4), or `variant=thumbnail` (its first frame, JPEG); 409 while not completed."""
        job = find(job_id, request)
        if not isinstance(job, Job):
            return job
        if variant not in ("video", "thumbnail"):
            return error(400, f"variant = {variant!r}: expected 'video' or 'thumbnail' (no spritesheets here)",
                         "variant")
        if job.status != COMPLETED:
            return error(409, f"video {job_id} is {job.status}: its content is available once it is completed", "id")
        path = state.store.video_path(job_id)
        if not path.is_file():
            return error(404, f"the video of job {job_id} is missing from the output folder", "id")
        if variant == "thumbnail":
            data = await run_in_threadpool(thumbnail, path)
            return Response(data, media_type="image/jpeg")
        return FileResponse(path, media_type="video/mp4", filename=f"{job_id}.mp4")

    @router.post("/v1/videos/{job_id}/cancel")
    async def cancel_video(job_id: str, request: Request):
        """Cancel a queued or running video and keep its record (409 once it is finished: nothing is deleted)."""
        job = find(job_id, request)
        if not isinstance(job, Job):
            return job
        if job.status in FINISHED or state.worker is None or not state.worker.cancel(job):
            return error(409, f"video {job_id} is already {job.status}", "id")
        return job.to_json()

    @router.delete("/v1/videos/{job_id}")
    async def delete_video(job_id: str, request: Request):
        """Cancel a queued or running video (a running one stops at its next transformer block; the answer is the
        video object with `deleted: false`), or delete a finished one, record and file ({"id", "object":
        "video.deleted", "deleted": true})."""
        job = find(job_id, request)
        if not isinstance(job, Job):
            return job
        if job.status not in FINISHED and state.worker is not None and state.worker.cancel(job):
            return {**job.to_json(), "deleted": False}
        if job.status not in FINISHED:  # not cancellable (a worker-less server): nothing changed
            return error(409, f"video {job_id} is {job.status} and cannot be cancelled now", "id")
        state.store.delete(job_id)
        return {"id": job_id, "object": "video.deleted", "deleted": True}

    return router


def _video_metric_lines(state: ServerState) -> list[str]:
    """A video server's lines: queue length and queue wait, jobs by state, jobs running and the most at once,
    seconds per denoising step, the step schedulers' transformer calls and batch sizes, the KV page pool of a
    causal model, the memory budget, live streams (each running stream's frame rate)."""
    worker = state.worker
    lines = ["# HELP composer_queue_length jobs waiting for a worker", "# TYPE composer_queue_length gauge",
             f"composer_queue_length {worker.queue_length if worker else 0}",
             "# HELP composer_queue_wait_seconds seconds each started job (or stream) waited in the queue",
             "# TYPE composer_queue_wait_seconds summary",
             f"composer_queue_wait_seconds_sum {worker.queue_wait_sum if worker else 0.0:.6f}",
             f"composer_queue_wait_seconds_count {worker.queue_waits if worker else 0}",
             "# HELP composer_jobs jobs by state", "# TYPE composer_jobs gauge"]
    counts = state.store.counts()
    lines += [f'composer_jobs{{state="{s}"}} {counts[s]}' for s in STATES]
    lines += ["# HELP composer_jobs_running jobs running now", "# TYPE composer_jobs_running gauge",
              f"composer_jobs_running {worker.running if worker else 0}",
              "# HELP composer_tasks_running requests running as tasks on the request loop now (jobs, stream "
              "chunks, session extends): no thread waits for them between their steps",
              "# TYPE composer_tasks_running gauge",
              f"composer_tasks_running {worker.tasks_running() if worker else 0}",
              "# HELP composer_max_concurrent jobs that may run at once (--max-concurrent)",
              "# TYPE composer_max_concurrent gauge",
              f"composer_max_concurrent {worker.max_concurrent if worker else 0}"]
    lines += ["# HELP composer_step_seconds denoising step time, per job (a step shared by several jobs counts "
              "for each)", "# TYPE composer_step_seconds summary",
              f"composer_step_seconds_sum {worker.step_seconds_sum if worker else 0.0:.6f}",
              f"composer_step_seconds_count {worker.steps if worker else 0}"]
    calls, units, batched, largest = worker.scheduler_stats() if worker else (0, 0, 0, 0)
    lines += ["# HELP composer_transformer_calls_total transformer calls the step schedulers ran",
              "# TYPE composer_transformer_calls_total counter", f"composer_transformer_calls_total {calls}",
              "# HELP composer_scheduled_units_total requests' steps (units) the step schedulers ran",
              "# TYPE composer_scheduled_units_total counter", f"composer_scheduled_units_total {units}",
              "# HELP composer_batched_units_total units that shared a transformer call with another request's",
              "# TYPE composer_batched_units_total counter", f"composer_batched_units_total {batched}",
              "# HELP composer_batch_size units (requests' steps) per transformer call: _sum / _count is the "
              "mean batch", "# TYPE composer_batch_size summary", f"composer_batch_size_sum {units}",
              f"composer_batch_size_count {calls}",
              "# HELP composer_batch_size_max the most units one transformer call ran",
              "# TYPE composer_batch_size_max gauge", f"composer_batch_size_max {largest}"]
    pool = worker.kv_pool_stats() if worker else None
    if pool is not None:  # a causal model: its streams' KV pages
        budget = "+Inf" if pool.budget_bytes is None else str(pool.budget_bytes)
        lines += _gauges("composer_kv_pool", [
            ("budget_bytes", "the KV page pool's budget (--kv-cache-memory; +Inf: no limit)", budget),
            ("used_bytes", "KV cache bytes in use by streams now", pool.used_bytes),
            ("allocated_bytes", "KV page arenas allocated, used or free", pool.allocated_bytes),
            ("peak_used_bytes", "the most KV cache bytes in use at once", pool.peak_used_bytes),
            ("sessions", "KV caches holding pages now", pool.sessions),
            ("waiting", "KV caches waiting for pages now (the budget is full)", pool.waiting),
            ("shared_pages", "KV pages shared by more than one cache (forks)", pool.shared_pages)])
        lines += ["# HELP composer_kv_pool_waits_total KV caches that had to wait for pages",
                  "# TYPE composer_kv_pool_waits_total counter", f"composer_kv_pool_waits_total {pool.waits}"]
    admission = getattr(getattr(state.generator, "memory_guard", None), "admission", None)
    if admission is not None:  # --memory-budget: jobs admitted against one budget (docs/memory.md)
        memory = admission.stats()
        lines += _gauges("composer_memory", [
            ("room_bytes", "the memory budget after headroom, less the weights", memory.room),
            ("weights_bytes", "the weights on the device, counted once", memory.weights),
            ("reserved_bytes", "memory the running requests reserved (their predicted activations)",
             memory.reserved),
            ("waiting", "requests waiting for memory now", memory.waiting)])
        lines += ["# HELP composer_memory_waits_total requests that had to wait for memory",
                  "# TYPE composer_memory_waits_total counter", f"composer_memory_waits_total {memory.waits}"]
    lines += state.streams.metric_lines()
    return lines


def _gauges(prefix: str, rows: list[tuple[str, str, Any]]) -> list[str]:
    """Prometheus lines for gauges `prefix_name`, each with its help text and value."""
    lines = []
    for name, help_text, value in rows:
        lines += [f"# HELP {prefix}_{name} {help_text}", f"# TYPE {prefix}_{name} gauge", f"{prefix}_{name} {value}"]
    return lines


def thumbnail(path: Path) -> bytes:
    """The first frame of a finished video as a JPEG."""
    import io

    import imageio.v2 as imageio
    import PIL.Image

    with imageio.get_reader(path, format="FFMPEG") as reader:
        frame = reader.get_data(0)
    buffer = io.BytesIO()
    PIL.Image.fromarray(frame).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()
