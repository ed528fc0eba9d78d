"""Wan2.2-Animate DiT (diffusers' `WanAnimateTransformer3DModel`): the Wan2.1 image-to-video DiT plus a pose input and
face motion, loading diffusers' weights unchanged.

    x      = patchify([noise | reference mask + latents], 36 channels)            [B, D, F + 1, h, w]
    x[:, :, 1:] += pose_patch_embedding(pose latents)                              (the reference frame takes none)
    face   = face_encoder(motion_encoder(face frames))   + a zero frame first      [B, F + 1, heads + 1, D]
    for each Wan block i:
        x = WanBlock_i(x)
        x = x + face_adapter_{i / k}(x, face)   after every k-th block (k = inject_face_latents_blocks)

A face adapter is a cross-attention from each latent frame's tokens to that frame's face tokens only. The motion
encoder (a StyleGAN-like conv net per face frame, then a linear motion decomposition) and the face encoder (causal
1D convs over time, 4x down) turn S face frames into ceil(S / 4) = F latent frames of tokens. Both depend on the face
frames alone, so the pipeline encodes them once per segment (`encode_face`) and passes `face_motion`; diffusers
encodes them again at every step, with the same result.

Through the Wan DiT's seams: the face adapters are `block_residuals` computed from the stream after their block, so
sequence parallelism (each rank attends its part of every frame to that frame's face tokens, which every rank
holds whole), step caches and the hooks act on them without code here. The pose rides into `patchify` on the
channel axis after the model's own input channels (`forward` puts it there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from composer.errors import InvalidInputError, ModelFormatError, UnsupportedError
from composer.models.attention import Attention
from composer.models.wan.config import WanTransformerConfig
from composer.models.wan.transformer import WanTransformer3DModel

# diffusers' WAN_ANIMATE_MOTION_ENCODER_CHANNEL_SIZES: the motion encoder's channels at each feature size
MOTION_CHANNELS = {"4": 512, "8": 512, "16": 512, "32": 512, "64": 256, "128": 128, "256": 64, "512": 32, "1024": 16}
BLUR_KERNEL = (1, 3, 3, 1)


@dataclass
class WanAnimateTransformerConfig(WanTransformerConfig):
    """WanTransformerConfig (diffusers' `WanAnimateTransformer3DModel` defaults where they differ) plus its own keys:
    the pose latents' channels (`latent_channels`; the input is the noise, the reference mask and latents: 2 x 16 +
    4), the motion encoder's (face frames of `motion_encoder_size` pixels a side), the face encoder's, and
    `inject_face_latents_blocks`, the face adapter after every k-th block."""

    in_channels: int = 36
    image_dim: int | None = 1280
    latent_channels: int = 16
    motion_encoder_channel_sizes: dict[str, int] | None = None
    motion_encoder_size: int = 512
    motion_style_dim: int = 512
    motion_dim: int = 20
    motion_encoder_dim: int = 512
    face_encoder_hidden_dim: int = 1024
    face_encoder_num_heads: int = 4
    inject_face_latents_blocks: int = 5
    motion_encoder_batch_size: int = 8

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "the transformer config") -> WanAnimateTransformerConfig:
        """diffusers' config: either of `in_channels` / `latent_channels` may be null (in = 2 x latent + 4), and
        `out_channels` null means `latent_channels`."""
        raw = dict(raw)
        latent, channels = raw.get("latent_channels"), raw.get("in_channels")
        if latent is None and isinstance(channels, int):
            raw["latent_channels"] = latent = (channels - 4) // 2
        elif channels is None and isinstance(latent, int):
            raw["in_channels"] = 2 * latent + 4
        if not raw.get("out_channels") and isinstance(latent, int):
            raw["out_channels"] = latent
        return super().from_dict(raw, source)

    @property
    def motion_channels(self) -> dict[str, int]:
        return self.motion_encoder_channel_sizes or MOTION_CHANNELS

    def check_supported(self) -> None:
        super().check_supported()
        if self.in_channels != 2 * self.latent_channels + 4:
            raise ModelFormatError(f"in_channels = {self.in_channels}: a Wan Animate transformer takes 2 x "
                                   f"latent_channels + 4 = {2 * self.latent_channels + 4} (the noise, the reference "
                                   "latents and their 4-channel mask)")
        if self.image_dim is None:
            raise UnsupportedError("a Wan Animate transformer without image_dim: composer runs it with the character "
                                   "image's CLIP tokens in cross-attention (image_dim and added_kv_proj_dim set)")
        if self.num_layers % self.inject_face_latents_blocks:
            raise ModelFormatError(f"num_layers = {self.num_layers} is not a multiple of inject_face_latents_blocks "
                                   f"= {self.inject_face_latents_blocks} (one face adapter after every "
                                   f"{self.inject_face_latents_blocks}th block: diffusers' model cannot run it either)")
        size = self.motion_encoder_size
        needed = [str(2**i) for i in range(2, int(math.log2(size)) + 1)] if size >= 4 else []
        if size < 4 or 2 ** int(math.log2(size)) != size or any(k not in self.motion_channels for k in needed):
            raise ModelFormatError(f"motion_encoder_size = {size}: expected a power of 2 >= 4 whose feature sizes "
                                   f"{', '.join(needed)} all have channels in motion_encoder_channel_sizes")


# -- the motion encoder: face frames -> motion vectors -------------------------------------------------------------
class ScaledLeakyReLU(nn.Module):
    """x + bias (per channel), leaky ReLU (0.2), times sqrt(2): diffusers' `FusedLeakyReLU`."""

    def __init__(self, channels: int):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = [1, -1] + [1] * (x.ndim - 2)
        return F.leaky_relu(x + self.bias.reshape(shape), 0.2) * 2**0.5


class MotionConv2d(nn.Module):
    """A conv with its weight scaled by 1 / sqrt(fan in), optionally after a blur (a [1, 3, 3, 1] FIR filter, per
    channel) and before a ScaledLeakyReLU (which then holds the bias): diffusers' `MotionConv2d`."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, padding: int = 0,
                 bias: bool = True, blur: bool = False, activation: bool = True):
        super().__init__()
        self.in_channels, self.stride, self.padding = in_channels, stride, padding
        self.blur_padding = None
        if blur:
            p = (len(BLUR_KERNEL) - stride) + (kernel_size - 1)
            self.blur_padding = ((p + 1) // 2, p // 2)  # as diffusers passes it: (rows, columns), both sides
        self.weight = nn.Parameter(torch.randn(out_channels, in_channels, kernel_size, kernel_size))
        self.scale = 1 / math.sqrt(in_channels * kernel_size**2)
        self.bias = nn.Parameter(torch.zeros(out_channels)) if bias and not activation else None
        self.act_fn = ScaledLeakyReLU(out_channels) if activation else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blur_padding is not None:
            kernel = torch.tensor(BLUR_KERNEL, device=x.device)
            kernel = kernel[None, :] * kernel[:, None]
            kernel = (kernel / kernel.sum()).to(x.dtype)
            x = F.conv2d(x, kernel.expand(self.in_channels, 1, -1, -1), padding=self.blur_padding,
                         groups=self.in_channels)
        x = F.conv2d(x.to(self.weight.dtype), self.weight * self.scale, self.bias, self.stride, self.padding)
        return x if self.act_fn is None else self.act_fn(x)


class MotionLinear(nn.Module):
    """A linear layer with its weight scaled by 1 / sqrt(in features): diffusers' `MotionLinear`."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_dim, in_dim))
        self.bias = nn.Parameter(torch.zeros(out_dim))
        self.scale = 1 / math.sqrt(in_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight * self.scale, self.bias)


class MotionResBlock(nn.Module):
    """conv 3x3 -> blurred conv 3x3, stride 2, beside a blurred 1x1 stride-2 skip; the sum over sqrt(2)."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.conv1 = MotionConv2d(in_channels, in_channels, 3, padding=1)
        self.conv2 = MotionConv2d(in_channels, out_channels, 3, stride=2, blur=True)
        self.conv_skip = MotionConv2d(in_channels, out_channels, 1, stride=2, bias=False, blur=True, activation=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.conv2(self.conv1(x)) + self.conv_skip(x)) / math.sqrt(2)


class WanAnimateMotionEncoder(nn.Module):
    """Face frames [N, 3, size, size] -> motion vectors [N, motion_encoder_dim]: convs down to 4 x 4, a 4 x 4 conv to
    the style vector, linear layers to `motion_dim` coefficients, and their combination of the orthonormalised
    (QR, fp32) `motion_synthesis_weight` directions."""

    def __init__(self, config: WanAnimateTransformerConfig):
        super().__init__()
        channels, size = config.motion_channels, config.motion_encoder_size
        self.size = size
        self.conv_in = MotionConv2d(3, channels[str(size)], 1)
        sizes = [2**i for i in range(int(math.log2(size)), 2, -1)]
        self.res_blocks = nn.ModuleList([MotionResBlock(channels[str(s)], channels[str(s // 2)]) for s in sizes])
        style = config.motion_style_dim
        self.conv_out = MotionConv2d(channels["4"], style, 4, bias=False, activation=False)
        # no activations between them, as in the release
        self.motion_network = nn.ModuleList([MotionLinear(style, style) for _ in range(4)]
                                            + [MotionLinear(style, config.motion_dim)])
        self.motion_synthesis_weight = nn.Parameter(torch.randn(config.motion_encoder_dim, config.motion_dim))

    def forward(self, faces: torch.Tensor) -> torch.Tensor:
        if tuple(faces.shape[-2:]) != (self.size, self.size):
            raise InvalidInputError(f"face frames of {faces.shape[-1]}x{faces.shape[-2]} pixels: this motion encoder "
                                    f"takes {self.size}x{self.size}")
        x = self.conv_in(faces)
        for block in self.res_blocks:
            x = block(x)
        feat = self.conv_out(x).squeeze(-1).squeeze(-1)
        for linear in self.motion_network:
            feat = linear(feat)
        dtype = feat.dtype
        q = torch.linalg.qr((self.motion_synthesis_weight + 1e-8).float())[0].to(feat.device)
        # sum_i feat_i * q_i, summed as diffusers sums it (a diagonal matmul, then the sum): the same fp32 bits
        return torch.matmul(torch.diag_embed(feat.float()), q.T).sum(dim=1).to(dtype)


class WanAnimateFaceEncoder(nn.Module):
    """Motion vectors [B, S, motion_encoder_dim] -> face tokens [B, ceil(S / 4), heads + 1, D]: a causal conv to
    `heads` streams, two causal stride-2 convs (LayerNorm, SiLU after each), a projection to the model width, and one
    learned padding token per frame."""

    def __init__(self, config: WanAnimateTransformerConfig):
        super().__init__()
        hidden, heads, eps = config.face_encoder_hidden_dim, config.face_encoder_num_heads, config.eps
        self.num_heads = heads
        self.conv1_local = nn.Conv1d(config.motion_encoder_dim, hidden * heads, 3)
        self.conv2 = nn.Conv1d(hidden, hidden, 3, stride=2)
        self.conv3 = nn.Conv1d(hidden, hidden, 3, stride=2)
        self.norm1, self.norm2, self.norm3 = (nn.LayerNorm(hidden, eps, elementwise_affine=False) for _ in range(3))
        self.out_proj = nn.Linear(hidden, config.hidden_size)
        self.padding_tokens = nn.Parameter(torch.zeros(1, 1, 1, config.hidden_size))

    def forward(self, motion: torch.Tensor) -> torch.Tensor:
        rows = motion.shape[0]
        x = self.conv1_local(F.pad(motion.transpose(1, 2), (2, 0), mode="replicate"))  # causal in time
        x = x.unflatten(1, (self.num_heads, -1)).flatten(0, 1)  # [B * heads, hidden, S]
        x = F.silu(self.norm1(x.transpose(1, 2)))
        for conv, norm in ((self.conv2, self.norm2), (self.conv3, self.norm3)):
            x = F.silu(norm(conv(F.pad(x.transpose(1, 2), (2, 0), mode="replicate")).transpose(1, 2)))
        x = self.out_proj(x).unflatten(0, (rows, -1)).transpose(1, 2)  # [B, T, heads, D]
        return torch.cat([x, self.padding_tokens.expand(rows, x.shape[1], 1, -1).to(x.device)], dim=2)


# -- the face adapter ----------------------------------------------------------------------------------------------
class WanAnimateFaceAdapter(nn.Module):
    """Cross-attention from each latent frame's tokens to that frame's face tokens (LayerNorms before, an RMSNorm
    per head on q and k): diffusers' `WanAnimateFaceBlockCrossAttention`."""

    def __init__(self, dim: int, num_heads: int, eps: float):
        super().__init__()
        self.head_dim = dim // num_heads  # heads are counted from the projections' width: a TP rank holds some
        self.pre_norm_q = nn.LayerNorm(dim, eps, elementwise_affine=False)
        self.pre_norm_kv = nn.LayerNorm(dim, eps, elementwise_affine=False)
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.Linear(dim, dim)
        self.norm_q = nn.RMSNorm(self.head_dim, eps=eps)
        self.norm_k = nn.RMSNorm(self.head_dim, eps=eps)
        self.attention = Attention(role="cross")

    def forward(self, x: torch.Tensor, face: torch.Tensor) -> torch.Tensor:
        """x [B, T * n, D] (n tokens of each of T frames: this rank's part of each under sequence parallelism), face
        [B, T, m, D] -> the residual [B, T * n, D]."""
        rows, frames, per_frame, _ = face.shape
        q = self.norm_q(self.to_q(self.pre_norm_q(x)).unflatten(2, (-1, self.head_dim)))
        kv = self.pre_norm_kv(face).flatten(1, 2)
        k = self.norm_k(self.to_k(kv).unflatten(2, (-1, self.head_dim)))
        v = self.to_v(kv).unflatten(2, (-1, self.head_dim))
        q = q.unflatten(1, (frames, -1)).flatten(0, 1)  # [B * T, n, heads, d]: a frame's tokens, its own batch row
        k, v = (t.unflatten(1, (frames, per_frame)).flatten(0, 1) for t in (k, v))
        out = self.attention(q, k, v).flatten(2).type_as(q)
        return self.to_out(out.unflatten(0, (rows, frames)).flatten(1, 2))


def _animate_plan(plan: dict[str, str]) -> dict[str, str]:
    """The Wan blocks' tensor-parallel plan and the face adapters' attention (their per-head norms replicated)."""
    return {**plan, r"^face_adapter\.\d+\.to_[qkv]$": "column", r"^face_adapter\.\d+\.to_out$": "row"}


class WanAnimateTransformer3DModel(WanTransformer3DModel):
    """Wan2.2-Animate DiT. Called as diffusers' model is: hidden_states [B, 2z + 4, F + 1, H, W] (the noise, then the
    reference mask and latents), `pose_hidden_states` [B, z, F, H, W] and the face frames `face_pixel_values` [B, 3,
    S, size, size] in [-1, 1]; or `face_motion` [B, F + 1, heads + 1, D] from `encode_face` instead of the frames."""

    class_names = ("WanAnimateTransformer3DModel",)
    config_class = WanAnimateTransformerConfig
    keep_in_fp32 = (*WanTransformer3DModel.keep_in_fp32, r"^motion_encoder\.motion_synthesis_weight$")
    tensor_parallel_plan = _animate_plan(WanTransformer3DModel.tensor_parallel_plan)

    def __init__(self, config: WanAnimateTransformerConfig):
        super().__init__(config)
        dim = config.hidden_size
        self.pose_patch_embedding = nn.Conv3d(config.latent_channels, dim, kernel_size=config.patch_size,
                                              stride=config.patch_size)
        self.motion_encoder = WanAnimateMotionEncoder(config)
        self.face_encoder = WanAnimateFaceEncoder(config)
        self.face_adapter = nn.ModuleList(
            [WanAnimateFaceAdapter(dim, config.num_attention_heads, config.eps)
             for _ in range(config.num_layers // config.inject_face_latents_blocks)])

    def encode_face(self, face_pixel_values: torch.Tensor, batch_size: int | None = None) -> torch.Tensor:
        """Face frames [B, 3, S, size, size] in [-1, 1] -> face tokens [B, ceil(S / 4) + 1, heads + 1, D] (a zero
        frame first, for the reference frame). The motion encoder runs `batch_size` frames at a time (default: the
        config's `motion_encoder_batch_size`): memory against speed, the same result."""
        rows, channels, frames = face_pixel_values.shape[:3]
        faces = face_pixel_values.transpose(1, 2).flatten(0, 1).to(self.dtype)  # [B * S, 3, size, size]
        size = batch_size or self.config.motion_encoder_batch_size
        motion = torch.cat([self.motion_encoder(part) for part in torch.split(faces, size)])
        face = self.face_encoder(motion.view(rows, frames, -1))
        return torch.cat([torch.zeros_like(face[:, :1]), face], dim=1)

    def variant_inputs(self, hidden_states: torch.Tensor, pose_hidden_states: torch.Tensor | None = None,
                       face_pixel_values: torch.Tensor | None = None, motion_encode_batch_size: int | None = None, *,
                       face_motion: torch.Tensor | None = None, frame_offset: int, attn_mask: torch.Tensor | None,
                       kv_cache) -> tuple[torch.Tensor, dict]:
        """forward's own inputs (diffusers' names and order, after encoder_hidden_states_image, which holds the
        character image's CLIP states unless `cross_kv` holds them): the pose latents and the face frames (or their
        `face_motion` tokens). Not causal."""
        if kv_cache is not None or attn_mask is not None or frame_offset:
            raise UnsupportedError("a Wan Animate transformer runs whole segments: it takes no kv_cache, attn_mask or "
                                   "frame_offset")
        rows, _, frames, height, width = hidden_states.shape
        expected = (rows, self.config.latent_channels, frames - 1, height, width)
        if pose_hidden_states is None or tuple(pose_hidden_states.shape) != expected:
            shape = None if pose_hidden_states is None else list(pose_hidden_states.shape)
            raise InvalidInputError(f"pose_hidden_states of shape {shape}: expected {list(expected)} (the pose latents: "
                                    "one frame fewer than hidden_states, whose first is the reference image's)")
        if face_motion is None:
            if face_pixel_values is None:
                raise InvalidInputError("a Wan Animate transformer needs the face frames (face_pixel_values) or their "
                                        "face_motion tokens")
            face_motion = self.encode_face(face_pixel_values, motion_encode_batch_size)
        if tuple(face_motion.shape[:2]) != (rows, frames):
            raise InvalidInputError(f"face motion of {face_motion.shape[1]} frames for {frames} latent frames: the "
                                    "face video must have the segment's length (4k + 1 frames give k + 1 latent "
                                    "frames, and the reference frame one more)")
        pose = F.pad(pose_hidden_states.to(hidden_states.dtype), (0, 0, 0, 0, 1, 0))  # none for the reference frame
        return torch.cat([hidden_states, pose], dim=1), {"face_motion": face_motion}

    def patchify(self, latents: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """[B, in_channels + latent_channels, F, H, W] (the model's input, then the pose latents after a zero frame)
        -> tokens [B, S, D], the pose's patch embedding added to every frame but the first, as diffusers adds it."""
        channels = self.config.in_channels
        x = self.patch_embedding(latents[:, :channels])
        pose = self.pose_patch_embedding(latents[:, channels:, 1:])
        x = torch.cat([x[:, :, :1], x[:, :, 1:] + pose], dim=2)
        return x.flatten(2).transpose(1, 2).contiguous(), tuple(x.shape[2:])

    def block_residuals(self, x, *, contexts, timestep_proj, rotary, token_grid, image, split, face_motion=None):
        """After every k-th block, its face adapter's output for the stream there (a function of it)."""
        every = self.config.inject_face_latents_blocks
        return {i: lambda h, adapter=self.face_adapter[i // every]: adapter(h, face_motion)
                for i in range(0, len(self.blocks), every)}


EntryClass = WanAnimateTransformer3DModel
