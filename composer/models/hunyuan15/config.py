"""HunyuanVideo15TransformerConfig: read from a diffusers `config.json` (`HunyuanVideo15Transformer3DModel`).

Every field means what diffusers' constructor makes it mean (diffusers 0.42): `in_channels` is the latents, the
condition latents and their mask on the channel axis (2 x 32 + 1 in the released model); `text_embed_dim` is the
Qwen2.5-VL width (the token refiner's input), `text_embed_2_dim` the ByT5 width (its projection's input; the
projection's hidden width, 2048, is diffusers' constant), `image_embed_dim` the SigLIP width (the image projection's
input); `use_meanflow` adds a second timestep embedder (`timestep_r`); `out_channels` null (or 0) means
`in_channels`. `target_size` (the pixel budget of the default size) and `task_type` are the pipeline's to read.
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
# The `qk_norm` values diffusers builds a working HunyuanVideo-1.5 DiT with: a per-head norm on q/k and on the text's
# added q/k (its attention processor calls the norms whatever they are, so None is no working model).
QK_NORMS = ("rms_norm", "layer_norm", "fp32_layer_norm")


@dataclass
class HunyuanVideo15TransformerConfig:
    """HunyuanVideo-1.5 DiT hyper-parameters, with diffusers' names and the released 8.3B model's values."""

    in_channels: int = 65
    out_channels: int = 32
    num_attention_heads: int = 16
    attention_head_dim: int = 128
    num_layers: int = 54  # dual-stream blocks (there are no single-stream blocks)
    num_refiner_layers: int = 2
    mlp_ratio: float = 4.0
    patch_size: int = 1
    patch_size_t: int = 1
    qk_norm: str = "rms_norm"  # one of QK_NORMS
    text_embed_dim: int = 3584
    text_embed_2_dim: int = 1472
    image_embed_dim: int = 1152
    rope_theta: float = 256.0
    rope_axes_dim: tuple[int, int, int] = (16, 56, 56)
    target_size: int = 640
    task_type: str = "i2v"
    use_meanflow: bool = False

    @property
    def hidden_size(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "the transformer config") -> HunyuanVideo15TransformerConfig:
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
        if self.qk_norm not in QK_NORMS:
            raise UnsupportedError(
                f"qk_norm = {self.qk_norm!r}: composer's HunyuanVideo-1.5 DiT implements "
                f"{', '.join(map(repr, QK_NORMS))} (diffusers builds no working HunyuanVideo-1.5 DiT with another: "
                "its text q/k norm refuses it, or its norm does not fit per-head states)"
            )
        if sum(self.rope_axes_dim) != self.attention_head_dim or any(d % 2 for d in self.rope_axes_dim):
            raise ModelFormatError(
                f"rope_axes_dim {list(self.rope_axes_dim)} must be even sizes adding up to attention_head_dim "
                f"({self.attention_head_dim})"
            )
