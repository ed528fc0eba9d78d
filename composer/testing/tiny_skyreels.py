"""Build a tiny SkyReels-V2 diffusion-forcing folder in exact diffusers layout, seeded.

The folder is written by diffusers' own `SkyReelsV2DiffusionForcingPipeline.save_pretrained` from diffusers'
`SkyReelsV2Transformer3DModel` and the tiny Wan2.1 parts (`AutoencoderKLWan`, `UMT5EncoderModel`, the T5 tokenizer,
the UniPC scheduler of the released folders), so composer loads it through the code a released checkpoint takes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from composer.testing.tiny_wan import TinyWanSpec, build_tiny_wan_components


def tiny_skyreels_transformer(spec: TinyWanSpec, seed: int, inject_sample_info: bool = True,
                              num_frame_per_block: int = 1):
    """diffusers' SkyReelsV2Transformer3DModel of the spec's sizes, seeded by `seed`; `inject_sample_info`: the fps
    embedding the released DF models have; `num_frame_per_block`: the causal block its config states."""
    from diffusers import SkyReelsV2Transformer3DModel

    torch.manual_seed(seed)
    return SkyReelsV2Transformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=spec.num_heads, attention_head_dim=spec.head_dim,
        in_channels=spec.z_dim, out_channels=spec.z_dim, text_dim=spec.text_dim, freq_dim=spec.freq_dim,
        ffn_dim=spec.ffn_dim, num_layers=spec.num_layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        eps=1e-6, rope_max_seq_len=1024, inject_sample_info=inject_sample_info,
        num_frame_per_block=num_frame_per_block,
    ).eval()


def build_tiny_skyreels_df(path: str | Path, spec: TinyWanSpec | None = None, inject_sample_info: bool = True,
                           num_frame_per_block: int = 1, pipeline: str = "SkyReelsV2DiffusionForcingPipeline",
                           **overrides) -> Path:
    """Write a tiny SkyReels-V2 DF diffusers folder at `path` (created; must not hold a model), saved by diffusers'
    `pipeline` class (its image- or video-to-video class: the same components, its `_class_name`)."""
    import diffusers

    spec = dataclasses.replace(spec or TinyWanSpec(), **overrides)
    path = Path(path)
    if (path / "model_index.json").exists():
        raise FileExistsError(f"{path} already holds a model")
    components = build_tiny_wan_components(spec)
    components["transformer"] = tiny_skyreels_transformer(spec, spec.seed + 2, inject_sample_info,
                                                          num_frame_per_block)
    getattr(diffusers, pipeline)(**components).save_pretrained(str(path), safe_serialization=True)
    return path
