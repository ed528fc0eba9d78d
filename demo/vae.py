"""The demo model's VAE: a small diffusers AutoencoderKLWan, built, trained on the synthetic frames and used to
encode the clips the DiTs learn from; the latent mean/std are measured on the data and written into its config,
as the released Wan VAE carries them."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F

from demo.train import Log, Progress, TrainConfig, cosine_lr, make_clips, optimizer_step, to_pixels


def decode_unclamped(vae, z: torch.Tensor) -> torch.Tensor:
    """diffusers' Wan VAE decode loop without its final clamp to [-1, 1], whose zero gradient stalls training
    once the decoder saturates."""
    vae.clear_cache()
    x = vae.post_quant_conv(z)
    out = []
    for i in range(z.shape[2]):
        vae._conv_idx = [0]
        out.append(vae.decoder(x[:, :, i:i + 1], feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=i == 0))
    vae.clear_cache()
    return torch.cat(out, dim=2)


def reconstruction_loss(recon: torch.Tensor, target: torch.Tensor, foreground_weight: float) -> torch.Tensor:
    """MSE + L1/2, weighted up where the target differs from its clip's background (the objects are a few
    percent of the pixels; unweighted, "draw the background" is a deep plateau)."""
    background = target[:, :, :1, :1, :1]
    foreground = ((target - background).abs().amax(dim=1, keepdim=True) > 0.1).float()
    weight = 1 + foreground_weight * foreground
    error = recon - target
    return (error.pow(2) * weight).mean() + 0.5 * (error.abs() * weight).mean()


def _vae_batch(step: int, cfg: TrainConfig, rng: np.random.Generator) -> torch.Tensor:
    """Pixels for a VAE step of the curriculum: images, cropped clips, then full clips."""
    if step < cfg.vae_image_steps:
        return to_pixels(make_clips(cfg.vae_image_batch, 1, cfg, rng)[0])
    if step < cfg.vae_image_steps + cfg.vae_crop_steps:
        x = to_pixels(make_clips(cfg.vae_crop_batch, cfg.vae_crop_frames, cfg, rng)[0])
        top, left = rng.integers(0, cfg.size - cfg.vae_crop_size + 1, size=2)
        return x[..., top:top + cfg.vae_crop_size, left:left + cfg.vae_crop_size]
    return to_pixels(make_clips(cfg.vae_full_batch, cfg.frames, cfg, rng)[0])


def new_vae(cfg: TrainConfig):
    """A Wan VAE with 4x temporal and `cfg.vae_spatial` spatial compression (one 2x stage per factor)."""
    from diffusers import AutoencoderKLWan

    from composer.testing.tiny_wan import wan_vae_layout

    dim_mult, temporal = wan_vae_layout(cfg.vae_spatial)
    return AutoencoderKLWan(
        base_dim=cfg.vae_base_dim, z_dim=cfg.z_dim, dim_mult=dim_mult, num_res_blocks=1, attn_scales=[],
        temperal_downsample=temporal, latents_mean=[0.0] * cfg.z_dim, latents_std=[1.0] * cfg.z_dim,
        scale_factor_spatial=cfg.vae_spatial, scale_factor_temporal=4,
    )


@torch.no_grad()
def inflate_temporal_identity(vae) -> None:
    """Make the VAE's video path start as its image path, as video VAEs are initialised from image weights:
    every causal 3D conv looks only at the current frame (past-frame taps zeroed), temporal downsampling keeps
    the newest frame and temporal upsampling copies frames. A 4-frame chunk then encodes as its last frame and
    decodes as four copies of it; training on clips only has to learn the motion inside a chunk."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, WanResample

    for module in vae.modules():
        if isinstance(module, WanCausalConv3d) and module.kernel_size[0] > 1:
            module.weight[:, :, :-1] = 0
            module.weight[:, :, -1] *= math.sqrt(module.kernel_size[0])  # keep the initial output scale
    for module in vae.modules():
        if isinstance(module, WanResample) and module.mode in ("upsample3d", "downsample3d"):
            conv = module.time_conv
            conv.weight.zero_()
            conv.bias.zero_()
            channels = conv.weight.shape[1]
            eye = torch.eye(channels)
            for half in range(conv.weight.shape[0] // channels):  # upsampling writes two frames: copy into both
                conv.weight[half * channels:(half + 1) * channels, :, -1, 0, 0] = eye


def _single_frame_conv_forward(conv, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
    """WanCausalConv3d.forward, computed as a 2D convolution when the input is one frame with no cache: the
    causal padding puts zeros before it, so only the last temporal tap contributes (the conv3d spends the other
    taps' work on the zeros). The same sum, and the same gradients: the other taps' are zero either way."""
    k_t = conv.kernel_size[0]
    if cache_x is not None or x.shape[2] != 1 or conv.stride[0] != 1 or conv._padding[4] != k_t - 1:
        return type(conv).forward(conv, x, cache_x)
    pad_w, _, pad_h, _ = conv._padding[:4]
    y = F.conv2d(x[:, :, 0], conv.weight[:, :, -1], conv.bias, stride=conv.stride[1:], padding=(pad_h, pad_w),
                 dilation=conv.dilation[1:], groups=conv.groups)
    return y.unsqueeze(2)


@contextmanager
def single_frame_convs(vae) -> Iterator[None]:
    """Within this context the VAE's causal 3D convolutions take the 2D path for single uncached frames
    (3x fewer operations per conv; the image phase of training, where every input is one frame, runs 2.1x
    faster)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    convs = [m for m in vae.modules() if isinstance(m, WanCausalConv3d)]
    for conv in convs:
        conv.forward = _single_frame_conv_forward.__get__(conv)
    try:
        yield
    finally:
        for conv in convs:
            del conv.forward


def train_vae(cfg: TrainConfig, log: Log = print, init=None, first_step: int = 0, device: str = "cpu"):
    """Train (or, with `init`, continue training from `first_step` of the curriculum) a Wan VAE on `device`."""
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    vae = init or new_vae(cfg)
    if init is None:
        inflate_temporal_identity(vae)
    vae.to(device)
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.vae_lr, weight_decay=0.0)
    total = cfg.vae_image_steps + cfg.vae_crop_steps + cfg.vae_full_steps
    progress = Progress("vae", total, log)
    vae.train().requires_grad_(True)
    with single_frame_convs(vae):
        for step in range(first_step, total):
            x = _vae_batch(step, cfg, rng).to(device)
            posterior = vae.encode(x).latent_dist
            recon = decode_unclamped(vae, posterior.sample())
            loss = reconstruction_loss(recon, x, cfg.vae_foreground_weight) + cfg.vae_kl_weight * posterior.kl().mean()
            optimizer_step(opt, loss, cosine_lr(step, total, cfg.vae_lr))
            progress.step(step, loss.item())
    return vae.eval().requires_grad_(False)


@torch.no_grad()
def encode_latents(vae, clips: np.ndarray, batch: int = 16) -> torch.Tensor:
    """Posterior means [N, C, F, h, w] of uint8 clips (not normalised)."""
    out = []
    with single_frame_convs(vae):
        for i in range(0, len(clips), batch):
            out.append(vae.encode(to_pixels(clips[i:i + batch]).to(vae.device)).latent_dist.mode().cpu())
    return torch.cat(out)


def set_latent_stats(vae, latents: torch.Tensor) -> None:
    """Measure per-channel mean/std over the data and record them in the VAE config."""
    mean = latents.mean(dim=(0, 2, 3, 4))
    std = latents.std(dim=(0, 2, 3, 4)).clamp_min(1e-3)
    vae.register_to_config(latents_mean=[round(float(m), 5) for m in mean],
                           latents_std=[round(float(s), 5) for s in std])


def normalize(latents: torch.Tensor, vae) -> torch.Tensor:
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    return (latents - mean) / std
