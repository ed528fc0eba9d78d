"""ImageEncodingStage: an image-to-video request's input image(s) -> CLIP image states for cross-attention."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from composer.batch import ForwardBatch
from composer.errors import InvalidInputError
from composer.images import load_image
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

    @classmethod
    def from_request(cls, sampling, takes_last_image: bool) -> ImageCondition:
        """The request's images (file, PIL, numpy or tensor) read; InvalidInputError when the first frame is
        missing, or a last frame is given to a model conditioning on the first frame only."""
        if getattr(sampling, "image", None) is None:
            raise InvalidInputError("image: this is an image-to-video model and needs an input image (the first "
                                    "frame): pass image=... (a file path, PIL image, numpy array or tensor), or "
                                    "--image FILE on the command line")
        last_image = getattr(sampling, "last_image", None)
        if last_image is not None:
            if not takes_last_image:
                raise InvalidInputError("last_image: this I2V model conditions on the first frame only; a "
                                        "first-last-frame model (Wan2.1 FLF2V) takes last_image")
            last_image = load_image(last_image, "last_image")
        return cls(load_image(sampling.image, "image"), last_image)


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
