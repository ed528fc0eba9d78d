"""Whole pipelines under every parallel layout equal one process: the same latents (<= 1e-5, fp32) and the same
uint8 frames (<= 1) for one request (seed, non-square size whose tokens per frame divide by no degree, CFG),
text-to-video and causal, on 2 and 4 gloo ranks through `VideoGenerator.from_pretrained(..., <degrees>)`.
Every rank returns the whole video; only rank 0 writes the file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from composer.testing import build_tiny_wan
from composer.testing.distributed import spawn

# 48 x 80 pixels -> 6 x 10 latents -> 3 x 5 = 15 tokens a frame: divides by neither 2 nor 4
REQUEST = dict(prompt="a red ball moves left", negative_prompt="blurry", height=48, width=80, num_frames=9,
               num_inference_steps=3, guidance_scale=5.0, seed=1234)
CAUSAL_REQUEST = dict(prompt="a red ball moves left", height=48, width=80, num_frames=13, seed=99,
                      guidance_scale=3.0, negative_prompt="blurry")

LAYOUTS = {
    "ulysses2": dict(ulysses_degree=2),
    "ring2": dict(ring_degree=2),
    "cfg2": dict(cfg_parallel=True),
    "tp2": dict(tp_size=2),
    "usp2x2": dict(ulysses_degree=2, ring_degree=2),
    "tp2-ulysses2": dict(tp_size=2, ulysses_degree=2),
    "cfg2-ring2": dict(cfg_parallel=True, ring_degree=2),
}
# Hooks under parallel layouts: LoRA (unfused) under sequence and tensor parallel, compile under sequence parallel.
HOOK_LAYOUTS = {
    "ulysses2-lora": dict(ulysses_degree=2, lora=True),
    "ring2-lora": dict(ring_degree=2, lora=True),
    "tp2-lora": dict(tp_size=2, lora=True),
    "ulysses2-compile": dict(ulysses_degree=2, compile="regional"),
}
CAUSAL_LAYOUTS = {
    "ulysses2": dict(ulysses_degree=2),
    "cfg2": dict(cfg_parallel=True),  # with guidance: each half keeps its own branch's KV cache
    "ring2": dict(ring_degree=2),
    "tp2": dict(tp_size=2),
    "usp2x2": dict(ulysses_degree=2, ring_degree=2),
    "tp2-ulysses2": dict(tp_size=2, ulysses_degree=2),
}


def _world(layout: dict) -> int:
    return (layout.get("ulysses_degree", 1) * layout.get("ring_degree", 1) * layout.get("tp_size", 1)
            * (2 if layout.get("cfg_parallel") else 1))


def _params(layouts: dict):
    return [pytest.param(name, marks=pytest.mark.slow) if _world(layout) > 2 else name
            for name, layout in layouts.items()]


@pytest.fixture(scope="module")
def parallel_wan_dir(tmp_path_factory):
    """4 heads (Ulysses 4, or TP 2 x Ulysses 2) and an FFN that splits 4 ways."""
    return build_tiny_wan(tmp_path_factory.mktemp("models") / "tiny-wan-4h", num_heads=4, head_dim=16, seed=3)


@pytest.fixture(scope="module")
def parallel_causal_dir(parallel_wan_dir, tmp_path_factory):
    from helpers import write_self_forcing_checkpoint

    from composer.convert.self_forcing import CausalSettings, convert_self_forcing

    root = tmp_path_factory.mktemp("tiny-causal-4h")
    write_self_forcing_checkpoint(parallel_wan_dir, root / "sf.pt")
    return convert_self_forcing(root / "sf.pt", parallel_wan_dir, root / "causal",
                                settings=CausalSettings(num_frames_per_block=2, local_attn_size=5, sink_size=1))


@pytest.fixture(scope="module")
def lora_file(parallel_wan_dir, tmp_path_factory):
    from test_lora import lora_weights, write_lora

    from composer import VideoGenerator

    model = VideoGenerator.from_pretrained(parallel_wan_dir, dtype="fp32", progress=False).pipeline.modules["transformer"]
    return str(write_lora(tmp_path_factory.mktemp("lora") / "style.safetensors", "diffusers", lora_weights(model, 5)))


def _runtime(layout: dict, lora_file: str | None = None) -> dict:
    """The layout's runtime keywords (`lora: True` -> the LoRA file)."""
    runtime = {k: v for k, v in layout.items() if k != "lora"}
    if layout.get("lora"):
        runtime["lora_path"] = [lora_file]
    return runtime


def _generate(folder, request: dict, out: str | None = None, **runtime):
    from composer import VideoGenerator

    gen = VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False, **runtime)
    return gen.generate_video(**request, **({"output_path": out} if out else {}))


def _worker(rank, world, folder, request, layout, out_dir):
    result = _generate(folder, request, f"{out_dir}/video.mp4", **layout)
    torch.save({"latents": result.latents, "frames": torch.from_numpy(result.frames),
                "path": str(result.output_path) if result.output_path else None}, f"{out_dir}/rank{rank}.pt")


_REFERENCE: dict[tuple, object] = {}


def _reference(folder, request, lora_path=None):
    """One process's video (with the same LoRA, when the layout has one)."""
    key = (str(folder), tuple(lora_path or ()))
    if key not in _REFERENCE:
        _REFERENCE[key] = _generate(folder, request, **({"lora_path": lora_path} if lora_path else {}))
    return _REFERENCE[key]


_RESULTS: dict[str, dict] = {}  # T2V layout name -> rank 0's latents and frames (filled by the layout tests)


def _check_layout(folder, request, layout, tmp_path, one_thread, lora_file=None):
    runtime = _runtime(layout, lora_file)
    expected = _reference(folder, request, runtime.get("lora_path"))
    world = _world(layout)
    spawn(_worker, world, str(folder), request, runtime, str(tmp_path), timeout_s=240)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for rank, got in enumerate(results):  # every rank holds the whole video
        torch.testing.assert_close(got["latents"], expected.latents, atol=1e-5, rtol=0)
        diff = np.abs(got["frames"].numpy().astype(int) - expected.frames.astype(int)).max()
        assert diff <= 1, f"rank {rank}: frames differ by {diff}"
    assert results[0]["path"] is not None and all(r["path"] is None for r in results[1:])
    assert (tmp_path / "video.mp4").is_file()
    return results[0]


@pytest.mark.parametrize("name", _params(LAYOUTS))
def test_text_to_video_layout_equals_one_process(name, parallel_wan_dir, tmp_path, one_thread):
    _RESULTS[name] = _check_layout(parallel_wan_dir, REQUEST, LAYOUTS[name], tmp_path, one_thread)


@pytest.mark.slow
def test_every_layout_gives_the_same_video(parallel_wan_dir, tmp_path, one_thread):
    """One request under every supported layout (those the tests above already ran are reused, the rest run
    here), compared with each other pairwise and with one process."""
    for name, layout in LAYOUTS.items():
        if name not in _RESULTS:
            (tmp_path / name).mkdir()
            _RESULTS[name] = _check_layout(parallel_wan_dir, REQUEST, layout, tmp_path / name, one_thread)
    one = _reference(parallel_wan_dir, REQUEST)
    videos = {"one process": {"latents": one.latents, "frames": torch.from_numpy(one.frames)}, **_RESULTS}
    names = list(videos)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            torch.testing.assert_close(videos[a]["latents"], videos[b]["latents"], atol=2e-5, rtol=0,
                                       msg=lambda m, a=a, b=b: f"{a} vs {b}: {m}")
            diff = (videos[a]["frames"].int() - videos[b]["frames"].int()).abs().max().item()
            assert diff <= 1, f"{a} vs {b}: frames differ by {diff}"
    assert len(names) == len(LAYOUTS) + 1


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if "compile" in n or "tp" in n else n
                                  for n in HOOK_LAYOUTS])
def test_hooks_under_a_layout_equal_one_process(name, parallel_wan_dir, lora_file, tmp_path, one_thread):
    _check_layout(parallel_wan_dir, REQUEST, HOOK_LAYOUTS[name], tmp_path, one_thread, lora_file)


@pytest.mark.parametrize("name", _params(CAUSAL_LAYOUTS))
def test_causal_layout_equals_one_process(name, parallel_causal_dir, tmp_path, one_thread):
    _check_layout(parallel_causal_dir, CAUSAL_REQUEST, CAUSAL_LAYOUTS[name], tmp_path, one_thread)
