"""`Attention`: the single module through which every composer model computes attention.

Models hand it projected, normed, rotated q/k/v; parallel strategies (sequence parallel and the like) wrap
or replace it, so model code stays the same on one device or many.
"""

from __future__ import annotations

import torch
from torch import nn

from composer.models.attention.backends import resolve_backend, run_attention


class Attention(nn.Module):
    """softmax(q k^T / sqrt(d)) v over [batch, seq, heads, head_dim] tensors, on the selected backend."""

    def __init__(self, backend: str = "auto"):
        super().__init__()
        self.set_backend(backend)

    def set_backend(self, name: str) -> None:
        self.backend_name = name
        self._backend = resolve_backend(name)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return run_attention(self._backend, query, key, value, attn_mask)

    def extra_repr(self) -> str:
        return f"backend={self.backend_name}"


def set_attention_backend(model: nn.Module, name: str) -> None:
    """Point every Attention module of `model` at backend `name` ("auto", "sdpa", "flash")."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.set_backend(name)
