"""What an attention backend is: `AttentionBackend`, and the `Capabilities` it declares.

A backend states what it supports instead of composer guessing from its name: the registry, ring attention and
the joint-attention models read `capabilities`, and the default `unusable_reason` is derived from it (device
types, dtypes, masks, head size), so a new backend is usually a `capabilities` line and a `__call__`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Capabilities:
    """What a backend takes.

    - `devices`: the device types it runs on (None: any).
    - `dtypes`: the dtypes it takes (None: any).
    - `mask`: takes an `attn_mask` (boolean True = attend, or additive, broadcasting to [B, H, Sq, Sk]).
    - `lse`: has `attention_with_lse(q, k, v, attn_mask, scale)` -> (out [B, Sq, H, D] fp32, lse [B, H, Sq] fp32),
      the log-sum-exp ring attention merges partial blocks with (composer/parallel/ring.py).
    - `varlen`: has `attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k)` over packed sequences
      ([total, H, D], flash-attn's convention), for requests of different lengths in one call.
    - `joint_text`: wants `joint_text=n` when the last n tokens of a joint video + text self-attention are the
      text (HunyuanVideo), to compute the two parts its own way (an NPU fused kernel does them separately).
    - `layouts`: the tensor layouts `__call__` takes; composer hands [batch, seq, heads, head_dim] ("bshd").
    - `max_head_dim`: the largest head size its kernel takes (None: any).
    - `exact`: computes softmax attention exactly (False: an approximation, e.g. a sparse window; `auto` never
      picks one).
    """

    devices: tuple[str, ...] | None = None
    dtypes: tuple[torch.dtype, ...] | None = None
    mask: bool = True
    lse: bool = False
    varlen: bool = False
    joint_text: bool = False
    layouts: tuple[str, ...] = ("bshd",)
    max_head_dim: int | None = None
    exact: bool = True

    def describe(self) -> str:
        parts = [f"devices {'/'.join(self.devices) if self.devices else 'any'}"]
        if self.dtypes:
            parts.append("dtypes " + "/".join(str(d).removeprefix("torch.") for d in self.dtypes))
        parts += [name for name in ("mask", "lse", "varlen", "joint_text") if getattr(self, name)]
        if self.max_head_dim:
            parts.append(f"head_dim <= {self.max_head_dim}")
        if not self.exact:
            parts.append("approximate")
        return ", ".join(parts)


class AttentionBackend:
    """Base of composer's backends (optional for a plug-in: the registry reads the same attributes from any
    class). Subclasses set `name`, `priority`, `capabilities` and write `__call__`."""

    name = "base"
    priority = 0  # `auto` picks the usable exact backend with the highest priority
    capabilities = Capabilities()

    @classmethod
    def load(cls) -> AttentionBackend:
        """An instance; raises ImportError when the library it needs is not installed."""
        return cls()

    def unusable_reason(self, query: torch.Tensor, attn_mask: torch.Tensor | None,
                        token_grid: tuple[int, int, int] | None = None) -> str | None:
        """None, or why these inputs need the fallback (SDPA) instead: derived from `capabilities`."""
        return capability_problem(self.capabilities, query, attn_mask)

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: torch.Tensor | None = None, token_grid: tuple[int, int, int] | None = None,
                 **kwargs) -> torch.Tensor:
        raise NotImplementedError


def capability_problem(caps: Capabilities, query: torch.Tensor, attn_mask: torch.Tensor | None) -> str | None:
    """Why `caps` do not cover these inputs (None when they do)."""
    if caps.devices is not None and query.device.type not in caps.devices:
        return f"inputs are on {query.device.type}"
    if caps.dtypes is not None and query.dtype not in caps.dtypes:
        wanted = " or ".join(str(d).removeprefix("torch.") for d in caps.dtypes)
        return f"dtype is {str(query.dtype).removeprefix('torch.')} (needs {wanted})"
    if attn_mask is not None and not caps.mask:
        return "an attention mask is given"
    if caps.max_head_dim is not None and query.shape[-1] > caps.max_head_dim:
        return f"head_dim {query.shape[-1]} > {caps.max_head_dim}"
    return None


def capabilities_of(backend) -> Capabilities:
    """A backend's capabilities; a plug-in that declares none is taken as a plain exact backend (mask, no LSE)."""
    return getattr(backend, "capabilities", None) or Capabilities()
