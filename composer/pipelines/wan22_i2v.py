"""Wan2.2 WanImageToVideoPipeline folders: I2V A14B (two experts), and TI2V-5B when saved from that class.

diffusers names `WanImageToVideoPipeline` in Wan2.1 I2V / FLF2V folders and in Wan2.2 I2V A14B's alike;
composer's WanImageToVideoPipeline hands a folder here by its model_index.json entries
(`wan22_image_pipeline_for`): `transformer_2` / `boundary_ratio` -> Wan2.2 I2V A14B; `expand_timesteps` -> TI2V-5B
(composer/pipelines/wan22.py), which takes an image or none.

I2V A14B: validate -> encode text -> timesteps -> noise -> image condition (VAE: the frame mask and the latents of
[image, 0, ..., 0], as Wan2.1 I2V) -> denoise with the high-noise expert (t >= boundary_ratio *
num_train_timesteps, CFG `guidance_scale`) -> the low-noise expert (CFG `guidance_scale_2`) -> decode. Its
transformers have no image cross-attention: no CLIP image encoder, the condition on the channel axis is all.
"""

from __future__ import annotations

from composer.batch import ForwardBatch
from composer.configs.wan22 import Wan22I2VA14BConfig
from composer.errors import ConfigError
from composer.loader.model_index import ModelIndex
from composer.pipelines.base import ComposedPipeline
from composer.pipelines.wan22 import Wan22A14BPipeline, wan22_pipeline_for
from composer.stages.decoding import DecodingStage
from composer.stages.image_denoising import ImageExpertDenoisingStage
from composer.stages.image_encoding import ImageCondition
from composer.stages.image_latents import ImageLatentStage


def wan22_image_pipeline_for(index: ModelIndex) -> type[ComposedPipeline] | None:
    """The Wan2.2 pipeline class a WanImageToVideoPipeline folder needs, or None for a Wan2.1 I2V / FLF2V one:
    the same entries as a WanPipeline folder's, with the image-conditioned two-expert class."""
    return wan22_pipeline_for(index, two_experts=Wan22I2VA14BPipeline)


class Wan22I2VA14BPipeline(Wan22A14BPipeline):
    """Wan2.2 I2V A14B: two experts (as T2V A14B) conditioned on the first frame (as Wan2.1 I2V, without CLIP)."""

    config_class = Wan22I2VA14BConfig

    def prepare(self, batch: ForwardBatch, sampling, segments=None, keep_video: bool = True) -> None:
        """The experts' CFG scales, and the request's image read into an ImageCondition (required)."""
        super().prepare(batch, sampling, segments, keep_video)
        batch.attach(ImageCondition.from_request(sampling, takes_last_image=False))

    def create_stages(self) -> None:
        high, _ = self.experts()
        vae = self.modules["vae"]
        temporal, spatial, z_dim = vae.config.scale_factor_temporal, vae.config.scale_factor_spatial, vae.config.z_dim
        expected = 2 * z_dim + temporal  # noise, frame mask, encoded condition video
        if high.config.in_channels != expected:
            raise ConfigError(
                f"{self.folder}: the experts take {high.config.in_channels} input channels, but an image-to-video "
                f"transformer over this VAE takes {expected} (the {z_dim} noise channels, a {temporal}-channel frame "
                f"mask and the {z_dim}-channel image condition; Wan2.2 I2V A14B: 36)"
            )
        self.add_preparation_stages(high, latent_channels=z_dim)
        self.add_stage(ImageLatentStage(vae, temporal, spatial, self.device))
        self.add_expert_stages(ImageExpertDenoisingStage)
        self.add_stage(DecodingStage(vae))
