"""Wan2.2-Animate's inputs and its segment loop (diffusers' `WanAnimatePipeline`).

The request's videos (pose, face; background and mask for mode replace) are padded to a whole number of segments
(diffusers' back-and-forth padding) and the video is made segment by segment, each `segment_frame_length` (S) frames
long and continuing from the last `prev_segment_conditioning_frames` (P) of the one before:

    reference = [ones (4 mask channels), (VAE(character image, scaled to fit, on black) - mean) / std]   1 latent frame
    for each segment [start, start + S) (start = 0, S - P, 2 (S - P), ...):
        noise [B, z, F + 1, h, w]            F = (S - 1) / 4 + 1 latent frames, and the reference frame
        pose  = (VAE(pose frames) - mean) / std
        video = [the previous segment's last P decoded frames (the first segment: none), then zeros (animate) or the
                 background (replace)]
        mask  = 1 on the previous segment's P frames; replace: 1 - the mask video too (1 keeps the background)
        condition = [reference | [fold(mask), (VAE(video) - mean) / std]]   on the frame axis, [B, 4 + z, F + 1, h, w]
        denoise [noise | condition] with the pose latents and the face frames' motion tokens; decode frames 1..F
        keep the decoded frames past the first P (the first segment: all of them)
    the video: the kept frames, cut to the pose video's length

With CFG (guidance_scale > 1) the negative branch has the negative prompt and a blank face (every pixel -1), as in
diffusers. The knobs keep diffusers' names; their rules are here (`check_animate_inputs`, run by the request check
before anything loads).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from composer.batch import ForwardBatch
from composer.engine import SchedulerSteps
from composer.engine.batcher import module_lock
from composer.engine.loop import Blocking, wait_for
from composer.engine.scheduler import current_request
from composer.errors import InvalidInputError
from composer.stages.base import Stage
from composer.stages.decoding import DecodingStage, video_to_frames
from composer.stages.denoising import DenoisingStage
from composer.stages.image_encoding import ImageCondition
from composer.stages.image_latents import image_to_pixels
from composer.stages.start_frames import normalize_latents
from composer.stages.vae_tiling import encode_mode
from composer.stages.validators import V, VerificationResult, check_input_length, describe
from composer.video import read_video_frames

VIDEOS = ("pose_video", "face_video", "background_video", "mask_video")
PREVIOUS_FRAMES = (1, 5)  # diffusers' check_inputs allows these two


# -- the request's inputs ------------------------------------------------------------------------------------------
def segment_starts(frames: int, segment: int, previous: int) -> list[int]:
    """The first frame of each segment of a `frames`-frame video (diffusers' loop): segments of `segment` frames,
    each starting `previous` frames before the one before it ends, as many as cover the video."""
    step = segment - previous
    short = (frames - previous) % step
    padded = frames + (step - short if short else 0)
    return [k * step for k in range(padded // step)]


def pad_frames(frames: list, count: int) -> list:
    """`frames` played forward, then backward, and so on, up to `count` frames ([1, 2, 3] -> [1, 2, 3, 2, 1, 2, ...]):
    diffusers' `pad_video_frames` (a longer video is cut)."""
    out, index, step = [], 0, 1
    while len(out) < count:
        out.append(frames[index])
        index += step
        if index in (0, len(frames) - 1):
            step = -step
    return out


WHAT = {"pose_video": "the poses the character follows", "face_video": "the character's expressions",
        "background_video": "mode replace puts the character into it", "mask_video": "mode replace draws the "
        "character where it is white"}


def check_animate_inputs(sp: Any, result: VerificationResult, temporal: int = 4, limits: Any = None) -> dict[str, list]:
    """Wan Animate's input rules, before anything loads: a pose and a face video of one length (the video's: at most
    the `limits`' max_frames); for mode replace a background and a mask video of that length too (and neither for
    animate); segments of `temporal` k + 1 frames, more than twice the frames carried over (1 or 5), which the pose
    video must outlast. (The character image: the request check's image rule; `mode`: its choices; num_frames is not
    used.) Returns the videos it read (PIL frames by field)."""
    required = VIDEOS if sp.mode == "replace" else VIDEOS[:2]
    videos: dict[str, list] = {}
    for name in VIDEOS:
        value = getattr(sp, name)
        if value is None:
            if name in required:  # no value to show: "pose_video: expected ..."
                result.failures.append((name, "", f"a video ({WHAT[name]})"))
            continue
        if sp.mode == "animate" and name not in required:
            result.failures.append((name, _shown(value), "unset in mode animate (background and mask videos are "
                                    "mode replace's: give mode='replace' / --mode replace)"))
            continue
        try:
            videos[name] = read_video_frames(value, name)
        except InvalidInputError as exc:
            result.failures.append((name, _shown(value), f"a readable video ({exc})"))
    pose = len(videos["pose_video"]) if "pose_video" in videos else None
    if pose is not None:
        check_input_length(result, "pose_video", pose, limits)
    for name, frames in videos.items():
        if pose is not None and len(frames) != pose:
            result.add_failure(f"{name} frames", len(frames), f"{pose}, the pose video's length")
    previous, segment = sp.prev_segment_conditioning_frames, sp.segment_frame_length
    if previous not in PREVIOUS_FRAMES or isinstance(previous, bool):
        result.add_failure("prev_segment_conditioning_frames", previous, "1 or 5")
    elif not V.positive_int(segment) or segment % temporal != 1 or segment <= 2 * previous:
        least = next(n for n in range(1, 10**6, temporal) if n > 2 * previous)
        near = max(least, round((segment - 1) / temporal) * temporal + 1) if V.positive_int(segment) else least
        result.add_failure("segment_frame_length", segment, f"{temporal}k + 1 frames, more than twice "
                           f"prev_segment_conditioning_frames = {previous} (nearest valid: {near})")
    elif pose is not None and pose <= previous:
        result.add_failure("pose_video frames", pose, f"more than prev_segment_conditioning_frames = {previous}")
    batch = sp.motion_encode_batch_size
    if batch is not None and not V.positive_int(batch):
        result.add_failure("motion_encode_batch_size", batch, "a number of frames >= 1, or unset")
    return videos


def _shown(value: Any) -> str:
    """A video as a failure shows it: a path quoted, frames by their count or shape, never pixels."""
    from composer.images import describe_image

    if isinstance(value, (str, os.PathLike)):
        return repr(str(value))
    if isinstance(value, (list, tuple)):
        return f"{len(value)} frames"
    return describe_image(value) if hasattr(value, "shape") else describe(value)


@dataclass(eq=False)
class AnimateInputs:
    """A Wan Animate request's videos (PIL frames, each padded to the segments' length) and knobs; the stages add
    the character's `reference` latents [1, 4 + z, 1, h, w] and the videos as pixels in [-1, 1] ([0, 1] for the mask)
    [1, C, T, H, W] (the face at the motion encoder's size)."""

    frames: int  # the pose video's length: the video's
    starts: list[int]
    pose: list
    face: list
    background: list | None
    mask: list | None
    mode: str
    segment: int
    previous: int
    motion_batch: int | None
    reference: torch.Tensor | None = None
    pixels: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_request(cls, sampling: Any, temporal: int) -> AnimateInputs:
        """The request's videos read and padded; a RequestError naming every broken rule (what the request check
        said before this runs, for a caller that skipped it)."""
        from composer.errors import RequestError

        result = VerificationResult()
        videos = check_animate_inputs(sampling, result, temporal)
        if result.failures:
            raise RequestError(result.failures)
        frames, segment = len(videos["pose_video"]), sampling.segment_frame_length
        starts = segment_starts(frames, segment, sampling.prev_segment_conditioning_frames)
        padded = {name: pad_frames(videos[name], starts[-1] + segment) if name in videos else None for name in VIDEOS}
        return cls(frames, starts, padded["pose_video"], padded["face_video"], padded["background_video"],
                   padded["mask_video"], sampling.mode, segment, sampling.prev_segment_conditioning_frames,
                   sampling.motion_encode_batch_size)


# -- the inputs as the model sees them -----------------------------------------------------------------------------
def fit_on_black(image, height: int, width: int):
    """The character image scaled (Lanczos) to fit height x width, centred on black: diffusers'
    `WanAnimateImageProcessor` with resize_mode "fill" and fill colour 0. (The pipeline asks it for bilinear, but its
    config registration runs twice and keeps the base class's Lanczos: what diffusers computes is Lanczos.)"""
    import PIL.Image

    wide = width / height < image.width / image.height
    w = width if wide else image.width * height // image.height
    h = height if not wide else image.height * width // image.width
    canvas = PIL.Image.new("RGB", (width, height), color=0)
    canvas.paste(image.resize((w, h), resample=PIL.Image.LANCZOS), box=(width // 2 - w // 2, height // 2 - h // 2))
    return canvas


def video_pixels(frames: list, height: int, width: int) -> torch.Tensor:
    """PIL frames -> [1, 3, T, height, width] in [-1, 1] (Lanczos, no crop: diffusers' VideoProcessor)."""
    return torch.stack([image_to_pixels(f, height, width)[0] for f in frames], dim=1)[None]


def mask_pixels(frames: list, height: int, width: int) -> torch.Tensor:
    """PIL frames -> [1, 1, T, height, width] in [0, 1]: resized (Lanczos), then grey, as diffusers' mask processor."""
    import PIL.Image

    grey = [np.asarray(f.resize((width, height), resample=PIL.Image.LANCZOS).convert("L"), np.float32) / 255.0
            for f in frames]
    return torch.from_numpy(np.stack(grey))[None, None]


def fold_frame_mask(mask: torch.Tensor, temporal: int) -> torch.Tensor:
    """A per-frame mask [B, 1, (F - 1) * temporal + 1, h, w] -> [B, temporal, F, h, w]: the first frame's entry
    repeated `temporal` times (the causal VAE keeps frame 0 alone in the first latent frame), then folded."""
    first = mask[:, :, :1].repeat_interleave(temporal, dim=2)
    folded = torch.cat([first, mask[:, :, 1:]], dim=2)
    return folded.view(mask.shape[0], -1, temporal, *mask.shape[3:]).transpose(1, 2)


class AnimateReferenceStage(Stage):
    """The character image VAE-encoded alone (scaled to fit, on black) with a mask of ones: `AnimateInputs.reference`;
    and the request's videos as pixels (the face at the motion encoder's `face_size` square)."""

    def __init__(self, vae: torch.nn.Module, face_size: int, device: torch.device):
        self.vae = vae
        self.face_size = face_size
        self.device = device
        self.tile_size: int | None = None  # RuntimeArgs.vae_tile_size (the pipeline sets it): exact tiled encode

    def verify_input(self, batch: ForwardBatch, result: VerificationResult) -> None:
        result.add_check("image", batch.get(ImageCondition, None), V.not_none)
        result.add_check("animate inputs (AnimateInputs)", batch.get(AnimateInputs, None), V.not_none)

    def verify_output(self, batch: ForwardBatch, result: VerificationResult) -> None:
        temporal, z = self.vae.config.scale_factor_temporal, self.vae.config.z_dim
        result.add_check("reference_latents", batch.get(AnimateInputs).reference, V.shape([1, temporal + z, 1, None,
                                                                                           None]), V.all_finite)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        inputs, height, width = batch.get(AnimateInputs), batch.height, batch.width
        image = image_to_pixels(fit_on_black(batch.get(ImageCondition).image, height, width), height, width)
        latents = encode_latents(self.vae, image[:, :, None], self.device, self.tile_size)
        mask = torch.ones(1, self.vae.config.scale_factor_temporal, *latents.shape[2:], device=self.device)
        inputs.reference = torch.cat([mask, latents], dim=1)
        inputs.pixels["pose_video"] = video_pixels(inputs.pose, height, width)
        inputs.pixels["face_video"] = video_pixels(inputs.face, self.face_size, self.face_size)
        if inputs.mode == "replace":
            inputs.pixels["background_video"] = video_pixels(inputs.background, height, width)
            inputs.pixels["mask_video"] = mask_pixels(inputs.mask, height, width)
        return batch


def encode_latents(vae: torch.nn.Module, pixels: torch.Tensor, device: torch.device, tile_size: int | None):
    """(VAE(pixels).mode - mean) / std, fp32 on `device`, as diffusers' Animate pipeline encodes every input."""
    mu = encode_mode(vae, pixels.to(vae.device, vae.dtype), tile_size)
    return normalize_latents(mu.to(device, torch.float32), vae.config)


# -- the segment loop ----------------------------------------------------------------------------------------------
class AnimateDenoisingStage(DenoisingStage):
    """Every segment of the request (see the module doc): its conditioning encoded and its frames decoded by the VAE
    (one request at a time: the VAE's lock), its steps through the engine (CFG; the reference and conditioning on the
    channel axis, the pose latents and face motion tokens as the transformer's own inputs). Writes `batch.frames`
    and, as diffusers' `output_type="latent"` gives them, the last segment's latents."""

    def __init__(self, engine, vae: torch.nn.Module, progress: bool = True):
        super().__init__(engine, progress)
        self.vae = vae
        self.tile_size: int | None = None  # RuntimeArgs.vae_tile_size (the pipeline sets it): exact tiled encode
        self._decoder = DecodingStage(vae)  # (its decode only: denormalize, exact tiles when tile_size is set)

    def verify_input(self, batch: ForwardBatch, result: VerificationResult) -> None:
        result.add_check("timesteps", batch.timesteps, V.ndim(1))
        result.add_check("prompt_embeds", batch.prompt_embeds, V.ndim(3))
        if batch.do_classifier_free_guidance:
            result.add_check("negative_prompt_embeds", batch.negative_prompt_embeds, V.ndim(3))
        result.add_check("image_embeds", getattr(batch.get(ImageCondition, None), "embeds", None), V.ndim(3))
        result.add_check("reference_latents", getattr(batch.get(AnimateInputs, None), "reference", None), V.ndim(5))

    def verify_output(self, batch: ForwardBatch, result: VerificationResult) -> None:
        expected = (batch.batch_size, batch.get(AnimateInputs).frames, batch.height, batch.width, 3)
        if batch.frames is None or tuple(batch.frames.shape) != expected:
            shape = None if batch.frames is None else list(batch.frames.shape)
            result.add_failure("frames", shape, f"uint8 frames of shape {list(expected)}")

    def _blocking(self, work, vae: bool = True):
        """`work()` as blocking work of the task (off the engine core's thread), holding the VAE when `vae` (one
        request's encode or decode at a time)."""
        def run():
            with module_lock(self.vae) if vae else contextlib.nullcontext(), torch.inference_mode():
                return work()
        return wait_for(Blocking(run))

    def _encode(self, pixels: torch.Tensor, device: torch.device) -> torch.Tensor:
        return encode_latents(self.vae, pixels, device, self.tile_size)

    def _condition(self, inputs: AnimateInputs, start: int, previous: torch.Tensor | None, rows: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """A segment's pose latents [1, z, F, h, w] and condition [rows, 4 + z, F + 1, h, w] (see the module doc)."""
        segment, carried, temporal = inputs.segment, inputs.previous, self.vae.config.scale_factor_temporal
        window = slice(start, start + segment)
        pose = self._encode(inputs.pixels["pose_video"][:, :, window], device)
        if inputs.mode == "replace":
            video = inputs.pixels["background_video"][:, :, window]
        else:
            video = torch.zeros(1, 3, segment, *inputs.pixels["pose_video"].shape[3:])
        if previous is None:  # the first segment: the same for every row
            latents = self._encode(video, device).expand(rows, -1, -1, -1, -1)
        else:  # each row continues its own video, encoded alone (diffusers: one generator per video)
            latents = torch.cat([self._encode(torch.cat([prev[None], video[:, :, carried:].to(prev)], dim=2), device)
                                 for prev in previous])
        h, w = latents.shape[3:]
        if inputs.mode == "replace":  # 1 - mask: 1 where the background is kept, per latent pixel (nearest)
            kept = 1 - inputs.pixels["mask_video"][0, :, window].transpose(0, 1)  # [S, 1, H, W]
            mask = F.interpolate(kept, size=(h, w), mode="nearest").transpose(0, 1)[None].to(device)
        else:
            mask = torch.zeros(1, 1, segment, h, w, device=device)
        if previous is not None:
            mask = mask.clone()
            mask[:, :, :carried] = 1  # the carried frames are known
        condition = torch.cat([fold_frame_mask(mask, temporal).expand(rows, -1, -1, -1, -1), latents], dim=1)
        reference = inputs.reference.to(device).expand(rows, -1, -1, -1, -1)
        return pose, torch.cat([reference, condition], dim=2)

    def _decode(self, latents: torch.Tensor) -> torch.Tensor:
        self._decoder.tile_size = self.tile_size
        return self._decoder.decode(latents)

    @torch.inference_mode()  # torch enters it around each resumption of the generator
    def forward_task(self, batch: ForwardBatch):
        """`forward` as a task: yields each step's transformer unit and the VAE's work (composer/engine/loop.py)."""
        inputs = batch.get(AnimateInputs)
        transformer = self.engine.transformer
        dtype, device, rows = transformer.dtype, transformer.device, batch.batch_size
        image = batch.get(ImageCondition).embeds.to(device, dtype).repeat(rows, 1, 1)
        text = {"cond": self.engine.text_inputs(batch.prompt_embeds.to(dtype), image)}
        guidance = None
        if batch.do_classifier_free_guidance:
            text["uncond"] = self.engine.text_inputs(batch.negative_prompt_embeds.to(dtype), image)
            guidance = self.guidance(batch)
        spatial, z = self.vae.config.scale_factor_spatial, self.vae.config.z_dim
        frames = (inputs.segment - 1) // self.vae.config.scale_factor_temporal + 1
        shape = (1, z, frames + 1, batch.height // spatial, batch.width // spatial)
        generators = [torch.Generator("cpu").manual_seed(seed) for seed in batch.seeds]
        request = current_request()
        progress = self.progress and not (request is not None and request.background)
        kept: list[np.ndarray] = []
        previous = None
        for number, start in enumerate(inputs.starts):
            noise = torch.cat([torch.randn(shape, generator=g) for g in generators]).to(device)
            pose, condition = yield from self._blocking(
                lambda start=start, previous=previous: self._condition(inputs, start, previous, rows, device))
            faces = inputs.pixels["face_video"][:, :, start:start + inputs.segment].to(device)
            blank = {"cond": faces, "uncond": faces * 0 - 1}  # the negative branch sees no face
            motion = yield from self._blocking(lambda blank=blank: {  # once a segment: it reads the faces only
                name: transformer.encode_face(blank[name], inputs.motion_batch) for name in text}, vae=False)
            branches = [dataclasses.replace(base, condition=condition, extra={
                "pose_hidden_states": pose.to(dtype).expand(rows, -1, -1, -1, -1),
                "face_motion": motion[name].expand(rows, -1, -1, -1)}) for name, base in text.items()]
            scheduler = copy.deepcopy(batch.scheduler)  # a fresh one per segment (diffusers sets its timesteps again)
            latents = yield from self.engine.run_task(noise, SchedulerSteps(scheduler, scheduler.timesteps),
                                                      branches[0], branches[1] if guidance else None, guidance,
                                                      run=number, progress=progress)
            video = yield from self._blocking(lambda latents=latents: self._decode(latents[:, :, 1:]))
            previous = video[:, :, -inputs.previous:].clone()  # (not a view holding the whole segment)
            kept.append(video_to_frames(video if number == 0 else video[:, :, inputs.previous:]).numpy())
            batch.latents = latents
        batch.frames = np.concatenate(kept, axis=1)[:, :inputs.frames]
        return batch
