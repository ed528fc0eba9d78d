"""ImageEncodingStage: an image-to-video request's input image(s) -> CLIP image states for cross-attention."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from composer.batch import ForwardBatch
from composer.stages.base import Stage
from composer.stages.validators import V, VerificationResult


@dataclass
class ImageCondition:
    """An image-to-video request's images (RGB PIL: the first frame, and the last for a first-last-frame model)
    and what the stages make of them: `embeds`, the CLIP image states [n, N, image_dim] (n = 1 or 2 images, for
    the transformer's image cross-attention), and `latents` [B, 4 + z, F', h, w] fp32 (the frame mask and the
    VAE-encoded condition video, concatenated to the noisy latents on the channel axis)."""

    image: Any
    last_image: Any = None
    embeds: torch.Tensor | None = None
    latents: torch.Tensor | None = None

    @property
    def images(self) -> list[Any]:
        return [self.image] if self.last_image is None else [self.image, self.last_image]


class ImageEncodingStage(Stage):
    """CLIP's own preprocessing (the folder's image processor: resize, center crop, normalize) of the original
    image(s), then the vision tower's penultimate hidden states, as diffusers' WanImageToVideoPipeline does."""

    def __init__(self, image_encoder: torch.nn.Module, image_processor):
        self.image_encoder = image_encoder
        self.image_processor = image_processor

    def verify_input(self, batch: ForwardBatch, result: VerificationResult) -> None:
        result.add_check("image", batch.get(ImageCondition, None), V.not_none)

    def verify_output(self, batch: ForwardBatch, result: VerificationResult) -> None:
        condition = batch.get(ImageCondition)
        result.add_check("image_embeds", condition.embeds, V.shape([len(condition.images), None, None]), V.all_finite)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        condition = batch.get(ImageCondition)
        pixels = self.image_processor(images=condition.images, return_tensors="pt").pixel_values
        weight = next(self.image_encoder.parameters())
        out = self.image_encoder(pixel_values=pixels.to(weight.device, weight.dtype), output_hidden_states=True)
        condition.embeds = out.hidden_states[-2]
        return batch
