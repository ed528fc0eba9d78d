"""The input image(s) as the video's known frames, for the two ways Wan conditions on them.

ImageLatentStage (Wan2.1 I2V / FLF2V, Wan2.2 I2V A14B): the image condition of a transformer taking it on the
channel axis.

    video  = [image, 0, ..., 0]  (or [image, 0, ..., 0, last_image]), F frames at the output size, in [-1, 1]
    latent = (VAE(video).mode - mean) / std                        [B, z, F', h, w]
    mask   = 1 on the given frames, 0 elsewhere; the first frame's entry repeated `temporal` times, so the F
             frames give F + temporal - 1 = temporal * F' entries, folded into `temporal` channels [B, 4, F', h, w]
    condition = [mask, latent] on the channel axis; the transformer sees [noise, condition]

FirstFrameLatentStage (Wan2.2 TI2V-5B image mode): the image VAE-encoded alone is the first latent frame itself,
held clean while the other frames are denoised (timestep 0 on its tokens: composer/stages/token_timesteps.py).
"""

from __future__ import annotations

import numpy as np
import torch

from composer.batch import ForwardBatch
from composer.stages.base import Stage
from composer.stages.image_encoding import ImageCondition
from composer.stages.latents import latent_shape
from composer.stages.start_frames import normalize_latents
from composer.stages.token_timesteps import KnownLatents, TimestepMask
from composer.stages.vae_tiling import encode_mode
from composer.stages.validators import V, VerificationResult


def image_to_pixels(image, height: int, width: int) -> torch.Tensor:
    """A PIL image -> [1, 3, height, width] fp32 in [-1, 1]: resized (Lanczos, no crop) exactly as diffusers'
    VaeImageProcessor.preprocess treats a PIL image."""
    import PIL.Image

    resized = image.resize((width, height), resample=PIL.Image.LANCZOS)
    array = np.asarray(resized, dtype=np.uint8).astype(np.float32) / 255.0
    return torch.from_numpy(array).permute(2, 0, 1).unsqueeze(0) * 2.0 - 1.0


def frame_mask(num_frames: int, temporal: int, known: list[int], height: int, width: int) -> torch.Tensor:
    """[1, temporal, F', height, width]: 1 at the known frame indices, 0 elsewhere, the first frame's entry
    repeated `temporal` times (the causal VAE keeps frame 0 alone in the first latent frame)."""
    per_frame = torch.zeros(num_frames)
    per_frame[known] = 1.0
    per_frame = torch.cat([per_frame[:1].repeat(temporal), per_frame[1:]])
    mask = per_frame.view(1, -1, 1, 1).expand(1, -1, height, width)
    return mask.reshape(1, -1, temporal, height, width).transpose(1, 2)


class ImageLatentStage(Stage):
    """VAE-encodes the condition video (the input image first, the last image last for FLF2V, zeros between) and
    builds the frame mask; writes `ImageCondition.latents` for every batch row."""

    def __init__(self, vae: torch.nn.Module, temporal_factor: int, spatial_factor: int, device: torch.device):
        self.vae = vae
        self.tile_size: int | None = None  # RuntimeArgs.vae_tile_size (the pipeline sets it): exact tiled encode
        self.temporal_factor = temporal_factor
        self.spatial_factor = spatial_factor
        self.device = device

    def verify_input(self, batch: ForwardBatch, result: VerificationResult) -> None:
        result.add_check("image", batch.get(ImageCondition, None), V.not_none)
        if batch.get(ImageCondition, None) is not None and batch.get(ImageCondition).last_image is not None:
            result.add_check("num_frames", batch.num_frames, V.int_in_range(2, 10**6))

    def verify_output(self, batch: ForwardBatch, result: VerificationResult) -> None:
        z = self.vae.config.z_dim
        shape = latent_shape(batch.batch_size, self.temporal_factor + z, batch.num_frames, batch.height, batch.width,
                             self.temporal_factor, self.spatial_factor)
        result.add_check("image_latents", batch.get(ImageCondition).latents, V.shape(shape),
                         V.dtype_in(torch.float32), V.all_finite)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        condition = batch.get(ImageCondition)
        frames, height, width = batch.num_frames, batch.height, batch.width
        video = torch.zeros(1, 3, frames, height, width)
        video[:, :, 0] = image_to_pixels(condition.image, height, width)
        known = [0]
        if condition.last_image is not None:
            video[:, :, -1] = image_to_pixels(condition.last_image, height, width)
            known.append(frames - 1)
        video = video.to(self.vae.device, self.vae.dtype)
        mu = encode_mode(self.vae, video, self.tile_size)
        latents = normalize_latents(mu.to(self.device, torch.float32), self.vae.config)
        h, w = latents.shape[-2:]
        mask = frame_mask(frames, self.temporal_factor, known, h, w).to(self.device)
        row = torch.cat([mask, latents], dim=1)
        condition.latents = row.expand(batch.batch_size, -1, -1, -1, -1)  # the same image for every row
        return batch


class FirstFrameLatentStage(Stage):
    """TI2V image mode: `(VAE(image).mode - mean) / std` [1, z, 1, h, w] is the first latent frame: attaches
    `KnownLatents` (frame 0 kept), a `TimestepMask` with frame 0 zeroed on the token grid (latent grid / patch
    size), and puts the image latents into the initial noise. Skipped for a request without an image
    (text-to-video)."""

    def __init__(self, vae: torch.nn.Module, patch_size: tuple[int, int, int]):
        self.vae = vae
        self.tile_size: int | None = None  # RuntimeArgs.vae_tile_size (the pipeline sets it): exact tiled encode
        self.patch_size = tuple(patch_size)

    def skips(self, batch: ForwardBatch) -> bool:
        return batch.get(ImageCondition, None) is None

    def verify_input(self, batch: ForwardBatch, result: VerificationResult) -> None:
        result.add_check("image", batch.get(ImageCondition, None), V.not_none)
        result.add_check("latents", batch.latents, V.ndim(5))

    def verify_output(self, batch: ForwardBatch, result: VerificationResult) -> None:
        shape = [1, self.vae.config.z_dim, 1, *batch.latents.shape[-2:]]
        result.add_check("image_latents", batch.get(ImageCondition).latents, V.shape(shape),
                         V.dtype_in(torch.float32), V.all_finite)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        condition = batch.get(ImageCondition)
        pixels = image_to_pixels(condition.image, batch.height, batch.width).unsqueeze(2)  # [1, 3, 1, H, W]
        mu = encode_mode(self.vae, pixels.to(self.vae.device, self.vae.dtype), self.tile_size)
        condition.latents = normalize_latents(mu.to(batch.latents.device, torch.float32), self.vae.config)
        _, _, frames, h, w = batch.latents.shape
        denoised = torch.ones(1, 1, frames, h, w, dtype=torch.bool, device=batch.latents.device)
        denoised[:, :, 0] = False
        known = KnownLatents(condition.latents, denoised)
        pt, ph, pw = self.patch_size
        batch.attach(known)
        batch.attach(TimestepMask(denoised[:, 0, ::pt, ::ph, ::pw].float().cpu()))
        batch.latents = known.apply(batch.latents)
        return batch
