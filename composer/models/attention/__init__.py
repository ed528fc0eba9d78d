"""Attention: the backend registry (one module per backend) and the one module that computes attention.

Exports resolve lazily, so reading the registry's names (settings checks, CLI help) does not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Attention": "composer.models.attention.layer",
    "set_attention_backend": "composer.models.attention.layer",
    "backend_choices": "composer.models.attention.backends",
    "backend_names": "composer.models.attention.backends",
    "resolve_backend": "composer.models.attention.backends",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
