"""Classifier-free guidance: combine the prompt's and the negative prompt's predictions."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ClassifierFreeGuidance:
    """`uncond + scale * (cond - uncond)`.

    `fp32`: combine in fp32 (the causal sampler, whose x0 is computed in float64 anyway) rather than in the
    model's output dtype (what diffusers' WanPipeline does, so bf16 runs match it).
    """

    scale: float
    fp32: bool = False

    def combine(self, cond: torch.Tensor, uncond: torch.Tensor) -> torch.Tensor:
        if self.fp32:
            cond, uncond = cond.float(), uncond.float()
        return uncond + self.scale * (cond - uncond)
