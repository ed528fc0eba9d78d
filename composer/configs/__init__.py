"""Per-family PipelineConfig / SamplingParam dataclasses."""

from composer.configs.base import PipelineConfig, SamplingParam

__all__ = ["PipelineConfig", "SamplingParam"]
