"""Memory planning (composer/memory/): weights from the safetensors headers, activations from the pipeline's twin on
fake tensors, the placement `offload = auto` picks, and requests refused with the numbers before they run."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from composer import VideoGenerator
from composer.errors import ConfigError, MemoryBudgetError
from composer.memory import (
    ComponentWeights,
    LiveBytes,
    MemoryPredictor,
    RequestMemory,
    component_weights,
    fake_mode,
    plan_memory,
    traced_peak,
)
from composer.memory.predict import StageMemory
from composer.testing import build_tiny_wan

REPO = Path(__file__).resolve().parents[1]
VIDEO = dict(num_frames=9, height=64, width=64, num_inference_steps=2, seed=3)


@pytest.fixture(scope="module")
def wan_folder(tmp_path_factory):
    return build_tiny_wan(tmp_path_factory.mktemp("memory") / "wan")


def state_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def test_weights_from_the_headers_are_the_loaded_bytes(wan_folder):
    gen = VideoGenerator.from_pretrained(str(wan_folder), device="cpu", progress=False)
    for name in ("transformer", "text_encoder", "vae"):
        module = gen.pipeline.modules[name]
        counted = component_weights(wan_folder / name, name, gen.pipeline.module_dtype(name))
        loaded = sum(p.numel() * p.element_size() for p in module.parameters())
        assert counted.total == pytest.approx(loaded, rel=0.02), name  # (persistent buffers are in the file too)
    # in bf16 each floating tensor counts two bytes; blocks are counted apart
    half = component_weights(wan_folder / "transformer", "transformer", torch.bfloat16)
    full = component_weights(wan_folder / "transformer", "transformer", torch.float32)
    assert half.total * 2 == full.total and len(full.blocks) == 2 and full.other > 0
    assert full.streamed(resident_blocks=1) == full.other + max(full.blocks.values())


def test_live_bytes_follow_tensors_created_and_freed():
    def work():
        a = torch.empty(1000, dtype=torch.float32)  # 4000 B
        b = torch.empty(500, dtype=torch.float64)  # 4000 B: peak 8000
        del a
        c = torch.empty(250, dtype=torch.float32)  # live 5000
        return b, c

    peak, (b, c) = traced_peak(work)
    assert peak == 8000
    tracker = LiveBytes()
    with fake_mode(), tracker:
        x = torch.empty(100, 100)  # fake: nothing allocated, 40000 B counted
        y = x @ x  # another 40000 B
        del x, y
    assert tracker.peak == 80000 and tracker.live == 0


def traced_convolution(conv: torch.nn.Module, shape: tuple, device: str | None = "cpu") -> tuple[LiveBytes, int]:
    """(the tracker after `conv` ran on a fake input of `shape` that existed before it, the output's bytes)."""
    tracker = LiveBytes(device)
    with fake_mode() as mode:
        x = mode.from_tensor(torch.zeros(shape))  # existed before: not counted itself
        with tracker, torch.inference_mode():
            y = conv(x)
            out = y.numel() * 4
            del y
    return tracker, out


def test_a_narrow_cpu_convolution_counts_its_im2col_buffer_for_its_call_only():
    """A batch-1 3x3x3 convolution of few channels on a few frames runs PyTorch's native kernel (Slow3d), which
    unfolds the input into a buffer of 27 rows per input channel by the output's positions: 27x its output at
    equal widths (the narrow VAEs' 9x their three-frame input), freed when it returns."""
    conv = torch.nn.Conv3d(8, 16, 3, padding=1)
    for device in ("cpu", None):
        tracker, out = traced_convolution(conv, (1, 8, 2, 10, 10), device)
        assert tracker.peak == out + 8 * 27 * (2 * 10 * 10) * 4 and tracker.live == 0, device
    # a 1x1x1 kernel reads the input as it is: nothing beyond the output
    tracker, out = traced_convolution(torch.nn.Conv3d(8, 16, 1), (1, 8, 2, 10, 10))
    assert tracker.peak == out


def test_a_onednn_convolution_counts_its_blocked_copies_channels_padded_to_the_block():
    """A convolution oneDNN runs reorders its input and weight into a layout of channel blocks (16 with AVX-512,
    8 otherwise: 24 channels pad to 32 at 16) and writes its output blocked before copying it out."""
    from composer.memory.cpu_convolution import channel_block

    block = channel_block()
    padded = -(-24 // block) * block
    shape = (1, 24, 4, 256, 8)  # batch x channels x frames x height > 20480: PyTorch picks oneDNN
    tracker, out = traced_convolution(torch.nn.Conv3d(24, 24, 3, padding=1), shape)
    src = padded * 4 * 256 * 8 * 4
    dst = src  # same positions and channels as the input
    weight = padded * padded * 27 * 4
    assert tracker.peak == out + max(src + weight + dst - out, dst) and tracker.live == 0
    # fewer input channels than a block: oneDNN's first-convolution kernel reads the input unreordered
    narrow = block - 4
    tracker, out = traced_convolution(torch.nn.Conv3d(narrow, 24, 3, padding=1), (1, narrow, 4, 2048, 8))
    dst = padded * 4 * 2048 * 8 * 4
    assert tracker.peak == out + max(padded * narrow * 27 * 4 + dst - out, dst)


NARROW_VAE_DECODE = """
import json, sys, torch
from diffusers import AutoencoderKLWan
from composer.memory import fake_mode, traced_peak

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

torch.manual_seed(0)
vae = AutoencoderKLWan(base_dim=12, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1, attn_scales=[],
                       temperal_downsample=[False, True, True]).eval()
z = torch.randn(1, 16, 2, 8, 12)  # a 5x64x96 video
mode = fake_mode()
fake_z = mode.from_tensor(z)
predicted, _ = traced_peak(lambda: vae.decode(fake_z, return_dict=False)[0], mode, "cpu")
with torch.inference_mode():
    vae.decode(torch.randn(1, 16, 2, 2, 2), return_dict=False)  # warm up (its cached frames' path too): code resident
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS starts again from here
    before = status("VmRSS")
    vae.decode(z, return_dict=False)
    measured = status("VmHWM") - before
print("RESULT " + json.dumps({"predicted": predicted, "measured": measured}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resettable peak RSS")
def test_a_narrow_vae_decode_is_predicted_within_ten_percent_of_its_measured_peak_rss():
    """A base-width-12 Wan VAE decodes on the CPU through PyTorch's native 3D convolution (im2col, 27 rows per
    input channel) and oneDNN's blocked layout (channels padded to 16 or 8): the trace models both, so its peak is
    the measured rise of peak RSS within 10% (1-3% measured on AVX-512; the rest is allowance for another CPU's
    kernels and allocator). Before that model it was 69% under."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}  # freed blocks leave RSS (benchmarks/memory_predictor)
    run = subprocess.run([sys.executable, "-c", NARROW_VAE_DECODE], capture_output=True, text=True, env=env,
                         timeout=300, cwd=REPO)
    line = next((x for x in run.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert run.returncode == 0 and line, run.stderr[-3000:]
    result = json.loads(line[len("RESULT "):])
    assert result["measured"] > 16 * 2**20, result  # the decode's activations, not the allocator's noise
    assert abs(result["predicted"] / result["measured"] - 1) <= 0.10, result


def test_the_twin_predicts_the_request_stage_by_stage_without_touching_the_model(wan_folder):
    gen = VideoGenerator.from_pretrained(str(wan_folder), device="cpu", progress=False)
    pipeline = gen.pipeline
    weights_before = {n: p.clone() for n, p in pipeline.modules["transformer"].named_parameters()}
    predictor = MemoryPredictor(type(pipeline), pipeline.index, pipeline.config, pipeline.runtime)
    from composer.generator import new_batch

    small = gen.sampling_param(prompt="a fox", num_frames=9, height=64, width=64)
    big = gen.sampling_param(prompt="a fox", num_frames=17, height=128, width=128)
    a = predictor.request(new_batch(small), small, key=("small",))
    b = predictor.request(new_batch(big), big, key=("big",))
    for module in predictor.twin().modules.values():  # the twin's modules live where the real ones do
        if isinstance(module, torch.nn.Module):
            assert all(t.device == pipeline.device for t in [*module.parameters(), *module.buffers()])
    names = [s.name for s in a.stages]
    assert names == ["TextEncodingStage", "DenoisingStage", "DecodingStage"]
    decode = {s.name: s.peak for s in b.stages}["DecodingStage"]
    assert decode > 4 * {s.name: s.peak for s in a.stages}["DecodingStage"]  # 4x the pixels, ~2x the frames
    assert b.peak > a.peak > 0
    assert predictor.request(new_batch(big), big, key=("big",)) is b  # cached by its key
    for n, p in pipeline.modules["transformer"].named_parameters():  # the real model is untouched
        assert torch.equal(p, weights_before[n])
    # the real run still gives the same frames as a generator that never predicted
    plain = VideoGenerator.from_pretrained(str(wan_folder), device="cpu", progress=False)
    np.testing.assert_array_equal(gen.generate_video("a fox", **VIDEO).frames,
                                  plain.generate_video("a fox", **VIDEO).frames)


class _Stub:
    """A predictor with chosen weights and activations (the planner's arithmetic alone)."""

    def __init__(self, device: str, request: RequestMemory, tiled: RequestMemory | None = None):
        gib = 2**30
        self.device = torch.device(device)
        self.weights = {"text_encoder": ComponentWeights("text_encoder", other=2 * gib),
                        "vae": ComponentWeights("vae", other=gib // 4),
                        "transformer": ComponentWeights("transformer", other=gib // 2,
                                                        blocks={f"blocks.{i}": gib // 2 for i in range(20)})}
        self._requests = {False: request, True: tiled or request}

    def request(self, batch, sampling, segments=None, key=None, tiled_decode=False):
        return self._requests[tiled_decode]


def _request(denoise: float, decode: float) -> RequestMemory:
    gib = 2**30
    return RequestMemory([StageMemory("TextEncodingStage", ("text_encoder",), gib // 8, 0),
                          StageMemory("DenoisingStage", ("transformer",), int(denoise * gib), gib // 8),
                          StageMemory("DecodingStage", ("vae",), int(decode * gib), 0)])


@pytest.mark.parametrize("budget_gib, expected", [
    # weights: text encoder 2, VAE 0.25, transformer 0.5 + 20 blocks of 0.5 GiB; 15% of the budget kept free
    (40, ("none", False)),  # 12.75 GiB of weights + 4.125 of denoising activations: 16.9 GiB
    (17, ("model", False)),  # one component at a time: the transformer's 10.5 + 4.125 = 14.6 GiB
    (10, ("layerwise", False)),  # 2 + 0.25 + 0.5 + two blocks + 4.125 = 7.9 GiB
    (16, ("none", True)),  # a 14 GiB whole-video decode that fits nowhere, 0.5 GiB tiled
])
def test_offload_auto_takes_the_cheapest_placement_that_fits(monkeypatch, budget_gib, expected):
    import composer.memory.plan as plan_module

    monkeypatch.setattr(plan_module, "host_available", lambda: 1 << 50)
    stub = _Stub("cuda", _request(4.0, 3.0), tiled=_request(4.0, 1.0))
    if expected[1]:
        stub = _Stub("cuda", _request(0.5, 14.0), tiled=_request(0.5, 0.5))
    video = dict(num_frames=81, height=480, width=832)
    plan = plan_memory(stub, lambda: (None, None, ("k",)), budget_gib * 2**30, video)
    assert (plan.offload, plan.vae_tiling) == expected
    assert plan.peak <= budget_gib * 2**30 / 1.15 and plan.fits
    assert f"offload {expected[0]}" in plan.describe()


def test_host_memory_decides_between_layerwise_and_disk(monkeypatch):
    import composer.memory.plan as plan_module

    monkeypatch.setattr(plan_module, "host_available", lambda: 4 * 2**30)  # 10 GiB of blocks do not fit the host
    stub = _Stub("cuda", _request(4.0, 3.0))
    plan = plan_memory(stub, lambda: (None, None, ("k",)), 7 * 2**30, dict(num_frames=81, height=480, width=832))
    assert plan.offload == "disk"
    assert any("host memory" in line for line in plan.considered)
    # LoRA or quantization rule the disk tier out: then nothing fits, and the weights alone do not fit either
    with pytest.raises(MemoryBudgetError, match="weights alone do not fit"):
        plan_memory(stub, lambda: (None, None, ("k",)), 1 * 2**30, dict(num_frames=81, height=480, width=832),
                    no_disk=True)


def test_a_budget_refuses_what_does_not_fit_with_the_numbers_and_runs_what_does(wan_folder, caplog):
    plain = VideoGenerator.from_pretrained(str(wan_folder), device="cpu", progress=False)
    with caplog.at_level(logging.INFO, logger="composer"):
        gen = VideoGenerator.from_pretrained(str(wan_folder), device="cpu", memory_budget=150e6, progress=False)
    plan = gen.memory_guard.plan
    assert plan.offload == "none" and not plan.fits  # the family's 81x480x832 default does not fit 150 MB
    assert any("no placement fits" in r.message for r in caplog.records)
    with pytest.raises(MemoryBudgetError, match=r"needs about .* more than the budget of 143\.05 MiB") as err:
        gen.generate_video("a fox", num_frames=33, height=512, width=512, num_inference_steps=2)
    assert "Decoding" in str(err.value)
    np.testing.assert_array_equal(gen.generate_video("a fox", **VIDEO).frames,
                                  plain.generate_video("a fox", **VIDEO).frames)
    assert gen.pipeline.runtime.offload == "none"


def test_offload_auto_on_the_cpu_keeps_the_model_resident_and_logs_the_plan(wan_folder, caplog):
    with caplog.at_level(logging.INFO, logger="composer"):
        gen = VideoGenerator.from_pretrained(str(wan_folder), device="cpu", offload="auto", progress=False)
    assert gen.pipeline.runtime.offload == "none" and gen.memory_guard.plan.fits
    line = next(r.message for r in caplog.records if r.message.startswith("memory plan:"))
    assert "predicted peak" in line and "within a budget" in line and "Decoding" in line


@pytest.mark.slow
def test_a_causal_stream_is_predicted_with_its_kv_cache_and_checked():
    gen = VideoGenerator.from_pretrained("shapes-causal", device="cpu", memory_budget=100e6, progress=False)
    assert gen.memory_guard.plan.fits  # 33x64x64 by default
    with pytest.raises(MemoryBudgetError, match="needs about .*CausalDenoising"):
        gen.stream_video("a red circle moving right", height=256, width=256)
    big = next(r for k, r in gen.memory_guard.predictor._cache.items() if k[:3] == (256, 256, 33))
    stages = {s.name: s for s in big.stages}
    assert stages["CausalDenoisingStage"].peak > 0 and stages["DecodingStage"].peak > 0
    plain = VideoGenerator.from_pretrained("shapes-causal", device="cpu", progress=False)
    a = gen.stream_video("a red circle moving right", seed=1)
    b = plain.stream_video("a red circle moving right", seed=1)
    np.testing.assert_array_equal(np.concatenate([c.frames for c in a]), np.concatenate([c.frames for c in b]))


def test_bad_budgets_are_refused():
    with pytest.raises(ConfigError, match="memory_budget = -1"):
        VideoGenerator.from_pretrained("shapes-t2v", device="cpu", memory_budget=-1)
    # (parallel layouts are planned: tests/test_memory_admission.py runs offload = auto under torchrun)


@pytest.mark.slow
def test_the_predictor_is_within_15_percent_of_measured_peaks_on_the_cpu(tmp_path):
    out = tmp_path / "memory.json"
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "memory_predictor.py"), "--sizes",
                          "5x64x64,13x256x256", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 2 and all(abs(r["error"]) <= 0.15 for r in rows), rows
    assert rows[1]["measured"] > 2 * rows[0]["measured"]  # the grid spans sizes that differ


@pytest.mark.parametrize("family", [pytest.param("wan-i2v", marks=pytest.mark.slow),
                                    pytest.param("wan22-a14b", marks=pytest.mark.slow), "hunyuan"])
def test_every_family_is_planned_stage_by_stage(tmp_path, family):
    """The twin runs each family's own stages: an image model planned with a stand-in first frame, Wan2.2's two
    experts each with its own stage, HunyuanVideo's template text encoder."""
    from PIL import Image

    from composer.testing import build_tiny_hunyuan
    from composer.testing.tiny_wan22 import build_tiny_wan22_a14b
    from composer.testing.tiny_wan_i2v import build_tiny_wan_i2v

    build = {"wan-i2v": build_tiny_wan_i2v, "wan22-a14b": build_tiny_wan22_a14b, "hunyuan": build_tiny_hunyuan}
    folder = build[family](tmp_path / family)
    gen = VideoGenerator.from_pretrained(str(folder), device="cpu", memory_budget=0.5, progress=False)
    extra = {"image": Image.new("RGB", (64, 64), (10, 200, 30))} if family == "wan-i2v" else {}
    gen.generate_video("a fox", num_frames=5, height=64, width=64, num_inference_steps=2, seed=1, **extra)
    request = next(r for k, r in gen.memory_guard.predictor._cache.items() if k[:3] == (64, 64, 5))
    names = " ".join(s.name for s in request.stages)
    expected = {"wan-i2v": ["ImageEncodingStage", "ImageToVideoDenoisingStage"],
                "wan22-a14b": ["DenoisingStage(transformer)", "DenoisingStage(transformer_2)"],
                "hunyuan": ["TemplateTextEncodingStage", "DenoisingStage"]}[family]
    assert all(e in names for e in expected), names
    assert request.peak > 0 and gen.memory_guard.plan.offload == "none"


def test_the_twin_quiets_only_its_own_thread(caplog):
    import threading

    from composer.logging import get_logger, quiet_this_thread

    log = get_logger("composer.test_quiet")
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Keep()
    logging.getLogger("composer").addHandler(handler)
    try:
        with quiet_this_thread():
            log.info("from the quiet thread")
            log.warning("a warning still shows")
            other = threading.Thread(target=lambda: log.info("from another thread"))
            other.start()
            other.join()
        log.info("after")
    finally:
        logging.getLogger("composer").removeHandler(handler)
    assert seen == ["a warning still shows", "from another thread", "after"]


@pytest.mark.slow
def test_budgeted_requests_at_once_each_equal_their_solo_run(wan_folder):
    from concurrent.futures import ThreadPoolExecutor

    plain = VideoGenerator.from_pretrained(str(wan_folder), device="cpu", progress=False)
    gen = VideoGenerator.from_pretrained(str(wan_folder), device="cpu", memory_budget=300e6, progress=False)
    sizes = [dict(VIDEO, seed=s, height=h) for s, h in ((1, 64), (2, 96), (3, 64))]
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda v: gen.generate_video("a fox", **v), sizes))
    for video, result in zip(sizes, results):
        # the bar of concurrent runs (docs/scheduling.md): within 1 uint8 level and 1e-5 in latents of the solo run
        # (two videos whose decodes arrive together share a VAE batch, which rounds a few pixels differently; whether
        # they do depends on the threads' timing, so equality of the frames cannot be asked)
        solo = plain.generate_video("a fox", **video)
        assert np.abs(result.frames.astype(np.int16) - solo.frames.astype(np.int16)).max() <= 1
        scale = max(1.0, solo.latents.abs().max().item())
        assert (result.latents - solo.latents).abs().max().item() <= 1e-5 * scale
