"""The three registries: model classes, per-family configs, pipelines."""

from composer.registry.configs import register_configs, registered_families, resolve_configs
from composer.registry.models import get_model_class, model_entry_points
from composer.registry.pipelines import get_pipeline_class, pipeline_entry_points

__all__ = [
    "get_model_class",
    "get_pipeline_class",
    "model_entry_points",
    "pipeline_entry_points",
    "register_configs",
    "registered_families",
    "resolve_configs",
]
