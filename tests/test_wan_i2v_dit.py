"""composer's Wan DiT with image cross-attention (Wan2.1 I2V / FLF2V) == diffusers' WanTransformer3DModel on the
same weights: fp32 max abs diff <= 1e-4, bf16 within 1e-2 relative, diffusers and original-release namings."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import WanTransformer3DModel as ReferenceWan
from helpers import to_original_name
from safetensors.torch import save_file

from composer.errors import UnsupportedError
from composer.loader.components import ComposerModelLoader
from composer.loader.model_index import ComponentSpec
from composer.models.wan.config import WanTransformerConfig

# diffusers' attention processor takes the last 512 context tokens as the text: the text is 512 tokens here
TEXT_LEN = 512
BASE = dict(num_attention_heads=2, attention_head_dim=16, in_channels=36, out_channels=16, text_dim=24,
            ffn_dim=64, num_layers=2, freq_dim=32, image_dim=20, added_kv_proj_dim=32)
CASES = {
    # I2V: one image of 9 CLIP tokens per video, batch 2, non-square latent grid, 3 latent frames
    "i2v-batch2": dict(ref=BASE, latents=(2, 36, 3, 6, 10), images_per_video=1),
    # FLF2V: the first and last images' tokens as one sequence with a learned position embedding
    "flf2v": dict(ref={**BASE, "pos_embed_seq_len": 18}, latents=(1, 36, 2, 8, 4), images_per_video=2),
}
IMAGE_TOKENS = 9


def _save_reference(tmp_path, ref_kwargs, seed=0):
    torch.manual_seed(seed)
    ref = ReferenceWan(**ref_kwargs).eval()
    with torch.no_grad():  # zero-initialised tables (pos_embed) and unit norms are exercised too
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    folder = tmp_path / "transformer"
    ref.save_pretrained(folder)
    return ref, folder


def _load_composer(folder, dtype=torch.float32):
    spec = ComponentSpec("transformer", "diffusers", "WanTransformer3DModel")
    return ComposerModelLoader().load(folder, spec, torch.device("cpu"), dtype)


def _inputs(case, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(case["latents"], generator=g)
    batch = latents.shape[0]
    text = torch.randn(batch, TEXT_LEN, case["ref"]["text_dim"], generator=g)
    image = torch.randn(batch * case["images_per_video"], IMAGE_TOKENS, case["ref"]["image_dim"], generator=g)
    return latents.to(dtype), text.to(dtype), image.to(dtype)


@pytest.mark.parametrize("name", list(CASES))
def test_image_dit_matches_diffusers(tmp_path, name):
    case = CASES[name]
    ref, folder = _save_reference(tmp_path, case["ref"])
    ours = _load_composer(folder)
    assert ours.config.takes_image and hasattr(ours.blocks[0].attn2, "add_k_proj")
    latents, text, image = _inputs(case)
    batch = latents.shape[0]
    for timestep in (torch.full((batch,), 999.0), torch.full((batch,), 437.25)):
        with torch.inference_mode():
            expected = ref(latents, timestep, text, encoder_hidden_states_image=image, return_dict=False)[0]
            got = ours(latents, timestep, text, image)
            # the engine's path: text and image k/v computed once per prompt
            got_kv = ours(latents, timestep, cross_kv=ours.cross_attention_kv(text, image))
        assert got.shape == expected.shape == (batch, 16, *latents.shape[2:])
        assert (got - expected).abs().max().item() <= 1e-4
        assert (got_kv - expected).abs().max().item() <= 1e-4
    # the image matters: another image gives another prediction
    with torch.inference_mode():
        other = ours(latents, timestep, text, image.flip(0) + 1.0)
    assert (other - got).abs().max().item() > 1e-3


def test_image_dit_matches_diffusers_bf16(tmp_path):
    """bf16 weights and activations; the image embedder's norms kept in fp32 as diffusers keeps them."""
    case = CASES["flf2v"]
    _, folder = _save_reference(tmp_path, case["ref"])
    ref = ReferenceWan.from_pretrained(folder, torch_dtype=torch.bfloat16).eval()
    ours = _load_composer(folder, torch.bfloat16)
    assert ours.blocks[0].attn2.add_k_proj.weight.dtype == torch.bfloat16
    assert ours.condition_embedder.image_embedder.norm1.weight.dtype == torch.float32
    assert ref.condition_embedder.image_embedder.norm1.weight.dtype == torch.float32
    latents, text, image = _inputs(case, seed=3, dtype=torch.bfloat16)
    t = torch.tensor([500.0])
    with torch.inference_mode():
        expected = ref(latents, t, text, encoder_hidden_states_image=image, return_dict=False)[0].float()
        got = ours(latents, t, text, image).float()
    assert torch.isfinite(got).all()
    rel = ((got - expected).abs().max() / expected.abs().max()).item()
    assert rel <= 1e-2, f"bf16 relative diff {rel}"


# diffusers names -> the original Wan release's I2V names, written out here independently of composer's table
I2V_TO_ORIGINAL = [
    (".attn2.add_k_proj.", ".cross_attn.k_img."),
    (".attn2.add_v_proj.", ".cross_attn.v_img."),
    (".attn2.norm_added_k.", ".cross_attn.norm_k_img."),
    ("condition_embedder.image_embedder.norm1.", "img_emb.proj.0."),
    ("condition_embedder.image_embedder.ff.net.0.proj.", "img_emb.proj.1."),
    ("condition_embedder.image_embedder.ff.net.2.", "img_emb.proj.3."),
    ("condition_embedder.image_embedder.norm2.", "img_emb.proj.4."),
    ("condition_embedder.image_embedder.pos_embed", "img_emb.emb_pos"),
]


def test_original_release_naming_and_config(tmp_path):
    """An FLF2V checkpoint in the original release's names and config (`model_type: flf2v`, no image sizes: they
    are the release's CLIP ViT-H, 1280 wide, 2 x 257 tokens)."""
    ref_kwargs = {**BASE, "image_dim": 1280, "pos_embed_seq_len": 2 * 257}
    ref, folder = _save_reference(tmp_path, ref_kwargs)
    original = tmp_path / "original"
    original.mkdir()
    state = {}
    for name, tensor in ref.state_dict().items():
        for old, new in I2V_TO_ORIGINAL:
            name = name.replace(old, new)
        state[to_original_name(name)] = tensor.contiguous()
    save_file(state, original / "model.safetensors")
    (original / "config.json").write_text(json.dumps({
        "_class_name": "WanModel", "model_type": "flf2v", "dim": 32, "num_heads": 2, "in_dim": 36, "out_dim": 16,
        "text_dim": 24, "ffn_dim": 64, "num_layers": 2, "freq_dim": 32, "eps": 1e-6, "cross_attn_norm": True,
        "qk_norm": True, "patch_size": [1, 2, 2], "text_len": 512, "window_size": [-1, -1],
    }))
    ours = _load_composer(original)
    assert ours.config.image_dim == 1280 and ours.config.pos_embed_seq_len == 514
    case = {"ref": ref_kwargs, "latents": (1, 36, 2, 4, 4), "images_per_video": 2}
    g = torch.Generator().manual_seed(5)
    latents, text = torch.randn(case["latents"], generator=g), torch.randn(1, TEXT_LEN, 24, generator=g)
    image = torch.randn(2, 257, 1280, generator=g)
    t = torch.tensor([250.0])
    with torch.inference_mode():
        expected = ref(latents, t, text, encoder_hidden_states_image=image, return_dict=False)[0]
        got = ours(latents, t, text, image)
    assert (got - expected).abs().max().item() <= 1e-4


def test_image_states_required_by_image_models_refused_by_text_models(tmp_path):
    _, folder = _save_reference(tmp_path, BASE)
    ours = _load_composer(folder)
    latents, text, image = _inputs(CASES["i2v-batch2"])
    with pytest.raises(ValueError, match="needs encoder_hidden_states_image"):
        ours(latents, torch.tensor([1.0, 1.0]), text)
    text_model = _load_composer(_save_reference(tmp_path / "t2v", {**BASE, "in_channels": 16, "image_dim": None,
                                                                   "added_kv_proj_dim": None})[1])
    with pytest.raises(ValueError, match="no image cross-attention"):
        text_model(latents[:, :16], torch.tensor([1.0, 1.0]), text, image)


def test_half_configured_image_attention_is_refused():
    with pytest.raises(UnsupportedError, match="image_dim = 20 but added_kv_proj_dim = None"):
        WanTransformerConfig.from_dict({**BASE, "added_kv_proj_dim": None})
