"""Attention backend registry: one module per backend in this package, named after the backend.

`backend_names()` lists the modules without importing them (so `composer generate --help` and settings checks
stay cheap); a backend module is imported when it is first resolved, and a GPU-only one imports its library
inside its class, so a missing install is a fallback said once in the log, never an import error.

A backend module defines `Backend`, a class with:
  - `priority` (int): `auto` picks the available backend with the highest one;
  - `load()` (classmethod) -> an instance, raising ImportError when its library is not installed;
  - `unusable_reason(query, attn_mask, token_grid)` -> None, or why these inputs need SDPA instead;
  - `__call__(query, key, value, attn_mask, token_grid)` on [batch, seq, heads, head_dim] tensors;
  - optionally `with_window(window)`: the backend with an `attention_window` setting (sliding_window).
`token_grid` is the (frames, rows, cols) of a self-attention pass over a whole video's tokens, None otherwise
(cross-attention, KV-cached and sequence-parallel passes); only a spatially sparse backend reads it.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
from pathlib import Path

from composer.logging import get_logger, log_once

logger = get_logger(__name__)

AUTO = "auto"
FALLBACK = "sdpa"  # always usable; takes every input the others cannot
_loaded: dict[str, object | None] = {}  # name -> instance, or None when its library is missing
_missing: dict[str, str] = {}  # name -> why it could not load


def backend_names() -> tuple[str, ...]:
    """Every registered backend (the module names of this package), without importing any of them."""
    return tuple(sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)]) if not m.name.startswith("_")))


def backend_choices() -> tuple[str, ...]:
    """What `attention_backend` accepts: `auto` and every registered backend."""
    return (AUTO, *backend_names())


def _load(name: str):
    if name not in _loaded:
        module = importlib.import_module(f"{__name__}.{name}")
        try:
            _loaded[name] = module.Backend.load()
        except ImportError as exc:
            _loaded[name] = None
            _missing[name] = str(exc)
            log_once(logger, f"missing:{name}", f"attention backend {name} is not usable here ({exc})")
    return _loaded[name]


def resolve_backend(name: str):
    """The backend for an `attention_backend` setting. `auto`: the usable backend with the highest priority;
    a named backend whose library is missing falls back to SDPA (said once in the log)."""
    if name == AUTO:
        usable = [b for b in (_load(n) for n in backend_names()) if b is not None]
        best = max(usable, key=lambda b: b.priority)
        log_once(logger, f"auto:{best.name}", f"attention backend (auto): {best.name}")
        return best
    if name not in backend_names():
        raise ValueError(f"unknown attention backend {name!r} (expected one of {', '.join(backend_choices())})")
    backend = _load(name)
    if backend is None:
        # a warning: the user asked for this backend by name, and the fallback is usually much slower
        log_once(logger, f"fallback:{name}", f"attention_backend = {name} is not usable here ({_missing[name]}): "
                 f"using {FALLBACK}; install it or choose another --attention-backend", logging.WARNING)
        return _load(FALLBACK)
    return backend


def run_attention(backend, query, key, value, attn_mask=None, token_grid=None):
    """Run `backend`, or SDPA when these inputs do not suit it (said once per reason)."""
    reason = backend.unusable_reason(query, attn_mask, token_grid)
    if reason is not None:
        log_once(logger, f"{backend.name}:{reason}", f"{backend.name} attention unusable ({reason}): using {FALLBACK}")
        backend = _load(FALLBACK)
    return backend(query, key, value, attn_mask, token_grid)
