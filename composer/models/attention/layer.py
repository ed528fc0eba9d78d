"""`Attention`: the single module through which every composer model computes attention.

Models hand it projected, normed, rotated q/k/v. It has a role: `self` attention may carry a KV cache handle
(causal generation: this pass's keys/values are written to the cache and every visible cached key is attended
to); `cross` attention gets the text's keys/values, usually precomputed once per prompt. Parallel strategies
(sequence parallel and the like) wrap or replace this one module, so model code stays the same on one device
or many.
"""

from __future__ import annotations

import torch
from torch import nn

from composer.models.attention.backends import AUTO, resolve_backend, run_attention

ROLES = ("self", "cross")


class Attention(nn.Module):
    """softmax(q k^T / sqrt(d)) v over [batch, seq, heads, head_dim] tensors, on the selected backend."""

    def __init__(self, role: str = "self", backend: str = AUTO, window: list[int] | None = None):
        super().__init__()
        if role not in ROLES:
            raise ValueError(f"attention role must be one of {ROLES}, got {role!r}")
        self.role = role
        # A sequence-parallel strategy (composer.parallel.sequence) computing self-attention across ranks; set
        # by the parallel hook. Cross-attention needs none: local queries attend to the whole text.
        self.parallel = None
        self.set_backend(backend, window)

    def set_backend(self, name: str, window: list[int] | None = None) -> None:
        """`window`: (frames, rows, cols) for a windowed backend (`attention_window`); others ignore it."""
        self.backend_name = name
        self.window = None if window is None else tuple(window)
        self._backend = None  # resolved on first use (or by the attention-backend hook at load)

    @property
    def backend(self):
        if self._backend is None:
            backend = resolve_backend(self.backend_name)
            if hasattr(backend, "with_window"):
                backend = backend.with_window(self.window)
            self._backend = backend
        return self._backend

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        kv_cache=None,
        token_grid: tuple[int, int, int] | None = None,
        joint_text: int = 0,
    ) -> torch.Tensor:
        """`kv_cache` (self role only): a layer handle of `composer.cache.KVCache` positioned on this pass;
        `update(k, v)` stores this pass's keys/values and returns every key/value the pass may see.
        `token_grid` (self role): the (frames, rows, cols) the tokens lie on, frame-major, for a windowed
        backend; only a pass over the whole grid (no KV cache, one device) hands it on.
        `joint_text` (self role): the last `joint_text` tokens are text that every sequence-parallel rank holds
        whole, after this rank's video tokens (joint attention: HunyuanVideo); `attn_mask` then covers the whole
        video followed by the text."""
        if joint_text and self.parallel is not None and self.role == "self":
            if kv_cache is not None:
                raise ValueError("joint text attention takes no KV cache")
            return self.parallel.attention(self.backend, query, key, value, attn_mask, joint_text=joint_text)
        if kv_cache is not None:
            if self.role != "self":
                raise ValueError("only self-attention keeps a KV cache; cross-attention takes precomputed text k/v")
            if self.parallel is not None:
                return self.parallel.attention(self.backend, query, key, value, attn_mask, kv_cache)
            key, value = kv_cache.update(key, value)
        elif self.parallel is not None and self.role == "self":
            return self.parallel.attention(self.backend, query, key, value, attn_mask)
        grid = token_grid if self.role == "self" else None
        return run_attention(self.backend, query, key, value, attn_mask, grid,
                             joint_text=joint_text if self.role == "self" else 0)

    def extra_repr(self) -> str:
        return f"role={self.role}, backend={self.backend_name}"


def set_attention_backend(model: nn.Module, name: str, window: list[int] | None = None) -> list[str]:
    """Point every Attention module of `model` at backend `name` (`auto` or a registered backend; `window`
    for a windowed one); returns the names of the backends they resolved to."""
    used = []
    for module in model.modules():
        if isinstance(module, Attention):
            module.set_backend(name, window)
            used.append(module.backend.name)
    return sorted(set(used))
