"""Benchmark composer against diffusers on the same Wan2.1 T2V weights, in one process.

What it measures (both engines load the same model folder once, then run the same work):

1. DiT forward: one transformer forward pass on identical seeded inputs (latents [1, C, F', H', W'], a
   timestep, a 512-token text embedding), under `torch.inference_mode()`. Reports the median time of each
   engine, the ratio diffusers / composer (> 1 means composer is faster), the peak memory of one forward
   and the max abs difference between the two outputs (a sanity check: same weights, same maths).
2. CFG step: one guided step's prediction on the same inputs. composer's engine runs the prompt and the
   negative prompt as one batch-2 call with the text's cross-attention k/v computed once per video (as a
   generation does); `composer-seq` is its sequential mode (two calls); diffusers' WanPipeline makes two
   transformer calls that each project the text again. Reports all three and the ratios.
3. End to end: prompt -> uint8 frames with classifier-free guidance (guidance 5.0), same prompt, negative
   prompt, seed, size and steps. Reports the median wall time of each engine, the ratio, the peak memory of
   one generation and the max difference between the two videos' uint8 frames.

Timing: `time.perf_counter` (with `torch.cuda.synchronize` on CUDA), one warmup call per engine, then
`--repeats` timed calls per engine, interleaved (composer, diffusers, diffusers, composer, ...) so that
load from other processes hits both engines alike. Peak memory is taken after all timing, in one extra
untimed call per engine: on CUDA the rise of `torch.cuda.max_memory_allocated` above what was allocated
before the call; on CPU the rise of the process's resident set size above the RSS before the call (the
kernel's VmHWM high-water mark, reset through /proc/self/clear_refs, or a thread sampling /proc/self/statm
where that reset is not allowed). For the CPU figures glibc is first told to mmap every allocation of
64 KiB or more and to give freed memory back at once, so the RSS follows the live tensors; with glibc's
defaults one engine's figure would depend on what the other left in the heap (seen to vary 2x).

On a CPU machine that other processes keep busy, several torch threads can spend most of their time
waiting for each other (seen: the tiny DiT forward at 4 ms with 1 thread, 450 ms with 2 threads under a
load average of 4 on 2 cores). The script warns when the load average is high; `--threads 1` then gives
steadier numbers.

composer caches prompt encodings; by default the cache is emptied before every composer generation so
both engines do the same work (pass --text-cache to keep it, as a server would).

Run (from the repository root):

    python benchmarks/wan_vs_diffusers.py --preset small
    python benchmarks/wan_vs_diffusers.py --preset tiny --device cpu --dtype fp32 --json bench.json
    python benchmarks/wan_vs_diffusers.py --model-path /path/to/Wan2.1-T2V-1.3B-Diffusers --device cuda \
        --dtype bf16 --steps 10 --skip-e2e

Measured on an H100 (2026-11-23, `--preset medium`): DiT forward 11.4 vs 11.1 ms in fp32 (0.97x), 10.8 vs
12.0 ms in bf16 (1.11x), outputs bit-identical; end to end 118 vs 173 ms in fp32 and 129 vs 188 ms in bf16
(1.46x both; composer's stages: text 15, timesteps 3, denoising 46, decoding 51 ms), the same uint8 frames.

Presets build a randomly initialised model with `composer.testing.build_tiny_wan` in a temporary folder
(`--model-path` uses an existing diffusers-format folder instead; the preset then gives only the video size
and default step count).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from diffusers import WanPipeline

    from composer import VideoGenerator

# Run as a script, `benchmarks/` is sys.path[0]: put the repository root first so `composer` is the
# checkout next to this file whatever is installed.
REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

PROMPT = "a red fox running through fresh snow, cinematic lighting"
NEGATIVE_PROMPT = "blurry, low quality, distorted"
GUIDANCE_SCALE = 5.0
SEED = 0
MIB = 1024**2


@dataclass(frozen=True)
class Preset:
    """Model sizes (overrides of `TinyWanSpec`) and the video generated with them."""

    model: dict[str, Any]
    num_frames: int
    height: int
    width: int
    steps: int


PRESETS: dict[str, Preset] = {
    # build_tiny_wan's defaults: 2 layers, 2 heads x 32, ffn 128, text_dim 32.
    "tiny": Preset(model={}, num_frames=9, height=64, width=64, steps=6),
    "small": Preset(
        model={"num_layers": 4, "num_heads": 4, "head_dim": 32, "ffn_dim": 512},
        num_frames=17, height=128, width=128, steps=4,
    ),
    "medium": Preset(
        model={
            "num_layers": 8, "num_heads": 8, "head_dim": 64, "ffn_dim": 2048,
            "text_dim": 64, "text_heads": 4, "text_ff": 128,
        },
        # 33x256x256 (2304 tokens, 4-6 s a DiT forward here) would run well past 5 minutes on 2 CPU cores;
        # 17 frames (1280 tokens) takes about 3.5 minutes with --threads 1.
        num_frames=17, height=256, width=256, steps=2,
    ),
}


# -- measuring --------------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_call(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds one call of `fn` takes, device work included."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def time_engines(calls: dict[str, Callable[[], Any]], repeats: int, device: torch.device) -> dict[str, list[float]]:
    """One warmup call per engine, then `repeats` timed calls each, interleaved in alternating order."""
    for fn in calls.values():
        timed_call(fn, device)
    names = list(calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        for name in names if i % 2 == 0 else reversed(names):
            times[name].append(timed_call(calls[name], device))
    return times


def _read_status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _rss_bytes_statm() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c") if platform.system() == "Linux" else None
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


def _trim_heap() -> None:
    """Collect garbage and hand freed malloc memory back to the OS, so the next call's RSS rise is its own."""
    gc.collect()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):  # glibc
        libc.malloc_trim(0)


def _fix_mmap_threshold() -> None:
    """Make glibc serve every allocation >= 64 KiB with its own mmap, unmapped on free, and trim the heap on
    every free: the RSS then follows the live tensors, as `max_memory_allocated` does on CUDA. (By default
    glibc raises that threshold as it sees large frees and keeps freed memory, so one engine's peak RSS would
    depend on what ran before it.) Irreversible and a little slower, hence set only after all timing."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's <malloc.h>
        libc.mallopt(m_mmap_threshold, 64 * 1024)
        libc.mallopt(m_trim_threshold, 0)


def _can_reset_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # "5": reset the peak RSS (VmHWM), Linux >= 4.0
        return True
    except OSError:
        return False


@contextmanager
def cpu_peak_rss() -> Iterator[dict[str, float]]:
    """Yields a dict that holds, on exit, `peak_mib`: the rise of the process RSS during the block."""
    out: dict[str, float] = {}
    _trim_heap()
    baseline = _rss_bytes_statm()
    if _can_reset_hwm():
        yield out
        peak = _read_status_kib("VmHWM") * 1024
    else:  # sample the RSS from a thread (torch kernels release the GIL, so it keeps running)
        samples = [baseline]
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                samples.append(_rss_bytes_statm())
                stop.wait(0.001)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            yield out
        finally:
            stop.set()
            thread.join()
        peak = max(max(samples), _rss_bytes_statm())
    out["peak_mib"] = (peak - baseline) / MIB


def peak_memory_mib(fn: Callable[[], Any], device: torch.device) -> float:
    """Peak memory one call of `fn` adds on top of what is already held (device memory on CUDA, RSS on CPU)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        baseline = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - baseline) / MIB
    if not Path("/proc/self/statm").exists():
        return float("nan")
    with cpu_peak_rss() as out:
        fn()
    return out["peak_mib"]


def module_mib(module: torch.nn.Module) -> float:
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers())) / MIB


# -- benchmarks and results -------------------------------------------------------------------------------


@dataclass
class Benchmark:
    """One comparison, ready to run: a zero-argument call per engine doing the same work."""

    name: str
    title: str
    calls: dict[str, Callable[[], Any]]  # "composer" / "diffusers" -> call
    repeats: int
    diff: Callable[[], tuple[float, str]]  # compares the last outputs: (max diff, description)
    weights_mib: dict[str, float] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)
    # Extra details read after the timed calls (before the memory calls), merged into `details`.
    after_timing: Callable[[], dict[str, Any]] | None = None


@dataclass
class EngineResult:
    times_s: list[float]
    peak_mib: float = float("nan")
    weights_mib: float | None = None

    @property
    def median_s(self) -> float:
        return statistics.median(self.times_s)


@dataclass
class Comparison:
    name: str
    title: str
    engines: dict[str, EngineResult]
    max_diff: float
    diff_note: str
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """diffusers median / composer median: > 1 means composer is faster."""
        return self.engines["diffusers"].median_s / self.engines["composer"].median_s

    def to_json(self) -> dict[str, Any]:
        engines = {name: {**asdict(r), "median_s": r.median_s} for name, r in self.engines.items()}
        return {
            "name": self.name, "engines": engines, "ratio_diffusers_over_composer": self.ratio,
            "max_diff": self.max_diff, "diff_note": self.diff_note, **self.details,
        }


def run_benchmarks(benchmarks: list[Benchmark], device: torch.device) -> list[Comparison]:
    """Time every benchmark first, then take every peak memory (the CPU memory mode is set only then)."""
    results = []
    for b in benchmarks:
        times = time_engines(b.calls, b.repeats, device)
        max_diff, note = b.diff()
        details = {**b.details, **(b.after_timing() if b.after_timing else {})}
        engines = {e: EngineResult(times[e], weights_mib=b.weights_mib.get(e)) for e in b.calls}
        results.append(Comparison(b.name, b.title, engines, max_diff, note, details))
    if device.type == "cpu":
        _fix_mmap_threshold()
    for b, result in zip(benchmarks, results):
        for engine, fn in b.calls.items():
            result.engines[engine].peak_mib = peak_memory_mib(fn, device)
    return results


def format_time(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def print_comparison(c: Comparison) -> None:
    print(f"\n{c.title}; median of {len(c.engines['composer'].times_s)}")
    header = f"  {'engine':<12} {'median':>10} {'min':>10} {'max':>10} {'peak MiB':>10}"
    has_weights = any(r.weights_mib is not None for r in c.engines.values())
    print(header + (f" {'weights MiB':>12}" if has_weights else ""))
    for engine, r in c.engines.items():
        row = (
            f"  {engine:<12} {format_time(r.median_s):>10} {format_time(min(r.times_s)):>10} "
            f"{format_time(max(r.times_s)):>10} {r.peak_mib:>10.1f}"
        )
        print(row + (f" {r.weights_mib:>12.1f}" if r.weights_mib is not None else ""))
    print(f"  ratio diffusers/composer: {c.ratio:.2f}x (> 1: composer faster); {c.diff_note}")
    if "composer-seq" in c.engines:
        seq = c.engines["composer-seq"].median_s
        print(f"  composer sequential CFG: {seq / c.engines['composer'].median_s:.2f}x the batched time, "
              f"diffusers/sequential {c.engines['diffusers'].median_s / seq:.2f}x")


def print_summary(results: list[Comparison], context: str, command: str) -> None:
    print(f"\n== summary: {context}")
    cols = (
        f"{'benchmark':<12} {'composer':>10} {'diffusers':>10} {'d/c ratio':>10} "
        f"{'composer MiB':>13} {'diffusers MiB':>14}  max diff"
    )
    print(cols)
    print("-" * len(cols))
    for c in results:
        comp, diff = c.engines["composer"], c.engines["diffusers"]
        print(
            f"{c.name:<12} {format_time(comp.median_s):>10} {format_time(diff.median_s):>10} "
            f"{c.ratio:>9.2f}x {comp.peak_mib:>13.1f} {diff.peak_mib:>14.1f}  {c.diff_note}"
        )
    print("(times: medians; MiB: peak memory a call adds; ratio > 1: composer faster)")
    print(f"\nreproduce: {command}")


# -- engines ----------------------------------------------------------------------------------------------


def build_model(preset: Preset, folder: Path) -> Path:
    from composer.testing import build_tiny_wan

    return build_tiny_wan(folder, **preset.model)


def load_composer(path: Path, device: torch.device, dtype: str) -> VideoGenerator:
    from composer import VideoGenerator

    # Only the DiT in bf16, as diffusers is loaded below: the text encoder stays fp32 (VAE is fp32 anyway).
    return VideoGenerator.from_pretrained(
        path, device=str(device), dtype=dtype, text_encoder_dtype="fp32", progress=False
    )


def load_diffusers(path: Path, device: torch.device, dtype: str) -> WanPipeline:
    import diffusers

    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    transformer = diffusers.WanTransformer3DModel.from_pretrained(
        path, subfolder="transformer", torch_dtype=torch_dtype
    )
    pipe = diffusers.WanPipeline.from_pretrained(path, transformer=transformer)  # the rest in fp32
    assert pipe.transformer.dtype == torch_dtype, pipe.transformer.dtype
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def clear_composer_text_cache(gen: VideoGenerator) -> None:
    """Empty composer's prompt-encoding cache (a private detail: skipped if the stage changes shape)."""
    for stage in gen.pipeline.stages:
        cache = getattr(stage, "_cache", None)
        if hasattr(cache, "clear"):
            cache.clear()


def dit_benchmark(
    gen: VideoGenerator, pipe: WanPipeline, preset: Preset, repeats: int, device: torch.device
) -> Benchmark:
    """One DiT forward on the same seeded inputs (batch 1: one CFG branch)."""
    ours = gen.pipeline.modules["transformer"]
    theirs = pipe.transformer
    config = theirs.config
    dtype = theirs.dtype
    temporal, spatial = pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial
    latent_shape = (
        1, config.in_channels, (preset.num_frames - 1) // temporal + 1,
        preset.height // spatial, preset.width // spatial,
    )
    text_len = gen.pipeline.config.text_encoder_max_length
    generator = torch.Generator("cpu").manual_seed(SEED)
    latents = torch.randn(latent_shape, generator=generator).to(device, dtype)
    text = torch.randn(1, text_len, config.text_dim, generator=generator).to(device, dtype)
    timestep = torch.tensor([500.0], device=device)
    outputs: dict[str, torch.Tensor] = {}

    def run_composer() -> None:
        with torch.inference_mode():
            outputs["composer"] = ours(latents, timestep, text)

    def run_diffusers() -> None:
        with torch.inference_mode():
            outputs["diffusers"] = theirs(latents, timestep, text, return_dict=False)[0]

    def diff() -> tuple[float, str]:
        a, b = outputs["composer"].float(), outputs["diffusers"].float()
        max_abs = (a - b).abs().max().item()
        return max_abs, f"max abs diff {max_abs:.2e} (output max |x| {b.abs().max().item():.2f})"

    patch = config.patch_size
    tokens = latent_shape[2] // patch[0] * (latent_shape[3] // patch[1]) * (latent_shape[4] // patch[2])
    return Benchmark(
        name="DiT forward",
        title=f"DiT forward: latents {list(latent_shape)} ({tokens} tokens), text {text_len} tokens",
        calls={"composer": run_composer, "diffusers": run_diffusers},
        repeats=repeats,
        diff=diff,
        weights_mib={"composer": module_mib(ours), "diffusers": module_mib(theirs)},
        details={"latent_shape": list(latent_shape), "tokens": tokens, "text_len": text_len},
    )


def cfg_step_benchmark(
    gen: VideoGenerator, pipe: WanPipeline, preset: Preset, repeats: int, device: torch.device
) -> Benchmark:
    """One guided denoising step's prediction: composer's engine (prompt and negative prompt as one batch-2
    call, cross-attention k/v computed once per video as a generation does) and its sequential mode, against
    diffusers' WanPipeline step (two transformer calls, the text projected inside every call)."""
    from composer.engine import ClassifierFreeGuidance, DenoisingEngine, ModelInputs

    (engine,) = gen.pipeline.engines
    sequential = DenoisingEngine(engine.transformer, cfg_mode="sequential")
    theirs = pipe.transformer
    config, dtype = theirs.config, theirs.dtype
    temporal, spatial = pipe.vae_scale_factor_temporal, pipe.vae_scale_factor_spatial
    latent_shape = (
        1, config.in_channels, (preset.num_frames - 1) // temporal + 1,
        preset.height // spatial, preset.width // spatial,
    )
    text_len = gen.pipeline.config.text_encoder_max_length
    generator = torch.Generator("cpu").manual_seed(SEED + 1)
    latents = torch.randn(latent_shape, generator=generator).to(device, dtype)
    text = torch.randn(1, text_len, config.text_dim, generator=generator).to(device, dtype)
    negative = torch.randn(1, text_len, config.text_dim, generator=generator).to(device, dtype)
    timestep = torch.tensor([500.0], device=device)
    guidance = ClassifierFreeGuidance(GUIDANCE_SCALE)
    with torch.inference_mode():
        cond, uncond = engine.text_inputs(text), engine.text_inputs(negative)
        merged = ModelInputs.batched([cond, uncond])
    outputs: dict[str, torch.Tensor] = {}

    def run_composer() -> None:
        with torch.inference_mode():
            outputs["composer"] = engine.predict(latents, timestep, cond, uncond, guidance, merged)

    def run_sequential() -> None:
        with torch.inference_mode():
            outputs["composer-seq"] = sequential.predict(latents, timestep, cond, uncond, guidance)

    def run_diffusers() -> None:
        with torch.inference_mode():
            c = theirs(latents, timestep, text, return_dict=False)[0]
            u = theirs(latents, timestep, negative, return_dict=False)[0]
            outputs["diffusers"] = u + GUIDANCE_SCALE * (c - u)

    def diff() -> tuple[float, str]:
        ref = outputs["diffusers"].float()
        batched = (outputs["composer"].float() - ref).abs().max().item()
        seq = (outputs["composer-seq"].float() - ref).abs().max().item()
        return batched, f"max abs diff batched {batched:.2e}, sequential {seq:.2e} (output max |x| {ref.abs().max():.2f})"

    return Benchmark(
        name="CFG step",
        title=f"one CFG step's prediction: latents {list(latent_shape)}, text {text_len} tokens, guidance {GUIDANCE_SCALE}",
        calls={"composer": run_composer, "composer-seq": run_sequential, "diffusers": run_diffusers},
        repeats=repeats,
        diff=diff,
        details={"latent_shape": list(latent_shape), "text_len": text_len},
    )


def e2e_benchmark(
    gen: VideoGenerator, pipe: WanPipeline, preset: Preset, steps: int, repeats: int, text_cache: bool
) -> Benchmark:
    """Prompt -> uint8 frames with CFG, same prompt, negative prompt, seed, size and steps."""
    frames: dict[str, np.ndarray] = {}
    size = {"height": preset.height, "width": preset.width, "num_frames": preset.num_frames}
    stage_timings: list[dict[str, float]] = []

    def run_composer() -> None:
        if not text_cache:
            clear_composer_text_cache(gen)
        res = gen.generate_video(
            PROMPT, negative_prompt=NEGATIVE_PROMPT, num_inference_steps=steps,
            guidance_scale=GUIDANCE_SCALE, seed=SEED, **size,
        )
        frames["composer"] = res.frames
        stage_timings.append(res.timings)

    def run_diffusers() -> None:
        video = pipe(
            PROMPT, negative_prompt=NEGATIVE_PROMPT, num_inference_steps=steps, guidance_scale=GUIDANCE_SCALE,
            generator=torch.Generator("cpu").manual_seed(SEED), output_type="np", **size,
        ).frames[0]
        frames["diffusers"] = (np.asarray(video, dtype=np.float32) * 255).round().clip(0, 255).astype(np.uint8)

    def diff() -> tuple[float, str]:
        a, b = frames["composer"], frames["diffusers"]
        if a.shape != b.shape:
            return float("nan"), f"shape mismatch: composer {a.shape} vs diffusers {b.shape}"
        delta = np.abs(a.astype(np.int16) - b.astype(np.int16))
        return float(delta.max()), f"max uint8 diff {int(delta.max())} ({(delta > 0).mean():.2%} of values differ)"

    def composer_stages() -> dict[str, Any]:
        timed = stage_timings[1:]  # composer's own per-stage split over the timed calls (not the warmup)
        return {"composer_stage_median_s": {k: statistics.median(t[k] for t in timed) for k in timed[0]}}

    video = f"{preset.num_frames}x{preset.height}x{preset.width}"
    return Benchmark(
        name="end-to-end",
        title=f"end to end: {video}, {steps} steps, CFG {GUIDANCE_SCALE}",
        calls={"composer": run_composer, "diffusers": run_diffusers},
        repeats=repeats,
        diff=diff,
        details={"steps": steps, "guidance_scale": GUIDANCE_SCALE, "text_cache": text_cache, **size},
        after_timing=composer_stages,
    )


# -- command line -----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="model sizes and video size (default tiny)")
    p.add_argument("--steps", type=int, default=None, help="denoising steps end to end (default: the preset's)")
    p.add_argument(
        "--repeats", type=int, default=None, help="timed calls per engine after 1 warmup (default 5 DiT, 3 end to end)"
    )
    p.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda when available, else cpu"
    )
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="DiT precision (the rest stays fp32)")
    p.add_argument(
        "--threads", type=int, default=None,
        help="torch intra-op CPU threads (default: torch's choice); 1 is steadier on a busy machine",
    )
    p.add_argument("--model-path", type=Path, default=None, help="existing diffusers Wan2.1 T2V folder")
    p.add_argument("--skip-e2e", action="store_true", help="only the DiT forward benchmark")
    p.add_argument("--text-cache", action="store_true", help="keep composer's prompt-encoding cache between calls")
    p.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.steps is not None and args.steps < 1:
        p.error("--steps must be >= 1")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    return args


def reproduce_command(args: argparse.Namespace, steps: int) -> str:
    """The command line with every setting spelled out (defaults resolved)."""
    cmd = ["python", "benchmarks/wan_vs_diffusers.py", "--preset", args.preset, "--steps", str(steps)]
    if args.repeats is not None:
        cmd += ["--repeats", str(args.repeats)]
    cmd += ["--device", args.device, "--dtype", args.dtype]
    if args.threads is not None:
        cmd += ["--threads", str(args.threads)]
    if args.model_path is not None:
        cmd += ["--model-path", str(args.model_path)]
    cmd += ["--skip-e2e"] if args.skip_e2e else []
    cmd += ["--text-cache"] if args.text_cache else []
    if args.json is not None:
        cmd += ["--json", str(args.json)]
    return shlex.join(cmd)


def quiet_libraries() -> None:
    os.environ.setdefault("COMPOSER_LOG_LEVEL", "WARNING")
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def run(args: argparse.Namespace, model_path: Path) -> tuple[list[Comparison], dict[str, Any]]:
    """Load both engines, run the benchmarks, print the per-benchmark tables."""
    import diffusers

    preset = PRESETS[args.preset]
    device = torch.device(args.device)
    steps = args.steps or preset.steps
    start = time.perf_counter()
    gen = load_composer(model_path, device, args.dtype)
    pipe = load_diffusers(model_path, device, args.dtype)
    cfg = pipe.transformer.config
    context = {
        "preset": args.preset, "model_path": str(args.model_path) if args.model_path else None,
        "model": {
            "num_layers": cfg.num_layers, "num_heads": cfg.num_attention_heads, "head_dim": cfg.attention_head_dim,
            "hidden": cfg.num_attention_heads * cfg.attention_head_dim, "ffn_dim": cfg.ffn_dim,
            "text_dim": cfg.text_dim, "in_channels": cfg.in_channels,
        },
        "video": f"{preset.num_frames}x{preset.height}x{preset.width}", "steps": steps,
        "device": str(device), "dtype": args.dtype, "torch": torch.__version__, "diffusers": diffusers.__version__,
        "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "python": platform.python_version(),
        "load_s": time.perf_counter() - start,
    }
    if device.type == "cuda":
        context["gpu"] = torch.cuda.get_device_name(device)
    m = context["model"]
    print(
        f"model: {m['num_layers']} layers, {m['num_heads']} heads x {m['head_dim']} (hidden {m['hidden']}), "
        f"ffn {m['ffn_dim']}, text_dim {m['text_dim']}; video {context['video']}, {steps} steps; "
        f"{args.dtype} on {device} (torch {torch.__version__}, threads {context['torch_threads']}, "
        f"diffusers {diffusers.__version__}); both engines loaded in {context['load_s']:.1f} s"
    )

    benchmarks = [dit_benchmark(gen, pipe, preset, args.repeats or 5, device),
                  cfg_step_benchmark(gen, pipe, preset, args.repeats or 5, device)]
    if not args.skip_e2e:
        benchmarks.append(e2e_benchmark(gen, pipe, preset, steps, args.repeats or 3, args.text_cache))
    results = run_benchmarks(benchmarks, device)
    for result in results:
        print_comparison(result)
        stages = result.details.get("composer_stage_median_s")
        if stages:
            split = ", ".join(
                f"{k.removesuffix('Stage')} {format_time(v)}" for k, v in stages.items() if k != "total" and v >= 1e-3
            )
            print(f"  composer stages (median): {split}")
    return results, context


def warn_if_busy(when: str) -> float | None:
    """Warn when other processes keep the CPUs busy (timings then mostly measure the contention)."""
    if not hasattr(os, "getloadavg"):
        return None
    load = os.getloadavg()[0]
    cpus = os.cpu_count() or 1
    if load > 0.75 * cpus:
        hint = "" if torch.get_num_threads() == 1 else " (several torch threads then wait on each other: try --threads 1)"
        sys.stdout.flush()
        print(
            f"warning: load average {load:.1f} on {cpus} CPUs {when}: other processes compete for the cores, "
            f"so times are noisy{hint}",
            file=sys.stderr,
            flush=True,
        )
    return load


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_libraries()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    load_before = warn_if_busy("before the benchmark")
    preset = PRESETS[args.preset]
    steps = args.steps or preset.steps
    command = reproduce_command(args, steps)
    with tempfile.TemporaryDirectory(prefix="wan-bench-") as tmp:
        if args.model_path is not None:
            model_path = args.model_path
        else:
            start = time.perf_counter()
            model_path = build_model(preset, Path(tmp) / f"wan-{args.preset}")
            print(f"built the {args.preset} model in {time.perf_counter() - start:.1f} s")
        results, context = run(args, model_path)
    context["load_avg_1min"] = {"before": load_before, "after": warn_if_busy("after the benchmark")}

    model = args.model_path.name if args.model_path is not None else args.preset
    ctx = (
        f"{model}, {context['video']}, {steps} steps, {args.dtype} on {context['device']}, "
        f"torch threads {context['torch_threads']}"
    )
    if load_before is not None:
        ctx += f", load avg {load_before:.1f} -> {context['load_avg_1min']['after']:.1f}"
    print_summary(results, ctx, command)
    if args.json is not None:
        payload = {"context": context, "command": command, "results": [r.to_json() for r in results]}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
