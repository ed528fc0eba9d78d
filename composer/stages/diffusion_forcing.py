"""Diffusion forcing (SkyReels-V2 DF): every latent frame at its own noise level, long videos in windows.

The sampler of diffusers' `SkyReelsV2DiffusionForcingPipeline`, as composer stages see it:

- **Schedule** (`forcing_schedule`, diffusers' `generate_timestep_matrix`): frames are grouped into causal blocks
  of `causal_block_size` latent frames. Each iteration moves every started block one step along the scheduler's
  timesteps; with `ar_step` = 0 all blocks move together (synchronous: the usual sampler), with `ar_step` = k a
  block starts k iterations after the one before it, so earlier blocks are cleaner than later ones (asynchronous:
  more iterations, n + (blocks - 1) k for n steps). A block not yet started is fed at timestep 999 (pure noise), a
  finished one at 0.
- **Steps**: one scheduler per latent frame (copies of the request's), stepped only at the iterations that move
  its block; the transformer gets a [B, F] timestep, one per frame (the Wan DiT's per-frame modulation, the
  same path Self-Forcing's causal sampler and Wan2.2 TI2V's conditioning frame use).
- **Causal blocks**: with `causal_block_size` > 1 the transformer attends block-causally (a frame sees its own block
  and the earlier ones), through the mask `composer.models.wan.causal.block_causal_mask` builds for the causal Wan
  sampler's uncached reference.
- **Long videos** (`num_frames` > `base_num_frames`): windows of at most `base_num_frames`; each window after the
  first starts from `overlap_history` frames of the video so far as a clean prefix (cut to whole blocks), which
  is never stepped (and with `addnoise_condition` > 0 is fed re-noised at that timestep, fresh noise each
  iteration), and adds its frames past the overlap to the video.
- **Inputs** (composer/stages/forcing_inputs.py): an image's latent frame, or an extended video's overlap, is the
  first window's clean prefix; a last image's frame follows the last window's frames, clean, and is dropped.

Noise: each row's initial noise of every window from its own CPU generator seeded `seed + row`, continued
window after window (diffusers' `generator`); the re-noising of the prefix from a second CPU generator per row,
seeded the same (diffusers draws it with `torch.randn_like`, from torch's global generator: `torch.manual_seed(seed)`
before diffusers' call gives it the same numbers for one video, in fp32).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

from composer.batch import ForwardBatch
from composer.engine import ModelInputs
from composer.engine.scheduler import current_request
from composer.models.wan.causal import block_causal_mask
from composer.stages.denoising import DenoisingStage
from composer.stages.forcing_inputs import ForcingInputs
from composer.stages.validators import V, Validator, VerificationResult

# What diffusers feeds a block that has not started (a placeholder timestep; its frames are pure noise).
NOT_STARTED_TIMESTEP = 999


def latent_count(frames: int, temporal: int) -> int:
    """Latent frames of `frames` video frames under a causal video VAE with `temporal` compression."""
    return (frames - 1) // temporal + 1


# -- the plan: windows of a long video -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Window:
    """One run of the sampler: `frames` latent frames, the first `prefix` of them clean at the start: the video frames
    [prefix_from, prefix_from + prefix) (the first window's: the request's own, `ForcingInputs.start`: the input
    image's frame or the extended video's overlap); its frames from `keep_from` on are appended to the video. The
    schedule holds the prefix's whole blocks, never stepped (a 1-frame image prefix in blocks of more frames is
    stepped with its block, as diffusers does)."""

    frames: int
    prefix: int = 0
    prefix_from: int = 0
    keep_from: int = 0


def plan_windows(num_frames: int, base_num_frames: int, overlap_history: int | None, block: int,
                 temporal: int, first_prefix: int = 0) -> list[Window]:
    """The windows of a request, as diffusers' loop makes them (its frame counts included: the overlap is counted
    whole where it places the window and drops the new frames, cut to whole blocks where it is the prefix).
    `first_prefix`: the first window's clean latent frames (1: image-to-video's image, whatever the block; the
    extended video's overlap, cut to whole blocks: `video_prefix`)."""
    total = latent_count(num_frames, temporal)
    first = first_prefix
    if overlap_history is None or num_frames <= base_num_frames:
        return [Window(total, first)]
    base, overlap = latent_count(base_num_frames, temporal), latent_count(overlap_history, temporal)
    count = 1 + (total - base - 1) // (base - overlap) + 1
    windows, made = [Window(base, first)], base
    for k in range(1, count):
        frames = min(total - (k * (base - overlap) + overlap) + overlap, base)
        prefix = overlap - overlap % block
        windows.append(Window(frames, prefix, made - overlap, overlap))
        made += frames - overlap
    return windows


def video_prefix(video_frames: int, overlap_history: int, block: int, temporal: int) -> int:
    """Video-to-video: the first window's clean latent frames, those of the video's last `overlap_history` frames
    (all of a shorter video) cut to whole causal blocks, as diffusers cuts them."""
    encoded = latent_count(min(video_frames, overlap_history), temporal)
    return encoded - encoded % block


AR_STEP_RULE = Validator("an integer >= 0 (0: every frame at the same noise level; k > 0: each causal block k steps "
                         "behind the one before)", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0)


def forcing_problems(num_frames: object, base_num_frames: object, overlap_history: object, ar_step: object,
                     causal_block_size: object, addnoise_condition: object, temporal: int, *, image: bool = False,
                     last_image: bool = False, video_frames: int | None = None) -> list[tuple]:
    """Every (field, value, rule) a diffusion-forcing request breaks (empty: it runs); value None: none to show.
    `causal_block_size` None: not known yet (the model's config states it; checked once the model is loaded). The
    inputs given: an `image`, a `last_image`, a video of `video_frames` frames to extend (None: no video)."""
    problems: list[tuple] = []
    video = video_frames is not None
    if video and image:
        problems.append(("image", None, "unset when a video is given: the video's last frames start the new ones "
                         "(diffusers' video-to-video pipeline takes no image)"))
    if last_image and video:
        problems.append(("last_image", None, "unset when a video is given (diffusers' video-to-video pipeline takes "
                         "no last frame)"))
    elif last_image and not image:
        problems.append(("last_image", None, "an image too: the last frame closes an image-to-video request (give "
                         "image, the first frame)"))
    if last_image and V.positive_int(causal_block_size) and causal_block_size > 1:
        problems.append(("last_image", None, f"causal_block_size = 1 with a last frame (it is {causal_block_size}): "
                         "the last image's latent frame follows the last window as a frame of its own, which "
                         "diffusers' schedule fits in blocks of 1 only"))

    def bad(field, value, validator):
        if not validator(value):
            problems.append((field, value, validator.rule))
            return True
        return False

    bad("ar_step", ar_step, AR_STEP_RULE)
    bad_block = causal_block_size is not None and bad("causal_block_size", causal_block_size, V.positive_int)
    bad_base = bad("base_num_frames", base_num_frames, V.congruent(temporal, 1))
    bad_overlap = overlap_history is not None and bad("overlap_history", overlap_history, V.positive_int)
    if isinstance(addnoise_condition, (int, float)) and addnoise_condition < 0:
        problems.append(("addnoise_condition", addnoise_condition, "a number >= 0 (0: the overlap is fed clean)"))
    if not V.congruent(temporal, 1)(num_frames) or bad_base or bad_block or bad_overlap:
        return problems  # (num_frames is the generic check's; the rest need valid numbers)
    if video:
        return problems + _video_problems(num_frames, base_num_frames, overlap_history, causal_block_size, temporal,
                                          video_frames)
    if num_frames > base_num_frames:
        if overlap_history is None:
            problems.append(("overlap_history", None, f"a number of frames when num_frames ({num_frames}) exceeds "
                             f"base_num_frames ({base_num_frames}): the video is made in windows of base_num_frames, "
                             "each continuing from this many frames of the one before (17 or 37 recommended)"))
            return problems
        if latent_count(overlap_history, temporal) >= latent_count(base_num_frames, temporal):
            problems.append(("overlap_history", overlap_history, f"fewer frames than base_num_frames "
                             f"({base_num_frames}): each window must add frames past the overlap"))
            return problems
    return problems + _block_problems(num_frames, base_num_frames, overlap_history, causal_block_size, temporal)


def _video_problems(num_frames: int, base: int, overlap: int | None, block: int | None, temporal: int,
                    video_frames: int) -> list[tuple]:
    """Video-to-video: the overlap is always used (diffusers needs it), leaves each window frames to add, and leaves
    the first window at least one block of the video; the new frames go past the overlap they start with."""
    if overlap is None:
        return [("overlap_history", None, "a number of frames when a video is given: the video's last overlap_history "
                 "frames are what the new frames continue from (17 or 37 recommended)")]
    if latent_count(overlap, temporal) >= latent_count(base, temporal):
        return [("overlap_history", overlap, f"fewer frames than base_num_frames ({base}): each window must add "
                 "frames past the overlap")]
    problems: list[tuple] = []
    if latent_count(num_frames, temporal) <= latent_count(overlap, temporal):
        near = latent_count(overlap, temporal) * temporal + 1
        problems.append(("num_frames", num_frames, f"more frames than overlap_history ({overlap}): the new frames "
                         f"start by re-making the overlap, so they must go past it (nearest valid: {near})"))
    if block is not None and video_prefix(video_frames, overlap, block, temporal) == 0:
        least = (block - 1) * temporal + 1  # the fewest frames that encode to one block
        field, value = ("video frames", video_frames) if video_frames < overlap else ("overlap_history", overlap)
        problems.append((field, value, f"at least {least} frames: the video's last overlap_history frames, cut to "
                         f"whole causal blocks of causal_block_size = {block}, are what the new frames continue from, "
                         "and fewer leave none (the video would condition nothing)"))
    if problems:
        return problems
    return _block_problems(num_frames, base, overlap, block, temporal)


def _block_problems(num_frames: int, base: int, overlap: int | None, block: int | None,
                    temporal: int) -> list[tuple]:
    """Every window's latent frames fill whole causal blocks (diffusers would leave the frames past the last whole
    block as noise)."""
    if block is None:
        return []
    windows = plan_windows(num_frames, base, overlap, block, temporal)
    if not any(w.frames % block for w in windows):
        return []
    near = _nearest_fitting(num_frames, base, overlap, block, temporal)
    sizes = ", ".join(str(w.frames) for w in windows)
    return [("num_frames", num_frames, f"a length whose windows of latent frames ({sizes} here) fill whole causal "
             f"blocks of causal_block_size = {block}" + (f" (nearest valid: {near})" if near else ""))]


def _nearest_fitting(num_frames: int, base: int, overlap: int | None, block: int, temporal: int) -> int | None:
    for distance in range(temporal, 64 * temporal * block, temporal):
        for candidate in (num_frames - distance, num_frames + distance):
            if candidate > 0 and not any(w.frames % block for w in
                                         plan_windows(candidate, base, overlap, block, temporal)):
                return candidate
    return None


@dataclass(frozen=True)
class ForcingPlan:
    """Request state of a diffusion-forcing request (the pipeline's `prepare`): its windows and knobs."""

    windows: tuple[Window, ...]  # the first one's prefix, if any, is the input image's latent frame
    ar_step: int
    causal_block_size: int
    addnoise_condition: float
    fps_index: int | None  # the model's frame-rate class (None: the model embeds none)


# -- the schedule -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ForcingSchedule:
    """Per iteration and latent frame: the timestep fed to the model (`timesteps` [N, F], int64) and whether the
    frame's scheduler steps (`update` [N, F] bool)."""

    timesteps: torch.Tensor
    update: torch.Tensor


def forcing_schedule(frames: int, timesteps: torch.Tensor, ar_step: int, pre_ready: int = 0,
                     block: int = 1, clean_end: int = 0) -> ForcingSchedule:
    """diffusers' `generate_timestep_matrix` for a window of `frames` latent frames (a multiple of `block`), whose
    first `pre_ready` are clean: block b's progress p_b (0: not started, n: its last step, n + 1: done) advances by
    one per iteration once block b - 1 is at its last step or beyond, else trails it by `ar_step`. `clean_end`
    frames more after them (the last image's) are fed at timestep 0 and never stepped: diffusers schedules them as
    further blocks and then overwrites their column, which only adds iterations that step nothing."""
    n = len(timesteps)
    template = torch.cat([torch.tensor([NOT_STARTED_TIMESTEP]), timesteps.cpu().long(), torch.tensor([0])])
    blocks = frames // block
    progress = torch.zeros(blocks, dtype=torch.long)
    progress[: pre_ready // block] = n + 1
    rows, updates = [], []
    while not bool((progress >= n).all()):
        row = torch.zeros(blocks, dtype=torch.long)
        for b in range(blocks):
            row[b] = progress[b] + 1 if b == 0 or progress[b - 1] >= n else row[b - 1] - ar_step
        row = row.clamp(0, n + 1)
        updates.append((row != progress) & (row != n + 1))
        rows.append(template[row])
        progress = row
    timesteps_per_frame = torch.stack(rows).repeat_interleave(block, dim=1)
    update = torch.stack(updates).repeat_interleave(block, dim=1)
    if clean_end:
        timesteps_per_frame = torch.cat([timesteps_per_frame, timesteps_per_frame.new_zeros(len(rows), clean_end)], 1)
        update = torch.cat([update, update.new_zeros(len(rows), clean_end)], 1)
    return ForcingSchedule(timesteps_per_frame, update)


def causal_blocks_mask(frames: int, block: int, tokens_per_frame: int, device) -> torch.Tensor | None:
    """The [S, S] attention mask of a window in causal blocks of `block` frames (a frame sees its block and the
    earlier ones: the causal Wan sampler's `block_causal_mask` with one chunk per block); None for blocks of 1
    (diffusers' transformer attends to every frame then)."""
    if block <= 1:
        return None
    return block_causal_mask([(s, s + block) for s in range(0, frames, block)], tokens_per_frame, device=device)


class Iteration(float):
    """One iteration of the schedule as the engine's loop sees it: a float (the timestep of the least denoised
    frame being stepped, what step hooks and the progress bar report) that knows its row."""

    index: int

    def __new__(cls, value: float, index: int) -> Iteration:
        obj = super().__new__(cls, value)
        obj.index = index
        return obj


class ForcingSteps:
    """The engine's step rule for one window (composer/engine/steps.py's protocol). It holds the window's latents
    (`latents`, fp32, stepped in place frame by frame); the loop's latents are the model's input made from them:
    the same, or with the first `prefix` frames re-noised when `addnoise` > 0 (fresh noise every iteration)."""

    def __init__(self, scheduler, schedule: ForcingSchedule, latents: torch.Tensor, prefix: int, addnoise: float,
                 generators: list[torch.Generator]):
        self.schedule = schedule
        self.latents = latents
        self.schedulers = [copy.deepcopy(scheduler) for _ in range(latents.shape[2])]
        self.prefix = prefix
        self.addnoise = addnoise if prefix else 0.0
        self.generators = generators
        moving = [row[mask] for row, mask in zip(schedule.timesteps, schedule.update)]
        self.timesteps = [Iteration(float(m.max()) if len(m) else 0.0, i) for i, m in enumerate(moving)]
        self._rows: torch.Tensor | None = None

    def model_input(self) -> torch.Tensor:
        """The model's input for the next iteration: the latents, their prefix re-noised when `addnoise` > 0."""
        if not self.addnoise:
            return self.latents
        factor = 0.001 * self.addnoise
        shape = (1, *self.latents.shape[1:2], self.prefix, *self.latents.shape[3:])
        noise = torch.cat([torch.randn(shape, generator=g) for g in self.generators]).to(self.latents.device)
        noised = self.latents.clone()
        noised[:, :, : self.prefix] = self.latents[:, :, : self.prefix] * (1.0 - factor) + noise * factor
        return noised

    def model_timestep(self, t: Iteration, latents: torch.Tensor) -> torch.Tensor:
        if self._rows is None or self._rows.device != latents.device:
            self._rows = self.schedule.timesteps.to(latents.device)
        row = self._rows[t.index].clone()
        if self.addnoise:
            row[: self.prefix] = int(self.addnoise)  # (diffusers writes it into an int64 timestep)
        return row.expand(latents.shape[0], -1)

    def step(self, index: int, t: Iteration, prediction: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        x, row = self.latents, self.schedule.timesteps[index]
        for f in torch.nonzero(self.schedule.update[index]).flatten().tolist():
            # In place, as diffusers does: UniPC keeps the `sample` it is given as `last_sample`, a view of the
            # frame here, so this write is what its corrector sees at the frame's next step.
            x[:, :, f] = self.schedulers[f].step(prediction[:, :, f], row[f], x[:, :, f], return_dict=False)[0]
        return x if index == len(self.timesteps) - 1 else self.model_input()


# -- the stages -------------------------------------------------------------------------------------------------------


class DiffusionForcingDenoisingStage(DenoisingStage):
    """Runs each window of the request's `ForcingPlan` through the engine (CFG, the request's scheduler per frame)
    and sets `batch.latents` to the whole video's latents."""

    def __init__(self, engine, num_channels: int, spatial_factor: int, progress: bool = True):
        super().__init__(engine, progress)
        self.num_channels = num_channels  # the noise's latent channels
        self.spatial_factor = spatial_factor  # the VAE's: latent height = height // spatial_factor

    def verify_input(self, batch: ForwardBatch, result: VerificationResult) -> None:
        result.add_check("timesteps", batch.timesteps, V.ndim(1))
        result.add_check("scheduler", batch.scheduler, V.not_none)
        result.add_check("prompt_embeds", batch.prompt_embeds, V.ndim(3))
        result.add_check("forcing plan (ForcingPlan)", batch.get(ForcingPlan, None), V.not_none)
        if batch.do_classifier_free_guidance:
            result.add_check("negative_prompt_embeds", batch.negative_prompt_embeds, V.ndim(3))

    def branch_inputs(self, batch: ForwardBatch, text: torch.Tensor) -> ModelInputs:
        inputs = super().branch_inputs(batch, text)
        plan = batch.get(ForcingPlan)
        if plan.fps_index is None:
            return inputs
        fps = torch.full((batch.batch_size,), plan.fps_index, dtype=torch.long, device=text.device)
        return dataclasses.replace(inputs, extra={**(inputs.extra or {}), "fps": fps})

    @torch.inference_mode()  # torch enters it around each resumption of the generator
    def forward_task(self, batch: ForwardBatch):
        """`forward` as a task: yields each iteration's transformer unit (composer/engine/loop.py)."""
        plan = batch.get(ForcingPlan)
        dtype = self.engine.transformer.dtype
        device = self.engine.transformer.device
        cond = self.branch_inputs(batch, batch.prompt_embeds.to(dtype))  # (UMT5 text: no PromptExtras to add)
        uncond, guidance = None, None
        if batch.do_classifier_free_guidance:
            uncond = self.branch_inputs(batch, batch.negative_prompt_embeds.to(dtype))
            guidance = self.guidance(batch)
        h, w = batch.height // self.spatial_factor, batch.width // self.spatial_factor
        _, ph, pw = self.engine.transformer.config.patch_size
        noise_generators = [torch.Generator("cpu").manual_seed(s) for s in batch.seeds]
        prefix_generators = [torch.Generator("cpu").manual_seed(s) for s in batch.seeds]
        video: torch.Tensor | None = None
        inputs = batch.get(ForcingInputs, None)
        end = None if inputs is None else inputs.end  # the last image's latent frame
        request = current_request()
        progress = self.progress and not (request is not None and request.background)
        for number, window in enumerate(plan.windows):
            latents = torch.cat([torch.randn((1, self.num_channels, window.frames, h, w), generator=g)
                                 for g in noise_generators]).to(device)
            if window.prefix:  # the request's image or video, or the overlap with the video so far
                source = (inputs.start[:, :, :window.prefix] if video is None else
                          video[:, :, window.prefix_from:window.prefix_from + window.prefix])
                latents[:, :, : window.prefix] = source.to(dtype)  # (diffusers' cast, into its fp32 latents)
            last = end if number == len(plan.windows) - 1 else None
            if last is not None:  # after the last window's frames, clean (diffusers' cast too)
                latents = torch.cat([latents, last.to(dtype).to(device, latents.dtype).expand(len(latents), -1, -1,
                                                                                              -1, -1)], dim=2)
            schedule = forcing_schedule(window.frames, batch.timesteps, plan.ar_step, window.prefix,
                                        plan.causal_block_size, 0 if last is None else last.shape[2])
            steps = ForcingSteps(batch.scheduler, schedule, latents, window.prefix, plan.addnoise_condition,
                                 prefix_generators)
            mask = causal_blocks_mask(window.frames, plan.causal_block_size, (h // ph) * (w // pw), device)
            branch = [b if mask is None else b.at(0, attn_mask=mask) for b in (cond, uncond) if b is not None]
            made = yield from self.engine.run_task(steps.model_input(), steps, branch[0],
                                                   branch[1] if guidance else None, guidance, run=number,
                                                   progress=progress)
            made = made[:, :, window.keep_from:window.frames]
            video = made if video is None else torch.cat([video, made], dim=2)
        batch.latents = video
        return batch
