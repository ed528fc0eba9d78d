"""Diffusion language models: text by iterative denoising (docs/text-diffusion.md)."""

from composer.text.generator import TextGenerator, TextPiece, TextResult
from composer.text.pipeline import TextStats
from composer.text.sampling import TextSamplingParam

__all__ = ["TextGenerator", "TextPiece", "TextResult", "TextSamplingParam", "TextStats"]
