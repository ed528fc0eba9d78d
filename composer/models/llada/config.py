"""LLaDAConfig: the hyper-parameters of LLaDA's config.json (GSAI-ML/LLaDA-8B-*, OLMo-style names)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from composer._fields import field_types, json_field_problems
from composer.errors import ModelFormatError, UnsupportedError
from composer.logging import get_logger

logger = get_logger(__name__)


@dataclass
class LLaDAConfig:
    """LLaDA's dense architecture: a Llama-style transformer (RMSNorm, SwiGLU, RoPE) with bidirectional attention.
    Names and defaults as LLaDA-8B's config.json."""

    d_model: int = 4096
    n_heads: int = 32
    n_kv_heads: int | None = None  # None: n_heads
    n_layers: int = 32
    mlp_hidden_size: int = 12288
    vocab_size: int = 126464
    embedding_size: int | None = None  # the embedding / output rows (>= vocab_size); None: vocab_size
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    max_sequence_length: int = 4096
    weight_tying: bool = False
    include_bias: bool = False
    include_qkv_bias: bool = False
    mask_token_id: int = 126336
    eos_token_id: int = 126081
    pad_token_id: int = 126081
    block_type: str = "llama"
    activation_type: str = "silu"
    layer_norm_type: str = "rms"
    rope: bool = True

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def num_attention_heads(self) -> int:
        """What tensor parallel must split into whole heads (composer/parallel/tensor.py): q's and k/v's alike."""
        return math.gcd(self.n_heads, self.kv_heads)

    @property
    def ffn_dim(self) -> int:
        return self.mlp_hidden_size

    @property
    def rows(self) -> int:
        return self.embedding_size or self.vocab_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "the model config") -> LLaDAConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in raw.items() if k in known}
        ignored = sorted(set(raw) - known)
        if ignored:
            logger.debug("ignoring LLaDA config keys %s", ignored)
        problems = json_field_problems(values, field_types(cls))
        if problems:
            raise ModelFormatError(f"{source}: {'; '.join(problems)}")
        config = cls(**values)
        if config.d_model % config.n_heads or config.n_heads % config.kv_heads:
            raise ModelFormatError(f"{source}: d_model {config.d_model}, n_heads {config.n_heads} and n_kv_heads "
                                   f"{config.kv_heads} do not divide")
        unsupported = [f"{k} = {getattr(config, k)!r}" for k, ok in (
            ("block_type", config.block_type in ("llama", "sequential")), ("activation_type", config.activation_type
             in ("silu", "swiglu")), ("layer_norm_type", config.layer_norm_type in ("rms", "default_rms")),
            ("rope", config.rope)) if not ok]
        if unsupported:
            raise UnsupportedError(f"{source}: composer's LLaDA model runs the llama block with SiLU gating, RMS norms "
                                   f"and RoPE; this config has {', '.join(unsupported)}")
        return config

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
