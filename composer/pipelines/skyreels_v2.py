"""SkyReels-V2 diffusion forcing (diffusers' `SkyReelsV2DiffusionForcingPipeline` folders): UMT5 text, composer's
SkyReels-V2 DiT (the Wan DiT with per-frame timesteps and an fps embedding), the Wan VAE, the folder's UniPC scheduler
copied per latent frame. Text-to-video; image-to-video with an `image` (and a `last_image`), video-to-video (extending a
`video`): diffusers runs the same folder with `SkyReelsV2DiffusionForcingImageToVideoPipeline` /
`...VideoToVideoPipeline`. docs/skyreels.md."""

from __future__ import annotations

import logging
from typing import Any

from composer.batch import ForwardBatch
from composer.configs.skyreels_v2 import SkyReelsV2DFConfig
from composer.errors import UnsupportedError
from composer.logging import get_logger, log_once
from composer.models.wan.skyreels import fps_index
from composer.pipelines.base import ComposedPipeline
from composer.stages.decoding import DecodingStage
from composer.stages.diffusion_forcing import (
    DiffusionForcingDenoisingStage,
    ForcingPlan,
    forcing_problems,
    latent_count,
    plan_windows,
    video_prefix,
)
from composer.stages.forcing_inputs import ForcingInputs, ForcingInputStage, InputVideoStage
from composer.stages.input_validation import InputValidationStage
from composer.stages.text_encoding import TextEncodingStage
from composer.stages.timesteps import TimestepPreparationStage, folder_flow_shift

logger = get_logger(__name__)

# Above this, diffusers warns that the re-noised overlap may make the windows inconsistent.
ADDNOISE_WARNING = 60


class SkyReelsV2DiffusionForcingPipeline(ComposedPipeline):
    """validate -> encode text -> timesteps -> [encode the image(s) or the video's overlap] -> diffusion forcing (every
    window, CFG) -> decode [-> the input video before the new frames]."""

    # diffusers' image- and video-to-video classes load the same folders (a folder saved by one names it)
    class_names = ("SkyReelsV2DiffusionForcingPipeline", "SkyReelsV2DiffusionForcingImageToVideoPipeline",
                   "SkyReelsV2DiffusionForcingVideoToVideoPipeline")
    config_class = SkyReelsV2DFConfig
    required_modules = ("text_encoder", "tokenizer", "vae", "transformer", "scheduler")

    def check_supported(self) -> None:
        if self.runtime.cache != "none":
            raise UnsupportedError(
                f"cache = {self.runtime.cache}: step caching plans from one timestep per step, and diffusion forcing "
                "gives every latent frame its own; run SkyReels-V2 DF with cache = none"
            )

    def sampling_defaults(self) -> dict[str, Any]:
        """The folder's flow shift, and its transformer's causal block (`num_frame_per_block`) as the request's
        default `causal_block_size` (diffusers takes it from there when the call gives none)."""
        block = getattr(self.modules["transformer"].config, "num_frame_per_block", 1)
        return {**folder_flow_shift(self.folder, self.modules["scheduler"]), "causal_block_size": block}

    def create_stages(self) -> None:
        vae, transformer = self.modules["vae"], self.modules["transformer"]
        temporal, spatial = vae.config.scale_factor_temporal, vae.config.scale_factor_spatial
        patch = transformer.config.patch_size
        self.add_stage(InputValidationStage(spatial_multiple=spatial * max(patch[1], patch[2]),
                                            temporal_factor=temporal))
        self.add_stage(TextEncodingStage(self.modules["text_encoder"], self.modules["tokenizer"],
                                         max_length=self.config.text_encoder_max_length,
                                         clean=self.config.clean_prompts))
        self.add_stage(TimestepPreparationStage(self.modules["scheduler"], self.device))
        self.add_stage(ForcingInputStage(vae, self.device))  # image- and video-to-video only
        self.add_stage(DiffusionForcingDenoisingStage(self.make_engine(transformer), transformer.config.in_channels,
                                                      spatial, progress=self.runtime.progress))
        self.add_stage(DecodingStage(vae))
        self.add_stage(InputVideoStage())  # video-to-video only

    def prepare(self, batch: ForwardBatch, sampling, segments=None, keep_video: bool = True) -> None:
        """The request's windows and knobs as a `ForcingPlan` (checked again here: a request that skipped the
        up-front check, or left causal_block_size to a model that states none)."""
        from composer.errors import RequestError

        super().prepare(batch, sampling, segments, keep_video)
        config = self.modules["transformer"].config
        temporal = self.modules["vae"].config.scale_factor_temporal
        block = sampling.causal_block_size or getattr(config, "num_frame_per_block", 1)
        inputs = ForcingInputs.from_request(sampling)
        video = None if inputs is None or inputs.video is None else len(inputs.video)
        problems = forcing_problems(sampling.num_frames, sampling.base_num_frames, sampling.overlap_history,
                                    sampling.ar_step, block, sampling.addnoise_condition, temporal,
                                    image=getattr(sampling, "image", None) is not None,
                                    last_image=getattr(sampling, "last_image", None) is not None, video_frames=video)
        if problems:
            raise RequestError([(name, "" if value is None else repr(value), rule) for name, value, rule in problems])
        first = 0 if inputs is None else (video_prefix(video, sampling.overlap_history, block, temporal)
                                          if video is not None else 1)
        if inputs is not None:
            batch.attach(inputs)
        windows = plan_windows(sampling.num_frames, sampling.base_num_frames, sampling.overlap_history, block, temporal,
                               first)
        encoded = latent_count(min(video, sampling.overlap_history), temporal) if video is not None else first
        if first < encoded:
            log_once(logger, f"video-cut-{encoded}-{block}", f"the video's overlap gives {encoded} latent frames, cut to "
                     f"{first} (whole causal blocks of {block}) as the first window's clean prefix (as diffusers does)",
                     logging.WARNING)
        if len(windows) > 1 and windows[1].prefix < windows[1].keep_from:
            log_once(logger, f"overlap-cut-{windows[1].keep_from}-{block}",
                     f"overlap_history = {sampling.overlap_history} gives {windows[1].keep_from} latent frames, cut to "
                     f"{windows[1].prefix} (whole causal blocks of {block}) as each window's clean prefix; the frames "
                     "cut are made again and not kept (as diffusers does)", logging.WARNING)
        if sampling.addnoise_condition > ADDNOISE_WARNING:
            log_once(logger, "addnoise-large", f"addnoise_condition = {sampling.addnoise_condition} is large and may "
                     "make the windows inconsistent; 20 is recommended", logging.WARNING)
        fps = fps_index(sampling.fps) if getattr(config, "inject_sample_info", False) else None
        batch.attach(ForcingPlan(tuple(windows), sampling.ar_step, block, float(sampling.addnoise_condition), fps))


EntryClass = SkyReelsV2DiffusionForcingPipeline
