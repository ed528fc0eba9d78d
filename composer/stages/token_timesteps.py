"""Per-token timesteps (Wan2.2 TI2V's `expand_timesteps`): the transformer gets one timestep per latent token,
`t * mask`, where the mask is 1 on tokens being denoised and 0 on clean conditioning tokens.

In text-to-video mode every token is denoised (the mask is all ones). Image-to-video mode conditions on the first
frame: its tokens get mask 0, so timestep 0, and hold the clean image latents. A stage attaches a `TimestepMask`
with the conditioning frame zeroed and the `KnownLatents` to the request (composer/stages/image_latents.py:
`FirstFrameLatentStage`) and puts the clean latents into the initial noise; `TokenTimestepSteps.step` puts them
back after every scheduler step. diffusers' WanImageToVideoPipeline (`expand_timesteps`) instead mixes them into
the model input before each call and into the result after the last step; both give the same model inputs and
result, as flow schedulers update every element on its own, so what the kept elements hold between steps changes
nothing else (tested equal to diffusers' frames).

The transformer is given the timesteps at the coarsest layout that is exact: [B] when the mask is all ones, [B, F]
(per latent frame) when it is constant over each frame (first-frame conditioning), [B, S] (per token) otherwise.
The values are the same as diffusers' per-token [B, S]; the coarser layouts only spare the [B, S, 6, D] fp32
modulation tensors per block (for TI2V-5B at 1280x704x121, 27280 tokens: ~2 GB per CFG row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from composer.batch import ForwardBatch
from composer.engine import SchedulerSteps
from composer.errors import InvalidInputError
from composer.stages.denoising import DenoisingStage


@dataclass(frozen=True)
class TimestepMask:
    """Which latent tokens are denoised (1.0) and which are clean conditioning (0.0): `values` [rows, F, h, w] on
    the transformer's token grid (latent grid / patch size), rows 1 (every video) or one per batch row, on the
    host. Request state: a pipeline attaches one to a batch to condition on given frames."""

    values: torch.Tensor

    @classmethod
    def denoise_all(cls, grid: tuple[int, int, int]) -> TimestepMask:
        """Every token denoised: text-to-video."""
        return cls(torch.ones((1, *grid)))

    def layout(self) -> torch.Tensor:
        """The mask at the coarsest exact layout: [rows] (all ones), [rows, F] or [rows, S]."""
        values = self.values.float()
        if bool((values == 1).all()):
            return values.new_ones(values.shape[:1])
        per_frame = values.flatten(2)
        if bool((per_frame == per_frame[:, :, :1]).all()):
            return per_frame[:, :, 0]
        return values.flatten(1)


@dataclass(frozen=True)
class KnownLatents:
    """Request state: clean latents held fixed while the rest is denoised. `values` [1 or rows, C, 1 or F, h, w]
    fp32 (broadcast over the latents), `denoised` [1, 1, F, h, w] bool: True where the latents are denoised, False
    where `values` are kept (TI2V image mode: frame 0)."""

    values: torch.Tensor
    denoised: torch.Tensor

    def apply(self, latents: torch.Tensor) -> torch.Tensor:
        """`latents` with the kept elements replaced by the clean values."""
        return torch.where(self.denoised, latents, self.values.to(latents.dtype))


class TokenTimestepSteps(SchedulerSteps):
    """A diffusers scheduler's steps with the transformer's timestep `t * mask` per token (see the module doc);
    `exact_layout=False` always gives the per-token [B, S] layout, as diffusers does. With `known`, the clean
    latents are put back after every step."""

    def __init__(self, scheduler, timesteps: torch.Tensor | None, mask: TimestepMask, exact_layout: bool = True,
                 known: KnownLatents | None = None):
        super().__init__(scheduler, timesteps)
        self.mask = mask.layout() if exact_layout else mask.values.float().flatten(1)
        self.known = known
        self._on_device: torch.Tensor | None = None

    def step(self, index, t, prediction, latents):
        latents = super().step(index, t, prediction, latents)
        return latents if self.known is None else self.known.apply(latents)

    def model_timestep(self, t, latents):
        if self._on_device is None or self._on_device.device != latents.device:
            self._on_device = self.mask.to(latents.device)
        rows = latents.shape[0]
        timestep = self._on_device * t
        return timestep.expand(rows, *timestep.shape[1:]) if timestep.shape[0] == 1 else timestep


class TokenTimestepDenoisingStage(DenoisingStage):
    """DenoisingStage for a transformer trained with per-token timesteps (Wan2.2 TI2V): the request's
    `TimestepMask` (or, without one, every token denoised) makes the transformer's timesteps."""

    def __init__(self, engine, patch_size: tuple[int, int, int], progress: bool = True, exact_layout: bool = True):
        super().__init__(engine, progress)
        self.patch_size = tuple(patch_size)
        self.exact_layout = exact_layout

    def token_grid(self, latents: torch.Tensor) -> tuple[int, int, int]:
        return tuple(n // p for n, p in zip(latents.shape[2:], self.patch_size))

    def steps(self, batch: ForwardBatch) -> TokenTimestepSteps:
        grid = self.token_grid(batch.latents)
        mask = batch.get(TimestepMask, None) or TimestepMask.denoise_all(grid)
        rows = batch.latents.shape[0]
        if tuple(mask.values.shape[1:]) != grid or mask.values.shape[0] not in (1, rows):
            raise InvalidInputError(f"TimestepMask of shape {list(mask.values.shape)} for a token grid of {grid} "
                                    f"({math.prod(grid)} tokens) and {rows} rows: expected [1 or {rows}, *{grid}]")
        known = batch.get(KnownLatents, None)
        return TokenTimestepSteps(batch.scheduler, batch.timesteps, mask, self.exact_layout, known)
