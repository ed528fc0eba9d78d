"""Model registry: composer's own model classes, found by AST discovery of `EntryClass` in composer/models/**.

A model class lists the checkpoint `_class_name`s it loads in `class_names = (...)` (composer's Wan DiT
serves diffusers' `WanTransformer3DModel` and the original release's `WanModel`), so a component folder's
`config.json` picks it directly.
"""

from __future__ import annotations

import functools

from composer.errors import UnknownModelError
from composer.registry.discovery import EntryPoint, discover_by_served_name


@functools.cache
def model_entry_points() -> dict[str, EntryPoint]:
    """Checkpoint class name -> entry point, discovered once per process; nothing is imported."""
    return discover_by_served_name("composer.models")


def has_model_class(class_name: str) -> bool:
    return class_name in model_entry_points()


def get_model_class(class_name: str) -> type:
    """Import and return composer's model class for a checkpoint's `_class_name`."""
    entries = model_entry_points()
    if class_name not in entries:
        known = ", ".join(sorted(entries)) or "none"
        raise UnknownModelError(
            f"composer has no model class for '{class_name}' (known: {known}). "
            "See docs/adding-a-model-family.md to add one."
        )
    return entries[class_name].load()
