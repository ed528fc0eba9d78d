"""Wan2.1 text-to-video: UMT5 text encoder, composer's Wan DiT, Wan VAE, the folder's flow scheduler."""

from __future__ import annotations

from typing import Any

from composer.batch import ForwardBatch
from composer.configs.wan import WanT2VConfig
from composer.errors import UnsupportedError
from composer.loader.model_index import ModelIndex
from composer.pipelines.base import ComposedPipeline
from composer.stages.decoding import DecodingStage
from composer.stages.denoising import DenoisingStage
from composer.stages.input_validation import InputValidationStage
from composer.stages.latents import LatentPreparationStage
from composer.stages.text_encoding import TextEncodingStage
from composer.stages.timesteps import TimestepPreparationStage, folder_flow_shift
from composer.stages.video_latents import VideoCondition, VideoLatentStage


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
        pipeline (composer/pipelines/wan22.py)."""
        if cls is not WanPipeline:
            return cls
        from composer.pipelines.wan22 import wan22_pipeline_for

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

EntryClass = WanPipeline
