"""HunyuanVideo15TransformerConfig: read from a diffusers `config.json` (`HunyuanVideo15Transformer3DModel`).

Every field means what diffusers' constructor makes it mean (diffusers 0.42): `in_channels` is the latents, the
condition latents and their mask on the channel axis (2 x 32 + 1 in the released model); `text_embed_dim` is the
Qwen2.5-VL width (the token refiner's input), `text_embed_2_dim` the ByT5 width (its projection's input; the
projection's hidden width, 2048, is diffusers' constant), `image_embed_dim` the SigLIP width (the image projection's
input); `use_meanflow` adds a second timestep embedder (`timestep_r`); `out_channels` null (or 0) means
`in_channels`. `target_size` (the pixel budget of the default size) and `task_type` are the pipeline's to read.
"""

from __future__ import annotations

from dataclasses import dataclass

from composer.errors import ModelFormatError, UnsupportedError
from composer.models.config_reading import DiffusersTransformerConfig

# The `qk_norm` values diffusers builds a working HunyuanVideo-1.5 DiT with: a per-head norm on q/k and on the text's
# added q/k (its attention processor calls the norms whatever they are, so None is no working model).
QK_NORMS = ("rms_norm", "layer_norm", "fp32_layer_norm")


@dataclass
class HunyuanVideo15TransformerConfig(DiffusersTransformerConfig):
    """HunyuanVideo-1.5 DiT hyper-parameters, with diffusers' names and the released 8.3B model's values."""

    _TUPLE_FIELDS = ("rope_axes_dim",)

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
