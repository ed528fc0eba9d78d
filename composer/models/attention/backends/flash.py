"""flash-attn 2 or 3 (`pip install composer[flash]`): CUDA, fp16/bf16, no mask, head_dim <= 256."""

from __future__ import annotations

import torch


class Backend:
    name = "flash"
    priority = 10  # preferred by `auto` when installed

    def __init__(self, fn):
        self._fn = fn

    @classmethod
    def load(cls) -> Backend:
        try:
            from flash_attn import flash_attn_func  # noqa: PLC0415 - optional GPU-only dependency
        except ImportError:
            try:
                from flash_attn_interface import flash_attn_func  # flash-attn 3  # noqa: PLC0415
            except ImportError as exc:
                raise ImportError("flash-attn is not installed") from exc
        return cls(flash_attn_func)

    def unusable_reason(
        self, query: torch.Tensor, attn_mask: torch.Tensor | None, token_grid: tuple[int, int, int] | None = None
    ) -> str | None:
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
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
        token_grid: tuple[int, int, int] | None = None,
    ) -> torch.Tensor:
        out = self._fn(query, key, value)
        return out[0] if isinstance(out, tuple) else out
