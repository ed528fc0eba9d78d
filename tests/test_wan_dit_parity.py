"""composer's Wan DiT == diffusers' WanTransformer3DModel on the same weights (fp32, max abs diff <= 1e-4)."""

from __future__ import annotations

import pytest
import torch
from diffusers import WanTransformer3DModel as ReferenceWan

from composer.loader.components import ComposerModelLoader
from composer.loader.model_index import ComponentSpec
from composer.models.wan.transformer import WanTransformer3DModel

CONFIGS = {
    # non-square latent grid (12x20 -> 6x10 tokens), odd latent frame count (5), batch 1
    "2L-2x32-nonsquare-odd": dict(
        ref=dict(num_attention_heads=2, attention_head_dim=32, text_dim=32, ffn_dim=128, num_layers=2, freq_dim=64),
        latents=(1, 16, 5, 12, 20), text_len=24,
    ),
    # batch 2, 3 heads of 24, no cross-attention norm, 3 latent frames, taller than wide
    "3L-3x24-batch2": dict(
        ref=dict(
            num_attention_heads=3, attention_head_dim=24, text_dim=48, ffn_dim=96, num_layers=3, freq_dim=256,
            cross_attn_norm=False,
        ),
        latents=(2, 16, 3, 16, 8), text_len=512,
    ),
    # 4 latent channels in and out, a single latent frame (an image), 7 frames of RoPE not needed
    "1L-4x16-image": dict(
        ref=dict(
            num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=16, ffn_dim=64,
            num_layers=1, freq_dim=32,
        ),
        latents=(1, 4, 1, 10, 14), text_len=8,
    ),
}


def _save_reference(tmp_path, ref_kwargs, seed=0):
    torch.manual_seed(seed)
    ref = ReferenceWan(**ref_kwargs).eval()
    # Perturb every parameter so zero-initialised tables and norms are exercised too.
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    folder = tmp_path / "transformer"
    ref.save_pretrained(folder)
    return ref, folder


def _load_composer(folder, dtype=torch.float32):
    spec = ComponentSpec("transformer", "diffusers", "WanTransformer3DModel")
    return ComposerModelLoader().load(folder, spec, torch.device("cpu"), dtype)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_dit_forward_matches_diffusers(tmp_path, name):
    case = CONFIGS[name]
    ref, folder = _save_reference(tmp_path, case["ref"])
    ours = _load_composer(folder)
    assert isinstance(ours, WanTransformer3DModel)

    g = torch.Generator().manual_seed(1)
    latents = torch.randn(case["latents"], generator=g)
    batch = latents.shape[0]
    context = torch.randn(batch, case["text_len"], case["ref"]["text_dim"], generator=g)
    for timestep in (torch.full((batch,), 999.0), torch.tensor([437.25] * batch), torch.zeros(batch)):
        with torch.inference_mode():
            expected = ref(latents, timestep, context, return_dict=False)[0]
            got = ours(latents, timestep, context)
        assert got.shape == expected.shape == latents.shape
        diff = (got - expected).abs().max().item()
        assert diff <= 1e-4, f"{name} t={timestep.tolist()}: max abs diff {diff}"


def test_dit_forward_matches_diffusers_bf16(tmp_path):
    """bf16 weights and activations, same dtype plumbing as diffusers (fp32 norms, modulation, tables)."""
    case = CONFIGS["2L-2x32-nonsquare-odd"]
    _, folder = _save_reference(tmp_path, case["ref"])
    ref = ReferenceWan.from_pretrained(folder, torch_dtype=torch.bfloat16).eval()
    ours = _load_composer(folder, torch.bfloat16)
    assert ours.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    assert ours.blocks[0].scale_shift_table.dtype == torch.float32  # kept in fp32 like diffusers
    assert ours.condition_embedder.time_embedder.linear_1.weight.dtype == torch.float32
    g = torch.Generator().manual_seed(3)
    latents = torch.randn(case["latents"], generator=g).bfloat16()
    context = torch.randn(1, case["text_len"], 32, generator=g).bfloat16()
    t = torch.tensor([500.0])
    with torch.inference_mode():
        expected = ref(latents, t, context, return_dict=False)[0].float()
        got = ours(latents, t, context).float()
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    rel = ((got - expected).abs().max() / expected.abs().max()).item()
    assert rel <= 1e-2, f"bf16 relative diff {rel}"


def test_rope_cache_reused_across_steps(tmp_path):
    _, folder = _save_reference(tmp_path, CONFIGS["1L-4x16-image"]["ref"])
    ours = _load_composer(folder)
    first = ours.rotary((1, 5, 7), torch.device("cpu"))
    assert ours.rotary((1, 5, 7), torch.device("cpu"))[0] is first[0]
    assert ours.rotary((2, 5, 7), torch.device("cpu"))[0].shape[1] == 2 * 5 * 7
