"""HunyuanVideo T2V: composer's DiT and pipeline against diffusers' on a tiny seeded folder, and the runtime hooks
(LoRA, offload, step caches) on this family without family-specific code."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import diffusers_frames, max_uint8_diff

from composer import VideoGenerator
from composer.loader.components import ComponentLoader
from composer.loader.model_index import read_model_index
from composer.testing.tiny_hunyuan import build_tiny_hunyuan

SMALL = dict(height=48, width=80, num_frames=9, num_inference_steps=4)  # non-square: 6x10 latents, 3 frames
CASES = {
    "embedded-guidance": dict(prompt="a red circle moving left", guidance_scale=6.0, seed=3),
    # the negative prompt is shorter than the prompt: batched CFG rows carry the text key mask
    "true-cfg": dict(prompt="a blue square moving up over the sea", negative_prompt="blurry, static",
                     guidance_scale=4.0, true_cfg_scale=3.0, seed=11),
}


@pytest.fixture(scope="module")
def tiny_hunyuan(tmp_path_factory):
    return build_tiny_hunyuan(tmp_path_factory.mktemp("models") / "tiny-hunyuan")


@pytest.fixture(scope="module")
def gen(tiny_hunyuan):
    return VideoGenerator.from_pretrained(tiny_hunyuan, dtype="fp32", progress=False)


@pytest.fixture(scope="module")
def ref_pipe(tiny_hunyuan):
    from diffusers import HunyuanVideoPipeline

    pipe = HunyuanVideoPipeline.from_pretrained(str(tiny_hunyuan))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference(pipe, gen, prompt, seed, **kwargs):
    """diffusers' frames with the prompt template cropped where composer crops it (the tiny tokenizer is not the
    released one, for which diffusers hard-codes 95)."""
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    crop = gen.pipeline.stage("TemplateTextEncodingStage").crop_start
    template = {"template": DEFAULT_PROMPT_TEMPLATE["template"], "crop_start": crop}
    return diffusers_frames(pipe, prompt, seed, prompt_template=template, **kwargs)


def load_ours(folder, dtype=torch.float32):
    spec = read_model_index(folder).component("transformer")
    return ComponentLoader.for_spec(spec, folder / "transformer").load(
        folder / "transformer", spec, torch.device("cpu"), dtype)


# -- the DiT ---------------------------------------------------------------------------------------------
def test_dit_matches_diffusers_with_text_padding(tiny_hunyuan):
    from diffusers import HunyuanVideoTransformer3DModel

    ours = load_ours(tiny_hunyuan)
    assert type(ours).__module__ == "composer.models.hunyuan.transformer"
    ref = HunyuanVideoTransformer3DModel.from_pretrained(tiny_hunyuan / "transformer").eval()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 3, 6, 10, generator=g)  # [B, C, F, H, W], non-square
    t = torch.tensor([700.0, 300.0])
    text = torch.randn(2, 12, 32, generator=g)
    mask = torch.ones(2, 12, dtype=torch.int64)
    mask[1, 7:] = 0  # row 1: 7 tokens and 5 of padding
    pooled = torch.randn(2, 32, generator=g)
    guidance = torch.tensor([6.0, 3.5])
    with torch.no_grad():
        out = ours(x, t, text, mask, pooled, guidance)
        expected = ref(x, t, text, mask, pooled, guidance * 1000, return_dict=False)[0]
        assert out.shape == x.shape
        assert (out - expected).abs().max().item() <= 1e-4
        # the mask matters: without it row 1 attends to its padding ...
        assert (ours(x, t, text, None, pooled, guidance) - out)[1].abs().max().item() > 1e-3
        # ... and with it the padding's values do not: it is the same as dropping the padding
        junk = text.clone()
        junk[1, 7:] = 100.0
        assert (ours(x, t, junk, mask, pooled, guidance) - out).abs().max().item() <= 1e-6
        trimmed = ours(x[1:], t[1:], text[1:, :7], None, pooled[1:], guidance[1:])
        assert (trimmed - out[1:]).abs().max().item() <= 1e-5
        # the embedded guidance matters
        assert (ours(x, t, text, mask, pooled, guidance + 2.0) - out).abs().max().item() > 1e-3


def test_dit_bf16_follows_the_references_precision(tiny_hunyuan):
    """Loaded in bf16 it computes as diffusers does in bf16 (same roundings: model-dtype norms and residuals,
    fp32 q/k norm statistics and rotary, the guidance rounded to bf16 before the x1000)."""
    from diffusers import HunyuanVideoTransformer3DModel

    bf16 = torch.bfloat16
    ours = load_ours(tiny_hunyuan, bf16)
    assert {p.dtype for p in ours.parameters()} == {bf16}
    ref = HunyuanVideoTransformer3DModel.from_pretrained(tiny_hunyuan / "transformer", torch_dtype=bf16).eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 4, 3, 6, 10, generator=g).to(bf16)
    t = torch.tensor([700.0, 300.0])
    text = torch.randn(2, 12, 32, generator=g).to(bf16)
    mask = torch.ones(2, 12, dtype=torch.int64)
    mask[1, 7:] = 0
    pooled = torch.randn(2, 32, generator=g).to(bf16)
    guidance = torch.tensor([6.0, 6.0])
    with torch.no_grad():
        out = ours(x, t, text, mask, pooled, guidance)
        expected = ref(x, t, text, mask.to(bf16), pooled, guidance.to(bf16) * 1000, return_dict=False)[0]
    assert out.dtype == bf16
    assert (out.float() - expected.float()).abs().max().item() <= 1e-2  # bf16 vs fp32 differ by ~8e-2 here


# -- the pipeline ----------------------------------------------------------------------------------------
def test_family_defaults_and_folder_shift(gen):
    assert gen.family == "hunyuanvideo-t2v"
    d = gen.default_sampling
    assert (d.height, d.width, d.num_frames, d.num_inference_steps, d.fps) == (720, 1280, 129, 50, 24)
    assert (d.guidance_scale, d.true_cfg_scale, d.negative_prompt) == (6.0, 1.0, None)
    assert d.flow_shift == 7.0  # the tiny folder's scheduler config states 7.0


@pytest.mark.parametrize("name", list(CASES))
def test_frames_match_diffusers(gen, ref_pipe, name):
    case = dict(CASES[name])
    prompt, seed = case.pop("prompt"), case.pop("seed")
    ours = gen.generate_video(prompt, seed=seed, **SMALL, **case)
    assert ours.frames.shape == (9, 48, 80, 3) and ours.frames.dtype == np.uint8
    assert ours.frames.std() > 1.0, "degenerate video: the comparison would prove nothing"
    assert max_uint8_diff(ours.frames, reference(ref_pipe, gen, prompt, seed, **SMALL, **case)) <= 1


def test_true_cfg_needs_a_negative_prompt_and_a_scale_above_one(gen):
    kwargs = dict(seed=5, guidance_scale=6.0, **SMALL)
    plain = gen.generate_video("a cat", **kwargs).frames
    # as in diffusers: a negative prompt without true_cfg_scale > 1 (or the scale without the prompt) is no CFG
    assert (gen.generate_video("a cat", negative_prompt="dark", **kwargs).frames == plain).all()
    assert (gen.generate_video("a cat", true_cfg_scale=4.0, **kwargs).frames == plain).all()
    cfg = gen.generate_video("a cat", negative_prompt="dark", true_cfg_scale=4.0, **kwargs).frames
    assert max_uint8_diff(cfg, plain) > 1
    # sequential CFG (one call per branch, no mask: each branch has its own length) gives the same video
    seq = VideoGenerator.from_pretrained(gen.pipeline.folder, dtype="fp32", progress=False, cfg_mode="sequential")
    again = seq.generate_video("a cat", negative_prompt="dark", true_cfg_scale=4.0, **kwargs).frames
    assert max_uint8_diff(again, cfg) <= 1


def test_a_prompt_list_is_the_single_videos(gen):
    kwargs = dict(seed=7, **SMALL)
    both = gen.generate_video(["a dog", "a bird flying over the mountains"], **kwargs)
    for i, prompt in enumerate(["a dog", "a bird flying over the mountains"]):
        single = gen.generate_video(prompt, **{**kwargs, "seed": 7 + i})
        assert max_uint8_diff(both[i].frames, single.frames) <= 1


def test_bad_request_is_refused_with_the_nearest_size(gen):
    from composer.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="height") as info:
        gen.generate_video("a cat", height=50, width=80, num_frames=9, num_inference_steps=2)
    assert "48" in str(info.value)
    with pytest.raises(InvalidInputError, match="true_cfg_scale"):
        gen.generate_video("a cat", true_cfg_scale=-1.0, **SMALL)


def test_preset_loads():
    from pathlib import Path

    from composer.presets import load_preset

    preset = load_preset(Path(__file__).parent.parent / "configs" / "hunyuanvideo-t2v-720p.yaml")
    assert preset.model_path == "hunyuanvideo-community/HunyuanVideo"
    assert "flow_shift" not in preset.sampling  # the folder's scheduler states it


def test_limits_from_the_folder_before_loading(tiny_hunyuan):
    from composer.configs.hunyuan_video import HunyuanVideoConfig
    from composer.request_check import ModelLimits

    limits = ModelLimits.from_folder(tiny_hunyuan, HunyuanVideoConfig())
    assert (limits.spatial_multiple, limits.temporal_factor) == (16, 4)


# -- hooks, with no family-specific code -----------------------------------------------------------------
def write_peft_lora(path, model: torch.nn.Module, rank: int = 4, alpha: float = 6.0):
    """A LoRA in diffusers/PEFT naming (written by diffusers itself, `transformer.` prefix) on attention, FFN and single-block MLP
    layers of dual- and single-stream blocks."""
    from diffusers import HunyuanVideoPipeline

    targets = ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.add_k_proj",
               "transformer_blocks.0.ff.net.0.proj", "single_transformer_blocks.1.proj_mlp",
               "single_transformer_blocks.0.attn.to_v"]
    g = torch.Generator().manual_seed(42)
    state = dict(model.named_parameters())
    tensors = {}
    for target in targets:
        ours = target.replace("ff.net.0.proj", "ff.fc_in")
        out_f, in_f = state[f"{ours}.weight"].shape
        tensors[f"{target}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * 0.3
        tensors[f"{target}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.3
    HunyuanVideoPipeline.save_lora_weights(
        str(path), transformer_lora_layers=tensors, weight_name="lora.safetensors",
        transformer_lora_adapter_metadata={"r": rank, "lora_alpha": alpha, "target_modules": sorted(targets)},
    )
    return path / "lora.safetensors"


def test_unfused_lora_matches_diffusers(tiny_hunyuan, gen, ref_pipe, tmp_path):
    lora = write_peft_lora(tmp_path, gen.pipeline.modules["transformer"])
    case = dict(CASES["embedded-guidance"])
    prompt, seed = case.pop("prompt"), case.pop("seed")
    base = gen.generate_video(prompt, seed=seed, **SMALL, **case).frames
    with_lora = VideoGenerator.from_pretrained(tiny_hunyuan, dtype="fp32", progress=False, lora_path=[str(lora)],
                                               lora_scale=[0.8])
    assert "unfused" in " ".join(with_lora.pipeline.applied_hooks) or not with_lora.pipeline.runtime.lora_fuse
    ours = with_lora.generate_video(prompt, seed=seed, **SMALL, **case).frames
    assert max_uint8_diff(ours, base) > 10, "the LoRA must visibly change the video"
    ref_pipe.load_lora_weights(str(lora), adapter_name="a")
    try:
        ref_pipe.set_adapters(["a"], [0.8])
        expected = reference(ref_pipe, gen, prompt, seed, **SMALL, **case)
    finally:
        ref_pipe.unload_lora_weights()
    assert max_uint8_diff(ours, expected) <= 1


@pytest.mark.parametrize("offload", ["model", "layerwise", "disk"])
def test_offload_gives_the_same_video(tiny_hunyuan, gen, offload):
    kwargs = dict(seed=1, negative_prompt="gray", true_cfg_scale=2.0, **SMALL)
    base = gen.generate_video("a cat", **kwargs)
    offloaded = VideoGenerator.from_pretrained(tiny_hunyuan, dtype="fp32", progress=False, offload=offload)
    line = next(x for x in offloaded.pipeline.applied_hooks if x.startswith("offload:"))
    if offload != "model":  # both kinds of blocks (1 dual-stream + 2 single-stream) stream through the device
        assert "3 blocks" in line, line
    result = offloaded.generate_video("a cat", **kwargs)
    assert float((result.latents - base.latents).abs().max()) <= 1e-5
    assert (result.frames == base.frames).all()


@pytest.mark.parametrize("cache, threshold", [("teacache", 1.0), ("dbcache", 0.2)])
def test_step_caches_skip_blocks(tiny_hunyuan, gen, cache, threshold):
    """TeaCache (planned from the model's `timestep_signal`, uncalibrated) and DBCache (first block's residual)
    through the model's `step_cache` slot over the joint [video; text] tokens of both block kinds."""
    kwargs = dict(seed=2, height=48, width=80, num_frames=9, num_inference_steps=10)
    base = gen.generate_video("a cat", **kwargs).frames
    cached = VideoGenerator.from_pretrained(tiny_hunyuan, dtype="fp32", progress=False, cache=cache,
                                            cache_threshold=threshold)
    line = next(x for x in cached.pipeline.applied_hooks if x.startswith("cache:"))
    assert "not cached" not in line
    frames = cached.generate_video("a cat", **kwargs).frames
    hook = cached.pipeline.hooks[[h.name for h in cached.pipeline.hooks].index("cache")].hooks[0]
    assert hook.stats.skipped > 0, "no step was cached: the check would prove nothing"
    assert max_uint8_diff(frames, base) < 32  # an approximation of the same video


def test_tensor_parallel_is_refused(gen):
    assert not hasattr(type(gen.pipeline.modules["transformer"]), "tensor_parallel_plan")


def _parallel_worker(rank, world, folder, runtime, request, out_dir):
    gen = VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False, **runtime)
    result = gen.generate_video(**request)
    torch.save({"latents": result.latents, "frames": torch.from_numpy(result.frames),
                "hooks": gen.pipeline.applied_hooks}, f"{out_dir}/rank{rank}.pt")


@pytest.mark.slow  # (the quick tier's sequence-parallel case: test_wan_i2v_parallel.py)
@pytest.mark.parametrize("runtime", [dict(cfg_parallel=True), dict(ulysses_degree=2)], ids=["cfg2", "ulysses2"])
def test_parallel_layouts_equal_one_process(tiny_hunyuan, gen, tmp_path, one_thread, runtime):
    """On two gloo ranks: CFG parallel (true CFG's two branches, texts of different lengths: each rank runs its
    branch with its key mask) and Ulysses (each rank a part of every frame, the text whole on both; the batched
    CFG rows carry the key mask) give the one-process video."""
    from composer.testing.distributed import spawn

    request = dict(prompt="a cat on the grass", negative_prompt="dark, gray", true_cfg_scale=3.0, seed=4, **SMALL)
    expected = gen.generate_video(**request)
    spawn(_parallel_worker, 2, str(tiny_hunyuan), runtime, request, str(tmp_path), timeout_s=300)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        parallel = next(line for line in got["hooks"] if line.startswith("parallel:"))
        assert ("sequence parallel" in parallel) == ("ulysses_degree" in runtime), parallel
        torch.testing.assert_close(got["latents"], expected.latents, atol=1e-5, rtol=0)
        assert max_uint8_diff(got["frames"].numpy(), expected.frames) <= 1
