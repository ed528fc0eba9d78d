"""Wan text-to-video, the folders whose model_index.json names diffusers' `WanPipeline`: Wan2.1 (UMT5 text encoder,
composer's Wan DiT, Wan VAE, the folder's flow scheduler) and Wan2.2's two-expert T2V A14B and TI2V-5B.

Wan2.2 folders name `WanPipeline` too; `WanPipeline.for_folder` hands them to their classes, below in this module,
by their entries (`wan22_pipeline_for`). They live here, beside the class they refine and that names them, as
wan_vace.py keeps Wan2.2 VACE (composer/pipelines/wan22.py re-exports them):

- `transformer_2` / `boundary_ratio`: Wan2.2 A14B. validate -> encode text -> timesteps -> noise -> denoise with the
  high-noise expert (t >= boundary_ratio * num_train_timesteps, CFG `guidance_scale`) -> denoise with the low-noise
  expert (the rest, CFG `guidance_scale_2`) -> decode.
- `expand_timesteps`: Wan2.2 TI2V-5B. As Wan2.1 but the transformer gets its timesteps per latent token
  (composer/stages/token_timesteps.py) and the VAE is Wan2.2's (48 channels, 16x spatial compression: the stages
  read the factors from the VAE config). With an `image` in the request (image-to-video mode, which diffusers
  users run through WanImageToVideoPipeline on the same folder): the image's latents are the first latent frame,
  held clean, its tokens at timestep 0.

Wan2.2 I2V A14B (a WanImageToVideoPipeline folder) is in composer/pipelines/wan22_i2v.py.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from composer.batch import ForwardBatch
from composer.configs.wan import WanT2VConfig
from composer.configs.wan22 import Wan22A14BConfig, Wan22TI2VConfig
from composer.errors import ConfigError, UnsupportedError
from composer.loader.model_index import ModelIndex
from composer.logging import get_logger, log_once
from composer.pipelines.base import ComposedPipeline
from composer.stages.decoding import DecodingStage
from composer.stages.denoising import DenoisingStage
from composer.stages.expert_denoising import ExpertDenoisingStage, ExpertGuidance
from composer.stages.image_encoding import ImageCondition
from composer.stages.image_latents import FirstFrameLatentStage
from composer.stages.input_validation import InputValidationStage
from composer.stages.latents import LatentPreparationStage
from composer.stages.text_encoding import TextEncodingStage
from composer.stages.timesteps import TimestepPreparationStage, folder_flow_shift
from composer.stages.token_timesteps import TokenTimestepDenoisingStage
from composer.stages.video_latents import VideoCondition, VideoLatentStage

logger = get_logger(__name__)


class WanPipeline(ComposedPipeline):
    """validate -> encode text -> timesteps -> noise -> denoise (CFG) -> decode."""

    # diffusers' video-to-video class loads the same folders (a folder saved by it names it); composer serves both
    # tasks on either (`video=` makes a request video-to-video)
    class_names = ("WanPipeline", "WanVideoToVideoPipeline")
    config_class = WanT2VConfig
    required_modules = ("text_encoder", "tokenizer", "vae", "transformer", "scheduler")

    @classmethod
    def for_folder(cls, index: ModelIndex) -> type[ComposedPipeline]:
        """Wan2.2 folders name diffusers' WanPipeline too: their model_index.json entries pick composer's Wan2.2
        pipeline (`wan22_pipeline_for`, below)."""
        if cls is not WanPipeline:
            return cls
        return wan22_pipeline_for(index) or cls

    def check_supported(self) -> None:
        extra = self.index.extra
        if extra.get("boundary_ratio") is not None or "transformer_2" in self.index.components:
            raise UnsupportedError(
                f"{self.folder} is a two-expert Wan2.2 folder (boundary_ratio / transformer_2): load it with "
                "VideoGenerator.from_pretrained, which picks composer's Wan2.2 pipeline"
            )
        if extra.get("expand_timesteps"):
            raise UnsupportedError(f"{self.folder} is a Wan2.2 TI2V folder (expand_timesteps): load it with "
                                   "VideoGenerator.from_pretrained, which picks composer's Wan2.2 pipeline")

    def sampling_defaults(self) -> dict[str, Any]:
        """The default flow_shift is the one the folder's scheduler config states: fine-tuned and distilled
        Wan folders ship their own (5, 8, ...). A config that states none leaves the family's value."""
        return folder_flow_shift(self.folder, self.modules["scheduler"])

    def create_stages(self) -> None:
        transformer = self.modules["transformer"]
        self.add_preparation_stages(transformer)
        self.add_stage(VideoLatentStage(self.modules["vae"], self.device))  # video-to-video only
        self.add_stage(DenoisingStage(self.make_engine(transformer), progress=self.runtime.progress))
        self.add_stage(DecodingStage(self.modules["vae"]))

    def prepare(self, batch: ForwardBatch, sampling, segments=None, keep_video: bool = True) -> None:
        """A `video` makes the request video-to-video (composer/stages/video_latents.py): its frames are read, and
        their count is the request's num_frames."""
        super().prepare(batch, sampling, segments, keep_video)
        if getattr(sampling, "video", None) is None:
            return
        if not any(isinstance(stage, VideoLatentStage) for stage in self.stages):
            raise UnsupportedError(f"{type(self).__name__} does not take a video (video-to-video runs on Wan2.1 "
                                   "text-to-video folders)")
        condition = VideoCondition.from_request(sampling, self.modules["vae"].config.scale_factor_temporal)
        batch.num_frames = len(condition.frames)
        batch.attach(condition)

    def add_preparation_stages(self, transformer, latent_channels: int | None = None) -> None:
        """validate -> encode text -> timesteps -> noise: sizes from the VAE config's compression factors and
        the DiT's patch and latent channels (Wan2.1's VAE: 4x / 8x, 16 channels; Wan2.2's: 4x / 16x, 48).
        `latent_channels`: the noise's channels when the DiT takes more (an image condition on the channel axis)."""
        vae = self.modules["vae"]
        temporal = vae.config.scale_factor_temporal
        spatial = vae.config.scale_factor_spatial
        patch = transformer.config.patch_size
        self.add_stage(InputValidationStage(spatial_multiple=spatial * max(patch[1], patch[2]), temporal_factor=temporal))
        self.add_stage(
            TextEncodingStage(
                self.modules["text_encoder"],
                self.modules["tokenizer"],
                max_length=self.config.text_encoder_max_length,
                clean=self.config.clean_prompts,
            )
        )
        self.add_stage(TimestepPreparationStage(self.modules["scheduler"], self.device))
        channels = transformer.config.in_channels if latent_channels is None else latent_channels
        self.add_stage(LatentPreparationStage(channels, temporal, spatial, self.device))


def wan22_pipeline_for(index: ModelIndex, two_experts: type[WanPipeline] | None = None) -> type[WanPipeline] | None:
    """The Wan2.2 pipeline class a folder needs, or None for a Wan2.1 folder: `two_experts` (default the T2V
    Wan22A14BPipeline) for `transformer_2` / `boundary_ratio`, Wan22TI2VPipeline for `expand_timesteps`."""
    extra = index.extra
    if "transformer_2" in index.components or extra.get("boundary_ratio") is not None:
        return two_experts or Wan22A14BPipeline
    if extra.get("expand_timesteps"):
        return Wan22TI2VPipeline
    return None


class Wan22A14BPipeline(WanPipeline):
    """Wan2.2 A14B: two experts, each its own denoising stage (see the module doc)."""

    config_class = Wan22A14BConfig
    required_modules = ("text_encoder", "tokenizer", "vae", "transformer", "transformer_2", "scheduler")

    def check_supported(self) -> None:
        index_file = self.folder / "model_index.json"
        if "transformer_2" not in self.index.components:
            raise ConfigError(f"{index_file} sets boundary_ratio but has no transformer_2 (the low-noise expert): "
                              "a Wan2.2 A14B folder has both transformer and transformer_2")
        if "transformer" not in self.index.components:
            raise UnsupportedError(f"{index_file} has transformer_2 but no transformer (the high-noise expert); "
                                   "composer runs A14B folders with both experts")
        ratio = self.index.extra.get("boundary_ratio")
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio < 1:
            raise ConfigError(
                f"{index_file}: boundary_ratio = {ratio!r}: expected a number between 0 and 1 (exclusive), the "
                "fraction of the training timesteps from which the high-noise expert takes over (0.875 in the "
                "released Wan2.2 T2V A14B folder, 0.9 in the I2V one)"
            )
        if self.index.extra.get("expand_timesteps"):
            raise UnsupportedError(f"{index_file} has two experts and expand_timesteps: no released Wan2.2 model "
                                   "is both; composer runs A14B (two experts) or TI2V-5B (expand_timesteps)")

    def boundary_timestep(self) -> float:
        """The first timestep of the low-noise expert's range: boundary_ratio * num_train_timesteps."""
        return self.config.boundary_ratio * self.modules["scheduler"].config.num_train_timesteps

    def prepare(self, batch: ForwardBatch, sampling, segments=None, keep_video: bool = True) -> None:
        super().prepare(batch, sampling, segments, keep_video)
        scale_2 = sampling.guidance_scale_2
        if scale_2 is None:  # diffusers' default: the high-noise expert's scale
            scale_2 = sampling.guidance_scale
        elif scale_2 > 1 and not batch.do_classifier_free_guidance:
            log_once(logger, "guidance-scale-2-ignored", f"guidance_scale_2 = {scale_2} is ignored: guidance_scale "
                     f"= {sampling.guidance_scale} (<= 1) turns classifier-free guidance off for both experts, as "
                     "in diffusers; set guidance_scale > 1 to use it", logging.WARNING)
        batch.attach(ExpertGuidance(float(scale_2)))

    def experts(self) -> tuple[torch.nn.Module, torch.nn.Module]:
        """The high-noise and low-noise experts, checked to denoise the same latents."""
        high, low = self.modules["transformer"], self.modules["transformer_2"]
        if tuple(high.config.patch_size) != tuple(low.config.patch_size) or (
            high.config.in_channels != low.config.in_channels
        ):
            raise ConfigError(f"{self.folder}: transformer and transformer_2 differ in patch_size or in_channels; "
                              "the two experts of one folder must denoise the same latents")
        return high, low

    def add_expert_stages(self, stage_class: type[ExpertDenoisingStage] = ExpertDenoisingStage) -> None:
        """One denoising stage per expert, high-noise first, each over its own engine."""
        boundary = self.boundary_timestep()
        for name, high_noise in (("transformer", True), ("transformer_2", False)):
            engine = self.make_engine(self.modules[name])
            self.add_stage(stage_class(engine, name, boundary, high_noise, self.runtime.progress))

    def create_stages(self) -> None:
        high, _ = self.experts()
        self.add_preparation_stages(high)
        self.add_expert_stages()
        self.add_stage(DecodingStage(self.modules["vae"]))


class Wan22TI2VPipeline(WanPipeline):
    """Wan2.2 TI2V-5B: per-token timesteps, the Wan2.2 VAE; text-to-video, or image-to-video when the request gives
    an `image` (its latents are the first latent frame, kept clean: timestep 0 on its tokens). See the module doc."""

    config_class = Wan22TI2VConfig

    def check_supported(self) -> None:
        if "transformer_2" in self.index.components or self.index.extra.get("boundary_ratio") is not None:
            raise UnsupportedError(f"{self.folder}: expand_timesteps with two experts is not a released Wan2.2 model")

    def prepare(self, batch: ForwardBatch, sampling, segments=None, keep_video: bool = True) -> None:
        """An `image` makes the request image-to-video (read into an ImageCondition); none: text-to-video."""
        super().prepare(batch, sampling, segments, keep_video)
        if getattr(sampling, "image", None) is not None:
            batch.attach(ImageCondition.from_request(sampling, takes_last_image=False))

    def create_stages(self) -> None:
        transformer, vae = self.modules["transformer"], self.modules["vae"]
        z_dim = getattr(vae.config, "z_dim", None)
        if z_dim is not None and z_dim != transformer.config.in_channels:
            raise ConfigError(f"{self.folder}: the VAE's latents have {z_dim} channels but the transformer takes "
                              f"{transformer.config.in_channels} (TI2V-5B: 48 and 48)")
        self.add_preparation_stages(transformer)
        patch = tuple(transformer.config.patch_size)
        self.add_stage(FirstFrameLatentStage(vae, patch))  # image mode only (skipped without an image)
        self.add_stage(TokenTimestepDenoisingStage(self.make_engine(transformer), patch, self.runtime.progress))
        self.add_stage(DecodingStage(vae))


EntryClass = WanPipeline
