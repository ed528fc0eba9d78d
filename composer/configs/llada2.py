"""LLaDA2 (inclusionAI's masked-diffusion language models) as diffusers' LLaDA2Pipeline folders hold them."""

from __future__ import annotations

from dataclasses import dataclass

from composer.configs.base import PipelineConfig
from composer.configs.text import TextSamplingParam
from composer.registry.configs import register_configs


@dataclass
class LLaDA2Config(PipelineConfig):
    """The special tokens, when the folder's tokenizer does not say them (model_index.json may set either)."""

    mask_token_id: int | None = None
    eos_token_id: int | None = None


@dataclass
class LLaDA2SamplingParam(TextSamplingParam):
    """diffusers' LLaDA2Pipeline defaults: 2048 tokens in blocks of the scheduler's length, 32 steps a block,
    greedy (temperature 0), threshold 0.7, editing above 0.5 for up to 16 steps, EOS early stop."""


@dataclass
class TinyDllmSamplingParam(TextSamplingParam):
    """The embedded tiny-dllm (addition; composer/text/tasks.py): 8 tokens in one block (the whole answer, as it was
    trained), 8 steps at most, every token more probable than 0.9 committed at once (at least one a step: on the
    10,310 held-out problems as right as one token a step, in 2.4 forwards instead of 8), no editing, the chat
    template (which writes "123+456=" as the model was trained: "1 2 3 + 4 5 6 ="). Its folder's composer.json
    states the same."""

    gen_length: int = 8
    block_length: int | None = 8
    num_inference_steps: int = 8
    threshold: float = 0.9
    editing_threshold: float | None = 0.0


register_configs(LLaDA2Config, TinyDllmSamplingParam, hf_model_paths=["composer/tiny-dllm"], name="tiny-dllm")
register_configs(
    LLaDA2Config,
    LLaDA2SamplingParam,
    model_detectors=[lambda path, class_name: class_name == "LLaDA2Pipeline"],
    name="llada2",
)
