"""The embedded demo models trained on synthetic moving shapes: 64x64 clips, quick defaults. The folders are
package data (composer/demo/models); the code that trained them is the checkout's demo/, not the engine's."""

from __future__ import annotations

from dataclasses import dataclass, field

from composer.configs.base import SamplingParam
from composer.configs.causal_wan import CausalWanConfig, CausalWanSamplingParam
from composer.configs.wan import WanT2VConfig
from composer.registry.configs import register_configs


@dataclass
class ShapesT2VConfig(WanT2VConfig):
    """The shapes model's step-caching settings: TeaCache coefficients fitted on it (`python scripts/fit_teacache.py
    --steps 10,20,30,50`: 848 points from 8 prompts, R^2 0.67; positive over the whole fitted range) and the
    thresholds measured on it at 30 steps over the demo prompts (docs/step-caching.md)."""

    teacache_coefficients: dict[int, tuple[float, ...]] = field(default_factory=lambda: {
        128: (1.08949690e02, -8.74712948e01, 2.08745796e01, -9.58064813e-01, 3.44407537e-02),
    })
    teacache_thresholds: dict[int, float] = field(default_factory=lambda: {128: 0.08})
    dbcache_threshold: float = 0.1


@dataclass
class ShapesT2VSamplingParam(SamplingParam):
    """What the shapes model was trained on: 64x64, 17 frames at 8 fps; 24 steps. Guidance 5, chosen on 48
    held-out prompts (docs/demo-model.md: direction 79% at guidance 4, 85% at 5 and 6; colour falls past 7)."""

    negative_prompt: str | None = ""
    height: int = 64
    width: int = 64
    num_frames: int = 17
    num_inference_steps: int = 24
    guidance_scale: float = 5.0
    fps: int = 8


@dataclass
class ShapesCausalSamplingParam(CausalWanSamplingParam):
    """The causal shapes model: 64x64 at 8 fps, 33 frames by default; long videos in rollouts of 6 blocks (one
    latent frame each), each restarted from the last 3 latent frames. Unlike Self-Forcing's distilled models it
    was trained with caption dropout, so it samples with CFG: guidance 2 (direction 71% without, 90% at 2, 85%
    at 3 on 48 held-out prompts; docs/demo-model.md)."""

    negative_prompt: str | None = ""
    guidance_scale: float = 2.0
    height: int = 64
    width: int = 64
    num_frames: int = 33
    fps: int = 8
    rollout_blocks: int | None = 6
    overlap_frames: int = 3


# The packaged folders are named after the ids' last parts, so they resolve by short name.
register_configs(ShapesT2VConfig, ShapesT2VSamplingParam, hf_model_paths=["composer/shapes-t2v"], name="shapes-t2v")
register_configs(
    CausalWanConfig, ShapesCausalSamplingParam, hf_model_paths=["composer/shapes-causal"], name="shapes-causal"
)
