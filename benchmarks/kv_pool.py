"""The paged KV pool's cost per pass against the contiguous KV cache, at a causal model's real cache shape.

A causal block's passes each write their frames' keys/values into every layer's cache and read back the visible
frames for attention. The contiguous `KVCache` reads a view; `PagedKVCache` reads a view too while its extent is one
run of pages (every cache that was not forked), and gathers (`index_select`) when it is scattered (a fragmented
arena, a fork reading shared history). This script times one block's passes (the denoising steps' re-runs and the
clean pass) over a whole rollout for the three, checks they return the same tensors, and prints the ratios and the
memory each holds.

    python benchmarks/kv_pool.py --device cuda        # Self-Forcing 1.3B at 480x832: 30 layers, 12 x 128, 1560
                                                      # tokens/frame, bf16 (about 6 GiB a cache, 24 GiB in all)
    python benchmarks/kv_pool.py --tiny               # small shapes, CPU (CI smoke run)
    python benchmarks/kv_pool.py --layers 2 --frames 9   # the real per-layer shape on a CPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from composer.cache import KVCache, KVCacheSpec  # noqa: E402
from composer.cache.kv_pool import KVPool, PagedKVCache  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rollout_passes(frames: int, block: int, steps: int) -> list[tuple[int, int]]:
    """A causal rollout's passes: per block `steps` denoising passes and one clean pass over its frames."""
    return [(s, min(s + block, frames)) for s in range(0, frames, block) for _ in range(steps + 1)]


def run(cache: KVCache, passes: list[tuple[int, int]], kv: dict[int, tuple[torch.Tensor, torch.Tensor]],
        layers: int, keep: bool = False) -> tuple[float, list]:
    device = cache.device
    seen = []
    sync(device)
    start = time.perf_counter()
    for s, e in passes:
        k, v = kv[e - s]
        with cache.pass_over(s, e - s):
            for i in range(layers):
                ko, vo = cache.layer(i).update(k, v)
                if keep and i == layers - 1:
                    seen.append((ko.clone(), vo.clone()))
    sync(device)
    return time.perf_counter() - start, seen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="bf16 | fp16 | fp32 (default: bf16 on a GPU, fp32 on the CPU)")
    p.add_argument("--tiny", action="store_true", help="small shapes (CPU smoke run)")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens-per-frame", type=int, default=1560, help="480x832: 30 x 52 patches per latent frame")
    p.add_argument("--frames", type=int, default=21, help="latent frames of the rollout (global attention)")
    p.add_argument("--block", type=int, default=3, help="latent frames per block")
    p.add_argument("--steps", type=int, default=4, help="denoising passes per block (then one clean pass)")
    p.add_argument("--rows", type=int, default=2, help="batch rows of the cache (2: batched CFG)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.heads, args.head_dim, args.tokens_per_frame, args.frames = 2, 2, 16, 24, 6
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    spec = KVCacheSpec(num_layers=args.layers, batch_size=args.rows, num_heads=args.heads, head_dim=args.head_dim,
                       tokens_per_frame=args.tokens_per_frame, capacity_frames=args.frames)
    need = 6 * spec.nbytes(dtype)  # the caches, the fragmented arena (2 to 4 extents of spacers), growth's copy
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        import os

        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > 0.8 * free:
        print(f"this run needs about {need / 2**30:.1f} GiB ({spec.nbytes(dtype) / 2**30:.1f} GiB a cache) and "
              f"{free / 2**30:.1f} GiB is free: use --tiny, fewer --layers or --frames", file=sys.stderr)
        return 2
    passes = rollout_passes(args.frames, args.block, args.steps)
    g = torch.Generator(device="cpu").manual_seed(0)
    kv = {}
    for n in sorted({e - s for s, e in passes}):
        shape = (args.rows, n * args.tokens_per_frame, args.heads, args.head_dim)
        kv[n] = (torch.randn(shape, generator=g).to(device, dtype), torch.randn(shape, generator=g).to(device, dtype))

    pool = KVPool(None, device)
    # a fragmented arena: every other extent-sized run taken, then every second one freed
    one_page = KVCacheSpec(args.layers, 1, args.heads, args.head_dim, args.tokens_per_frame, 1)
    spacers = [PagedKVCache(one_page, dtype, device, pool) for _ in range(2 * args.rows * args.frames)]
    arena = spacers[0].arena
    while arena.used < arena.capacity:  # no free run at the end either
        spacers.append(PagedKVCache(one_page, dtype, device, pool))
    for c in spacers[::2]:
        c.close()
    makers = {
        "contiguous KVCache": lambda: KVCache(spec, dtype, device),
        "paged, one run (view)": lambda: PagedKVCache(spec, dtype, device, KVPool(None, device)),
        "paged, scattered (gather)": lambda: PagedKVCache(spec, dtype, device, pool),
    }
    times: dict[str, list[float]] = {name: [] for name in makers}
    outputs = {}
    for r in range(args.repeats + 1):  # the first round warms up (allocations, kernels)
        for name, make in makers.items():
            cache = make()
            if name.startswith("paged, scattered"):
                assert cache.base is None, "the arena was not fragmented"
            elapsed, seen = run(cache, passes, kv, args.layers, keep=(r == 0))
            if r == 0:
                outputs[name] = seen
            else:
                times[name].append(elapsed)
            if hasattr(cache, "close"):
                cache.close()
    ref = outputs["contiguous KVCache"]
    same = all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for name in makers for a, b in zip(outputs[name], ref))
    base = statistics.median(times["contiguous KVCache"])
    print(f"KV cache passes: {args.layers} layers, {args.rows} rows x {args.heads} heads x {args.head_dim}, "
          f"{args.tokens_per_frame} tokens/frame, {args.frames}-frame rollout in blocks of {args.block} "
          f"({len(passes)} passes), {str(dtype).removeprefix('torch.')} on {device}; medians of {args.repeats}")
    print(f"cache memory: {spec.nbytes(dtype) / 2**20:.1f} MiB (the same for all three)")
    print("| cache | seconds per rollout | vs contiguous |")
    print("| --- | --- | --- |")
    for name in makers:
        t = statistics.median(times[name])
        print(f"| {name} | {t:.4f} | {t / base:.2f}x |")
    print(f"outputs identical to the contiguous cache's: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
