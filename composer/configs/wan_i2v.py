"""Wan2.1 image-to-video and first-last-frame-to-video: defaults of the released diffusers checkpoints
(Wan-AI/Wan2.1-I2V-14B-{480P,720P}-Diffusers, Wan-AI/Wan2.1-FLF2V-14B-720P-Diffusers)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from composer.configs.base import PipelineConfig, SamplingParam
from composer.configs.wan import WAN_NEGATIVE_PROMPT
from composer.registry.configs import register_configs

IMAGE_HELP = ("image-to-video models: the first frame, an image file (Python also takes a PIL image, a uint8 numpy "
              "array [H, W, 3] or a torch tensor); resized to height x width")


def input_image_field(help: str = IMAGE_HELP) -> Any:
    """The `image` sampling knob of an image-conditioned family (None: not given)."""
    return field(default=None, metadata={"help": help})


@dataclass
class WanI2VConfig(PipelineConfig):
    """Wan2.1 I2V / FLF2V: UMT5 prompts of 512 tokens, as T2V; the image side comes from the folder (its CLIP
    image processor and encoder, the transformer's image cross-attention). Not a WanT2VConfig, so a text-to-video
    folder never takes an image family (nor the T2V TeaCache fit: step caching runs without a rescaling here)."""

    text_encoder_max_length: int = 512


@dataclass
class WanI2V480PSamplingParam(SamplingParam):
    """Wan2.1 I2V at 480p: 832x480, 81 frames at 16 fps, 50 steps (the diffusers model card; the original release
    samples 40), CFG 5.0, flow shift 3.0 where the folder's scheduler config states none. The input image is
    resized to the output size as diffusers does (no crop: give an image of the video's aspect ratio)."""

    negative_prompt: str | None = WAN_NEGATIVE_PROMPT
    height: int = 480
    width: int = 832
    num_frames: int = 81
    num_inference_steps: int = 50
    guidance_scale: float = 5.0
    flow_shift: float | None = 3.0
    fps: int = 16
    image: Any = input_image_field()
    last_image: Any = field(
        default=None,
        metadata={"help": "first-last-frame models (FLF2V): the last frame, given like image"},
    )


@dataclass
class WanI2V720PSamplingParam(WanI2V480PSamplingParam):
    """Wan2.1 I2V at 720p: 1280x720, flow shift 5.0 (the model card's value for 720p), else as at 480p."""

    height: int = 720
    width: int = 1280
    flow_shift: float | None = 5.0


@dataclass
class WanFLF2VSamplingParam(WanI2V720PSamplingParam):
    """Wan2.1 FLF2V at 720p: 1280x720, 81 frames between `image` and `last_image`, 50 steps, CFG 5.0, flow
    shift 16 (the original release's default for flf2v) where the folder states none."""

    flow_shift: float | None = 16.0


register_configs(
    WanI2VConfig,
    WanI2V480PSamplingParam,
    hf_model_paths=["Wan-AI/Wan2.1-I2V-14B-480P-Diffusers"],
    # every I2V folder not named otherwise gets the 480p defaults (the size flags change them)
    model_detectors=[lambda path, class_name: class_name == "WanImageToVideoPipeline"],
    name="wan2.1-i2v-480p",
)
register_configs(
    WanI2VConfig,
    WanI2V720PSamplingParam,
    hf_model_paths=["Wan-AI/Wan2.1-I2V-14B-720P-Diffusers"],
    model_detectors=[],
    name="wan2.1-i2v-720p",
)
register_configs(
    WanI2VConfig,
    WanFLF2VSamplingParam,
    hf_model_paths=["Wan-AI/Wan2.1-FLF2V-14B-720P-Diffusers"],
    model_detectors=[],
    name="wan2.1-flf2v-720p",
)
