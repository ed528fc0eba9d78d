"""Tiny models in exact diffusers layout, built locally (tests, the demo, benchmarks)."""

from composer.testing.tiny_hunyuan import TinyHunyuanSpec, build_tiny_hunyuan
from composer.testing.tiny_hunyuan15 import TinyHunyuan15Spec, build_tiny_hunyuan15, build_tiny_hunyuan15_i2v
from composer.testing.tiny_skyreels import build_tiny_skyreels_df
from composer.testing.tiny_wan import TinyWanSpec, build_tiny_wan
from composer.testing.tiny_wan22 import (
    TinyWan22Spec,
    build_tiny_wan22_a14b,
    build_tiny_wan22_i2v_a14b,
    build_tiny_wan22_ti2v,
)
from composer.testing.tiny_wan_animate import TinyWanAnimateSpec, build_tiny_wan_animate
from composer.testing.tiny_wan_i2v import TinyWanI2VSpec, build_tiny_wan_i2v
from composer.testing.tiny_wan_vace import TinyWanVACESpec, build_tiny_wan_vace

__all__ = [
    "TinyHunyuanSpec", "TinyWan22Spec", "TinyWanI2VSpec", "TinyWanSpec", "build_tiny_hunyuan", "build_tiny_wan",
    "build_tiny_wan22_a14b", "build_tiny_wan22_i2v_a14b", "build_tiny_wan22_ti2v", "build_tiny_wan_i2v",
    "build_tiny_skyreels_df", "TinyHunyuan15Spec", "build_tiny_hunyuan15", "build_tiny_hunyuan15_i2v",
    "TinyWanVACESpec", "build_tiny_wan_vace", "TinyWanAnimateSpec", "build_tiny_wan_animate",
]
