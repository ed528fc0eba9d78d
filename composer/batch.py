"""ForwardBatch: the one object that flows through a pipeline's stages.

It holds what a request asks for and what the stages make of it. Family-specific state does not get a
field here: a family's stages keep it in `extra` under a documented key.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class ForwardBatch:
    """State of one generation request as it moves through the stages."""

    # What was asked (filled from SamplingParam).
    prompt: list[str]
    negative_prompt: list[str] | None = None
    height: int = 480
    width: int = 832
    num_frames: int = 81
    num_inference_steps: int = 50
    guidance_scale: float = 5.0
    flow_shift: float | None = None
    seed: int = 0

    # Text encoding.
    prompt_embeds: torch.Tensor | None = None
    negative_prompt_embeds: torch.Tensor | None = None

    # Schedule: a per-request scheduler instance (schedulers carry state between steps) and its timesteps.
    scheduler: Any = None
    timesteps: torch.Tensor | None = None

    # Latents: the initial noise, then the denoised latents.
    latents: torch.Tensor | None = None
    # Latents of given frames to continue from (an image or video the request starts with).
    start_latents: torch.Tensor | None = None
    # The request's CPU generator, seeded with `seed`, for samplers that draw noise as they go.
    generator: torch.Generator | None = None

    # Output: uint8 frames [B, T, H, W, 3] on the CPU.
    frames: np.ndarray | None = None

    # Seconds per stage (host time; a stage that ends on the host, like decoding, includes device work).
    timings: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return len(self.prompt) if isinstance(self.prompt, list) else 1

    @property
    def do_classifier_free_guidance(self) -> bool:
        return self.guidance_scale > 1.0
