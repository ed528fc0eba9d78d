"""Reading a diffusers model folder's `model_index.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from composer.errors import ModelFormatError


@dataclass(frozen=True)
class ComponentSpec:
    """One entry of model_index.json: `"vae": ["diffusers", "AutoencoderKLWan"]`."""

    name: str
    library: str
    class_name: str


@dataclass(frozen=True)
class ModelIndex:
    folder: Path
    class_name: str
    components: dict[str, ComponentSpec]
    extra: dict  # non-component entries (boundary_ratio, expand_timesteps, ...)

    def component(self, name: str) -> ComponentSpec:
        if name not in self.components:
            raise ModelFormatError(
                f"{self.folder / 'model_index.json'} has no '{name}' component "
                f"(it lists: {', '.join(sorted(self.components)) or 'none'})"
            )
        return self.components[name]


def read_model_index(folder: Path) -> ModelIndex:
    """Parse model_index.json; errors name the file and what is wrong with it."""
    path = folder / "model_index.json"
    if not path.is_file():
        present = sorted(p.name for p in folder.iterdir())[:12]
        raise ModelFormatError(
            f"{folder} has no model_index.json, so it is not a diffusers-format model folder "
            f"(it holds: {', '.join(present) or 'nothing'}). Point --model-path at the folder that has it."
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFormatError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict) or not isinstance(raw.get("_class_name"), str):
        raise ModelFormatError(f"{path} has no '_class_name' string naming the pipeline")
    components, extra = {}, {}
    for key, value in raw.items():
        if key.startswith("_"):
            continue
        if isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) or v is None for v in value):
            if value[0] is None or value[1] is None:  # an optional component left out
                continue
            components[key] = ComponentSpec(key, value[0], value[1])
        else:
            extra[key] = value
    return ModelIndex(folder=folder, class_name=raw["_class_name"], components=components, extra=extra)
