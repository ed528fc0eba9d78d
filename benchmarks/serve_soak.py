"""Soak `composer serve`: many requests from concurrent clients, some malformed, some cancelled, against a real
server on 127.0.0.1 (uvicorn in a thread, the embedded shapes model by default), bounded in time.

Every well-formed request is submitted (retrying after 429 as `Retry-After` says), polled to the end, and its
video fetched and decoded: the mp4 must hold the requested number of frames at the requested size. Malformed
requests must get a 4xx. Cancelled ones must end `cancelled` (or `completed` when the job finished first). At the
end the server must still be healthy and list every accepted job in a final state: 0 crashes, 0 lost jobs.
Prints the outcome counts, the latency percentiles (submit to completed) and the throughput; exits 1 on any
failed check.

    python benchmarks/serve_soak.py                               # 200 requests, 8 clients, 10 malformed, 10 cancelled
    python benchmarks/serve_soak.py --requests 40 --clients 4 --steps 1 --timeout 120
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

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

    def request(self, method: str, path: str, data: bytes | None = None) -> tuple[int, dict, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def submit(self, body: bytes, deadline: float) -> tuple[int, dict, bytes]:
        while True:
            status, headers, data = self.request("POST", "/v1/videos", body)
            if status != 429 or time.monotonic() > deadline:
                return status, headers, data
            self.retries_429[0] += 1
            time.sleep(min(float(headers.get("retry-after", "1")), 2.0) * 0.25)

    def wait(self, job_id: str, deadline: float) -> dict:
        while True:
            status, _, data = self.request("GET", f"/v1/videos/{job_id}")
            job = json.loads(data) if status == 200 else {"status": f"http {status}"}
            if job.get("status") in ("completed", "failed", "cancelled") or time.monotonic() > deadline:
                return job
            time.sleep(0.05)


def run_one(client: Client, index: int, kind: str, args, deadline: float, frames_dir: Path) -> Outcome:
    from composer.video import read_frames

    if kind == "malformed":
        body = MALFORMED[index % len(MALFORMED)]
        status, _, data = client.submit(body, deadline)
        return Outcome(kind, 400 <= status < 500, f"{status} {data[:80]!r}")
    request = {"prompt": f"a {('red', 'blue', 'green')[index % 3]} circle moving left", "seed": index,
               "num_inference_steps": args.steps, "num_frames": args.num_frames}
    start = time.monotonic()
    status, _, data = client.submit(json.dumps(request).encode(), deadline)
    if status != 200:
        return Outcome(kind, False, f"submit: {status} {data[:120]!r}")
    job_id = json.loads(data)["id"]
    if kind == "cancel":
        time.sleep(0.05 * (index % 4))  # some while queued, some while running
        client.request("DELETE", f"/v1/videos/{job_id}")
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="default: the embedded shapes model")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--malformed", type=int, default=10)
    parser.add_argument("--cancel", type=int, default=10)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--num-frames", type=int, default=5)
    parser.add_argument("--max-queue", type=int, default=16)
    parser.add_argument("--max-concurrent", type=int, default=None, help="jobs at once (default: the server's)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for the whole soak")
    args = parser.parse_args()
    if args.malformed + args.cancel > args.requests:
        parser.error("--malformed + --cancel must not exceed --requests")
    os.environ.setdefault("COMPOSER_LOG_LEVEL", "WARNING")

    import uvicorn

    from composer import VideoGenerator
    from composer.serve.app import ServeConfig, create_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = tempfile.TemporaryDirectory(prefix="composer-soak-")
    config = ServeConfig(output_dir=Path(tmp.name) / "serve", max_queue=args.max_queue,
                         max_concurrent=args.max_concurrent)
    app = create_app(lambda: VideoGenerator.from_pretrained(args.model_path, progress=False), config)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    client = Client(port, args.timeout)
    start = time.monotonic()
    while not server.started or client.request("GET", "/health")[0] != 200:
        if time.monotonic() - start > 120:
            print("the server did not become ready in 120 s")
            return 1
        time.sleep(0.1)

    # spread the malformed and cancelled requests over the run
    kinds = ["video"] * args.requests
    for k, (count, offset) in {"malformed": (args.malformed, 1), "cancel": (args.cancel, 3)}.items():
        step = max(1, args.requests // max(1, count))
        placed = 0
        for i in range(offset, args.requests, step):
            if placed == count:
                break
            while kinds[i % args.requests] != "video":
                i += 1
            kinds[i % args.requests] = k
            placed += 1
    deadline = time.monotonic() + args.timeout
    frames_dir = Path(tmp.name) / "fetched"
    frames_dir.mkdir()
    began = time.monotonic()
    with ThreadPoolExecutor(args.clients) as pool:
        outcomes = list(pool.map(lambda ik: run_one(client, ik[0], ik[1], args, deadline, frames_dir),
                                 enumerate(kinds)))
    wall = time.monotonic() - began

    failures = [o for o in outcomes if not o.ok]
    healthy = thread.is_alive() and client.request("GET", "/health")[0] == 200
    listed = {job["id"]: job["status"] for job in json.loads(client.request("GET", "/v1/videos")[2])["data"]}
    accepted = [o.job_id for o in outcomes if o.job_id]
    lost = [j for j in accepted if listed.get(j) not in ("completed", "failed", "cancelled")]
    server.should_exit = True
    thread.join(timeout=30)
    tmp.cleanup()

    latencies = [o.latency for o in outcomes if o.latency is not None]
    completed = len(latencies)
    by_kind = {k: sum(o.kind == k for o in outcomes) for k in ("video", "malformed", "cancel")}
    cancelled = sum(o.status == "cancelled" for o in outcomes if o.kind == "cancel")
    print(f"{args.requests} requests from {args.clients} clients ({by_kind['video']} videos, {by_kind['malformed']} "
          f"malformed, {by_kind['cancel']} cancelled) on the shapes model at {args.steps} steps, {args.num_frames} "
          f"frames; queue {args.max_queue}")
    print(f"completed and fetched: {completed}; malformed refused with a 4xx: "
          f"{sum(o.ok for o in outcomes if o.kind == 'malformed')}; cancel requests: {cancelled} cancelled, "
          f"{by_kind['cancel'] - cancelled} finished first; 429 retries: {client.retries_429[0]}")
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
