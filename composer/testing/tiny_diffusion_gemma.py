"""A tiny DiffusionGemmaPipeline folder in exact diffusers layout, built locally: transformers'
DiffusionGemmaForBlockDiffusion at toy sizes (two layers, two experts, a one-layer vision tower it never uses), the
word-level tokenizer of tiny_llada2 (with its chat template) as the processor, and a scheduler config (diffusers'
BlockRefinementScheduler, DiscreteDDIMScheduler or EntropyBoundScheduler)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from composer.testing.tiny_llada2 import CHAT, SPECIAL, WORDS, build_tokenizer


@dataclass
class TinyDiffusionGemmaSpec:
    canvas_length: int = 8
    scheduler: str = "BlockRefinementScheduler"
    scheduler_config: dict | None = None
    seed: int = 0
    head_scale: float = 20.0  # sharper than the initial weights: confident predictions, adaptive stops


def build_tiny_diffusion_gemma(folder: str | Path, spec: TinyDiffusionGemmaSpec | None = None) -> Path:
    import diffusers
    from transformers import (
        DiffusionGemmaConfig,
        DiffusionGemmaForBlockDiffusion,
        DiffusionGemmaTextConfig,
        Gemma4VisionConfig,
    )
    from transformers.utils import logging as hf_logging

    spec = spec or TinyDiffusionGemmaSpec()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer(folder / "processor")
    vocab = len(SPECIAL) + len(CHAT) + len(WORDS)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the toy config's last layer is forced to full attention: said every time
    try:
        text = DiffusionGemmaTextConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, global_head_dim=8, sliding_window=16, max_position_embeddings=512,
            pad_token_id=0, eos_token_id=1, bos_token_id=3, num_experts=2, top_k_experts=1, moe_intermediate_size=32)
        vision = Gemma4VisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=2, head_dim=8)
        config = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=spec.canvas_length)
        torch.manual_seed(spec.seed)
        model = DiffusionGemmaForBlockDiffusion(config).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(spec.head_scale) if not config.tie_word_embeddings else None
            model.model.decoder.get_input_embeddings().weight.mul_(1.0)
        model.save_pretrained(folder / "model", safe_serialization=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    scheduler_cls = getattr(diffusers, spec.scheduler)
    scheduler_cls(**(spec.scheduler_config or {})).save_pretrained(folder / "scheduler")
    index = {"_class_name": "DiffusionGemmaPipeline", "_diffusers_version": "0.42.1",
             "model": ["transformers", "DiffusionGemmaForBlockDiffusion"],
             "processor": ["transformers", "PreTrainedTokenizerFast"], "scheduler": ["diffusers", spec.scheduler]}
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))
    return folder
