"""Classifier-free guidance: combine the prompt's and the negative prompt's predictions."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ClassifierFreeGuidance:
    """`uncond + scale * (cond - uncond)`.

    `fp32`: combine in fp32 (the causal sampler, whose x0 is computed in float64 anyway) rather than in the
    model's output dtype (what diffusers' WanPipeline does, so bf16 runs match it).
    `rescale`: mix the result with itself rescaled to the prompt prediction's standard deviation (per video), by this
    fraction (diffusers' `guidance_rescale`, "Common Diffusion Noise Schedules and Sample Steps are Flawed").
    `start` / `stop`: guidance only for steps [int(start * n), int(stop * n)) of n; the others run the prompt's
    branch alone (diffusers' guiders' `start` / `stop`).
    """

    scale: float
    fp32: bool = False
    rescale: float = 0.0
    start: float = 0.0
    stop: float = 1.0

    def active(self, step: int, num_steps: int) -> bool:
        """Whether step `step` of `num_steps` runs both branches."""
        return int(self.start * num_steps) <= step < int(self.stop * num_steps)

    def combine(self, cond: torch.Tensor, uncond: torch.Tensor) -> torch.Tensor:
        if self.fp32:
            cond, uncond = cond.float(), uncond.float()
        guided = uncond + self.scale * (cond - uncond)
        return guided if self.rescale <= 0 else self.rescaled(guided, cond)

    def rescaled(self, guided: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """`guided` pulled towards cond's per-video standard deviation by `rescale` (diffusers' rescale_noise_cfg)."""
        dims = list(range(1, cond.ndim))
        matched = guided * (cond.std(dim=dims, keepdim=True) / guided.std(dim=dims, keepdim=True))
        return self.rescale * matched + (1 - self.rescale) * guided
