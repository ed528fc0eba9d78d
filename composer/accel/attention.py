"""Attention backend hook: point every `Attention` module at the runtime's backend (the backend registry in
composer/models/attention/backends/ lists what exists; `auto` takes the best usable one)."""

from __future__ import annotations

from typing import Any

from torch import nn

from composer.attach import attach
from composer.models.attention import Attention, set_attention_backend


def _restore(saved: list[tuple[Attention, dict[str, Any]]]) -> None:
    for module, state in saved:
        module.__dict__.update(state)


class AttentionBackendHook:
    """Every Attention module on the runtime's backend; removing it gives each module the backend (and window)
    it had before."""

    name = "attention"

    def apply(self, pipeline: Any) -> str:
        wanted = pipeline.runtime.attention_backend
        used: dict[str, list[str]] = {}
        saved = [(m, {k: m.__dict__[k] for k in ("backend_name", "window", "_backend") if k in m.__dict__})
                 for module in pipeline.modules.values() if isinstance(module, nn.Module)
                 for m in module.modules() if isinstance(m, Attention)]
        attach(undo=lambda: _restore(saved), what=f"{len(saved)} attention modules' backend")
        for name, module in pipeline.modules.items():
            if isinstance(module, nn.Module):
                for backend in set_attention_backend(module, wanted, pipeline.runtime.attention_window):
                    used.setdefault(backend, []).append(name)
        if not used:
            return f"{wanted} (no composer attention modules)"
        return f"{wanted} -> " + ", ".join(f"{b} ({', '.join(names)})" for b, names in used.items())
