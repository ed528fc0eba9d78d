"""Pipeline registry: model_index.json `_class_name` -> composer pipeline class.

Pipelines are found by AST discovery of `EntryClass` in composer/pipelines/**; a pipeline class lists the
`_class_name`s it serves in `class_names = (...)`.
"""

from __future__ import annotations

import functools

from composer.errors import UnknownModelError
from composer.registry.discovery import EntryPoint, discover_by_served_name


@functools.cache
def pipeline_entry_points() -> dict[str, EntryPoint]:
    """model_index `_class_name` -> pipeline entry point, discovered once per process; nothing imported."""
    return discover_by_served_name("composer.pipelines")


def get_pipeline_class(class_name: str) -> type:
    entries = pipeline_entry_points()
    if class_name not in entries:
        known = ", ".join(sorted(entries)) or "none"
        raise UnknownModelError(
            f"model_index.json asks for pipeline '{class_name}', which composer does not serve "
            f"(served: {known}). See docs/adding-a-model-family.md to add one."
        )
    return entries[class_name].load()
