"""Wan2.1 image-to-video (I2V) and first-last-frame-to-video (FLF2V): diffusers' WanImageToVideoPipeline folders.

Beyond a T2V folder: `image_encoder` (transformers CLIPVisionModel) with its `image_processor`
(CLIPImageProcessor), and a transformer with image cross-attention (`image_dim`) whose input is the noise and
the image condition on the channel axis (in_channels = 2 * z + 4). An FLF2V folder's transformer also has a
position embedding over two images' tokens (`pos_embed_seq_len`) and takes `last_image`.
"""

from __future__ import annotations

import torch

from composer.batch import ForwardBatch
from composer.configs.wan_i2v import WanI2VConfig
from composer.errors import UnsupportedError
from composer.loader.model_index import ModelIndex
from composer.pipelines.base import ComposedPipeline
from composer.pipelines.wan import WanPipeline
from composer.stages.decoding import DecodingStage
from composer.stages.image_denoising import ImageToVideoDenoisingStage
from composer.stages.image_encoding import ImageCondition, ImageEncodingStage
from composer.stages.image_latents import ImageLatentStage
from composer.stages.input_validation import InputValidationStage
from composer.stages.latents import LatentPreparationStage
from composer.stages.text_encoding import TextEncodingStage
from composer.stages.timesteps import TimestepPreparationStage


class WanImageToVideoPipeline(WanPipeline):
    """validate -> encode text -> encode image (CLIP) -> timesteps -> noise -> image condition (VAE) -> denoise
    (CFG) -> decode. The folder's flow shift is the default, as for T2V (`WanPipeline.sampling_defaults`)."""

    class_names = ("WanImageToVideoPipeline",)
    config_class = WanI2VConfig
    required_modules = (
        "text_encoder", "tokenizer", "image_encoder", "image_processor", "vae", "transformer", "scheduler",
    )

    @classmethod
    def for_folder(cls, index: ModelIndex) -> type[ComposedPipeline]:
        """diffusers' WanImageToVideoPipeline serves Wan2.2 folders too: two experts (I2V A14B) or
        `expand_timesteps` (TI2V-5B, saved from the I2V pipeline) pick composer's Wan2.2 pipelines."""
        if cls is not WanImageToVideoPipeline:
            return cls
        from composer.pipelines.wan22_i2v import wan22_image_pipeline_for

        return wan22_image_pipeline_for(index) or cls

    def check_supported(self) -> None:
        extra, components = self.index.extra, self.index.components
        if extra.get("boundary_ratio") is not None or "transformer_2" in components or extra.get("expand_timesteps"):
            raise UnsupportedError(
                f"{self.folder} is a Wan2.2 image-to-video folder (boundary_ratio / transformer_2 / "
                "expand_timesteps): load it with VideoGenerator.from_pretrained, which picks composer's Wan2.2 "
                "pipeline; this class serves Wan2.1 I2V and FLF2V folders (a CLIP image encoder)"
            )
        missing = [name for name in ("image_encoder", "image_processor") if name not in components]
        if missing:
            raise UnsupportedError(
                f"{self.folder} has no {' / '.join(missing)} in model_index.json: Wan2.1 I2V needs the CLIP image "
                "encoder and its processor"
            )

    def module_dtype(self, name: str) -> torch.dtype | None:
        """The CLIP image encoder loads in the text encoder's dtype (`text_encoder_dtype`): both only encode the
        request's conditioning, once."""
        if name == "image_encoder":
            return self.runtime.text_encoder_torch_dtype
        return super().module_dtype(name)

    @property
    def takes_last_image(self) -> bool:
        """Whether the transformer is a first-last-frame one (a position embedding over two images' tokens)."""
        return bool(self.modules["transformer"].config.pos_embed_seq_len)

    def prepare(self, batch: ForwardBatch, sampling, segments=None, keep_video: bool = True) -> None:
        """Read the request's images (file, PIL, numpy or tensor) into an ImageCondition on the batch."""
        super().prepare(batch, sampling, segments, keep_video)
        batch.attach(ImageCondition.from_request(sampling, self.takes_last_image))

    def create_stages(self) -> None:
        vae, transformer = self.modules["vae"], self.modules["transformer"]
        temporal, spatial = vae.config.scale_factor_temporal, vae.config.scale_factor_spatial
        patch = transformer.config.patch_size
        self.add_stage(InputValidationStage(spatial_multiple=spatial * max(patch[1], patch[2]), temporal_factor=temporal))
        self.add_stage(
            TextEncodingStage(
                self.modules["text_encoder"], self.modules["tokenizer"],
                max_length=self.config.text_encoder_max_length, clean=self.config.clean_prompts,
            )
        )
        self.add_stage(ImageEncodingStage(self.modules["image_encoder"], self.modules["image_processor"]))
        self.add_stage(TimestepPreparationStage(self.modules["scheduler"], self.device))
        # the noise has the VAE's channels; the transformer's input adds the image condition's
        self.add_stage(LatentPreparationStage(vae.config.z_dim, temporal, spatial, self.device))
        self.add_stage(ImageLatentStage(vae, temporal, spatial, self.device))
        self.add_stage(ImageToVideoDenoisingStage(self.make_engine(transformer), progress=self.runtime.progress))
        self.add_stage(DecodingStage(vae))


EntryClass = WanImageToVideoPipeline
