"""flash-attn 2 or 3 (`pip install composer[flash]`): CUDA, fp16/bf16, no mask, head_dim <= 256; returns the
log-sum-exp for ring attention."""

from __future__ import annotations

import torch

from composer.models.attention.backends._base import AttentionBackend, Capabilities


class Backend(AttentionBackend):
    name = "flash"
    priority = 10  # preferred by `auto` when installed
    capabilities = Capabilities(devices=("cuda",), dtypes=(torch.float16, torch.bfloat16), mask=False, lse=True,
                                max_head_dim=256)

    def __init__(self, fn, version: int = 2):
        self._fn = fn
        self.version = version

    @classmethod
    def load(cls) -> Backend:
        try:
            from flash_attn import flash_attn_func  # noqa: PLC0415 - optional GPU-only dependency
            return cls(flash_attn_func, 2)
        except ImportError:
            try:
                from flash_attn_interface import flash_attn_func  # flash-attn 3  # noqa: PLC0415
            except ImportError as exc:
                raise ImportError("flash-attn is not installed") from exc
            return cls(flash_attn_func, 3)

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
        token_grid: tuple[int, int, int] | None = None, **kwargs,
    ) -> torch.Tensor:
        out = self._fn(query, key, value)
        return out[0] if isinstance(out, tuple) else out

    def attention_with_lse(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(out [B, Sq, H, D] fp32, lse [B, H, Sq] fp32): both versions return the softmax LSE with
        `return_attn_probs=True` (flash-attn 2: (out, lse, probs); 3: (out, lse))."""
        if attn_mask is not None or self.unusable_reason(query, None) is not None:
            return None
        try:
            result = self._fn(query, key, value, softmax_scale=scale, return_attn_probs=True)
        except TypeError:  # a flash-attn 3 build without the keyword returns (out, lse) on its own
            result = self._fn(query, key, value, softmax_scale=scale)
        if not isinstance(result, tuple) or len(result) < 2:
            return None  # no LSE from this build: the caller takes SDPA's
        out, lse = result[0], result[1]
        return out.float(), lse[..., :query.shape[1]].float()
