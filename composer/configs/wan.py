"""Wan2.1 text-to-video: defaults of the released checkpoints (Wan-AI/Wan2.1-T2V-{1.3B,14B}-Diffusers)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from composer.configs.base import PipelineConfig, SamplingParam
from composer.registry.configs import register_configs

# The English negative prompt published with the Wan2.1 diffusers checkpoints.
WAN_NEGATIVE_PROMPT = (
    "Bright tones, overexposed, static, blurred details, subtitles, style, works, paintings, images, static, "
    "overall gray, worst quality, low quality, JPEG compression residue, ugly, incomplete, extra fingers, poorly "
    "drawn hands, poorly drawn faces, deformed, disfigured, misshapen limbs, fused fingers, still picture, messy "
    "background, three legs, many people in the background, walking backwards"
)


@dataclass
class WanT2VConfig(PipelineConfig):
    """Wan2.1 T2V: UMT5 prompts of 512 tokens, zero-padded past the prompt's length."""

    text_encoder_max_length: int = 512
    # TeaCache's polynomial per transformer width (1536: Wan2.1 1.3B, 5120: 14B), fitted by the TeaCache authors
    # for the timestep projection as the signal with the first steps retained ("ret_steps"), highest power first
    teacache_coefficients: dict[int, tuple[float, ...]] = field(default_factory=lambda: {
        1536: (-5.21862437e04, 9.23041404e03, -5.28275948e02, 1.36987616e01, -4.99875664e-02),
        5120: (-3.03318725e05, 4.90537029e04, -2.65530556e03, 5.87365115e01, -3.15583525e-01),
    })
    # Within the TeaCache authors' suggested ranges for these coefficients (not measured here: no real weights)
    teacache_thresholds: dict[int, float] = field(default_factory=lambda: {1536: 0.08, 5120: 0.2})


STRENGTH_HELP = ("video-to-video: how much of the input video is redrawn, in (0, 1]: the denoising runs the last "
                 "strength x num_inference_steps steps from the video noised to that point (1.0: all of them, the "
                 "video only sets the noise's starting point; lower keeps more of it)")
VIDEO_HELP = ("video-to-video: the input video, a file (.mp4, .gif, ...; Python also takes uint8 frames [T, H, W, 3] "
              "or a list of PIL images); its frames are resized to height x width and its length is num_frames "
              "(4k + 1 frames)")


def video_field() -> Any:
    return field(default=None, metadata={"help": VIDEO_HELP})


def strength_field(default: float = 0.8) -> Any:
    return field(default=default, metadata={"help": STRENGTH_HELP})



@dataclass
class WanT2V480PSamplingParam(SamplingParam):
    """Wan2.1 T2V at 480p: 832x480, 81 frames at 16 fps, 50 steps, CFG 5.0. The flow shift is the model folder's
    (the released folders' scheduler configs say 3.0); 3.0 only fills in for a folder that states none."""

    video_use: ClassVar[str | None] = "redraw"  # a server's remix / edit: video-to-video

    negative_prompt: str | None = WAN_NEGATIVE_PROMPT
    height: int = 480
    width: int = 832
    num_frames: int = 81
    num_inference_steps: int = 50
    guidance_scale: float = 5.0
    flow_shift: float | None = 3.0
    fps: int = 16
    # video-to-video (diffusers' WanVideoToVideoPipeline on a text-to-video folder): composer/stages/video_latents.py
    video: Any = video_field()
    strength: float = strength_field(0.8)

    @property
    def length_from_input(self) -> str | None:
        """With a video (video-to-video), its length is the video's and num_frames is not used, as in diffusers'
        WanVideoToVideoPipeline, which has none."""
        return "video" if self.video is not None else None

    def check_inputs(self, result: Any, limits: Any) -> None:
        """Video-to-video's rule: the video reads and has 4k + 1 frames (the request's length, at most max_frames),
        and `strength` keeps at least one step (composer/stages/video_latents.py)."""
        from composer.stages.video_latents import check_video_to_video

        check_video_to_video(self, result, limits.temporal_factor or 4, limits)


register_configs(
    WanT2VConfig,
    WanT2V480PSamplingParam,
    hf_model_paths=["Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "Wan-AI/Wan2.1-T2V-14B-Diffusers"],
    model_detectors=[lambda path, class_name: class_name in ("WanPipeline", "WanVideoToVideoPipeline")],
    name="wan2.1-t2v",
)
