"""The denoising loops of image-conditioned models: Wan2.1 I2V / FLF2V (one transformer) and Wan2.2 I2V A14B
(two experts, no CLIP image states)."""

from __future__ import annotations

import dataclasses

import torch

from composer.batch import ForwardBatch
from composer.engine import ModelInputs
from composer.stages.denoising import DenoisingStage
from composer.stages.expert_denoising import ExpertDenoisingStage
from composer.stages.image_encoding import ImageCondition
from composer.stages.validators import V, VerificationResult


class ImageToVideoDenoisingStage(DenoisingStage):
    """DenoisingStage whose branches also carry the image: the image condition concatenated to the noisy latents on
    the channel axis, and, for a transformer with image cross-attention (`image_dim`: Wan2.1), the CLIP image
    states (the same for the prompt and the negative prompt, as diffusers does)."""

    @property
    def takes_image_states(self) -> bool:
        """Image states as the transformer's input: Wan2.1's CLIP (`image_dim`), HunyuanVideo-1.5's SigLIP
        (`image_embed_dim`, text tokens of its joint attention)."""
        config = self.engine.transformer.config
        return getattr(config, "image_dim", None) is not None or getattr(config, "image_embed_dim", None) is not None

    def verify_input(self, batch: ForwardBatch, result: VerificationResult) -> None:
        super().verify_input(batch, result)
        condition = batch.get(ImageCondition, None)
        if self.takes_image_states:
            result.add_check("image_embeds", getattr(condition, "embeds", None), V.ndim(3))
        result.add_check("image_latents", getattr(condition, "latents", None), V.ndim(5))

    def branch_inputs(self, batch: ForwardBatch, text: torch.Tensor) -> ModelInputs:
        condition = batch.get(ImageCondition)
        image = None
        if self.takes_image_states:
            dtype = self.engine.transformer.dtype
            image = condition.embeds.to(self.engine.transformer.device, dtype).repeat(text.shape[0], 1, 1)
        return dataclasses.replace(self.engine.text_inputs(text, image), condition=condition.latents)


class ImageExpertDenoisingStage(ExpertDenoisingStage, ImageToVideoDenoisingStage):
    """One expert's steps (ExpertDenoisingStage: its timesteps and CFG scale) with the image condition on the
    channel axis (ImageToVideoDenoisingStage): Wan2.2 I2V A14B."""
