"""A tiny LLaDA2Pipeline folder in exact diffusers layout, built locally: a word-level tokenizer with a mask token,
an EOS and a chat template; a small transformers causal LM as `model`; a BlockRefinementScheduler config."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

SPECIAL = ["<pad>", "<eos>", "<mask>", "<unk>"]
CHAT = ["<|user|>", "<|assistant|>", "<|end|>"]
WORDS = ("the a cat dog red blue green sky sea is was and or not to of in on big small one two three four five six "
         "seven eight nine zero plus minus equals sum reverse sort list answer question what why how yes no . , ? !"
         ).split()
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@dataclass
class TinyLLaDA2Spec:
    hidden_size: int = 32
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    block_length: int = 8
    eos_scale: float = 0.0  # > 0: the EOS row of the output head scaled up, so rows commit EOS (early stop)
    seed: int = 0
    # "llama": transformers' LlamaForCausalLM (what diffusers drives); "llada": composer's LLaDAModelLM in LLaDA's
    # own config keys and weight names (bidirectional attention; what the vicinity KV refresh needs); "remote": the
    # llama weights under a class the folder defines in its own Python files (config.json auto_map), as the
    # released LLaDA2 folders ship theirs
    model: str = "llama"
    # more BlockRefinementScheduler config (threshold, editing_threshold, ...): what diffusers' scheduler falls back
    # to where a call passes None
    scheduler_config: dict | None = None


def build_tokenizer(folder: Path) -> None:
    """The word-level tokenizer (special tokens and chat markers matched whole) saved as PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + CHAT + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                        mask_token="<mask>", unk_token="<unk>", additional_special_tokens=CHAT)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)


def build_tiny_llada2(folder: str | Path, spec: TinyLLaDA2Spec | None = None) -> Path:
    """Write the folder (model_index.json, model/, tokenizer/, scheduler/) and return it."""
    from diffusers import BlockRefinementScheduler
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = spec or TinyLLaDA2Spec()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer(folder / "tokenizer")
    vocab_size = len(SPECIAL) + len(CHAT) + len(WORDS)
    if spec.model == "llada":
        _write_llada(folder / "model", vocab_size, spec)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=spec.hidden_size, intermediate_size=2 * spec.hidden_size,
                         num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                         num_key_value_heads=spec.kv_heads, max_position_embeddings=512, tie_word_embeddings=False,
                         pad_token_id=0, eos_token_id=1)
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # sharper than the initial weights: confident commits and edits happen
        model.lm_head.weight.mul_(40.0)
        if spec.eos_scale > 0:
            model.lm_head.weight[1].mul_(spec.eos_scale)
    if spec.model in ("llama", "remote"):
        model.save_pretrained(folder / "model", safe_serialization=True)
    if spec.model == "remote":
        _make_remote(folder / "model")
    BlockRefinementScheduler(block_length=spec.block_length, **(spec.scheduler_config or {})).save_pretrained(
        folder / "scheduler")
    index = {"_class_name": "LLaDA2Pipeline", "_diffusers_version": "0.42.1",
             "model": ["transformers", {"llama": "LlamaForCausalLM", "llada": "LLaDAModelLM",
                                        "remote": "TinyRemoteLM"}[spec.model]], "scheduler": ["diffusers", "BlockRefinementScheduler"],
             "tokenizer": ["transformers", "PreTrainedTokenizerFast"]}
    (folder / "model_index.json").write_text(json.dumps(index, indent=2))
    return folder


def _write_llada(folder: Path, vocab_size: int, spec: TinyLLaDA2Spec) -> None:
    """composer's LLaDA model, random, saved as LLaDA's release is: config.json in its keys, model.transformer.*."""
    from safetensors.torch import save_file

    from composer.models.llada.config import LLaDAConfig
    from composer.models.llada.model import LLaDAModelLM

    config = LLaDAConfig(d_model=spec.hidden_size, n_heads=spec.heads, n_kv_heads=spec.kv_heads, n_layers=spec.layers,
                         mlp_hidden_size=2 * spec.hidden_size, vocab_size=vocab_size, rope_theta=10000.0,
                         max_sequence_length=512, mask_token_id=2, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(spec.seed)
    model = LLaDAModelLM(config)
    with torch.no_grad():
        head = model.model.transformer["ff_out"].weight
        head.mul_(40.0)
        if spec.eos_scale > 0:
            head[1].mul_(spec.eos_scale)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps({"architectures": ["LLaDAModelLM"], "model_type": "llada",
                                                    **config.to_dict()}, indent=2))


REMOTE_CONFIG = """from transformers import LlamaConfig


class TinyRemoteConfig(LlamaConfig):
    model_type = "tiny_remote"
"""
REMOTE_MODEL = """from transformers import LlamaForCausalLM

from .configuration_tiny import TinyRemoteConfig


class TinyRemoteLM(LlamaForCausalLM):
    config_class = TinyRemoteConfig
"""


def _make_remote(folder: Path) -> None:
    """The saved llama model as a class of the folder's own code (config.json auto_map)."""
    (folder / "configuration_tiny.py").write_text(REMOTE_CONFIG)
    (folder / "modeling_tiny.py").write_text(REMOTE_MODEL)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="tiny_remote", architectures=["TinyRemoteLM"],
                  auto_map={"AutoConfig": "configuration_tiny.TinyRemoteConfig",
                            "AutoModelForCausalLM": "modeling_tiny.TinyRemoteLM"})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
