"""LLaDA2 (inclusionAI's masked-diffusion language models) as diffusers' LLaDA2Pipeline folders hold them."""

from __future__ import annotations

from dataclasses import dataclass

from composer.configs.base import PipelineConfig
from composer.registry.configs import register_configs
from composer.text.sampling import TextSamplingParam


@dataclass
class LLaDA2Config(PipelineConfig):
    """The special tokens, when the folder's tokenizer does not say them (model_index.json may set either)."""

    mask_token_id: int | None = None
    eos_token_id: int | None = None


@dataclass
class LLaDA2SamplingParam(TextSamplingParam):
    """diffusers' LLaDA2Pipeline defaults: 2048 tokens in blocks of the scheduler's length, 32 steps a block,
    greedy (temperature 0), threshold 0.7, editing above 0.5 for up to 16 steps, EOS early stop."""


register_configs(
    LLaDA2Config,
    LLaDA2SamplingParam,
    model_detectors=[lambda path, class_name: class_name == "LLaDA2Pipeline"],
    name="llada2",
)
