"""HunyuanVideoTransformerConfig: read from a diffusers `config.json` (`HunyuanVideoTransformer3DModel`).

Every field means what diffusers' constructor makes it mean (diffusers 0.42): `mlp_ratio` sizes the dual- and
single-stream blocks' MLPs only (the token refiner's is fixed at 4.0); `num_attention_heads` x `attention_head_dim`
is also the refiner's attention; `qk_norm` picks the per-head q/k norm of the DiT's blocks (not the refiner's: it has
none); `out_channels` null (or 0) means `in_channels`. The values diffusers fixes whatever the config says (the
256-wide sinusoidal embeddings, every norm's eps 1e-6, the refiner's FFN ratio) are constants in blocks.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from composer._fields import field_types, json_field_problems
from composer.errors import ModelFormatError, UnsupportedError
from composer.logging import get_logger

logger = get_logger(__name__)

_IGNORED_KEYS = {"_class_name", "_diffusers_version", "_name_or_path"}
# The `qk_norm` values diffusers builds a working HunyuanVideo DiT with: a per-head norm on q/k (and on the text's
# added q/k in the dual-stream blocks), or None for none.
QK_NORMS = (None, "rms_norm", "layer_norm", "fp32_layer_norm")


@dataclass
class HunyuanVideoTransformerConfig:
    """HunyuanVideo DiT hyper-parameters, with diffusers' names and the released 13B model's values."""

    in_channels: int = 16
    out_channels: int = 16
    num_attention_heads: int = 24
    attention_head_dim: int = 128
    num_layers: int = 20  # dual-stream blocks
    num_single_layers: int = 40  # single-stream blocks
    num_refiner_layers: int = 2  # text token refiner blocks
    mlp_ratio: float = 4.0
    patch_size: int = 2
    patch_size_t: int = 1
    qk_norm: str | None = "rms_norm"  # one of QK_NORMS
    guidance_embeds: bool = True
    text_embed_dim: int = 4096
    pooled_projection_dim: int = 768
    rope_theta: float = 256.0
    rope_axes_dim: tuple[int, int, int] = (16, 56, 56)
    image_condition_type: str | None = None

    @property
    def hidden_size(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def mlp_dim(self) -> int:
        """The dual- and single-stream blocks' MLP width (the token refiner's is 4 x hidden_size whatever this is)."""
        return int(self.hidden_size * self.mlp_ratio)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "the transformer config") -> HunyuanVideoTransformerConfig:
        """From diffusers' config.json; a value of the wrong JSON type is a ModelFormatError naming `source`, the
        field, what it expects and the value."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known - _IGNORED_KEYS)
        if unknown:
            logger.debug("ignoring transformer config keys %s", unknown)
        values = {k: v for k, v in raw.items() if k in known}
        if "out_channels" in values and not values["out_channels"]:  # diffusers' `out_channels or in_channels`
            values["out_channels"] = values.get("in_channels", cls.in_channels)
        problems = json_field_problems(values, field_types(cls))
        if problems:
            raise ModelFormatError(f"{source}: {'; '.join(problems)}")
        if "rope_axes_dim" in values:
            values["rope_axes_dim"] = tuple(values["rope_axes_dim"])
        config = cls(**values)
        config.check_supported()
        return config

    def check_supported(self) -> None:
        if self.image_condition_type is not None:
            raise UnsupportedError(
                f"this HunyuanVideo transformer takes image conditioning (image_condition_type = "
                f"{self.image_condition_type!r}: an image-to-video checkpoint); composer serves HunyuanVideo "
                "text-to-video so far"
            )
        if self.qk_norm not in QK_NORMS:
            raise UnsupportedError(
                f"qk_norm = {self.qk_norm!r}: composer's HunyuanVideo DiT implements "
                f"{', '.join(map(repr, QK_NORMS))} (diffusers builds no working HunyuanVideo DiT with another: "
                "its dual-stream blocks' text q/k norm refuses it, or its norm does not fit per-head states)"
            )
        if sum(self.rope_axes_dim) != self.attention_head_dim or any(d % 2 for d in self.rope_axes_dim):
            raise ModelFormatError(
                f"rope_axes_dim {list(self.rope_axes_dim)} must be even sizes adding up to attention_head_dim "
                f"({self.attention_head_dim})"
            )
