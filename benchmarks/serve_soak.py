"""Soak `composer serve`: many requests from concurrent clients, some malformed, some cancelled, against a real
server on 127.0.0.1 (uvicorn in a thread, the embedded shapes model by default), bounded in time.

Every well-formed request is submitted (retrying after 429 as `Retry-After` says), polled to the end, and its
video fetched and decoded: the mp4 must hold the requested number of frames at the requested size. Malformed
requests must get a 4xx. Cancelled ones must end `cancelled` (or `completed` when the job finished first). At the
end the server must still be healthy and list every accepted job in a final state: 0 crashes, 0 lost jobs.
Prints the outcome counts, the latency percentiles (submit to completed) and the throughput; exits 1 on any
failed check.

With `--streams N` it soaks live streams (the causal shapes model by default): N WebSocket streams at once, each
read to its end (every chunk in order, every JPEG decoded, the saved video fetched), beside jobs from `--clients`
threads (`--requests` of them per round), and with `--stalled`, one more stream whose client reads nothing. Each
round runs twice, without and with the stalled client, on a fresh server over the same loaded model; the stalled
stream must pause (its progress stays put while the others run) and must stop nobody else: the report compares
the other streams' frame rates and the jobs' latency with and without it. The stalled stream's frames are swapped
for random `--stall-frame-size` noise after the model makes them, so that its socket's buffers fill in a few
chunks (the shapes model's 64x64 JPEGs are ~1 KB: megabytes of them would fit in the buffers first).

    python benchmarks/serve_soak.py                               # 200 requests, 8 clients, 10 malformed, 10 cancelled
    python benchmarks/serve_soak.py --requests 40 --clients 4 --steps 1 --timeout 120
    python benchmarks/serve_soak.py --streams 3 --stalled --requests 6 --clients 2 --rounds 2

With `--base-url` the jobs soak runs against a server already running there instead (several replicas behind
nginx, docs/deploy.md), with `--api-key` as its key; every accepted job is then checked by its id (each replica
lists only its own jobs):

    python benchmarks/serve_soak.py --base-url http://127.0.0.1:8000 --api-key "$KEY" --requests 40 --steps 0
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# Malformed bodies, cycled: each must be refused with a 4xx and must not disturb the server.
MALFORMED: list[bytes] = [
    b"{not json",
    json.dumps({"prompt": 5}).encode(),
    json.dumps({"negative_prompt": "no prompt"}).encode(),
    json.dumps({"prompt": "x", "num_inference_steps": -3}).encode(),
    json.dumps({"prompt": "x", "height": 100000, "width": 100000}).encode(),
    json.dumps({"prompt": "x", "no_such_field": 1}).encode(),
    json.dumps({"prompt": "x", "size": "big"}).encode(),
    json.dumps({"prompt": "x", "seed": "seven"}).encode(),
    json.dumps({"prompt": "x", "image": "data:image/png;base64,@@@"}).encode(),
    json.dumps(["a", "list"]).encode(),
]


@dataclass
class Outcome:
    kind: str  # "video", "malformed", "cancel"
    ok: bool
    detail: str = ""
    job_id: str | None = None
    latency: float | None = None
    status: str | None = None


@dataclass
class Client:
    port: int
    timeout: float
    retries_429: list[int] = field(default_factory=lambda: [0])
    retries_503: list[int] = field(default_factory=lambda: [0])  # behind a proxy: no replica could take it just now
    host: str = "127.0.0.1"
    key: str | None = None  # an API key of the server (--api-key): sent as Authorization: Bearer
    tls: bool = False

    @classmethod
    def of_url(cls, url: str, timeout: float, key: str | None = None) -> Client:
        """A client of the server at `url` (http://HOST:PORT or https://...)."""
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/"):
            raise ValueError(f"--base-url {url!r}: expected http://HOST:PORT or https://HOST:PORT")
        tls = parts.scheme == "https"
        return cls(parts.port or (443 if tls else 80), timeout, host=parts.hostname, key=key, tls=tls)

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def ws_url(self, path: str) -> str:
        return f"{'wss' if self.tls else 'ws'}://{self.host}:{self.port}{path}"

    def request(self, method: str, path: str, data: bytes | None = None,
                content_type: str = "application/json") -> tuple[int, dict, bytes]:
        connection = http.client.HTTPSConnection if self.tls else http.client.HTTPConnection
        conn = connection(self.host, self.port, timeout=60)
        try:
            conn.request(method, path, body=data, headers={"Content-Type": content_type, **self.auth})
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def submit(self, body: bytes, deadline: float, content_type: str = "application/json") -> tuple[int, dict, bytes]:
        while True:
            status, headers, data = self.request("POST", "/v1/videos", body, content_type)
            busy = status == 429 or (status == 503 and "retry-after" in headers)
            if not busy or time.monotonic() > deadline:
                return status, headers, data
            (self.retries_429 if status == 429 else self.retries_503)[0] += 1
            time.sleep(min(float(headers.get("retry-after", "1")), 2.0) * 0.25)

    def wait(self, job_id: str, deadline: float) -> dict:
        while True:
            status, _, data = self.request("GET", f"/v1/videos/{job_id}")
            job = json.loads(data) if status == 200 else {"status": f"http {status}"}
            if job.get("status") in ("completed", "failed", "cancelled") or time.monotonic() > deadline:
                return job
            time.sleep(0.05)


def multipart(fields: dict[str, str], files: dict[str, tuple[str, bytes, str]]) -> tuple[bytes, str]:
    """A multipart/form-data body (fields, then files) and its Content-Type."""
    boundary = uuid.uuid4().hex
    out = bytearray()
    for key, value in fields.items():
        out += f'--{boundary}\r\nContent-Disposition: form-data; name="{key}"\r\n\r\n{value}\r\n'.encode()
    for key, (name, data, kind) in files.items():
        out += (f'--{boundary}\r\nContent-Disposition: form-data; name="{key}"; filename="{name}"\r\n'
                f"Content-Type: {kind}\r\n\r\n").encode() + data + b"\r\n"
    return bytes(out + f"--{boundary}--\r\n".encode()), f"multipart/form-data; boundary={boundary}"


def upload_png(index: int, size: int = 64) -> bytes:
    """A start image: a coloured square on black."""
    import numpy as np
    import PIL.Image

    image = np.zeros((size, size, 3), np.uint8)
    image[size // 4: size // 2, size // 4: size // 2, index % 3] = 255
    buffer = io.BytesIO()
    PIL.Image.fromarray(image).save(buffer, format="PNG")
    return buffer.getvalue()


# Broken uploads: a cut PNG, text, an mp4 header with nothing after it.
BAD_UPLOADS = [b"\x89PNG\r\n\x1a\n\x00\x00", b"not an image at all", b"\x00\x00\x00\x18ftypisom" + bytes(32)]


def run_one(client: Client, index: int, kind: str, args, deadline: float, frames_dir: Path) -> Outcome:
    from composer.video import read_frames

    if kind == "malformed":
        body = MALFORMED[index % len(MALFORMED)]
        status, _, data = client.submit(body, deadline)
        return Outcome(kind, 400 <= status < 500, f"{status} {data[:80]!r}")
    if kind == "bad-upload":  # a multipart body whose upload is broken: a 4xx, and the server goes on
        fields = {"prompt": "a broken upload", "num_frames": str(args.num_frames)}
        files = {"input_reference": ("cut.png", BAD_UPLOADS[index % len(BAD_UPLOADS)], "image/png")}
        body, content_type = multipart(fields, files)
        status, _, data = client.submit(body, deadline, content_type)
        return Outcome(kind, 400 <= status < 500, f"{status} {data[:80]!r}")
    request = {"prompt": f"a {('red', 'blue', 'green')[index % 3]} circle moving left", "seed": index,
               "num_frames": args.num_frames}
    if args.steps is not None:  # None: the model's own (a distilled causal model's fixed steps)
        request["num_inference_steps"] = args.steps
    start = time.monotonic()
    if kind == "upload":  # multipart/form-data, as the openai SDK sends it; with an image when the model takes one
        files = {"input_reference": ("start.png", upload_png(index), "image/png")} if args.upload_image else {}
        body, content_type = multipart({k: str(v) for k, v in request.items()}, files)
        status, _, data = client.submit(body, deadline, content_type)
    else:
        status, _, data = client.submit(json.dumps(request).encode(), deadline)
    if status != 200:
        return Outcome(kind, False, f"submit: {status} {data[:120]!r}")
    job_id = json.loads(data)["id"]
    if kind == "cancel":
        time.sleep(0.05 * (index % 4))  # some while queued, some while running
        status, _, data = client.request("DELETE", f"/v1/videos/{job_id}")
        if status == 200 and json.loads(data).get("deleted") is True:  # it finished first, and the DELETE removed it
            return Outcome(kind, True, "deleted", None, status="completed")
        job = client.wait(job_id, deadline)
        return Outcome(kind, job["status"] in ("cancelled", "completed"), job["status"], job_id, status=job["status"])
    job = client.wait(job_id, deadline)
    latency = time.monotonic() - start
    if job["status"] != "completed":
        return Outcome(kind, False, f"ended {job['status']}: {job.get('error')}", job_id, status=job["status"])
    status, headers, video = client.request("GET", f"/v1/videos/{job_id}/content")
    if status != 200 or headers.get("content-type") != "video/mp4":
        return Outcome(kind, False, f"content: {status}", job_id, status="completed")
    path = frames_dir / f"{job_id}.mp4"
    path.write_bytes(video)
    frames = read_frames(path)
    path.unlink()
    good = frames.shape[0] == args.num_frames and frames.ndim == 4 and frames.std() > 0
    return Outcome(kind, good, f"frames {frames.shape}", job_id, latency, "completed")


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


@dataclass
class Running:
    """A server in a thread: its uvicorn Server, the thread, a client and its output folder."""

    server: Any
    thread: threading.Thread
    client: Client
    tmp: tempfile.TemporaryDirectory


def start_server(load, args, max_concurrent: int | None = None, max_frames: int | None = None) -> Running:
    import uvicorn

    from composer.serve.app import ServeConfig, create_app
    from composer.serve.requests import ServerLimits

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = tempfile.TemporaryDirectory(prefix="composer-soak-")
    config = ServeConfig(output_dir=Path(tmp.name) / "serve", max_queue=args.max_queue,
                         max_concurrent=max_concurrent if max_concurrent is not None else args.max_concurrent)
    if max_frames is not None:
        config.limits = ServerLimits(max_frames=max_frames)
    app = create_app(load, config)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    client = Client(port, args.timeout)
    start = time.monotonic()
    while not server.started or client.request("GET", "/health")[0] != 200:
        if time.monotonic() - start > 120:
            raise RuntimeError("the server did not become ready in 120 s")
        time.sleep(0.1)
    if args.stall_timeout is not None:
        app.state.streams.stall_timeout = args.stall_timeout
    return Running(server, thread, client, tmp)


def stop_server(running: Running) -> None:
    running.server.should_exit = True
    running.thread.join(timeout=30)
    running.tmp.cleanup()


def final_check(running: Running | Client, outcomes: list[Outcome]) -> tuple[bool, list[str]]:
    """(healthy, the accepted jobs not in a final state when asked by id: behind a proxy each replica lists only
    its own)."""
    client = running if isinstance(running, Client) else running.client
    alive = isinstance(running, Client) or running.thread.is_alive()
    healthy = alive and client.request("GET", "/health")[0] == 200

    def final(job_id: str) -> bool:
        status, _, data = client.request("GET", f"/v1/videos/{job_id}")
        return status == 200 and json.loads(data).get("status") in ("completed", "failed", "cancelled")

    return healthy, [o.job_id for o in outcomes if o.job_id and not final(o.job_id)]


# -- live streams ----------------------------------------------------------------------------------------------

STALLED = "stalled"  # the prompt prefix of the stream whose client reads nothing


class NoisyStalledFrames:
    """The served generator; a stream whose prompt starts with STALLED is made by the model as any other, but
    each chunk's frames are swapped for random `size` x `size` noise (big JPEGs: its client's socket fills in a
    few chunks)."""

    def __init__(self, generator: Any, size: int):
        self._generator = generator
        self.size = size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._generator, name)

    def stream_video(self, prompts, **kwargs):
        stream = self._generator.stream_video(prompts, **kwargs)
        if not str(getattr(prompts, "prompt", "")).startswith(STALLED):
            return stream
        return _Noise(stream, self.size)


class _Noise:
    def __init__(self, stream: Any, size: int):
        self._stream = stream
        self._size = size

    @property
    def stats(self) -> Any:
        return getattr(self._stream, "stats", None)

    def __iter__(self):
        import numpy as np

        rng = np.random.default_rng(0)
        for chunk in self._stream:
            frames = rng.integers(0, 256, (len(chunk.frames), self._size, self._size, 3), dtype=np.uint8)
            yield SimpleNamespace(frames=frames, block_index=chunk.block_index, start_frame=chunk.start_frame,
                                  prompt=chunk.prompt)

    def close(self) -> None:
        self._stream.close()


@dataclass
class StreamResult:
    ok: bool
    detail: str = ""
    job_id: str | None = None
    fps: float | None = None  # frames received per second, from the first chunk to the last
    server_fps: float | None = None  # the last chunk's `fps` (the rate the server says the stream reached)


def watch_stream(client: Client, index: int, args, frames_dir: Path) -> StreamResult:
    """One stream read to its end: every chunk in order with its JPEGs, `done`, and the saved video."""
    import io

    import PIL.Image
    from websockets.sync.client import connect

    from composer.video import read_frames

    request = {"prompt": f"a {('red circle', 'blue square', 'green triangle')[index % 3]} moving "
                         f"{('left', 'right', 'up', 'down')[index % 4]}", "seed": index, "num_blocks": args.stream_blocks}
    job_id, chunks, frames, times, server_fps, size, event = None, [], 0, [], None, None, {}
    try:
        with connect(client.ws_url("/v1/streams"), additional_headers=client.auth, open_timeout=60,
                     close_timeout=10) as ws:
            ws.send(json.dumps(request))
            expected = 0
            for message in ws:
                if isinstance(message, bytes):
                    image = PIL.Image.open(io.BytesIO(message))
                    if expected <= 0 or image.size != size:
                        return StreamResult(False, f"a frame outside a chunk or of size {image.size}", job_id)
                    expected -= 1
                    frames += 1
                    if expected == 0:
                        times.append((time.perf_counter(), frames))
                    continue
                event = json.loads(message)
                if event["type"] == "started":
                    job_id, size = event["id"], (event["width"], event["height"])
                elif event["type"] == "chunk":
                    if event["index"] != len(chunks) or expected:
                        return StreamResult(False, f"chunk {event['index']} out of order", job_id)
                    chunks.append(event)
                    expected = event["frames"]
                    server_fps = event.get("fps")
                elif event["type"] == "done":
                    break
                elif event["type"] == "error":
                    return StreamResult(False, f"error: {event['error']['message']}", job_id)
    except Exception as exc:  # noqa: BLE001 - reported as a failed check
        return StreamResult(False, f"{type(exc).__name__}: {exc}", job_id)
    if len(chunks) != args.stream_blocks or event["frames"] != frames:
        return StreamResult(False, f"{len(chunks)} chunks, {frames} frames; done says {event.get('frames')}", job_id)
    status, _, video = client.request("GET", f"/v1/videos/{job_id}/content")
    path = frames_dir / f"{job_id}.mp4"
    path.write_bytes(video)
    saved = read_frames(path).shape[0] if status == 200 else 0
    path.unlink()
    if saved != frames:
        return StreamResult(False, f"the saved video has {saved} frames of {frames}", job_id)
    (t0, f0), (t1, f1) = times[0], times[-1]  # from the first chunk's last frame: the stream's pace, not its start
    fps = (f1 - f0) / (t1 - t0) if t1 > t0 else None
    return StreamResult(True, "", job_id, fps, server_fps)


def job_progress(client: Client, job_id: str) -> float:
    return json.loads(client.request("GET", f"/v1/videos/{job_id}")[2])["progress_fraction"]


def start_stalled(client: Client, args, stack: ExitStack) -> tuple[str, float, float]:
    """A stream whose client reads nothing after its first message (its connection closes with `stack`);
    returns (its id, its progress once it paused, the seconds it took to pause)."""
    from websockets.sync.client import connect

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
    sock.connect(("127.0.0.1", client.port))
    ws = stack.enter_context(connect(f"ws://127.0.0.1:{client.port}/v1/streams", sock=sock, max_queue=1,
                                     open_timeout=60, close_timeout=1))
    ws.send(json.dumps({"prompt": f"{STALLED}: a red circle moving left", "seed": 99,
                        "num_blocks": args.stall_blocks}))
    started = json.loads(ws.recv(timeout=120))
    assert started["type"] == "started", started
    job_id, began = started["id"], time.monotonic()
    last, since = -1.0, time.monotonic()
    while True:  # paused: no progress for a second, its two chunks buffered
        progress = job_progress(client, job_id)
        if progress != last:
            last, since = progress, time.monotonic()
        metrics = client.request("GET", "/metrics")[2].decode()
        buffered = next(float(line.split()[1]) for line in metrics.splitlines()
                        if line.startswith("composer_stream_buffered_chunks "))
        if time.monotonic() - since > 1.0 and buffered >= 2:
            return job_id, progress, time.monotonic() - began
        if time.monotonic() - began > 120:
            raise RuntimeError("the stalled stream never paused")
        time.sleep(0.1)


def settling(generator: Any) -> tuple[float, int]:
    """(seconds ready transformer calls were held for requests outside a loop, calls) over the schedulers."""
    stats = [e.scheduler.stats for e in generator.pipeline.engines if e.scheduler is not None]
    return sum(s.settle_seconds for s in stats), sum(s.calls for s in stats)


def stream_round(load, args, stalled: bool, frames_dir: Path, slots: int, generator: Any) -> dict:
    """One round on a fresh server: the streams and the jobs at once (and first, the stalled stream)."""
    running = start_server(load, args, slots, max_frames=100_000)  # the stalled stream's blocks
    client = running.client
    result: dict = {"stalled": None, "checks": []}
    stack = ExitStack()  # the stalled client's connection
    try:
        if stalled:
            stalled_id, paused_at, pause_s = start_stalled(client, args, stack)
        deadline = time.monotonic() + args.timeout
        began = time.monotonic()
        settled_before = settling(generator)
        with ThreadPoolExecutor(args.streams + args.clients) as pool:
            streams = [pool.submit(watch_stream, client, i, args, frames_dir) for i in range(args.streams)]
            per_client = [list(range(c, args.requests, args.clients)) for c in range(args.clients)]
            jobs = [pool.submit(lambda ids: [run_one(client, i, "video", args, deadline, frames_dir) for i in ids],
                                ids) for ids in per_client]
            result["streams"] = [f.result() for f in streams]
            result["jobs"] = [o for f in jobs for o in f.result()]
        result["wall"] = time.monotonic() - began
        settled = settling(generator)
        result["settle_s"], result["calls"] = settled[0] - settled_before[0], settled[1] - settled_before[1]
        if stalled:
            now = job_progress(client, stalled_id)
            status = json.loads(client.request("GET", f"/v1/videos/{stalled_id}")[2])["status"]
            result["stalled"] = {"blocks": round(paused_at * args.stall_blocks), "moved": now - paused_at,
                                 "status_while": status, "pause_s": pause_s}
            if now != paused_at:
                result["checks"].append(f"the stalled stream moved from {paused_at} to {now} while it stalled")
            stack.close()  # the client leaves while its stream waits for it: failed as stalled (or cancelled if it
            # had caught up)
            end = client.wait(stalled_id, time.monotonic() + 60)["status"]
            result["stalled"]["end"] = end
            if end not in ("cancelled", "failed"):
                result["checks"].append(f"the stalled stream ended {end}")
        outcomes = [Outcome("stream", r.ok, r.detail, r.job_id) for r in result["streams"]] + result["jobs"]
        if stalled:
            outcomes.append(Outcome("stream", True, "", stalled_id))
        result["healthy"], result["lost"] = final_check(running, outcomes)
        result["failures"] = [o for o in outcomes if not o.ok]
        return result
    finally:
        stack.close()
        stop_server(running)


def stream_soak(args) -> int:
    from composer import VideoGenerator

    generator = VideoGenerator.from_pretrained(args.model_path or "shapes-causal", progress=False)
    if not getattr(generator.pipeline, "can_stream", False):
        print(f"{generator.family} cannot stream: --streams needs a causal model")
        return 1
    fixed = getattr(generator.pipeline.stage("CausalDenoisingStage"), "steps", None)
    if args.park_grace is not None:  # inf: a stalled stream is never parked (composer before parking)
        generator.pipeline.gate.park_grace_s = args.park_grace
    args.steps = None if fixed is not None else args.steps  # a distilled model runs its own steps
    load = (lambda: NoisyStalledFrames(generator, args.stall_frame_size)) if args.stalled else (lambda: generator)
    for _ in generator.stream_video("warm up", num_frames=5, keep_video=False):  # first calls' costs out of round 1
        pass
    generator.generate_video("warm up", num_frames=5)
    slots = args.max_concurrent or args.streams + args.clients + int(args.stalled)
    frames_dir = Path(tempfile.mkdtemp(prefix="composer-soak-frames-"))
    rounds = []
    try:
        for r in range(args.rounds):
            for stalled in ((False, True) if args.stalled else (False,)):
                rounds.append((stalled, stream_round(load, args, stalled, frames_dir, slots, generator)))
                print(f"round {r + 1} {'with' if stalled else 'without'} the stalled client: "
                      f"{summary(rounds[-1][1])}", flush=True)
    finally:
        shutil.rmtree(frames_dir, ignore_errors=True)

    print(f"{args.streams} streams at once ({args.stream_blocks} blocks each, every chunk read and decoded) and "
          f"{args.requests} jobs from {args.clients} clients ({args.num_frames} frames) per round, {args.rounds} "
          f"round(s), {slots} slots, on {generator.family}")
    if args.stalled:
        print(f"stalled client: one more stream of {args.stall_blocks} blocks that reads nothing (its frames "
              f"{args.stall_frame_size}x{args.stall_frame_size} noise), started before the others")
    for stalled in ((False, True) if args.stalled else (False,)):
        mine = [res for s, res in rounds if s == stalled]
        fps = [x.fps for res in mine for x in res["streams"] if x.fps]
        server_fps = [x.server_fps for res in mine for x in res["streams"] if x.server_fps]
        latency = [o.latency for res in mine for o in res["jobs"] if o.latency is not None]
        settle, calls = sum(res["settle_s"] for res in mine), sum(res["calls"] for res in mine)
        label = "with the stalled client:   " if stalled else "without the stalled client:"
        print(f"{label} streams {median(fps):.2f} fps received (median of {len(fps)}; server's "
              f"{median(server_fps):.2f}), jobs latency p50 {median(latency):.2f} s, max {max(latency, default=0):.2f} "
              f"s ({len(latency)} jobs); calls held for requests outside a loop: {settle:.2f} s over {calls} calls")
        if stalled:
            st = [res["stalled"] for res in mine]
            blocks = ", ".join(str(x["blocks"]) for x in st)
            pauses = ", ".join(f"{x['pause_s']:.1f}" for x in st)
            print(f"the stalled stream paused after {blocks} block(s) (in {pauses} s), moved "
                  f"{sum(x['moved'] != 0 for x in st)} time(s) while the others ran, ended "
                  f"{', '.join(x['end'] for x in st)}")
    if args.stalled:
        def collect(stalled, pick):
            return [v for s, res in rounds if s == stalled for v in pick(res)]
        fps_ratio = (median(collect(True, lambda r: [x.fps for x in r["streams"] if x.fps]))
                     / median(collect(False, lambda r: [x.fps for x in r["streams"] if x.fps])))
        lat_ratio = (median(collect(True, lambda r: [o.latency for o in r["jobs"] if o.latency]))
                     / median(collect(False, lambda r: [o.latency for o in r["jobs"] if o.latency])))
        print(f"with / without the stalled client: streams' fps {fps_ratio:.2f}x, jobs' latency {lat_ratio:.2f}x")
    healthy = all(res["healthy"] for _, res in rounds)
    lost = sum(len(res["lost"]) for _, res in rounds)
    failures = [f for _, res in rounds for f in res["failures"]] + [
        Outcome("check", False, c) for _, res in rounds for c in res["checks"]]
    print(f"server crashes: {sum(not res['healthy'] for _, res in rounds)}; lost jobs: {lost}; failed checks: "
          f"{len(failures)}")
    for o in failures[:10]:
        print(f"  failed: {o.kind} {o.job_id or ''} {o.detail}")
    return 0 if healthy and not lost and not failures else 1


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summary(res: dict) -> str:
    fps = [x.fps for x in res["streams"] if x.fps]
    latency = [o.latency for o in res["jobs"] if o.latency is not None]
    return (f"{sum(x.ok for x in res['streams'])}/{len(res['streams'])} streams ok at {median(fps):.2f} fps, "
            f"{len(latency)}/{len(res['jobs'])} jobs completed, p50 {median(latency):.2f} s, {res['wall']:.1f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="default: the embedded shapes model")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--malformed", type=int, default=10)
    parser.add_argument("--cancel", type=int, default=10)
    parser.add_argument("--uploads", type=int, default=20, help="requests sent as multipart/form-data (as the openai "
                        "SDK sends them), with --upload-image an input_reference image each")
    parser.add_argument("--upload-image", action="store_true", help="attach a start image to each --uploads request "
                        "(for a model that takes one: a causal or image-to-video model)")
    parser.add_argument("--bad-uploads", type=int, default=6, help="multipart requests with a broken image: each must "
                        "get a 4xx")
    parser.add_argument("--steps", type=int, default=2, help="denoising steps per job (0: the model's own, e.g. a "
                        "distilled causal model's)")
    parser.add_argument("--base-url", default=None, help="soak the server running there (http://HOST:PORT, e.g. "
                        "nginx in front of several replicas) instead of starting one; the jobs soak only")
    parser.add_argument("--api-key", default=os.environ.get("COMPOSER_API_KEY"), help="the server's API key "
                        "(default: $COMPOSER_API_KEY)")
    parser.add_argument("--num-frames", type=int, default=5)
    parser.add_argument("--max-queue", type=int, default=16)
    parser.add_argument("--max-concurrent", type=int, default=None, help="jobs at once (default: the server's)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for the whole soak (per round with "
                        "--streams)")
    parser.add_argument("--streams", type=int, default=0, help="live streams at once (default 0: the jobs soak); "
                        "the model defaults to shapes-causal")
    parser.add_argument("--stream-blocks", type=int, default=24, help="blocks of each stream")
    parser.add_argument("--stalled", action="store_true", help="add a stream whose client reads nothing, and "
                        "compare each round with and without it")
    parser.add_argument("--stall-blocks", type=int, default=400, help="blocks the stalled stream asks for")
    parser.add_argument("--stall-frame-size", type=int, default=256, help="the stalled stream's noise frames")
    parser.add_argument("--stall-timeout", type=float, default=None, help="the server's stall timeout (default: "
                        "its own, 60 s)")
    parser.add_argument("--rounds", type=int, default=1, help="--streams rounds (each with and without --stalled)")
    parser.add_argument("--park-grace", type=float, default=None, help="seconds before a stream whose reader holds "
                        "its chunk stops being waited for (default: the gate's, 0.05; inf: never, as before parking)")
    args = parser.parse_args()
    os.environ.setdefault("COMPOSER_LOG_LEVEL", "WARNING")
    if args.streams:  # jobs beside the streams are all well-formed and run to the end
        if args.base_url:
            parser.error("--streams runs its own servers (a fresh one per round): --base-url is for the jobs soak")
        return stream_soak(args)
    if args.malformed + args.cancel > args.requests:
        parser.error("--malformed + --cancel must not exceed --requests")
    if args.steps == 0:
        args.steps = None

    from composer import VideoGenerator

    if args.base_url:
        try:
            client = Client.of_url(args.base_url, args.timeout, args.api_key)
        except ValueError as exc:
            parser.error(str(exc))
        running, tmp = client, tempfile.TemporaryDirectory(prefix="composer-soak-")
        try:
            healthy = client.request("GET", "/health")[0] == 200
        except OSError as exc:
            healthy = False
            print(f"{args.base_url}: {exc}")
        if not healthy:
            print(f"{args.base_url}/health does not answer 200: is the server (or a replica behind it) ready?")
            return 1
    else:
        try:
            running = start_server(lambda: VideoGenerator.from_pretrained(args.model_path, progress=False), args)
        except RuntimeError as exc:
            print(exc)
            return 1
        client, tmp = running.client, running.tmp

    # spread the malformed and cancelled requests over the run
    kinds = ["video"] * args.requests
    for k, (count, offset) in {"malformed": (args.malformed, 1), "cancel": (args.cancel, 3),
                               "bad-upload": (args.bad_uploads, 5), "upload": (args.uploads, 2)}.items():
        count = min(count, kinds.count("video"))  # never more than the plain requests left (a short soak)
        step = max(1, args.requests // max(1, count))
        for n in range(count):  # every `step`-th request from `offset` on, or the next plain one after it
            j = (offset + n * step) % args.requests
            while kinds[j] != "video":
                j = (j + 1) % args.requests
            kinds[j] = k
    deadline = time.monotonic() + args.timeout
    frames_dir = Path(tmp.name) / "fetched"
    frames_dir.mkdir()
    began = time.monotonic()
    with ThreadPoolExecutor(args.clients) as pool:
        outcomes = list(pool.map(lambda ik: run_one(client, ik[0], ik[1], args, deadline, frames_dir),
                                 enumerate(kinds)))
    wall = time.monotonic() - began

    failures = [o for o in outcomes if not o.ok]
    healthy, lost = final_check(running, outcomes)
    if isinstance(running, Client):
        tmp.cleanup()
    else:
        stop_server(running)

    latencies = [o.latency for o in outcomes if o.latency is not None]
    completed = len(latencies)
    by_kind = {k: sum(o.kind == k for o in outcomes) for k in ("video", "malformed", "cancel", "upload", "bad-upload")}
    cancelled = sum(o.status == "cancelled" for o in outcomes if o.kind == "cancel")
    steps = f"{args.steps} steps" if args.steps else "the model's own steps"
    queue = "" if args.base_url else f"; queue {args.max_queue}"
    print(f"{args.requests} requests from {args.clients} clients ({by_kind['video']} videos, {by_kind['upload']} "
          f"multipart{' with an image' if args.upload_image else ''}, {by_kind['malformed']} malformed, "
          f"{by_kind['bad-upload']} broken uploads, {by_kind['cancel']} cancelled) on {args.base_url or 'the shapes model'} at {steps}, "
          f"{args.num_frames} frames{queue}")
    print(f"completed and fetched: {completed}; malformed refused with a 4xx: "
          f"{sum(o.ok for o in outcomes if o.kind in ('malformed', 'bad-upload'))}; cancel requests: {cancelled} cancelled, "
          f"{by_kind['cancel'] - cancelled} finished first; 429 retries: {client.retries_429[0]}"
          + (f"; 503 retries: {client.retries_503[0]}" if client.retries_503[0] else ""))
    if latencies:
        print(f"latency submit -> completed: p50 {percentile(latencies, 0.5):.2f} s, p90 {percentile(latencies, 0.9):.2f} "
              f"s, p99 {percentile(latencies, 0.99):.2f} s, max {max(latencies):.2f} s; mean "
              f"{statistics.mean(latencies):.2f} s")
    print(f"throughput: {completed / wall:.2f} videos/s over {wall:.1f} s")
    print(f"server crashes: {0 if healthy else 1}; lost jobs: {len(lost)}; failed checks: {len(failures)}")
    for o in failures[:10]:
        print(f"  failed: {o.kind} {o.job_id or ''} {o.detail}")
    return 0 if healthy and not lost and not failures else 1


if __name__ == "__main__":
    sys.exit(main())
