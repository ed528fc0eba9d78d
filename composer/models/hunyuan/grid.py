"""The token grid of HunyuanVideo's DiTs (HunyuanVideo and HunyuanVideo-1.5 alike): the 3D RoPE table of a
(frames, rows, cols) grid, the joint [video; text] key mask, and unpatchify."""

from __future__ import annotations

from collections import OrderedDict

import torch

from composer.models.layers.rotary import rope_frequencies

Rotary = tuple[torch.Tensor, torch.Tensor]


class HunyuanTokenGrid:
    """Mixin for a HunyuanVideo DiT: needs `config` (attention_head_dim, rope_theta, rope_axes_dim, patch_size,
    patch_size_t), a `proj_out` Linear (the model's dtype and device) and an empty OrderedDict `_rope_cache` set in
    `__init__`."""

    _rope_cache: OrderedDict[tuple, Rotary]

    @property
    def dtype(self) -> torch.dtype:
        return self.proj_out.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.proj_out.weight.device

    def rotary(self, grid: tuple[int, int, int], device: torch.device) -> Rotary:
        """RoPE cos/sin for a token grid (frames, rows, cols), cached per (grid, device): steps reuse one table."""
        key = (grid, str(device))
        if key not in self._rope_cache:
            if len(self._rope_cache) >= 8:
                self._rope_cache.popitem(last=False)
            self._rope_cache[key] = rope_frequencies(
                self.config.attention_head_dim, grid, 0, self.config.rope_theta, device,
                axis_dims=tuple(self.config.rope_axes_dim),
            )
        return self._rope_cache[key]

    @staticmethod
    def joint_key_mask(video_len: int, text_mask: torch.Tensor | None) -> torch.Tensor | None:
        """[B, 1, 1, S + L] boolean key mask over [video; text]: every video token and each row's first
        `text_mask.sum()` text tokens (the reference's rule: the text is right-padded). None: no padding."""
        if text_mask is None:
            return None
        batch, text_len = text_mask.shape
        valid = video_len + text_mask.sum(dim=1, dtype=torch.int64)
        index = torch.arange(video_len + text_len, device=text_mask.device)
        return (index.unsqueeze(0) < valid.unsqueeze(1))[:, None, None, :]

    def unpatchify(self, tokens: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """[B, S, C*pt*p*p] (channels outermost within a patch) -> [B, C, F, H, W]."""
        pt, p = self.config.patch_size_t, self.config.patch_size
        f, h, w = grid
        x = tokens.reshape(tokens.shape[0], f, h, w, -1, pt, p, p)
        return x.permute(0, 4, 1, 5, 2, 6, 3, 7).flatten(6, 7).flatten(4, 5).flatten(2, 3)
