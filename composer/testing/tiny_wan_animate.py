"""Build a tiny Wan2.2-Animate folder in exact diffusers layout, seeded.

Written by diffusers' own `WanAnimatePipeline(...).save_pretrained` from diffusers' `WanAnimateTransformer3DModel`,
the CLIP image encoder and processor of `tiny_wan_i2v.py` and the pieces of `tiny_wan.py` (tokenizer, UMT5 encoder,
the Wan2.1 VAE, UniPC), so composer loads it through the code a released folder takes. Four blocks with a face
adapter after blocks 0 and 2 (interleaved, as the release's after every 5th of 40), face frames of 16 pixels (two
motion-encoder stages down to 4 x 4). Parameters diffusers starts at zeros or ones (the motion encoder's activation
biases, the face padding token, the face adapters' norms) are drawn at random, and the pose embedding and the face
adapters' outputs scaled up, so that each input visibly moves the video (tests/test_wan_animate.py checks it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from composer.testing.tiny_wan_i2v import MASK_CHANNELS, TinyWanI2VSpec, build_tiny_wan_i2v_components


@dataclass(frozen=True)
class TinyWanAnimateSpec(TinyWanI2VSpec):
    """TinyWanI2VSpec plus the Animate transformer's own sizes."""

    num_layers: int = 4
    inject_face_latents_blocks: int = 2
    motion_encoder_size: int = 16
    motion_channels: int = 8
    motion_style_dim: int = 16
    motion_dim: int = 4
    motion_encoder_dim: int = 16
    face_encoder_hidden_dim: int = 16
    face_encoder_num_heads: int = 2
    motion_encoder_batch_size: int = 3  # not a divisor of the face frames: the batches' split is exercised


def tiny_animate_transformer(spec: TinyWanAnimateSpec, seed: int):
    """diffusers' WanAnimateTransformer3DModel of the spec's sizes over the Wan2.1 VAE's 16 channels, seeded (see the
    module doc for what is perturbed)."""
    from diffusers import WanAnimateTransformer3DModel

    torch.manual_seed(seed)
    dim = spec.num_heads * spec.head_dim
    sizes = [2**i for i in range(2, spec.motion_encoder_size.bit_length())]
    model = WanAnimateTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=spec.num_heads, attention_head_dim=spec.head_dim,
        in_channels=2 * spec.z_dim + MASK_CHANNELS, latent_channels=spec.z_dim, out_channels=spec.z_dim,
        text_dim=spec.text_dim, freq_dim=spec.freq_dim, ffn_dim=spec.ffn_dim, num_layers=spec.num_layers,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=spec.clip_dim,
        added_kv_proj_dim=dim, rope_max_seq_len=1024,
        motion_encoder_channel_sizes={str(s): spec.motion_channels for s in sizes},
        motion_encoder_size=spec.motion_encoder_size, motion_style_dim=spec.motion_style_dim,
        motion_dim=spec.motion_dim, motion_encoder_dim=spec.motion_encoder_dim,
        face_encoder_hidden_dim=spec.face_encoder_hidden_dim, face_encoder_num_heads=spec.face_encoder_num_heads,
        inject_face_latents_blocks=spec.inject_face_latents_blocks,
        motion_encoder_batch_size=spec.motion_encoder_batch_size,
    ).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "padding_tokens" in name or name.startswith("face_adapter.") and ".norm_" in name or \
                    name.startswith("motion_encoder.") and name.endswith("act_fn.bias"):
                param.add_(torch.randn_like(param) * 0.2)
        # at random initialisation the pose and face barely move the video: made to matter, as trained ones do
        model.pose_patch_embedding.weight.mul_(8.0)
        for adapter in model.face_adapter:
            adapter.to_out.weight.mul_(8.0)
    return model


def build_tiny_wan_animate(path: str | Path, spec: TinyWanAnimateSpec | None = None, **overrides) -> Path:
    """Write a tiny Wan2.2-Animate diffusers folder at `path` (created; must not hold a model already)."""
    from diffusers import WanAnimatePipeline

    spec = dataclasses.replace(spec or TinyWanAnimateSpec(), **overrides)
    path = Path(path)
    if (path / "model_index.json").exists():
        raise FileExistsError(f"{path} already holds a model")
    components = build_tiny_wan_i2v_components(spec)
    components["transformer"] = tiny_animate_transformer(spec, spec.seed + 4)
    WanAnimatePipeline(**components).save_pretrained(str(path), safe_serialization=True)
    return path
