"""Wan VACE DiT (Wan2.1 VACE 1.3B / 14B, Wan2.2 VACE-Fun experts): the Wan DiT plus a control branch, loading diffusers'
`WanVACETransformer3DModel` weights.

    control latents [B, vace_in_channels, F, H, W] -> vace_patch_embedding (Conv3d) -> c [B, S, D]
    c = proj_in(c) + x                                    (the first control block only; x: the patchified latents)
    for each control block j (a Wan block with an output projection):
        c = WanBlock_j(c)            hint_j = proj_out_j(c)
    for each Wan block i:
        x = WanBlock_i(x)            x = x + scale_j * hint_j   after the j-th block of `vace_layers` (ascending)

The control blocks read the same timestep modulation, RoPE and text as the Wan blocks (their own cross-attention
k/v). `scale` is the request's `conditioning_scale`, one value per control block, per row or for every row. The
control branch runs through the Wan DiT's `block_residuals` seam, so sequence parallelism (the control tokens split
like the latents'), step caches and the hooks act on it without code here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from composer.errors import InvalidInputError, ModelFormatError, UnsupportedError
from composer.models.wan.config import WanTransformerConfig
from composer.models.wan.transformer import Rotary, WanTransformer3DModel, WanTransformerBlock


@dataclass
class WanVACETransformerConfig(WanTransformerConfig):
    """WanTransformerConfig plus diffusers' two VACE keys: `vace_layers`, the Wan blocks after which the control
    blocks' hints are added (one control block per entry, the released 14B's default below; 1.3B: every second of
    its 30 blocks), and `vace_in_channels`, the control latents' channels (inactive and reactive video latents,
    2 x 16, and the 8 x 8 pixels of each latent position's mask, 64)."""

    vace_layers: list[int] = field(default_factory=lambda: [0, 5, 10, 15, 20, 25, 30, 35])
    vace_in_channels: int = 96

    def check_supported(self) -> None:
        super().check_supported()
        layers = self.vace_layers
        if not layers or 0 not in layers:
            raise ModelFormatError(f"vace_layers = {layers}: must include block 0 (the first control block takes "
                                   "the latents through its input projection there)")
        if max(layers) >= self.num_layers or min(layers) < 0:
            raise ModelFormatError(f"vace_layers = {layers}: every entry must be a block index below num_layers = "
                                   f"{self.num_layers}")
        if len(set(layers)) != len(layers):
            raise ModelFormatError(f"vace_layers = {layers}: names a block twice (one control block per entry, each "
                                   "added after its own Wan block)")

    @property
    def hint_layers(self) -> list[int]:
        """The Wan block after which each control block's hint is added, control block j -> hint_layers[j]
        (ascending, as diffusers pairs them whatever the order of `vace_layers`)."""
        return sorted(self.vace_layers)


class WanVACEBlock(WanTransformerBlock):
    """A control block: a Wan block over the control tokens with an output projection giving its hint (and, for
    the first one, an input projection adding the latents' tokens)."""

    def __init__(self, config: WanVACETransformerConfig, input_projection: bool):
        super().__init__(config)
        dim = config.hidden_size
        self.proj_in = nn.Linear(dim, dim) if input_projection else None
        self.proj_out = nn.Linear(dim, dim)

    def forward(self, control: torch.Tensor, x: torch.Tensor, context: torch.Tensor | tuple[torch.Tensor, ...],
                timestep_proj: torch.Tensor, rotary: Rotary, token_grid: tuple[int, int, int] | None = None,
                image: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(hint, control) for control tokens [B, S, D]; x: the latents' tokens (read by the first block)."""
        if self.proj_in is not None:
            control = self.proj_in(control) + x
        control = super().forward(control, context, timestep_proj, rotary, None, None, token_grid, image)
        return self.proj_out(control), control


def _vace_plan(plan: dict[str, str]) -> dict[str, str]:
    """The Wan blocks' tensor-parallel plan, for the control blocks too (their projections in and out are whole)."""
    return {**plan, **{key.replace("^blocks", "^vace_blocks"): kind for key, kind in plan.items()
                       if key.startswith("^blocks")}}


class WanVACETransformer3DModel(WanTransformer3DModel):
    """Wan DiT with VACE's control blocks. Called as diffusers' model is: `control_hidden_states` [B,
    vace_in_channels, F, H, W] (the latents' grid) and `control_hidden_states_scale` [len(vace_layers)] or [B,
    len(vace_layers)] (default: ones)."""

    class_names = ("WanVACETransformer3DModel",)
    config_class = WanVACETransformerConfig
    # in run order: the control blocks (their hints) before the Wan blocks; offload streams, compile and cancel
    # points act on both
    repeated_blocks = ("vace_blocks", "blocks")
    keep_in_fp32 = (*WanTransformer3DModel.keep_in_fp32, r"^vace_blocks\.\d+\.norm2\.")
    tensor_parallel_plan = _vace_plan(WanTransformer3DModel.tensor_parallel_plan)

    def __init__(self, config: WanVACETransformerConfig):
        super().__init__(config)
        dim = config.hidden_size
        self.vace_patch_embedding = nn.Conv3d(config.vace_in_channels, dim, kernel_size=config.patch_size,
                                              stride=config.patch_size)
        self.vace_blocks = nn.ModuleList(
            [WanVACEBlock(config, input_projection=j == 0) for j in range(len(config.vace_layers))])

    def cross_attention_blocks(self) -> list[nn.Module]:
        return [*self.blocks, *self.vace_blocks]

    def variant_inputs(self, hidden_states: torch.Tensor, control_hidden_states: torch.Tensor | None = None,
                       control_hidden_states_scale: torch.Tensor | None = None, *, frame_offset: int,
                       attn_mask: torch.Tensor | None, kv_cache) -> tuple[torch.Tensor, dict]:
        """forward's own inputs: the control latents and their per-block scales (diffusers' names and order, after
        encoder_hidden_states_image). Not causal: no KV cache or attention mask."""
        if kv_cache is not None or attn_mask is not None:
            raise UnsupportedError("a VACE transformer runs whole videos: it takes no kv_cache or attn_mask")
        if control_hidden_states is None:
            raise InvalidInputError("a VACE transformer needs control_hidden_states (the control latents [B, "
                                    f"{self.config.vace_in_channels}, F, H, W])")
        expected = (hidden_states.shape[0], self.config.vace_in_channels, *hidden_states.shape[2:])
        if tuple(control_hidden_states.shape) != expected:
            raise InvalidInputError(f"control_hidden_states of shape {list(control_hidden_states.shape)}: expected "
                                    f"{list(expected)} (a row per video, vace_in_channels, the latents' frames and "
                                    "size)")
        scale = self._scales(control_hidden_states_scale, hidden_states.shape[0], control_hidden_states)
        return hidden_states, {"control": control_hidden_states, "control_scale": scale}

    def _scales(self, scale: torch.Tensor | None, rows: int, like: torch.Tensor) -> torch.Tensor:
        """[rows, control blocks]: the scale of each control block's hint, per row (ones by default)."""
        count = len(self.vace_blocks)
        if scale is None:
            return like.new_ones(rows, count)
        if scale.ndim == 1:
            scale = scale.expand(rows, -1)
        if tuple(scale.shape) != (rows, count):
            raise InvalidInputError(f"control_hidden_states_scale of shape {list(scale.shape)}: expected [{count}] or "
                                    f"[{rows}, {count}] (one scale per control block: len(vace_layers) = {count})")
        return scale

    def block_residuals(self, x, *, contexts, timestep_proj, rotary, token_grid, image, split, control=None,
                        control_scale=None):
        """Each control block's hint times its scale, keyed by the Wan block it follows."""
        c = self.vace_patch_embedding(control.to(self.vace_patch_embedding.weight.dtype))
        c = split(c.flatten(2).transpose(1, 2))  # this rank's control tokens, as x's
        first = len(self.blocks)  # the control blocks' cross-attention k/v follow the Wan blocks'
        residuals = {}
        for j, (layer, block) in enumerate(zip(self.config.hint_layers, self.vace_blocks)):
            hint, c = block(c, x, contexts[first + j], timestep_proj, rotary, token_grid, image)
            residuals[layer] = hint * control_scale[:, j].to(hint.dtype).view(-1, 1, 1)
        return residuals


EntryClass = WanVACETransformer3DModel
