"""Benchmark composer's causal (block-autoregressive, Self-Forcing-style) video generation: KV cache vs recompute.

What it measures (one causal model folder, loaded once; the same prompt, seed and video in both modes):

1. cached: `VideoGenerator.stream_video(..., kv_cache=True)`, the fast path. Each denoising step of a block
   runs only that block's frames through the DiT, attending to the earlier frames' keys/values in a
   preallocated KV cache; one extra clean pass per block writes the block's keys/values.
2. recompute: the same call with `kv_cache=False`, the uncached reference. Each denoising step runs every
   frame of the rollout so far through the DiT under a block-causal attention mask, so a block's work grows
   with its index (block b runs (b + 1) * frames_per_block frames).

Per mode it reports the per-block denoising latency (`CausalStats.block_seconds`: the block's few denoising
steps, plus the clean cache-writing pass when cached; VAE decode excluded), as the median and mean over the
timed runs for each block index, then the time to first frame, total time, frames per second (end to end,
and for denoising alone), the median VAE decode per block and the KV cache memory the run allocated. It
checks that both modes produce the same latents (max abs diff of `stream.latents`, expected <= 1e-5 in fp32;
the script exits with status 1 if not) and that the cache's size is what `KVCacheSpec.nbytes` gives for the
model and video. Last, a table of KV cache sizes for the real Wan2.1-T2V-1.3B at 480x832, computed with
`KVCacheSpec.nbytes` (not measured), for global attention over longer and longer videos and for a few
sink + rolling window settings.

Timing: the stage's own `time.perf_counter` figures (it synchronises CUDA per block). One untimed warmup
stream per mode, then `--repeats` streams per mode, interleaved (cached, recompute, recompute, cached, ...)
so that load from other processes hits both modes alike. Prompt encodings are cached by composer after the
warmup, so the time to first frame is the first block plus its decode. On a busy CPU machine several torch
threads mostly wait for each other: the script warns when the load average is high; `--threads 1` then gives
steadier numbers.

Run (from the repository root):

    python benchmarks/causal.py --preset tiny
    python benchmarks/causal.py --preset small --threads 1 --json causal.json
    python benchmarks/causal.py --preset small --window 6 --sink 3 --blocks 12
    python benchmarks/causal.py --model-path /path/to/causal-folder --device cuda --dtype bf16 \
        --height 480 --width 832 --blocks 7

Presets build a randomly initialised tiny Wan2.1 model with `composer.testing.build_tiny_wan`, write its
transformer as a Self-Forcing-format checkpoint and convert that with
`composer.convert.self_forcing.convert_self_forcing` (`--frames-per-block`, `--window`, `--sink` are the
conversion's causal settings), all in a temporary folder. `--model-path` uses an existing causal folder
(`composer convert self-forcing` output) with its own settings; the preset then gives only the video size.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from composer import VideoGenerator
    from composer.convert.self_forcing import CausalSettings

# Run as a script, `benchmarks/` is sys.path[0]; make sure of it (and put the repository root first, so
# `composer` is the checkout next to this file whatever is installed).
BENCH_DIR = Path(__file__).resolve().parent
for _path in (BENCH_DIR, BENCH_DIR.parent):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from wan_vs_diffusers import format_time, quiet_libraries, warn_if_busy  # noqa: E402

PROMPT = "a red fox running through fresh snow, cinematic lighting"
SEED = 0
FRAMES_PER_BLOCK = 3  # Self-Forcing's default, for presets
LATENTS_TOLERANCE = 1e-5  # fp32: cached and recompute do the same maths in another order
MODES = {"cached": True, "recompute": False}  # name -> kv_cache


@dataclass(frozen=True)
class Preset:
    """Model sizes (overrides of `TinyWanSpec`) and the video size generated with them."""

    model: dict[str, Any]
    height: int
    width: int


PRESETS: dict[str, Preset] = {
    # build_tiny_wan's defaults: 2 layers, 2 heads x 32, ffn 128, text_dim 32. 64x64: 16 tokens per frame.
    "tiny": Preset(model={}, height=64, width=64),
    # 128x128: 64 tokens per frame, 1536 tokens in the last recompute pass of 8 blocks of 3 frames.
    "small": Preset(model={"num_layers": 4, "num_heads": 4, "head_dim": 32, "ffn_dim": 512}, height=128, width=128),
}

# The real Wan2.1-T2V-1.3B for the computed KV memory table.
WAN_1_3B = {"num_layers": 30, "num_heads": 12, "head_dim": 128}
WAN_HEIGHT, WAN_WIDTH, WAN_VAE_STRIDE, WAN_VAE_TEMPORAL, WAN_PATCH = 480, 832, 8, 4, 2
WAN_GLOBAL_FRAMES = (21, 42, 84)  # latent frames: 81, 165, 333 video frames
WAN_WINDOWS = ((12, 3), (21, 3))  # (local_attn_size, sink_size)


# -- building the model ---------------------------------------------------------------------------------


def write_self_forcing_checkpoint(base: Path, path: Path) -> Path:
    """A Self-Forcing-format checkpoint (`{"generator": {"model.<name>": tensor}}`) holding the transformer
    of the diffusers folder `base`, its names in composer's naming (which the converter accepts)."""
    from safetensors.torch import load_file

    from composer.loader.weights import apply_rules
    from composer.models.wan.mapping import DIFFUSERS_TO_COMPOSER

    state = load_file(base / "transformer" / "diffusion_pytorch_model.safetensors")
    torch.save({"generator": {"model." + apply_rules(k, DIFFUSERS_TO_COMPOSER): v for k, v in state.items()}}, path)
    return path


def build_causal_model(preset: Preset, settings: CausalSettings, folder: Path) -> Path:
    """Tiny Wan2.1 folder -> Self-Forcing checkpoint -> causal folder, all under `folder`."""
    from composer.convert.self_forcing import convert_self_forcing
    from composer.testing import build_tiny_wan

    base = build_tiny_wan(folder / "base", **preset.model)
    checkpoint = write_self_forcing_checkpoint(base, folder / "self_forcing.pt")
    return convert_self_forcing(checkpoint, base, folder / "causal", settings=settings)


# -- measuring ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Video:
    height: int
    width: int
    num_frames: int
    guidance_scale: float = 1.0  # > 1: CFG, a doubled batch over a cache of twice the batch


@dataclass
class Run:
    """The profile of one streamed video (from its CausalStats and VideoChunks)."""

    block_s: list[float]
    decode_s: list[float]
    time_to_first_frame_s: float
    total_s: float
    frames: int
    frames_per_second: float  # end to end: frames / total_s
    kv_cache_bytes: int

    @property
    def denoise_frames_per_second(self) -> float:
        return self.frames / sum(self.block_s)


def stream_once(gen: VideoGenerator, video: Video, kv_cache: bool) -> tuple[Run, torch.Tensor]:
    """Stream one video to the end; its profile and final latents [B, C, F, h, w] (on the CPU)."""
    stream = gen.stream_video(
        PROMPT, height=video.height, width=video.width, num_frames=video.num_frames, seed=SEED, kv_cache=kv_cache,
        guidance_scale=video.guidance_scale, negative_prompt="",
        rollout_blocks=video.num_frames,  # more blocks than the video has: one rollout, one cache, as measured
    )
    chunks = list(stream)
    stats = stream.stats
    run = Run(
        block_s=list(stats.block_seconds), decode_s=[c.decode_seconds for c in chunks],
        time_to_first_frame_s=stats.time_to_first_frame, total_s=stats.total_seconds, frames=stats.frames,
        frames_per_second=stats.frames_per_second, kv_cache_bytes=stats.kv_cache_bytes,
    )
    return run, stream.latents.float().cpu()


def time_modes(gen: VideoGenerator, video: Video, repeats: int) -> tuple[dict[str, list[Run]], float]:
    """One warmup stream per mode, then `repeats` each in alternating order; the runs per mode and the max abs
    difference between the two modes' final latents."""
    latents: dict[str, torch.Tensor] = {}
    for name, kv_cache in MODES.items():
        _, latents[name] = stream_once(gen, video, kv_cache)
    runs: dict[str, list[Run]] = {name: [] for name in MODES}
    names = list(MODES)
    for i in range(repeats):
        for name in names if i % 2 == 0 else reversed(names):
            run, latents[name] = stream_once(gen, video, MODES[name])
            runs[name].append(run)
    max_diff = (latents["cached"] - latents["recompute"]).abs().max().item()
    return runs, max_diff


def per_block(runs: list[Run], stat: Callable[[list[float]], float]) -> list[float]:
    """`stat` over the runs of each block index's latency."""
    return [stat([r.block_s[i] for r in runs]) for i in range(len(runs[0].block_s))]


def median_of(runs: list[Run], figure: Callable[[Run], float]) -> float:
    return statistics.median(figure(r) for r in runs)


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


# -- the model's causal layout --------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """How the benchmark's video splits into blocks, and what each block's passes see."""

    frames_per_block: int
    blocks: int
    tokens_per_frame: int
    window: int | None  # local_attn_size in latent frames; None: global attention
    sink: int

    def attended(self, block: int) -> int:
        """Latent frames the passes of `block` attend to (its own included), in either mode."""
        end = (block + 1) * self.frames_per_block
        return end if self.window is None else min(end, self.window)

    def describe(self) -> str:
        attention = "global attention" if self.window is None else f"rolling window {self.window}, sink {self.sink}"
        n = self.frames_per_block
        return f"{self.blocks} blocks of {n} latent frames ({self.blocks * n} in all), {attention}"


def model_layout(gen: VideoGenerator, video: Video, blocks: int) -> Layout:
    cfg = gen.pipeline.config
    transformer = gen.pipeline.modules["transformer"]
    spatial = gen.pipeline.modules["vae"].config.scale_factor_spatial
    return Layout(
        frames_per_block=cfg.num_frames_per_block, blocks=blocks,
        tokens_per_frame=transformer.tokens_per_frame(video.height // spatial, video.width // spatial),
        window=None if cfg.local_attn_size == -1 else cfg.local_attn_size, sink=cfg.sink_size,
    )


def expected_kv_bytes(gen: VideoGenerator, layout: Layout, guidance_scale: float = 1.0) -> int:
    """KVCacheSpec.nbytes for this model and video (batch 1; 2 rows with CFG), to check the allocated cache
    against."""
    from composer.cache import KVCacheSpec

    transformer = gen.pipeline.modules["transformer"]
    cfg = transformer.config
    spec = KVCacheSpec(
        num_layers=cfg.num_layers, batch_size=2 if guidance_scale > 1 else 1, num_heads=cfg.num_attention_heads,
        head_dim=cfg.attention_head_dim,
        tokens_per_frame=layout.tokens_per_frame, capacity_frames=layout.blocks * layout.frames_per_block,
        window_frames=layout.window, sink_frames=layout.sink,
    )
    return spec.nbytes(transformer.dtype)


# -- tables ---------------------------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def print_per_block(runs: dict[str, list[Run]], layout: Layout) -> list[dict[str, Any]]:
    cached, recompute = runs["cached"], runs["recompute"]
    n = layout.frames_per_block
    print(
        f"\nper-block denoising latency, ms (median and mean over {len(cached)} timed runs per mode; VAE decode "
        f"excluded).\nframes: the block's latent frames; a cached pass runs those {n}, a recompute pass runs "
        "'recomputed' frames; both attend to 'attends' frames"
    )
    cols = (
        f"  {'block':>5} {'frames':>7} {'recomputed':>10} {'attends':>7} {'cached med':>11} {'mean':>7} "
        f"{'recompute med':>14} {'mean':>7} {'recompute/cached':>17}"
    )
    print(cols)
    print("  " + "-" * (len(cols) - 2))
    rows = []
    columns = zip(
        per_block(cached, statistics.median), per_block(cached, statistics.fmean),
        per_block(recompute, statistics.median), per_block(recompute, statistics.fmean),
    )
    for b, (c_med, c_mean, r_med, r_mean) in enumerate(columns):
        frames = f"{b * n}-{(b + 1) * n - 1}"
        print(
            f"  {b:>5} {frames:>7} {(b + 1) * n:>10} {layout.attended(b):>7} {ms(c_med):>11} {ms(c_mean):>7} "
            f"{ms(r_med):>14} {ms(r_mean):>7} {r_med / c_med:>16.2f}x"
        )
        rows.append({
            "block": b, "recompute_frames": (b + 1) * n, "attended_frames": layout.attended(b),
            "cached_median_s": c_med, "cached_mean_s": c_mean,
            "recompute_median_s": r_med, "recompute_mean_s": r_mean, "ratio_recompute_over_cached": r_med / c_med,
        })
    return rows


def summarize(runs: list[Run]) -> dict[str, float]:
    """Medians over the runs of each whole-video figure."""
    return {
        "block_mean_s": median_of(runs, lambda r: statistics.fmean(r.block_s)),
        "first_block_s": median_of(runs, lambda r: r.block_s[0]),
        "last_block_s": median_of(runs, lambda r: r.block_s[-1]),
        "last_over_first": median_of(runs, lambda r: r.block_s[-1] / r.block_s[0]),
        "time_to_first_frame_s": median_of(runs, lambda r: r.time_to_first_frame_s),
        "total_s": median_of(runs, lambda r: r.total_s),
        "frames_per_second": median_of(runs, lambda r: r.frames_per_second),
        "denoise_frames_per_second": median_of(runs, lambda r: r.denoise_frames_per_second),
        "decode_per_block_s": median_of(runs, lambda r: statistics.median(r.decode_s)),
        "kv_cache_bytes": runs[0].kv_cache_bytes,
    }


def print_summary(summary: dict[str, dict[str, float]], frames: int) -> None:
    """Rows: figures; columns: modes and the cache's gain (> 1: cached better)."""
    c, r = summary["cached"], summary["recompute"]
    rows: list[tuple[str, str, str, str]] = []
    for key, label in (
        ("block_mean_s", "block latency, mean of blocks"), ("first_block_s", "first block"),
        ("last_block_s", "last block"), ("time_to_first_frame_s", "time to first frame"),
        ("total_s", f"total ({frames} frames)"),
    ):
        rows.append((label, format_time(c[key]), format_time(r[key]), f"{r[key] / c[key]:.2f}x"))
    rows.insert(3, ("last / first block", f"{c['last_over_first']:.2f}", f"{r['last_over_first']:.2f}", ""))
    for key, label in (
        ("frames_per_second", "frames/s, end to end"), ("denoise_frames_per_second", "frames/s, denoising only"),
    ):
        rows.append((label, f"{c[key]:.1f}", f"{r[key]:.1f}", f"{c[key] / r[key]:.2f}x"))
    decode = format_time(c["decode_per_block_s"]), format_time(r["decode_per_block_s"])
    rows.append(("VAE decode per block", *decode, ""))
    rows.append(("KV cache", format_bytes(c["kv_cache_bytes"]), format_bytes(r["kv_cache_bytes"]), ""))
    print("\nsummary (medians over the runs; cache gain > 1: the cached mode is better)")
    cols = f"  {'':<31} {'cached':>10} {'recompute':>10} {'cache gain':>11}"
    print(cols)
    print("  " + "-" * (len(cols) - 2))
    for label, cached, recompute, gain in rows:
        print(f"  {label:<31} {cached:>10} {recompute:>10} {gain:>11}")


def wan_kv_table() -> list[dict[str, Any]]:
    """KV cache sizes of Wan2.1-T2V-1.3B at 480x832 (bf16, batch 1), from KVCacheSpec.nbytes."""
    from composer.cache import KVCacheSpec

    tokens = (WAN_HEIGHT // WAN_VAE_STRIDE // WAN_PATCH) * (WAN_WIDTH // WAN_VAE_STRIDE // WAN_PATCH)
    configs: list[tuple[str, int, int | None, int]] = [
        (f"global, {f} latent frames ({WAN_VAE_TEMPORAL * (f - 1) + 1} video frames)", f, None, 0)
        for f in WAN_GLOBAL_FRAMES
    ]
    configs += [(f"local_attn_size {w}, sink {s} (any length)", w, w, s) for w, s in WAN_WINDOWS]
    rows = []
    for label, capacity, window, sink in configs:
        spec = KVCacheSpec(batch_size=1, tokens_per_frame=tokens, capacity_frames=capacity, window_frames=window,
                           sink_frames=sink, **WAN_1_3B)
        nbytes = spec.nbytes(torch.bfloat16)
        rows.append({"attention": label, "frames_held": spec.slots, "tokens_held": spec.slots * tokens,
                     "kv_cache_bytes": nbytes, "per_layer_bytes": nbytes // spec.num_layers})
    cfg = WAN_1_3B
    print(
        f"\nKV cache memory of Wan2.1-T2V-1.3B ({cfg['num_layers']} layers, {cfg['num_heads']} heads x "
        f"{cfg['head_dim']}, bf16, batch 1, {WAN_HEIGHT}x{WAN_WIDTH} -> {tokens} tokens per latent frame):\n"
        "COMPUTED with KVCacheSpec.nbytes (keys + values, all layers), not measured"
    )
    cols = f"  {'attention':<50} {'frames held':>11} {'tokens held':>11} {'KV cache':>10} {'per layer':>10}"
    print(cols)
    print("  " + "-" * (len(cols) - 2))
    for row in rows:
        print(
            f"  {row['attention']:<50} {row['frames_held']:>11} {row['tokens_held']:>11} "
            f"{format_bytes(row['kv_cache_bytes']):>10} {format_bytes(row['per_layer_bytes']):>10}"
        )
    return rows


# -- command line ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model sizes and video size (default tiny)")
    p.add_argument("--blocks", type=int, default=8, help="blocks to generate (default 8)")
    p.add_argument(
        "--frames-per-block", type=int, default=None,
        help=f"latent frames per block (default {FRAMES_PER_BLOCK}, Self-Forcing's)",
    )
    p.add_argument("--height", type=int, default=None, help="video height (default: the preset's)")
    p.add_argument("--width", type=int, default=None, help="video width (default: the preset's)")
    p.add_argument(
        "--window", type=int, default=None,
        help="local_attn_size in latent frames (sink included): rolling-window attention (default: global)",
    )
    p.add_argument("--sink", type=int, default=None, help="sink_size: first frames kept in the window (default 0)")
    p.add_argument(
        "--guidance-scale", type=float, default=1.0,
        help="CFG scale (default 1: none, as Self-Forcing samples); > 1 doubles the batch and the KV cache",
    )
    p.add_argument("--repeats", type=int, default=3, help="timed streams per mode after 1 warmup each (default 3)")
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda when available, else cpu"
    )
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="DiT precision (the rest stays fp32)")
    p.add_argument(
        "--threads", type=int, default=None,
        help="torch intra-op CPU threads (default: torch's choice); 1 is steadier on a busy machine",
    )
    p.add_argument(
        "--model-path", type=Path, default=None,
        help="existing causal folder (its own frames per block, window and sink)",
    )
    p.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    for name in ("blocks", "repeats", "threads", "frames_per_block", "height", "width"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("height", "width"):
        if getattr(args, name) is not None and getattr(args, name) % 16:
            p.error(f"--{name} must be a multiple of 16 (VAE stride 8 x patch 2)")
    if args.model_path is not None:
        given = [f for f in ("frames_per_block", "window", "sink") if getattr(args, f) is not None]
        if given:
            p.error(f"--{given[0].replace('_', '-')} is a conversion setting: a --model-path folder has its own")
    if args.sink is not None and args.window is None:
        p.error("--sink needs --window")
    if args.window is not None:  # CausalSettings.check's rules, checked before minutes of model building
        frames_per_block, sink = args.frames_per_block or FRAMES_PER_BLOCK, args.sink or 0
        if sink < 0:
            p.error("--sink must be >= 0")
        if args.window - sink < frames_per_block:
            p.error(
                f"--window - --sink ({args.window} - {sink}) must be >= the frames per block ({frames_per_block}): "
                "a block must fit in the rolling part of the window"
            )
    return args


def causal_settings(args: argparse.Namespace) -> CausalSettings:
    from composer.convert.self_forcing import CausalSettings

    return CausalSettings(
        num_frames_per_block=args.frames_per_block or FRAMES_PER_BLOCK,
        local_attn_size=-1 if args.window is None else args.window, sink_size=args.sink or 0,
    )


def video_size(args: argparse.Namespace) -> tuple[int, int]:
    preset = PRESETS[args.preset]
    return args.height or preset.height, args.width or preset.width


def reproduce_command(args: argparse.Namespace) -> str:
    """The command line with every setting spelled out (defaults resolved)."""
    height, width = video_size(args)
    cmd = ["python", "benchmarks/causal.py", "--preset", args.preset, "--blocks", str(args.blocks)]
    if args.model_path is None:
        cmd += ["--frames-per-block", str(args.frames_per_block or FRAMES_PER_BLOCK)]
        if args.window is not None:
            cmd += ["--window", str(args.window), "--sink", str(args.sink or 0)]
    cmd += ["--height", str(height), "--width", str(width), "--guidance-scale", f"{args.guidance_scale:g}"]
    cmd += ["--repeats", str(args.repeats)]
    cmd += ["--device", args.device, "--dtype", args.dtype]
    if args.threads is not None:
        cmd += ["--threads", str(args.threads)]
    if args.model_path is not None:
        cmd += ["--model-path", str(args.model_path)]
    if args.json is not None:
        cmd += ["--json", str(args.json)]
    return shlex.join(cmd)


def run(args: argparse.Namespace, model_path: Path) -> dict[str, Any]:
    """Load the model, stream in both modes, print the tables; the results for --json."""
    from composer import VideoGenerator

    start = time.perf_counter()
    gen = VideoGenerator.from_pretrained(
        model_path, device=args.device, dtype=args.dtype, text_encoder_dtype="fp32", progress=False
    )
    load_s = time.perf_counter() - start
    height, width = video_size(args)
    temporal = gen.pipeline.modules["vae"].config.scale_factor_temporal
    latent_frames = args.blocks * gen.pipeline.config.num_frames_per_block
    video = Video(height, width, temporal * (latent_frames - 1) + 1, args.guidance_scale)
    layout = model_layout(gen, video, args.blocks)
    cfg = gen.pipeline.modules["transformer"].config
    steps = len(gen.pipeline.config.denoising_step_list)
    print(
        f"model: {cfg.num_layers} layers, {cfg.num_attention_heads} heads x {cfg.attention_head_dim}, "
        f"ffn {cfg.ffn_dim}; {steps} denoising steps per block; loaded in {load_s:.1f} s\n"
        f"video: {video.num_frames}x{height}x{width}, {layout.describe()}, {layout.tokens_per_frame} tokens per "
        f"latent frame, guidance {args.guidance_scale:g}\n"
        f"{args.dtype} on {args.device} (torch {torch.__version__}, threads {torch.get_num_threads()})"
    )

    runs, max_diff = time_modes(gen, video, args.repeats)
    blocks = print_per_block(runs, layout)
    summary = {name: summarize(mode_runs) for name, mode_runs in runs.items()}
    print_summary(summary, video.num_frames)

    expected = expected_kv_bytes(gen, layout, args.guidance_scale)
    allocated = summary["cached"]["kv_cache_bytes"]
    verdict = "matches" if allocated == expected else "DIFFERS from"
    print(
        f"\nKV cache allocated {format_bytes(allocated)} ({allocated} B) {verdict} KVCacheSpec.nbytes ({expected} B)"
    )
    checked = args.dtype == "fp32"
    # CFG's g c - (g - 1) u scales rounding differences of c and u by up to 2g - 1
    tolerance = LATENTS_TOLERANCE * max(1.0, 2 * args.guidance_scale - 1)
    latents_ok = not checked or max_diff <= tolerance
    check = f"<= {tolerance:g}: {'ok' if latents_ok else 'FAILED'}" if checked else "no tolerance in bf16"
    print(f"latents, cached vs recompute: max abs diff {max_diff:.2e} ({check})")

    return {
        "model": {
            "num_layers": cfg.num_layers, "num_heads": cfg.num_attention_heads, "head_dim": cfg.attention_head_dim,
            "ffn_dim": cfg.ffn_dim, "denoising_steps": steps,
        },
        "layout": {
            "frames_per_block": layout.frames_per_block, "blocks": layout.blocks,
            "tokens_per_frame": layout.tokens_per_frame, "local_attn_size": layout.window, "sink_size": layout.sink,
        },
        "video": {"num_frames": video.num_frames, "height": height, "width": width},
        "load_s": load_s, "torch_threads": torch.get_num_threads(),
        "per_block": blocks,
        "block_seconds": {name: [r.block_s for r in mode_runs] for name, mode_runs in runs.items()},
        "summary": summary,
        "kv_cache_bytes_expected": expected,
        "latents_max_abs_diff": max_diff, "latents_ok": latents_ok,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_libraries()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    load_before = warn_if_busy("before the benchmark")
    command = reproduce_command(args)
    with tempfile.TemporaryDirectory(prefix="causal-bench-") as tmp:
        if args.model_path is not None:
            model_path = args.model_path
        else:
            start = time.perf_counter()
            model_path = build_causal_model(PRESETS[args.preset], causal_settings(args), Path(tmp))
            print(f"built the {args.preset} causal model in {time.perf_counter() - start:.1f} s")
        results = run(args, model_path)
    load_after = warn_if_busy("after the benchmark")
    wan_rows = wan_kv_table()

    if load_before is not None:
        print(f"\nload average {load_before:.1f} -> {load_after:.1f} on {os.cpu_count()} CPUs")
    print(f"\nreproduce: {command}")
    if args.json is not None:
        context = {
            "preset": args.preset, "model_path": str(args.model_path) if args.model_path else None,
            "device": args.device, "dtype": args.dtype, "repeats": args.repeats, "torch": torch.__version__,
            "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "load_avg_1min": {"before": load_before, "after": load_after},
        }
        payload = {"context": context, "command": command, **results, "wan2_1_1_3b_kv_computed": wan_rows}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if results["latents_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
