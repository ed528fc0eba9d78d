"""HunyuanVideoTransformerConfig: read from a diffusers `config.json` (`HunyuanVideoTransformer3DModel`).

Every field means what diffusers' constructor makes it mean (diffusers 0.42): `mlp_ratio` sizes the dual- and
single-stream blocks' MLPs only (the token refiner's is fixed at 4.0); `num_attention_heads` x `attention_head_dim`
is also the refiner's attention; `qk_norm` picks the per-head q/k norm of the DiT's blocks (not the refiner's: it has
none); `out_channels` null (or 0) means `in_channels`. The values diffusers fixes whatever the config says (the
256-wide sinusoidal embeddings, every norm's eps 1e-6, the refiner's FFN ratio) are constants in blocks.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from composer.errors import ModelFormatError, UnsupportedError
from composer.models.config_reading import DiffusersTransformerConfig

# The `qk_norm` values diffusers builds a working HunyuanVideo DiT with: a per-head norm on q/k (and on the text's
# added q/k in the dual-stream blocks), or None for none.
QK_NORMS = (None, "rms_norm", "layer_norm", "fp32_layer_norm")


@dataclass
class HunyuanVideoTransformerConfig(DiffusersTransformerConfig):
    """HunyuanVideo DiT hyper-parameters, with diffusers' names and the released 13B model's values."""

    _TUPLE_FIELDS = ("rope_axes_dim",)

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
