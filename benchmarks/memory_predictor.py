"""The memory predictor against measured peaks, over a grid of video sizes (docs/memory.md).

For each size, in a fresh subprocess: the model folder loads, one small warmup video runs, then the measured video:

- CUDA: its `torch.cuda.max_memory_allocated` (weights included: the peak of everything allocated), against the
  prediction: the weights on the device (safetensors headers) + the request's activation peak (the pipeline's
  twin on fake tensors, composer.memory);
- CPU: the rise of the process's peak RSS over its RSS before the video (the weights are already resident, so this
  is the activations and the frames), against the predicted activation peak. glibc keeps freed memory below its
  mmap threshold for reuse, so RSS would measure the allocator's history as much as the tensors: the subprocess runs
  with MALLOC_MMAP_THRESHOLD_=65536 (big blocks mapped and returned on free), as a memory-tight deployment would.

Prints a row per size: predicted, measured, error (predicted / measured - 1), the prediction's own seconds; with
`--json` writes them. Exit status 1 when an error exceeds `--tolerance` (default 0.15).

`--concurrent N`: N requests of each size at once (submit_video, seeds 0..N-1: their steps batched, their decodes
batched), against what a shared budget counts for them (composer.memory.admission): N times each request's held
share plus N times its calls' excess (every request at its peak at once, all its steps in one call).

    python benchmarks/memory_predictor.py                                   # a mid-size random Wan on CPU
    python benchmarks/memory_predictor.py --model-path shapes-t2v --sizes 17x96x96    # a narrow VAE (base 16)
    python benchmarks/memory_predictor.py --vae-base-dim 12 --sizes 9x128x160       # narrower still
    python benchmarks/memory_predictor.py --convolutions "1,12,12,3,128,160,3,0;1,96,96,9,128,160,3,1"
    python benchmarks/memory_predictor.py --model-path /path/to/Wan2.1-T2V-1.3B-Diffusers --device cuda \\
        --sizes 17x480x832,33x480x832,81x480x832 --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# A mid-size random Wan2.1 whose activations at these sizes dwarf the allocator's noise (VAE base_dim 32).
MID = dict(num_layers=4, num_heads=4, head_dim=64, ffn_dim=1024, text_dim=64, text_heads=4, text_ff=128,
           vae_base_dim=32)
CPU_SIZES = "9x128x128,17x192x192,17x256x256"


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(args) -> dict:
    """One size in this process: predicted and measured (see the module docstring)."""
    import torch

    from composer import VideoGenerator
    from composer.memory import device_peak, request_key
    from composer.prompt_lists import video_requests

    frames, height, width = (int(x) for x in args.size.split("x"))
    gen = VideoGenerator.from_pretrained(args.model_path, device=args.device, dtype=args.dtype, progress=False)
    request = dict(num_inference_steps=args.steps, guidance_scale=args.guidance, seed=0)
    gen.generate_video("warm up", num_frames=5, height=64, width=64, **request)

    from composer.generator import new_batch
    from composer.memory import MemoryPredictor

    pipeline = gen.pipeline
    predictor = MemoryPredictor(type(pipeline), pipeline.index, pipeline.config, pipeline.runtime)
    sp = gen.sampling_param(prompt="a red fox running through fresh snow", num_frames=frames, height=height,
                            width=width, **request)
    videos = video_requests(sp.prompt, sp.negative_prompt, 1)
    start = time.perf_counter()
    predicted = predictor.request(new_batch(sp, videos), sp, key=request_key(sp, videos, None))
    seconds = time.perf_counter() - start
    device = pipeline.device
    out = {"size": args.size, "device": str(device), "predict_s": seconds, "stages": predicted.describe()}
    if args.concurrent > 1:
        from composer.memory import MemoryShare

        share = MemoryShare.of(predicted)
        n = args.concurrent
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        before = rss()
        futures = [gen.submit_video(sp.prompt, num_frames=frames, height=height, width=width,
                                    **{**request, "seed": i}) for i in range(n)]
        for future in futures:
            future.result()
        scheduler = pipeline.engines[0].scheduler
        out["batched"] = f"{scheduler.stats.units} steps in {scheduler.stats.calls} calls"
        out["predicted"] = n * share.held + n * max(0, share.excess)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            out["measured"] = torch.cuda.max_memory_allocated(device)
            out["predicted"] += device_peak(predictor, "none", predicted)[1]
            out["what"] = f"max_memory_allocated of {n} requests at once (weights included)"
        else:
            out["measured"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
            out["what"] = f"peak RSS rise of {n} requests at once"
    elif device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        gen.generate_video(sp.prompt, num_frames=frames, height=height, width=width, **request)
        torch.cuda.synchronize(device)
        out["measured"] = torch.cuda.max_memory_allocated(device)
        out["predicted"] = device_peak(predictor, "none", predicted)[0]
        out["what"] = "max_memory_allocated (weights included)"
    else:
        before = rss()
        gen.generate_video(sp.prompt, num_frames=frames, height=height, width=width, **request)
        out["measured"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
        out["predicted"] = predicted.peak
        out["what"] = "peak RSS rise (activations and frames)"
    out["error"] = out["predicted"] / out["measured"] - 1
    return out


def measure_convolution(spec: str, dtype: str) -> dict:
    """One convolution in this process: the trace's peak of the call against the rise of peak RSS over the call
    (the same shapes run once before, so that the kernels' code is resident; the peak reset by
    /proc/self/clear_refs, Linux)."""
    import torch

    from composer.memory import fake_mode, traced_peak

    batch, cin, cout, frames, height, width, kernel, pad = (int(x) for x in spec.split(","))
    shape = (batch, cin, frames, height, width) if frames else (batch, cin, height, width)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    conv = (torch.nn.Conv3d if frames else torch.nn.Conv2d)(cin, cout, kernel, padding=pad).to(dt)
    mode = fake_mode()
    fake = mode.from_tensor(torch.empty(shape, dtype=dt))
    predicted, _ = traced_peak(lambda: conv(fake), mode, "cpu")
    x = torch.randn(shape, dtype=dt)
    with torch.inference_mode():
        conv(x)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status("VmRSS")
        conv(x)
        measured = _status("VmHWM") - before
        backend = str(torch._C._select_conv_backend(x, conv.weight, conv.bias, conv.stride, conv.padding,
                                                    conv.dilation, False, [0] * (x.dim() - 2), 1, None))
    return {"conv": spec, "backend": backend.rsplit(".", 1)[-1], "input": x.numel() * x.element_size(),
            "predicted": predicted, "measured": measured, "error": predicted / measured - 1}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def convolutions(args, env) -> int:
    """`--convolutions`: each in a fresh subprocess; a row each."""
    print(f"{'batch,in,out,frames,height,width,kernel,pad':>44} {'kernel':>8} {'input':>9} {'predicted':>11} "
          f"{'measured':>11} {'error':>7}")
    rows = []
    for spec in args.convolutions.split(";"):
        cmd = [sys.executable, __file__, "--convolution", spec, "--dtype", args.dtype]
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
        if res.returncode or line is None:
            print(f"{spec}: failed\n{res.stderr[-3000:]}")
            return 2
        row = json.loads(line[len("RESULT "):])
        rows.append(row)
        print(f"{spec:>44} {row['backend']:>8} {row['input'] / 2**20:>7.2f}Mi {row['predicted'] / 2**20:>9.2f}Mi "
              f"{row['measured'] / 2**20:>9.2f}Mi {row['error']:>+7.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    worst = max(abs(r["error"]) for r in rows)
    print(f"worst error {worst:.1%} (tolerance {args.tolerance:.0%})")
    return 0 if worst <= args.tolerance else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="a video model folder or short name (default: a mid-size "
                   "random Wan, built)")
    p.add_argument("--vae-base-dim", type=int, default=MID["vae_base_dim"],
                   help="the built random Wan's VAE width (without --model-path; 12 is a narrow VAE)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--sizes", default=None, help=f"FRAMESxHEIGHTxWIDTH,... (default on CPU: {CPU_SIZES})")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--guidance", type=float, default=5.0)
    p.add_argument("--tolerance", type=float, default=0.15)
    p.add_argument("--json", default=None)
    p.add_argument("--concurrent", type=int, default=1, help="requests of each size at once (see the module)")
    p.add_argument("--convolutions", default=None, metavar="SPEC;SPEC...",
                   help="single convolutions instead of videos: batch,in,out,frames,height,width,kernel,pad each "
                        "(frames 0: a 2D one), the trace's peak of the call against its measured peak RSS rise")
    p.add_argument("--size", default=None, help=argparse.SUPPRESS)
    p.add_argument("--convolution", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    if args.size:  # the subprocess
        print("RESULT " + json.dumps(measure(args)))
        return 0
    if args.convolution:  # the subprocess
        print("RESULT " + json.dumps(measure_convolution(args.convolution, args.dtype)))
        return 0
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONUNBUFFERED": "1"}
    if args.convolutions:
        return convolutions(args, env)
    tmp = None
    if args.model_path is None:
        from composer.testing import build_tiny_wan

        tmp = tempfile.TemporaryDirectory(prefix="composer-memory-")
        args.model_path = str(build_tiny_wan(Path(tmp.name) / "mid-wan", **{**MID, "vae_base_dim": args.vae_base_dim}))
    rows = []
    print(f"{'size':>14} {'predicted':>11} {'measured':>11} {'error':>7} {'predict':>8}  stages (predicted)")
    for size in (args.sizes or CPU_SIZES).split(","):
        cmd = [sys.executable, __file__, "--size", size, "--model-path", args.model_path, "--device", args.device,
               "--dtype", args.dtype, "--steps", str(args.steps), "--guidance", str(args.guidance),
               "--concurrent", str(args.concurrent)]
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = next((x for x in res.stdout.splitlines() if x.startswith("RESULT ")), None)
        if res.returncode or line is None:
            print(f"{size}: failed\n{res.stderr[-3000:]}")
            return 2
        row = json.loads(line[len("RESULT "):])
        rows.append(row)
        print(f"{size:>14} {row['predicted'] / 2**20:>9.1f}Mi {row['measured'] / 2**20:>9.1f}Mi "
              f"{row['error']:>+7.1%} {row['predict_s']:>7.2f}s  {row['stages']}"
              f"{'; ' + row['batched'] if 'batched' in row else ''}")
    print(f"measured: {rows[0]['what']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    worst = max(abs(r["error"]) for r in rows)
    print(f"worst error {worst:.1%} (tolerance {args.tolerance:.0%})")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
