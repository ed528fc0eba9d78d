"""One command for the GPU measurements: composer at released model sizes (random weights, no download).

    python benchmarks/gpu_suite.py                      # every part, CUDA, bf16, released sizes
    python benchmarks/gpu_suite.py --tiny               # the same code at tiny sizes on CPU (CI runs this)
    python benchmarks/gpu_suite.py --only dit-1.3b,quant-1.3b --out /tmp/suite

Every part runs in its own subprocess with its own time budget, so a part that fails, runs out of memory or
overruns is reported as such and the others still run. Results go to `<out>/gpu_suite.json` and a markdown
table `<out>/gpu_suite.md` (also printed).

Parts (sizes as on the GPU; `--tiny` shrinks the models and videos, same code):
- dit-1.3b: Wan2.1-T2V-1.3B's released transformer config, 480x832, 81 frames (32760 tokens), bf16. One DiT
  forward, composer vs diffusers, and one CFG step (composer: both branches as one batch, text k/v computed
  once per video; diffusers: WanPipeline's two transformer calls), same weights in the same process (composer's
  model holds diffusers' very tensors), max abs difference, peak `max_memory_allocated`.
- dit-14b: Wan2.1-T2V-14B's config, 720x1280, 81 frames (75600 tokens): one DiT forward each.
- e2e-1.3b: a model folder (shared with cache-1.3b, causal-1.3b and offload-disk-1.3b, built once under `--scratch`
  and removed at the end) written to disk with the 1.3B transformer, the released Wan VAE (AutoencoderKLWan's
  default config, full size) and a UMT5 text encoder of the released width (4096) with 2 layers instead of 24
  (the text encoder runs once per video); prompt -> uint8 frames, composer vs diffusers, with the VAE decode.
- compile-1.3b: composer's regional compile (each block's forward compiled once): cold first forward, steady.
- quant-1.3b: weight-only int8 and fp8 (torchao) DiT forward against bf16, and the output difference.
- offload-1.3b: layerwise offload (blocks streamed from pinned host memory, one block ahead) vs resident.
- sparse: the sliding_window attention backend at the 1.3B's 480p token grid (benchmarks/sparse_attention.py).
- concurrency: N concurrent requests through the step scheduler against the same N one after another
  (benchmarks/concurrency.py): the 1.3B model at 240x416, 17 frames, 4 steps, and the shapes models' t2v and
  streams, medians of 3.
- kv-pool: the paged KV pool's passes (one run of pages: a view; scattered: a gather) against the contiguous
  KV cache at Self-Forcing 1.3B's cache shape, 480x832, bf16 (benchmarks/kv_pool.py).
- cache-1.3b: TeaCache and DBCache at their defaults against the exact path, 10 CFG steps of the 1.3B at 480p 81
  frames, end to end from the shared folder: steps skipped, denoising and total seconds, PSNR against the exact frames.
- causal-1.3b: the Self-Forcing 1.3B causal model (the 1.3B DiT converted by `composer convert self-forcing`'s code)
  at Self-Forcing's setting: 480x832, 81 frames, 3 latent frames a block, 4 steps, KV cache; time to first frame,
  frames/s end to end and for denoising alone, the block and per-block decode latencies, KV cache bytes, peak memory.
- vae: the released Wan VAE decoding 81x480x832 (21 latent frames): the whole video at once (composer's
  DecodingStage, fp32 = composer's default vae_dtype, and in the suite's dtype), diffusers' own tiling, composer's
  exact tiling (`vae_tile_size = 32`: trunk on whole frames, the last two up blocks in tiles with a halo), and
  composer's streaming decode of Self-Forcing's blocks (3 latent frames each, the causal cache carried): seconds,
  peak memory and the uint8 difference against the whole decode.
- offload-disk-1.3b: the disk tier (`offload = disk`: blocks read from the memory-mapped safetensors files one
  block ahead) against the resident model, from the shared folder; the host's page cache is dropped first.
- memory: the memory predictor (composer/memory/) against measured peaks, each size in a fresh process
  (benchmarks/memory_predictor.py: predicted weights + activations vs `max_memory_allocated`), then `offload = auto`
  with `memory_budget = 10e9`: the plan it picks for the 1.3B at 480p 81 frames and the peak a real request reaches.
- dllm: the diffusion-LM decoding strategies on the embedded tiny-dllm against the exact path (forwards per token,
  tokens/s, accuracy on 300 held-out problems) and batch 1/8/32 throughput (benchmarks/dllm.py).
- host-profile: 8 shapes-causal streams at once on threads, 5 timed runs, with a sampling profile of every thread and
  cProfile of the engine core's thread and side lane (benchmarks/host_profile.py): where the host's time goes.

Speed does not depend on the weights' values: random weights give the same seconds as a real checkpoint. Quality
figures (PSNR, differences) of approximate paths on random weights say little; docs/ quote them as such.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# Released diffusers transformer configs (composer/testing/released.py: transformer/config.json of the releases).
from composer.testing.released import WAN_COMMON, composer_twin, released_config, released_dit  # noqa: E402

WAN_1_3B = released_config("wan2.1-t2v-1.3b")
WAN_14B = released_config("wan2.1-t2v-14b")
WAN_TINY = dict(WAN_COMMON, num_attention_heads=2, attention_head_dim=32, ffn_dim=128, num_layers=2, text_dim=64)

VIDEO_480P = dict(num_frames=81, height=480, width=832)
VIDEO_720P = dict(num_frames=81, height=720, width=1280)
VIDEO_TINY = dict(num_frames=9, height=64, width=64)
TEXT_LEN = 512
SEED = 0
PROMPT, NEGATIVE, GUIDANCE = "a red fox running through fresh snow", "blurry, low quality", 5.0

# name -> (time budget in seconds on the GPU, one-line description)
PARTS: dict[str, tuple[int, str]] = {
    "dit-1.3b": (90, "Wan2.1 1.3B DiT forward and CFG step, 480p 81 frames, composer vs diffusers"),
    "e2e-1.3b": (200, "Wan2.1 1.3B end to end (text, 4 steps, VAE decode), 480p 81 frames"),
    "dit-14b": (120, "Wan2.1 14B DiT forward, 720p 81 frames, composer vs diffusers"),
    "offload-1.3b": (90, "layerwise offload vs resident: DiT forward time and peak memory, 480p"),
    "quant-1.3b": (90, "weight-only int8 / fp8 DiT forward vs the runtime dtype, 480p"),
    "compile-1.3b": (150, "regional compile: cold start and steady DiT forward, 480p"),
    "sparse": (90, "sliding_window attention at the 480p token grid (21x30x52, 12 heads x 128)"),
    "concurrency": (300, "1, 2, 4, 8 concurrent requests through the step scheduler vs one after another, on threads "
                         "and as tasks"),
    "kv-pool": (60, "the paged KV pool's passes vs the contiguous cache at Self-Forcing 1.3B's cache shape"),
    "cache-1.3b": (200, "TeaCache and DBCache at their defaults vs the exact path, 10 CFG steps, 480p 81 frames"),
    "causal-1.3b": (200, "Self-Forcing 1.3B causal streaming, 480x832, 81 frames, 3 latent frames a block, 4 steps"),
    "vae": (150, "the Wan VAE decoding 81x480x832: whole, diffusers-tiled, streamed per block; fp32 and bf16"),
    "vae-hunyuan": (300, "the HunyuanVideo VAE decoding 33x720x1280 in bf16: whole (its own split in time), "
                         "diffusers-tiled, composer's exact tiles (GroupNorm statistics over the whole video)"),
    "offload-disk-1.3b": (120, "the disk tier (blocks from the memory-mapped files) vs resident, 480p"),
    "memory": (200, "the memory predictor vs measured peaks (1.3B, 480p and 720p) and offload = auto under 10 GB"),
    "dllm": (90, "diffusion-LM decoding strategies on tiny-dllm vs the exact path: forwards/token, tokens/s, "
                 "accuracy; batch 1/8/32 throughput"),
    "host-profile": (120, "8 shapes-causal streams at once on threads, 5 runs: where the host's time goes (a sampling "
                          "profile of every thread, cProfile of the engine core's thread and side lane)"),
}


# -- measurement helpers -------------------------------------------------------------------------------------


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return times


@contextmanager
def peak_memory(device, out: dict, key: str):
    """Peak device memory above what was allocated before (CUDA); peak RSS of the process on CPU."""
    import torch

    if device.type == "cuda":
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        yield
        sync(device)
        out[key] = (torch.cuda.max_memory_allocated(device) - base) / 2**30
    else:
        import resource

        yield
        out[key] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB, whole process


def sizes(tiny: bool, which: str) -> tuple[dict, dict]:
    if tiny:
        return dict(WAN_TINY), dict(VIDEO_TINY)
    return (dict(WAN_14B), dict(VIDEO_720P)) if which == "14b" else (dict(WAN_1_3B), dict(VIDEO_480P))


def latent_shape(config: dict, video: dict) -> tuple[int, ...]:
    return (1, config["in_channels"], (video["num_frames"] - 1) // 4 + 1, video["height"] // 8, video["width"] // 8)


def tokens_of(shape) -> int:
    return shape[2] * (shape[3] // 2) * (shape[4] // 2)


def build_diffusers_dit(config: dict, device, dtype):
    """diffusers' WanTransformer3DModel, seeded, on `device`, cast as `from_pretrained(torch_dtype=dtype)` casts it
    (its `_keep_in_fp32_modules` stay fp32)."""
    import torch
    from diffusers import WanTransformer3DModel

    torch.manual_seed(SEED)
    with torch.device(device):
        model = WanTransformer3DModel(**config).eval()
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or [])
    for name, param in model.named_parameters():
        if not keep.intersection(name.split(".")):
            param.data = param.data.to(dtype)
    return model


def composer_dit(config: dict, device, dtype):
    """composer's model alone (built through diffusers' seeded init, then diffusers' model dropped)."""
    return composer_twin(build_diffusers_dit(config, device, dtype))


def dit_inputs(config: dict, video: dict, device, dtype, seed: int = SEED):
    import torch

    g = torch.Generator("cpu").manual_seed(seed)
    latents = torch.randn(latent_shape(config, video), generator=g).to(device, dtype)
    text = torch.randn(1, TEXT_LEN, config["text_dim"], generator=g).to(device, dtype)
    negative = torch.randn(1, TEXT_LEN, config["text_dim"], generator=g).to(device, dtype)
    return latents, torch.tensor([500.0], device=device), text, negative


def max_diff(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# -- parts ---------------------------------------------------------------------------------------------------


def part_dit(args, which: str) -> dict:
    import torch

    from composer.engine import ClassifierFreeGuidance, DenoisingEngine, ModelInputs

    device, dtype = torch.device(args.device), args.torch_dtype
    config, video = sizes(args.tiny, which)
    theirs = build_diffusers_dit(config, device, dtype)
    ours = composer_twin(theirs)
    latents, t, text, negative = dit_inputs(config, video, device, dtype)
    out: dict[str, Any] = {"latent_shape": list(latents.shape), "tokens": tokens_of(latents.shape),
                           "params_b": sum(p.numel() for p in theirs.parameters()) / 1e9}
    results = {}
    with torch.inference_mode():
        calls = {"composer": lambda x=latents: results.__setitem__("composer", ours(x, t, text)),
                 "diffusers": lambda x=latents: results.__setitem__("diffusers", theirs(x, t, text, return_dict=False)[0])}
        times: dict[str, list[float]] = {k: [] for k in calls}
        if which == "1.3b":
            for fn in calls.values():
                fn()  # warmup
            for i in range(args.repeats):
                for name in (list(calls) if i % 2 == 0 else list(calls)[::-1]):
                    times[name] += timed(calls[name], device, 1)
            for name, fn in calls.items():
                with peak_memory(device, out, f"forward_peak_gib_{name}"):
                    fn()
        else:  # a forward takes seconds: warm up on one latent frame, then one timed forward each
            for fn in calls.values():
                fn(latents[:, :, :1])
            for name, fn in calls.items():
                with peak_memory(device, out, f"forward_peak_gib_{name}"):
                    times[name] += timed(fn, device, 1)
        out["forward_s"] = {k: median(v) for k, v in times.items()}
        out["forward_ratio"] = out["forward_s"]["diffusers"] / out["forward_s"]["composer"]
        out["forward_max_abs_diff"] = max_diff(results["composer"], results["diffusers"])
        if which == "1.3b":
            engine = DenoisingEngine(ours)
            guidance = ClassifierFreeGuidance(GUIDANCE)
            cond, uncond = engine.text_inputs(text), engine.text_inputs(negative)
            merged = ModelInputs.batched([cond, uncond])

            def theirs_step():
                c = theirs(latents, t, text, return_dict=False)[0]
                u = theirs(latents, t, negative, return_dict=False)[0]
                results["diffusers_step"] = u + GUIDANCE * (c - u)

            steps = {"composer": lambda: results.__setitem__(
                "composer_step", engine.predict(latents, t, cond, uncond, guidance, merged)),
                "diffusers": theirs_step}
            for fn in steps.values():
                fn()
            st = {k: timed(fn, device, args.repeats) for k, fn in steps.items()}
            out["cfg_step_s"] = {k: median(v) for k, v in st.items()}
            out["cfg_step_ratio"] = out["cfg_step_s"]["diffusers"] / out["cfg_step_s"]["composer"]
            out["cfg_step_max_abs_diff"] = max_diff(results["composer_step"], results["diffusers_step"])
    return out


def build_e2e_folder(path: Path, tiny: bool) -> Path:
    """A Wan2.1 T2V folder: the 1.3B transformer, the released VAE, UMT5 of the released width with 2 layers."""
    import torch
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from composer.testing.tokenizer import build_tokenizer

    config = WAN_TINY if tiny else WAN_1_3B
    tokenizer = build_tokenizer()
    torch.manual_seed(SEED)
    d_model = config["text_dim"]
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=d_model, d_kv=64 if not tiny else 16, d_ff=10240 if not tiny else 128,
        num_layers=2, num_heads=64 if not tiny else 4, relative_attention_num_buckets=32,
        relative_attention_max_distance=128, dropout_rate=0.0, feed_forward_proj="gated-gelu")).eval()
    vae = AutoencoderKLWan(base_dim=8, num_res_blocks=1) if tiny else AutoencoderKLWan()  # default = released
    if tiny:
        torch.manual_seed(SEED + 2)
        transformer = WanTransformer3DModel(**config).eval()
    else:  # the fast seeded init, stored in bf16 (what released folders hold): seconds instead of a minute
        transformer = released_dit("wan2.1-t2v-1.3b", dtype=torch.bfloat16, seed=SEED + 2)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=3.0)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       scheduler=scheduler)
    pipe.save_pretrained(str(path), safe_serialization=True)
    return path


SHARED_FOLDER = "composer-gpu-suite-wan13b"


def shared_folder_path(args) -> Path:
    return Path(args.scratch or tempfile.gettempdir()) / (SHARED_FOLDER + ("-tiny" if args.tiny else ""))


def shared_folder(args) -> Path:
    """The Wan2.1 T2V folder of `build_e2e_folder`, built once per suite run (the e2e, cache, causal and disk parts
    load it; the driver removes it at the end when it was not there before)."""
    import shutil

    path = shared_folder_path(args)
    if not (path / "model_index.json").exists():
        building = path.with_name(f"{path.name}.building-{os.getpid()}")
        shutil.rmtree(building, ignore_errors=True)
        build_e2e_folder(building, args.tiny)
        shutil.rmtree(path, ignore_errors=True)
        building.rename(path)
    return path


def part_e2e(args) -> dict:
    import diffusers
    import numpy as np
    import torch

    from composer import VideoGenerator

    device = torch.device(args.device)
    _, video = sizes(args.tiny, "1.3b")
    steps = 4
    out: dict[str, Any] = {"steps": steps, **video}
    t0 = time.perf_counter()
    folder = shared_folder(args)
    out["build_s"] = time.perf_counter() - t0
    gen = VideoGenerator.from_pretrained(folder, device=str(device), dtype=args.dtype, progress=False)
    transformer = diffusers.WanTransformer3DModel.from_pretrained(folder, subfolder="transformer",
                                                                  torch_dtype=args.torch_dtype)
    pipe = diffusers.WanPipeline.from_pretrained(str(folder), transformer=transformer).to(device)
    pipe.set_progress_bar_config(disable=True)
    small = dict(num_frames=5, height=video["height"] // 2, width=video["width"] // 2)
    frames, timings = {}, {}

    def run_composer(size):
        res = gen.generate_video(PROMPT, negative_prompt=NEGATIVE, num_inference_steps=steps,
                                 guidance_scale=GUIDANCE, seed=SEED, **size)
        frames["composer"], timings["composer"] = res.frames, res.timings

    def run_diffusers(size):
        v = pipe(PROMPT, negative_prompt=NEGATIVE, num_inference_steps=steps, guidance_scale=GUIDANCE,
                 generator=torch.Generator("cpu").manual_seed(SEED), output_type="np", **size).frames[0]
        frames["diffusers"] = (np.asarray(v, dtype=np.float32) * 255).round().clip(0, 255).astype(np.uint8)

    run_composer(small)
    run_diffusers(small)  # warmups at a smaller size: kernels loaded, nothing compiled
    out["e2e_s"] = {}
    for name, fn in (("composer", run_composer), ("diffusers", run_diffusers)):
        with peak_memory(device, out, f"e2e_peak_gib_{name}"):
            out["e2e_s"][name] = timed(lambda fn=fn: fn(video), device, 1)[0]
    out["e2e_ratio"] = out["e2e_s"]["diffusers"] / out["e2e_s"]["composer"]
    out["composer_stage_s"] = timings["composer"]
    a, b = frames["composer"], frames["diffusers"]
    out["max_uint8_diff"] = int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max()) if a.shape == b.shape else None
    return out


def _forward_timer(model, inputs, device, repeats):
    import torch

    latents, t, text, _ = inputs
    with torch.inference_mode():
        return timed(lambda: model(latents, t, text), device, repeats)


def steady_forward_s(model, inputs, device, repeats: int) -> float:
    """Median forward time after one untimed warmup."""
    return median(_forward_timer(model, inputs, device, repeats + 1)[1:])


def part_compile(args) -> dict:
    import torch

    from composer.accel.compile import compile_module

    device, dtype = torch.device(args.device), args.torch_dtype
    config, video = sizes(args.tiny, "1.3b")
    model = composer_dit(config, device, dtype)
    inputs = dit_inputs(config, video, device, dtype)
    eager = _forward_timer(model, inputs, device, args.repeats + 1)[1:]
    with torch.inference_mode():
        ref = model(*inputs[:3])
    for block in model.blocks:
        compile_module(block, None)
    cold = _forward_timer(model, inputs, device, 1)[0]
    steady = _forward_timer(model, inputs, device, args.repeats)
    with torch.inference_mode():
        got = model(*inputs[:3])
    return {"eager_s": median(eager), "compiled_cold_s": cold, "compiled_s": median(steady),
            "speedup": median(eager) / median(steady), "max_abs_diff": max_diff(got, ref)}


def part_quant(args) -> dict:
    import torch

    from composer.accel.quantize import linear_weight_bytes, quantize_model

    device, dtype = torch.device(args.device), args.torch_dtype
    config, video = sizes(args.tiny, "1.3b")
    modes = ["int8"] + (["fp8"] if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9) else [])
    out: dict[str, Any] = {}
    inputs = dit_inputs(config, video, device, dtype)
    model = composer_dit(config, device, dtype)
    out["dtype"] = args.dtype
    out["bf16_s"] = steady_forward_s(model, inputs, device, args.repeats)
    out["bf16_linear_gib"] = linear_weight_bytes(model) / 2**30
    with torch.inference_mode():
        ref = model(*inputs[:3]).float()
    del model
    for mode in modes:
        model = composer_dit(config, device, dtype)
        quantize_model(model, mode)
        out[f"{mode}_s"] = steady_forward_s(model, inputs, device, args.repeats)
        out[f"{mode}_linear_gib"] = linear_weight_bytes(model) / 2**30
        with torch.inference_mode():
            got = model(*inputs[:3]).float()
        out[f"{mode}_rel_err"] = float((got - ref).norm() / ref.norm())
        out[f"{mode}_ratio"] = out[f"{mode}_s"] / out["bf16_s"]
        del model
    return out


def part_offload(args) -> dict:
    import torch

    from composer.accel.offload import LayerwiseOffload

    device, dtype = torch.device(args.device), args.torch_dtype
    config, video = sizes(args.tiny, "1.3b")
    inputs = dit_inputs(config, video, device, dtype)
    out: dict[str, Any] = {}
    model = composer_dit(config, device, dtype)

    def measure(label: str) -> torch.Tensor:
        """Steady forward time, peak memory (and on CUDA everything allocated) under `label`; the output."""
        with peak_memory(device, out, f"{label}_peak_gib"):
            out[f"{label}_s"] = steady_forward_s(model, inputs, device, args.repeats)
        if device.type == "cuda":
            out[f"{label}_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        with torch.inference_mode():
            return model(*inputs[:3])

    ref = measure("resident")
    model = model.to("cpu")
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    hook = LayerwiseOffload(model, device, prefetch=1)
    got = measure("layerwise")
    out["max_abs_diff"] = max_diff(got, ref)
    out["slowdown"] = out["layerwise_s"] / out["resident_s"]
    hook.remove()
    return out


def uint8_diff(a, b) -> int | None:
    import numpy as np

    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max()) if a.shape == b.shape else None


def free_device(device) -> None:
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def part_cache(args) -> dict:
    """TeaCache and DBCache at their defaults (what `cache=...` alone gives) against the exact path, end to end."""
    import torch

    from composer import VideoGenerator

    if str(REPO_ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    from step_cache import psnr

    device = torch.device(args.device)
    _, video = sizes(args.tiny, "1.3b")
    steps = 10
    folder = shared_folder(args)
    request = dict(prompt=PROMPT, negative_prompt=NEGATIVE, num_inference_steps=steps, guidance_scale=GUIDANCE,
                   seed=SEED, **video)
    warmup = dict(request, num_inference_steps=2, num_frames=5, height=video["height"] // 2,
                  width=video["width"] // 2)
    out: dict[str, Any] = {"steps": steps, **video, "modes": {}}
    exact = None
    for label, settings in (("exact", {}), ("teacache", {"cache": "teacache"}), ("dbcache", {"cache": "dbcache"})):
        gen = VideoGenerator.from_pretrained(folder, device=str(device), dtype=args.dtype, progress=False, **settings)
        gen.generate_video(**warmup)
        row: dict[str, Any] = {}
        with peak_memory(device, row, "peak_gib"):
            start = time.perf_counter()
            result = gen.generate_video(**request)
            sync(device)
            row["total_s"] = time.perf_counter() - start
        row["denoise_s"] = sum(v for k, v in result.timings.items() if "DenoisingStage" in k)
        hook = next((h for h in gen.pipeline.hooks if h.name == "cache"), None)
        if hook is not None:
            stats = hook.hooks[0].stats
            row["skipped"], row["calls"] = int(stats.skipped), int(stats.calls)
        if exact is None:
            exact = result.frames
        else:
            row["psnr_db"] = psnr(result.frames, exact)
            row["denoise_ratio"] = out["modes"]["exact"]["denoise_s"] / row["denoise_s"]
        out["modes"][label] = row
        del gen, result
        free_device(device)
    return out


def part_causal(args) -> dict:
    """The Self-Forcing 1.3B causal model: the 1.3B DiT written as a Self-Forcing checkpoint and converted by
    composer's converter (Self-Forcing's default settings: 3 latent frames a block, steps 1000/750/500/250)."""
    import torch

    from composer import VideoGenerator
    from composer.convert.self_forcing import CausalSettings, convert_self_forcing

    if str(REPO_ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
    from causal import write_self_forcing_checkpoint

    device = torch.device(args.device)
    video = dict(num_frames=33, height=64, width=64) if args.tiny else dict(VIDEO_480P)  # 9 / 21 latent frames
    out: dict[str, Any] = dict(video)
    base = shared_folder(args)
    with tempfile.TemporaryDirectory(dir=args.scratch) as tmp:
        start = time.perf_counter()
        checkpoint = write_self_forcing_checkpoint(base, Path(tmp) / "self_forcing.pt")
        folder = convert_self_forcing(checkpoint, base, Path(tmp) / "causal", settings=CausalSettings(),
                                      dtype=args.torch_dtype)
        checkpoint.unlink()
        out["convert_s"] = time.perf_counter() - start
        gen = VideoGenerator.from_pretrained(folder, device=str(device), dtype=args.dtype, progress=False)

        def stream(num_frames: int):
            s = gen.stream_video(PROMPT, height=video["height"], width=video["width"], num_frames=num_frames,
                                 seed=SEED, kv_cache=True, rollout_blocks=num_frames)
            chunks = list(s)
            return s.stats, chunks

        stream(9)  # warmup: one block at the full frame size
        runs = []
        for _ in range(max(1, args.repeats - 1)):
            row: dict[str, Any] = {}
            with peak_memory(device, row, "peak_gib"):
                stats, chunks = stream(video["num_frames"])
            row.update(ttff_s=stats.time_to_first_frame, total_s=stats.total_seconds, frames=stats.frames,
                       fps=stats.frames_per_second, denoise_fps=stats.frames / sum(stats.block_seconds),
                       block_s=list(stats.block_seconds), decode_s=[c.decode_seconds for c in chunks],
                       kv_cache_gib=stats.kv_cache_bytes / 2**30)
            runs.append(row)
    best = min(runs, key=lambda r: r["total_s"])  # the run least disturbed; every run is in `runs`
    out.update(runs=runs, ttff_s=median([r["ttff_s"] for r in runs]), fps=median([r["fps"] for r in runs]),
               denoise_fps=median([r["denoise_fps"] for r in runs]), block_median_s=median(best["block_s"]),
               decode_median_s=median(best["decode_s"][1:] or best["decode_s"]), kv_cache_gib=best["kv_cache_gib"],
               peak_gib=max(r["peak_gib"] for r in runs), blocks=len(best["block_s"]))
    return out


def part_vae(args) -> dict:
    """The released Wan VAE (AutoencoderKLWan's default config) decoding a 480p 81-frame video."""
    import torch
    from diffusers import AutoencoderKLWan

    from composer.stages.decoding import (
        DecodingStage,
        StreamingVideoDecoder,
        denormalize_latents,
        video_to_frames,
    )

    device = torch.device(args.device)
    _, video = sizes(args.tiny, "1.3b")
    if args.tiny:
        video = dict(num_frames=13, height=48, width=48)  # 4 latent frames: two stream blocks, two decode chunks
    torch.manual_seed(SEED)
    vae = (AutoencoderKLWan(base_dim=8, num_res_blocks=1) if args.tiny else AutoencoderKLWan()).eval()
    g = torch.Generator("cpu").manual_seed(SEED)
    latents = torch.randn(latent_shape({"in_channels": 16}, video), generator=g)
    out: dict[str, Any] = {**video, "latent_shape": list(latents.shape), "modes": {}}
    reference = None
    for dtype_name in ("fp32", args.dtype) if args.dtype != "fp32" else ("fp32",):
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
        vae.to(device, dtype)
        stage = DecodingStage(vae)
        z = latents.to(device)

        def whole(stage=stage, z=z):
            return video_to_frames(stage.decode(z)).numpy()[0]

        def streamed(z=z):
            decoder = StreamingVideoDecoder(vae)
            frames, seconds = [], []
            for i in range(0, z.shape[2], 3):  # Self-Forcing's blocks of 3 latent frames
                start = time.perf_counter()
                frames.append(decoder.decode(z[:, :, i:i + 3])[0])
                sync(device)
                seconds.append(time.perf_counter() - start)
            import numpy as np

            return np.concatenate(frames), seconds

        def tiled(whole=whole):
            vae.enable_tiling()
            try:
                return whole()
            finally:
                vae.disable_tiling()

        def exact_tiled(z=z, dtype=dtype):  # composer's exact tiles (RuntimeArgs.vae_tile_size): 32 latent pixels a side
            from composer.stages.vae_tiling import decode_tiled

            with torch.inference_mode():
                return video_to_frames(decode_tiled(vae, denormalize_latents(z.to(dtype), vae.config),
                                                    tile=32 if not args.tiny else 3)).numpy()[0]

        # Candidates for a decode faster than diffusers' at the same output (issue 35), measured before any is
        # built into composer: the Conv3d weights and input in channels-last-3d memory (cuDNN's preferred layout
        # for bf16 convolutions), and the latent frames after the first decoded 4 at a time with the causal cache
        # (diffusers decodes them one by one: fewer, larger kernels).
        def channels_last(z=z, dtype=dtype):
            convs = [m for m in vae.modules() if isinstance(m, torch.nn.Conv3d)]
            for m in convs:
                m.weight.data = m.weight.data.to(memory_format=torch.channels_last_3d)
            try:
                with torch.inference_mode():
                    x = denormalize_latents(z.to(dtype), vae.config).contiguous(memory_format=torch.channels_last_3d)
                    return video_to_frames(vae.decode(x, return_dict=False)[0]).numpy()[0]
            finally:
                for m in convs:
                    m.weight.data = m.weight.data.contiguous()

        def chunked(z=z, dtype=dtype):
            with torch.inference_mode():
                x = vae.post_quant_conv(denormalize_latents(z.to(dtype), vae.config))
                cache, outs, i = [None] * vae._cached_conv_counts["decoder"], [], 0
                while i < x.shape[2]:
                    k = 1 if i == 0 else 4
                    outs.append(vae.decoder(x[:, :, i:i + k], feat_cache=cache, feat_idx=[0], first_chunk=i == 0))
                    i += k
                return video_to_frames(torch.cat(outs, dim=2).clamp(-1.0, 1.0)).numpy()[0]

        whole()  # warmup
        for label, fn in (("whole", whole), ("tiled", tiled), ("exact-tiled", exact_tiled), ("streamed", streamed),
                          ("channels-last", channels_last), ("chunked-4", chunked)):
            row: dict[str, Any] = {}
            with peak_memory(device, row, "peak_gib"):
                start = time.perf_counter()
                got = fn()
                sync(device)
                row["s"] = time.perf_counter() - start
            if label == "streamed":
                got, row["block_s"] = got
            if reference is None:
                reference = got
            row["max_uint8_diff_vs_fp32_whole"] = uint8_diff(got, reference)
            out["modes"][f"{label}-{dtype_name}"] = row
        free_device(device)
    return out


def part_vae_hunyuan(args) -> dict:
    """The released HunyuanVideo VAE (AutoencoderKLHunyuanVideo's default config, random weights) decoding a 720p
    video in the suite's dtype: its own decode (chunks of latent frames blended in time, whole frames in space),
    diffusers' spatial tiles (blended; each tile normalised by its own GroupNorm statistics) and composer's exact
    tiles (`vae_tile_size`: the whole video's statistics, waiting tiles parked on the host)."""
    import torch
    from diffusers import AutoencoderKLHunyuanVideo

    from composer.stages.decoding import DecodingStage, video_to_frames

    device = torch.device(args.device)
    video = dict(num_frames=9, height=64, width=96) if args.tiny else dict(num_frames=33, height=720, width=1280)
    dtype = torch.float32 if args.tiny else {"fp32": torch.float32, "bf16": torch.bfloat16,
                                             "fp16": torch.float16}[args.dtype]
    torch.manual_seed(SEED)
    built = time.perf_counter()
    if args.tiny:
        vae = AutoencoderKLHunyuanVideo(latent_channels=4, block_out_channels=(16, 32, 32, 32), layers_per_block=1,
                                        norm_num_groups=4, down_block_types=("HunyuanVideoDownBlock3D",) * 4,
                                        up_block_types=("HunyuanVideoUpBlock3D",) * 4)
    else:
        vae = AutoencoderKLHunyuanVideo()
    vae = vae.eval().to(device, dtype)
    print(f"vae-hunyuan: built in {time.perf_counter() - built:.1f} s", file=sys.stderr, flush=True)
    g = torch.Generator("cpu").manual_seed(SEED)
    latents = torch.randn(1, vae.config.latent_channels, (video["num_frames"] - 1) // 4 + 1, video["height"] // 8,
                          video["width"] // 8, generator=g).to(device)
    out: dict[str, Any] = {**video, "dtype": str(dtype).split(".")[-1], "latent_shape": list(latents.shape),
                           "modes": {}}
    whole_stage, tiled_stage = DecodingStage(vae), DecodingStage(vae, tile_size=4 if args.tiny else 32)

    def whole():
        return video_to_frames(whole_stage.decode(latents)).numpy()[0]

    def tiled():  # diffusers' default 256-pixel tiles (at --tiny: 32, so that the tiny video has several)
        vae.enable_tiling(**(dict(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=24,
                                  tile_sample_stride_width=24) if args.tiny else {}))
        try:
            return whole()
        finally:
            vae.disable_tiling()

    def exact_tiled():
        return video_to_frames(tiled_stage.decode(latents)).numpy()[0]

    reference = None
    for label, fn in (("whole", whole), ("diffusers-tiled", tiled), ("exact-tiled", exact_tiled)):
        row: dict[str, Any] = {}
        try:
            with peak_memory(device, row, "peak_gib"):
                start = time.perf_counter()
                got = fn()
                sync(device)
                row["s"] = time.perf_counter() - start
        except torch.OutOfMemoryError as e:  # the point of tiling: record it and go on
            row["error"] = f"out of memory: {str(e)[:200]}"
            got = None
            free_device(device)
        if reference is None:
            reference = got
        row["max_uint8_diff_vs_whole"] = uint8_diff(got, reference) if got is not None else None
        out["modes"][label] = row
        print(f"vae-hunyuan {label}: {row}", file=sys.stderr, flush=True)  # progress, kept if the part times out
    free_device(device)
    return out


def part_offload_disk(args) -> dict:
    """The disk tier from the shared folder's transformer files against the resident model, one forward each."""
    import torch

    from composer.accel.disk import load_with_blocks_on_disk
    from composer.loader.components import ComponentSpec, ComposerModelLoader

    device, dtype = torch.device(args.device), args.torch_dtype
    config, video = sizes(args.tiny, "1.3b")
    inputs = dit_inputs(config, video, device, dtype)
    folder = shared_folder(args) / "transformer"
    out: dict[str, Any] = {}
    model = ComposerModelLoader().load(folder, ComponentSpec("transformer", "diffusers", ""), device, dtype)
    with peak_memory(device, out, "resident_peak_gib"):
        out["resident_s"] = steady_forward_s(model, inputs, device, args.repeats)
    with torch.inference_mode():
        ref = model(*inputs[:3])
    del model
    free_device(device)
    for f in folder.glob("*.safetensors"):  # drop the file's pages from the host cache: the first read is a disk read
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    model, offload = load_with_blocks_on_disk(folder, device, dtype, prefetch=1)
    out["disk_load_s"] = time.perf_counter() - start
    with peak_memory(device, out, "disk_first_peak_gib"):
        out["disk_first_s"] = _forward_timer(model, inputs, device, 1)[0]
    with peak_memory(device, out, "disk_peak_gib"):
        out["disk_s"] = median(_forward_timer(model, inputs, device, args.repeats))
    if device.type == "cuda":
        out["disk_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    with torch.inference_mode():
        got = model(*inputs[:3])
    out["max_abs_diff"] = max_diff(got, ref)
    out["slowdown"] = out["disk_s"] / out["resident_s"]
    import resource

    out["host_peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    offload.remove()
    return out


def part_memory(args) -> dict:
    """The memory predictor against measured peaks (benchmarks/memory_predictor.py, each size in a fresh process),
    then offload = auto under a budget the model's whole-video decode does not fit: the plan it picks and the peak
    a real request reaches under it."""
    import torch

    from composer import VideoGenerator

    device = torch.device(args.device)
    folder = shared_folder(args)
    sizes = "5x64x64" if args.tiny else "17x480x832,81x480x832,81x720x1280"
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "memory_predictor.py"), "--model-path", str(folder),
           "--device", args.device, "--dtype", args.dtype, "--sizes", sizes, "--steps", "2", "--tolerance", "1"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=PARTS["memory"][0] * args.budget_scale)
    if res.returncode:
        raise RuntimeError(f"memory_predictor.py exited {res.returncode}: {(res.stderr or res.stdout)[-2000:]}")
    out: dict[str, Any] = {"report": res.stdout[-3000:]}
    video = dict(VIDEO_TINY) if args.tiny else dict(VIDEO_480P)
    # 10 GB: the whole-video decode (11.5 GiB predicted at 480p, 81 frames, on an H200) does not fit, offloading and
    # tiling do (8 GB left none of the placements inside the 15% headroom on the device, by 0.01 GiB)
    budget = 0.6e9 if args.tiny else 10e9
    start = time.perf_counter()
    gen = VideoGenerator.from_pretrained(folder, device=str(device), dtype=args.dtype, progress=False, offload="auto",
                                         memory_budget=budget)
    plan = gen.memory_guard.plan
    out.update(plan=plan.describe(), plan_offload=plan.offload, plan_tiled=plan.vae_tiling, predicted=plan.peak,
               budget=budget, plan_s=time.perf_counter() - start)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    from composer.errors import MemoryBudgetError

    try:
        gen.generate_video(PROMPT, negative_prompt=NEGATIVE, num_inference_steps=2, guidance_scale=GUIDANCE,
                           seed=SEED, **video)
    except MemoryBudgetError as exc:  # the plan's own refusal is a result (the predictor's figures above stand)
        out["refused"] = str(exc)
        out["report"] += f"\noffload = auto, memory_budget = {budget / 1e9:.0f} GB: {plan.describe()}; refused: {exc}\n"
        return out
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        out["measured"] = torch.cuda.max_memory_allocated(device)
        out["report"] += (f"\noffload = auto, memory_budget = {budget / 1e9:.0f} GB: {plan.describe()}; the request's "
                          f"measured peak {out['measured'] / 2**30:.2f} GiB (max_memory_allocated, weights included)\n")
    return out


def part_sparse(args) -> dict:
    grid = ["3", "4", "4"] if args.tiny else ["21", "30", "52"]
    heads = ["2", "32"] if args.tiny else ["12", "128"]
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "sparse_attention.py"), "--grid", *grid, "--heads", heads[0],
           "--head-dim", heads[1], "--device", args.device, "--skip-video", "--repeats", str(args.repeats)]
    cmd += ["--windows", "full;default" if args.tiny else "full;default;3x6x8"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=PARTS["sparse"][0] * args.budget_scale)
    if res.returncode:
        raise RuntimeError(f"sparse_attention.py exited {res.returncode}: {res.stderr[-2000:]}")
    return {"report": res.stdout[-4000:]}


def part_concurrency(args) -> dict:
    script = str(REPO_ROOT / "benchmarks" / "concurrency.py")
    runs = []
    if args.tiny:
        runs.append(["--levels", "1,2", "--kinds", "t2v,stream", "--steps", "2", "--stream-frames", "17"])
    else:
        runs.append(["--t2v-model", "wan1.3b", "--kinds", "t2v", "--levels", "1,4", "--steps", "4",
                     "--height", "240", "--width", "416", "--num-frames", "17", "--repeats", "3"])
        runs.append(["--kinds", "t2v,stream", "--levels", "1,2,4,8", "--repeats", "3"])  # launch-bound tiny steps
        # the same requests as tasks on the request loop (submit_video, VideoStream.next_task): what a server runs
        runs.append(["--kinds", "t2v,stream", "--levels", "1,4,8", "--repeats", "3", "--api", "tasks"])
    reports = []
    for extra in runs:
        cmd = [sys.executable, script, "--device", args.device, "--dtype", args.dtype, *extra]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=PARTS["concurrency"][0] * args.budget_scale)
        if res.returncode:
            raise RuntimeError(f"concurrency.py exited {res.returncode}: {(res.stderr or res.stdout)[-2000:]}")
        reports.append(res.stdout[-3000:])
    return {"report": "\n".join(reports)}


def part_kv_pool(args) -> dict:
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "kv_pool.py"), "--device", args.device, "--dtype", args.dtype,
           "--repeats", str(args.repeats)] + (["--tiny"] if args.tiny else [])
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=PARTS["kv-pool"][0] * args.budget_scale)
    if res.returncode:
        raise RuntimeError(f"kv_pool.py exited {res.returncode}: {(res.stderr or res.stdout)[-2000:]}")
    return {"report": res.stdout[-3000:]}


def part_dllm(args) -> dict:
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "dllm.py"), "--device", args.device, "--dtype", "fp32"]
    if args.tiny:
        cmd += ["--problems", "32", "--strategies", "exact,threshold"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=PARTS["dllm"][0] * args.budget_scale)
    if res.returncode:
        raise RuntimeError(f"dllm.py exited {res.returncode}: {(res.stderr or res.stdout)[-2000:]}")
    return {"report": res.stdout[-3000:]}


def part_host_profile(args) -> dict:
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "host_profile.py"), "--device", args.device,
           "--dtype", args.dtype, "--sample", "--cprofile"]
    cmd += ["--n", "2", "--stream-frames", "9", "--repeats", "1"] if args.tiny else ["--n", "8", "--repeats", "5"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=PARTS["host-profile"][0] * args.budget_scale)
    if res.returncode:
        raise RuntimeError(f"host_profile.py exited {res.returncode}: {(res.stderr or res.stdout)[-2000:]}")
    return {"report": res.stdout[-12000:]}


PART_FUNCS = {
    "dit-1.3b": lambda a: part_dit(a, "1.3b"),
    "dit-14b": lambda a: part_dit(a, "14b"),
    "e2e-1.3b": part_e2e,
    "compile-1.3b": part_compile,
    "quant-1.3b": part_quant,
    "offload-1.3b": part_offload,
    "sparse": part_sparse,
    "concurrency": part_concurrency,
    "kv-pool": part_kv_pool,
    "cache-1.3b": part_cache,
    "causal-1.3b": part_causal,
    "vae": part_vae,
    "vae-hunyuan": part_vae_hunyuan,
    "offload-disk-1.3b": part_offload_disk,
    "memory": part_memory,
    "dllm": part_dllm,
    "host-profile": part_host_profile,
}


# -- driver --------------------------------------------------------------------------------------------------


def run_part_here(args) -> None:
    import torch

    args.torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[args.dtype]
    start = time.perf_counter()
    result = PART_FUNCS[args.part](args)
    result["wall_s"] = time.perf_counter() - start
    Path(args.result).write_text(json.dumps(result, indent=1, default=str))


def environment(args) -> dict:
    env: dict[str, Any] = {"python": platform.python_version(), "date": time.strftime("%Y-%m-%d"),
                           "device": args.device, "dtype": args.dtype, "tiny": args.tiny}
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                       text=True).stdout.strip() or "unknown"
    except OSError:
        env["commit"] = "unknown"
    code = ("import torch, json; d = {'torch': torch.__version__}\n"
            "if torch.cuda.is_available(): d['gpu'] = torch.cuda.get_device_name(0)\n"
            "try:\n import diffusers; d['diffusers'] = diffusers.__version__\nexcept ImportError: pass\n"
            "print(json.dumps(d))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if res.returncode == 0:
        env.update(json.loads(res.stdout.strip().splitlines()[-1]))
    return env


def fmt(x, unit: str = "", digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}g}{unit}"
    return f"{x}{unit}"


def summary_rows(name: str, r: dict) -> list[str]:
    """One or more markdown table rows (part, measurement, composer, reference, ratio, note)."""
    if r.get("status") != "ok":
        return [f"| {name} | {r.get('status')} | - | - | - | {r.get('error', '')[:160]} |"]
    if name.startswith("dit-"):
        f, rows = r["forward_s"], []
        rows.append(f"| {name} | DiT forward, {r['tokens']} tokens | {fmt(f['composer'], ' s')} | "
                    f"{fmt(f['diffusers'], ' s')} | {r['forward_ratio']:.2f}x | max abs diff "
                    f"{r['forward_max_abs_diff']:.1e}; peak {fmt(r.get('forward_peak_gib_composer'), ' GiB')} vs "
                    f"{fmt(r.get('forward_peak_gib_diffusers'), ' GiB')} |")
        if "cfg_step_s" in r:
            s = r["cfg_step_s"]
            rows.append(f"| {name} | CFG step (2 branches) | {fmt(s['composer'], ' s')} | {fmt(s['diffusers'], ' s')} "
                        f"| {r['cfg_step_ratio']:.2f}x | max abs diff {r['cfg_step_max_abs_diff']:.1e} |")
        return rows
    if name == "e2e-1.3b":
        e, st = r["e2e_s"], r.get("composer_stage_s", {})
        stages = ", ".join(f"{k.replace('Stage', '')} {v:.2f}" for k, v in st.items())
        return [f"| {name} | prompt -> frames, {r['steps']} steps, {r['num_frames']}x{r['height']}x{r['width']} | "
                f"{fmt(e['composer'], ' s')} | {fmt(e['diffusers'], ' s')} | {r['e2e_ratio']:.2f}x | max uint8 diff "
                f"{r['max_uint8_diff']}; composer stages (s): {stages} |"]
    if name == "compile-1.3b":
        return [f"| {name} | regional compile: cold first forward / steady | {fmt(r['compiled_cold_s'], ' s')} / "
                f"{fmt(r['compiled_s'], ' s')} | eager {fmt(r['eager_s'], ' s')} | {r['speedup']:.2f}x | max abs diff "
                f"{r['max_abs_diff']:.1e} |"]
    if name == "quant-1.3b":
        rows = []
        for mode in ("int8", "fp8"):
            if f"{mode}_s" in r:
                rows.append(f"| {name} | {mode} weight-only DiT forward | {fmt(r[f'{mode}_s'], ' s')} | {r['dtype']} "
                            f"{fmt(r['bf16_s'], ' s')} | {r[f'{mode}_ratio']:.2f} (time) | block linears "
                            f"{r[f'{mode}_linear_gib']:.2f} vs {r['bf16_linear_gib']:.2f} GiB; rel. error "
                            f"{r[f'{mode}_rel_err']:.1e} |")
        return rows
    if name == "offload-1.3b":
        return [f"| {name} | layerwise offload DiT forward | {fmt(r['layerwise_s'], ' s')} | resident "
                f"{fmt(r['resident_s'], ' s')} | {r['slowdown']:.2f} (time) | peak "
                f"{fmt(r.get('layerwise_allocated_gib', r.get('layerwise_peak_gib')), ' GiB')} vs "
                f"{fmt(r.get('resident_allocated_gib', r.get('resident_peak_gib')), ' GiB')}; max abs diff "
                f"{r['max_abs_diff']:.1e} |"]
    if name == "cache-1.3b":
        m, rows = r["modes"], []
        for label in ("teacache", "dbcache"):
            if label in m:
                x = m[label]
                rows.append(f"| {name} | {label} (default), {r['steps']} CFG steps, {r['num_frames']}x{r['height']}x"
                            f"{r['width']}: denoising / total | {fmt(x['denoise_s'], ' s')} / {fmt(x['total_s'], ' s')} "
                            f"| exact {fmt(m['exact']['denoise_s'], ' s')} / {fmt(m['exact']['total_s'], ' s')} | "
                            f"{x['denoise_ratio']:.2f}x | {x.get('skipped')}/{x.get('calls')} calls skipped; PSNR "
                            f"{x['psnr_db']:.1f} dB vs exact (random weights); peak {fmt(x['peak_gib'], ' GiB')} |")
        return rows
    if name == "causal-1.3b":
        return [f"| {name} | stream {r['num_frames']}x{r['height']}x{r['width']}, {r['blocks']} blocks: time to first "
                f"frame / frames/s | {fmt(r['ttff_s'], ' s')} / {fmt(r['fps'], ' fps')} | - | - | denoising alone "
                f"{fmt(r['denoise_fps'], ' fps')}; block {fmt(r['block_median_s'], ' s')}, decode "
                f"{fmt(r['decode_median_s'], ' s')} a block (medians); KV cache {fmt(r['kv_cache_gib'], ' GiB')}; peak "
                f"{fmt(r['peak_gib'], ' GiB')} |"]
    if name == "vae":
        rows, m = [], r["modes"]
        for label, x in m.items():
            whole = m.get("whole-" + label.rsplit("-", 1)[1], x)
            extra = f"; blocks {fmt(median(x['block_s']), ' s')} median" if "block_s" in x else ""
            rows.append(f"| {name} | decode {r['num_frames']}x{r['height']}x{r['width']}, {label} | {fmt(x['s'], ' s')} "
                        f"| whole {fmt(whole['s'], ' s')} | {x['s'] / whole['s']:.2f} (time) | peak "
                        f"{fmt(x['peak_gib'], ' GiB')}; max uint8 diff vs fp32 whole {x['max_uint8_diff_vs_fp32_whole']}"
                        f"{extra} |")
        return rows
    if name == "vae-hunyuan":
        rows, m = [], r["modes"]
        whole = m.get("whole", {})
        for label, x in m.items():
            if "s" not in x:
                rows.append(f"| {name} | decode {r['num_frames']}x{r['height']}x{r['width']} {r['dtype']}, {label} | "
                            f"{x.get('error', 'failed')} | - | - | |")
                continue
            ratio = f"{x['s'] / whole['s']:.2f} (time)" if whole.get("s") else "-"
            rows.append(f"| {name} | decode {r['num_frames']}x{r['height']}x{r['width']} {r['dtype']}, {label} | "
                        f"{fmt(x['s'], ' s')} | whole {fmt(whole.get('s'), ' s')} | {ratio} | peak "
                        f"{fmt(x['peak_gib'], ' GiB')}; max uint8 diff vs whole {x['max_uint8_diff_vs_whole']} |")
        return rows
    if name == "offload-disk-1.3b":
        return [f"| {name} | disk tier DiT forward (first, from a dropped page cache / steady) | "
                f"{fmt(r['disk_first_s'], ' s')} / {fmt(r['disk_s'], ' s')} | resident {fmt(r['resident_s'], ' s')} | "
                f"{r['slowdown']:.2f} (time) | load {fmt(r['disk_load_s'], ' s')}; peak "
                f"{fmt(r.get('disk_allocated_gib', r.get('disk_peak_gib')), ' GiB')} vs "
                f"{fmt(r['resident_peak_gib'], ' GiB')} (activations); host peak RSS "
                f"{fmt(r['host_peak_rss_gib'], ' GiB')}; max abs diff {r['max_abs_diff']:.1e} |"]
    if name in ("sparse", "concurrency", "kv-pool", "dllm", "memory"):
        return [f"| {name} | see its report below | - | - | - | |"]
    return [f"| {name} | {json.dumps(r)[:200]} | | | | |"]


def markdown(env: dict, results: dict) -> str:
    head = (f"composer GPU suite: {env.get('gpu', env['device'])}, torch {env.get('torch')}, diffusers "
            f"{env.get('diffusers')}, {env['dtype']}, commit {env['commit']}, {env['date']}"
            f"{' (--tiny)' if env['tiny'] else ''}\n\n")
    lines = ["| part | measurement | composer | reference | ratio (ref/composer, or time ratio) | notes |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        lines += summary_rows(name, r)
    tail = "".join(f"\n{name}:\n{r['report']}\n" for name, r in results.items() if r.get("status") == "ok" and "report" in r)
    return head + "\n".join(lines) + "\n" + tail


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny models and videos (CPU, fp32 unless told): CI's smoke run")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp32", "fp16"], help="default bf16 on cuda, fp32 on cpu")
    p.add_argument("--only", default=None, help=f"comma-separated parts (default all): {', '.join(PARTS)}")
    p.add_argument("--skip", default="", help="comma-separated parts to leave out")
    p.add_argument("--out", default="gpu_suite_out", help="folder for gpu_suite.json and gpu_suite.md")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (after one warmup)")
    p.add_argument("--budget-scale", type=float, default=1.0, help="multiply every part's time budget")
    p.add_argument("--total-budget", type=float, default=None,
                   help="seconds for the whole suite: a part gets at most what is left (default: no limit)")
    p.add_argument("--scratch", default=None, help="folder for the e2e model folder (default: the system temp)")
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    if args.part:
        run_part_here(args)
        return 0
    names = [n.strip() for n in args.only.split(",")] if args.only else list(PARTS)
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        p.error(f"unknown part(s) {', '.join(unknown)}: expected some of {', '.join(PARTS)}")
    names = [n for n in names if n not in set(args.skip.split(","))]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = environment(args)
    print(f"gpu_suite: {env}", flush=True)
    results: dict[str, dict] = {}
    shared = shared_folder_path(args)
    shared_existed = shared.exists()
    suite_start = time.perf_counter()
    for name in names:
        budget = PARTS[name][0] * args.budget_scale
        if args.total_budget is not None:
            budget = min(budget, args.total_budget - (time.perf_counter() - suite_start))
            if budget < 15:
                results[name] = {"status": "skipped", "error": "the suite's --total-budget was spent"}
                continue
        result_file = out_dir / f".part-{name}.json"
        result_file.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--part", name, "--result", str(result_file), "--device", args.device,
               "--dtype", args.dtype, "--repeats", str(args.repeats), "--budget-scale", str(args.budget_scale)]
        cmd += ["--tiny"] if args.tiny else []
        cmd += ["--scratch", args.scratch] if args.scratch else []
        print(f"== {name}: {PARTS[name][1]} (budget {budget:.0f} s)", flush=True)
        start = time.perf_counter()
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=budget,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
            if res.returncode == 0 and result_file.exists():
                results[name] = {"status": "ok", **json.loads(result_file.read_text())}
            else:
                lines = (res.stderr or res.stdout).strip().splitlines()
                results[name] = {"status": "failed", "error": " / ".join(lines[-3:]), "log": res.stderr[-6000:]}
        except subprocess.TimeoutExpired as exc:  # keep what the part said before it ran out (its progress lines)
            said = exc.stderr or b""
            said = said.decode(errors="replace") if isinstance(said, bytes) else said
            results[name] = {"status": "timeout", "error": f"over its {budget:.0f} s budget", "log": said[-6000:]}
        results[name]["part_wall_s"] = time.perf_counter() - start
        print(f"   {results[name]['status']} in {results[name]['part_wall_s']:.1f} s", flush=True)
        result_file.unlink(missing_ok=True)
        (out_dir / "gpu_suite.json").write_text(json.dumps({"env": env, "results": results}, indent=1, default=str))
    if not shared_existed:
        import shutil

        shutil.rmtree(shared, ignore_errors=True)
    text = markdown(env, results)
    (out_dir / "gpu_suite.md").write_text(text)
    print(text)
    return 0 if all(r["status"] == "ok" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
