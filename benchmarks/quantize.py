"""Weight-only quantization: int8 (and fp8 where the GPU has it) against the full-precision model, in one process.

For each model: the transformer's weight bytes (all of it, and the blocks' linears that are quantized), the
denoising stage's time as a ratio to the full-precision run (< 1: faster) and the PSNR of the frames against
it. Models: the embedded shapes model and a mid-size random tiny Wan (4 layers, 8 heads x 64, FFN 2048) built
in a temporary folder. Runs unchanged on CPU and CUDA.

    python benchmarks/quantize.py
    python benchmarks/quantize.py --device cuda --dtype bf16 --modes int8,fp8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


def timed_interleaved(gens: list, request: dict, repeats: int) -> list:
    """(last result, median denoising-stage seconds) per generator: one warmup each, then the runs alternate
    between them, so a machine whose load changes during the benchmark slows every variant alike."""
    for gen in gens:
        gen.generate_video(**request)
    runs: list[list] = [[] for _ in gens]
    for _ in range(repeats):
        for i, gen in enumerate(gens):
            runs[i].append(gen.generate_video(**request))
    return [(r[-1], statistics.median(x.timings.get("DenoisingStage", float("nan")) for x in r)) for r in runs]


def weight_bytes(model) -> tuple[int, int]:
    """(all the transformer's parameter and buffer bytes, the repeated blocks' linear weight bytes)."""
    from composer.accel.quantize import linear_weight_bytes, tensor_bytes

    tensors = list(model.parameters()) + list(model.buffers())
    return sum(tensor_bytes(t) for t in tensors), linear_weight_bytes(model)


def bench(label: str, model_path, runtime: dict, request: dict, modes: list[str], repeats: int) -> list[str]:
    from composer import VideoGenerator
    from composer.errors import ConfigError

    gens, refused = {"none": VideoGenerator.from_pretrained(model_path, **runtime)}, {}
    for mode in modes:
        try:
            gens[mode] = VideoGenerator.from_pretrained(model_path, quantize=mode, **runtime)
        except ConfigError as exc:
            refused[mode] = str(exc).split(":")[0]
    results = dict(zip(gens, timed_interleaved(list(gens.values()), request, repeats)))
    sizes = {mode: weight_bytes(gen.pipeline.modules["transformer"]) for mode, gen in gens.items()}
    (exact, t0), (total0, lin0) = results["none"], sizes["none"]
    rows = [f"| {label} | none | {total0 / 2**20:.2f} | {lin0 / 2**20:.2f} | 1.00 ({t0:.2f} s) | exact |"]
    for mode in modes:
        if mode in refused:
            rows.append(f"| {label} | {mode} | - | - | - | refused: {refused[mode]} |")
            continue
        (result, t), (total, lin) = results[mode], sizes[mode]
        rows.append(f"| {label} | {mode} | {total / 2**20:.2f} ({total / total0:.2f}x) | {lin / 2**20:.2f} "
                    f"({lin / lin0:.2f}x) | {t / t0:.2f} ({t:.2f} s) | {psnr(result.frames, exact.frames):.1f} dB |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", default="a red circle moving left")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default="int8,fp8")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mid-size", default="33x128x128", help="frames x height x width for the mid-size model")
    args = parser.parse_args()

    import torch

    from composer.testing import build_tiny_wan

    modes = [m for m in args.modes.split(",") if m]
    runtime = dict(device=args.device, dtype=args.dtype, progress=False)
    request = dict(prompt=args.prompt, seed=args.seed, num_inference_steps=args.steps)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else (
        f"CPU, {torch.get_num_threads()} threads")
    print(f"{device}, torch {torch.__version__}, {args.steps} steps, median of {args.repeats} interleaved runs after a warmup\n")
    print("| model | quantize | transformer MiB | block linears MiB | denoise time ratio | PSNR vs none |")
    print("|---|---|---|---|---|---|")
    for row in bench("shapes-t2v (embedded)", None, runtime, request, modes, args.repeats):
        print(row, flush=True)
    frames, height, width = (int(v) for v in args.mid_size.split("x"))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "mid-wan"
        build_tiny_wan(folder, num_layers=4, num_heads=8, head_dim=64, ffn_dim=2048)
        mid = dict(request, num_frames=frames, height=height, width=width, negative_prompt="", guidance_scale=4.0)
        for row in bench(f"random Wan 4x(8x64), ffn 2048, {args.mid_size}", folder, runtime, mid, modes,
                         args.repeats):
            print(row, flush=True)


if __name__ == "__main__":
    main()
