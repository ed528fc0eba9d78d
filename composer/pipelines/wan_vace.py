"""Wan VACE (diffusers' `WanVACEPipeline` folders): video generation controlled by a video, its mask and reference
images (composer/stages/vace.py), through composer's Wan DiT with VACE's control blocks (composer/models/wan/vace.py).

    validate -> encode text -> timesteps -> noise (F' + references latent frames) -> encode the control ->
    denoise (CFG; the control latents and scales in every call) -> cut the reference frames -> decode

A folder with `transformer_2` / `boundary_ratio` (Wan2.2 VACE) goes to Wan22VACEPipeline: the same control, denoised
by two experts as Wan2.2 A14B (composer/pipelines/wan22.py).

    gen.generate_video("a fox in the snow", video="pose.mp4", mask="mask.mp4", reference_images=["fox.png"])
    composer generate --model-path Wan-AI/Wan2.1-VACE-1.3B-diffusers --video pose.mp4 --reference-images fox.png ...
"""

from __future__ import annotations

import dataclasses

from composer.batch import ForwardBatch
from composer.configs.wan_vace import Wan22VACEConfig, WanVACEConfig
from composer.errors import ConfigError, UnsupportedError
from composer.loader.model_index import ModelIndex
from composer.pipelines.base import ComposedPipeline
from composer.pipelines.wan import WanPipeline
from composer.pipelines.wan22 import Wan22A14BPipeline
from composer.stages.decoding import DecodingStage
from composer.stages.vace import (
    ReferenceFrameCutStage,
    ReferenceNoiseStage,
    VaceCondition,
    VaceConditionStage,
    VaceDenoisingStage,
    VaceExpertDenoisingStage,
)


class WanVACEPipeline(WanPipeline):
    """Wan2.1 VACE: one VACE transformer (see the module doc)."""

    class_names = ("WanVACEPipeline",)
    config_class = WanVACEConfig

    @classmethod
    def for_folder(cls, index: ModelIndex) -> type[ComposedPipeline]:
        """A two-expert folder (Wan2.2 VACE) goes to Wan22VACEPipeline."""
        if cls is not WanVACEPipeline:
            return cls
        if "transformer_2" in index.components or index.extra.get("boundary_ratio") is not None:
            return Wan22VACEPipeline
        return cls

    def check_supported(self) -> None:
        if "transformer_2" in self.index.components or self.index.extra.get("boundary_ratio") is not None:
            raise UnsupportedError(f"{self.folder} is a two-expert VACE folder (boundary_ratio / transformer_2): load "
                                   "it with VideoGenerator.from_pretrained, which picks composer's Wan2.2 VACE pipeline")
        if self.index.extra.get("expand_timesteps"):
            raise UnsupportedError(f"{self.folder}: expand_timesteps (per-token timesteps) with VACE is no released "
                                   "model; composer runs VACE with one timestep per video")

    def prepare(self, batch: ForwardBatch, sampling, segments=None, keep_video: bool = True) -> None:
        """The request's control read into a VaceCondition; a control video's length is num_frames."""
        # `video` is VACE's control video, not video-to-video's input: the Wan pipelines' own prepare must not take it
        super().prepare(batch, dataclasses.replace(sampling, video=None), segments, keep_video)
        blocks = len(self.modules["transformer"].config.vace_layers)
        condition = VaceCondition.from_request(sampling, self.modules["vae"].config.scale_factor_temporal, blocks)
        if condition.frames is not None:
            batch.num_frames = len(condition.frames)
        batch.attach(condition)

    def create_stages(self) -> None:
        transformer = self.modules["transformer"]
        self.add_preparation_stages(transformer)
        self.add_control_stages(transformer)
        self.add_stage(VaceDenoisingStage(self.make_engine(transformer), progress=self.runtime.progress))
        self.add_output_stages()

    def add_control_stages(self, transformer) -> None:
        """The noise over the reference frames too, and the control latents, checked to fit the transformer."""
        vae = self.modules["vae"]
        z, spatial, temporal = vae.config.z_dim, vae.config.scale_factor_spatial, vae.config.scale_factor_temporal
        expected = 2 * z + spatial**2
        if transformer.config.vace_in_channels != expected:
            raise ConfigError(f"{self.folder}: the transformer's vace_in_channels is {transformer.config.vace_in_channels},"
                              f" but this VAE's control latents have {expected} channels (2 x {z} latent channels of "
                              f"the kept and redrawn video, {spatial} x {spatial} mask pixels per latent position)")
        self.add_stage(ReferenceNoiseStage(transformer.config.in_channels, temporal, spatial, self.device))
        self.add_stage(VaceConditionStage(vae, self.device))

    def add_output_stages(self) -> None:
        self.add_stage(ReferenceFrameCutStage())
        self.add_stage(DecodingStage(self.modules["vae"]))


class Wan22VACEPipeline(WanVACEPipeline, Wan22A14BPipeline):
    """Wan2.2 VACE: the control of WanVACEPipeline, denoised by two VACE experts as Wan2.2 A14B (the high-noise one
    for t >= boundary_ratio * num_train_timesteps, CFG `guidance_scale`; the low-noise one, `guidance_scale_2`)."""

    config_class = Wan22VACEConfig
    required_modules = Wan22A14BPipeline.required_modules

    def check_supported(self) -> None:
        Wan22A14BPipeline.check_supported(self)

    def create_stages(self) -> None:
        high, low = self.experts()
        if list(high.config.vace_layers) != list(low.config.vace_layers) or (
                high.config.vace_in_channels != low.config.vace_in_channels):
            raise ConfigError(f"{self.folder}: transformer and transformer_2 differ in vace_layers or "
                              "vace_in_channels; the two experts of one folder read the same control")
        self.add_preparation_stages(high)
        self.add_control_stages(high)
        self.add_expert_stages(VaceExpertDenoisingStage)
        self.add_output_stages()


EntryClass = WanVACEPipeline
