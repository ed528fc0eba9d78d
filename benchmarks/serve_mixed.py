"""One `composer serve` with two models, a causal video model and a diffusion language model, under mixed traffic:
N text requests and M live streams at once, in two priority classes, against the same requests one after another.

The server is the real app (`create_app(load, config, text_load=...)`, what `composer serve --model-path VIDEO
--text-model-path TEXT` builds) on uvicorn in a thread on 127.0.0.1, over the embedded shapes-causal and tiny-dllm
by default. Text requests go to POST /v1/completions through the official `openai` SDK when it is installed (else
http.client), each with `priority` in its body; streams are WebSockets on /v1/streams (the `websockets` sync
client), each with `priority` in its first message, every chunk's JPEGs read. Half of each kind (the even-numbered
ones) run at priority 1, the rest at 0.

Printed: each request's figures (text: seconds to the answer; a stream: seconds to its first chunk, its frames and
frames per second from its request to its last chunk), the aggregate (wall time, frames per second over all
streams, text requests per second), each priority class's medians; first for the requests one after another (the
baseline: one text request, then one stream, ...), then for all of them at once, then the ratio. One warm-up text
request and one warm-up stream run before anything is timed.

    python benchmarks/serve_mixed.py                       # 4 text requests and 4 streams of 8 blocks, CPU
    python benchmarks/serve_mixed.py --texts 8 --streams 8 --blocks 16 --json mixed.json
    python benchmarks/serve_mixed.py --device cuda --video-model shapes-causal --text-model tiny-dllm

Figures in docs/serving.md ("One server, two models").
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

STREAM_PROMPTS = ["a red circle moving left", "a blue square moving right", "a green triangle moving up",
                  "a yellow circle moving down", "a red square moving up", "a blue triangle moving left",
                  "a green circle moving right", "a yellow square moving down"]


@dataclass
class Result:
    kind: str  # "text" or "stream"
    index: int
    priority: int
    seconds: float  # text: to the answer; stream: to its last chunk
    first_chunk: float | None = None  # stream: seconds to its first chunk
    frames: int = 0
    fps: float | None = None  # stream: frames / seconds
    ok: bool = True
    note: str = ""


class Served:
    """The two-model app on uvicorn in a thread, on a free port of 127.0.0.1."""

    def __init__(self, video: Any, text: Any, max_concurrent: int | None, output_dir: Path):
        import uvicorn

        from composer.serve.app import ServeConfig, create_app

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = ServeConfig(output_dir=output_dir, max_concurrent=max_concurrent, max_queue=64)
        self.app = create_app(lambda: video, config, text_load=lambda: text)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started or self.get("/ready")[0] != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not become ready in 120 s")
            time.sleep(0.05)

    def get(self, path: str) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request("GET", path)
            reply = conn.getresponse()
            return reply.status, reply.read()
        except OSError:
            return 0, b""
        finally:
            conn.close()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def text_client(port: int, use_sdk: bool):
    """A function (prompt, priority, seed) -> the answer's text: the openai SDK's completions, or http.client."""
    if use_sdk:
        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                               timeout=300)

        def ask(prompt: str, priority: int, seed: int) -> str:
            reply = client.completions.create(model="tiny-dllm", prompt=prompt, seed=seed,
                                              extra_body={"priority": priority})
            return reply.choices[0].text

        return ask

    def ask_http(prompt: str, priority: int, seed: int) -> str:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        try:
            body = {"prompt": prompt, "seed": seed, "priority": priority}
            conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type":
                                                                                    "application/json"})
            reply = conn.getresponse()
            data = json.loads(reply.read())
            if reply.status != 200:
                raise RuntimeError(f"{reply.status}: {data}")
            return data["choices"][0]["text"]
        finally:
            conn.close()

    return ask_http


def run_text(ask, index: int, priority: int) -> Result:
    """A sum for tiny-dllm (its template writes "123+456=" as its digits); the note says whether it was right."""
    a, b = (100 + 37 * index) % 1000, (200 + 53 * index) % 1000
    start = time.perf_counter()
    try:
        text = ask(f"{a}+{b}=", priority, index)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return Result("text", index, priority, time.perf_counter() - start, ok=False, note=str(exc)[:80])
    right = "right" if text.replace(" ", "").strip() == str(a + b) else "wrong"
    return Result("text", index, priority, time.perf_counter() - start, note=f"{a}+{b}= {text.strip()!r} ({right})")


def run_stream(port: int, index: int, priority: int, blocks: int, seed: int) -> Result:
    from websockets.sync.client import connect

    prompt = STREAM_PROMPTS[index % len(STREAM_PROMPTS)]
    start = time.perf_counter()
    first = last = None
    frames = 0
    try:
        with connect(f"ws://127.0.0.1:{port}/v1/streams", open_timeout=60, max_size=None) as ws:
            ws.send(json.dumps({"prompt": prompt, "num_blocks": blocks, "priority": priority,
                                "guidance_scale": 1.0, "seed": seed + index}))
            while True:
                data = ws.recv(timeout=300)
                if isinstance(data, bytes):  # a chunk's frame (JPEG)
                    frames += 1
                    last = time.perf_counter()
                    if first is None:
                        first = last - start
                    continue
                message = json.loads(data)
                if message["type"] == "error":
                    raise RuntimeError(message.get("message"))
                if message["type"] == "done":
                    break
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return Result("stream", index, priority, time.perf_counter() - start, first, frames, ok=False,
                      note=str(exc)[:80])
    seconds = (last or time.perf_counter()) - start
    return Result("stream", index, priority, seconds, first, frames, frames / seconds if seconds > 0 else None)


def jobs(texts: int, streams: int) -> list[tuple[str, int, int]]:
    """(kind, index, priority), interleaved text, stream, text, ...: the even-numbered of each kind at priority 1."""
    out = []
    for i in range(max(texts, streams)):
        if i < texts:
            out.append(("text", i, 1 if i % 2 == 0 else 0))
        if i < streams:
            out.append(("stream", i, 1 if i % 2 == 0 else 0))
    return out


def run_all(port: int, ask, plan: list[tuple[str, int, int]], blocks: int, seed: int,
            at_once: bool) -> tuple[list[Result], float]:
    def one(kind: str, index: int, priority: int) -> Result:
        if kind == "text":
            return run_text(ask, index, priority)
        return run_stream(port, index, priority, blocks, seed)

    start = time.perf_counter()
    if not at_once:
        results = [one(*job) for job in plan]
        return results, time.perf_counter() - start
    results: list[Result | None] = [None] * len(plan)
    barrier = threading.Barrier(len(plan))

    def worker(slot: int) -> None:
        barrier.wait()
        results[slot] = one(*plan[slot])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(plan))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in results if r is not None], time.perf_counter() - start


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def summary(results: list[Result], wall: float) -> dict[str, Any]:
    streams = [r for r in results if r.kind == "stream"]
    texts = [r for r in results if r.kind == "text"]
    classes = {}
    for priority in sorted({r.priority for r in results}, reverse=True):
        t = [r.seconds for r in texts if r.priority == priority and r.ok]
        s = [r for r in streams if r.priority == priority and r.ok]
        classes[priority] = {"text_seconds_median": median(t),
                             "stream_first_chunk_median": median([r.first_chunk for r in s if r.first_chunk]),
                             "stream_fps_median": median([r.fps for r in s if r.fps])}
    return {"wall_seconds": wall, "frames": sum(r.frames for r in streams),
            "frames_per_second": sum(r.frames for r in streams) / wall if wall > 0 else None,
            "text_requests_per_second": len(texts) / wall if wall > 0 else None,
            "text_seconds_median": median([r.seconds for r in texts if r.ok]),
            "stream_first_chunk_median": median([r.first_chunk for r in streams if r.first_chunk]),
            "stream_fps_median": median([r.fps for r in streams if r.fps]),
            "failed": sum(not r.ok for r in results), "classes": classes}


def report(title: str, results: list[Result], wall: float) -> dict[str, Any]:
    print(f"\n{title}")
    print(f"  {'request':<10} {'prio':>4} {'seconds':>8} {'1st chunk':>9} {'frames':>6} {'fps':>6}  note")
    for r in sorted(results, key=lambda r: (r.kind, r.index)):
        print(f"  {r.kind + ' ' + str(r.index):<10} {r.priority:>4} {r.seconds:>8.2f} {fmt(r.first_chunk):>9} "
              f"{r.frames if r.kind == 'stream' else '':>6} {fmt(r.fps, '.1f'):>6}  {'' if r.ok else 'FAILED '}"
              f"{r.note}")
    s = summary(results, wall)
    print(f"  aggregate: {s['wall_seconds']:.2f} s wall, {s['frames']} frames, {fmt(s['frames_per_second'], '.1f')} "
          f"frames/s over all streams, {fmt(s['text_requests_per_second'], '.2f')} text requests/s; "
          f"medians: text {fmt(s['text_seconds_median'])} s, first chunk {fmt(s['stream_first_chunk_median'])} s, "
          f"stream {fmt(s['stream_fps_median'], '.1f')} fps")
    for priority, c in s["classes"].items():
        print(f"  priority {priority}: text {fmt(c['text_seconds_median'])} s, first chunk "
              f"{fmt(c['stream_first_chunk_median'])} s, stream {fmt(c['stream_fps_median'], '.1f')} fps (medians)")
    return s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--video-model", default="shapes-causal", help="a causal video model (default: shapes-causal)")
    p.add_argument("--text-model", default=None, help="a diffusion language model (default: the embedded tiny-dllm)")
    p.add_argument("--texts", type=int, default=4, help="text requests (default: 4)")
    p.add_argument("--streams", type=int, default=4, help="live streams (default: 4)")
    p.add_argument("--blocks", type=int, default=8, help="blocks per stream (default: 8)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--max-concurrent", type=int, default=None, help="the server's --max-concurrent (default: its "
                   "own: 4 video jobs / streams, 4 text requests)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--http", action="store_true", help="text requests through http.client even with openai installed")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    try:
        import websockets  # noqa: F401
    except ImportError:
        print("serve_mixed.py needs the serve extra (websockets): pip install 'composer[serve]'", file=sys.stderr)
        return 2
    try:
        import openai  # noqa: F401
        use_sdk = not args.http
    except ImportError:
        use_sdk = False

    from composer import TextGenerator, VideoGenerator

    runtime = {k: v for k, v in (("device", args.device), ("dtype", args.dtype)) if v is not None}
    video = VideoGenerator.from_pretrained(args.video_model, progress=False, **runtime)
    text = TextGenerator.from_pretrained(args.text_model, progress=False, **runtime)
    with tempfile.TemporaryDirectory(prefix="composer-mixed-") as tmp:
        served = Served(video, text, args.max_concurrent, Path(tmp) / "serve")
        try:
            import torch

            ask = text_client(served.port, use_sdk)
            print(f"one server, two models: {video.family} (video) and {text.family} (text) on "
                  f"{next(video.pipeline.transformer.parameters()).device if hasattr(video.pipeline, 'transformer') else 'cpu'}"  # noqa: E501
                  f", torch {torch.__version__} with {torch.get_num_threads()} CPU thread(s); {args.texts} text "
                  f"requests ({'openai SDK' if use_sdk else 'http.client'}) and {args.streams} streams of "
                  f"{args.blocks} blocks, the even-numbered of each at priority 1, the rest at 0")
            run_text(ask, 99, 0)  # warm-up: one of each, untimed
            run_stream(served.port, 99, 0, 2, args.seed)
            plan = jobs(args.texts, args.streams)
            serial, serial_wall = run_all(served.port, ask, plan, args.blocks, args.seed, at_once=False)
            s = report("one after another (the baseline):", serial, serial_wall)
            mixed, mixed_wall = run_all(served.port, ask, plan, args.blocks, args.seed, at_once=True)
            m = report("all at once:", mixed, mixed_wall)
        finally:
            served.stop()
    ratio = (m["frames_per_second"] or 0) / s["frames_per_second"] if s["frames_per_second"] else None
    print(f"\nat once / one after another: wall {m['wall_seconds'] / s['wall_seconds']:.2f}x, aggregate frames/s "
          f"{fmt(ratio)}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"serial": {"summary": s, "results": [asdict(r) for r in serial]},
                                               "at_once": {"summary": m, "results": [asdict(r) for r in mixed]}},
                                              indent=2))
    failed = s["failed"] + m["failed"]
    if failed:
        print(f"{failed} request(s) failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
