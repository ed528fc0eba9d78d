"""Job records: what a client polls, kept in memory and written as JSON next to the videos.

Layout of the output folder: `jobs/<id>.json` (the record) and `videos/<id>.mp4` (a finished video). A record
is rewritten atomically on every state change, so a crash leaves the last state; on restart, completed jobs
stay fetchable and jobs that were queued or running are marked failed ("server restarted").
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    inputs: dict[str, Any] = field(default_factory=dict, repr=False)  # decoded images: not in the record

    def to_json(self) -> dict[str, Any]:
        """The record as the API returns it (OpenAI's video object fields, plus composer's request)."""
        req = self.request
        return {
            "id": self.id, "object": "video", "kind": self.kind, "status": self.status,
            "progress": round(self.progress, 4), "model": self.model, "created_at": self.created_at,
            "started_at": self.started_at,
            "completed_at": self.completed_at, "size": f"{req.get('width')}x{req.get('height')}",
            "seconds": _seconds(req), "prompt": req.get("prompt"), "seed": req.get("seed"),
            "error": {"message": self.error} if self.error else None, "lora": self.lora, "priority": self.priority,
            "request": req,
        }

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> Job:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in names and k != "inputs"}
        values["error"] = (data.get("error") or {}).get("message") if isinstance(data.get("error"), dict) else None
        return cls(**values)


def _seconds(req: dict[str, Any]) -> float | None:
    frames, fps = req.get("num_frames"), req.get("fps")
    return round(frames / fps, 3) if isinstance(frames, int) and isinstance(fps, int) and fps > 0 else None


def new_job_id() -> str:
    return "video_" + uuid.uuid4().hex[:24]


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
        temp.write_text(json.dumps(job.to_json(), indent=1), encoding="utf-8")
        os.replace(temp, path)
