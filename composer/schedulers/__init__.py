"""Noise schedules composer implements itself (the bidirectional pipelines use the model folder's
diffusers scheduler)."""

from composer.schedulers.flow_table import FlowMatchTable

__all__ = ["FlowMatchTable"]
