"""The clean frames a diffusion-forcing request (SkyReels-V2 DF) gives the sampler, as diffusers' three DF pipelines
take them from one folder:

- **image-to-video** (`SkyReelsV2DiffusionForcingImageToVideoPipeline`): the image, resized to the output size
  (Lanczos), VAE-encoded alone, is the first window's first latent frame; a `last_image`, encoded in the same VAE call
  (a batch of two single frames, as diffusers encodes them), is appended after the last window's frames, fed clean at
  timestep 0, never stepped, and dropped before decoding.
- **video-to-video** (`SkyReelsV2DiffusionForcingVideoToVideoPipeline`: extending a video): the video's last
  `overlap_history` frames, resized and VAE-encoded together, are the first window's clean prefix (cut to whole causal
  blocks); the result is the input video (resized) followed by the `num_frames` decoded frames, whose first ones
  re-make the overlap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from composer.batch import ForwardBatch
from composer.images import load_image
from composer.stages.base import Stage
from composer.stages.image_latents import image_to_pixels
from composer.stages.start_frames import normalize_latents
from composer.stages.vae_tiling import encode_mode
from composer.stages.validators import V, VerificationResult
from composer.video import read_video_frames


@dataclass(eq=False)
class ForcingInputs:
    """A request's input image(s) or video (PIL) and, after `ForcingInputStage`, their normalized latents
    [1, z, n, h, w] fp32: `start`, the first window's clean prefix (the image's frame, or the video's overlap's
    frames); `end`, the last image's frame (None without one)."""

    image: Any = None
    last_image: Any = None
    video: list | None = None  # the video to extend: its frames
    overlap_history: int = 0  # video frames encoded as the prefix (the last ones)
    start: torch.Tensor | None = None
    end: torch.Tensor | None = None

    @classmethod
    def from_request(cls, sampling: Any) -> ForcingInputs | None:
        """The request's `image` / `last_image` or `video` read (InvalidInputError naming the field); None for
        text-to-video. Which combinations run is `forcing_problems`' to say, before this."""
        image, last, video = (getattr(sampling, name, None) for name in ("image", "last_image", "video"))
        if image is None and last is None and video is None:
            return None
        return cls(image=None if image is None else load_image(image, "image"),
                   last_image=None if last is None else load_image(last, "last_image"),
                   video=None if video is None else read_video_frames(video),
                   overlap_history=int(getattr(sampling, "overlap_history", None) or 0))

    def pixels(self, height: int, width: int) -> torch.Tensor:
        """What the VAE encodes, [n, 3, t, H, W] in [-1, 1]: the image (and last image) as single frames, or the
        video's last `overlap_history` frames as one clip."""
        if self.video is not None:
            clip = self.video[-self.overlap_history:]
            return torch.stack([image_to_pixels(f, height, width)[0] for f in clip], dim=1).unsqueeze(0)
        images = [self.image] + ([self.last_image] if self.last_image is not None else [])
        return torch.cat([image_to_pixels(i, height, width) for i in images]).unsqueeze(2)


def resized_frames(frames: list, height: int, width: int) -> np.ndarray:
    """uint8 [T, height, width, 3]: the frames as the VAE sees them (`image_to_pixels`), back in 0-255."""
    pixels = torch.cat([image_to_pixels(f, height, width) for f in frames])  # [T, 3, H, W]
    return ((pixels * 0.5 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()


class ForcingInputStage(Stage):
    """Encodes the request's image(s) or the video's overlap (`(mode - mean) / std`) into `ForcingInputs.start` /
    `.end`. Skipped for text-to-video."""

    def __init__(self, vae: torch.nn.Module, device: torch.device):
        self.vae = vae
        self.device = device
        self.tile_size: int | None = None  # RuntimeArgs.vae_tile_size (the pipeline sets it): exact tiled encode

    def skips(self, batch: ForwardBatch) -> bool:
        return batch.get(ForcingInputs, None) is None

    def verify_output(self, batch: ForwardBatch, result: VerificationResult) -> None:
        inputs = batch.get(ForcingInputs)
        result.add_check("start latents", inputs.start, V.ndim(5), V.dtype_in(torch.float32), V.all_finite)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        inputs = batch.get(ForcingInputs)
        pixels = inputs.pixels(batch.height, batch.width)
        mu = encode_mode(self.vae, pixels.to(self.vae.device, self.vae.dtype), self.tile_size)
        latents = normalize_latents(mu.to(self.device, torch.float32), self.vae.config)
        inputs.start = latents[:1]
        inputs.end = latents[1:] if inputs.last_image is not None else None
        return batch


class InputVideoStage(Stage):
    """Video-to-video: the input video's frames at the output size before the decoded ones, as diffusers'
    SkyReelsV2DiffusionForcingVideoToVideoPipeline returns them. Skipped without a video."""

    def skips(self, batch: ForwardBatch) -> bool:
        inputs = batch.get(ForcingInputs, None)
        # (frames None: the memory predictor traces the decode without keeping its frames)
        return inputs is None or inputs.video is None or batch.frames is None

    def verify_output(self, batch: ForwardBatch, result: VerificationResult) -> None:
        expected = (batch.batch_size, len(batch.get(ForcingInputs).video) + batch.num_frames, batch.height,
                    batch.width, 3)
        if tuple(batch.frames.shape) != expected:
            result.add_failure("frames", list(batch.frames.shape), f"uint8 frames of shape {list(expected)}")

    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        head = resized_frames(batch.get(ForcingInputs).video, batch.height, batch.width)
        frames = np.asarray(batch.frames)
        batch.frames = np.concatenate([np.broadcast_to(head, (frames.shape[0], *head.shape)), frames], axis=1)
        return batch
