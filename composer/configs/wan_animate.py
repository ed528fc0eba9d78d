"""Wan2.2-Animate (diffusers' `WanAnimatePipeline` folders): a character image animated by a pose video and a face
video ("animate"), or put into a background video where a mask says ("replace").

Defaults are diffusers' `WanAnimatePipeline.__call__`'s and the release's (1280x720, segments of 77 frames, 20
steps, no CFG, one frame of the previous segment carried over; UniPC at flow shift 5.0, the release's `sample_shift`,
where the folder's scheduler states none; 30 fps, the release's `sample_fps`). The knobs, under diffusers' names,
are read by composer/stages/animate.py, which holds their rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from composer.configs.base import PipelineConfig, SamplingParam
from composer.configs.wan22 import WAN22_NEGATIVE_PROMPT
from composer.configs.wan_i2v import input_image_field
from composer.registry.configs import register_configs

IMAGE_HELP = ("Wan Animate: the character to animate, an image file (Python also takes a PIL image, a uint8 numpy "
              "array [H, W, 3] or a torch tensor); scaled to fit height x width, on black")
POSE_HELP = ("Wan Animate: the pose video the character follows (a file; Python also takes uint8 frames [T, H, W, 3] "
             "or a list of images), resized to height x width; its length is the video's")
FACE_HELP = ("Wan Animate: the face video driving the character's expressions, of the pose video's length (a file or "
             "frames, as pose_video), resized to the transformer's motion_encoder_size square")
BACKGROUND_HELP = "Wan Animate, mode replace: the video the character is put into, of the pose video's length"
MASK_HELP = ("Wan Animate, mode replace: where to draw the character (white) and where to keep background_video "
             "(black), a video of the pose video's length")
MODE_HELP = ("Wan Animate: animate (the character in its own image's setting) or replace (the character in "
             "background_video, where mask_video is white)")
SEGMENT_HELP = ("Wan Animate: frames made per segment (4k + 1); a longer pose video is made in segments, each "
                "continuing from the last frames of the one before")
PREVIOUS_HELP = ("Wan Animate: frames of the previous segment each segment continues from (1 or 5); a segment adds "
                 "segment_frame_length minus these")
MOTION_BATCH_HELP = ("Wan Animate: face frames the motion encoder takes at once (memory against speed; the same "
                     "video); default: the transformer config's motion_encoder_batch_size")


@dataclass
class WanAnimateConfig(PipelineConfig):
    """Wan2.2-Animate: UMT5 prompts of 512 tokens, as every Wan; the character image's CLIP states from the folder's
    image encoder and processor."""

    text_encoder_max_length: int = 512


@dataclass
class WanAnimateSamplingParam(SamplingParam):
    """Wan2.2-Animate 14B at 720p: 1280x720, segments of 77 frames, 20 steps, CFG 1.0 (none: diffusers' and the
    release's default; > 1 guides with the negative prompt and a blank face), flow shift 5.0 where the folder states
    none, 30 fps. The video's length is the pose video's (`num_frames` is not used)."""

    negative_prompt: str | None = WAN22_NEGATIVE_PROMPT
    height: int = 720
    width: int = 1280
    num_frames: int = field(default=77, metadata={"help": "frames in the video (Wan Animate: not used, the pose "
                                                          "video's length is the video's)"})
    num_inference_steps: int = 20
    guidance_scale: float = 1.0
    flow_shift: float | None = 5.0
    fps: int = 30
    image: Any = input_image_field(IMAGE_HELP)
    pose_video: Any = field(default=None, metadata={"help": POSE_HELP})
    face_video: Any = field(default=None, metadata={"help": FACE_HELP})
    background_video: Any = field(default=None, metadata={"help": BACKGROUND_HELP})
    mask_video: Any = field(default=None, metadata={"help": MASK_HELP})
    mode: str = field(default="animate", metadata={"help": MODE_HELP, "choices": ("animate", "replace")})
    segment_frame_length: int = field(default=77, metadata={"help": SEGMENT_HELP})
    prev_segment_conditioning_frames: int = field(default=1, metadata={"help": PREVIOUS_HELP})
    motion_encode_batch_size: int | None = field(default=None, metadata={"help": MOTION_BATCH_HELP})

    @property
    def length_from_input(self) -> str:
        """The input whose length is the video's: num_frames is not used (diffusers' pipeline has none), so any value
        is accepted; the pose video's length is checked instead."""
        return "pose_video"

    def check_inputs(self, result: Any, limits: Any) -> None:
        from composer.stages.animate import check_animate_inputs

        check_animate_inputs(self, result, getattr(limits, "temporal_factor", None) or 4, limits)


register_configs(
    WanAnimateConfig,
    WanAnimateSamplingParam,
    hf_model_paths=["Wan-AI/Wan2.2-Animate-14B-Diffusers"],
    model_detectors=[lambda path, class_name: class_name == "WanAnimatePipeline"],
    name="wan2.2-animate",
)
