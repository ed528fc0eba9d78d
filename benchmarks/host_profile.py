"""Where the host's time goes while N causal streams run at once on one generator (launch-bound steps on a GPU).

N streams (`stream_video`, different prompts and seeds) run at once on a warmed pool of N threads, `--repeats` times;
printed: each run's seconds and frames/s (best and median). Optional:
- `--sample`: a sampling profile of every thread during the last run (every 5 ms, each thread's innermost composer
  frame and the function it is in): which thread is busy, and where; the engine core's share waiting shows how
  much of the time the device's work, not the host, is the limit;
- `--cprofile`: Python's profiler on the engine core's executor thread and its side lane (whole run, by own time);
- `--ops`: the tensor operations (aten calls, each a kernel launch or more on a GPU) the engine core's executor
  thread and side lane dispatch in the timed runs, per frame and by the composer function that issues them: the host
  cost of an iteration in a figure no CPU or load changes (a launch-bound device runs at the host's pace);
- `--no-release`: the engine core's threads keep their OpenMP teams (composer/platform/openmp.py), for an A/B;
- `--settle-ms`: how long a ready call may wait for requests outside a loop to join it, for an A/B.
Also printed: the step scheduler's calls and the time its ready calls were held back for partners, and the decode
batcher's calls.

    python benchmarks/host_profile.py --device cuda --dtype bf16 --n 8 --sample
    python benchmarks/host_profile.py --n 2 --stream-frames 9 --repeats 1 --cprofile     # CPU, small

The throughput figures of record are benchmarks/concurrency.py's (same requests, with their sequential baseline).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import dataclasses
import io
import os
import pstats
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import concurrency  # noqa: E402


class Sampler:
    """Every `interval` s, each thread's innermost composer frame and its leaf function, counted per thread."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.samples: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.totals: collections.Counter = collections.Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.is_set():
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                name = names.get(ident, "?")
                if name.startswith("ThreadPoolExecutor"):  # the benchmark's own pool: one row for all its threads
                    name = "stream threads"
                ours = frame
                while ours is not None and "/composer/" not in ours.f_code.co_filename:
                    ours = ours.f_back
                key = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"
                if ours is not None and ours is not frame:
                    key = f"{os.path.basename(ours.f_code.co_filename)}:{ours.f_code.co_name}:{ours.f_lineno} -> {key}"
                self.samples[name][key] += 1
                self.totals[name] += 1
            time.sleep(self.interval)

    def report(self, top: int = 12) -> str:
        lines = []
        for name, n in self.totals.most_common():
            lines.append(f"-- thread {name}: {n} samples")
            lines += [f"   {c / n:6.1%}  {key}" for key, c in self.samples[name].most_common(top)]
        return "\n".join(lines)


def profile_core(profiles: dict[str, cProfile.Profile]):
    """Run the engine core's executor loop and its side lane's work under cProfile (one profile each); returns the
    function that puts the originals back."""
    import composer.engine.core as core_module

    loop, logged = core_module.EngineCore._loop, core_module._logged

    def profiled(name, fn):
        def run(*a):
            profile = profiles.setdefault(name, cProfile.Profile())
            profile.enable()
            try:
                return fn(*a)
            finally:
                profile.disable()
        return run

    core_module.EngineCore._loop = profiled("engine core", loop)
    core_module._logged = profiled("side lane", logged)

    def restore() -> None:
        core_module.EngineCore._loop, core_module._logged = loop, logged
    return restore


class OpCounter:
    """Counts the aten operations dispatched under it, by the innermost composer function (file:function) that
    issued them."""

    def __init__(self):
        self.by_site: collections.Counter = collections.Counter()
        self.enabled = False

    def total(self) -> int:
        return sum(self.by_site.values())

    def mode(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Counting(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if counter.enabled:
                    frame = sys._getframe(1)
                    while frame is not None and ("/composer/" not in frame.f_code.co_filename
                                                 or "/torch/" in frame.f_code.co_filename):
                        frame = frame.f_back
                    site = ("(outside composer)" if frame is None else
                            f"{frame.f_code.co_filename.split('/composer/', 1)[1]}:{frame.f_code.co_name}")
                    counter.by_site[site] += 1
                return func(*args, **(kwargs or {}))

        return Counting()

    def report(self, frames: int, top: int = 15) -> str:
        n = self.total()
        lines = [f"-- tensor operations on the engine core's threads, the timed runs: {n} ({n / max(frames, 1):.1f} a "
                 "frame)"]
        lines += [f"   {c:8d}  {c / max(n, 1):6.1%}  {site}" for site, c in self.by_site.most_common(top)]
        return "\n".join(lines)


def count_core_ops(counter: OpCounter):
    """Run the engine core's executor loop and its side lane's work under `counter`'s dispatch mode; returns the
    function that puts the originals back."""
    import composer.engine.core as core_module

    loop, logged = core_module.EngineCore._loop, core_module._logged

    def counted(fn):
        def run(*a):
            with counter.mode():
                return fn(*a)
        return run

    core_module.EngineCore._loop = counted(loop)
    core_module._logged = counted(logged)

    def restore() -> None:
        core_module.EngineCore._loop, core_module._logged = loop, logged
    return restore


def no_release():
    """The engine core's threads keep their OpenMP teams; returns the function that puts the release back."""
    import composer.engine.batcher as batcher_module
    import composer.engine.core as core_module

    saved = core_module.release_workers, batcher_module.release_workers
    core_module.release_workers = batcher_module.release_workers = lambda: False

    def restore() -> None:
        core_module.release_workers, batcher_module.release_workers = saved
    return restore


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="shapes-causal", help="a causal model folder / name")
    p.add_argument("--n", type=int, default=8, help="streams at once")
    p.add_argument("--stream-frames", type=int, default=33)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--api", choices=["threads", "tasks"], default="threads")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--sample", action="store_true", help="sample every thread's stack during the last run")
    p.add_argument("--cprofile", action="store_true", help="cProfile the engine core's thread and its side lane")
    p.add_argument("--ops", action="store_true", help="count the tensor operations of the engine core's threads")
    p.add_argument("--no-release", action="store_true", help="the core's threads keep their OpenMP teams")
    p.add_argument("--settle-ms", type=float, default=None,
                   help="how long a ready call (a step, a decode) may wait for requests outside a loop to join it "
                        "(default: the queues' own, 5 ms and at most a quarter of a recent call), for an A/B")
    args = p.parse_args(argv)
    restores = [no_release()] if args.no_release else []
    profiles: dict[str, cProfile.Profile] = {}
    if args.cprofile:
        restores.append(profile_core(profiles))
    counter = OpCounter() if args.ops else None
    if counter is not None:
        restores.append(count_core_ops(counter))
    try:
        run(args, profiles, counter)
    finally:
        for restore in restores:
            restore()
    return 0


def run(args: argparse.Namespace, profiles: dict[str, cProfile.Profile], counter: OpCounter | None = None) -> None:
    from composer import VideoGenerator
    from composer.engine.core import unit_queues

    runtime = {k: v for k, v in (("device", args.device), ("dtype", args.dtype)) if v}
    gen = VideoGenerator.from_pretrained(args.model, progress=False, **runtime)
    request = argparse.Namespace(api=args.api, stream_frames=args.stream_frames)
    pool = ThreadPoolExecutor(max_workers=args.n)
    concurrency.warm_pool(pool, args.n, gen, concurrency.one_stream, request)
    for profile in profiles.values():  # count the timed runs only
        profile.clear()
    if counter is not None:
        counter.enabled = True
    schedulers = [e.scheduler for e in gen.pipeline.engines if e.scheduler is not None]
    decoders = [q for q in unit_queues(gen.pipeline) if q not in schedulers]
    if args.settle_ms is not None:
        for queue in [*schedulers, *decoders]:
            queue.settle_s = args.settle_ms / 1e3
    before = [dataclasses.replace(s.stats) for s in schedulers]
    decoded = [(q.calls, q.batched_calls) for q in decoders]
    times, sampler = [], None
    for r in range(args.repeats):
        sampler = Sampler() if args.sample and r == args.repeats - 1 else None
        start = time.perf_counter()
        if sampler is not None:
            with sampler:
                results = [f.result() for f in [pool.submit(concurrency.one_stream, gen, i, request)
                                                for i in range(args.n)]]
        else:
            results = [f.result() for f in [pool.submit(concurrency.one_stream, gen, i, request) for i in range(args.n)]]
        times.append(time.perf_counter() - start)
    pool.shutdown()
    frames = sum(len(r["frames"]) for r in results)
    print(f"{args.n} streams at once ({args.api} API, OpenMP release {'off' if args.no_release else 'on'}), "
          f"{frames} frames a run: runs " + ", ".join(f"{t:.3f}" for t in times)
          + f" s; best {frames / min(times):.1f} frames/s, median {frames / statistics.median(times):.1f} frames/s",
          flush=True)
    for scheduler, start in zip(schedulers, before):
        st = scheduler.stats
        print(f"step scheduler, the timed runs: {st.calls - start.calls} calls for {st.units - start.units} units "
              f"({st.batched_units - start.batched_units} shared a call); ready calls held back "
              f"{st.settle_seconds - start.settle_seconds:.3f} s for requests outside a loop (settle_s)")
    for queue, (calls, batched) in zip(decoders, decoded):
        print(f"{type(queue).__name__} ({queue.lane} lane), the timed runs: {queue.calls - calls} calls, "
              f"{queue.batched_calls - batched} of them batched with another; a run {queue.run_seconds * 1e3:.1f} ms "
              "(running average)")
    for name, profile in profiles.items():
        buf = io.StringIO()
        pstats.Stats(profile, stream=buf).sort_stats("tottime").print_stats(25)
        print(f"-- cProfile, {name} (the timed runs), by own time")
        print("\n".join(line for line in buf.getvalue().splitlines() if line.strip())[:6000])
    if counter is not None:
        print(counter.report(frames * args.repeats))
    if sampler is not None:
        print(sampler.report())


if __name__ == "__main__":
    sys.exit(main())
