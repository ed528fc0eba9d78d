"""LatentPreparationStage: the initial noise, drawn exactly as diffusers draws it for the same seed."""

from __future__ import annotations

import torch

from composer.batch import ForwardBatch
from composer.stages.base import Stage
from composer.stages.validators import V, VerificationResult


def latent_shape(
    batch_size: int, channels: int, num_frames: int, height: int, width: int, temporal: int, spatial: int
) -> tuple[int, int, int, int, int]:
    """(B, C, (F-1)//temporal + 1, H//spatial, W//spatial): a causal video VAE's latent grid."""
    return (batch_size, channels, (num_frames - 1) // temporal + 1, height // spatial, width // spatial)


class LatentPreparationStage(Stage):
    """Draws [B, C, F', H', W'] fp32 noise, row i from its own CPU `torch.Generator` seeded with
    `batch.seeds[i]`, then moves it to the device: the same seed gives the same noise on every device, rank,
    engine and batch size (diffusers' WanPipeline with `generator=[torch.Generator("cpu").manual_seed(s) for s
    in seeds]`, or one generator for one video)."""

    def __init__(self, num_channels: int, temporal_factor: int, spatial_factor: int, device: torch.device):
        self.num_channels = num_channels
        self.temporal_factor = temporal_factor
        self.spatial_factor = spatial_factor
        self.device = device

    def shape(self, batch: ForwardBatch) -> tuple[int, ...]:
        return latent_shape(
            batch.batch_size, self.num_channels, batch.num_frames, batch.height, batch.width,
            self.temporal_factor, self.spatial_factor,
        )

    def verify_output(self, batch: ForwardBatch, result: VerificationResult) -> None:
        result.add_check("latents", batch.latents, V.shape(self.shape(batch)), V.dtype_in(torch.float32))

    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        row_shape = (1, *self.shape(batch)[1:])
        noise = torch.cat([
            torch.randn(row_shape, generator=torch.Generator("cpu").manual_seed(seed), dtype=torch.float32)
            for seed in batch.seeds
        ])
        batch.latents = noise.to(self.device)
        return batch
