"""Build a tiny Wan2.1 text-to-video folder in exact diffusers layout, seeded.

The folder is written by diffusers' own `WanPipeline.save_pretrained` from diffusers' `WanTransformer3DModel`
and `AutoencoderKLWan`, transformers' `UMT5EncoderModel` and a deterministic T5 tokenizer, so composer
loads it through the same code a real checkpoint takes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class TinyWanSpec:
    """Sizes of the tiny model (defaults: ~1 MB, a 9x64x64 6-step CFG video in well under a second)."""

    num_layers: int = 2
    num_heads: int = 2
    head_dim: int = 32
    ffn_dim: int = 128
    freq_dim: int = 64
    text_dim: int = 32  # UMT5 d_model
    text_layers: int = 2
    text_heads: int = 2
    text_ff: int = 64
    z_dim: int = 16
    vae_base_dim: int = 8
    vae_spatial: int = 8  # spatial compression: 8 (Wan2.1's) or 4 (one 2x stage fewer)
    scheduler: str = "unipc"  # "unipc" (as released) or "euler" (FlowMatchEulerDiscreteScheduler)
    flow_shift: float = 3.0
    seed: int = 0


def _make_scheduler(spec: TinyWanSpec):
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    if spec.scheduler == "unipc":  # the released Wan2.1 scheduler config
        return UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000,
            flow_shift=spec.flow_shift,
        )
    if spec.scheduler == "euler":
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=spec.flow_shift)
    raise ValueError(f"unknown scheduler {spec.scheduler!r} (expected 'unipc' or 'euler')")


def wan_vae_layout(spatial: int) -> tuple[list[int], list[bool]]:
    """(dim_mult, temperal_downsample) of a Wan VAE with 4x temporal and `spatial` (4 or 8) spatial
    compression: one 2x stage per factor of 2, the temporal ones last at 8x (Wan2.1's layout)."""
    layouts = {8: ([1, 2, 4, 4], [False, True, True]), 4: ([1, 2, 4], [True, True])}
    if spatial not in layouts:
        raise ValueError(f"the VAE's spatial compression must be 4 or 8, got {spatial}")
    dim_mult, temporal = layouts[spatial]
    return list(dim_mult), list(temporal)


def build_tiny_wan_components(spec: TinyWanSpec = TinyWanSpec()) -> dict:
    """The diffusers / transformers modules of a tiny Wan2.1 T2V pipeline, seeded by `spec.seed`."""
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    from composer.testing.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    torch.manual_seed(spec.seed)
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tokenizer), d_model=spec.text_dim, d_kv=spec.text_dim // spec.text_heads,
            d_ff=spec.text_ff, num_layers=spec.text_layers, num_heads=spec.text_heads,
            relative_attention_num_buckets=32, relative_attention_max_distance=128, dropout_rate=0.0,
            feed_forward_proj="gated-gelu",
        )
    ).eval()
    torch.manual_seed(spec.seed + 1)
    z_kwargs = {} if spec.z_dim == 16 else {"latents_mean": [0.0] * spec.z_dim, "latents_std": [1.0] * spec.z_dim}
    dim_mult, temporal = wan_vae_layout(spec.vae_spatial)
    vae = AutoencoderKLWan(
        base_dim=spec.vae_base_dim, z_dim=spec.z_dim, dim_mult=dim_mult, num_res_blocks=1,
        attn_scales=[], temperal_downsample=temporal, scale_factor_spatial=spec.vae_spatial, **z_kwargs,
    ).eval()
    return {
        "tokenizer": tokenizer, "text_encoder": text_encoder, "vae": vae,
        "transformer": tiny_wan_transformer(spec, spec.z_dim, spec.seed + 2), "scheduler": _make_scheduler(spec),
    }


def tiny_wan_transformer(spec: TinyWanSpec, channels: int, seed: int, in_channels: int | None = None):
    """diffusers' WanTransformer3DModel of the spec's sizes over `channels` latent channels, seeded by `seed`;
    `in_channels` when its input has more (an image condition on the channel axis)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=spec.num_heads, attention_head_dim=spec.head_dim,
        in_channels=channels if in_channels is None else in_channels, out_channels=channels, text_dim=spec.text_dim, freq_dim=spec.freq_dim,
        ffn_dim=spec.ffn_dim, num_layers=spec.num_layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
        eps=1e-6, rope_max_seq_len=1024,
    ).eval()


def build_tiny_wan(path: str | Path, spec: TinyWanSpec | None = None, **overrides) -> Path:
    """Write a tiny Wan2.1 T2V diffusers folder at `path` (created; must not hold a model already)."""
    from diffusers import WanPipeline

    spec = dataclasses.replace(spec or TinyWanSpec(), **overrides)
    path = Path(path)
    if (path / "model_index.json").exists():
        raise FileExistsError(f"{path} already holds a model")
    pipe = WanPipeline(**build_tiny_wan_components(spec))
    pipe.save_pretrained(str(path), safe_serialization=True)
    return path
