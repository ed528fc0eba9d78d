"""Attention: the backend registry (one module per backend) and the one module that computes attention."""

from composer.models.attention.backends import backend_choices, backend_names, resolve_backend
from composer.models.attention.layer import Attention, set_attention_backend

__all__ = ["Attention", "backend_choices", "backend_names", "resolve_backend", "set_attention_backend"]
