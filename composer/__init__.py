"""composer: an inference engine for video diffusion models (and diffusion language models: TextGenerator).

    from composer import VideoGenerator
    gen = VideoGenerator.from_pretrained("Wan-AI/Wan2.1-T2V-1.3B-Diffusers")
    gen.generate_video("a cat surfing a wave", output_path="cat.mp4")
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["CancelToken", "Cancelled", "GenerationResult", "PipelineConfig", "RuntimeArgs", "SamplingParam",
           "TextGenerator", "TextResult", "TextSamplingParam", "VideoGenerator"]

_EXPORTS = {
    "VideoGenerator": "composer.generator",
    "GenerationResult": "composer.generator",
    "SamplingParam": "composer.configs.base",
    "PipelineConfig": "composer.configs.base",
    "RuntimeArgs": "composer.runtime",
    "CancelToken": "composer.cancel",
    "Cancelled": "composer.errors",
    "TextGenerator": "composer.text.generator",
    "TextResult": "composer.text.generator",
    "TextSamplingParam": "composer.text.sampling",
}

if TYPE_CHECKING:
    from composer.cancel import CancelToken
    from composer.configs.base import PipelineConfig, SamplingParam
    from composer.errors import Cancelled
    from composer.generator import GenerationResult, VideoGenerator
    from composer.runtime import RuntimeArgs
    from composer.text.generator import TextGenerator, TextResult
    from composer.text.sampling import TextSamplingParam


def __getattr__(name: str):
    # Lazy: `import composer` stays cheap (the CLI's --help does not import torch-heavy modules).
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'composer' has no attribute {name!r}")
