"""Every transformer config value means what diffusers makes it mean (issue 36, section A).

For each family composer implements itself (Wan2.1 T2V, Wan2.1 I2V / FLF2V, Wan2.2 TI2V, HunyuanVideo), diffusers'
own class is built with non-default values for the config fields it reads, saved with `save_pretrained`, loaded by
composer's loader, and one forward is compared with diffusers' on the same inputs (fp32, max abs diff <= 1e-4).
A value composer does not run is refused with an error naming the field, before any weight is read.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import HunyuanVideoTransformer3DModel as ReferenceHunyuan
from diffusers import WanTransformer3DModel as ReferenceWan

from composer.errors import InvalidInputError, ModelFormatError, UnsupportedError
from composer.loader.components import ComponentLoader
from composer.loader.model_index import ComponentSpec

TOLERANCE = 1e-4


def _save(tmp_path: Path, cls, kwargs: dict, extra_config: dict | None = None):
    """diffusers' model from `kwargs` (every parameter perturbed: zero-initialised tables and unit norms count
    too), saved to tmp_path/transformer; `extra_config` is then written into its config.json."""
    torch.manual_seed(0)
    ref = cls(**kwargs).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    folder = tmp_path / "transformer"
    ref.save_pretrained(folder)
    if extra_config:
        _edit_config(folder, **extra_config)
    return ref, folder


def _edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _load(folder: Path, class_name: str):
    spec = ComponentSpec("transformer", "diffusers", class_name)
    return ComponentLoader.for_spec(spec, folder).load(folder, spec, torch.device("cpu"), torch.float32)


def _assert_close(got: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert got.shape == expected.shape, f"{what}: {tuple(got.shape)} != {tuple(expected.shape)}"
    diff = (got - expected).abs().max().item()
    assert diff <= TOLERANCE, f"{what}: max abs diff {diff}"


# -- Wan ----------------------------------------------------------------------------------------------------
WAN_CASES = {
    # Wan2.1 T2V-style: 3 heads of 10 (RoPE split 6/2/2), in 5 / out 3 channels, odd freq_dim (padded sinusoids),
    # odd ffn width, no cross-attention norm, eps 1e-5, qk_norm None (diffusers RMS-norms q/k whatever it says),
    # a small RoPE table; `rope_theta` in config.json is not a diffusers argument: ignored, as diffusers ignores it
    "t2v": dict(
        ref=dict(patch_size=(1, 2, 2), num_attention_heads=3, attention_head_dim=10, in_channels=5, out_channels=3,
                 text_dim=7, freq_dim=33, ffn_dim=19, num_layers=2, cross_attn_norm=False, qk_norm=None, eps=1e-5,
                 rope_max_seq_len=8),
        extra_config={"rope_theta": 500.0}, latents=(2, 5, 3, 6, 4), text_len=9),
    # out_channels null: diffusers' `out_channels or in_channels`; cross-attention norm on, eps 1e-4
    "t2v-out-null": dict(
        ref=dict(num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=None, text_dim=5,
                 freq_dim=16, ffn_dim=8, num_layers=1, cross_attn_norm=True, eps=1e-4, rope_max_seq_len=32),
        latents=(1, 4, 2, 4, 6), text_len=3),
    # Wan2.1 I2V-style: image cross-attention (image_dim 6 -> the model width); diffusers' processor takes the
    # last 512 context tokens as the text, so the text is 512 tokens
    "i2v": dict(
        ref=dict(num_attention_heads=3, attention_head_dim=8, in_channels=9, out_channels=4, text_dim=6, freq_dim=8,
                 ffn_dim=20, num_layers=2, eps=1e-5, image_dim=6, added_kv_proj_dim=24, qk_norm="rms_norm"),
        latents=(2, 9, 2, 4, 4), text_len=512, image_tokens=5, images_per_video=1),
    # FLF2V-style: two images' tokens as one sequence with a learned position embedding (pos_embed_seq_len)
    "flf2v": dict(
        ref=dict(num_attention_heads=2, attention_head_dim=8, in_channels=9, out_channels=4, text_dim=6, freq_dim=8,
                 ffn_dim=12, num_layers=1, image_dim=6, added_kv_proj_dim=16, pos_embed_seq_len=8),
        latents=(1, 9, 2, 4, 2), text_len=512, image_tokens=4, images_per_video=2),
    # Wan2.2 TI2V-style: in 12 / out 6 channels, a (2, 2, 1) patch, timesteps per token (expand_timesteps)
    "ti2v": dict(
        ref=dict(patch_size=(2, 2, 1), num_attention_heads=2, attention_head_dim=14, in_channels=12, out_channels=6,
                 text_dim=8, freq_dim=12, ffn_dim=30, num_layers=2, eps=1e-6),
        latents=(2, 12, 4, 4, 3), text_len=6, per_token=True),
}


def _wan_inputs(case):
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(case["latents"], generator=g)
    batch = latents.shape[0]
    text = torch.randn(batch, case["text_len"], case["ref"]["text_dim"], generator=g)
    image = None
    if "image_tokens" in case:
        image = torch.randn(batch * case["images_per_video"], case["image_tokens"], case["ref"]["image_dim"],
                            generator=g)
    return latents, text, image


@pytest.mark.parametrize("name", list(WAN_CASES))
def test_wan_config_values_mean_what_diffusers_makes_them_mean(tmp_path, name):
    case = WAN_CASES[name]
    ref, folder = _save(tmp_path, ReferenceWan, case["ref"], case.get("extra_config"))
    ours = _load(folder, "WanTransformer3DModel")
    assert type(ours).__module__ == "composer.models.wan.transformer"
    latents, text, image = _wan_inputs(case)
    batch = latents.shape[0]
    timesteps = [torch.linspace(999.0, 437.25, batch)]
    if case.get("per_token"):  # one timestep per token, as diffusers' TI2V pipeline gives them
        pt, ph, pw = case["ref"]["patch_size"]
        _, _, f, h, w = latents.shape
        tokens = (f // pt) * (h // ph) * (w // pw)
        timesteps.append(torch.rand(batch, tokens, generator=torch.Generator().manual_seed(2)) * 1000)
    with torch.inference_mode():
        for t in timesteps:
            expected = ref(latents, t, text, encoder_hidden_states_image=image, return_dict=False)[0]
            got = ours(latents, t, text, image)
            _assert_close(got, expected, f"{name}, timestep {list(t.shape)}")
    in_channels = case["ref"]["in_channels"]
    assert got.shape[1] == (case["ref"]["out_channels"] or in_channels)


def test_wan_rope_max_seq_len_bounds_the_grid_as_in_diffusers(tmp_path):
    """rope_max_seq_len is diffusers' RoPE table length: a grid past it fails there, and is refused here with
    an error naming the field (frames counted from the causal frame offset too)."""
    ref_kwargs = dict(num_attention_heads=2, attention_head_dim=12, text_dim=4, freq_dim=8, ffn_dim=8, num_layers=1,
                      in_channels=4, out_channels=4, rope_max_seq_len=4)
    ref, folder = _save(tmp_path, ReferenceWan, ref_kwargs)
    ours = _load(folder, "WanTransformer3DModel")
    text, t = torch.randn(1, 3, 4), torch.tensor([500.0])
    fits = torch.randn(1, 4, 4, 8, 8)  # 4 x 4 x 4 tokens: every axis within the table
    with torch.inference_mode():
        _assert_close(ours(fits, t, text), ref(fits, t, text, return_dict=False)[0], "grid at the limit")
        too_tall = torch.randn(1, 4, 2, 10, 8)  # 5 rows of tokens
        with pytest.raises(RuntimeError):
            ref(too_tall, t, text)
        with pytest.raises(InvalidInputError, match="rope_max_seq_len = 4"):
            ours(too_tall, t, text)
        with pytest.raises(InvalidInputError, match="rope_max_seq_len = 4"):
            ours(torch.randn(1, 4, 2, 4, 4), t, text, frame_offset=3)


@pytest.mark.parametrize("changes, error, message", [
    ({"added_kv_proj_dim": None}, UnsupportedError, "image_dim = 6 but added_kv_proj_dim = None"),
    ({"added_kv_proj_dim": 7}, ModelFormatError, "added_kv_proj_dim = 7 must equal the model width 16"),
    ({"attention_head_dim": 7, "added_kv_proj_dim": 14}, ModelFormatError, "attention_head_dim must be even"),
])
def test_wan_values_composer_cannot_run_are_refused_by_name(tmp_path, changes, error, message):
    _, folder = _save(tmp_path, ReferenceWan, WAN_CASES["flf2v"]["ref"], changes)
    with pytest.raises(error, match=message):
        _load(folder, "WanTransformer3DModel")


# -- HunyuanVideo -------------------------------------------------------------------------------------------
HUNYUAN_BASE = dict(in_channels=3, out_channels=5, num_attention_heads=3, attention_head_dim=12, num_layers=1,
                    num_single_layers=2, num_refiner_layers=2, mlp_ratio=3.0, patch_size=2, patch_size_t=1,
                    qk_norm="rms_norm", guidance_embeds=False, text_embed_dim=10, pooled_projection_dim=7,
                    rope_theta=100.0, rope_axes_dim=(4, 4, 4))
HUNYUAN_CASES = {
    # mlp_ratio 3.0 (the DiT blocks' MLPs; the token refiner keeps diffusers' fixed 4.0), 3 heads, 2 refiner
    # blocks, no guidance embedder, in 3 / out 5 channels, rope_theta 100 and an even (4, 4, 4) axis split
    "mlp3-no-guidance": dict(ref=HUNYUAN_BASE, latents=(2, 3, 3, 4, 6)),
    # a temporal patch (patch_size_t 2), a spatial patch of 1, guidance embedded, an odd mlp ratio
    "temporal-patch-guidance": dict(
        ref={**HUNYUAN_BASE, "patch_size": 1, "patch_size_t": 2, "guidance_embeds": True, "mlp_ratio": 2.5,
             "rope_axes_dim": (2, 6, 4), "num_refiner_layers": 1},
        latents=(2, 3, 4, 3, 2)),
    # the other q/k norms diffusers builds a working HunyuanVideo DiT with; out_channels null (= in_channels)
    "qk-layer-norm": dict(ref={**HUNYUAN_BASE, "qk_norm": "layer_norm", "out_channels": None}, latents=(1, 3, 2, 4, 4)),
    "qk-fp32-layer-norm": dict(ref={**HUNYUAN_BASE, "qk_norm": "fp32_layer_norm"}, latents=(1, 3, 2, 4, 4)),
    "qk-none": dict(ref={**HUNYUAN_BASE, "qk_norm": None, "num_refiner_layers": 0}, latents=(1, 3, 2, 4, 4)),
}


@pytest.mark.parametrize("name", list(HUNYUAN_CASES))
def test_hunyuan_config_values_mean_what_diffusers_makes_them_mean(tmp_path, name):
    case = HUNYUAN_CASES[name]
    kwargs = case["ref"]
    ref, folder = _save(tmp_path, ReferenceHunyuan, kwargs)
    ours = _load(folder, "HunyuanVideoTransformer3DModel")
    assert type(ours).__module__ == "composer.models.hunyuan.transformer"
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(case["latents"], generator=g)
    batch = latents.shape[0]
    text = torch.randn(batch, 6, kwargs["text_embed_dim"], generator=g)
    mask = torch.ones(batch, 6, dtype=torch.int64)
    mask[-1, 4:] = 0  # the last row has 2 tokens of padding
    pooled = torch.randn(batch, kwargs["pooled_projection_dim"], generator=g)
    t = torch.linspace(900.0, 250.5, batch)
    guidance = torch.linspace(6.0, 3.5, batch) if kwargs["guidance_embeds"] else None
    with torch.inference_mode():
        # diffusers' transformer takes the guidance scale x 1000 (its pipeline scales it); composer's the scale
        ref_guidance = None if guidance is None else guidance * 1000
        expected = ref(latents, t, text, mask, pooled, ref_guidance, return_dict=False)[0]
        got = ours(latents, t, text, mask, pooled, guidance)
    _assert_close(got, expected, name)
    assert got.shape[1] == (kwargs["out_channels"] or kwargs["in_channels"])


def test_hunyuan_refiner_keeps_its_own_mlp_ratio(tmp_path):
    """The defect of issue 36: a folder saved with mlp_ratio 3.0 loads (the refiner's FFN is 4 x wide)."""
    _, folder = _save(tmp_path, ReferenceHunyuan, HUNYUAN_BASE)
    ours = _load(folder, "HunyuanVideoTransformer3DModel")
    dim = HUNYUAN_BASE["num_attention_heads"] * HUNYUAN_BASE["attention_head_dim"]
    assert ours.context_embedder.refiner_blocks[0].ff.fc_in.out_features == 4 * dim
    assert ours.transformer_blocks[0].ff.fc_in.out_features == int(3.0 * dim)
    assert ours.single_transformer_blocks[0].proj_mlp.out_features == int(3.0 * dim)


@pytest.mark.parametrize("changes, error, message", [
    ({"qk_norm": "l2"}, UnsupportedError, "qk_norm = 'l2'"),
    ({"qk_norm": "rms_norm_across_heads"}, UnsupportedError, "qk_norm = 'rms_norm_across_heads'"),
    ({"image_condition_type": "latent_concat"}, UnsupportedError, "image_condition_type = 'latent_concat'"),
    ({"rope_axes_dim": [4, 4, 2]}, ModelFormatError, "rope_axes_dim"),
    ({"patch_size": [2, 2]}, ModelFormatError, "patch_size"),
])
def test_hunyuan_values_composer_cannot_run_are_refused_by_name(tmp_path, changes, error, message):
    _, folder = _save(tmp_path, ReferenceHunyuan, {**HUNYUAN_BASE, "num_single_layers": 0}, changes)
    with pytest.raises(error, match=message):
        _load(folder, "HunyuanVideoTransformer3DModel")
