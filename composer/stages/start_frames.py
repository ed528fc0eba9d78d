"""StartFrameEncodingStage: frames a request starts from (an image, or a video to continue) -> latents."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from composer.batch import ForwardBatch
from composer.errors import InvalidInputError
from composer.stages.base import Stage
from composer.stages.vae_tiling import encode_mode
from composer.stages.validators import V, Validator, VerificationResult


@dataclass
class StartFrames:
    """Frames a request starts from (an image, or the end of a video to continue): uint8 [T, H, W, 3], T = 4k+1."""

    frames: np.ndarray


# read_frames gives these for every file; a caller attaching its own frames gets this rule, not a conv error
_RGB_FRAMES = Validator("uint8 RGB frames [T, H, W, 3]",
                        lambda f: f.dtype == np.uint8 and f.ndim == 4 and f.shape[-1] == 3 and min(f.shape) > 0)


def read_start_frames(start_image: Any = None, start_video: Any = None, temporal: int = 4) -> np.ndarray | None:
    """A causal request's start frames: `start_image` (an image file, PIL image or uint8 array: one frame) or the
    last 4k+1 frames of `start_video` (a video file, uint8 frames [T, H, W, 3] or a list of frames); None without
    either. InvalidInputError naming the field when a value does not load."""
    import os

    from composer.images import load_image
    from composer.video import read_frames, read_video_frames

    if _given(start_image) and _given(start_video):
        raise InvalidInputError("give start_image or start_video, not both")
    if _given(start_image):
        if isinstance(start_image, (str, os.PathLike)):
            return read_frames(start_image)[:1]
        return np.array(load_image(start_image, "start_image"))[None]  # writable (torch.from_numpy)
    if not _given(start_video):
        return None
    if isinstance(start_video, (str, os.PathLike)):
        frames = read_frames(start_video)
    else:
        frames = np.stack([np.asarray(f) for f in read_video_frames(start_video, "start_video")])
    usable = (len(frames) - 1) // temporal * temporal + 1
    return np.ascontiguousarray(frames[len(frames) - usable:])


def _given(value: Any) -> bool:
    """A start input is given: not None and not an empty path (arrays have no truth value)."""
    return value is not None and not (isinstance(value, str) and not value)


def normalize_latents(latents: torch.Tensor, vae_config) -> torch.Tensor:
    """The inverse of decoding's denormalization: (mu - mean) / std per channel."""
    shape = (1, -1) + (1,) * (latents.ndim - 2)
    mean = torch.tensor(vae_config.latents_mean).view(shape).to(latents.device, latents.dtype)
    inv_std = 1.0 / torch.tensor(vae_config.latents_std).view(shape).to(latents.device, latents.dtype)
    return (latents - mean) * inv_std


def resize_frames(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [T, h, w, 3] -> [T, height, width, 3]: scale to cover, then center-crop."""
    t, h, w, _ = frames.shape
    if (h, w) == (height, width):
        return frames
    scale = max(height / h, width / w)
    x = torch.from_numpy(frames).permute(0, 3, 1, 2).float()
    x = F.interpolate(x, size=(max(height, round(h * scale)), max(width, round(w * scale))),
                      mode="bilinear", antialias=True, align_corners=False)
    top, left = (x.shape[2] - height) // 2, (x.shape[3] - width) // 2
    x = x[:, :, top:top + height, left:left + width]
    return x.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()


class StartFrameEncodingStage(Stage):
    """Encodes the request's StartFrames with the VAE (posterior mean, normalized) into `start_latents`."""

    def __init__(self, vae: torch.nn.Module):
        self.vae = vae
        self.tile_size: int | None = None  # RuntimeArgs.vae_tile_size (the pipeline sets it): exact tiled encode

    def verify_input(self, batch: ForwardBatch, result: VerificationResult) -> None:
        start = batch.get(StartFrames, None)
        if start is not None:
            result.add_check("start_frames", np.asarray(start.frames), _RGB_FRAMES)

    def verify_output(self, batch: ForwardBatch, result: VerificationResult) -> None:
        if batch.get(StartFrames, None) is not None:
            result.add_check("start_latents", batch.start_latents, V.ndim(5))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        start = batch.get(StartFrames, None)
        if start is None:
            return batch
        frames = resize_frames(np.asarray(start.frames), batch.height, batch.width)
        pixels = torch.from_numpy(frames).permute(3, 0, 1, 2).unsqueeze(0)  # [1, 3, T, H, W]
        pixels = (pixels.to(self.vae.device, self.vae.dtype) / 127.5 - 1.0).expand(batch.batch_size, -1, -1, -1, -1)
        mu = encode_mode(self.vae, pixels, self.tile_size)
        batch.start_latents = normalize_latents(mu, self.vae.config).float()
        return batch
