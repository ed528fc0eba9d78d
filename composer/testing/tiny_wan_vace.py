"""Build tiny Wan VACE folders in exact diffusers layout, seeded: Wan2.1 VACE (one transformer) and the two-expert
Wan2.2 VACE layout (`transformer_2`, `boundary_ratio`).

Written by diffusers' own `WanVACEPipeline(...).save_pretrained` from diffusers' `WanVACETransformer3DModel` and the
pieces of `tiny_wan.py` (tokenizer, UMT5 encoder, the Wan2.1 VAE, scheduler), so composer loads them through the
code a released folder takes. The control blocks sit after blocks 0 and 2 of 3 (not every block, not contiguous:
the hint-to-block pairing is exercised); the control latents have 2 x 16 + 8 x 8 = 96 channels, as released.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from composer.testing.tiny_wan import TinyWanSpec, build_tiny_wan_components


@dataclass(frozen=True)
class TinyWanVACESpec(TinyWanSpec):
    """TinyWanSpec plus VACE's settings (and the two-expert layout's boundary)."""

    num_layers: int = 3
    vace_layers: tuple[int, ...] = (0, 2)
    boundary_ratio: float = 0.875


def tiny_vace_transformer(spec: TinyWanVACESpec, seed: int):
    """diffusers' WanVACETransformer3DModel of the spec's sizes over the Wan2.1 VAE's 16 channels, seeded."""
    from diffusers import WanVACETransformer3DModel

    torch.manual_seed(seed)
    return WanVACETransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=spec.num_heads, attention_head_dim=spec.head_dim, in_channels=16,
        out_channels=16, text_dim=spec.text_dim, freq_dim=spec.freq_dim, ffn_dim=spec.ffn_dim,
        num_layers=spec.num_layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
        rope_max_seq_len=1024, vace_layers=list(spec.vace_layers), vace_in_channels=2 * 16 + spec.vae_spatial ** 2,
    ).eval()


def build_tiny_wan_vace(path: str | Path, spec: TinyWanVACESpec | None = None, two_experts: bool = False,
                        **overrides) -> Path:
    """Write a tiny Wan VACE folder at `path`: Wan2.1's (one transformer), or with `two_experts` the Wan2.2 layout
    (`transformer_2` of other weights, `boundary_ratio` in model_index.json)."""
    from diffusers import WanVACEPipeline

    spec = dataclasses.replace(spec or TinyWanVACESpec(), **overrides)
    path = Path(path)
    if (path / "model_index.json").exists():
        raise FileExistsError(f"{path} already holds a model")
    components = build_tiny_wan_components(dataclasses.replace(spec, z_dim=16))
    components["transformer"] = tiny_vace_transformer(spec, spec.seed + 2)
    config = {}
    if two_experts:
        components["transformer_2"] = tiny_vace_transformer(spec, spec.seed + 4)
        config["boundary_ratio"] = spec.boundary_ratio
    WanVACEPipeline(**components, **config).save_pretrained(str(path), safe_serialization=True)
    return path
