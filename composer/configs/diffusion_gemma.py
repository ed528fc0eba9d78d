"""DiffusionGemma (google's block-diffusion language models) as diffusers' DiffusionGemmaPipeline folders hold them."""

from __future__ import annotations

from dataclasses import dataclass

from composer.configs.base import PipelineConfig
from composer.configs.text import TextSamplingParam
from composer.registry.configs import register_configs


@dataclass
class DiffusionGemmaConfig(PipelineConfig):
    """Nothing beyond the folder: the canvas length is the model config's, the sampler the scheduler's."""


@dataclass
class DiffusionGemmaSamplingParam(TextSamplingParam):
    """diffusers' DiffusionGemmaPipeline defaults: 256 tokens (canvases of the model's canvas_length), 48 steps a
    canvas, greedy; adaptive stopping once a row's prediction is stable for `stability_threshold` steps with a mean
    entropy under `confidence_threshold` (None: every step runs). The folder's scheduler config holds the other
    sampling knobs (top-k, thresholds, annealing)."""

    gen_length: int = 256
    num_inference_steps: int = 48
    stability_threshold: int = 1
    confidence_threshold: float | None = 0.005


register_configs(
    DiffusionGemmaConfig,
    DiffusionGemmaSamplingParam,
    hf_model_paths=["google/diffusiongemma-26B-A4B-it"],
    model_detectors=[lambda path, class_name: class_name == "DiffusionGemmaPipeline"],
    name="diffusion-gemma",
)
