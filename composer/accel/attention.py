"""Attention backend hook: point every `Attention` module at the runtime's backend (the backend registry in
composer/models/attention/backends/ lists what exists; `auto` takes the best usable one)."""

from __future__ import annotations

from typing import Any

from torch import nn

from composer.models.attention import set_attention_backend


class AttentionBackendHook:
    name = "attention"


    def apply(self, pipeline: Any) -> str:
        wanted = pipeline.runtime.attention_backend
        used: dict[str, list[str]] = {}
        for name, module in pipeline.modules.items():
            if isinstance(module, nn.Module):
                for backend in set_attention_backend(module, wanted, pipeline.runtime.attention_window):
                    used.setdefault(backend, []).append(name)
        if not used:
            return f"{wanted} (no composer attention modules)"
        return f"{wanted} -> " + ", ".join(f"{b} ({', '.join(names)})" for b, names in used.items())
