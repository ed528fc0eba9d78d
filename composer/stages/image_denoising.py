"""ImageToVideoDenoisingStage: the denoising loop of an image-conditioned model (Wan2.1 I2V / FLF2V)."""

from __future__ import annotations

import dataclasses

import torch

from composer.batch import ForwardBatch
from composer.engine import ModelInputs
from composer.stages.denoising import DenoisingStage
from composer.stages.image_encoding import ImageCondition
from composer.stages.validators import V, VerificationResult


class ImageToVideoDenoisingStage(DenoisingStage):
    """DenoisingStage whose branches also carry the image: the CLIP image states for cross-attention (the same for
    the prompt and the negative prompt, as diffusers does) and the image condition concatenated to the noisy
    latents on the channel axis."""

    def verify_input(self, batch: ForwardBatch, result: VerificationResult) -> None:
        super().verify_input(batch, result)
        condition = batch.get(ImageCondition, None)
        result.add_check("image_embeds", getattr(condition, "embeds", None), V.ndim(3))
        result.add_check("image_latents", getattr(condition, "latents", None), V.ndim(5))

    def branch_inputs(self, batch: ForwardBatch, text: torch.Tensor) -> ModelInputs:
        condition = batch.get(ImageCondition)
        dtype = self.engine.transformer.dtype
        image = condition.embeds.to(self.engine.transformer.device, dtype).repeat(text.shape[0], 1, 1)
        return dataclasses.replace(self.engine.text_inputs(text, image), condition=condition.latents)
