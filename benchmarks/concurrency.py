"""Concurrent requests on one generator through the step scheduler, against the same requests run one after another.

For each concurrency level N (default 1, 2, 4, 8) and each kind of traffic:
- t2v: N text-to-video requests (different seeds) on a text-to-video model;
- stream: N causal streams (`stream_video`, different prompts) on a causal model;
the same N requests run first one after another on one worker thread, then at once on N worker threads (a pool
whose threads each ran one request before anything is timed). Reported:
aggregate frames per second of both and their ratio (> 1: concurrency pays), transformer calls of both (a forward
hook counts them), the share of units that shared a call, the requests' latency p50 / p99, and for streams the
per-stream frame rate and the block latency p50 / p99 (a block: time between a stream's chunks). Each concurrent
video is checked against its sequential twin (uint8 <= 1; the script exits 1 otherwise).
For streams, KV memory too: the KV pool's peak while the N streams ran at once, next to the sum of the streams'
`stats.kv_cache_bytes` (what N contiguous caches would hold), and a session forked N - 1 times (pool bytes held,
pages shared) next to N contiguous caches.

    python benchmarks/concurrency.py                               # shapes models, CPU
    python benchmarks/concurrency.py --levels 1,4 --kinds t2v --steps 4
    python benchmarks/concurrency.py --t2v-model mid               # a random mid-size Wan (8 layers, 512 wide)
    python benchmarks/concurrency.py --device cuda --dtype bf16 --t2v-model wan1.3b --kinds t2v --steps 4 \
        --height 480 --width 832 --num-frames 17

Figures in docs/scheduling.md. On a 2-core CPU a tiny model's step is mostly Python and kernel-launch overhead, which
batching shares; a large model on a GPU gains when one request's step does not fill the device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from composer import VideoGenerator  # noqa: E402

PROMPTS = ["a red circle moving left", "a blue square moving right", "a green triangle moving up",
           "a yellow circle moving down", "a red square moving up", "a blue triangle moving left",
           "a green circle moving right", "a yellow square moving down"]


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


class Counter:
    def __init__(self, gen):
        self.calls = 0
        for module in gen.pipeline.denoisers().values():
            module.register_forward_pre_hook(self._hit)

    def _hit(self, module, args):
        self.calls += 1


def scheduler_units(gen) -> tuple[int, int]:
    units = batched = 0
    for engine in gen.pipeline.engines:
        if engine.scheduler is not None:
            units += engine.scheduler.stats.units
            batched += engine.scheduler.stats.batched_units
    return units, batched


def one_t2v(gen, i: int, args) -> dict:
    start = time.perf_counter()
    size = {k: v for k, v in (("height", args.height), ("width", args.width)) if v}
    call = gen.generate_video
    if getattr(args, "api", "threads") == "tasks":  # a task on the request loop; this thread only waits
        call = lambda *a, **k: gen.submit_video(*a, **k).result()  # noqa: E731
    result = call(PROMPTS[i % len(PROMPTS)], seed=i, num_inference_steps=args.steps, num_frames=args.num_frames,
                  **size)
    return {"frames": result.frames, "seconds": time.perf_counter() - start, "blocks": []}


def one_stream(gen, i: int, args) -> dict:
    start = time.perf_counter()
    last, blocks, chunks = start, [], []
    stream = gen.stream_video(PROMPTS[i % len(PROMPTS)], seed=i, num_frames=args.stream_frames)
    if getattr(args, "api", "threads") == "tasks":  # each chunk a task on the request loop; this thread only waits
        def tasks():
            while (chunk := gen.core.submit(stream.next_task(), stream.context).result()) is not None:
                yield chunk

        chunks_of = tasks()
    else:
        chunks_of = iter(stream)
    for chunk in chunks_of:
        now = time.perf_counter()
        blocks.append(now - last)
        last = now
        chunks.append(chunk.frames)
    return {"frames": np.concatenate(chunks), "seconds": time.perf_counter() - start, "blocks": blocks,
            "kv_bytes": stream.stats.kv_cache_bytes}


def kv_pool(gen):
    """The causal model's KV page pool (None for other models)."""
    try:
        return gen.pipeline.stage("CausalDenoisingStage").kv_pool
    except (KeyError, LookupError, AttributeError):
        return None


def fork_memory(gen, n: int) -> dict:
    """A session extended by 2 blocks ('keep' switches keep its cache between extends), then forked n - 1 times:
    the pool's bytes in use and its shared pages, next to n contiguous caches of the session's size."""
    pool = kv_pool(gen)
    before = pool.stats().used_bytes
    session = gen.open_session(seed=0, prompt_switch="keep")
    try:
        list(session.extend(PROMPTS[0], 2))
        one = pool.stats().used_bytes - before
        forks = [session.fork() for _ in range(n - 1)]
        stats = pool.stats()
        for fork in forks:
            fork.close()
    finally:
        session.close()
    return {"n": n, "pool_bytes": stats.used_bytes - before, "contiguous_bytes": n * one,
            "shared_pages": stats.shared_pages}


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def warm_pool(pool: ThreadPoolExecutor, size: int, gen, fn, args) -> None:
    """Start the pool's `size` threads and run one request on each: torch's per-thread state (CPU thread pools, a
    CUDA thread's cuBLAS handle) is made before anything is timed."""
    barrier = threading.Barrier(size)

    def warm(i: int) -> None:
        barrier.wait()
        fn(gen, i, args)

    for future in [pool.submit(warm, i) for i in range(size)]:
        future.result()


def run_level(gen, counter, kind: str, n: int, args, workers: ThreadPoolExecutor) -> dict:
    fn = one_t2v if kind == "t2v" else one_stream
    # Both sides run on the pool's warmed worker threads (as a server's workers would), `args.repeats` times each,
    # interleaved; the figures are the medians (the request counts and the diffs are the last run's).
    seq_times, conc_times = [], []
    units0, batched0 = scheduler_units(gen)
    pool = kv_pool(gen) if kind == "stream" else None
    for _ in range(args.repeats):
        counter.calls = 0
        start = time.perf_counter()
        sequential = workers.submit(lambda: [fn(gen, i, args) for i in range(n)]).result()
        seq_times.append(time.perf_counter() - start)
        seq_calls = counter.calls

        counter.calls = 0
        if pool is not None:
            pool.reset_peak()
        start = time.perf_counter()
        futures = [workers.submit(fn, gen, i, args) for i in range(n)]
        results = {i: f.result() for i, f in enumerate(futures)}
        conc_times.append(time.perf_counter() - start)
        conc_calls = counter.calls
    seq_s, conc_s = statistics.median(seq_times), statistics.median(conc_times)
    units1, batched1 = scheduler_units(gen)
    frames = sum(len(r["frames"]) for r in sequential)
    worst = max(int(np.abs(results[i]["frames"].astype(np.int16) - sequential[i]["frames"].astype(np.int16)).max())
                for i in range(n))
    blocks = [b for r in results.values() for b in r["blocks"][1:]]  # after each stream's first chunk
    return {
        "kind": kind, "n": n, "frames": frames,
        "sequential_s": seq_s, "concurrent_s": conc_s,
        # every repeat's seconds: the medians hide a slow first run or a swing between runs
        "sequential_runs_s": seq_times, "concurrent_runs_s": conc_times,
        "sequential_fps": frames / seq_s, "concurrent_fps": frames / conc_s, "speedup": seq_s / conc_s,
        "sequential_calls": seq_calls, "concurrent_calls": conc_calls,
        "shared_call_share": (batched1 - batched0) / max(units1 - units0, 1),
        "latency_p50_s": percentile([r["seconds"] for r in results.values()], 0.5),
        "latency_p99_s": percentile([r["seconds"] for r in results.values()], 0.99),
        "per_stream_fps": statistics.mean(len(r["frames"]) / r["seconds"] for r in results.values()),
        "block_p50_s": percentile(blocks, 0.5), "block_p99_s": percentile(blocks, 0.99),
        "max_uint8_diff": worst,
        # the last concurrent run's KV memory: the pool's peak, and the N streams' contiguous caches together
        "kv_pool_peak_bytes": pool.stats().peak_used_bytes if pool is not None else None,
        "kv_contiguous_bytes": sum(r.get("kv_bytes", 0) for r in results.values()) if pool is not None else None,
    }


def build_mid(folder: Path) -> Path:
    from composer.testing import build_tiny_wan

    return build_tiny_wan(folder / "mid", num_layers=8, num_heads=8, head_dim=64, ffn_dim=2048, text_dim=64,
                          text_heads=4, text_ff=128)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--levels", default="1,2,4,8", help="concurrency levels (comma-separated)")
    p.add_argument("--kinds", default="t2v,stream", help="t2v, stream or both")
    p.add_argument("--t2v-model", default="shapes-t2v",
                   help="a model folder / name, 'mid' (a random mid-size Wan) or 'wan1.3b' (Wan2.1-T2V-1.3B's released\n"
                        "transformer and VAE, random weights, a 2-layer UMT5 of the released width: for a GPU)")
    p.add_argument("--stream-model", default="shapes-causal", help="a causal model folder / name")
    p.add_argument("--steps", type=int, default=8, help="denoising steps of a t2v request")
    p.add_argument("--num-frames", type=int, default=17)
    p.add_argument("--height", type=int, default=None, help="t2v video height (default: the model's)")
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--stream-frames", type=int, default=33)
    p.add_argument("--api", choices=["threads", "tasks"], default="threads",
                   help="requests as blocking calls on threads (generate_video, stream_video's iterator), or as tasks "
                        "on the generator's request loop (submit_video, VideoStream.next_task); both sides alike")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs of each side per level (medians; 3+ on a GPU,"
                   " where sub-second runs vary)")
    p.add_argument("--json", default=None, help="write the rows to this file")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    runtime = {k: v for k, v in (("device", args.device), ("dtype", args.dtype)) if v}
    levels = [int(x) for x in args.levels.split(",")]
    kinds = [k.strip() for k in args.kinds.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in kinds:
            path = args.t2v_model if kind == "t2v" else args.stream_model
            if kind == "t2v" and path == "mid":
                path = str(build_mid(Path(tmp)))
            elif kind == "t2v" and path == "wan1.3b":
                from benchmarks.gpu_suite import build_e2e_folder

                path = str(build_e2e_folder(Path(tmp) / "wan13b", tiny=False))
            gen = VideoGenerator.from_pretrained(path, progress=False, **runtime)
            counter = Counter(gen)
            pool = ThreadPoolExecutor(max_workers=max(levels))
            warm_pool(pool, max(levels), gen, one_t2v if kind == "t2v" else one_stream, args)
            api = f", {args.api} API"
            print(f"{kind}: {path} ({gen.pipeline.concurrency} mode{api}), torch threads {torch.get_num_threads()}",
                  flush=True)
            for n in levels:
                row = run_level(gen, counter, kind, n, args, pool)
                rows.append(row)
                print(f"  N={n}: {row['sequential_fps']:.1f} -> {row['concurrent_fps']:.1f} frames/s "
                      f"({row['speedup']:.2f}x), calls {row['sequential_calls']} -> {row['concurrent_calls']}, "
                      f"shared {row['shared_call_share']:.0%}, latency p50 {row['latency_p50_s']:.2f} s "
                      f"p99 {row['latency_p99_s']:.2f} s"
                      + (f", per stream {row['per_stream_fps']:.1f} frames/s, block p50 {row['block_p50_s']*1e3:.0f} "
                         f"ms p99 {row['block_p99_s']*1e3:.0f} ms" if kind == "stream" else "")
                      + f", max uint8 diff {row['max_uint8_diff']}"
                      + (f", KV pool peak {mib(row['kv_pool_peak_bytes'])} (contiguous caches "
                         f"{mib(row['kv_contiguous_bytes'])})" if row["kv_pool_peak_bytes"] is not None else ""),
                      flush=True)
                if len(row["sequential_runs_s"]) > 1:
                    print("       runs (s): one after another " + ", ".join(f"{t:.3f}" for t in row["sequential_runs_s"])
                          + "; at once " + ", ".join(f"{t:.3f}" for t in row["concurrent_runs_s"]), flush=True)
            pool.shutdown()
            if kind == "stream" and kv_pool(gen) is not None and max(levels) > 1:
                forks = fork_memory(gen, max(levels))
                print(f"  forks: a session and {forks['n'] - 1} forks hold {mib(forks['pool_bytes'])} of KV pool "
                      f"({forks['shared_pages']} pages shared; {forks['n']} contiguous caches: "
                      f"{mib(forks['contiguous_bytes'])})", flush=True)
                rows.append({"kind": "forks", **forks})
    print("\n| traffic | N | sequential frames/s | concurrent frames/s | ratio | transformer calls (seq -> conc) | "
          "latency p50 / p99 | max uint8 diff |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if r["kind"] == "forks":
            continue
        print(f"| {r['kind']} | {r['n']} | {r['sequential_fps']:.1f} | {r['concurrent_fps']:.1f} | {r['speedup']:.2f}x | "
              f"{r['sequential_calls']} -> {r['concurrent_calls']} | {r['latency_p50_s']:.2f} / "
              f"{r['latency_p99_s']:.2f} s | {r['max_uint8_diff']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r.get("max_uint8_diff", 0) <= 1 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
