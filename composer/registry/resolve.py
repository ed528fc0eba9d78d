"""Resolving a model: a path or hub id to its folder, pipeline class, family and stated defaults, without loading.

What `VideoGenerator.from_pretrained`, the CLI's request check (before loading) and the text limits share.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from composer.configs.base import SamplingParam
from composer.loader.components import check_component_configs
from composer.loader.folder_settings import FolderSettings, read_folder_settings
from composer.loader.model_index import read_model_index
from composer.loader.resolve import resolve_model_path
from composer.registry.configs import resolve_configs
from composer.registry.pipelines import get_pipeline_class


def _folder_sampling(family_defaults: SamplingParam, settings: FolderSettings) -> SamplingParam:
    """The family's defaults with the composer.json `sampling` values over them (ConfigError naming the file
    for a key the family's SamplingParam lacks or a value of the wrong type)."""
    if not settings.sampling:
        return family_defaults
    return family_defaults.with_folder_defaults(settings.sampling, source=str(settings.path))


@dataclasses.dataclass
class ResolvedModel:
    """What `from_pretrained` would load, found without loading it."""

    model_path: str  # as given (None: the embedded default model's folder)
    index: Any  # ModelIndex
    pipeline_cls: type
    configs: Any  # ResolvedConfigs: the family and its config classes
    settings: FolderSettings  # the folder's composer.json (empty when it has none)
    stated: SamplingParam  # the family's sampling defaults with the composer.json values over them


def resolve_model(model_path: str | os.PathLike | None, model_family: str | None = None) -> ResolvedModel:
    """Resolve a path or hub id to its folder, pipeline class, family and stated defaults (no weights read;
    a bad composer.json, or a value of the wrong type in a composer model's config, fails here, before loading)."""
    if model_path is None:
        from composer.default_model import default_model_path

        model_path = default_model_path()
    model_path = str(model_path)
    folder = resolve_model_path(model_path)
    index = read_model_index(folder)
    pipeline_cls = get_pipeline_class(index.class_name).for_folder(index)
    check_component_configs(folder, _loaded_components(index, pipeline_cls), libraries=False)  # no library import
    settings = read_folder_settings(folder)
    configs = resolve_configs(
        model_path if not Path(model_path).is_dir() else str(folder), index.class_name, pipeline_cls.config_class,
        family=model_family,
        folder_family=(settings.family, str(settings.path)) if settings.family else None,
    )
    stated = _folder_sampling(configs.sampling_param(), settings)
    return ResolvedModel(model_path, index, pipeline_cls, configs, settings, stated)


def _loaded_components(index: Any, pipeline_cls: type) -> list:
    return [index.components[name] for name in pipeline_cls.required_modules if name in index.components]


def check_model_configs(resolved: ResolvedModel) -> None:
    """Every component config the pipeline will load, the libraries' (VAE, text encoders, scheduler) too, checked
    for values of the wrong type before anything loads."""
    check_component_configs(resolved.index.folder, _loaded_components(resolved.index, resolved.pipeline_cls))


