"""ForwardBatch: the one object that flows through a pipeline's stages, and the chunks streaming stages yield.

It holds what a request asks for and what the stages make of it. What a request carries beyond the common
fields (a causal plan, start frames, ...) is a typed object attached with `batch.attach(obj)` and read with
`batch.get(Type)`: one object per type, never string keys, and no field per model family.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch

T = TypeVar("T")


@dataclass
class RequestStats:
    """Profile of a request, filled as it runs (a family may extend it, e.g. CausalStats)."""

    time_to_first_frame: float | None = None  # seconds from the request to its first frames being ready
    total_seconds: float | None = None
    frames: int = 0  # decoded frames
    # Streams (VideoStream): the frame rate delivered, frames over the seconds from the stream's first read to its
    # latest chunk (a session's time between extends left out), and the rate asked for (stream_video(target_fps=)).
    fps: float | None = None
    target_fps: float | None = None

    @property
    def frames_per_second(self) -> float | None:
        if not self.total_seconds or not self.frames:
            return None
        return self.frames / self.total_seconds

    def summary(self) -> str:
        parts = []
        if self.time_to_first_frame is not None:
            parts.append(f"time to first frame {self.time_to_first_frame:.2f} s")
        if self.frames_per_second is not None:
            parts.append(f"{self.frames_per_second:.1f} frames/s ({self.frames} frames)")
        if self.target_fps is not None:
            reached = "-" if self.fps is None else f"{self.fps:.1f}"
            parts.append(f"stream {reached} fps for a target of {self.target_fps:g}")
        return ", ".join(parts)


@dataclass
class LatentBlock:
    """A streaming denoiser's finished piece: clean latents [B, C, n, h, w] (fp32) and where it sits."""

    index: int
    segment: int
    prompt: str
    start_frame: int  # latent frame index in the whole video
    latents: torch.Tensor
    seconds: float


@dataclass
class VideoChunk:
    """Frames decoded from one block (or from the start frames), in video order."""

    frames: np.ndarray  # uint8 [t, H, W, 3]
    block_index: int | None  # None for the start frames
    segment: int
    prompt: str
    start_frame: int  # index of the chunk's first frame in the video
    block_seconds: float  # denoising time of the block (0 for the start frames)
    decode_seconds: float
    since_start: float  # seconds from the request to this chunk being ready


@dataclass
class EmbeddedGuidance:
    """Attached by a guidance-distilled family (HunyuanVideo): the request's `guidance_scale` is a transformer
    input, and classifier-free guidance with the negative prompt has its own scale, `true_cfg_scale` (on when it
    is > 1 and a negative prompt is given: diffusers' names and meanings)."""

    true_cfg_scale: float = 1.0


@dataclass
class GuidanceSettings:
    """Attached by a family whose folder has a diffusers guider (HunyuanVideo-1.5): classifier-free guidance beyond
    its scale, as `composer.engine.ClassifierFreeGuidance` takes it (`rescale`; CFG only for steps
    [int(start * n), int(stop * n)))."""

    rescale: float = 0.0
    start: float = 0.0
    stop: float = 1.0


@dataclass
class PromptExtras:
    """What a text stage makes beyond `prompt_embeds` for a transformer that takes it (HunyuanVideo): the
    text's token mask [B, L] (1: a token, 0: right padding; None: no padding) and a pooled text vector [B, D],
    for the prompt and, under CFG, the negative prompt; a second text encoder's states [B, L2, D2] with their mask
    (HunyuanVideo-1.5's ByT5 glyph text; None: no tokens)."""

    mask: torch.Tensor | None = None
    pooled: torch.Tensor | None = None
    negative_mask: torch.Tensor | None = None
    negative_pooled: torch.Tensor | None = None
    text_2: torch.Tensor | None = None
    mask_2: torch.Tensor | None = None
    negative_text_2: torch.Tensor | None = None
    negative_mask_2: torch.Tensor | None = None


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
    # The request's CPU generator, seeded with `seed`, for samplers that draw noise as they go (one-row requests).
    generator: torch.Generator | None = None

    # Output: uint8 frames [B, T, H, W, 3] on the CPU.
    frames: np.ndarray | None = None

    # Seconds per stage (host time; a stage that ends on the host, like decoding, includes device work).
    timings: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    # The request's profile (RequestStats or a family's subclass), when its pipeline keeps one.
    stats: RequestStats | None = None
    # When the request started (time.perf_counter()), for time-to-first-frame figures.
    started: float = field(default_factory=time.perf_counter)
    # Typed request state beyond the common fields, one object per type (see `attach` / `get`).
    state: dict[type, Any] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return len(self.prompt) if isinstance(self.prompt, list) else 1

    @property
    def seeds(self) -> list[int]:
        """Each row's seed: `seed + i` for row i, so a row of a batched request is the same video as a
        single request with that seed (each row draws its noise from its own generator)."""
        return [self.seed + i for i in range(self.batch_size)]

    @property
    def do_classifier_free_guidance(self) -> bool:
        """Whether the negative prompt is a second guidance branch: guidance_scale > 1, or for a guidance-distilled
        family (EmbeddedGuidance attached) true_cfg_scale > 1 with a negative prompt given."""
        embedded = self.state.get(EmbeddedGuidance)
        if embedded is None:
            return self.guidance_scale > 1.0
        return embedded.true_cfg_scale > 1.0 and self.negative_prompt is not None

    @property
    def cfg_scale(self) -> float:
        """The classifier-free guidance scale: guidance_scale, or true_cfg_scale where guidance is embedded."""
        embedded = self.state.get(EmbeddedGuidance)
        return self.guidance_scale if embedded is None else embedded.true_cfg_scale

    @property
    def embedded_guidance(self) -> float | None:
        """The guidance scale the transformer takes as an input (None: the family embeds none)."""
        return self.guidance_scale if EmbeddedGuidance in self.state else None

    def attach(self, obj: Any) -> None:
        """Attach a typed piece of request state (replacing any earlier one of the same type)."""
        self.state[type(obj)] = obj

    def get(self, cls: type[T], default: Any = ...) -> T:
        """The attached object of type `cls`; without a default, a missing one is a KeyError naming it."""
        if cls in self.state:
            return self.state[cls]
        if default is not ...:
            return default
        raise KeyError(f"the request carries no {cls.__name__} (attached: {[t.__name__ for t in self.state]})")
