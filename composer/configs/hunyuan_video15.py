"""HunyuanVideo-1.5 text- and image-to-video: defaults of the released 480p checkpoints
(hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v, -480p_i2v).

Sources: diffusers 0.42.1's `HunyuanVideo15Pipeline`: 121 frames, 50 steps, the size from the transformer's
`target_size` (640 in the 480p folder: 848x480; 960 in the 720p one: 1280x720), no negative prompt (an empty one
under CFG), the guider's guidance scale and the scheduler's shift (the folder's: the values here fill in where a
folder states none); the system message, the 108-token crop, the 1000 prompt tokens, the hidden layer read
(`num_hidden_layers_to_skip = 2`) and ByT5's 256 tokens are the pipeline's. fps 24 is the release's (its sampling
script writes 24 fps videos; diffusers' docstring example exports at 15). Image-to-video has the same defaults, and
its video is the request's size (diffusers' I2V pipeline takes none: it picks the bucket nearest the image's aspect
ratio, `composer.pipelines.hunyuan_video15.default_size`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from composer.configs.base import PipelineConfig, SamplingParam
from composer.configs.wan_i2v import input_image_field
from composer.registry.configs import register_configs

# The system turn HunyuanVideo-1.5's Qwen2.5-VL reads prompts after (the reference's, its runs of spaces included:
# they come from line continuations inside its string literal).
HUNYUAN15_SYSTEM_MESSAGE = (" " * 9).join([
    "You are a helpful assistant. Describe the video by detailing the following aspects:",
    "1. The main content and theme of the video.",
    "2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects.",
    "3. Actions, events, behaviors temporal relationships, physical movement changes of the objects.",
    "4. background environment, light, style and atmosphere.",
    "5. camera angles, movements, and transitions used in the video.",
])


@dataclass
class HunyuanVideo15TextConfig(PipelineConfig):
    """HunyuanVideo-1.5: Qwen2.5-VL prompts through its chat template after a system turn (1000 prompt tokens), the
    states of the third-last hidden layer; the prompt's quoted text through ByT5 (256 tokens). The base of the text-
    and image-to-video configs (siblings: a folder of one is never a candidate for the other's family)."""

    text_encoder_max_length: int = 1000  # prompt tokens kept after the crop (the reference's tokenizer_max_length)
    clean_prompts: bool = False  # the reference pipeline does not clean prompts
    system_message: str = HUNYUAN15_SYSTEM_MESSAGE
    # Tokens cropped off the front (the system turn and the user turn's header). None: counted with the folder's
    # tokenizer and chat template (the reference hard-codes 108 for the released tokenizer).
    prompt_template_crop_start: int | None = None
    num_hidden_layers_to_skip: int = 2  # read hidden_states[-(skip + 1)]
    glyph_max_length: int = 256  # ByT5 tokens of the prompt's quoted text


@dataclass
class HunyuanVideo15Config(HunyuanVideo15TextConfig):
    """HunyuanVideo-1.5 text-to-video."""

    # Whether the family's requests need an input image (its transformer always takes the condition channels:
    # zeros for text-to-video), for the request check before loading.
    requires_image: ClassVar[bool] = False


@dataclass
class HunyuanVideo15I2VConfig(HunyuanVideo15TextConfig):
    """HunyuanVideo-1.5 image-to-video: the first frame's latents as the condition, its SigLIP states as text tokens."""

    requires_image: ClassVar[bool] = True


@dataclass
class HunyuanVideo15SamplingParam(SamplingParam):
    """HunyuanVideo-1.5 at 480p: 848x480, 121 frames at 24 fps, 50 steps, CFG 6.0 with an empty negative prompt.
    The folder states the size (its transformer's target_size), the guidance scale and rescale (its guider) and the
    flow shift (its scheduler); the values here only fill in where it states none."""

    negative_prompt: str | None = None
    height: int = 480
    width: int = 848
    num_frames: int = 121
    num_inference_steps: int = 50
    guidance_scale: float = 6.0
    guidance_rescale: float = field(default=0.0, metadata={
        "help": "HunyuanVideo-1.5: pull the guided prediction towards the prompt prediction's standard deviation "
                "by this fraction, 0 to 1 (diffusers' guider guidance_rescale; the folder's guider states the default)"})
    flow_shift: float | None = 5.0
    fps: int = 24

    def check_inputs(self, result: Any, limits: Any) -> None:
        """guidance_rescale is a fraction (0: off, 1: the prompt prediction's standard deviation)."""
        value = self.guidance_rescale
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (number and math.isfinite(value) and 0 <= value <= 1):
            result.add_failure("guidance_rescale", value, "a number in [0, 1]")


register_configs(
    HunyuanVideo15Config,
    HunyuanVideo15SamplingParam,
    hf_model_paths=["hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v", "hunyuanvideo-community/HunyuanVideo-1.5-720p_t2v"],
    model_detectors=[lambda path, class_name: class_name == "HunyuanVideo15Pipeline"],
    name="hunyuanvideo-1.5-t2v",
)


@dataclass
class HunyuanVideo15I2VSamplingParam(HunyuanVideo15SamplingParam):
    """HunyuanVideo-1.5 image-to-video at 480p: as text-to-video, with the first frame (cropped to the video's size)."""

    image: Any = input_image_field("image-to-video models: the first frame, an image file (Python also takes a PIL "
                                   "image, a uint8 numpy array [H, W, 3] or a torch tensor); resized to cover height x "
                                   "width and center-cropped")


register_configs(
    HunyuanVideo15I2VConfig,
    HunyuanVideo15I2VSamplingParam,
    hf_model_paths=["hunyuanvideo-community/HunyuanVideo-1.5-480p_i2v", "hunyuanvideo-community/HunyuanVideo-1.5-720p_i2v"],
    model_detectors=[lambda path, class_name: class_name == "HunyuanVideo15ImageToVideoPipeline"],
    name="hunyuanvideo-1.5-i2v",
)
