"""One request at a time on the CPU, with and without the engine core's threads giving their OpenMP teams back.

torch's CPU operators run on libgomp, which gives each thread that computes its own team of workers and, while the
process holds more workers than CPUs, makes every team sleep between parallel regions instead of spinning
(composer/platform/openmp.py). The engine core's threads release their teams where they go idle; this script runs
the same videos with that release turned off and on, alternately (off, on, off, on, ...; each round a fresh process,
since a thread's team made while the release was off would outlive the switch), and prints the wall time, the CPU
time and the voluntary context switches of each round and the ratio of the medians.

    python benchmarks/openmp_teams.py                    # the embedded shapes-t2v model, 5 videos a round
    python benchmarks/openmp_teams.py --rounds 3 --videos 5 --model-path /path/to/folder --steps 10
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

import composer.engine.batcher as batcher_module
import composer.engine.core as core_module
from composer import VideoGenerator
from composer.platform import openmp


def _no_release() -> bool:
    return False


def run_round(gen: VideoGenerator, videos: int, steps: int | None) -> dict:
    kwargs = {} if steps is None else {"num_inference_steps": steps}
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for seed in range(videos):
        gen.generate_video("a red circle moves right", seed=seed, **kwargs)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {"wall": wall, "cpu": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "switches": after.ru_nvcsw - before.ru_nvcsw}


def child(args: argparse.Namespace) -> None:
    if args.child == "off":
        core_module.release_workers = batcher_module.release_workers = _no_release
    gen = VideoGenerator.from_pretrained(args.model_path, progress=False)
    gen.generate_video("warm up", seed=0, num_inference_steps=2)
    print(json.dumps(run_round(gen, args.videos, args.steps)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="a diffusers folder (default: the embedded shapes model)")
    parser.add_argument("--videos", type=int, default=5, help="videos per round (default 5)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each setting (default 3)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    parser.add_argument("--child", choices=("on", "off"), default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        child(args)
        return
    if openmp.runtime_name() is None:
        print("torch's OpenMP runtime here is not libgomp: there are no teams to give back; nothing to compare")
        return
    rounds: dict[str, list[dict]] = {"off": [], "on": []}
    forwarded = [f"--videos={args.videos}"] + ([f"--model-path={args.model_path}"] if args.model_path else []) + (
        [f"--steps={args.steps}"] if args.steps is not None else [])
    for _ in range(args.rounds):
        for setting in ("off", "on"):
            out = subprocess.run([sys.executable, __file__, f"--child={setting}", *forwarded], capture_output=True,
                                 text=True, check=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            rounds[setting].append(result)
            print(f"release {setting:3}: {args.videos} videos {result['wall']:.2f} s, CPU {result['cpu']:.2f} s, "
                  f"{result['switches']} voluntary context switches", flush=True)
    off = statistics.median(r["wall"] for r in rounds["off"])
    on = statistics.median(r["wall"] for r in rounds["on"])
    print(f"\nmedian wall: release off {off:.2f} s, on {on:.2f} s: {off / on:.2f}x faster with the release "
          f"(torch threads {torch.get_num_threads()}, OpenMP runtime {openmp.runtime_name()})")


if __name__ == "__main__":
    main()
