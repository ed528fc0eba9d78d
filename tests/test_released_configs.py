"""The released models' transformer configs at full size (composer/testing/released.py, random weights): one
classifier-free-guided denoising prediction of the real Wan2.1 1.3B DiT (30 layers, width 1536) at a tiny
resolution equals diffusers' on the same tensors (fp32, <= 1e-4), and every released config builds."""

from __future__ import annotations

import pytest
import torch

from composer.testing.released import RELEASED, composer_twin, released_config, released_dit


@pytest.fixture(scope="module")
def dit_1_3b():
    """diffusers' Wan2.1 1.3B DiT (seed 0), built once for the module: both tests below read it, neither changes it."""
    return released_dit("wan2.1-t2v-1.3b")


@pytest.mark.slow  # two 1.3B models built on the CPU
def test_the_real_1_3b_dit_predicts_as_diffusers_at_a_tiny_resolution(dit_1_3b):
    theirs = dit_1_3b
    assert sum(p.numel() for p in theirs.parameters()) > 1.3e9  # the released size, not a reduced one
    ours = composer_twin(theirs)
    g = torch.Generator("cpu").manual_seed(0)
    latents = torch.randn(1, 16, 2, 8, 8, generator=g)  # 2 latent frames of 8x8: 32 tokens
    text = torch.randn(2, 12, 4096, generator=g)  # the prompt's and the negative prompt's embeddings
    t = torch.tensor([700.0, 700.0])
    with torch.no_grad():
        expected = theirs(torch.cat([latents, latents]), t, text, return_dict=False)[0]
        got = ours(torch.cat([latents, latents]), t, text)
    got = got.sample if hasattr(got, "sample") else (got[0] if isinstance(got, tuple) else got)
    guided = lambda out: out[1:] + 5.0 * (out[:1] - out[1:])  # noqa: E731 - the CFG combination
    assert (guided(got) - guided(expected)).abs().max().item() <= 1e-4
    assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", list(RELEASED))
def test_every_released_config_builds_on_meta(name):
    import diffusers

    class_name, _ = RELEASED[name]
    with torch.device("meta"):
        model = getattr(diffusers, class_name)(**released_config(name))
    billions = sum(p.numel() for p in model.parameters()) / 1e9
    expected = {"wan2.1-t2v-1.3b": 1.4, "wan2.1-t2v-14b": 14.3, "wan2.2-ti2v-5b": 5.0, "hunyuanvideo": 12.8}[name]
    assert abs(billions - expected) / expected < 0.06, billions


@pytest.mark.slow
def test_the_self_forcing_1_3b_causal_model_at_its_real_size(dit_1_3b):
    """The Self-Forcing 1.3B (the 1.3B DiT as composer's block-causal model): its first block, alone in the video,
    attends to itself only, so it predicts what diffusers' full-attention DiT predicts on the same tensors; and the
    settings are Self-Forcing's (3 latent frames a block, four steps)."""
    from composer.testing.released import SELF_FORCING_1_3B

    assert SELF_FORCING_1_3B["base"] == "wan2.1-t2v-1.3b"  # the module's DiT (released_dit(base), seed 0)
    theirs = dit_1_3b
    ours = composer_twin(theirs, causal=True)
    assert type(ours).__name__ == "CausalWanTransformer3DModel"
    g = torch.Generator("cpu").manual_seed(1)
    block = torch.randn(1, 16, SELF_FORCING_1_3B["num_frames_per_block"], 4, 4, generator=g)
    text = torch.randn(1, 12, 4096, generator=g)
    t = torch.tensor([1000.0])
    with torch.no_grad():
        expected = theirs(block, t, text, return_dict=False)[0]
        got = ours(block, t, text)
    assert (got - expected).abs().max().item() <= 1e-4
    assert SELF_FORCING_1_3B["denoising_step_list"] == [1000, 750, 500, 250]
