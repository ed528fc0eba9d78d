"""Build a tiny Wan2.1 image-to-video (or first-last-frame) folder in exact diffusers layout, seeded.

The tiny T2V pieces (UMT5 text encoder, tokenizer, VAE, scheduler) come from `tiny_wan`; this adds what an I2V
folder has beyond them: a transformer taking the image condition (in_channels = 2 * z_dim + 4: noise, the
4-channel frame mask and the encoded condition video) with image cross-attention, a transformers
`CLIPVisionModel` image encoder and its `CLIPImageProcessor`. diffusers' own
`WanImageToVideoPipeline.save_pretrained` writes the folder, so composer loads it as it would a real checkpoint.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from composer.testing.tiny_wan import TinyWanSpec, build_tiny_wan_components

# The 4 mask channels diffusers' I2V pipeline puts before the encoded condition: the VAE's temporal factor.
MASK_CHANNELS = 4


@dataclass(frozen=True)
class TinyWanI2VSpec(TinyWanSpec):
    """Sizes of the tiny I2V model: the tiny T2V sizes plus a tiny CLIP vision tower (17 tokens of width 32)."""

    clip_dim: int = 32
    clip_layers: int = 2
    clip_heads: int = 2
    clip_ff: int = 64
    clip_image_size: int = 32
    clip_patch: int = 8
    first_last_frame: bool = False  # FLF2V: a learned position embedding over both images' tokens

    @property
    def clip_tokens(self) -> int:
        return (self.clip_image_size // self.clip_patch) ** 2 + 1


def build_tiny_wan_i2v_components(spec: TinyWanI2VSpec = TinyWanI2VSpec()) -> dict:
    """The diffusers / transformers modules of a tiny Wan2.1 I2V (or FLF2V) pipeline, seeded by `spec.seed`."""
    from diffusers import WanTransformer3DModel
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    components = build_tiny_wan_components(spec)
    torch.manual_seed(spec.seed + 3)
    components["image_encoder"] = CLIPVisionModel(
        CLIPVisionConfig(
            hidden_size=spec.clip_dim, intermediate_size=spec.clip_ff, num_hidden_layers=spec.clip_layers,
            num_attention_heads=spec.clip_heads, image_size=spec.clip_image_size, patch_size=spec.clip_patch,
            hidden_act="gelu",
        )
    ).eval()
    # CLIP's own preprocessing (resize the short side, center crop, CLIP mean/std) at the tiny tower's size
    components["image_processor"] = CLIPImageProcessor(
        size={"shortest_edge": spec.clip_image_size},
        crop_size={"height": spec.clip_image_size, "width": spec.clip_image_size},
    )
    torch.manual_seed(spec.seed + 4)
    dim = spec.num_heads * spec.head_dim
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=spec.num_heads, attention_head_dim=spec.head_dim,
        in_channels=2 * spec.z_dim + MASK_CHANNELS, out_channels=spec.z_dim, text_dim=spec.text_dim,
        freq_dim=spec.freq_dim, ffn_dim=spec.ffn_dim, num_layers=spec.num_layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024, image_dim=spec.clip_dim,
        added_kv_proj_dim=dim, pos_embed_seq_len=2 * spec.clip_tokens if spec.first_last_frame else None,
    ).eval()
    if spec.first_last_frame:  # diffusers initialises it to zeros: make it matter
        with torch.no_grad():
            transformer.condition_embedder.image_embedder.pos_embed.normal_(0.0, 0.5)
    components["transformer"] = transformer
    return components


def build_tiny_wan_i2v(path: str | Path, spec: TinyWanI2VSpec | None = None, **overrides) -> Path:
    """Write a tiny Wan2.1 I2V diffusers folder at `path` (`first_last_frame=True`: FLF2V); created, must not
    hold a model already."""
    from diffusers import WanImageToVideoPipeline

    spec = dataclasses.replace(spec or TinyWanI2VSpec(), **overrides)
    path = Path(path)
    if (path / "model_index.json").exists():
        raise FileExistsError(f"{path} already holds a model")
    pipe = WanImageToVideoPipeline(**build_tiny_wan_i2v_components(spec))
    pipe.save_pretrained(str(path), safe_serialization=True)
    return path
