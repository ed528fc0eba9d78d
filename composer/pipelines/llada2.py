"""LLaDA2 text generation: diffusers' LLaDA2Pipeline folders (model, tokenizer, BlockRefinementScheduler) as
composer's text pipeline (composer/text/pipeline.py): tokenize -> block refinement -> detokenize."""

from __future__ import annotations

from composer.configs.llada2 import LLaDA2Config
from composer.text.pipeline import TextPipeline


class LLaDA2TextPipeline(TextPipeline):
    """The folder's `model` is the transformers class model_index.json names (any causal-LM-shaped module taking
    `attention_mask` / `position_ids` and returning `.logits`, as diffusers drives it)."""

    class_names = ("LLaDA2Pipeline",)
    config_class = LLaDA2Config


EntryClass = LLaDA2TextPipeline
