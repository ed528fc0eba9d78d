"""Tiny models in exact diffusers layout, built locally (tests, the demo, benchmarks)."""

from composer.testing.tiny_wan import TinyWanSpec, build_tiny_wan

__all__ = ["TinyWanSpec", "build_tiny_wan"]
