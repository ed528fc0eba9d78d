"""Job records: what a client polls, kept in memory and written as JSON next to the videos.

Layout of the output folder: `jobs/<id>.json` (the record) and `videos/<id>.mp4` (a finished video). A record
is rewritten atomically on every state change, so a crash leaves the last state; on restart, completed jobs
stay fetchable and jobs that were queued or running are marked failed ("server restarted").
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from composer.errors import ConfigError

QUEUED, IN_PROGRESS, COMPLETED, FAILED, CANCELLED = "queued", "in_progress", "completed", "failed", "cancelled"
STATES = (QUEUED, IN_PROGRESS, COMPLETED, FAILED, CANCELLED)
FINISHED = (COMPLETED, FAILED, CANCELLED)


@dataclass
class Job:
    """One video request and where it stands."""

    id: str
    request: dict[str, Any]  # the checked request (SamplingParam fields, JSON-safe)
    model: str
    status: str = QUEUED
    progress: float = 0.0
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    completed_at: float | None = None
    error: str | None = None
    lora: list = field(default_factory=list)  # [name, scale] pairs of the adapters it runs with ([]: none)
    kind: str = "video"  # "video" (POST /v1/videos) or "stream" (a live WebSocket stream, serve/stream.py)
    priority: int = 0  # higher starts first, and its steps are scheduled first
    owner: str | None = None  # the name of the API key that created it (auth.py; None: no keys configured)
    remixed_from: str | None = None  # the video this one remixes (POST /v1/videos/{id}/remix)
    warnings: list[str] = field(default_factory=list)  # what the request should know (a prompt the encoder cuts)
    inputs: dict[str, Any] = field(default_factory=dict, repr=False)  # decoded images: not in the record
    # the request as checked before it was queued (composer.request_check.CheckedRequest): what generate_video
    # runs without checking it again; not in the record (a job read back from its file has none)
    checked: Any = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict[str, Any]:
        """The video object as the API returns it: OpenAI's fields with OpenAI's types (`progress` an integer 0..100,
        `created_at` / `completed_at` integer seconds, `seconds` and `size` strings, `error` {code, message}), and
        composer's beside them (`kind`, `progress_fraction` 0..1, `started_at`, `times` (the timestamps to the
        microsecond), `seed`, `lora`, `priority`, the checked `request` and its `warnings`: a prompt longer than the
        text encoder reads, cut)."""
        req = self.request
        status = self.status
        return {
            "id": self.id, "object": "video", "status": status, "model": self.model,
            "progress": 100 if status == COMPLETED else min(int(self.progress * 100), 99),
            "created_at": int(self.created_at),
            "completed_at": None if self.completed_at is None else int(self.completed_at),
            "expires_at": None, "size": f"{req.get('width')}x{req.get('height')}", "seconds": _seconds(req),
            "prompt": req.get("prompt"), "remixed_from_video_id": self.remixed_from,
            "error": {"code": _ERROR_CODES.get(status, "failed"), "message": self.error} if self.error else None,
            # composer's fields
            "kind": self.kind, "progress_fraction": round(self.progress, 4), "started_at": self.started_at,
            "times": {"created_at": self.created_at, "started_at": self.started_at,  # fractional seconds
                      "completed_at": self.completed_at},
            "seed": req.get("seed"), "lora": self.lora, "priority": self.priority, "request": req,
            "warnings": self.warnings,
        }

    def record(self) -> dict[str, Any]:
        """What the job's file keeps: every field at full precision (not the decoded inputs), and the API's view."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _NOT_KEPT}
        return {**self.to_json(), "fields": fields}

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> Job:
        """A job from its file (this version's `record`, or an older file that kept only the API's view)."""
        names = {f.name for f in dataclasses.fields(cls)}
        if isinstance(data.get("fields"), dict):
            return cls(**{k: v for k, v in data["fields"].items() if k in names and k not in _NOT_KEPT})
        values = {k: v for k, v in data.items() if k in names and k not in _NOT_KEPT}
        if isinstance(data.get("error"), dict):
            values["error"] = data["error"].get("message")
        return cls(**values)


_ERROR_CODES = {FAILED: "generation_failed", CANCELLED: "cancelled"}
_NOT_KEPT = ("inputs", "checked")  # a job's fields its file does not keep


def _seconds(req: dict[str, Any]) -> str | None:
    """The video's length as OpenAI's `seconds` string ("5.06")."""
    frames, fps = req.get("num_frames"), req.get("fps")
    if not (isinstance(frames, int) and isinstance(fps, int) and fps > 0):
        return None
    return f"{round(frames / fps, 2):g}"


REPLICA_NAME = re.compile(r"^[a-z0-9]{1,16}$")


def check_replica(name: str) -> str:
    """A replica's name (--replica) as ids carry it: 1 to 16 lowercase letters or digits, so that a proxy can
    read it back from `video_<name>-...` and `sess_<name>-...` (docs/deploy.md)."""
    if not isinstance(name, str) or not REPLICA_NAME.match(name):
        raise ConfigError(f"replica name {name!r}: expected 1 to 16 lowercase letters or digits (a, b, gpu0, ...)")
    return name


def new_id(prefix: str, replica: str | None = None, hex_chars: int = 24) -> str:
    """A fresh id, `<prefix>_<hex>`, or `<prefix>_<replica>-<hex>` on a named replica (a proxy routes by it)."""
    tail = secrets.token_hex(hex_chars // 2)
    return f"{prefix}_{tail}" if replica is None else f"{prefix}_{replica}-{tail}"


def replica_in(id_: str) -> str | None:
    """The replica name an id carries (`video_<name>-<hex>`, `sess_<name>-<hex>`), or None."""
    if not isinstance(id_, str) or "_" not in id_:
        return None
    head, sep, _ = id_.split("_", 1)[1].partition("-")
    return head if sep and REPLICA_NAME.match(head) else None


def new_job_id(replica: str | None = None) -> str:
    """A job's id: `video_<hex>`, or `video_<replica>-<hex>` on a named replica."""
    return new_id("video", replica)


class JobStore:
    """The jobs of one server, in memory and on disk (`root/jobs`, `root/videos`). Thread-safe."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.jobs_dir, self.videos_dir = self.root / "jobs", self.root / "videos"
        self.jobs_dir.mkdir(parents=True, exist_ok=True)
        self.videos_dir.mkdir(parents=True, exist_ok=True)
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()
        self._load()

    def _load(self) -> None:
        """Read the records a previous run left; an unfinished job there died with that run."""
        for path in sorted(self.jobs_dir.glob("*.json")):
            try:
                job = Job.from_record(json.loads(path.read_text(encoding="utf-8")))
            except (OSError, ValueError, TypeError):
                continue  # a foreign or damaged file: not a job of ours
            if job.status in (QUEUED, IN_PROGRESS):
                job.status, job.error, job.completed_at = FAILED, "server restarted", time.time()
                self._write(job)
            elif job.status == COMPLETED and not self.video_path(job.id).is_file():
                job.status, job.error = FAILED, "the finished video is missing from the output folder"
                self._write(job)
            self._jobs[job.id] = job

    def video_path(self, job_id: str) -> Path:
        return self.videos_dir / f"{job_id}.mp4"

    def add(self, job: Job) -> None:
        with self._lock:
            self._jobs[job.id] = job
            self._write(job)

    def remove(self, job_id: str) -> None:
        """Forget a job that never ran (its queue slot was refused)."""
        with self._lock:
            self._jobs.pop(job_id, None)
            (self.jobs_dir / f"{job_id}.json").unlink(missing_ok=True)

    def delete(self, job_id: str) -> bool:
        """Delete a finished job: its record and its video (DELETE /v1/videos/{id}). False if it was not there."""
        with self._lock:
            job = self._jobs.pop(job_id, None)
            if job is None:
                return False
            (self.jobs_dir / f"{job_id}.json").unlink(missing_ok=True)
            self.video_path(job_id).unlink(missing_ok=True)
            return True

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            return self._jobs.get(job_id)

    def all(self) -> list[Job]:
        with self._lock:
            return sorted(self._jobs.values(), key=lambda j: j.created_at)

    def update(self, job: Job, persist: bool = True, **changes: Any) -> None:
        """Change a job's fields (and write its record unless `persist` is off: progress ticks stay in memory)."""
        with self._lock:
            for key, value in changes.items():
                setattr(job, key, value)
            if persist:
                self._write(job)

    def counts(self) -> dict[str, int]:
        with self._lock:
            counts = dict.fromkeys(STATES, 0)
            for job in self._jobs.values():
                counts[job.status] += 1
            return counts

    def _write(self, job: Job) -> None:
        path = self.jobs_dir / f"{job.id}.json"
        temp = path.with_suffix(".json.tmp")
        temp.write_text(json.dumps(job.record(), indent=1), encoding="utf-8")
        os.replace(temp, path)
