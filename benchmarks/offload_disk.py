"""Benchmark the disk tier of weight offloading: peak host memory of loading a Wan transformer and running one
forward, with its blocks read from the memory-mapped safetensors files (`offload = disk`) against eager loading.

What it measures. A randomly initialised Wan2.1 transformer (diffusers' `WanTransformer3DModel`, written with
`save_pretrained` in `--save-dtype`; default 20 blocks of width 1024: ~0.36 B parameters, 1.4 GB in fp32) is
loaded by composer in `--dtype` and run once on a fixed, seeded input, each mode in a fresh subprocess:

- eager: `ComposerModelLoader().load(...)`, every weight read (on the CPU, safetensors' own memory map:
  the pages of every block end up charged to the process once the forward has touched them);
- disk: `composer.accel.disk.load_with_blocks_on_disk(...)`: only the non-block weights read; each block
  read from the map when its turn comes (prefetch 1) and its pages released (madvise) after use.

Per mode it reports peak RSS (`resource.getrusage(RUSAGE_SELF).ru_maxrss`, file-backed pages included), the
RSS after imports (the interpreter + torch baseline, the same in both), load and forward seconds; then the
peak RSS ratio, the peak above the baseline for both, the time ratio (load + forward, disk / eager) and the
max abs difference of the outputs (expected 0 on the CPU: the same weights, the same kernels; the script exits
with status 1 above 1e-5). With `--save-dtype bf16 --dtype fp32` the disk tier converts each block as it is
read (the other code path: converted copies, the file pages released at once).

Run (from the repository root; the model is written to a temporary folder and deleted afterwards unless
`--model-dir` names one to keep):

    python benchmarks/offload_disk.py
    python benchmarks/offload_disk.py --save-dtype bf16 --dtype fp32
    python benchmarks/offload_disk.py --no-release                         # disk tier without madvise
    python benchmarks/offload_disk.py --layers 4 --dim 256 --ffn 1024      # a quick check
    python benchmarks/offload_disk.py --device cuda --dtype bf16           # GPU host: RSS of the host side
    python benchmarks/offload_disk.py --released wan2.1-t2v-14b --save-dtype bf16 --dtype bf16 --modes disk \
        --latent 8 --text-len 16                                            # the real 14B, from disk, on a 24 GB host
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def rss_mib() -> float:
    with open("/proc/self/statm") as f:  # resident pages now (Linux)
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


def write_model(args) -> None:
    import torch
    from diffusers import WanTransformer3DModel

    if args.released:  # the release's config at full size, written a tensor at a time (composer.testing.released)
        from composer.testing.released import write_released_transformer

        params = write_released_transformer(args.released, args.model_dir, getattr(torch, DTYPES[args.save_dtype]))
        print(json.dumps({"params": params}))
        return

    torch.manual_seed(0)
    heads = args.dim // 64
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=64, in_channels=16, out_channels=16,
        text_dim=args.text_dim, freq_dim=256, ffn_dim=args.ffn, num_layers=args.layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
    ).to(getattr(torch, DTYPES[args.save_dtype]))
    model.save_pretrained(args.model_dir, max_shard_size="100GB")
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"params": params}))


def measure(args) -> None:
    import torch

    from composer.accel.disk import load_with_blocks_on_disk
    from composer.loader.components import ComposerModelLoader
    from composer.loader.model_index import ComponentSpec
    from composer.registry.models import get_model_class

    get_model_class("WanTransformer3DModel")  # model code imported before the baseline, in both modes

    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, DTYPES[args.dtype])
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 16, args.frames, args.latent, args.latent, generator=g)
    text = torch.randn(1, args.text_len, args.text_dim, generator=g)
    baseline = rss_mib()
    start = time.perf_counter()
    folder = Path(args.model_dir)
    if args.worker == "eager":
        model = ComposerModelLoader().load(folder, ComponentSpec("transformer", "diffusers", ""), device, dtype)
    else:
        if args.no_release:  # what the page release saves: keep every page the blocks touched
            from composer.accel.disk import MappedSafetensors

            MappedSafetensors.release = lambda self, start, end: None
        model, _ = load_with_blocks_on_disk(folder, device, dtype, prefetch=1)
    load_s = time.perf_counter() - start
    after_load = rss_mib()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model(latents.to(device, dtype), torch.tensor([500.0], device=device), text.to(device, dtype))
        out = out.float().cpu()
    forward_s = time.perf_counter() - start
    torch.save(out, args.out)
    print(json.dumps({
        "baseline_mib": baseline, "after_load_mib": after_load, "after_forward_mib": rss_mib(),
        "peak_mib": peak_rss_mib(), "load_s": load_s, "forward_s": forward_s,
    }))


def run_worker(args, mode: str, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--worker", mode, "--out", str(out)] + [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
        if k in ("model_dir", "dtype", "device", "threads", "frames", "latent", "text_len", "text_dim")
    ] + (["--no-release"] if args.no_release else [])
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(Path.cwd())})
    if result.returncode != 0:
        sys.exit(f"{mode} run failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", choices=["write", "eager", "disk"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default=None, help="where to write the model (default: a temp folder, deleted)")
    parser.add_argument("--released", default=None,
                        help="write a released transformer config at full size instead (e.g. wan2.1-t2v-14b: 28 GB in "
                             "bf16, never held in memory; --modes disk where it does not fit the host)")
    parser.add_argument("--modes", default="eager,disk", help="eager,disk (the default) or one of them")
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--dim", type=int, default=1024, help="hidden size (heads of 64)")
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--text-dim", type=int, default=4096)
    parser.add_argument("--save-dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="the dtype the model runs in")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--frames", type=int, default=1, help="latent frames of the input")
    parser.add_argument("--latent", type=int, default=32, help="latent height = width (tokens: (latent/2)^2 per frame)")
    parser.add_argument("--text-len", type=int, default=64)
    parser.add_argument("--no-release", action="store_true",
                        help="disk tier without releasing a block's pages after use (to see what that saves)")
    args = parser.parse_args()
    if args.worker == "write":
        return write_model(args)
    if args.worker:
        return measure(args)

    keep = args.model_dir is not None
    tmp = Path(tempfile.mkdtemp(prefix="offload-disk-"))
    args.model_dir = args.model_dir or str(tmp / "transformer")
    try:
        if not (Path(args.model_dir) / "config.json").exists():
            cmd = [sys.executable, __file__, "--worker", "write"] + [
                f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                if k in ("model_dir", "layers", "dim", "ffn", "text_dim", "save_dtype", "released") and v is not None
            ]
            written = subprocess.run(cmd, capture_output=True, text=True, check=True)
            params = json.loads(written.stdout.strip().splitlines()[-1])["params"]
        else:
            params = None
        size = sum(f.stat().st_size for f in Path(args.model_dir).glob("*.safetensors"))
        modes = [m for m in ("eager", "disk") if m in args.modes.split(",")]
        results = {mode: run_worker(args, mode, tmp / f"{mode}.pt") for mode in modes}
        import torch

        diff = (float((torch.load(tmp / "eager.pt") - torch.load(tmp / "disk.pt")).abs().max())
                if len(modes) == 2 else None)
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)
    what = args.released or f"{args.layers} blocks x width {args.dim}"
    print(f"model: {what}, {params or '?'} params, {size / 2**20:.0f} MiB on disk "
          f"({args.save_dtype}), run in {args.dtype} on {args.device}, {args.threads} threads")
    if diff is None:
        for mode, r in results.items():
            print(f"{mode}: peak RSS {r['peak_mib']:.0f} MiB ({r['peak_mib'] - r['baseline_mib']:.0f} above the "
                  f"{r['baseline_mib']:.0f} MiB baseline), after load {r['after_load_mib']:.0f} MiB, load "
                  f"{r['load_s']:.2f} s, forward {r['forward_s']:.2f} s")
        return
    e, d = results["eager"], results["disk"]
    print(f"{'mode':6} {'peak RSS':>10} {'after load':>11} {'baseline':>9} {'load s':>7} {'forward s':>10}")
    for mode, r in results.items():
        print(f"{mode:6} {r['peak_mib']:8.0f} MiB {r['after_load_mib']:7.0f} MiB {r['baseline_mib']:5.0f} MiB "
              f"{r['load_s']:7.2f} {r['forward_s']:10.2f}")
    over = [r["peak_mib"] - r["baseline_mib"] for r in (e, d)]
    print(f"peak RSS disk / eager: {d['peak_mib'] / e['peak_mib']:.2f} (above the baseline: {over[1]:.0f} vs "
          f"{over[0]:.0f} MiB, {over[1] / over[0]:.2f})")
    print(f"time (load + forward) disk / eager: {(d['load_s'] + d['forward_s']) / (e['load_s'] + e['forward_s']):.2f}")
    print(f"max abs diff of the outputs: {diff:.3g}")
    if diff > 1e-5:
        sys.exit(1)


if __name__ == "__main__":
    main()
