"""Wan VACE (diffusers' `WanVACEPipeline` folders): video generation controlled by a video, its mask and reference
images. Wan2.1 VACE 1.3B / 14B (one transformer), and Wan2.2 VACE folders (two experts, `boundary_ratio`).

Defaults are the released Wan2.1 VACE models' (diffusers' WanVACEPipeline: 832x480, 81 frames, 50 steps, CFG 5.0,
`conditioning_scale` 1.0; UniPC at flow shift 3.0 for 480p, as diffusers' example sets it). As for every Wan family, a
value the folder states (its scheduler's shift, model_index.json's `boundary_ratio`) wins over the family's. The
knobs, under diffusers' names, are read by composer/stages/vace.py, which holds their rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from composer.configs.base import PipelineConfig, SamplingParam
from composer.configs.wan import WAN_NEGATIVE_PROMPT
from composer.configs.wan22 import WAN22_NEGATIVE_PROMPT, guidance_scale_2_field
from composer.registry.configs import register_configs

VACE_VIDEO_HELP = ("VACE: the control video (a file; Python also takes uint8 frames [T, H, W, 3] or a list of "
                   "images): what the video follows, where the mask keeps it; resized to height x width, its length "
                   "(4k + 1 frames) is num_frames. Without it (reference images only) the control is blank")
MASK_HELP = ("VACE: which parts of the control video to generate (white) and which to keep (black), a video of the "
             "control video's length and size (a file, or frames as for video); default: generate everything")
REFERENCE_HELP = ("VACE: reference images the video draws its subjects from (files; Python also takes PIL images, "
                  "arrays or tensors, one or a list), each fitted into the frame on a white canvas")
SCALE_HELP = ("VACE: how strongly the control steers the video, one value for every control block or one per block "
              "(len(vace_layers) of the transformer config); 0 ignores the control")


@dataclass
class WanVACEConfig(PipelineConfig):
    """Wan2.1 VACE: UMT5 prompts of 512 tokens, as Wan2.1 T2V."""

    text_encoder_max_length: int = 512


@dataclass
class WanVACESamplingParam(SamplingParam):
    """Wan2.1 VACE at 480p: 832x480, 81 frames at 16 fps, 50 steps, CFG 5.0, conditioning scale 1.0; the flow shift
    is the folder's scheduler's (3.0 fills in for a folder that states none). The control inputs are diffusers'
    `video`, `mask`, `reference_images` and `conditioning_scale`."""

    negative_prompt: str | None = WAN_NEGATIVE_PROMPT
    height: int = 480
    width: int = 832
    num_frames: int = 81
    num_inference_steps: int = 50
    guidance_scale: float = 5.0
    flow_shift: float | None = 3.0
    fps: int = 16
    video: Any = field(default=None, metadata={"help": VACE_VIDEO_HELP})
    mask: Any = field(default=None, metadata={"help": MASK_HELP})
    reference_images: list[Any] | None = field(default=None, metadata={"help": REFERENCE_HELP,
                                                                       "aliases": ("--reference-image",)})
    conditioning_scale: list[float] = field(default_factory=lambda: [1.0], metadata={"help": SCALE_HELP})

    def check_inputs(self, result: Any, limits: Any) -> None:
        from composer.stages.vace import check_vace_inputs

        check_vace_inputs(self, result, limits.temporal_factor or 4)


@dataclass
class Wan22VACEConfig(PipelineConfig):
    """Wan2.2 VACE: two experts (the high-noise one for timesteps >= boundary_ratio * num_train_timesteps), each a
    VACE transformer. Not a WanVACEConfig, so a Wan2.1 VACE folder never takes this family."""

    text_encoder_max_length: int = 512
    # The folder's model_index.json states it; this fills in for none (Wan2.2 T2V A14B's).
    boundary_ratio: float = 0.875


@dataclass
class Wan22VACESamplingParam(WanVACESamplingParam):
    """Wan2.2 VACE at 720p: 1280x720, 81 frames at 16 fps, 40 steps, CFG 4.0 (high noise) / 3.0 (low noise): Wan2.2
    T2V A14B's settings, which its VACE experts share (the folder's scheduler states the shift)."""

    negative_prompt: str | None = WAN22_NEGATIVE_PROMPT
    height: int = 720
    width: int = 1280
    num_inference_steps: int = 40
    guidance_scale: float = 4.0
    guidance_scale_2: float | None = guidance_scale_2_field(3.0)
    flow_shift: float | None = 12.0


register_configs(
    WanVACEConfig,
    WanVACESamplingParam,
    hf_model_paths=["Wan-AI/Wan2.1-VACE-1.3B-diffusers", "Wan-AI/Wan2.1-VACE-14B-diffusers"],
    model_detectors=[lambda path, class_name: class_name == "WanVACEPipeline"],
    name="wan2.1-vace",
)
# Only two-expert folders reach this detector: composer's WanVACEPipeline hands them to a pipeline asking for this
# config (composer/pipelines/wan_vace.py).
register_configs(
    Wan22VACEConfig,
    Wan22VACESamplingParam,
    model_detectors=[lambda path, class_name: class_name == "WanVACEPipeline"],
    name="wan2.2-vace",
)
