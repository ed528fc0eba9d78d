"""Causal (block-autoregressive) Wan: Self-Forcing / CausVid-style video generation.

Same weights, names and blocks as the bidirectional `WanTransformer3DModel`; what changes is who attends to
whom. Frames are generated in blocks; a block's tokens see every earlier frame (or a sink + rolling window of
them) and their own block, timesteps are per frame, and RoPE uses absolute frame positions.

Two equivalent ways to run it:
- `forward_cached`: one block (or prefill chunk) at a time against a `KVCache` holding earlier frames'
  keys (after RoPE) and values - the fast path;
- `forward_masked`: every frame at once with a block-causal attention mask - the reference the cache is
  tested against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from composer.cache import KVCache
from composer.models.wan.transformer import WanTransformer3DModel

CrossKV = list[tuple[torch.Tensor, torch.Tensor]]


def visible_to(end: int, window_frames: int | None, sink_frames: int) -> torch.Tensor:
    """Boolean [end] over frames: which frames a pass ending at frame `end` attends to."""
    frames = torch.arange(end)
    if window_frames is None:
        return torch.ones(end, dtype=torch.bool)
    return (frames < sink_frames) | (frames >= end - (window_frames - sink_frames))


def block_causal_mask(
    chunks: Sequence[tuple[int, int]],
    tokens_per_frame: int,
    window_frames: int | None = None,
    sink_frames: int = 0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """[S, S] boolean attention mask (True: attend) for frames split into consecutive chunks [start, end).

    The tokens of a chunk ending at frame e see frame g when g < e and (no window, or g < sink_frames, or
    g >= e - (window_frames - sink_frames)): exactly what a KVCache shows that chunk's pass.
    """
    total = chunks[-1][1]
    frame_mask = torch.zeros(total, total, dtype=torch.bool)
    for start, end in chunks:
        frame_mask[start:end, :end] = visible_to(end, window_frames, sink_frames)
    tokens = frame_mask.repeat_interleave(tokens_per_frame, 0).repeat_interleave(tokens_per_frame, 1)
    return tokens.to(device)


class CausalWanTransformer3DModel(WanTransformer3DModel):
    """Block-causal Wan2.1 DiT (a converted Self-Forcing / CausVid checkpoint)."""

    class_names = ("CausalWanTransformer3DModel",)

    def tokens_per_frame(self, height: int, width: int) -> int:
        """Tokens of one latent frame of size height x width (computed, never assumed)."""
        _, ph, pw = self.config.patch_size
        return (height // ph) * (width // pw)

    def kv_cache_layout(self, tokens_per_frame: int) -> tuple[int, int]:
        """(heads, tokens per frame) this process's KV cache holds: every head and token on one device; the
        local heads (tensor parallel) and the sequence-parallel share (heads for Ulysses, tokens for a ring)
        when the model is split over ranks."""
        attn = self.blocks[0].attn1
        heads = attn.to_q.weight.shape[0] // self.config.attention_head_dim  # this rank's heads (tensor parallel)
        if self.sequence_parallel is not None:
            return self.sequence_parallel.kv_cache_layout(heads, tokens_per_frame)
        return heads, tokens_per_frame

    def forward_cached(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        cross_kv: CrossKV,
        kv_cache: KVCache,
        start_frame: int,
    ) -> torch.Tensor:
        """Predict for frames [start_frame, start_frame + F) of `latents` [B, C, F, H, W], timestep [B, F];
        their keys/values go into `kv_cache` (appended, or overwriting the newest frames on a re-run)."""
        return self(latents, timestep, cross_kv=cross_kv, frame_offset=start_frame, kv_cache=kv_cache)

    def forward_masked(
        self,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        cross_kv: CrossKV,
        chunks: Sequence[tuple[int, int]],
        window_frames: int | None = None,
        sink_frames: int = 0,
    ) -> torch.Tensor:
        """All frames [0, F) at once with a block-causal mask over `chunks` (no cache)."""
        tpf = self.tokens_per_frame(latents.shape[3], latents.shape[4])
        mask = block_causal_mask(chunks, tpf, window_frames, sink_frames, latents.device)
        return self(latents, timestep, cross_kv=cross_kv, attn_mask=mask)


EntryClass = CausalWanTransformer3DModel
