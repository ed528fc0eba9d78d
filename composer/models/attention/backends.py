"""Attention backends. SDPA always works; flash-attn is used when installed and the inputs suit it.

All backends take and return [batch, seq, heads, head_dim] tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from composer.logging import get_logger, log_once

logger = get_logger(__name__)


class SDPABackend:
    """torch.nn.functional.scaled_dot_product_attention (picks flash / memory-efficient / math kernels itself)."""

    name = "sdpa"

    def unusable_reason(self, query: torch.Tensor, attn_mask: torch.Tensor | None) -> str | None:
        return None

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=attn_mask
        )
        return out.transpose(1, 2)


class FlashAttentionBackend:
    """flash-attn 2/3 (`pip install composer[flash]`): CUDA, fp16/bf16, no mask, head_dim <= 256."""

    name = "flash"

    def __init__(self):
        try:
            from flash_attn import flash_attn_func  # noqa: PLC0415 - optional GPU-only dependency
        except ImportError:
            try:
                from flash_attn_interface import flash_attn_func  # flash-attn 3  # noqa: PLC0415
            except ImportError as exc:
                raise ImportError("flash-attn is not installed") from exc
        self._fn = flash_attn_func

    def unusable_reason(self, query: torch.Tensor, attn_mask: torch.Tensor | None) -> str | None:
        if query.device.type != "cuda":
            return f"inputs are on {query.device.type}"
        if query.dtype not in (torch.float16, torch.bfloat16):
            return f"dtype is {query.dtype} (flash-attn needs fp16 or bf16)"
        if attn_mask is not None:
            return "an attention mask is given"
        if query.shape[-1] > 256:
            return f"head_dim {query.shape[-1]} > 256"
        return None

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = self._fn(query, key, value)
        return out[0] if isinstance(out, tuple) else out


_SDPA = SDPABackend()
_flash: FlashAttentionBackend | None | bool = False  # False: not tried yet; None: unavailable


def _flash_backend() -> FlashAttentionBackend | None:
    global _flash
    if _flash is False:
        try:
            _flash = FlashAttentionBackend()
        except ImportError:
            _flash = None
    return _flash


def resolve_backend(name: str) -> SDPABackend | FlashAttentionBackend:
    """The backend for a runtime `attention_backend` setting, falling back to SDPA (said once in the log)."""
    if name == "sdpa":
        return _SDPA
    if name not in ("auto", "flash"):
        raise ValueError(f"unknown attention backend {name!r}")
    flash = _flash_backend()
    if flash is None:
        if name == "flash":
            log_once(logger, "flash-missing", "attention_backend=flash but flash-attn is not installed: using SDPA")
        else:
            log_once(logger, "auto-sdpa", "attention backend: SDPA (flash-attn not installed)")
        return _SDPA
    return flash


def run_attention(
    backend: SDPABackend | FlashAttentionBackend,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run `backend`, or SDPA when the inputs do not suit it (said once per reason)."""
    reason = backend.unusable_reason(query, attn_mask)
    if reason is not None:
        log_once(logger, f"{backend.name}:{reason}", f"{backend.name} attention unusable ({reason}): using SDPA")
        backend = _SDPA
    return backend(query, key, value, attn_mask)
