"""Wan2.2: the two-expert A14B models (text-to-video and image-to-video) and TI2V-5B (text- or image-to-video).

Defaults are the released models' (Wan-Video/Wan2.2 `wan/configs/wan_t2v_A14B.py`, `wan_i2v_A14B.py` and
`wan_ti2v_5B.py`, and the diffusers model cards of Wan-AI/Wan2.2-{T2V-A14B,I2V-A14B,TI2V-5B}-Diffusers). As for Wan2.1, a
value the model folder states (its scheduler's shift, model_index.json's `boundary_ratio`) wins over the family's.

A Wan2.2 folder's model_index.json has `_class_name` "WanPipeline" like Wan2.1's; composer's WanPipeline hands it
to the Wan2.2 pipeline its entries call for (composer/pipelines/wan22.py: `transformer_2` + `boundary_ratio`: two
experts; `expand_timesteps`: TI2V), whose PipelineConfig is one of these, so only these families are candidates.
The I2V A14B folder names `WanImageToVideoPipeline`, as Wan2.1 I2V's does; composer's WanImageToVideoPipeline hands
it on the same way (composer/pipelines/wan22_i2v.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from composer.configs.base import PipelineConfig, SamplingParam
from composer.configs.wan_i2v import input_image_field
from composer.registry.configs import register_configs

# The negative prompt of the Wan2.2 release (`sample_neg_prompt` in its shared config), as the model cards use it.
WAN22_NEGATIVE_PROMPT = (
    "色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量，JPEG压缩残留，"
    "丑陋的，残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，形态畸形的肢体，手指融合，"
    "静止不动的画面，杂乱的背景，三条腿，背景人很多，倒着走"
)


def guidance_scale_2_field(default: float) -> Any:
    """The low-noise expert's CFG scale knob of a two-expert (A14B) family, with the family's default."""
    return field(default=default, metadata={
        "help": "classifier-free guidance scale of the low-noise expert (Wan2.2 A14B; default: the family's value, "
                "or guidance_scale when unset); guidance_scale is the high-noise expert's"})


@dataclass
class Wan22A14BConfig(PipelineConfig):
    """Wan2.2 T2V A14B: two 14B experts, the high-noise one for timesteps >= boundary_ratio * num_train_timesteps,
    the low-noise one below. UMT5 prompts of 512 tokens as Wan2.1."""

    text_encoder_max_length: int = 512
    # The folder's model_index.json states it (0.875 in the released T2V folder); this fills in for none.
    boundary_ratio: float = 0.875
    # No TeaCache polynomial has been fitted for the Wan2.2 experts: the raw relative change is used (logged).
    teacache_coefficients: dict[int, tuple[float, ...]] = field(default_factory=dict)


@dataclass
class Wan22A14BSamplingParam(SamplingParam):
    """Wan2.2 T2V A14B at 720p: 1280x720, 81 frames at 16 fps, 40 steps, CFG 4.0 for the high-noise expert and
    3.0 for the low-noise one, flow shift 12.0 (the release's `sample_shift`; the folder's scheduler config
    wins when it states one)."""

    negative_prompt: str | None = WAN22_NEGATIVE_PROMPT
    height: int = 720
    width: int = 1280
    num_frames: int = 81
    num_inference_steps: int = 40
    guidance_scale: float = 4.0
    guidance_scale_2: float | None = guidance_scale_2_field(3.0)
    flow_shift: float | None = 12.0
    fps: int = 16


@dataclass
class Wan22TI2VConfig(PipelineConfig):
    """Wan2.2 TI2V-5B: one transformer over 48-channel latents of the Wan2.2 VAE (16x spatial compression,
    4x temporal), timesteps per latent token (`expand_timesteps`). UMT5 prompts of 512 tokens."""

    text_encoder_max_length: int = 512
    expand_timesteps: bool = True
    teacache_coefficients: dict[int, tuple[float, ...]] = field(default_factory=dict)


@dataclass
class Wan22TI2V5BSamplingParam(SamplingParam):
    """Wan2.2 TI2V-5B at 720p: 1280x704, 121 frames at 24 fps, 50 steps, CFG 5.0, flow shift 5.0 (the release's
    `sample_shift`; the folder's scheduler config wins when it states one)."""

    negative_prompt: str | None = WAN22_NEGATIVE_PROMPT
    height: int = 704
    width: int = 1280
    num_frames: int = 121
    num_inference_steps: int = 50
    guidance_scale: float = 5.0
    flow_shift: float | None = 5.0
    fps: int = 24
    image: Any = input_image_field(
        "TI2V-5B: an optional first frame (image-to-video mode; without it, text-to-video), an image file (Python "
        "also takes a PIL image, a uint8 numpy array [H, W, 3] or a torch tensor); resized to height x width"
    )


@dataclass
class Wan22I2VA14BConfig(PipelineConfig):
    """Wan2.2 I2V A14B: two 14B experts as T2V A14B (switching at boundary_ratio * num_train_timesteps), each
    taking the noise and the image condition (frame mask + VAE latents of [image, 0, ...]) on the channel axis; no
    CLIP image encoder. Not a Wan22A14BConfig, so a text-to-video folder never takes this family."""

    text_encoder_max_length: int = 512
    # The folder's model_index.json states it (0.9 in the released I2V folder); this fills in for none.
    boundary_ratio: float = 0.9
    teacache_coefficients: dict[int, tuple[float, ...]] = field(default_factory=dict)


@dataclass
class Wan22I2VA14BSamplingParam(SamplingParam):
    """Wan2.2 I2V A14B at 720p: 1280x720 (832x480 for 480p), 81 frames at 16 fps, 40 steps, CFG 3.5 for both
    experts, flow shift 5.0 (the release's `wan_i2v_A14B.py`: sample_shift 5.0, sample_steps 40, boundary 0.900,
    sample_guide_scale (3.5, 3.5); the folder's scheduler config wins when it states a shift). The input image is
    resized to the output size (no crop: give an image of the video's aspect ratio)."""

    negative_prompt: str | None = WAN22_NEGATIVE_PROMPT
    height: int = 720
    width: int = 1280
    num_frames: int = 81
    num_inference_steps: int = 40
    guidance_scale: float = 3.5
    guidance_scale_2: float | None = guidance_scale_2_field(3.5)
    flow_shift: float | None = 5.0
    fps: int = 16
    image: Any = input_image_field()


# Only Wan2.2 folders reach these detectors: the pipeline WanPipeline hands them to asks for these configs.
register_configs(
    Wan22A14BConfig,
    Wan22A14BSamplingParam,
    hf_model_paths=["Wan-AI/Wan2.2-T2V-A14B-Diffusers"],
    model_detectors=[lambda path, class_name: class_name == "WanPipeline"],
    name="wan2.2-t2v-a14b",
)
# A TI2V folder names WanPipeline; diffusers users run its image mode with WanImageToVideoPipeline, whose
# save_pretrained names that class instead: both reach the TI2V pipeline.
register_configs(
    Wan22TI2VConfig,
    Wan22TI2V5BSamplingParam,
    hf_model_paths=["Wan-AI/Wan2.2-TI2V-5B-Diffusers"],
    model_detectors=[lambda path, class_name: class_name in ("WanPipeline", "WanImageToVideoPipeline")],
    name="wan2.2-ti2v-5b",
)
# Only Wan2.2 I2V folders reach this detector: composer's WanImageToVideoPipeline hands them to a pipeline asking
# for this config.
register_configs(
    Wan22I2VA14BConfig,
    Wan22I2VA14BSamplingParam,
    hf_model_paths=["Wan-AI/Wan2.2-I2V-A14B-Diffusers"],
    model_detectors=[lambda path, class_name: class_name == "WanImageToVideoPipeline"],
    name="wan2.2-i2v-a14b",
)
