"""HunyuanVideo-1.5 image-to-video's two views of the first frame: its vision tower's states (SigLIP, as text tokens
of the transformer) and its latents as the condition on the channel axis.

    image  -> resized to cover the video's size and center-cropped (diffusers' resize_mode="crop")
    states = vision_tower(processor(image)).last_hidden_state                                  [1, N, D]
    latent = VAE(image as one frame).mode * scaling_factor                                     [1, z, 1, h, w]
    condition = [latent in latent frame 0, zeros after | mask: 1 on frame 0, 0 after]          [B, z + 1, F', h, w]
"""

from __future__ import annotations

import torch

from composer.batch import ForwardBatch
from composer.stages.base import Stage
from composer.stages.image_encoding import ImageCondition
from composer.stages.image_latents import image_to_pixels
from composer.stages.latents import latent_shape
from composer.stages.vae_tiling import encode_mode
from composer.stages.validators import V, VerificationResult


def crop_to_size(image, height: int, width: int):
    """A PIL image resized (Lanczos) to cover height x width, keeping its aspect ratio, then center-cropped: diffusers'
    VaeImageProcessor._resize_and_crop, integer arithmetic included."""
    import PIL.Image

    ratio, source = width / height, image.width / image.height
    resized_w = width if ratio > source else image.width * height // image.height
    resized_h = height if ratio <= source else image.height * width // image.width
    resized = image.resize((resized_w, resized_h), resample=PIL.Image.LANCZOS)
    canvas = PIL.Image.new("RGB", (width, height))
    canvas.paste(resized, box=(width // 2 - resized_w // 2, height // 2 - resized_h // 2))
    return canvas


class FirstFrameStatesStage(Stage):
    """The cropped first frame through the folder's image processor and vision tower: its last hidden states
    (`ImageCondition.embeds` [1, N, D]), as diffusers' HunyuanVideo15ImageToVideoPipeline takes them."""

    def __init__(self, image_encoder: torch.nn.Module, image_processor):
        self.image_encoder = image_encoder
        self.image_processor = image_processor

    def verify_input(self, batch: ForwardBatch, result: VerificationResult) -> None:
        result.add_check("image", batch.get(ImageCondition, None), V.not_none)

    def verify_output(self, batch: ForwardBatch, result: VerificationResult) -> None:
        result.add_check("image_embeds", batch.get(ImageCondition).embeds, V.shape([1, None, None]), V.all_finite)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        condition = batch.get(ImageCondition)
        image = crop_to_size(condition.image, batch.height, batch.width)
        inputs = self.image_processor.preprocess(images=image, do_resize=True, return_tensors="pt",
                                                 do_convert_rgb=True)
        weight = next(self.image_encoder.parameters())
        pixels = inputs["pixel_values"].to(weight.device, weight.dtype)
        condition.embeds = self.image_encoder(pixel_values=pixels).last_hidden_state
        return batch


class FirstFrameConditionStage(Stage):
    """VAE-encodes the cropped first frame alone and writes the condition every batch row takes on the channel axis
    (`ImageCondition.latents`): its latent as latent frame 0, zeros after, and a mask channel marking frame 0."""

    def __init__(self, vae: torch.nn.Module, temporal_factor: int, spatial_factor: int, device: torch.device):
        self.vae = vae
        self.temporal_factor = temporal_factor
        self.spatial_factor = spatial_factor
        self.device = device
        self.tile_size = None  # RuntimeArgs.vae_tile_size (the pipeline sets it): the encode in exact tiles

    def shape(self, batch: ForwardBatch) -> tuple[int, ...]:
        return latent_shape(batch.batch_size, self.vae.config.latent_channels + 1, batch.num_frames, batch.height,
                            batch.width, self.temporal_factor, self.spatial_factor)

    def verify_input(self, batch: ForwardBatch, result: VerificationResult) -> None:
        result.add_check("image", batch.get(ImageCondition, None), V.not_none)

    def verify_output(self, batch: ForwardBatch, result: VerificationResult) -> None:
        result.add_check("image_latents", batch.get(ImageCondition).latents, V.shape(self.shape(batch)),
                         V.dtype_in(torch.float32), V.all_finite)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        condition = batch.get(ImageCondition)
        pixels = image_to_pixels(crop_to_size(condition.image, batch.height, batch.width), batch.height, batch.width)
        pixels = pixels.unsqueeze(2).to(self.vae.device, self.vae.dtype)  # one frame
        latent = encode_mode(self.vae, pixels, self.tile_size) * self.vae.config.scaling_factor
        shape = self.shape(batch)
        latents = torch.zeros(shape, dtype=torch.float32, device=self.device)
        latents[:, :-1, :1] = latent.float().to(self.device)
        latents[:, -1, 0] = 1.0
        condition.latents = latents
        return batch
