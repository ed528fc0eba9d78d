"""SDPA: torch.nn.functional.scaled_dot_product_attention (torch picks its flash / memory-efficient / math
kernel). Always usable: every other backend falls back to it.

Its `attention_with_lse` (ring attention's partial blocks) runs torch's fused kernels that return the log-sum-exp
(flash attention on the CPU; flash or memory-efficient attention on CUDA), so no [Sq, Sk] score matrix is
materialised; where none takes the inputs it returns None and the caller computes the scores itself.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from composer.logging import get_logger, log_once
from composer.models.attention.backends._base import AttentionBackend, Capabilities

logger = get_logger(__name__)


class Backend(AttentionBackend):
    name = "sdpa"
    priority = 0
    capabilities = Capabilities(mask=True, lse=True)

    def __init__(self):
        self._lse_failed: set[str] = set()  # device types whose fused LSE kernel refused once

    def unusable_reason(
        self, query: torch.Tensor, attn_mask: torch.Tensor | None, token_grid: tuple[int, int, int] | None = None
    ) -> str | None:
        return None

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
        token_grid: tuple[int, int, int] | None = None, **kwargs,
    ) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=attn_mask
        )
        return out.transpose(1, 2)

    def attention_with_lse(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(out [B, Sq, H, D] fp32, lse [B, H, Sq] fp32) from a fused kernel that returns the log-sum-exp, or None
        when there is none for these inputs. `attn_mask`: boolean (True: attend), broadcasting to [B, H, Sq, Sk];
        fully masked rows come back as the kernel leaves them (the caller masks them)."""
        device = query.device.type
        if device in self._lse_failed:
            return None
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        bias = None
        if attn_mask is not None:  # additive, in q's dtype, broadcast as the kernels want it
            bias = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill(~attn_mask, float("-inf"))
        try:
            aten = torch.ops.aten
            if device == "cpu":
                out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias,
                                                                            scale=scale)
            elif device == "cuda" and bias is None and q.dtype in (torch.float16, torch.bfloat16):
                out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[:2]
            elif device == "cuda":
                if bias is not None:
                    bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
                out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, False,
                                                                        scale=scale)[:2]
            else:
                return None
        except (RuntimeError, NotImplementedError, AttributeError) as exc:
            self._lse_failed.add(device)
            log_once(logger, f"sdpa-lse-{device}", f"sdpa: no fused kernel with log-sum-exp on {device} "
                     f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); ring attention "
                     "computes the scores explicitly (more memory per block)", logging.WARNING)
            return None
        # the efficient kernel may pad the LSE's last dim
        return out.transpose(1, 2).float(), lse[..., :q.shape[2]].float()
