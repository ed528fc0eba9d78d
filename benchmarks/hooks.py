"""Benchmark the runtime hooks on one model: LoRA (none / unfused / fused), offload (none / model / layerwise /
disk) and torch.compile (eager / regional / full), each against the plain run of the same request.

Every configuration runs in a fresh subprocess (so its peak memory is its own): it loads the model with that
runtime setting, makes one warmup video (for compile: the cold start, compilation included), then `--repeats`
timed videos. Reported per configuration: load time, first video, steady-state median per video and of its
denoising stage (where the hooks act; at small sizes the VAE decode dominates the video) with their ratios to
the plain run (> 1: slower), peak memory (CUDA: max_memory_allocated; CPU: peak RSS of the process), and the
max abs difference of the final latents from the plain run (the exactness check: <= 1e-5 expected for LoRA
fused vs unfused and offload, <= 1e-4 for compile in fp32).

On a CPU machine offload moves nothing (the device is the host): only the disk tier changes memory there, and
its figure is the one to read; on a GPU every mode's device memory and time are the point.

    python benchmarks/hooks.py                          # the mid preset, CPU fp32
    python benchmarks/hooks.py --device cuda --dtype bf16 --preset large
    python benchmarks/hooks.py --only lora-unfused,lora-fused --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

PRESETS = {
    # 8 layers of width 512 (hidden 8 x 64, ffn 2048): ~30M DiT parameters; 9 frames of 128x128 (256 tokens)
    "mid": dict(model=dict(num_layers=8, num_heads=8, head_dim=64, ffn_dim=2048, text_dim=64, text_heads=4,
                           text_ff=128), video=dict(num_frames=9, height=128, width=128), steps=4),
    # 20 layers of width 1024: ~350M parameters (1.3 GB in fp32); for a GPU or a patient CPU
    "large": dict(model=dict(num_layers=20, num_heads=16, head_dim=64, ffn_dim=4096, text_dim=64, text_heads=4,
                             text_ff=128), video=dict(num_frames=17, height=256, width=256), steps=4),
}
CONFIGS = {
    "plain": {},
    "lora-unfused": {"lora": True},
    "lora-fused": {"lora": True, "lora_fuse": True},
    "offload-model": {"offload": "model"},
    "offload-layerwise": {"offload": "layerwise"},
    "offload-disk": {"offload": "disk"},
    "compile-regional": {"compile": "regional"},
    "compile-full": {"compile": "full"},
}
PROMPT, NEGATIVE, SEED, GUIDANCE = "a red circle moving left", "blurry", 0, 5.0


def write_lora(model_dir: Path, path: Path, rank: int) -> Path:
    """A random rank-`rank` adapter on every block linear, in diffusers naming."""
    import torch
    from safetensors.torch import save_file

    from composer import VideoGenerator

    model = VideoGenerator.from_pretrained(model_dir, device="cpu", dtype="fp32", progress=False).pipeline.modules[
        "transformer"]
    g = torch.Generator().manual_seed(0)
    tensors = {}
    names = {"attn1.to_out": "attn1.to_out.0", "attn2.to_out": "attn2.to_out.0", "ffn.fc_in": "ffn.net.0.proj",
             "ffn.fc_out": "ffn.net.2"}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("blocks."):
            block, layer = name.split(".", 2)[1], name.split(".", 2)[2]
            key = f"transformer.blocks.{block}.{names.get(layer, layer)}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=g) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=g) * 0.02
    save_file(tensors, str(path))
    return path


def child(args: argparse.Namespace) -> None:
    """One configuration: load, warm up, time; prints one JSON line."""
    import torch

    from composer import VideoGenerator

    if args.threads:
        torch.set_num_threads(args.threads)
    config = CONFIGS[args.config]
    runtime = {k: v for k, v in config.items() if k != "lora"}
    if config.get("lora"):
        runtime["lora_path"] = [args.lora]
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    start = time.perf_counter()
    gen = VideoGenerator.from_pretrained(args.model, device=args.device, dtype=args.dtype, progress=False, **runtime)
    load_s = time.perf_counter() - start
    request = dict(negative_prompt=NEGATIVE, guidance_scale=GUIDANCE, seed=SEED,
                   num_inference_steps=args.steps, **PRESETS[args.preset]["video"])

    def video():
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = gen.generate_video(PROMPT, **request)
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0, result

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    first_s, result = video()
    times, denoise = [], []
    for _ in range(args.repeats):
        seconds, timed = video()
        times.append(seconds)
        denoise.append(timed.timings["DenoisingStage"])
    peak = (torch.cuda.max_memory_allocated() if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) / 2**20
    torch.save(result.latents, args.latents)
    print(json.dumps({"config": args.config, "load_s": load_s, "first_s": first_s, "times_s": times,
                      "denoise_s": denoise, "peak_mib": peak, "memory": "max_memory_allocated" if cuda else "peak RSS"}))


def parent(args: argparse.Namespace) -> None:
    import torch

    from composer.testing import build_tiny_wan

    preset = PRESETS[args.preset]
    names = ["plain", *[n for n in (args.only.split(",") if args.only else CONFIGS) if n != "plain"]]
    with tempfile.TemporaryDirectory(prefix="hooks-bench-") as tmp:
        tmp = Path(tmp)
        model = build_tiny_wan(tmp / "model", **preset["model"])
        lora = write_lora(model, tmp / "lora.safetensors", rank=args.rank)
        rows = {}
        for name in names:
            latents = tmp / f"{name}.pt"
            cmd = [sys.executable, __file__, "--child", name, "--model", str(model), "--lora", str(lora),
                   "--latents", str(latents), "--preset", args.preset, "--device", args.device, "--dtype",
                   args.dtype, "--repeats", str(args.repeats), "--steps", str(args.steps or preset["steps"])]
            if args.threads:
                cmd += ["--threads", str(args.threads)]
            # a fresh inductor cache per run: 'first' is a true cold start, not a read of an earlier run's kernels
            env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TORCHINDUCTOR_CACHE_DIR": str(tmp / f"inductor-{name}")}
            out = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if out.returncode:
                print(f"{name}: failed\n{out.stderr[-2000:]}", file=sys.stderr)
                continue
            rows[name] = json.loads(out.stdout.strip().splitlines()[-1])
            rows[name]["max_abs_diff"] = (torch.load(latents) - torch.load(tmp / "plain.pt")).abs().max().item()
            print(f"  ran {name}", file=sys.stderr, flush=True)
    base = statistics.median(rows["plain"]["times_s"])
    base_denoise = statistics.median(rows["plain"]["denoise_s"])
    video = preset["video"]
    m = preset["model"]
    print(f"\nmodel: {m['num_layers']} layers, hidden {m['num_heads'] * m['head_dim']}, ffn {m['ffn_dim']}; video "
          f"{video['num_frames']}x{video['height']}x{video['width']}, {args.steps or preset['steps']} steps, CFG "
          f"{GUIDANCE}; {args.dtype} on {args.device}; LoRA rank {args.rank} on every block linear; "
          f"median of {args.repeats} videos after 1 warmup")
    print(f"{'config':<18} {'load':>7} {'first':>8} {'video':>8} {'vs plain':>9} {'denoise':>8} {'vs plain':>9} "
          f"{'peak MiB':>9}  max |diff|")
    for name, r in rows.items():
        median, den = statistics.median(r["times_s"]), statistics.median(r["denoise_s"])
        print(f"{name:<18} {r['load_s']:>6.2f}s {r['first_s']:>7.2f}s {median:>7.3f}s {median / base:>8.2f}x "
              f"{den:>7.3f}s {den / base_denoise:>8.2f}x {r['peak_mib']:>9.0f}  {r['max_abs_diff']:.1e}")
    print(f"(medians; video: the whole generation, denoise: its denoising stage, where the hooks act; peak memory: "
          f"{rows['plain']['memory']}; 'first' is the warmup video, compilation included for the compile configs)")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")


def main() -> None:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="mid")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto", help="transformer precision (auto: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--rank", type=int, default=16, help="LoRA rank")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads in each run")
    p.add_argument("--only", default=None, help=f"comma-separated configs (of {', '.join(CONFIGS)})")
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--lora", default=None, help=argparse.SUPPRESS)
    p.add_argument("--latents", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.config = args.child
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
