"""SkyReels-V2's DiT (diffusers' `SkyReelsV2Transformer3DModel`): the Wan2.1 DiT with two differences, so composer
runs it as a Wan variant on the same blocks, names and runner:

- the timestep sinusoids are computed in float64 (diffusers' `get_1d_sincos_pos_embed_from_grid`) and cast to the
  time embedder's dtype, where Wan computes them in fp32;
- models with `inject_sample_info` (the released diffusion-forcing ones) embed the video's frame rate: an index
  (0 for 16 fps, 1 otherwise) -> `fps_embedding` -> `fps_projection` (Linear, SiLU, Linear to 6 x width), added
  to every timestep's six modulation vectors (not to the output norm's), in the activations' dtype.

What diffusers' forward does from its config, composer's takes as inputs: per-frame timesteps are a [B, F]
timestep (`enable_diffusion_forcing`), and the block-causal attention of `num_frame_per_block > 1` is an
`attn_mask` the pipeline builds (`composer.models.wan.causal.block_causal_mask`): a request may choose another block
size than the config's (diffusers' `causal_block_size` rewrites the config for that), and the mask is built once
per video, not once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from composer.errors import InvalidInputError
from composer.models.wan.config import WanTransformerConfig
from composer.models.wan.mapping import DIFFUSERS_TO_COMPOSER, ORIGINAL_TO_COMPOSER
from composer.models.wan.transformer import WanConditionEmbedder, WanTransformer3DModel

FPS_RULES_DIFFUSERS = [(r"^fps_projection\.net\.0\.proj\.", "fps_projection.fc_in."),
                       (r"^fps_projection\.net\.2\.", "fps_projection.fc_out.")]
FPS_RULES_ORIGINAL = [(r"^(model\.diffusion_model\.)?fps_projection\.0\.", "fps_projection.fc_in."),
                      (r"^(model\.diffusion_model\.)?fps_projection\.2\.", "fps_projection.fc_out.")]


@dataclass
class SkyReelsV2TransformerConfig(WanTransformerConfig):
    """Wan's fields (diffusers' `SkyReelsV2Transformer3DModel` defaults where they differ) and two of its own."""

    num_attention_heads: int = 16
    ffn_dim: int = 8192
    num_layers: int = 32
    inject_sample_info: bool = False  # the fps embedding (the released DF models have it)
    num_frame_per_block: int = 1  # the default causal block of a diffusion-forcing request (> 1: block-causal)


def sincos_frequencies_f64(timesteps: torch.Tensor, dim: int) -> torch.Tensor:
    """[N] -> [N, dim] float64 [cos | sin] at frequencies 10000^(-i / (dim / 2)): diffusers'
    `get_1d_sincos_pos_embed_from_grid(..., flip_sin_to_cos=True)`, term for term (MPS has no float64: fp32)."""
    dtype = torch.float32 if timesteps.device.type == "mps" else torch.float64
    omega = torch.arange(dim // 2, dtype=dtype, device=timesteps.device) / (dim / 2.0)
    omega = 1.0 / 10000**omega
    args = torch.outer(timesteps.to(dtype), omega)
    return torch.cat([torch.cos(args), torch.sin(args)], dim=1)


class SkyReelsV2ConditionEmbedder(WanConditionEmbedder):
    """Wan's condition embedder with float64 timestep sinusoids."""

    def timestep_frequencies(self, timestep: torch.Tensor) -> torch.Tensor:
        return sincos_frequencies_f64(timestep, self.freq_dim)


class FpsProjection(nn.Module):
    """Linear -> SiLU -> Linear (diffusers' FeedForward with `linear-silu`): the fps embedding -> 6 x width."""

    def __init__(self, dim: int):
        super().__init__()
        self.fc_in = nn.Linear(dim, dim)
        self.fc_out = nn.Linear(dim, 6 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.silu(self.fc_in(x)))


def fps_index(fps: float) -> int:
    """The released models' two frame-rate classes: 0 for 16 fps, 1 for any other (diffusers' rule)."""
    return 0 if fps == 16 else 1


class SkyReelsV2Transformer3DModel(WanTransformer3DModel):
    """SkyReels-V2 DiT (text-to-video and diffusion forcing). Loads diffusers `SkyReelsV2Transformer3DModel`
    checkpoints."""

    class_names = ("SkyReelsV2Transformer3DModel",)
    config_class = SkyReelsV2TransformerConfig
    param_name_mappings = {"diffusers": DIFFUSERS_TO_COMPOSER + FPS_RULES_DIFFUSERS,
                           "original": ORIGINAL_TO_COMPOSER + FPS_RULES_ORIGINAL}

    def __init__(self, config: SkyReelsV2TransformerConfig):
        super().__init__(config)
        self.condition_embedder = SkyReelsV2ConditionEmbedder(config)
        if config.inject_sample_info:
            self.fps_embedding = nn.Embedding(2, config.hidden_size)
            self.fps_projection = FpsProjection(config.hidden_size)

    def sample_info_bias(self, fps: torch.Tensor | None, rows: int) -> torch.Tensor | None:
        """The fps embedding's modulation bias [B, 6, D] (None for a model without one). `fps`: [B] indices."""
        if not self.config.inject_sample_info:
            return None
        if fps is None:
            raise InvalidInputError("this SkyReels-V2 transformer embeds the video's frame rate: pass fps, one index "
                                    "per row (0 for 16 fps, 1 otherwise)")
        fps = torch.as_tensor(fps, dtype=torch.long, device=self.device).reshape(-1)
        if fps.shape[0] != rows:
            raise InvalidInputError(f"fps has {fps.shape[0]} entries for {rows} rows: give one per row")
        return self.fps_projection(self.fps_embedding(fps)).unflatten(1, (6, -1))

    def variant_inputs(self, hidden_states: torch.Tensor, *, fps: torch.Tensor | None = None, frame_offset: int,
                       attn_mask: torch.Tensor | None, kv_cache) -> tuple[torch.Tensor, dict]:
        """forward's own input, by keyword: `fps` [B], each row's frame-rate index, for a model with
        `inject_sample_info` (its modulation bias). A diffusion-forcing call gives a [B, F] timestep and, for causal
        blocks, the block-causal `attn_mask`, as Wan's forward takes them."""
        return hidden_states, {"modulation_bias": self.sample_info_bias(fps, hidden_states.shape[0])}


EntryClass = SkyReelsV2Transformer3DModel
