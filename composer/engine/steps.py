"""Step rules: how a denoising loop turns a model prediction into the next latents.

- `SchedulerSteps`: a diffusers scheduler (the model folder's), one timestep for the whole latent video;
- `FewStepFlow`: the few-step flow-matching loop of Self-Forcing / CausVid (per-frame timesteps; x0 from the
  flow, then re-noised to the next step's level with fresh noise from the request's generator).
"""

from __future__ import annotations

from typing import Protocol

import torch

from composer.platform import platform_for
from composer.schedulers import FlowMatchTable


class StepRule(Protocol):
    timesteps: list | torch.Tensor

    def model_timestep(self, t, latents: torch.Tensor) -> torch.Tensor:
        """The transformer's timestep argument for step value `t`."""

    def step(self, index: int, t, prediction: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """The latents after step `index` (after the last step: the clean sample)."""


class SchedulerSteps:
    """A diffusers scheduler with its timesteps set (it carries state between steps: one per request)."""

    def __init__(self, scheduler, timesteps: torch.Tensor | None = None):
        self.scheduler = scheduler
        self.timesteps = scheduler.timesteps if timesteps is None else timesteps

    def model_timestep(self, t, latents):
        return t.expand(latents.shape[0])

    def step(self, index, t, prediction, latents):
        return self.scheduler.step(prediction, t, latents, return_dict=False)[0]


class FewStepFlow:
    """x0 = x_t - sigma(t) v (float64); unless last: x = (1 - sigma') x0 + sigma' eps with eps drawn from
    `generator` as one [B * frames, C, h, w] draw per step (Self-Forcing's order, so a seed keeps its noise)."""

    def __init__(self, table: FlowMatchTable, timesteps: list[float], generator: torch.Generator):
        self.table = table
        self.timesteps = list(timesteps)
        self.generator = generator

    def model_timestep(self, t, latents):
        return torch.full(latents.shape[:1] + latents.shape[2:3], float(t), device=latents.device)

    def step(self, index, t, prediction, latents):
        x0 = self.table.to_x0(prediction, latents, t)
        if index == len(self.timesteps) - 1:
            return x0
        bsz, channels, n, h, w = latents.shape
        eps = torch.randn((bsz * n, channels, h, w), generator=self.generator)
        eps = platform_for(latents.device).to_device(eps.unflatten(0, (bsz, n)).permute(0, 2, 1, 3, 4), latents.device)
        return self.table.add_noise(x0, eps, self.timesteps[index + 1])
