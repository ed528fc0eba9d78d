"""HunyuanVideo diffusion transformer (DiT), composer's own implementation, loading diffusers' weights.

    x: [B, C, F, H, W] latents -> patchify (Conv3d) -> video tokens [B, S, D]
    text: Llama states [B, L, 4096] -> token refiner (self-attention conditioned on t and the mean text) -> [B, L, D]
    temb = MLP(t) + MLP(guidance x 1000) + MLP(CLIP pooled text)
    dual-stream blocks (separate video / text weights):
        q, k, v per stream (RMSNorm on q, k; RoPE on the video's), one attention over [video; text]
        each stream: x += gate * out;  x += gate * FFN(LN(x) * (1 + scale) + shift)
    single-stream blocks over [video; text]: x += gate * Linear([Attn(h), GELU(Linear(h))]), h = modulated LN(x)
    -> LN * (1 + scale) + shift (from temb) -> Linear -> unpatchify -> [B, C, F, H, W] (the flow prediction)

Text padding. The text's padding is masked as keys in every attention (a [B, 1, 1, S + L] boolean mask: the
video tokens and each row's first `text_mask.sum()` text tokens, as in the reference). A flash backend takes
no mask, so such a call falls back to SDPA (said once in the log by `run_attention`). The pipeline avoids the
mask where it can: its text stage drops the padding every row shares on the host, so a one-prompt request (and
CFG whose two prompts have the same length) carries no mask at all and runs on any backend. Rows of unequal
text length still need the mask; packing them for flash-attn's varlen kernel (cu_seqlens = S + L_b per row)
would lift that fallback and is not implemented.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from composer.models.hunyuan.blocks import FREQ_DIM as _FREQ_DIM
from composer.models.hunyuan.blocks import (
    AdaNorm,
    DualStreamBlock,
    MLPEmbedder,
    Rotary,
    SingleStreamBlock,
    TokenRefiner,
    embed_scalar,
)
from composer.models.hunyuan.config import HunyuanVideoTransformerConfig
from composer.models.hunyuan.grid import HunyuanTokenGrid
from composer.models.hunyuan.mapping import DIFFUSERS_TO_COMPOSER
from composer.models.runner import RunsBlocks, TokenPlan

# The released model embeds the guidance scale as a timestep: guidance x 1000 (the reference pipeline's factor).
GUIDANCE_EMBED_FACTOR = 1000.0


class HunyuanVideoTransformer3DModel(HunyuanTokenGrid, RunsBlocks, nn.Module):
    """HunyuanVideo T2V DiT. Loads diffusers `HunyuanVideoTransformer3DModel` checkpoints."""

    class_names = ("HunyuanVideoTransformer3DModel",)
    config_class = HunyuanVideoTransformerConfig
    param_name_mappings = {"diffusers": DIFFUSERS_TO_COMPOSER}
    ignored_checkpoint_keys = ()
    keep_in_fp32 = ()  # the reference keeps no module in fp32
    # The repeated blocks, in run order (20 dual-stream then 40 single-stream in the 13B model): what regional
    # compile, layerwise / disk offload, quantization and the cancel points act on.
    repeated_blocks = ("transformer_blocks", "single_transformer_blocks")
    # The declarative split/gather plan (composer/models/runner.py): under sequence parallelism (Ulysses) each rank
    # keeps its part of every frame's video tokens and the whole text (joint attention gathers heads across ranks),
    # and proj_out's output is gathered back. A step cache runs or skips blocks of the whole block sequence
    # (dual-stream then single-stream) over the joint tokens [video; text].
    token_plan = TokenPlan(gather_at="proj_out", whole=("text",))
    # No `tensor_parallel_plan` (see docs/adding-a-model-family.md): a single-stream block's proj_out reads
    # [attention | MLP], which a plain row split cannot shard; tensor parallelism refuses this model.

    def __init__(self, config: HunyuanVideoTransformerConfig):
        super().__init__()
        config.check_supported()
        self.config = config
        dim, head_dim = config.hidden_size, config.attention_head_dim
        patch = (config.patch_size_t, config.patch_size, config.patch_size)
        self.x_embedder = nn.Module()
        self.x_embedder.proj = nn.Conv3d(config.in_channels, dim, kernel_size=patch, stride=patch)
        # the refiner's FFN ratio is diffusers' fixed 4.0, not config.mlp_ratio (see blocks.REFINER_MLP_RATIO)
        self.context_embedder = TokenRefiner(config.text_embed_dim, dim, head_dim, config.num_refiner_layers)
        self.time_text_embed = nn.Module()
        self.time_text_embed.timestep_embedder = MLPEmbedder(_FREQ_DIM, dim)
        self.time_text_embed.text_embedder = MLPEmbedder(config.pooled_projection_dim, dim)
        if config.guidance_embeds:
            self.time_text_embed.guidance_embedder = MLPEmbedder(_FREQ_DIM, dim)
        block_args = (dim, head_dim, config.mlp_ratio, config.qk_norm)
        self.transformer_blocks = nn.ModuleList([DualStreamBlock(*block_args) for _ in range(config.num_layers)])
        self.single_transformer_blocks = nn.ModuleList(
            [SingleStreamBlock(*block_args) for _ in range(config.num_single_layers)]
        )
        self.norm_out = AdaNorm(dim, 2)
        self.proj_out = nn.Linear(dim, config.out_channels * config.patch_size_t * config.patch_size**2)
        self._rope_cache: OrderedDict[tuple, Rotary] = OrderedDict()

    def conditioning(self, timestep: torch.Tensor, pooled: torch.Tensor, guidance: torch.Tensor | None
                     ) -> torch.Tensor:
        """temb [B, D]: timestep + embedded guidance + pooled CLIP text, in the pooled vector's dtype."""
        embed = self.time_text_embed
        temb = embed_scalar(embed.timestep_embedder, timestep, pooled.dtype)
        if self.config.guidance_embeds:
            if guidance is None:
                raise ValueError("this HunyuanVideo transformer embeds the guidance scale: pass `guidance` [B]")
            # The scale is rounded to the model dtype before the x1000, as the reference pipeline builds it.
            scaled = guidance.to(device=temb.device, dtype=self.dtype) * GUIDANCE_EMBED_FACTOR
            temb = temb + embed_scalar(embed.guidance_embedder, scaled, pooled.dtype)
        return temb + embed.text_embedder(pooled)

    def timestep_signal(self, timestep: torch.Tensor) -> torch.Tensor:
        """The timestep's embedding [B, D]: what TeaCache plans its skips from (the rest of temb, guidance and
        pooled text, is the same at every step of a video)."""
        return embed_scalar(self.time_text_embed.timestep_embedder, timestep, self.dtype)

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor | None = None,
        pooled_projections: torch.Tensor | None = None,
        guidance: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states [B, C, F, H, W], timestep [B], the Llama text states [B, L, text_dim] with their mask
        [B, L] (1: a token, 0: right padding; None: no padding), the CLIP pooled vector [B, pooled_dim] and the
        guidance scale [B] (e.g. 6.0; embedded as scale x 1000) -> the prediction [B, C, F, H, W]."""
        if pooled_projections is None:
            raise ValueError("HunyuanVideo needs the pooled CLIP text vector (pooled_projections)")
        temb = self.conditioning(timestep, pooled_projections, guidance)
        x = self.x_embedder.proj(hidden_states)
        grid = tuple(x.shape[2:])
        x = x.flatten(2).transpose(1, 2)
        rotary = self.rotary(grid, x.device)
        text = self.context_embedder(encoder_hidden_states, timestep, encoder_attention_mask)
        key_mask = self.joint_key_mask(x.shape[1], encoder_attention_mask)  # over the whole video, then the text
        # this rank's part of every frame (the text stays whole), once for all blocks
        x, rotary = self.runner.enter(x, rotary, frames=grid[0])

        blocks = [*self.transformer_blocks, *self.single_transformer_blocks]
        video_len = x.shape[1]

        def run_blocks(joint: torch.Tensor, start: int = 0, end: int | None = None) -> torch.Tensor:
            # contiguous: the compiled block would otherwise be compiled again for the first block's strided views
            x, text = joint[:, :video_len].contiguous(), joint[:, video_len:].contiguous()
            for block in blocks[start:end]:
                x, text = block(x, text, temb, rotary, key_mask)
            return torch.cat([x, text], dim=1)

        # a step cache keeps / reuses residuals of the joint tokens over a range of blocks
        x = self.runner.run_blocks(run_blocks, torch.cat([x, text], dim=1), len(blocks))[:, :video_len]

        scale, shift = self.norm_out.modulation(temb)
        # proj_out's output is the whole sequence again (token_plan's gather, under sequence parallelism)
        x = self.proj_out(self.norm_out.norm(x) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1))
        return self.unpatchify(x, grid)


EntryClass = HunyuanVideoTransformer3DModel
