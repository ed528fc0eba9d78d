"""Video-to-video (diffusers' `WanVideoToVideoPipeline`): the request's video, encoded by the VAE and noised to the
timestep `strength` starts from, replaces the pure noise; the denoising runs the schedule's last steps only.

    gen.generate_video("a watercolor painting of a fox", video="in.mp4", strength=0.6)
    composer generate --model-path Wan-AI/Wan2.1-T2V-1.3B-Diffusers --video in.mp4 --strength 0.6 --prompt ...

As diffusers: the frames are resized to height x width (Lanczos, no crop), the VAE's posterior mean (`argmax`) is
normalized by the VAE's latent statistics, the schedule keeps its last `int(num_inference_steps * strength)` steps,
and the noise drawn for the request (the same draw as text-to-video) is added at the first kept timestep with the
scheduler's own `add_noise` (or `scale_noise`). The video's length is the request's `num_frames`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from composer.batch import ForwardBatch
from composer.errors import InvalidInputError
from composer.stages.base import Stage
from composer.stages.image_latents import image_to_pixels
from composer.stages.start_frames import normalize_latents
from composer.stages.vae_tiling import encode_mode
from composer.stages.validators import V, VerificationResult, check_input_length
from composer.video import read_video_frames  # (kept importable here: its home was this module)


def strength_problem(strength: Any, steps: Any) -> str | None:
    """What is wrong with `strength` for `steps` denoising steps ("expected ..."), or None."""
    if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not math.isfinite(strength) \
            or not 0.0 < strength <= 1.0:
        return "a number in (0, 1]"
    if isinstance(steps, int) and int(steps * strength) < 1:
        return (f"at least 1 / num_inference_steps = {1 / steps:g} (strength x num_inference_steps must keep one "
                "step to denoise)")
    return None


def check_video_input(result: VerificationResult, video: Any, temporal: int | None = None) -> list | None:
    """A request's input video, before any work: it reads (else a failure naming `video`) and, with `temporal`, has
    `temporal` k + 1 frames (Wan video-to-video and VACE: the video's length is the request's num_frames). Returns
    its frames, None when it does not read."""
    from composer.images import shown_input

    try:
        frames = read_video_frames(video)
    except InvalidInputError as exc:
        result.add_failure("video", shown_input(video), f"a readable video ({exc})")
        return None
    if temporal is not None and (len(frames) - 1) % temporal:
        result.add_failure("video frames", len(frames), f"{temporal}k + 1 (the video's length is the request's "
                           f"num_frames: give {(len(frames) - 1) // temporal * temporal + 1} frames, for one)")
    return frames


def check_video_to_video(sp: Any, result: VerificationResult, temporal: int, limits: Any = None) -> None:
    """Wan video-to-video's request rule (its SamplingParam's `check_inputs`): the video reads and has `temporal` k + 1
    frames (at most the `limits`' max_frames: its length is the video's, num_frames is not used), and `strength`
    keeps at least one step; a strength other than the default without a video does nothing, so it is refused.
    (A non-finite strength is named by the request check's number rule.)"""
    strength = sp.strength
    finite = isinstance(strength, (int, float)) and not isinstance(strength, bool) and math.isfinite(strength)
    if sp.video is None:
        default = next(f.default for f in dataclasses.fields(type(sp)) if f.name == "strength")
        if finite and strength != default:
            result.add_failure("strength", strength, f"unset ({default}) without a video: strength is video-to-"
                               "video's (give video= / --video too)")
        return
    if (video := check_video_input(result, sp.video, temporal)) is None:
        return
    check_input_length(result, "video", len(video), limits)
    if finite and (problem := strength_problem(strength, sp.num_inference_steps)) is not None:
        result.add_failure("strength", strength, problem)


@dataclass(eq=False)
class VideoCondition:
    """A video-to-video request's input: its frames (PIL), strength, and (after `VideoLatentStage`) the video's
    normalized latents [1, z, F, h, w]."""

    frames: list
    strength: float
    latents: torch.Tensor | None = None

    @classmethod
    def from_request(cls, sampling, temporal: int) -> VideoCondition:
        frames = read_video_frames(sampling.video)
        if (len(frames) - 1) % temporal:
            shorter = (len(frames) - 1) // temporal * temporal + 1
            raise InvalidInputError(f"video: {len(frames)} frames; video-to-video takes {temporal}k + 1 frames (the "
                                    f"VAE's temporal factor is {temporal}): give {shorter} or "
                                    f"{shorter + temporal} frames")
        steps = getattr(sampling, "num_inference_steps", None)
        if (problem := strength_problem(sampling.strength, steps)) is not None:
            raise InvalidInputError(f"strength = {sampling.strength!r}: expected {problem}")
        return cls(frames, float(sampling.strength))


class VideoLatentStage(Stage):
    """Video-to-video only (skipped without a `VideoCondition`): encodes the video, cuts the schedule to its last
    `strength` share and noises the video's latents to its first timestep with the request's noise."""

    def __init__(self, vae: torch.nn.Module, device: torch.device):
        self.vae = vae
        self.device = device
        self.tile_size: int | None = None  # RuntimeArgs.vae_tile_size (the pipeline sets it): exact tiled encode

    def skips(self, batch: ForwardBatch) -> bool:
        return batch.get(VideoCondition, None) is None

    def verify_input(self, batch: ForwardBatch, result: VerificationResult) -> None:
        result.add_check("latents", batch.latents, V.ndim(5))
        result.add_check("timesteps", batch.timesteps, V.ndim(1))

    def verify_output(self, batch: ForwardBatch, result: VerificationResult) -> None:
        result.add_check("latents", batch.latents, V.ndim(5), V.all_finite)
        result.add_check("timesteps", batch.timesteps, V.ndim(1))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        condition = batch.get(VideoCondition)
        if len(condition.frames) != batch.num_frames:
            raise InvalidInputError(f"video: {len(condition.frames)} frames for num_frames = {batch.num_frames}: the "
                                    "video's length is the request's num_frames")
        pixels = torch.stack([image_to_pixels(f, batch.height, batch.width)[0] for f in condition.frames], dim=1)
        pixels = pixels.unsqueeze(0).to(self.vae.device, self.vae.dtype)  # [1, 3, T, H, W]
        mu = encode_mode(self.vae, pixels, self.tile_size)
        condition.latents = normalize_latents(mu.to(self.device, torch.float32), self.vae.config)
        if condition.latents.shape[2:] != batch.latents.shape[2:]:
            raise InvalidInputError(f"video: latents of shape {list(condition.latents.shape[2:])} for a request of "
                                    f"{list(batch.latents.shape[2:])}")
        scheduler, steps = batch.scheduler, batch.num_inference_steps
        order = getattr(scheduler, "order", 1)
        kept = min(int(steps * condition.strength), steps)
        start = (steps - kept) * order
        batch.timesteps = batch.timesteps[start:]
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(start)
        first = batch.timesteps[:1].repeat(batch.latents.shape[0])
        noise = batch.latents
        video = condition.latents.to(noise.dtype).expand_as(noise)
        if hasattr(scheduler, "add_noise"):
            batch.latents = scheduler.add_noise(video, noise, first)
        else:
            batch.latents = scheduler.scale_noise(video, first, noise)
        return batch
