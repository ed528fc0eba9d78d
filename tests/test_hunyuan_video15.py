"""HunyuanVideo-1.5 T2V: composer's DiT and pipeline against diffusers' on a tiny seeded folder saved by diffusers'
own classes (Qwen2.5-VL + ByT5 text encoders, the 16x VAE, the guider), its config values, its inputs checked before
loading, and the runtime hooks (LoRA, layerwise offload, Ulysses, the step scheduler) with no family code."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import diffusers_frames, max_uint8_diff
from helpers import held

from composer import VideoGenerator
from composer.errors import ModelFormatError, UnsupportedError
from composer.loader.components import ComponentLoader
from composer.loader.model_index import ComponentSpec, read_model_index
from composer.testing.tiny_hunyuan15 import build_tiny_hunyuan15

SMALL = dict(height=48, width=80, num_frames=9, num_inference_steps=4)  # non-square: 3x5 latents, 3 frames
CASES = {
    # CFG with a negative prompt shorter than the prompt: the batched rows carry the text key mask
    "cfg": dict(prompt="a blue square moving up over the sea", negative_prompt="blurry, static",
                guidance_scale=6.0, seed=11),
    "no-cfg": dict(prompt="a red circle moving left", guidance_scale=1.0, seed=3),
    # the family's own knobs: guidance_rescale, and a quoted text (ByT5 glyph tokens in one row only)
    "rescale-glyph": dict(prompt='a shop sign reading "OPEN" at night', negative_prompt="", guidance_scale=4.0,
                          guidance_rescale=0.7, seed=5),
}
QUICK = {"cfg"}


@pytest.fixture(scope="module")
def tiny15(tmp_path_factory):
    return build_tiny_hunyuan15(tmp_path_factory.mktemp("models") / "tiny-hunyuan15")


@pytest.fixture(scope="module")
def gen(tiny15):
    return VideoGenerator.from_pretrained(tiny15, dtype="fp32", progress=False)


@pytest.fixture(scope="module")
def ref_pipe(tiny15):
    from diffusers import HunyuanVideo15Pipeline

    pipe = HunyuanVideo15Pipeline.from_pretrained(str(tiny15))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference(pipe, gen, prompt, seed, guidance_scale, guidance_rescale=0.0, **kwargs):
    """diffusers' frames: its guider built with the request's CFG settings (its `__call__` takes none), the chat
    template cropped where composer crops it (the tiny tokenizer is not the released one, for which diffusers
    hard-codes 108)."""
    from diffusers import ClassifierFreeGuidance

    config = {k: v for k, v in pipe.guider.config.items() if not k.startswith("_")}
    pipe.guider = ClassifierFreeGuidance(**{**config, "guidance_scale": guidance_scale,
                                            "guidance_rescale": guidance_rescale})
    pipe.prompt_template_encode_start_idx = gen.pipeline.stage("ChatTextEncodingStage").crop_start
    return diffusers_frames(pipe, prompt, seed, **kwargs)


def with_guider(folder, tmp_path, **settings):
    """A copy of `folder` whose guider config states `settings`."""
    copy = shutil.copytree(folder, tmp_path / "hunyuan15-guider")
    path = copy / "guider" / "guider_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **settings}))
    return copy


def load_ours(folder, dtype=torch.float32):
    spec = read_model_index(folder).component("transformer")
    return ComponentLoader.for_spec(spec, folder / "transformer").load(
        folder / "transformer", spec, torch.device("cpu"), dtype)


def dit_inputs(g, batch=2, channels=9, text_dim=32, glyph_dim=16, image_dim=None, dtype=torch.float32):
    x = torch.randn(batch, channels, 3, 3, 5, generator=g)  # [B, C, F, H, W], non-square
    text = torch.randn(batch, 12, text_dim, generator=g)
    mask = torch.ones(batch, 12, dtype=torch.int64)
    mask[-1, 7:] = 0  # the last row: 7 tokens and 5 of padding
    glyph = torch.randn(batch, 6, glyph_dim, generator=g)
    glyph_mask = torch.ones(batch, 6, dtype=torch.int64)
    glyph_mask[0, 4:] = 0
    glyph_mask[-1] = 0  # the last row quotes no text
    image = None if image_dim is None else torch.randn(batch, 729, image_dim, generator=g)
    x, text, glyph, image = (None if v is None else v.to(dtype) for v in (x, text, glyph, image))
    return x, text, mask, glyph, glyph_mask, image


# -- the DiT ---------------------------------------------------------------------------------------------
def test_dit_matches_diffusers_with_padding_glyphs_and_an_image(tiny15):
    from diffusers import HunyuanVideo15Transformer3DModel

    ours = load_ours(tiny15)
    assert type(ours).__module__ == "composer.models.hunyuan15.transformer"
    ref = HunyuanVideo15Transformer3DModel.from_pretrained(tiny15 / "transformer").eval()
    g = torch.Generator().manual_seed(0)
    x, text, mask, glyph, glyph_mask, image = dit_inputs(g, image_dim=12)
    t = torch.tensor([700.0, 300.0])
    with torch.no_grad():
        # text-to-video: diffusers takes zero image states (and masks them all), composer none
        expected = ref(x, t, text, mask, encoder_hidden_states_2=glyph, encoder_attention_mask_2=glyph_mask,
                       image_embeds=torch.zeros(2, 729, 12), return_dict=False)[0]
        out = ours(x, t, text, mask, glyph, glyph_mask)
        assert out.shape == (2, 4, 3, 3, 5)
        assert (out - expected).abs().max().item() <= 1e-4
        # the zero condition channels may be left to the model (what the text-to-video pipeline does)
        zero_condition = torch.cat([x[:, :4], torch.zeros_like(x[:, 4:])], dim=1)
        expected_t2v = ref(zero_condition, t, text, mask, encoder_hidden_states_2=glyph,
                           encoder_attention_mask_2=glyph_mask, image_embeds=torch.zeros(2, 729, 12),
                           return_dict=False)[0]
        assert (ours(x[:, :4], t, text, mask, glyph, glyph_mask) - expected_t2v).abs().max().item() <= 1e-4
        # image-to-video's SigLIP states
        expected = ref(x, t, text, mask, encoder_hidden_states_2=glyph, encoder_attention_mask_2=glyph_mask,
                       image_embeds=image, return_dict=False)[0]
        assert (ours(x, t, text, mask, glyph, glyph_mask, image) - expected).abs().max().item() <= 1e-4
        # padding is masked: its values do not matter, and dropping it is the same
        junk_text, junk_glyph = text.clone(), glyph.clone()
        junk_text[1, 7:], junk_glyph[0, 4:], junk_glyph[1] = 100.0, -50.0, 30.0
        assert (ours(x, t, junk_text, mask, junk_glyph, glyph_mask) - out).abs().max().item() <= 1e-5
        trimmed = ours(x[1:], t[1:], text[1:, :7], None)
        assert (trimmed - out[1:]).abs().max().item() <= 1e-5


def test_dit_bf16_follows_the_references_precision(tiny15):
    """In bf16 composer rounds where diffusers rounds (model-dtype norms and residuals, fp32 q/k statistics and
    rotary, the timestep in the model dtype as the reference pipeline passes it)."""
    from diffusers import HunyuanVideo15Transformer3DModel

    bf16 = torch.bfloat16
    ours = load_ours(tiny15, bf16)
    assert {p.dtype for p in ours.parameters()} == {bf16}
    ref = HunyuanVideo15Transformer3DModel.from_pretrained(tiny15 / "transformer", torch_dtype=bf16).eval()
    x, text, mask, glyph, glyph_mask, _ = dit_inputs(torch.Generator().manual_seed(1), dtype=bf16)
    t = torch.tensor([999.0, 300.0])
    with torch.no_grad():
        out = ours(x, t, text, mask, glyph, glyph_mask)
        expected = ref(x, t.to(bf16), text, mask, encoder_hidden_states_2=glyph, encoder_attention_mask_2=glyph_mask,
                       image_embeds=torch.zeros(2, 729, 12, dtype=bf16), return_dict=False)[0]
        fp32 = load_ours(tiny15)(x.float(), t, text.float(), mask, glyph.float(), glyph_mask)
    assert out.dtype == bf16
    diff = (out.float() - expected.float()).abs().max().item()
    assert diff <= 1e-2 < (out.float() - fp32).abs().max().item(), diff  # closer to diffusers' bf16 than to fp32


# -- config values, as test_config_audit.py does for the other families --------------------------------------
AUDIT = dict(in_channels=7, out_channels=None, num_attention_heads=3, attention_head_dim=12, num_layers=2,
             num_refiner_layers=2, mlp_ratio=3.0, patch_size=2, patch_size_t=2, qk_norm="layer_norm",
             text_embed_dim=10, text_embed_2_dim=6, image_embed_dim=5, rope_theta=100.0, rope_axes_dim=(2, 6, 4),
             target_size=320, task_type="t2v", use_meanflow=True)


def _save_audit(tmp_path, **changes):
    from diffusers import HunyuanVideo15Transformer3DModel

    torch.manual_seed(0)
    ref = HunyuanVideo15Transformer3DModel(**{**AUDIT, **changes}).eval()
    with torch.no_grad():
        for p in ref.parameters():  # zero-initialised tables and unit norms count too
            p.add_(torch.randn_like(p) * 0.05)
    ref.save_pretrained(tmp_path / "transformer")
    return ref, tmp_path / "transformer"


def _load(folder):
    spec = ComponentSpec("transformer", "diffusers", "HunyuanVideo15Transformer3DModel")
    return ComponentLoader.for_spec(spec, folder).load(folder, spec, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("changes", [{}, {"qk_norm": "fp32_layer_norm", "use_meanflow": False, "out_channels": 3,
                                          "num_refiner_layers": 0}],
                         ids=["layer-norm-meanflow", "fp32-layer-norm-no-refiner"])
def test_config_values_mean_what_diffusers_makes_them_mean(tmp_path, changes):
    """Non-default values for every config field diffusers reads (a temporal and spatial patch of 2, odd widths,
    3 heads with an uneven RoPE split, null out_channels, a MeanFlow timestep embedder given `timestep_r`)."""
    ref, folder = _save_audit(tmp_path, **changes)
    ours = _load(folder)
    config = {**AUDIT, **changes}
    out_channels = config["out_channels"] or config["in_channels"]
    assert ours.config.out_channels == out_channels and ours.config.target_size == 320
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, 4, 4, 6, generator=g)
    text = torch.randn(2, 6, 10, generator=g)
    mask = torch.ones(2, 6, dtype=torch.int64)
    mask[1, 4:] = 0
    glyph, glyph_mask = torch.randn(2, 3, 6, generator=g), torch.tensor([[1, 1, 0], [1, 1, 1]])
    t = torch.tensor([900.0, 250.5])
    t_r = torch.tensor([500.0, 120.0]) if config["use_meanflow"] else None
    with torch.inference_mode():
        expected = ref(x, t, text, mask, timestep_r=t_r, encoder_hidden_states_2=glyph,
                       encoder_attention_mask_2=glyph_mask, image_embeds=torch.zeros(2, 729, 5), return_dict=False)[0]
        got = ours(x, t, text, mask, glyph, glyph_mask, timestep_r=t_r)
    assert got.shape == expected.shape == (2, out_channels, 4, 4, 6)
    assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("changes, error, message", [
    ({"qk_norm": "l2"}, UnsupportedError, "qk_norm = 'l2'"),
    ({"qk_norm": None}, ModelFormatError, "qk_norm = None"),  # diffusers' processor calls the norm: no working model
    ({"rope_axes_dim": [4, 4, 2]}, ModelFormatError, "rope_axes_dim"),
    ({"patch_size": [2, 2]}, ModelFormatError, "patch_size"),
    ({"use_meanflow": "yes"}, ModelFormatError, "use_meanflow"),
])
def test_values_composer_cannot_run_are_refused_by_name(tmp_path, changes, error, message):
    _, folder = _save_audit(tmp_path, num_layers=1)
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    with pytest.raises(error, match=message):
        _load(folder)


# -- the pipeline ----------------------------------------------------------------------------------------
def test_family_defaults_come_from_the_folder(gen):
    assert gen.family == "hunyuanvideo-1.5-t2v"
    d = gen.default_sampling
    assert (d.num_frames, d.num_inference_steps, d.fps, d.negative_prompt) == (121, 50, 24, None)
    # the folder's guider (scale, rescale), scheduler (shift) and transformer (target_size 64: diffusers' 48x80)
    assert (d.guidance_scale, d.guidance_rescale, d.flow_shift, d.height, d.width) == (6.0, 0.0, 5.0, 48, 80)


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in QUICK else pytest.mark.slow) for n in CASES])
def test_frames_match_diffusers(gen, ref_pipe, name):
    case = dict(CASES[name])
    prompt, seed = case.pop("prompt"), case.pop("seed")
    ours = gen.generate_video(prompt, seed=seed, **SMALL, **case)
    assert ours.frames.shape == (9, 48, 80, 3) and ours.frames.dtype == np.uint8
    assert ours.frames.std() > 1.0, "degenerate video: the comparison would prove nothing"
    assert max_uint8_diff(ours.frames, reference(ref_pipe, gen, prompt, seed, **SMALL, **case)) <= 1


@pytest.mark.slow
def test_the_folders_guider_window_and_rescale(tiny15, tmp_path):
    """A guider stating a window of steps (CFG on steps 1 and 2 of 4 only) and a rescale: composer's defaults, and
    the frames diffusers makes with that guider."""
    from diffusers import HunyuanVideo15Pipeline

    folder = with_guider(tiny15, tmp_path, start=0.25, stop=0.75, guidance_rescale=0.3, guidance_scale=5.0)
    windowed = VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False)
    assert (windowed.default_sampling.guidance_scale, windowed.default_sampling.guidance_rescale) == (5.0, 0.3)
    ours = windowed.generate_video("a cat on the grass", negative_prompt="dark", seed=2, **SMALL).frames
    pipe = HunyuanVideo15Pipeline.from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)
    pipe.prompt_template_encode_start_idx = windowed.pipeline.stage("ChatTextEncodingStage").crop_start
    assert max_uint8_diff(ours, diffusers_frames(pipe, "a cat on the grass", 2, negative_prompt="dark", **SMALL)) <= 1
    # the window matters: the same settings with CFG on every step differ
    whole = VideoGenerator.from_pretrained(tiny15, dtype="fp32", progress=False)
    every_step = whole.generate_video("a cat on the grass", negative_prompt="dark", seed=2, guidance_scale=5.0,
                                      guidance_rescale=0.3, **SMALL).frames
    assert max_uint8_diff(ours, every_step) > 1


def test_guiders_composer_does_not_run_are_refused_before_loading(tiny15, tmp_path):
    folder = with_guider(tiny15, tmp_path, use_original_formulation=True)
    with pytest.raises(UnsupportedError, match="use_original_formulation"):
        VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False)
    path = folder / "guider" / "guider_config.json"
    path.write_text(json.dumps({"guidance_scale": "high"}))
    with pytest.raises(ModelFormatError, match="guidance_scale = 'high'"):
        VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False)


def test_a_disabled_guider_means_no_cfg_by_default(tiny15, tmp_path):
    gen = VideoGenerator.from_pretrained(with_guider(tiny15, tmp_path, enabled=False), dtype="fp32", progress=False)
    assert gen.default_sampling.guidance_scale == 1.0


def test_inputs_are_checked_before_loading(tiny15):
    from composer.configs.hunyuan_video15 import HunyuanVideo15Config
    from composer.errors import ComposerError
    from composer.request_check import ModelLimits, RequestError, check_cli_request

    limits = ModelLimits.from_folder(tiny15, HunyuanVideo15Config())
    # 16x VAE x patch 1; the condition channels do not make it an image-to-video model
    assert (limits.spatial_multiple, limits.temporal_factor, limits.requires_image) == (16, 4, False)
    with pytest.raises(RequestError) as info:
        check_cli_request(str(tiny15), None, {"prompt": "a cat", "height": 50, "width": 80, "num_frames": 10,
                                              "guidance_rescale": 1.5})
    message = str(info.value)
    assert "nothing was loaded" in message
    for field in ("--height 50: expected a positive multiple of 16 (nearest valid: 48)",
                  "--num-frames 10: expected a positive integer of the form 4k+1",
                  "--guidance-rescale 1.5: expected a number in [0, 1]"):
        assert field in message, message
    with pytest.raises(ComposerError, match="image"):  # text-to-video takes no image
        check_cli_request(str(tiny15), None, {"prompt": "a cat", "image": "cat.png"})


def test_bad_request_is_refused_in_python_too(gen):
    from composer.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="guidance_rescale = -0.5: expected a number in"):
        gen.generate_video("a cat", guidance_rescale=-0.5, **SMALL)
    with pytest.raises(InvalidInputError, match="width"):
        gen.generate_video("a cat", height=48, width=72, num_frames=9, num_inference_steps=2)


def test_preset_loads():
    from pathlib import Path

    from composer.presets import load_preset

    preset = load_preset(Path(__file__).parent.parent / "configs" / "hunyuanvideo-1.5-t2v-480p.yaml")
    assert preset.model_path == "hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v"
    assert not {"flow_shift", "guidance_scale"} & set(preset.sampling)  # the folder states them


# -- hooks, with no family-specific code -----------------------------------------------------------------
LORA_TARGETS = ["transformer_blocks.0.attn.to_q", "transformer_blocks.1.attn.add_k_proj",
                "transformer_blocks.0.ff.net.0.proj", "transformer_blocks.0.ff_context.net.2",
                "context_embedder.token_refiner.refiner_blocks.0.attn.to_v", "context_embedder_2.linear_1"]


def write_peft_lora(path, folder, rank: int = 4, alpha: float = 6.0):
    """A LoRA in diffusers/PEFT naming (`transformer.` prefix, written by diffusers' own writer) on the DiT of
    `folder`: attention, FFN, token refiner and glyph projection."""
    from diffusers import HunyuanVideo15Transformer3DModel, HunyuanVideoPipeline

    model = HunyuanVideo15Transformer3DModel.from_pretrained(folder / "transformer")
    shapes = {name: module.weight.shape for name, module in model.named_modules() if name in LORA_TARGETS}
    g = torch.Generator().manual_seed(42)
    tensors = {}
    for target in LORA_TARGETS:
        out_f, in_f = shapes[target]
        tensors[f"{target}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * 0.3
        tensors[f"{target}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * 0.3
    HunyuanVideoPipeline.save_lora_weights(  # any pipeline's writer: the file is the transformer's
        str(path), transformer_lora_layers=tensors, weight_name="lora.safetensors",
        transformer_lora_adapter_metadata={"r": rank, "lora_alpha": alpha, "target_modules": sorted(LORA_TARGETS)},
    )
    return path / "lora.safetensors"


@pytest.mark.slow
def test_unfused_lora_matches_diffusers(tiny15, gen, tmp_path):
    from diffusers import HunyuanVideo15Pipeline

    lora = write_peft_lora(tmp_path, tiny15)
    case = dict(CASES["rescale-glyph"])
    prompt, seed = case.pop("prompt"), case.pop("seed")
    base = gen.generate_video(prompt, seed=seed, **SMALL, **case).frames
    with_lora = VideoGenerator.from_pretrained(tiny15, dtype="fp32", progress=False, lora_path=[str(lora)],
                                               lora_scale=[0.8])
    ours = with_lora.generate_video(prompt, seed=seed, **SMALL, **case).frames
    assert max_uint8_diff(ours, base) > 10, "the LoRA must visibly change the video"
    pipe = HunyuanVideo15Pipeline.from_pretrained(str(tiny15))
    pipe.set_progress_bar_config(disable=True)
    # (a folder and weight_name: how diffusers reads the file's alpha from its metadata)
    pipe.transformer.load_lora_adapter(str(lora.parent), weight_name=lora.name, prefix="transformer", adapter_name="a")
    pipe.transformer.set_adapters(["a"], [0.8])
    assert max_uint8_diff(ours, reference(pipe, gen, prompt, seed, **SMALL, **case)) <= 1


@pytest.mark.slow
def test_layerwise_offload_gives_the_same_video(tiny15, gen):
    kwargs = dict(seed=1, negative_prompt="gray", guidance_scale=5.0, **SMALL)
    base = gen.generate_video('a "STOP" sign', **kwargs)
    offloaded = VideoGenerator.from_pretrained(tiny15, dtype="fp32", progress=False, offload="layerwise")
    line = next(x for x in offloaded.pipeline.applied_hooks if x.startswith("offload:"))
    assert "2 blocks" in line, line
    result = offloaded.generate_video('a "STOP" sign', **kwargs)
    assert float((result.latents - base.latents).abs().max()) <= 1e-5
    assert (result.frames == base.frames).all()


@pytest.mark.slow
def test_two_requests_through_the_scheduler_equal_their_solo_runs(gen):
    """Two requests submitted at once share the step scheduler's transformer calls (their prompts have equal token
    counts, so their CFG rows batch) and each gets its solo video."""
    requests = [dict(prompt="a cat on the red sofa", seed=7), dict(prompt="a dog in the big tree", seed=8)]
    kwargs = dict(negative_prompt="blurry", guidance_scale=4.0, **SMALL)
    solo = [gen.generate_video(r["prompt"], seed=r["seed"], **kwargs).frames for r in requests]
    scheduler = gen.pipeline.engines[0].scheduler
    before = scheduler.stats.batched_units
    with held(gen, 2):
        futures = [gen.submit_video(r["prompt"], seed=r["seed"], **kwargs) for r in requests]
    together = [f.result(timeout=300).frames for f in futures]
    assert scheduler.stats.batched_units > before, "the two requests never shared a call"
    for alone, shared in zip(solo, together):
        assert max_uint8_diff(alone, shared) <= 1


def _parallel_worker(rank, world, folder, runtime, request, out_dir):
    gen = VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False, **runtime)
    result = gen.generate_video(**request)
    torch.save({"latents": result.latents, "frames": torch.from_numpy(result.frames),
                "hooks": gen.pipeline.applied_hooks}, f"{out_dir}/rank{rank}.pt")


@pytest.mark.slow
def test_ulysses_on_two_ranks_equals_one_process(tiny15, gen, tmp_path, one_thread):
    """Each rank a part of every frame, the joint text (glyph and prompt, padded rows masked) whole on both."""
    from composer.testing.distributed import spawn

    request = dict(prompt='a cat holding a "HELLO" sign', negative_prompt="dark, gray", guidance_scale=3.0, seed=4,
                   **SMALL)
    expected = gen.generate_video(**request)
    spawn(_parallel_worker, 2, str(tiny15), dict(ulysses_degree=2), request, str(tmp_path), timeout_s=300)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert "sequence parallel" in next(line for line in got["hooks"] if line.startswith("parallel:"))
        torch.testing.assert_close(got["latents"], expected.latents, atol=1e-5, rtol=0)
        assert max_uint8_diff(got["frames"].numpy(), expected.frames) <= 1


# -- image-to-video --------------------------------------------------------------------------------------
def make_image(width: int, height: int, seed: int = 0):
    """A smooth seeded RGB image of another size than the video (the crop path)."""
    from PIL import Image

    small = (np.random.default_rng(seed).random((5, 7, 3)) * 255).astype(np.uint8)
    return Image.fromarray(small).resize((width, height), Image.BILINEAR)


@pytest.fixture(scope="module")
def tiny15_i2v(tmp_path_factory):
    from composer.testing.tiny_hunyuan15 import build_tiny_hunyuan15_i2v

    return build_tiny_hunyuan15_i2v(tmp_path_factory.mktemp("models") / "tiny-hunyuan15-i2v")


@pytest.fixture(scope="module")
def gen_i2v(tiny15_i2v):
    return VideoGenerator.from_pretrained(tiny15_i2v, dtype="fp32", progress=False)


@pytest.mark.parametrize("image_size", [(70, 40), pytest.param((40, 70), marks=pytest.mark.slow)],
                         ids=["landscape", "portrait"])
def test_image_to_video_matches_diffusers(tiny15_i2v, gen_i2v, image_size):
    """diffusers' I2V pipeline takes no size (it picks the bucket nearest the image's aspect ratio); composer is
    given that size (`default_size`), and crops the image to it as diffusers does."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline

    from composer.pipelines.hunyuan_video15 import default_size

    assert gen_i2v.family == "hunyuanvideo-1.5-i2v"
    image = make_image(*image_size)
    height, width = default_size(64, 16, aspect=(image.height, image.width))
    assert (height > width) == (image.height > image.width)
    request = dict(negative_prompt="blurry", num_frames=9, num_inference_steps=4)
    ours = gen_i2v.generate_video('a "GO" sign in the wind', image=image, seed=3, height=height, width=width,
                                  **request).frames
    pipe = HunyuanVideo15ImageToVideoPipeline.from_pretrained(str(tiny15_i2v))
    pipe.set_progress_bar_config(disable=True)
    pipe.prompt_template_encode_start_idx = gen_i2v.pipeline.stage("ChatTextEncodingStage").crop_start
    out = pipe(image=image, prompt='a "GO" sign in the wind', generator=torch.Generator("cpu").manual_seed(3),
               output_type="np", **request).frames[0]
    assert ours.shape == (9, height, width, 3) and ours.std() > 1.0
    assert max_uint8_diff(ours, (out * 255).round().astype(np.uint8)) <= 1
    other = gen_i2v.generate_video('a "GO" sign in the wind', image=make_image(*image_size, seed=1), seed=3,
                                   height=height, width=width, **request).frames
    assert max_uint8_diff(ours, other) > 1, "the image must matter"


def test_image_to_video_needs_its_image_before_loading(tiny15_i2v):
    from composer.configs.hunyuan_video15 import HunyuanVideo15I2VConfig
    from composer.request_check import ModelLimits, RequestError, check_cli_request

    assert ModelLimits.from_folder(tiny15_i2v, HunyuanVideo15I2VConfig()).requires_image
    with pytest.raises(RequestError, match="image: expected an input image"):
        check_cli_request(str(tiny15_i2v), None, {"prompt": "a cat"})
    with pytest.raises(RequestError, match="--image missing.png: expected an existing"):
        check_cli_request(str(tiny15_i2v), None, {"prompt": "a cat", "image": "missing.png"})


def test_meanflow_image_to_video_is_refused_before_loading(tiny15_i2v, tmp_path):
    folder = shutil.copytree(tiny15_i2v, tmp_path / "meanflow")
    path = folder / "transformer" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "use_meanflow": True}))
    with pytest.raises(UnsupportedError, match="use_meanflow = true"):
        VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False)
