"""Config registry: which (PipelineConfig, SamplingParam) pair a model folder or hub id gets.

Resolution order: exact hub id > short name (the id's last part, case-insensitive, also matched against a
local folder's name) > the family the folder's composer.json names > detectors (called with the path and
model_index `_class_name`) > an error listing the known families. The runtime option `model_family` names the
family outright (a renamed copy of a model).
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import PurePath

from composer.configs.base import PipelineConfig, SamplingParam
from composer.errors import ConfigError, UnknownModelError

Detector = Callable[[str, "str | None"], bool]


@dataclass(frozen=True)
class ModelFamily:
    """A registered family: its config classes, the hub ids it answers to and its detectors."""

    name: str
    pipeline_config_cls: type[PipelineConfig]
    sampling_param_cls: type[SamplingParam]
    hf_model_paths: tuple[str, ...]
    model_detectors: tuple[Detector, ...]


@dataclass(frozen=True)
class ResolvedConfigs:
    family: ModelFamily
    matched_by: str  # "hub id", "short name", "composer.json", "detector" or "model_family option"

    def pipeline_config(self) -> PipelineConfig:
        return self.family.pipeline_config_cls()

    def sampling_param(self) -> SamplingParam:
        return self.family.sampling_param_cls()


_families: list[ModelFamily] = []
_builtins_loaded = False
_lock = threading.Lock()


def register_configs(
    pipeline_config_cls: type[PipelineConfig],
    sampling_param_cls: type[SamplingParam],
    hf_model_paths: Sequence[str] = (),
    model_detectors: Sequence[Detector] = (),
    name: str | None = None,
) -> ModelFamily:
    """Register a family. Hub ids must be unique across families."""
    family = ModelFamily(
        name=name or pipeline_config_cls.__name__,
        pipeline_config_cls=pipeline_config_cls,
        sampling_param_cls=sampling_param_cls,
        hf_model_paths=tuple(hf_model_paths),
        model_detectors=tuple(model_detectors),
    )
    with _lock:
        taken = {p: f.name for f in _families for p in f.hf_model_paths}
        for path in family.hf_model_paths:
            if path in taken:
                raise ValueError(f"hub id {path} is already registered by family {taken[path]}")
        _families.append(family)
    return family


def registered_families() -> list[ModelFamily]:
    _load_builtins()
    return list(_families)


def sampling_param_classes() -> list[type[SamplingParam]]:
    """The base SamplingParam and every registered family's: together, every sampling knob there is (for CLI
    flags and preset checks; a request is still checked against its own family's class)."""
    return [SamplingParam, *(family.sampling_param_cls for family in registered_families())]


def sampling_field_names() -> set[str]:
    return {f.name for cls in sampling_param_classes() for f in dataclasses.fields(cls)}


_HF_CACHE_SNAPSHOT = re.compile(r"models--([^/\\]+?)--([^/\\]+)[/\\]snapshots[/\\]")


def hub_id_of(model: str) -> str:
    """The hub id a string names: itself, or the id behind a Hugging Face cache snapshot folder."""
    match = _HF_CACHE_SNAPSHOT.search(model)
    return f"{match.group(1)}/{match.group(2)}" if match else model


def _short_name(model: str) -> str:
    return PurePath(model.rstrip("/\\")).name.lower()


def resolve_configs(
    model: str,
    class_name: str | None = None,
    config_class: type[PipelineConfig] = PipelineConfig,
    family: str | None = None,
    folder_family: tuple[str, str] | None = None,
) -> ResolvedConfigs:
    """Find the family for a hub id or local path (`class_name`: model_index.json's `_class_name`), or take
    the one named by `family` (a family name or one of its hub ids, case-insensitive). `folder_family`:
    (name, file) the folder's composer.json states, used when neither the id nor the name identifies one.

    Only families whose PipelineConfig is a `config_class` (what the folder's pipeline needs) are candidates,
    so a causal folder named like a released bidirectional model still gets a causal family.
    """
    if family is not None:
        return ResolvedConfigs(_named_family(family, config_class), "model_family option")
    families = _families_for(config_class)
    hub_id = hub_id_of(model)
    for family in families:
        if hub_id in family.hf_model_paths:
            return ResolvedConfigs(family, "hub id")
    short = _short_name(hub_id)
    for family in families:
        if any(_short_name(p) == short for p in family.hf_model_paths):
            return ResolvedConfigs(family, "short name")
    if folder_family is not None:
        name, source = folder_family
        return ResolvedConfigs(_named_family(name, config_class, f"{source}: family"), "composer.json")
    for family in families:
        if any(detector(model, class_name) for detector in family.model_detectors):
            return ResolvedConfigs(family, "detector")
    known = "\n  ".join(
        f"{f.name}: {', '.join(f.hf_model_paths) or '(detector only)'}" for f in registered_families()
    )
    raise UnknownModelError(
        f"no registered model family matches '{model}'"
        + (f" (model_index _class_name '{class_name}')" if class_name else "")
        + f". Known families:\n  {known}\nSee docs/adding-a-model-family.md to add one."
    )


def _families_for(config_class: type[PipelineConfig]) -> list[ModelFamily]:
    """The registered families whose PipelineConfig fits a pipeline that needs a `config_class`."""
    return [f for f in registered_families() if issubclass(f.pipeline_config_cls, config_class)]


def _named_family(name: str, config_class: type[PipelineConfig], what: str = "model_family") -> ModelFamily:
    """The family `what` (the option, or a composer.json) names; errors say which said it."""
    wanted = name.lower()
    for family in registered_families():
        if wanted == family.name.lower() or wanted in (p.lower() for p in family.hf_model_paths):
            if not issubclass(family.pipeline_config_cls, config_class):
                raise ConfigError(
                    f"{what} = {name!r}: that family's {family.pipeline_config_cls.__name__} does not fit this "
                    f"folder's pipeline, which needs a {config_class.__name__}"
                )
            return family
    fitting = [f.name for f in _families_for(config_class)]
    raise UnknownModelError(
        f"{what} = {name!r}: no registered family has that name or hub id. Families for this pipeline: "
        f"{', '.join(fitting) or '(none)'}; `composer models` lists them all"
    )


def _load_builtins() -> None:
    """Import every module of composer.configs once; each family module registers itself at its end."""
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True
    import composer.configs

    for info in pkgutil.iter_modules(composer.configs.__path__):
        importlib.import_module(f"composer.configs.{info.name}")
