"""SkyReels-V2 diffusion forcing (text-, image- and video-to-video): defaults of diffusers'
`SkyReelsV2DiffusionForcingPipeline` and the released folders (Skywork/SkyReels-V2-DF-{1.3B-540P,14B-540P,14B-720P}-
Diffusers). docs/skyreels.md."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from composer.configs.base import PipelineConfig, SamplingParam
from composer.configs.wan_i2v import input_image_field
from composer.registry.configs import register_configs

# diffusers' diffusion-forcing pipeline classes (its image- and video-to-video ones load the same folders)
DF_PIPELINES = ("SkyReelsV2DiffusionForcingPipeline", "SkyReelsV2DiffusionForcingImageToVideoPipeline",
                "SkyReelsV2DiffusionForcingVideoToVideoPipeline")


@dataclass
class SkyReelsV2DFConfig(PipelineConfig):
    """SkyReels-V2 DF: UMT5 prompts of 512 tokens, zero-padded past the prompt's length (Wan2.1's text side). Not a
    WanT2VConfig: a Wan2.1 folder never takes this family, nor this family Wan2.1's TeaCache fit."""

    text_encoder_max_length: int = 512
    # diffusers' image-to-video DF pipeline takes a last frame (the request check then lets `last_image` through;
    # the family's own rule, `forcing_problems`, says when it runs)
    takes_last_image: ClassVar[bool] = True


AR_STEP_HELP = ("diffusion forcing: 0 denoises every frame together (synchronous); k > 0 starts each causal block k "
                "steps after the one before (asynchronous: earlier frames cleaner, more model calls)")
BLOCK_HELP = ("diffusion forcing: latent frames per causal block (> 1: a frame attends to its own block and the "
              "earlier ones); default: the transformer config's num_frame_per_block")
OVERLAP_HELP = ("diffusion forcing, videos longer than base_num_frames: frames each window continues from (17 or 37 "
                "recommended); required then")
ADDNOISE_HELP = ("diffusion forcing, long videos: re-noise the overlap frames to this timestep at every iteration "
                 "(0: fed clean; 20 recommended, at most about 50)")
IMAGE_HELP = ("SkyReels-V2 DF: an optional first frame (image-to-video, as diffusers' "
              "SkyReelsV2DiffusionForcingImageToVideoPipeline; without it, text-to-video), an image file (Python also "
              "takes a PIL image, a uint8 numpy array [H, W, 3] or a torch tensor); resized to height x width")
VIDEO_HELP = ("SkyReels-V2 DF: a video to extend (diffusers' SkyReelsV2DiffusionForcingVideoToVideoPipeline), a file "
              "(Python also takes uint8 frames [T, H, W, 3] or a list of images), of any length, resized to height x "
              "width: its last overlap_history frames (required) start the new ones; the result is the video followed "
              "by num_frames new frames, the first of which re-make the overlap")
LAST_IMAGE_HELP = ("SkyReels-V2 DF image-to-video: an optional last frame, given like image: fed clean after the video's "
                   "last frame and not shown (diffusers' last_image; causal_block_size 1)")
BASE_HELP = "diffusion forcing: frames the model makes at once (97 at 540P, 121 at 720P); longer videos go in windows"


@dataclass
class SkyReelsV2DF540PSamplingParam(SamplingParam):
    """SkyReels-V2 DF at 540P: 960x544, 97 frames at 24 fps, 50 steps, CFG 6.0, synchronous (`ar_step` 0), windows
    of 97 frames (diffusers' `__call__` defaults). The flow shift is the folder's; 8.0 (diffusers' recommendation for
    text-to-video) only fills in for a folder that states none."""

    video_use: ClassVar[str | None] = "extend"  # a server's remix / extend: the video, continued

    negative_prompt: str | None = None
    height: int = 544
    width: int = 960
    num_frames: int = 97
    num_inference_steps: int = 50
    guidance_scale: float = 6.0
    flow_shift: float | None = 8.0
    fps: int = 24
    ar_step: int = field(default=0, metadata={"help": AR_STEP_HELP})
    causal_block_size: int | None = field(default=None, metadata={"help": BLOCK_HELP})
    overlap_history: int | None = field(default=None, metadata={"help": OVERLAP_HELP})
    addnoise_condition: float = field(default=0.0, metadata={"help": ADDNOISE_HELP})
    base_num_frames: int = field(default=97, metadata={"help": BASE_HELP})
    image: Any = input_image_field(IMAGE_HELP)
    last_image: Any = field(default=None, metadata={"help": LAST_IMAGE_HELP})
    video: Any = field(default=None, metadata={"help": VIDEO_HELP})

    def check_inputs(self, result: Any, limits: Any) -> None:
        """ar_step, causal_block_size, base_num_frames, overlap_history and addnoise_condition; every window's latent
        frames fill whole causal blocks; which inputs go together, and a video that reads and that its overlap
        uses (composer/stages/diffusion_forcing.py)."""
        from composer.stages.diffusion_forcing import forcing_problems
        from composer.stages.video_latents import check_video_input

        frames = None if self.video is None else check_video_input(result, self.video)
        video = None if frames is None else len(frames)  # (an unreadable one: its rules wait, the knobs' do not)
        for name, value, rule in forcing_problems(
            self.num_frames, self.base_num_frames, self.overlap_history, self.ar_step, self.causal_block_size,
            self.addnoise_condition, limits.temporal_factor or 4, image=self.image is not None,
            last_image=self.last_image is not None, video_frames=video,
        ):
            if value is None:  # a knob that must be given: no value to show ("overlap_history: expected ...")
                result.failures.append((name, "", rule))
            else:
                result.add_failure(name, value, rule)


@dataclass
class SkyReelsV2DF720PSamplingParam(SkyReelsV2DF540PSamplingParam):
    """SkyReels-V2 DF at 720P: 1280x720, 121 frames, windows of 121 frames."""

    height: int = 720
    width: int = 1280
    num_frames: int = 121
    base_num_frames: int = field(default=121, metadata={"help": BASE_HELP})


register_configs(
    SkyReelsV2DFConfig,
    SkyReelsV2DF540PSamplingParam,
    hf_model_paths=["Skywork/SkyReels-V2-DF-1.3B-540P-Diffusers", "Skywork/SkyReels-V2-DF-14B-540P-Diffusers"],
    model_detectors=[lambda path, class_name: class_name in DF_PIPELINES],
    name="skyreels-v2-df",
)
register_configs(
    SkyReelsV2DFConfig,
    SkyReelsV2DF720PSamplingParam,
    hf_model_paths=["Skywork/SkyReels-V2-DF-14B-720P-Diffusers"],
    name="skyreels-v2-df-720p",
)
