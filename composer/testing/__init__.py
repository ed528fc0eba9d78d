"""Tiny models in exact diffusers layout, built locally (tests, the demo, benchmarks)."""

from composer.testing.tiny_wan import TinyWanSpec, build_tiny_wan
from composer.testing.tiny_wan_i2v import TinyWanI2VSpec, build_tiny_wan_i2v

__all__ = ["TinyWanI2VSpec", "TinyWanSpec", "build_tiny_wan", "build_tiny_wan_i2v"]
