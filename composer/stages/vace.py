"""VACE's control (diffusers' `WanVACEPipeline`): the request's control video, its mask and reference images, encoded
into the control latents the VACE transformer's control blocks read.

    video  [3, F, H, W] in [-1, 1] (zeros without one), resized to height x width (Lanczos, no crop)
    mask   [F, H, W] in [0, 1] (ones without one: generate everything), resized likewise
    control = [(VAE(video * (mask <= .5)) - mean) / std,  (VAE(video * (mask > .5)) - mean) / std]   2z channels
    mask latents: each latent position's s x s mask pixels as s * s channels (s: the VAE's spatial factor), frames
                  picked by nearest-exact from F to F' latent frames                                  s * s channels
    each reference image, fitted into the frame on a white canvas and encoded alone: one more latent frame [ref, 0]
    (mask 0), before the video's (the last given first, as diffusers stacks them); the noise then has those frames
    too, and they are cut before decoding.

The knobs are diffusers': `video`, `mask`, `reference_images`, `conditioning_scale` (one value, or one per control
block); their rules are here (`check_vace_inputs`, run by the request check before anything loads).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from composer.batch import ForwardBatch
from composer.engine import ModelInputs
from composer.errors import InvalidInputError
from composer.stages.base import Stage
from composer.stages.denoising import DenoisingStage
from composer.stages.expert_denoising import ExpertDenoisingStage
from composer.stages.image_latents import image_to_pixels
from composer.stages.latents import LatentPreparationStage
from composer.stages.start_frames import normalize_latents
from composer.stages.vae_tiling import encode_mode
from composer.stages.validators import V, VerificationResult, describe
from composer.stages.video_latents import check_video_input
from composer.video import read_video_frames


# -- the request's inputs ------------------------------------------------------------------------------------------
def reference_problems(value: Any) -> list[tuple[str, Any, str]]:
    """What is wrong with `reference_images`, as (field, value shown, "expected ..." text): one image (a file path,
    PIL image, array or tensor, as composer.images reads it) or a non-empty list of them."""
    from composer.images import ACCEPTED, image_problem

    if not isinstance(value, (list, tuple)):
        if value is None or isinstance(value, (int, float, bool, dict, set)):
            return [("reference_images", _shown(value), f"an image or a list of images ({ACCEPTED})")]
        problem = image_problem(value)
        return [] if problem is None else [("reference_images", _shown(value), problem)]
    if not value:
        return [("reference_images", _shown(value), "at least one image (or leave it unset)")]
    if any(isinstance(item, (list, tuple)) for item in value):
        return [("reference_images", _shown(value), "one image or a list of images, not a list of lists (one "
                 "request makes one video: give its images as one list)")]
    return [(f"reference_images[{i}]", _shown(item), problem) for i, item in enumerate(value)
            if (problem := image_problem(item)) is not None]


def read_reference_images(value: Any) -> list:
    """`reference_images` as RGB PIL images; InvalidInputError naming the field (and the item) otherwise."""
    from composer.images import load_image

    if problems := reference_problems(value):
        name, shown, rule = problems[0]
        raise InvalidInputError(f"{name} = {shown}: expected {rule}")
    items = value if isinstance(value, (list, tuple)) else [value]
    return [load_image(item, f"reference_images[{i}]") for i, item in enumerate(items)]


def scale_problem(scale: Any, blocks: int | None = None) -> str | None:
    """What is wrong with `conditioning_scale` ("expected ..." text) for `blocks` control blocks, or None."""
    values = scale if isinstance(scale, (list, tuple)) else [scale]
    if not values or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                             for v in values):
        return "finite numbers: one for every control block, or one per block"
    if blocks is not None and len(values) not in (1, blocks):
        return (f"one value, or one per control block: this transformer has {blocks} (len(vace_layers) in its "
                "config)")
    return None


def _shown(value: Any) -> str:
    """An input as a message shows it: a path quoted, a list by its length, an image by its size, never pixels."""
    if isinstance(value, (str, os.PathLike)):
        return repr(str(value))
    if isinstance(value, (list, tuple)):
        return f"{len(value)} items" if value else "[]"
    from composer.images import describe_image

    return describe_image(value) if hasattr(value, "size") or hasattr(value, "shape") else describe(value)


def check_vace_inputs(sp: Any, result: VerificationResult, temporal: int = 4) -> None:
    """VACE's input rules, before anything loads: a control video that reads, of `temporal` k + 1 frames, or
    reference images; a mask only with the video, of its length and frame size; reference images that read; finite
    conditioning scales."""
    video, mask, references = sp.video, sp.mask, sp.reference_images
    if video is not None:
        check_video_input(result, video, temporal)
    failures = []  # (field, value as shown, rule): appended as they are (the values are already text)
    if video is None and references is None:  # no value to show: "video: expected ..."
        failures.append(("video", "", "a control video, or reference_images (a VACE model follows a video, its mask "
                         "and reference images; without any, use a text-to-video model)"))
    if mask is not None and video is None:
        failures.append(("mask", _shown(mask), "unset without a video (the mask says which parts of the control video "
                         "to keep: give video too)"))
    elif mask is not None:
        try:
            mask_frames = read_video_frames(mask, "mask")
        except InvalidInputError as exc:
            failures.append(("mask", _shown(mask), f"a readable video ({exc})"))
        else:
            try:
                frames = read_video_frames(video)
            except InvalidInputError:
                frames = None  # named by check_video_input
            if frames is not None and (problem := mask_problem(mask_frames, frames)):
                failures.append(("mask", _shown(mask), problem))
    if references is not None:
        failures += reference_problems(references)
    if (problem := scale_problem(sp.conditioning_scale)) is not None:
        failures.append(("conditioning_scale", describe(sp.conditioning_scale), problem))
    result.failures += failures


def mask_problem(mask: list, frames: list) -> str | None:
    """What is wrong with the mask's frames for the control video's frames ("expected ..." text), or None."""
    if len(mask) != len(frames):
        return f"{len(frames)} frames, the control video's length (it has {len(mask)})"
    size, mask_size = frames[0].size, next((m.size for m in mask if m.size != frames[0].size), None)
    if mask_size is not None:
        return (f"frames of the control video's size, {size[0]}x{size[1]} (width x height), not "
                f"{mask_size[0]}x{mask_size[1]}")
    return None


@dataclass(eq=False)
class VaceCondition:
    """A VACE request's control: the video's frames (None: a blank one), the mask's (None: generate everywhere), the
    reference images (PIL), the scale of each control block's hint, and (after VaceConditionStage) the control
    latents [1, vace_in_channels, F' + references, h, w] fp32."""

    frames: list | None
    mask: list | None
    references: list
    scale: list[float]
    latents: torch.Tensor | None = None

    @classmethod
    def from_request(cls, sampling: Any, temporal: int, blocks: int) -> VaceCondition:
        """The request's inputs read and checked for a transformer with `blocks` control blocks (InvalidInputError
        naming the field). Neither a video nor reference images is a blank control, as in diffusers: the request check
        refuses it for users (`check_vace_inputs`), the memory planner's stand-in request runs it (the same shapes)."""
        frames = read_video_frames(sampling.video) if sampling.video is not None else None
        if frames is not None and (len(frames) - 1) % temporal:
            raise InvalidInputError(f"video: {len(frames)} frames; a control video has {temporal}k + 1 frames (the "
                                    f"VAE's temporal factor is {temporal})")
        mask = None
        if sampling.mask is not None:
            if frames is None:
                raise InvalidInputError("mask: given without a video (the mask says which parts of the control video "
                                        "to keep)")
            mask = read_video_frames(sampling.mask, "mask")
            if (problem := mask_problem(mask, frames)) is not None:
                raise InvalidInputError(f"mask: expected {problem}")
        references = [] if sampling.reference_images is None else read_reference_images(sampling.reference_images)
        scale = sampling.conditioning_scale
        if (problem := scale_problem(scale, blocks)) is not None:
            raise InvalidInputError(f"conditioning_scale = {scale!r}: expected {problem}")
        scale = [float(v) for v in (scale if isinstance(scale, (list, tuple)) else [scale])]
        return cls(frames, mask, references, scale * blocks if len(scale) == 1 else scale)


# -- the stages ----------------------------------------------------------------------------------------------------
def reference_pixels(image, height: int, width: int, spatial: int) -> torch.Tensor:
    """A reference image [1, 3, height, width] in [-1, 1], as diffusers prepares it: cut down to a multiple of the
    VAE's spatial factor (Lanczos), scaled to fit the frame (bilinear), centred on a white canvas."""
    w, h = image.size
    pixels = image_to_pixels(image, h - h % spatial, w - w % spatial)
    h, w = pixels.shape[-2:]
    scale = min(height / h, width / w)
    fitted = F.interpolate(pixels, size=(int(h * scale), int(w * scale)), mode="bilinear", align_corners=False)
    canvas = torch.ones(1, 3, height, width)
    top, left = (height - fitted.shape[2]) // 2, (width - fitted.shape[3]) // 2
    canvas[:, :, top:top + fitted.shape[2], left:left + fitted.shape[3]] = fitted
    return canvas


def mask_latents(mask: torch.Tensor, latent_frames: int, spatial: int) -> torch.Tensor:
    """[F, H, W] mask pixels -> [spatial**2, latent_frames, H / spatial, W / spatial]: each latent position's
    spatial x spatial pixels as channels, the frames picked by nearest-exact (diffusers' `prepare_masks`)."""
    frames, height, width = mask.shape
    h, w = height // spatial, width // spatial
    folded = mask.view(frames, h, spatial, w, spatial).permute(2, 4, 0, 1, 3).flatten(0, 1)
    return F.interpolate(folded.unsqueeze(0), size=(latent_frames, h, w), mode="nearest-exact").squeeze(0)


class ReferenceNoiseStage(LatentPreparationStage):
    """With reference images: the initial noise drawn again over their latent frames too (diffusers draws one tensor
    of F' + references latent frames, the references' first). Skipped without reference images."""

    def skips(self, batch: ForwardBatch) -> bool:
        return not batch.get(VaceCondition).references

    def shape(self, batch: ForwardBatch) -> tuple[int, ...]:
        rows, channels, frames, h, w = super().shape(batch)
        return rows, channels, frames + len(batch.get(VaceCondition).references), h, w


class VaceConditionStage(Stage):
    """Encodes the request's control (video, mask, reference images) into `VaceCondition.latents` (see the module
    doc), with the VAE's posterior mean, as diffusers' WanVACEPipeline does."""

    def __init__(self, vae: torch.nn.Module, device: torch.device):
        self.vae = vae
        self.device = device
        self.tile_size: int | None = None  # RuntimeArgs.vae_tile_size (the pipeline sets it): exact tiled encode

    def verify_input(self, batch: ForwardBatch, result: VerificationResult) -> None:
        result.add_check("control", batch.get(VaceCondition, None), V.not_none)
        result.add_check("latents", batch.latents, V.ndim(5))

    def verify_output(self, batch: ForwardBatch, result: VerificationResult) -> None:
        shape = [1, None, *batch.latents.shape[2:]]
        result.add_check("control_latents", batch.get(VaceCondition).latents, V.shape(shape), V.all_finite)

    def _encode(self, pixels: torch.Tensor) -> torch.Tensor:
        mu = encode_mode(self.vae, pixels.to(self.vae.device, self.vae.dtype), self.tile_size)
        return normalize_latents(mu.to(self.device, torch.float32), self.vae.config)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        condition = batch.get(VaceCondition)
        frames, height, width = batch.num_frames, batch.height, batch.width
        spatial = self.vae.config.scale_factor_spatial
        if condition.frames is None:
            video = torch.zeros(1, 3, frames, height, width)
        else:
            video = torch.stack([image_to_pixels(f, height, width)[0] for f in condition.frames], dim=1)[None]
        if condition.mask is None:
            mask = torch.ones(1, 1, frames, height, width)
        else:  # [-1, 1] back to [0, 1], as diffusers reads a mask video
            pixels = torch.stack([image_to_pixels(m, height, width)[0] for m in condition.mask], dim=1)[None]
            mask = torch.clamp((pixels + 1) / 2, min=0, max=1)
        generate = torch.where(mask > 0.5, 1.0, 0.0)  # what is kept ("inactive") and what is redrawn ("reactive")
        latents = torch.cat([self._encode(video * (1 - generate)), self._encode(video * generate)], dim=1)
        masks = mask_latents(mask[0, 0], latents.shape[2], spatial)[None].to(self.device)
        for image in condition.references:  # each one latent frame before the others (the last given first)
            reference = self._encode(reference_pixels(image, height, width, spatial)[:, :, None])
            latents = torch.cat([torch.cat([reference, torch.zeros_like(reference)], dim=1), latents], dim=2)
            masks = torch.cat([torch.zeros_like(masks[:, :, :1]), masks], dim=2)
        condition.latents = torch.cat([latents, masks], dim=1)
        return batch


class VaceDenoisingStage(DenoisingStage):
    """DenoisingStage whose branches also carry the control latents and the per-block scales (the same for the prompt
    and the negative prompt, as diffusers does)."""

    def verify_input(self, batch: ForwardBatch, result: VerificationResult) -> None:
        super().verify_input(batch, result)
        result.add_check("control_latents", getattr(batch.get(VaceCondition, None), "latents", None), V.ndim(5))

    def branch_inputs(self, batch: ForwardBatch, text: torch.Tensor) -> ModelInputs:
        condition = batch.get(VaceCondition)
        rows, device, dtype = text.shape[0], batch.latents.device, self.engine.transformer.dtype
        control = condition.latents.to(device, dtype).expand(rows, -1, -1, -1, -1)
        scale = torch.tensor(condition.scale, device=device, dtype=dtype).expand(rows, -1)
        return dataclasses.replace(super().branch_inputs(batch, text), extra={
            "control_hidden_states": control, "control_hidden_states_scale": scale})


class VaceExpertDenoisingStage(ExpertDenoisingStage, VaceDenoisingStage):
    """One expert's steps (ExpertDenoisingStage: its timesteps and CFG scale) with the control (VaceDenoisingStage):
    Wan2.2 VACE."""


class ReferenceFrameCutStage(Stage):
    """Drops the reference images' latent frames before decoding (diffusers: `latents[:, :, references:]`). Skipped
    without reference images."""

    def skips(self, batch: ForwardBatch) -> bool:
        return not batch.get(VaceCondition).references

    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        batch.latents = batch.latents[:, :, len(batch.get(VaceCondition).references):]
        return batch
