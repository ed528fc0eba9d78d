"""Attention backend registry: one module per backend in this package, named after the backend, plus backends
other distributions declare (entry points) or code registers (`register_backend`).

`backend_names()` lists them without importing any (so `composer generate --help` and settings checks stay
cheap); a backend is imported when it is first resolved, and a GPU-only one imports its library inside its
class, so a missing install is a fallback said once in the log, never an import error.

A backend (a module's `Backend` class, or the object an entry point names) has:
  - `name` (str) and `priority` (int): `auto` picks the usable exact backend with the highest priority;
  - `capabilities`: a `Capabilities` (backends/_base.py) saying what it takes (devices, dtypes, masks, LSE
    output for ring attention, varlen, joint text, layouts, head size, exact or approximate);
  - `load()` (classmethod) -> an instance, raising ImportError when its library is not installed;
  - `unusable_reason(query, attn_mask, token_grid)` -> None, or why these inputs need SDPA instead
    (`AttentionBackend` derives it from the capabilities);
  - `__call__(query, key, value, attn_mask, token_grid)` on [batch, seq, heads, head_dim] tensors (and
    `joint_text=` when its capabilities ask for it);
  - optionally `attention_with_lse(...)` (capabilities.lse) and `with_window(window)` (an `attention_window`
    setting: sliding_window).
`token_grid` is the (frames, rows, cols) of a self-attention pass over a whole video's tokens, None otherwise
(cross-attention, KV-cached and sequence-parallel passes); only a spatially sparse backend reads it.

From outside the package, a distribution declares in its pyproject.toml

    [project.entry-points."composer.attention_backends"]
    npu_fia = "my_package.attention:Backend"

and `attention_backend = npu_fia` (or `auto`, by priority) uses it: one file (docs/attention-backends.md).
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
import threading
from pathlib import Path

from composer.logging import get_logger, log_once
from composer.models.attention.backends._base import AttentionBackend, Capabilities, capabilities_of

logger = get_logger(__name__)

AUTO = "auto"
FALLBACK = "sdpa"  # always usable; takes every input the others cannot
ENTRY_POINT_GROUP = "composer.attention_backends"
_loaded: dict[str, object | None] = {}  # name -> instance, or None when its library is missing
_missing: dict[str, str] = {}  # name -> why it could not load
_registered: dict[str, object] = {}  # name -> backend class (register_backend)
_plugins: dict[str, object] | None = None  # name -> entry point, read once (refresh_backends reads again)
_lock = threading.RLock()


def _builtin_names() -> tuple[str, ...]:
    return tuple(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)]) if not m.name.startswith("_"))


def _entry_points() -> dict[str, object]:
    global _plugins
    if _plugins is None:
        from importlib.metadata import entry_points

        _plugins = {}
        for point in entry_points(group=ENTRY_POINT_GROUP):
            if point.name in _builtin_names():
                log_once(logger, f"plugin-shadow:{point.name}", f"attention backend plug-in {point.name} "
                         f"({point.value}) has a built-in backend's name: ignored")
                continue
            _plugins[point.name] = point
    return _plugins


def register_backend(name: str, backend_class) -> None:
    """Register a backend class under `name` from code (a plug-in package can also use an entry point); it
    replaces an earlier registration of that name. Built-in names cannot be replaced."""
    if name in (AUTO, *_builtin_names()):
        raise ValueError(f"{name!r} is a built-in attention backend's name: register under another name")
    with _lock:
        _registered[name] = backend_class
        _loaded.pop(name, None)
        _missing.pop(name, None)


def refresh_backends() -> None:
    """Read the entry points again and forget every loaded backend (after installing a plug-in in a running
    process; tests)."""
    global _plugins
    with _lock:
        _plugins = None
        _loaded.clear()
        _missing.clear()


def backend_names() -> tuple[str, ...]:
    """Every backend (built-in, registered, from entry points), without importing any of them."""
    return tuple(sorted({*_builtin_names(), *_registered, *_entry_points()}))


def backend_choices() -> tuple[str, ...]:
    """What `attention_backend` accepts: `auto` and every backend."""
    return (AUTO, *backend_names())


def _backend_class(name: str):
    if name in _registered:
        return _registered[name]
    if name in _builtin_names():
        return importlib.import_module(f"{__name__}.{name}").Backend
    return _entry_points()[name].load()


def _load(name: str):
    with _lock:
        if name not in _loaded:
            try:
                _loaded[name] = _backend_class(name).load()
            except ImportError as exc:
                _loaded[name] = None
                _missing[name] = str(exc)
                log_once(logger, f"missing:{name}", f"attention backend {name} is not usable here ({exc})")
        return _loaded[name]


def resolve_backend(name: str):
    """The backend for an `attention_backend` setting. `auto`: the usable exact backend with the highest priority;
    a named backend whose library is missing falls back to SDPA (said once in the log)."""
    if name == AUTO:
        usable = [b for b in (_load(n) for n in backend_names()) if b is not None and capabilities_of(b).exact]
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


def fallback_backend():
    """SDPA: takes every input."""
    return _load(FALLBACK)


def run_attention(backend, query, key, value, attn_mask=None, token_grid=None, joint_text: int = 0):
    """Run `backend`, or SDPA when these inputs do not suit it (said once per reason). `joint_text` (the last
    tokens are a joint attention's text) reaches a backend whose capabilities ask for it."""
    reason = backend.unusable_reason(query, attn_mask, token_grid)
    if reason is not None:
        log_once(logger, f"{backend.name}:{reason}", f"{backend.name} attention unusable ({reason}): using {FALLBACK}")
        backend = _load(FALLBACK)
    if joint_text and capabilities_of(backend).joint_text:
        return backend(query, key, value, attn_mask, token_grid, joint_text=joint_text)
    return backend(query, key, value, attn_mask, token_grid)


def attention_with_lse(backend, query, key, value, attn_mask, scale: float):
    """(out [B, Sq, H, D] fp32, lse [B, H, Sq] fp32) of `query` over one key block: `backend`'s own LSE kernel
    where its capabilities declare one and take these inputs, else SDPA's; None when no kernel takes them (the
    caller computes the scores itself)."""
    for candidate in (backend, _load(FALLBACK)):
        if candidate is None or not capabilities_of(candidate).lse:
            continue
        if candidate.unusable_reason(query, attn_mask, None) is not None:
            continue
        result = candidate.attention_with_lse(query, key, value, attn_mask, scale)
        if result is not None:
            return result
    return None


def describe_backends() -> list[tuple[str, str]]:
    """(name, what it is) for every backend: its capabilities, or why it cannot load here (loads each)."""
    rows = []
    for name in backend_names():
        backend = _load(name)
        rows.append((name, f"priority {backend.priority}; {capabilities_of(backend).describe()}" if backend is not None
                     else f"not usable here ({_missing.get(name, 'unknown')})"))
    return rows


__all__ = [
    "AUTO", "ENTRY_POINT_GROUP", "FALLBACK", "AttentionBackend", "Capabilities", "attention_with_lse",
    "backend_choices", "backend_names", "capabilities_of", "describe_backends", "fallback_backend",
    "refresh_backends", "register_backend", "resolve_backend", "run_attention",
]
