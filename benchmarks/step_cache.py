"""Step caching: composer's TeaCache and DBCache at several thresholds against the exact path, in one process.

For each setting: the share of transformer calls that reused the cached residual (TeaCache: all the blocks;
DBCache: the middle blocks), the denoising stage's time and the whole video's time as ratios to the exact run
(< 1: faster), and the PSNR of the frames against the exact run. DBCache rows come without and with TaylorSeer.
Default: the embedded shapes model at 30 steps (its width has no fitted TeaCache coefficients: the raw relative
change is used).

    python benchmarks/step_cache.py
    python benchmarks/step_cache.py --method dbcache --dbcache-thresholds 0.1,0.2 --fn-blocks 1 --bn-blocks 1
    python benchmarks/step_cache.py --model-path Wan-AI/Wan2.1-T2V-1.3B-Diffusers --device cuda --steps 50

Still to come (issue 24): diffusers' FirstBlockCache on the same weights, the prompt-following score.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


def timed(gen, request: dict, repeats: int):
    """The last result and the median timings of `repeats` runs (after one warmup)."""
    gen.generate_video(**request)
    runs = [gen.generate_video(**request) for _ in range(repeats)]
    denoise = statistics.median(r.timings.get("DenoisingStage", float("nan")) for r in runs)
    total = statistics.median(r.timings["total"] for r in runs)
    return runs[-1], denoise, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="model folder or hub id (default: the shapes model)")
    parser.add_argument("--prompt", default="a red circle moving left")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--method", default="teacache,dbcache", help="comma-separated: teacache, dbcache")
    parser.add_argument("--thresholds", default="0.05,0.1,0.2,0.4", help="teacache's thresholds")
    parser.add_argument("--dbcache-thresholds", default="0.05,0.1,0.2,0.4")
    parser.add_argument("--fn-blocks", type=int, default=1, help="dbcache: first blocks that always run")
    parser.add_argument("--bn-blocks", type=int, default=0, help="dbcache: last blocks that always run")
    parser.add_argument("--taylorseer", default="off,on", help="dbcache rows without and/or with TaylorSeer")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    methods = [m.strip() for m in args.method.split(",")]
    unknown = set(methods) - {"teacache", "dbcache"}
    if unknown:
        parser.error(f"--method: unknown {', '.join(sorted(unknown))} (expected teacache, dbcache)")

    from composer import VideoGenerator

    runtime = dict(device=args.device, dtype=args.dtype, progress=False)
    request = dict(prompt=args.prompt, seed=args.seed, num_inference_steps=args.steps)
    exact, denoise0, total0 = timed(VideoGenerator.from_pretrained(args.model_path, **runtime), request, args.repeats)
    print(f"model {args.model_path or 'shapes-t2v (embedded)'}, {args.steps} steps, frames {exact.frames.shape}, "
          f"median of {args.repeats} runs after a warmup")
    print(f"{'setting':<24} {'skipped':>8} {'denoise':>10} {'vs exact':>9} {'video':>9} {'vs exact':>9} "
          f"{'PSNR':>9}")
    print(f"{'exact':<24} {'0':>8} {denoise0 * 1e3:>8.0f}ms {1:>8.2f}x {total0:>8.2f}s {1:>8.2f}x {'inf':>9}")
    settings = []  # (label, runtime settings)
    if "teacache" in methods:
        settings += [(f"teacache {t:g}", dict(cache="teacache", cache_threshold=t))
                     for t in (float(t) for t in args.thresholds.split(","))]
    if "dbcache" in methods:
        blocks = f"F{args.fn_blocks}B{args.bn_blocks}"
        for taylor in (v.strip() == "on" for v in args.taylorseer.split(",")):
            settings += [(f"dbcache {blocks}{' +TS' if taylor else ''} {t:g}",
                          dict(cache="dbcache", cache_threshold=t, cache_fn_blocks=args.fn_blocks,
                               cache_bn_blocks=args.bn_blocks, cache_taylorseer=taylor))
                         for t in (float(t) for t in args.dbcache_thresholds.split(","))]
    for label, cache in settings:
        gen = VideoGenerator.from_pretrained(args.model_path, **cache, **runtime)
        result, denoise, total = timed(gen, request, args.repeats)
        stats = next(h for h in gen.pipeline.hooks if h.name == "cache").hooks[0].stats
        print(f"{label:<24} {f'{stats.skipped}/{stats.calls}':>8} {denoise * 1e3:>8.0f}ms "
              f"{denoise / denoise0:>8.2f}x {total:>8.2f}s {total / total0:>8.2f}x "
              f"{psnr(result.frames, exact.frames):>7.1f}dB")


if __name__ == "__main__":
    main()
