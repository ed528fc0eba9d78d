"""DecodingStage: latents -> uint8 RGB frames on the CPU."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import torch

from composer.batch import ForwardBatch, LatentBlock, VideoChunk
from composer.errors import StageVerificationError, UnsupportedError
from composer.stages.base import Stage
from composer.stages.validators import V, VerificationResult


def denormalize_latents(latents: torch.Tensor, vae_config) -> torch.Tensor:
    """Undo the latent normalisation the DiT was trained with (per-channel mean/std, or a scaling factor)."""
    if getattr(vae_config, "latents_mean", None) is not None and getattr(vae_config, "latents_std", None) is not None:
        shape = (1, -1) + (1,) * (latents.ndim - 2)
        mean = torch.tensor(vae_config.latents_mean).view(shape).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae_config.latents_std).view(shape).to(latents.device, latents.dtype)
        return latents / inv_std + mean
    scaling = getattr(vae_config, "scaling_factor", 1.0) or 1.0
    shift = getattr(vae_config, "shift_factor", 0.0) or 0.0
    return latents / scaling + shift


def video_to_frames(video: torch.Tensor) -> torch.Tensor:
    """VAE output [B, 3, T, H, W] in [-1, 1] -> uint8 [B, T, H, W, 3] on the CPU."""
    video = (video * 0.5 + 0.5).clamp(0, 1)
    return (video.permute(0, 2, 3, 4, 1).float() * 255).round().to(torch.uint8).cpu()


class DecodingStage(Stage):
    """Denormalizes the latents and decodes them with the VAE into frames (`batch.frames`)."""

    streams_from_upstream = True  # decodes a streaming denoiser's blocks

    def __init__(self, vae: torch.nn.Module):
        self.vae = vae

    def verify_input(self, batch: ForwardBatch, result: VerificationResult) -> None:
        result.add_check("latents", batch.latents, V.ndim(5))

    def verify_output(self, batch: ForwardBatch, result: VerificationResult) -> None:
        expected = (batch.batch_size, batch.num_frames, batch.height, batch.width, 3)
        if batch.frames is None or tuple(batch.frames.shape) != expected:
            shape = None if batch.frames is None else list(batch.frames.shape)
            result.add_failure("frames", shape, f"uint8 frames of shape {list(expected)}")

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        latents = denormalize_latents(latents.to(self.vae.device, self.vae.dtype), self.vae.config)
        return self.vae.decode(latents, return_dict=False)[0]

    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        batch.frames = video_to_frames(self.decode(batch.latents)).numpy()
        return batch

    # -- streaming: frames per latent block, as the denoiser finishes them -----------------------------
    def verify_stream_input(self, batch: ForwardBatch, result: VerificationResult) -> None:
        """The latents arrive block by block from upstream."""

    def verify_stream_output(self, batch: ForwardBatch, result: VerificationResult) -> None:
        """The frames went out chunk by chunk (each chunk's shape is checked as it is made)."""

    def stream(self, batch: ForwardBatch, upstream: Iterator[LatentBlock] | None) -> Iterator[VideoChunk]:
        """The start frames (when the request has start latents), then each upstream block's frames: the
        VAE's temporal cache is carried from chunk to chunk, so the frames equal a whole-video decode."""
        if upstream is None:
            raise UnsupportedError("streaming decode needs a streaming denoiser before it")
        decoder = StreamingVideoDecoder(self.vae)
        frame_index = 0

        def chunk(latents: torch.Tensor, block: LatentBlock | None) -> VideoChunk:
            nonlocal frame_index
            start = time.perf_counter()
            frames = decoder.decode(latents)[0]
            if frames.shape[1:] != (batch.height, batch.width, 3):
                raise StageVerificationError(self.name, "output", [("frames", list(frames.shape),
                                             f"uint8 frames [t, {batch.height}, {batch.width}, 3]")])
            piece = VideoChunk(
                frames=frames, block_index=None if block is None else block.index,
                segment=0 if block is None else block.segment,
                prompt=batch.prompt[0] if block is None else block.prompt, start_frame=frame_index,
                block_seconds=0.0 if block is None else block.seconds, decode_seconds=time.perf_counter() - start,
                since_start=time.perf_counter() - batch.started,
            )
            frame_index += len(frames)
            return piece

        if batch.start_latents is not None:
            yield chunk(batch.start_latents, None)
        for block in upstream:
            yield chunk(block.latents, block)


class StreamingVideoDecoder:
    """Decodes latents chunk by chunk, carrying the Wan VAE's causal temporal cache between chunks, so the
    concatenated frames equal decoding the whole video at once (the VAE decodes frame by frame either way).

    The first latent frame gives 1 video frame, every later one gives `scale_factor_temporal` frames.
    """

    def __init__(self, vae: torch.nn.Module):
        counts = getattr(vae, "_cached_conv_counts", None)
        usable = (
            counts is not None and hasattr(vae, "decoder") and hasattr(vae, "post_quant_conv")
            and getattr(vae.config, "patch_size", None) is None and not getattr(vae, "use_tiling", False)
        )
        if not usable:
            raise UnsupportedError(f"streaming decode needs the Wan2.1 VAE without tiling, got {type(vae).__name__}")
        self.vae = vae
        self.feat_cache: list = [None] * counts["decoder"]
        self.first = True

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> np.ndarray:
        """Latents [B, C, f, h, w] (the next f latent frames) -> uint8 frames [B, t, H, W, 3]."""
        vae = self.vae
        z = denormalize_latents(latents.to(vae.device, vae.dtype), vae.config)
        x = vae.post_quant_conv(z)
        outs = []
        for i in range(x.shape[2]):
            outs.append(vae.decoder(x[:, :, i:i + 1], feat_cache=self.feat_cache, feat_idx=[0], first_chunk=self.first))
            self.first = False
        return video_to_frames(torch.cat(outs, dim=2).clamp(-1.0, 1.0)).numpy()
