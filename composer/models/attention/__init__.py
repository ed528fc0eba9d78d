"""Attention: backend selection (SDPA, flash-attn) and the one module that computes it."""

from composer.models.attention.backends import resolve_backend
from composer.models.attention.layer import Attention, set_attention_backend

__all__ = ["Attention", "resolve_backend", "set_attention_backend"]
