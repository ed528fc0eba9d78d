"""Model folder reading and component loading."""

from composer.loader.components import ComponentLoader
from composer.loader.model_index import ModelIndex, read_model_index
from composer.loader.resolve import resolve_model_path

__all__ = ["ComponentLoader", "ModelIndex", "read_model_index", "resolve_model_path"]
