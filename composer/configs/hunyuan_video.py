"""HunyuanVideo text-to-video: defaults of the released checkpoint (hunyuanvideo-community/HunyuanVideo).

Sources: the sampling defaults are diffusers' `HunyuanVideoPipeline.__call__` defaults (diffusers 0.42.1:
height 720, width 1280, num_frames 129, num_inference_steps 50, guidance_scale 6.0 embedded, true_cfg_scale
1.0, no negative prompt); fps 24 is the HunyuanVideo release's (its sampling script writes 24 fps videos;
diffusers' docstring example exports at 15). The prompt template, its crop and the hidden layer read are the
reference pipeline's (`DEFAULT_PROMPT_TEMPLATE`, `num_hidden_layers_to_skip = 2`, 256 prompt tokens, CLIP 77).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from composer.configs.base import PipelineConfig, SamplingParam
from composer.registry.configs import register_configs

# The Llama chat template HunyuanVideo's text encoder reads prompts in (the reference's DEFAULT_PROMPT_TEMPLATE);
# the states of the system part are cropped off.
HUNYUAN_PROMPT_TEMPLATE = (
    "<|start_header_id|>system<|end_header_id|>\n\nDescribe the video by detailing the following aspects: "
    "1. The main content and theme of the video."
    "2. The color, shape, size, texture, quantity, text, and spatial relationships of the objects."
    "3. Actions, events, behaviors temporal relationships, physical movement changes of the objects."
    "4. background environment, light, style and atmosphere."
    "5. camera angles, movements, and transitions used in the video:<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>"
)


@dataclass
class HunyuanVideoConfig(PipelineConfig):
    """HunyuanVideo: Llama prompts in a chat template (256 prompt tokens after the template's system part),
    the states of the third-last hidden layer; CLIP's pooled output (77 tokens) for the pooled vector."""

    text_encoder_max_length: int = 256  # prompt tokens kept after the crop (the reference's max_sequence_length)
    clean_prompts: bool = False  # the reference pipeline does not clean prompts
    prompt_template: str = HUNYUAN_PROMPT_TEMPLATE
    # Tokens cropped off the front (BOS + the template's system part). None: counted with the folder's tokenizer,
    # the tokens of the template's text before "{}" (the reference hard-codes 95 for the released tokenizer).
    prompt_template_crop_start: int | None = None
    num_hidden_layers_to_skip: int = 2  # read hidden_states[-(skip + 1)]
    text_encoder_2_max_length: int = 77


@dataclass
class HunyuanVideoSamplingParam(SamplingParam):
    """HunyuanVideo at 720p: 1280x720, 129 frames at 24 fps, 50 steps, embedded guidance 6.0, no true CFG. The
    flow shift is the folder's (the released scheduler config says 7.0); 7.0 only fills in where it states none."""

    negative_prompt: str | None = None
    height: int = 720
    width: int = 1280
    num_frames: int = 129
    num_inference_steps: int = 50
    guidance_scale: float = 6.0  # embedded in the transformer (guidance-distilled), not CFG
    true_cfg_scale: float = field(default=1.0, metadata={
        "help": "guidance-distilled models (HunyuanVideo): real classifier-free guidance with negative_prompt "
                "when > 1 (a second transformer pass per step); their guidance_scale is embedded in the transformer"})
    flow_shift: float | None = 7.0
    fps: int = 24


register_configs(
    HunyuanVideoConfig,
    HunyuanVideoSamplingParam,
    hf_model_paths=["hunyuanvideo-community/HunyuanVideo"],
    model_detectors=[lambda path, class_name: class_name == "HunyuanVideoPipeline"],
    name="hunyuanvideo-t2v",
)
