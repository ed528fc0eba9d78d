"""HunyuanVideo-1.5 diffusion transformer (DiT), composer's own implementation, loading diffusers' weights.

    x: [B, C, F, H, W] = [noisy latents | condition latents | condition mask] -> patchify (Conv3d) -> video [B, S, D]
    text (Qwen2.5-VL states [B, L, 3584]) -> token refiner (self-attention conditioned on t and the mean text)
        + cond_type_embed[0]
    glyph text (ByT5 states [B, L2, 1472], the prompt's quoted text) -> LN, MLP (GELU) + cond_type_embed[1]
    image (SigLIP states [B, 729, 1152], image-to-video only) -> LN, MLP, LN + cond_type_embed[2]
    temb = MLP(t) (+ MLP(t_r) for a MeanFlow model)
    joint text = [image; glyph text; text]
    dual-stream blocks (HunyuanVideo's: separate video / text weights, one attention over [video; joint text])
    -> LN * (1 + scale) + shift (from temb) -> Linear -> unpatchify -> [B, C_out, F, H, W] (the flow prediction)

There are no single-stream blocks and no embedded guidance (HunyuanVideo's have both): classifier-free guidance
is a second branch, as for Wan.

Text padding. Each text stream comes with its mask (1: a token, 0: padding); the padding is masked as keys in every
attention ([B, 1, 1, S + L]). The reference reorders each row's tokens (the real ones of the three streams first,
then the padding) and masks (query, key) pairs: a real token sees the same keys either way and padding never reaches
the video, so keeping the streams in place with a key mask gives the same video. A text-to-video request has no
image tokens at all (the reference computes 729 and masks every one), and a prompt without quoted text no glyph
tokens. The pipeline's text stage drops the padding every row shares, so a request whose rows have equal lengths
carries no mask and runs on any attention backend.

Precision follows the reference: everything in the model dtype except the q/k RMSNorm statistics and the rotary
products (fp32) and the sinusoidal timestep embeddings (fp32, cast to the model dtype before their MLPs). The
timestep is rounded to the model dtype first, as the reference pipeline passes it.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from composer.models.hunyuan.blocks import (
    FREQ_DIM,
    AdaNorm,
    DualStreamBlock,
    MLPEmbedder,
    Rotary,
    TokenRefiner,
    embed_scalar,
)
from composer.models.hunyuan.grid import HunyuanTokenGrid
from composer.models.hunyuan.mapping import DIFFUSERS_TO_COMPOSER
from composer.models.hunyuan15.config import HunyuanVideo15TransformerConfig
from composer.models.runner import RunsBlocks, TokenPlan

GLYPH_HIDDEN = 2048  # the ByT5 projection's hidden width (diffusers' constant, whatever the config says)
# cond_type_embed's rows: which stream a text token comes from
TEXT, GLYPH, IMAGE = 0, 1, 2


class GlyphProjection(nn.Module):
    """ByT5 states -> the model width: LayerNorm, then Linear -> GELU -> Linear -> GELU -> Linear."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(in_dim)
        self.linear_1 = nn.Linear(in_dim, GLYPH_HIDDEN)
        self.linear_2 = nn.Linear(GLYPH_HIDDEN, GLYPH_HIDDEN)
        self.linear_3 = nn.Linear(GLYPH_HIDDEN, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_3(F.gelu(self.linear_2(F.gelu(self.linear_1(self.norm(x))))))


class ImageProjection(nn.Module):
    """SigLIP states -> the model width: LayerNorm -> Linear -> GELU -> Linear -> LayerNorm."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.norm_in = nn.LayerNorm(in_dim)
        self.linear_1 = nn.Linear(in_dim, in_dim)
        self.linear_2 = nn.Linear(in_dim, dim)
        self.norm_out = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm_out(self.linear_2(F.gelu(self.linear_1(self.norm_in(x)))))


class HunyuanVideo15Transformer3DModel(HunyuanTokenGrid, RunsBlocks, nn.Module):
    """HunyuanVideo-1.5 DiT (text- and image-to-video). Loads diffusers `HunyuanVideo15Transformer3DModel`
    checkpoints."""

    class_names = ("HunyuanVideo15Transformer3DModel",)
    config_class = HunyuanVideo15TransformerConfig
    param_name_mappings = {"diffusers": DIFFUSERS_TO_COMPOSER}
    ignored_checkpoint_keys = ()
    keep_in_fp32 = ()  # the reference keeps no module in fp32
    repeated_blocks = "transformer_blocks"
    # As HunyuanVideo's (composer/models/runner.py): under sequence parallelism (Ulysses) each rank keeps its part of
    # every frame's video tokens and the whole joint text; proj_out's output is gathered back.
    token_plan = TokenPlan(gather_at="proj_out", whole=("text",))

    def __init__(self, config: HunyuanVideo15TransformerConfig):
        super().__init__()
        config.check_supported()
        self.config = config
        dim, head_dim = config.hidden_size, config.attention_head_dim
        patch = (config.patch_size_t, config.patch_size, config.patch_size)
        self.x_embedder = nn.Module()
        self.x_embedder.proj = nn.Conv3d(config.in_channels, dim, kernel_size=patch, stride=patch)
        self.image_embedder = ImageProjection(config.image_embed_dim, dim)
        self.context_embedder = TokenRefiner(config.text_embed_dim, dim, head_dim, config.num_refiner_layers)
        self.context_embedder_2 = GlyphProjection(config.text_embed_2_dim, dim)
        self.time_embed = nn.Module()
        self.time_embed.timestep_embedder = MLPEmbedder(FREQ_DIM, dim)
        if config.use_meanflow:
            self.time_embed.timestep_embedder_r = MLPEmbedder(FREQ_DIM, dim)
        self.cond_type_embed = nn.Embedding(3, dim)
        self.transformer_blocks = nn.ModuleList(
            [DualStreamBlock(dim, head_dim, config.mlp_ratio, config.qk_norm) for _ in range(config.num_layers)]
        )
        self.norm_out = AdaNorm(dim, 2)
        self.proj_out = nn.Linear(dim, config.out_channels * config.patch_size_t * config.patch_size**2)
        self._rope_cache: OrderedDict[tuple, Rotary] = OrderedDict()

    def timestep_signal(self, timestep: torch.Tensor) -> torch.Tensor:
        """The timestep's embedding [B, D]: what TeaCache plans its skips from."""
        return embed_scalar(self.time_embed.timestep_embedder, timestep.to(self.dtype), self.dtype)

    def conditioning(self, timestep: torch.Tensor, timestep_r: torch.Tensor | None) -> torch.Tensor:
        """temb [B, D]: MLP(t), plus MLP(t_r) for a MeanFlow model given a second timestep."""
        temb = embed_scalar(self.time_embed.timestep_embedder, timestep, self.dtype)
        if timestep_r is not None:
            if not self.config.use_meanflow:
                raise ValueError("timestep_r is given but this transformer has no MeanFlow embedder (use_meanflow)")
            temb = temb + embed_scalar(self.time_embed.timestep_embedder_r, timestep_r.to(self.dtype), self.dtype)
        return temb

    def joint_text(self, text: torch.Tensor, text_mask: torch.Tensor | None, timestep: torch.Tensor,
                   glyph: torch.Tensor | None, glyph_mask: torch.Tensor | None,
                   image: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The text tokens the blocks attend with, [image; glyph; text] [B, L, D], and their mask [B, L] (None: every
        token is real)."""
        rows = text.shape[0]
        kinds = self.cond_type_embed.weight
        parts = [(self.context_embedder(text, timestep, text_mask) + kinds[TEXT], text_mask)]
        if glyph is not None:
            parts.insert(0, (self.context_embedder_2(glyph) + kinds[GLYPH], glyph_mask))
        if image is not None:
            parts.insert(0, (self.image_embedder(image) + kinds[IMAGE], None))
        tokens = torch.cat([p for p, _ in parts], dim=1)
        if all(m is None for _, m in parts):
            return tokens, None
        masks = [torch.ones(rows, p.shape[1], dtype=torch.bool, device=p.device) if m is None else m.bool()
                 for p, m in parts]
        return tokens, torch.cat(masks, dim=1)

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor | None = None,
        encoder_hidden_states_2: torch.Tensor | None = None,
        encoder_attention_mask_2: torch.Tensor | None = None,
        encoder_hidden_states_image: torch.Tensor | None = None,
        timestep_r: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states [B, in_channels, F, H, W] (the noisy latents, the condition latents and their mask; or the
        noisy latents alone, [B, out_channels, ...], for text-to-video, whose condition is zeros), timestep [B], the
        Qwen2.5-VL states [B, L, text_dim] with their mask [B, L] (1: a token, 0: padding; None: none), the ByT5
        glyph states [B, L2, text_2_dim] with theirs (None: the prompts quote no text), the SigLIP image states
        [B, N, image_dim] (None: text-to-video) and a MeanFlow model's second timestep -> the prediction
        [B, out_channels, F, H, W]."""
        missing = self.config.in_channels - hidden_states.shape[1]
        if missing > 0 and hidden_states.shape[1] == self.config.out_channels:  # text-to-video: a zero condition
            zeros = hidden_states.new_zeros(hidden_states.shape[0], missing, *hidden_states.shape[2:])
            hidden_states = torch.cat([hidden_states, zeros], dim=1)
        timestep = timestep.to(self.dtype)  # the reference pipeline passes it in the model dtype
        temb = self.conditioning(timestep, timestep_r)
        x = self.x_embedder.proj(hidden_states)
        grid = tuple(x.shape[2:])
        x = x.flatten(2).transpose(1, 2)
        rotary = self.rotary(grid, x.device)
        text, text_mask = self.joint_text(encoder_hidden_states, encoder_attention_mask, timestep,
                                          encoder_hidden_states_2, encoder_attention_mask_2,
                                          encoder_hidden_states_image)
        key_mask = None  # over the whole video, then the text
        if text_mask is not None:
            video = torch.ones(x.shape[0], x.shape[1], dtype=torch.bool, device=x.device)
            key_mask = torch.cat([video, text_mask], dim=1)[:, None, None, :]
        # this rank's part of every frame (the text stays whole), once for all blocks
        x, rotary = self.runner.enter(x, rotary, frames=grid[0])
        video_len = x.shape[1]

        def run_blocks(joint: torch.Tensor, start: int = 0, end: int | None = None) -> torch.Tensor:
            # contiguous: the compiled block would otherwise be compiled again for the first block's strided views
            x, text = joint[:, :video_len].contiguous(), joint[:, video_len:].contiguous()
            for block in self.transformer_blocks[start:end]:
                x, text = block(x, text, temb, rotary, key_mask)
            return torch.cat([x, text], dim=1)

        # a step cache keeps / reuses residuals of the joint tokens over a range of blocks
        joint = torch.cat([x, text], dim=1)
        x = self.runner.run_blocks(run_blocks, joint, len(self.transformer_blocks))[:, :video_len]

        scale, shift = self.norm_out.modulation(temb)
        # proj_out's output is the whole sequence again (token_plan's gather, under sequence parallelism)
        x = self.proj_out(self.norm_out.norm(x) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1))
        return self.unpatchify(x, grid)


EntryClass = HunyuanVideo15Transformer3DModel
