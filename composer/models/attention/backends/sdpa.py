"""SDPA: torch.nn.functional.scaled_dot_product_attention (torch picks its flash / memory-efficient / math
kernel). Always usable: every other backend falls back to it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Backend:
    name = "sdpa"
    priority = 0

    @classmethod
    def load(cls) -> Backend:
        return cls()

    def unusable_reason(
        self, query: torch.Tensor, attn_mask: torch.Tensor | None, token_grid: tuple[int, int, int] | None = None
    ) -> str | None:
        return None

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
        token_grid: tuple[int, int, int] | None = None,
    ) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=attn_mask
        )
        return out.transpose(1, 2)
