"""Step caching: composer's TeaCache and DBCache, and diffusers' FirstBlockCache (and cache-dit's DBCache when it
is installed), at several thresholds against the exact path of the same engine, in one process.

Every engine runs the same model folder, prompt, negative prompt, seed, size, guidance and steps, and the same
initial noise (composer draws its latents as diffusers does). For each setting it prints the share of transformer
calls whose cached blocks were skipped (TeaCache: all the blocks; DBCache, FirstBlockCache: every block after the
first Fn), the transformer's time (composer: the denoising stage; diffusers: the sum of the transformer's calls)
and the whole video's time as ratios to that engine's exact run (< 1: faster), and the PSNR of the frames
against that engine's exact run. A first line checks that the two exact runs give the same frames.

    python benchmarks/step_cache.py                          # the embedded shapes model, 30 steps
    python benchmarks/step_cache.py --preset mid --repeats 1 # a mid-size random Wan, built in a temporary folder
    python benchmarks/step_cache.py --method dbcache --dbcache-thresholds 0.1,0.2 --fn-blocks 1 --bn-blocks 1
    python benchmarks/step_cache.py --model-path Wan-AI/Wan2.1-T2V-1.3B-Diffusers --device cuda --steps 50
    PYTHONPATH=/path/to/cache-dit python benchmarks/step_cache.py   # adds cache-dit rows (optional)
    python benchmarks/step_cache.py --score 50 --method teacache,dbcache --thresholds default --dbcache-thresholds default

`--score N` (the shapes model only) measures quality over N seeded demo prompts instead of time: for the exact path
and each composer setting, the prompt-following score (colour, shape, direction read from the frames by the demo's
scorer: `composer eval demo`'s), the prompts whose verdict (all three right) flipped against the exact path (+ won,
- lost), and the PSNR against the exact frames of each prompt (mean and worst). A threshold
`default` is the family's recommended one (what `cache=...` alone gives).

Timing: after one warmup of each, every setting's run is paired with a run of its engine's exact path (the order
alternating), and the ratios are the medians of the `--repeats` per-pair ratios, so load from other processes hits
both sides alike; `time.perf_counter`, with a CUDA synchronize around each timed transformer call on GPU. On a busy CPU use `--threads 1` (several threads waiting on each other swing wall
times by several x). Random weights say little about quality: the shapes model is the quality reference.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# A mid-size random Wan2.1 (8 blocks of 8 heads x 64, ffn 2048) and the video it makes.
MID_MODEL = dict(num_layers=8, num_heads=8, head_dim=64, ffn_dim=2048, text_dim=64, text_heads=4, text_ff=128)
MID_VIDEO = dict(num_frames=17, height=96, width=96)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


def denoising_seconds(result) -> float:
    """The denoising stages' time: DenoisingStage, CausalDenoisingStage, one per expert (Wan2.2 A14B)."""
    return sum(v for k, v in result.timings.items() if "DenoisingStage" in k)


def composer_timed(gen, request: dict, repeats: int):
    """The last result and the median denoising-stage and whole-video times of `repeats` runs after a warmup."""
    gen.generate_video(**request)
    runs = [gen.generate_video(**request) for _ in range(repeats)]
    denoise = statistics.median(denoising_seconds(r) for r in runs)
    total = statistics.median(r.timings["total"] for r in runs)
    return runs[-1], denoise, total


class DiffusersRunner:
    """diffusers' WanPipeline on the same folder, timing its transformer's calls and counting the calls in which
    the last block ran (a cached call skips it)."""

    def __init__(self, folder: Path, device: torch.device, dtype: torch.dtype, sampling, max_sequence_length: int):
        import diffusers

        transformer = diffusers.WanTransformer3DModel.from_pretrained(folder, subfolder="transformer",
                                                                      torch_dtype=dtype)
        diffusers.utils.logging.set_verbosity_error()
        # the text encoder and VAE in fp32, as composer loads them
        self.pipe = diffusers.WanPipeline.from_pretrained(folder, transformer=transformer,
                                                          torch_dtype=torch.float32).to(device)
        self.pipe.set_progress_bar_config(disable=True)
        self.device = device
        self.sampling = sampling
        self.max_sequence_length = max_sequence_length
        self.calls = self.block_runs = 0
        self.transformer_s = 0.0
        self._start = 0.0
        model = self.pipe.transformer
        model.register_forward_pre_hook(self._before)
        model.register_forward_hook(self._after)
        model.blocks[-1].ffn.register_forward_hook(self._block_ran)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _before(self, *_):
        self._sync()
        self._start = time.perf_counter()

    def _after(self, *_):
        self._sync()
        self.transformer_s += time.perf_counter() - self._start
        self.calls += 1

    def _block_ran(self, *_):
        self.block_runs += 1

    def generate(self, prompt: str, seed: int, steps: int) -> tuple[np.ndarray, float, float]:
        s = self.sampling
        self.calls = self.block_runs = 0
        self.transformer_s = 0.0
        start = time.perf_counter()
        out = self.pipe(prompt, negative_prompt=s.negative_prompt, height=s.height, width=s.width,
                        num_frames=s.num_frames, num_inference_steps=steps, guidance_scale=s.guidance_scale,
                        generator=torch.Generator("cpu").manual_seed(seed), output_type="np",
                        max_sequence_length=self.max_sequence_length).frames[0]
        self._sync()
        total = time.perf_counter() - start
        frames = (np.clip(out, 0, 1) * 255).round().astype(np.uint8)
        return frames, self.transformer_s, total

    def once(self, prompt: str, seed: int, steps: int, enable=None, disable=None):
        """One video (with a fresh cache when `enable` is given): frames, transformer and video seconds, and the
        transformer calls that skipped the last block out of all calls."""
        if enable is not None:
            enable(self.pipe)
        try:
            frames, transformer_s, total = self.generate(prompt, seed, steps)
        finally:
            if disable is not None:
                disable(self.pipe)
        return frames, transformer_s, total, self.calls - self.block_runs, self.calls

    def timed(self, prompt: str, seed: int, steps: int, repeats: int):
        """The exact path: the last frames, median transformer and video times of `repeats` runs after a warmup,
        and the call counts."""
        runs = [self.once(prompt, seed, steps) for _ in range(repeats + 1)][1:]
        return (runs[-1][0], statistics.median(r[1] for r in runs), statistics.median(r[2] for r in runs),
                runs[-1][3], runs[-1][4])


def first_block_cache(threshold: float):
    from diffusers import FirstBlockCacheConfig

    def enable(pipe):
        pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))

    def disable(pipe):
        pipe.transformer.disable_cache()

    return enable, disable


def cache_dit_dbcache(threshold: float, fn_blocks: int, bn_blocks: int, warmup: int):
    import cache_dit

    def enable(pipe):
        cache_dit.enable_cache(pipe, cache_config=cache_dit.DBCacheConfig(
            Fn_compute_blocks=fn_blocks, Bn_compute_blocks=bn_blocks, residual_diff_threshold=threshold,
            max_warmup_steps=warmup, max_cached_steps=-1, max_continuous_cached_steps=-1))

    def disable(pipe):
        cache_dit.disable_cache(pipe)

    return enable, disable


def score_settings(settings: list[tuple[str, dict]], runtime: dict, count: int, steps: int, seed: int) -> None:
    """Prompt score and PSNR over `count` demo prompts (prompt i with seed + i), exact path first."""
    from composer import VideoGenerator
    from demo.evaluate import demo_prompts
    from demo.score import Score

    prompts = demo_prompts(count, seed)
    print(f"shapes-t2v (embedded), {steps} steps, {count} demo prompts (seeds {seed}..{seed + count - 1})")
    print(f"{'setting':<30} {'skipped':>8} {'colour':>7} {'shape':>7} {'direct.':>7} {'overall':>8} "
          f"{'flips':>7} {'PSNR mean':>10} {'worst':>7}")
    exact = exact_verdicts = None
    for label, cache in [("composer exact", {})] + settings:
        gen = VideoGenerator.from_pretrained(None, **cache, **runtime)
        score, frames, skipped, calls = Score(), [], 0, 0
        for i, prompt in enumerate(prompts):
            video = gen.generate_video(prompt, seed=seed + i, num_inference_steps=steps).frames
            score.add(prompt, video)
            frames.append(video)
            hook = next((h for h in gen.pipeline.hooks if h.name == "cache"), None)
            if hook is not None:
                skipped += hook.hooks[0].stats.skipped
                calls += hook.hooks[0].stats.calls
        exact = exact or frames
        verdicts = [all(r.values()) for _, r in score.per_prompt]
        exact_verdicts = exact_verdicts or verdicts
        gained = sum(v and not e for v, e in zip(verdicts, exact_verdicts))
        lost = sum(e and not v for v, e in zip(verdicts, exact_verdicts))
        values = [psnr(a, b) for a, b in zip(frames, exact)]
        finite = [v for v in values if np.isfinite(v)]
        summary = score.summary()
        mean = f"{np.mean(finite):.1f}dB" if finite else "inf"
        worst = f"{min(values):.1f}dB" if finite else "inf"
        share = f"{skipped / calls:.0%}" if calls else "0"
        print(f"{label:<30} {share:>8} {summary['color']:>7.0%} {summary['shape']:>7.0%} "
              f"{summary['direction']:>7.0%} {summary['overall']:>8.1%} {f'+{gained}/-{lost}':>7} {mean:>10} "
              f"{worst:>7}", flush=True)
        gen = None  # free the exact model before diffusers loads


def row(label: str, skipped: str, t: float, ratio_t: float, total: float, ratio_v: float, quality: str) -> None:
    print(f"{label:<30} {skipped:>8} {t * 1e3:>9.0f}ms {ratio_t:>8.2f}x {total:>8.2f}s {ratio_v:>8.2f}x "
          f"{quality:>9}")


def paired(run_exact, run_setting, repeats: int):
    """Time a setting against the exact path in pairs (order alternating, after one warmup of each), so that
    load from other processes hits both alike: the setting's last result, its median times, and the medians of
    the per-pair ratios (setting / exact) of the transformer and whole-video times."""
    run_exact()
    run_setting()
    times, ratios_t, ratios_v, result = [], [], [], None
    for i in range(repeats):
        if i % 2:
            result, t, v = run_setting()
            _, t0, v0 = run_exact()
        else:
            _, t0, v0 = run_exact()
            result, t, v = run_setting()
        times.append((t, v))
        ratios_t.append(t / t0)
        ratios_v.append(v / v0)
    return (result, statistics.median(t for t, _ in times), statistics.median(v for _, v in times),
            statistics.median(ratios_t), statistics.median(ratios_v))


def thresholds(text: str) -> list[float | None]:
    """Comma-separated thresholds; `default` (None) is the family's recommended one."""
    return [None if t.strip() == "default" else float(t) for t in text.split(",") if t.strip()]


def label_of(threshold: float | None) -> str:
    return "default" if threshold is None else f"{threshold:g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=("shapes", "causal", "mid"), default="shapes",
                        help="shapes: the embedded shapes model; causal: the embedded causal shapes model (composer "
                             "rows only); mid: a mid-size random Wan built in a temp folder")
    parser.add_argument("--model-path", default=None, help="a model folder or hub id instead of the preset")
    parser.add_argument("--prompt", default="a red circle moving left")
    parser.add_argument("--steps", type=int, default=None, help="default: 30 (causal: the model's few steps)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-frames", type=int, default=None)
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--method", default="teacache,dbcache,diffusers,cache-dit",
                        help="comma-separated rows to run: teacache, dbcache, diffusers (FirstBlockCache), cache-dit; none")
    parser.add_argument("--thresholds", default="0.05,0.1,0.2,0.4", help="teacache's thresholds")
    parser.add_argument("--dbcache-thresholds", default="0.05,0.1,0.2,0.4",
                        help="composer's dbcache, diffusers' FirstBlockCache and cache-dit's DBCache thresholds")
    parser.add_argument("--fn-blocks", type=int, default=1, help="dbcache: first blocks that always run")
    parser.add_argument("--bn-blocks", type=int, default=0, help="dbcache: last blocks that always run")
    parser.add_argument("--taylorseer", default="off", help="dbcache rows without and/or with TaylorSeer: off,on")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), fp32, bf16")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--setting", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                        help="an extra composer row with these runtime settings (e.g. quantize=int8); repeatable")
    parser.add_argument("--score", type=int, default=0, metavar="N",
                        help="instead of timing: prompt score and PSNR over N demo prompts (shapes model only)")
    args = parser.parse_args()
    if args.score and (args.model_path or args.preset != "shapes"):
        parser.error("--score reads the shapes world: it runs on the embedded shapes model only")
    methods = [m.strip() for m in args.method.split(",") if m.strip()]
    unknown = set(methods) - {"teacache", "dbcache", "diffusers", "cache-dit", "none"}
    if unknown:
        parser.error(f"--method: unknown {', '.join(sorted(unknown))} (expected teacache, dbcache, diffusers, "
                     "cache-dit)")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.steps is None and args.preset != "causal":
        args.steps = 30

    # the tables only: composer's INFO log, cache-dit's and diffusers' chatter off (before they are imported)
    os.environ.setdefault("COMPOSER_LOG_LEVEL", "WARNING")
    os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "error")
    from composer import VideoGenerator
    from composer.default_model import default_model_path
    from composer.loader.resolve import resolve_model_path

    tmp = None
    size = {}
    if args.model_path:
        model_path, name = args.model_path, args.model_path
    elif args.preset == "mid":
        from composer.testing import build_tiny_wan

        tmp = tempfile.TemporaryDirectory(prefix="composer-bench-")
        model_path = str(build_tiny_wan(Path(tmp.name) / "mid-wan", **MID_MODEL))
        name = "mid-size random Wan2.1 (" + ", ".join(f"{k} {v}" for k, v in MID_MODEL.items()) + ")"
        size = dict(MID_VIDEO)
    elif args.preset == "causal":
        model_path, name = "shapes-causal", "shapes-causal (embedded, block-autoregressive)"
    else:
        model_path, name = None, "shapes-t2v (embedded)"
    size.update({k: v for k, v in (("num_frames", args.num_frames), ("height", args.height),
                                   ("width", args.width)) if v is not None})

    runtime = dict(device=args.device, dtype=args.dtype, progress=False)
    settings = []  # (label, runtime settings)
    if "teacache" in methods:
        settings += [(f"composer teacache {label_of(t)}", dict(cache="teacache", cache_threshold=t))
                     for t in thresholds(args.thresholds)]
    blocks = f"F{args.fn_blocks}B{args.bn_blocks}"
    if "dbcache" in methods:
        for taylor in (v.strip() == "on" for v in args.taylorseer.split(",")):
            settings += [(f"composer dbcache {blocks}{' +TS' if taylor else ''} {label_of(t)}",
                          dict(cache="dbcache", cache_threshold=t, cache_fn_blocks=args.fn_blocks,
                               cache_bn_blocks=args.bn_blocks, cache_taylorseer=taylor))
                         for t in thresholds(args.dbcache_thresholds)]

    for text in args.setting:
        pairs = [p.partition("=") for p in text.split(",") if p.strip()]
        if any(not value for _, _, value in pairs):
            parser.error(f"--setting {text!r}: expected KEY=VALUE[,KEY=VALUE]")
        settings.append((f"composer {text}", {k.strip(): v.strip() for k, _, v in pairs}))

    if args.score:
        score_settings(settings, runtime, args.score, args.steps, args.seed)
        return

    request = dict(prompt=args.prompt, seed=args.seed, **size)
    if args.steps:
        request["num_inference_steps"] = args.steps
    gen = VideoGenerator.from_pretrained(model_path, **runtime)
    exact, denoise0, total0 = composer_timed(gen, request, args.repeats)
    sampling = exact.sampling
    device, dtype = gen.pipeline.device, gen.pipeline.runtime.torch_dtype
    max_sequence_length = gen.pipeline.config.text_encoder_max_length
    print(f"model {name}, {args.steps or 'default'} steps, frames {exact.frames.shape}, guidance "
          f"{sampling.guidance_scale}, {device} {str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} "
          f"threads, median of {args.repeats} runs after a warmup, each run paired with an exact one")

    header = (f"{'setting':<30} {'skipped':>8} {'transformer':>11} {'vs exact':>9} {'video':>9} {'vs exact':>9} "
              f"{'PSNR':>9}")
    print(header)
    row("composer exact", "0", denoise0, 1.0, total0, 1.0, "inf")

    def composer_run(g):
        result = g.generate_video(**request)
        return result, denoising_seconds(result), result.timings["total"]

    for label, cache in settings:
        cached = VideoGenerator.from_pretrained(model_path, **cache, **runtime)
        result, denoise, total, ratio_t, ratio_v = paired(partial(composer_run, gen), partial(composer_run, cached),
                                                          args.repeats)
        stats = next(h for h in cached.pipeline.hooks if h.name == "cache").hooks[0].stats
        row(label, f"{stats.skipped}/{stats.calls}", denoise, ratio_t, total, ratio_v,
            f"{psnr(result.frames, exact.frames):.1f}dB")
        del cached
    gen = None  # free the exact model before diffusers loads

    if not {"diffusers", "cache-dit"} & set(methods):
        return
    if args.preset == "causal" and not args.model_path:
        print("diffusers / cache-dit rows: skipped (diffusers has no pipeline for composer's causal folders)")
        return
    folder = resolve_model_path(model_path if model_path else str(default_model_path()))
    runner = DiffusersRunner(folder, device, dtype, sampling, max_sequence_length)
    ref, t0, v0, _, calls = runner.timed(args.prompt, args.seed, args.steps, args.repeats)
    diff = int(np.abs(ref.astype(np.int16) - exact.frames.astype(np.int16)).max())
    row("diffusers exact", f"0/{calls}", t0, 1.0, v0, 1.0, "inf")
    print(f"  (composer's exact frames vs diffusers': max uint8 difference {diff}, PSNR "
          f"{psnr(ref, exact.frames):.1f} dB)")
    cached = []
    if "diffusers" in methods:
        cached += [(f"diffusers FirstBlockCache {t:g}", first_block_cache(t))
                   for t in thresholds(args.dbcache_thresholds) if t is not None]
    if "cache-dit" in methods:
        try:
            import cache_dit  # noqa: F401
        except ImportError:
            print("cache-dit: not installed (optional: pip install cache-dit, in its own environment); rows skipped")
        else:
            warmup = max(1, round(0.1 * args.steps))  # composer's default warmup, for a like-for-like comparison
            cached += [(f"cache-dit DBCache {blocks} {t:g}",
                        cache_dit_dbcache(t, args.fn_blocks, args.bn_blocks, warmup))
                       for t in thresholds(args.dbcache_thresholds) if t is not None]
    for label, (enable, disable) in cached:
        counts = {}

        def diffusers_run(counts, enable=None, disable=None):
            frames, t, v, skipped, calls = runner.once(args.prompt, args.seed, args.steps, enable, disable)
            counts.update(skipped=skipped, calls=calls)
            return frames, t, v

        frames, t, v, ratio_t, ratio_v = paired(partial(diffusers_run, {}), partial(diffusers_run, counts, enable,
                                                                                   disable), args.repeats)
        row(label, f"{counts['skipped']}/{counts['calls']}", t, ratio_t, v, ratio_v, f"{psnr(frames, ref):.1f}dB")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
