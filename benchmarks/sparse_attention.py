"""Sliding-window attention (`attention_backend = sliding_window`) against dense SDPA, in one process.

1. The attention call alone on a token grid: median time of compiled flex_attention under each window, the
   share of query-key pairs the window keeps, the BlockMask's share of skipped 128 x 128 blocks, and the PSNR
   of the output against dense attention (peak = max |dense output|).
2. A whole video on a model (default: the embedded shapes model): the denoising stage's time under each
   window and the PSNR of the frames against the dense (sdpa) video.

    python benchmarks/sparse_attention.py
    python benchmarks/sparse_attention.py --grid 9 30 52 --heads 12 --head-dim 128 --device cuda
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def psnr(ref, out, peak: float) -> float:
    mse = float(((out.double() - ref.double()) ** 2).mean()) if hasattr(out, "double") else float(
        np.mean((out.astype(np.float64) - ref.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * math.log10(peak**2 / mse)


def median_time(fn, repeats: int, sync) -> float:
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def parse_windows(text: str) -> list[tuple[int, int, int] | None]:
    """'full;default;3x8x8' -> windows (None: the backend's default)."""
    out = []
    for item in text.split(";"):
        out.append("full" if item == "full" else None if item == "default" else tuple(int(x) for x in item.split("x")))
    return out


def attention_table(args) -> None:
    import torch
    import torch.nn.functional as F

    from composer.models.attention import resolve_backend
    from composer.models.attention.backends import sliding_window as sw

    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    grid = tuple(args.grid)
    seq = math.prod(grid)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, seq, args.heads, args.head_dim, generator=g).to(device, dtype) for _ in range(3))

    def dense():
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    ref = dense()
    peak = float(ref.abs().max())
    t_dense = median_time(dense, args.repeats, sync)
    print(f"\nattention: grid {grid} ({seq} tokens), {args.heads} heads x {args.head_dim}, {dtype}, {device}; "
          f"median of {args.repeats}")
    print(f"dense SDPA: {t_dense * 1e3:.1f} ms")
    print("| window (f x h x w) | pairs kept | blocks skipped | first call (compile) | time | vs dense | PSNR dB |")
    print("|---|---|---|---|---|---|---|")
    backend = resolve_backend("sliding_window")
    for window in parse_windows(args.windows):
        window = grid if window == "full" else window
        layer = backend.with_window(window)
        resolved = sw.resolve_window(grid, window)
        start = time.perf_counter()
        out = layer(q, k, v, token_grid=grid)
        sync()
        first = time.perf_counter() - start
        t = median_time(lambda layer=layer: layer(q, k, v, token_grid=grid), args.repeats, sync)
        kept = float(sw.window_mask(grid, resolved).float().mean())
        bm = sw.block_mask(grid, resolved, device)[0]
        computed = int(bm.kv_num_blocks.sum()) + (int(bm.full_kv_num_blocks.sum()) if bm.full_kv_num_blocks is not None else 0)
        skipped = 1 - computed / math.ceil(seq / 128) ** 2  # share of 128 x 128 (query, key) blocks never computed
        print(f"| {'x'.join(map(str, resolved))}{' (default)' if window is None else ''} | {kept:.0%} | "
              f"{skipped:.0%} | {first:.1f} s | {t * 1e3:.1f} ms | {t / t_dense:.2f}x | "
              f"{psnr(ref.float(), out.float(), peak):.1f} |")


def video_table(args) -> None:
    from composer import VideoGenerator

    runtime = dict(device=args.device, dtype=args.model_dtype, progress=False)
    request = dict(prompt=args.prompt, seed=0, num_inference_steps=args.steps)

    def run(**extra):
        gen = VideoGenerator.from_pretrained(args.model_path, **runtime, **extra)
        gen.generate_video(**request)  # warmup (compiles flex_attention for this grid)
        results = [gen.generate_video(**request) for _ in range(args.video_repeats)]
        patch = gen.pipeline.modules["transformer"].config.patch_size
        return results[-1], statistics.median(r.timings.get("DenoisingStage", float("nan")) for r in results), patch

    dense, t_dense, patch = run(attention_backend="sdpa")
    lat = dense.latents.shape  # [B, C, F, h, w]
    grid = tuple(n // p for n, p in zip(lat[2:], patch, strict=True))
    print(f"\nvideo: {args.model_path or 'shapes-t2v (embedded)'}, {args.steps} steps, frames {dense.frames.shape}, "
          f"token grid {grid}; denoising stage, median of {args.video_repeats} after a warmup")
    print(f"dense (sdpa): {t_dense:.2f} s")
    print("| window (f x h x w) | denoise | vs dense | PSNR dB (frames) |")
    print("|---|---|---|---|")
    for window in parse_windows(args.video_windows):
        window = list(grid) if window == "full" else window
        extra = {"attention_backend": "sliding_window"}
        if window is not None:
            extra["attention_window"] = list(window)
        result, t, _ = run(**extra)
        from composer.models.attention.backends.sliding_window import resolve_window

        label = "x".join(map(str, resolve_window(grid, window))) + (" (default)" if window is None else "")
        print(f"| {label} | {t:.2f} s | {t / t_dense:.2f}x | {psnr(dense.frames, result.frames, 255.0):.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", type=int, nargs=3, default=[5, 18, 32], help="token grid: frames rows cols")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--windows", default="full;default;3x9x16;3x6x8;1x6x8",
                        help="';'-separated windows FxHxW, 'full' or 'default'")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--model-path", default=None, help="model folder or hub id (default: the shapes model)")
    parser.add_argument("--model-dtype", default="auto")
    parser.add_argument("--prompt", default="a red circle moving left")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--video-windows", default="full;default;3x4x4;1x2x2")
    parser.add_argument("--video-repeats", type=int, default=2)
    parser.add_argument("--skip-video", action="store_true")
    args = parser.parse_args()
    attention_table(args)
    if not args.skip_video:
        video_table(args)


if __name__ == "__main__":
    main()
