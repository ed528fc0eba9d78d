"""WanTransformerConfig: read from a diffusers `config.json` or the original Wan release's `config.json`.

Every field means what diffusers' `WanTransformer3DModel.__init__` makes it mean (diffusers 0.42): `qk_norm` is
read but, as in diffusers, q/k are always RMS-normed across heads whatever it says; `out_channels` null (or 0)
means `in_channels`; `rope_max_seq_len` bounds the RoPE positions (diffusers' precomputed table: a longer grid is
refused); `added_kv_proj_dim` is the image tokens' width in the cross-attention (the model width, as the image
embedder outputs it). What diffusers fixes whatever the config says: RoPE's theta (10000: a `rope_theta` key is
ignored, as diffusers ignores it), the axis split of a head's channels (`rope_axis_dims`), the image embedder's
LayerNorm eps (1e-5) and exact-GELU MLP of width `image_dim`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from composer._fields import json_field_problems
from composer.errors import ModelFormatError, UnsupportedError
from composer.models.config_reading import DIFFUSERS_METADATA_KEYS, DiffusersTransformerConfig

# Original Wan release config keys -> diffusers keys (dim and num_heads give the head dim).
_ORIGINAL_KEYS = {
    "in_dim": "in_channels",
    "out_dim": "out_channels",
    "num_heads": "num_attention_heads",
    "text_dim": "text_dim",
    "freq_dim": "freq_dim",
    "ffn_dim": "ffn_dim",
    "num_layers": "num_layers",
    "eps": "eps",
    "cross_attn_norm": "cross_attn_norm",
}
# Wan2.1 I2V / FLF2V encode images with open-clip ViT-H/14: 1280 wide, 257 tokens (256 patches + class token).
ORIGINAL_CLIP_DIM = 1280
ORIGINAL_CLIP_TOKENS = 257


@dataclass
class WanTransformerConfig(DiffusersTransformerConfig):
    """Wan DiT hyper-parameters, with diffusers' names and the released 14B defaults."""

    _IGNORED_KEYS = DIFFUSERS_METADATA_KEYS | {"text_len", "window_size", "model_type"}
    _TUPLE_FIELDS = ("patch_size",)

    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: int = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    qk_norm: str | None = "rms_norm_across_heads"  # informational: q/k are always RMS-normed (as in diffusers)
    eps: float = 1e-6
    image_dim: int | None = None
    added_kv_proj_dim: int | None = None
    rope_max_seq_len: int = 1024  # RoPE positions (frames, rows, columns of tokens) are < this
    pos_embed_seq_len: int | None = None

    @property
    def hidden_size(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "the transformer config") -> WanTransformerConfig:
        """Accept diffusers' config.json or the original release's (`dim`, `num_heads`, `in_dim`, ...). A value of
        the wrong JSON type is a ModelFormatError naming `source`, the field, what it expects and the value."""
        raw = dict(raw)
        if "dim" in raw and "num_attention_heads" not in raw:  # original Wan naming
            problems = json_field_problems(raw, {"dim": int, "num_heads": int})
            if problems:
                raise ModelFormatError(f"{source}: {'; '.join(problems)}")
            dim, heads = raw.pop("dim"), raw.get("num_heads")
            if not heads or dim % heads:
                raise ModelFormatError(f"original Wan config: dim {dim} is not divisible by num_heads {heads}")
            raw["attention_head_dim"] = dim // heads
            if isinstance(raw.get("qk_norm"), bool):
                raw["qk_norm"] = "rms_norm_across_heads" if raw["qk_norm"] else None
            raw = {_ORIGINAL_KEYS.get(k, k): v for k, v in raw.items()}
            if raw.get("model_type") in ("i2v", "flf2v"):  # the original release states the task, not the sizes
                raw.setdefault("image_dim", ORIGINAL_CLIP_DIM)
                raw.setdefault("added_kv_proj_dim", dim)
                if raw["model_type"] == "flf2v":
                    raw.setdefault("pos_embed_seq_len", 2 * ORIGINAL_CLIP_TOKENS)
        return super().from_dict(raw, source)

    @property
    def takes_image(self) -> bool:
        """Whether the model has image cross-attention (Wan2.1 I2V / FLF2V: CLIP image tokens beside the text)."""
        return self.image_dim is not None

    def check_supported(self) -> None:
        if (self.image_dim is None) != (self.added_kv_proj_dim is None):
            raise UnsupportedError(
                f"this Wan transformer sets image_dim = {self.image_dim} but added_kv_proj_dim = "
                f"{self.added_kv_proj_dim}; composer runs image cross-attention (Wan2.1 I2V / FLF2V) with both set"
            )
        if self.added_kv_proj_dim is not None and self.added_kv_proj_dim != self.hidden_size:
            raise ModelFormatError(
                f"added_kv_proj_dim = {self.added_kv_proj_dim} must equal the model width "
                f"{self.hidden_size} (the image embedder projects image_dim to it)"
            )
        if self.attention_head_dim % 2:
            raise ModelFormatError(f"attention_head_dim must be even for rotary embedding, got {self.attention_head_dim}")
