"""RowDecodingStage: DecodingStage for a VAE that decodes one video at a time."""

from __future__ import annotations

import torch

from composer.stages.decoding import DecodingStage


class RowDecodingStage(DecodingStage):
    """Decodes the rows of each call (a request's videos, or concurrent requests' decodes batched together) one after
    another: diffusers' AutoencoderKLHunyuanVideo15 builds its attention's causal mask as [B, S, S] for [B, 1, S, C]
    queries, which broadcasts to the wrong shape for B > 1 videos."""

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        decode = super().decode
        return decode(latents) if latents.shape[0] == 1 else torch.cat([decode(row) for row in latents.split(1)])
