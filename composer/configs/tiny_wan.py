"""The embedded default model (a tiny Wan2.1 T2V built locally): small, quick defaults for a CPU demo."""

from __future__ import annotations

from dataclasses import dataclass

from composer.configs.base import SamplingParam
from composer.configs.wan import WanT2VConfig
from composer.registry.configs import register_configs


@dataclass
class TinyWanSamplingParam(SamplingParam):
    """128x128, 17 frames at 8 fps, 8 steps, CFG 5.0: a couple of seconds on two CPU cores."""

    negative_prompt: str | None = ""
    height: int = 128
    width: int = 128
    num_frames: int = 17
    num_inference_steps: int = 8
    guidance_scale: float = 5.0
    fps: int = 8


# The folder composer builds is named after the id's last part, so it resolves by short name.
register_configs(
    WanT2VConfig,
    TinyWanSamplingParam,
    hf_model_paths=["composer/tiny-wan2.1-t2v-random"],
    name="tiny-wan2.1-t2v",
)
