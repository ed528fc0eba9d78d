"""The hook phase through the runtime: LoRA (lora_path / set_lora), offload (model, layerwise, disk) and
torch.compile (regional, full), each against the exact path, for text-to-video and causal models; the order
hooks apply in and the combinations refused."""

from __future__ import annotations

import pytest
import torch
from conftest import diffusers_frames, max_uint8_diff
from test_lora import lora_weights, write_lora

from composer import VideoGenerator
from composer.errors import ConfigError, UnsupportedError

REQUEST = dict(negative_prompt="blurry", guidance_scale=4.0, height=32, width=32, num_frames=5,
               num_inference_steps=3, seed=3)
PROMPT = "a red ball bouncing"


def _gen(folder, **runtime):
    return VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False, **runtime)


@pytest.fixture(scope="module")
def base_gen(tiny_wan_dir):
    return _gen(tiny_wan_dir)


@pytest.fixture(scope="module")
def base(base_gen):
    return base_gen.generate_video(PROMPT, **REQUEST)


@pytest.fixture(scope="module")
def lora_files(base_gen, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model = base_gen.pipeline.modules["transformer"]
    return (write_lora(root / "one.safetensors", "kohya", lora_weights(model, seed=1)),
            write_lora(root / "two.safetensors", "diffusers", lora_weights(model, seed=2)))


CAUSAL = dict(height=32, width=48, num_frames=4 * (6 - 1) + 1, seed=4, rollout_blocks=2, overlap_frames=2,
              guidance_scale=3.0, negative_prompt="")


@pytest.fixture(scope="module")
def causal_base(tiny_causal_dir):
    return _gen(tiny_causal_dir).generate_video(PROMPT, **CAUSAL)


# -- order and refusals --------------------------------------------------------------------------------
def test_hooks_apply_in_the_documented_order_and_are_logged(tiny_wan_dir, lora_files):
    gen = _gen(tiny_wan_dir, lora_path=[str(lora_files[0])], offload="model", attention_backend="sdpa")
    names = [line.split(":")[0] for line in gen.pipeline.applied_hooks]
    assert names == ["lora", "attention", "offload", "cancel"]
    assert "sdpa" in gen.pipeline.applied_hooks[1]
    assert _gen(tiny_wan_dir).pipeline.applied_hooks == [
        "attention: auto -> sdpa (transformer)", "cancel: transformer: before each of 2 blocks and each step",
    ]


def test_refused_combinations_say_why(tiny_wan_dir, lora_files):
    with pytest.raises(ConfigError, match="offload = disk"):
        _gen(tiny_wan_dir, lora_path=[str(lora_files[0])], offload="disk")
    gen = _gen(tiny_wan_dir, offload="disk")  # model and layerwise offload take adapter changes (test_hook_primitive)
    with pytest.raises(UnsupportedError, match="offload = disk"):
        gen.set_lora(lora_files[0])
    with pytest.raises(ConfigError, match="lora_scale has 2 value"):
        _gen(tiny_wan_dir, lora_path=[str(lora_files[0])], lora_scale=[1.0, 0.5])


# -- LoRA through the runtime --------------------------------------------------------------------------
def test_lora_path_matches_diffusers_and_set_unset_switch_between_videos(tiny_wan_dir, lora_files, base):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(tiny_wan_dir))
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(str(lora_files[0]), adapter_name="one")
    pipe.load_lora_weights(str(lora_files[1]), adapter_name="two")
    pipe.set_adapters(["one", "two"], [0.8, -0.4])
    request = {k: v for k, v in REQUEST.items() if k != "seed"}
    reference = diffusers_frames(pipe, PROMPT, REQUEST["seed"], **request)

    gen = _gen(tiny_wan_dir, lora_path=[str(p) for p in lora_files], lora_scale=[0.8, -0.4])
    ours = gen.generate_video(PROMPT, **REQUEST)
    assert max_uint8_diff(ours.frames, reference) <= 1
    assert max_uint8_diff(ours.frames, base.frames) > 10  # the adapters change the video

    gen.unset_lora()
    assert torch.equal(gen.generate_video(PROMPT, **REQUEST).latents, base.latents)
    gen.set_lora(lora_files, [0.8, -0.4])
    assert torch.equal(gen.generate_video(PROMPT, **REQUEST).latents, ours.latents)


def test_fused_lora_through_the_runtime_equals_unfused(tiny_wan_dir, lora_files, base):
    unfused = _gen(tiny_wan_dir, lora_path=[str(lora_files[0])]).generate_video(PROMPT, **REQUEST)
    fused_gen = _gen(tiny_wan_dir, lora_path=[str(lora_files[0])], lora_fuse=True)
    fused = fused_gen.generate_video(PROMPT, **REQUEST)
    assert (fused.latents - unfused.latents).abs().max().item() <= 1e-5
    fused_gen.unset_lora()
    assert torch.equal(fused_gen.generate_video(PROMPT, **REQUEST).latents, base.latents)


def test_causal_model_with_a_lora(tiny_causal_dir, lora_files, causal_base):
    gen = _gen(tiny_causal_dir, lora_path=[str(lora_files[0])])
    cached = gen.generate_video(PROMPT, **CAUSAL)
    recomputed = gen.generate_video(PROMPT, kv_cache=False, **CAUSAL)
    assert (cached.latents - recomputed.latents).abs().max().item() <= 1e-5
    assert (cached.latents - causal_base.latents).abs().max().item() > 1e-2
    gen.unset_lora()
    assert torch.equal(gen.generate_video(PROMPT, **CAUSAL).latents, causal_base.latents)


# -- offload -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["model", "layerwise", "disk"])
def test_offload_equals_no_offload(tiny_wan_dir, base, mode):
    ours = _gen(tiny_wan_dir, offload=mode).generate_video(PROMPT, **REQUEST)
    assert (ours.latents - base.latents).abs().max().item() <= 1e-5


@pytest.mark.parametrize("mode", ["model", "layerwise", "disk"])
def test_offload_of_a_causal_model_equals_no_offload(tiny_causal_dir, causal_base, mode):
    gen = _gen(tiny_causal_dir, offload=mode)
    ours = gen.generate_video(PROMPT, **CAUSAL)
    assert (ours.latents - causal_base.latents).abs().max().item() <= 1e-5
    streamed = gen.stream_video(PROMPT, **CAUSAL)
    chunks = list(streamed)
    assert len(chunks) == 3 and (streamed.latents.cpu() - causal_base.latents).abs().max().item() <= 1e-5


def test_layerwise_offload_with_a_lora_at_load(tiny_wan_dir, lora_files):
    plain = _gen(tiny_wan_dir, lora_path=[str(lora_files[0])]).generate_video(PROMPT, **REQUEST)
    for fuse in (False, True):
        gen = _gen(tiny_wan_dir, lora_path=[str(lora_files[0])], lora_fuse=fuse, offload="layerwise")
        assert (gen.generate_video(PROMPT, **REQUEST).latents - plain.latents).abs().max().item() <= 1e-5


# -- torch.compile ---------------------------------------------------------------------------------------
def _graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _reset_dynamo() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()  # reset() keeps the counters


@pytest.mark.slow
def test_regional_compile_equals_eager_and_compiles_once(tiny_wan_dir, tmp_path, base):
    from composer.testing import build_tiny_wan

    _reset_dynamo()
    gen = _gen(tiny_wan_dir, compile="regional")
    first = gen.generate_video(PROMPT, **REQUEST)
    graphs = _graphs()
    second = gen.generate_video(PROMPT, **{**REQUEST, "seed": 9})  # same size: no new graphs
    assert _graphs() == graphs, "recompiled between videos of the same size"
    assert (first.latents - base.latents).abs().max().item() <= 1e-4
    assert not torch.equal(first.latents, second.latents)

    # compile time does not grow with depth: a 4-layer model compiles as many graphs as the 2-layer one
    deep = build_tiny_wan(tmp_path / "deep", num_layers=4)
    _reset_dynamo()
    _gen(deep, compile="regional").generate_video(PROMPT, **REQUEST)
    assert _graphs() == graphs


@pytest.mark.slow
def test_full_compile_equals_eager(tiny_wan_dir, base):
    _reset_dynamo()
    gen = _gen(tiny_wan_dir, compile="full")
    assert (gen.generate_video(PROMPT, **REQUEST).latents - base.latents).abs().max().item() <= 1e-4
    graphs = _graphs()
    gen.generate_video(PROMPT, **{**REQUEST, "seed": 1})
    assert _graphs() == graphs


@pytest.mark.slow
def test_compile_composes_with_unfused_lora_and_offload(tiny_wan_dir, lora_files):
    eager = _gen(tiny_wan_dir, lora_path=[str(lora_files[0])]).generate_video(PROMPT, **REQUEST)
    _reset_dynamo()
    gen = _gen(tiny_wan_dir, lora_path=[str(lora_files[0])], compile="regional", offload="layerwise")
    assert (gen.generate_video(PROMPT, **REQUEST).latents - eager.latents).abs().max().item() <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["regional", "full"])
def test_compile_of_a_causal_model(tiny_causal_dir, causal_base, mode):
    """The KV cache's bookkeeping stays out of the graphs: the graphs settle within the first video."""
    _reset_dynamo()
    gen = _gen(tiny_causal_dir, compile=mode)
    first = gen.generate_video(PROMPT, **CAUSAL)
    assert (first.latents - causal_base.latents).abs().max().item() <= 1e-4
    graphs = _graphs()
    gen.generate_video(PROMPT, **{**CAUSAL, "seed": 8})
    assert _graphs() == graphs, "recompiled between videos of the same size"


# -- one name per knob: flags and YAML ----------------------------------------------------------------------
def test_hook_flags_and_preset_keys_reach_the_pipeline(tiny_wan_dir, lora_files, tmp_path, capsys):
    """`--lora-path A B --lora-scale x y --offload layerwise` and the same under `runtime:` in a preset give
    the video the Python API gives; a bad value is one error line naming the accepted ones."""
    import numpy as np

    from composer.cli.main import main

    small = ["--height", "32", "--width", "32", "--num-frames", "5", "--steps", "3", "--seed", "3",
             "--negative-prompt", "blurry", "--guidance-scale", "4.0", "--dtype", "fp32", "--no-progress"]
    flags_out = tmp_path / "flags"
    code = main(["generate", "--model-path", str(tiny_wan_dir), "--prompt", PROMPT, *small, "--offload", "layerwise",
                 "--lora-path", str(lora_files[0]), str(lora_files[1]), "--lora-scale", "0.8", "-0.4",
                 "--cfg-mode", "sequential", "--output", str(flags_out)])
    assert code == 0
    preset = tmp_path / "hooks.yaml"
    preset.write_text(f"runtime:\n  offload: layerwise\n  lora_path: [{lora_files[0]}, {lora_files[1]}]\n"
                      "  lora_scale: [0.8, -0.4]\n  cfg_mode: sequential\n")
    preset_out = tmp_path / "preset"
    assert main(["generate", "--config", str(preset), "--model-path", str(tiny_wan_dir), "--prompt", PROMPT,
                 *small, "--output", str(preset_out)]) == 0
    api = _gen(tiny_wan_dir, lora_path=[str(p) for p in lora_files], lora_scale=[0.8, -0.4]).generate_video(
        PROMPT, **REQUEST)
    import imageio.v3 as iio

    for folder in (flags_out, preset_out):
        frames = np.stack([iio.imread(p) for p in sorted(folder.glob("*.png"))])
        assert max_uint8_diff(frames, api.frames) <= 1
    capsys.readouterr()
    assert main(["generate", "--model-path", str(tiny_wan_dir), "--prompt", PROMPT, "--compile", "max"]) == 1
    assert "compile = 'max': expected one of none, regional, full" in capsys.readouterr().err
