"""Build tiny Wan2.2 folders in exact diffusers layout, seeded: the two-expert T2V A14B layout, the TI2V-5B layout
(text- or image-to-video) and the two-expert I2V A14B layout.

Both are written by diffusers' own `WanPipeline(..., transformer_2=..., boundary_ratio=..., expand_timesteps=...)`
`.save_pretrained`, from the pieces of `tiny_wan.py` (tokenizer, UMT5 encoder, scheduler, Wan transformer):

- A14B: two transformers of the same shape and different weights (high-noise `transformer`, low-noise
  `transformer_2`), the Wan2.1 VAE (16 channels, 8x), `boundary_ratio` in model_index.json;
- TI2V: one transformer over 48 latent channels and the Wan2.2 VAE at tiny width with its real structure
  (`is_residual`, `patch_size` 2 so 12 pixel channels, 16x spatial / 4x temporal compression, z_dim 48, its own
  per-channel latent mean / std), `expand_timesteps` in model_index.json;
- I2V A14B: written by diffusers' `WanImageToVideoPipeline(..., transformer_2=..., boundary_ratio=...)` with no
  image encoder or processor (null in model_index.json, as in the release): two experts taking 2 * 16 + 4 input
  channels (noise, frame mask, encoded condition video) without image cross-attention, the Wan2.1 VAE.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from composer.testing.tiny_wan import TinyWanSpec, build_tiny_wan_components, tiny_wan_transformer


@dataclass(frozen=True)
class TinyWan22Spec(TinyWanSpec):
    """TinyWanSpec plus the Wan2.2 settings. `z_dim` and `vae_base_dim` apply to the Wan2.2 VAE of the TI2V layout
    (the A14B layout keeps the Wan2.1 VAE, as the released model does)."""

    boundary_ratio: float = 0.875
    flow_shift: float = 5.0
    vae_decoder_base_dim: int = 12


def wan22_vae(spec: TinyWan22Spec):
    """A Wan2.2 VAE (AutoencoderKLWan with the TI2V-5B structure) at tiny width, seeded."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(spec.seed + 3)
    mean = (torch.rand(spec.z_dim) - 0.5).tolist()  # a real per-channel normalisation, not the identity
    std = (torch.rand(spec.z_dim) + 0.5).tolist()
    return AutoencoderKLWan(
        base_dim=spec.vae_base_dim, decoder_base_dim=spec.vae_decoder_base_dim, z_dim=spec.z_dim,
        dim_mult=[1, 2, 4, 4], num_res_blocks=1, attn_scales=[], temperal_downsample=[False, True, True],
        is_residual=True, in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
        scale_factor_temporal=4, latents_mean=mean, latents_std=std,
    ).eval()


def _write(path: str | Path, components: dict, pipeline_class=None, **config) -> Path:
    from diffusers import WanPipeline

    path = Path(path)
    if (path / "model_index.json").exists():
        raise FileExistsError(f"{path} already holds a model")
    (pipeline_class or WanPipeline)(**components, **config).save_pretrained(str(path), safe_serialization=True)
    return path


def build_tiny_wan22_a14b(path: str | Path, spec: TinyWan22Spec | None = None, **overrides) -> Path:
    """Write a tiny Wan2.2 T2V A14B folder (two experts, `boundary_ratio`) at `path`."""
    spec = dataclasses.replace(spec or TinyWan22Spec(), **overrides)
    components = build_tiny_wan_components(dataclasses.replace(spec, z_dim=16))
    components["transformer"] = tiny_wan_transformer(spec, 16, spec.seed + 2)
    components["transformer_2"] = tiny_wan_transformer(spec, 16, spec.seed + 4)
    return _write(path, components, boundary_ratio=spec.boundary_ratio)


def build_tiny_wan22_ti2v(path: str | Path, spec: TinyWan22Spec | None = None, **overrides) -> Path:
    """Write a tiny Wan2.2 TI2V folder (48-channel Wan2.2 VAE, `expand_timesteps`) at `path`."""
    spec = dataclasses.replace(spec or TinyWan22Spec(z_dim=48, vae_base_dim=8), **overrides)
    components = build_tiny_wan_components(dataclasses.replace(spec, z_dim=16))
    components["vae"] = wan22_vae(spec)
    components["transformer"] = tiny_wan_transformer(spec, spec.z_dim, spec.seed + 2)
    return _write(path, components, expand_timesteps=True)


def build_tiny_wan22_i2v_a14b(path: str | Path, spec: TinyWan22Spec | None = None, **overrides) -> Path:
    """Write a tiny Wan2.2 I2V A14B folder (WanImageToVideoPipeline, two experts, `boundary_ratio` 0.9 as
    released, no image encoder) at `path`."""
    from diffusers import WanImageToVideoPipeline

    spec = dataclasses.replace(spec or TinyWan22Spec(boundary_ratio=0.9), **overrides)
    components = build_tiny_wan_components(dataclasses.replace(spec, z_dim=16))
    condition = 16 + 4  # the frame mask (the VAE's temporal factor) and the encoded condition video
    components["transformer"] = tiny_wan_transformer(spec, 16, spec.seed + 2, in_channels=16 + condition)
    components["transformer_2"] = tiny_wan_transformer(spec, 16, spec.seed + 4, in_channels=16 + condition)
    components.update(image_encoder=None, image_processor=None)
    return _write(path, components, WanImageToVideoPipeline, boundary_ratio=spec.boundary_ratio)
