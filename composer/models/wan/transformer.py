"""Wan diffusion transformer (DiT) for Wan2.1 and Wan2.2 (the A14B experts, TI2V-5B), composer's own
implementation, loading diffusers' weights.

    x: [B, C, F, H, W] latents -> patchify (Conv3d) -> tokens [B, S, D]
    for each block (timestep modulation from a shared projection + a learned per-block table):
        x = x + gate1 * SelfAttn(LN(x) * (1 + scale1) + shift1)      (3D RoPE, RMSNorm on q and k)
        x = x + CrossAttn(LN_affine(x), text)  [+ CrossAttn to the CLIP image tokens, for I2V / FLF2V models]
        x = x + gate2 * FFN(LN(x) * (1 + scale2) + shift2)
    -> LN * (1 + scale) + shift -> Linear -> unpatchify -> [B, C, F, H, W] (the flow / noise prediction)

Precision follows the reference: norms, modulation and the gated residual adds in fp32 (the cross-attention
residual in the model dtype), matmuls in the model dtype.
Attention goes through `composer.models.attention.Attention`, the one place it is computed.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from composer.errors import InvalidInputError, UnsupportedError
from composer.models.attention import Attention
from composer.models.layers.embeddings import MLPEmbedder, sinusoidal_timestep_embedding
from composer.models.layers.norm import FP32LayerNorm
from composer.models.layers.rotary import apply_rotary, rope_frequencies
from composer.models.runner import RunsBlocks, TokenPlan
from composer.models.wan.config import WanTransformerConfig
from composer.models.wan.mapping import DIFFUSERS_TO_COMPOSER, ORIGINAL_TO_COMPOSER

Rotary = tuple[torch.Tensor, torch.Tensor]

# RoPE's theta: diffusers' WanRotaryPosEmbed (and the original release) fix it; no config key changes it.
ROPE_THETA = 10000.0


class WanSelfAttention(nn.Module):
    """Multi-head self-attention with RMSNorm across heads on q/k and 3D RoPE.

    q/k are always RMS-normed: every released Wan uses it and diffusers applies it whatever `qk_norm` says.
    """

    def __init__(self, dim: int, num_heads: int, eps: float):
        super().__init__()
        self.head_dim = dim // num_heads  # heads are counted from the projections' width: a TP rank holds some
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.Linear(dim, dim)
        self.norm_q = nn.RMSNorm(dim, eps=eps)
        self.norm_k = nn.RMSNorm(dim, eps=eps)
        self.attention = Attention(role="self")

    def project_qkv(self, x: torch.Tensor, rotary: Rotary) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (normed, rotated) and v as [B, S, heads, head_dim]."""
        q = self.norm_q(self.to_q(x)).unflatten(2, (-1, self.head_dim))
        k = self.norm_k(self.to_k(x)).unflatten(2, (-1, self.head_dim))
        v = self.to_v(x).unflatten(2, (-1, self.head_dim))
        return apply_rotary(q, *rotary), apply_rotary(k, *rotary), v

    def forward(
        self, x: torch.Tensor, rotary: Rotary, attn_mask: torch.Tensor | None = None, kv_cache=None,
        token_grid: tuple[int, int, int] | None = None,
    ) -> torch.Tensor:
        """`kv_cache`: a layer handle of composer.cache.KVCache; this pass's k/v are written into it and q
        attends to every key it holds that the window lets it see. `token_grid`: the (frames, rows, cols) of
        x's tokens, for a spatially windowed attention backend."""
        q, k, v = self.project_qkv(x, rotary)
        return self.to_out(self.attention(q, k, v, attn_mask, kv_cache, token_grid).flatten(2))


class WanCrossAttention(nn.Module):
    """Attention from video tokens to the text embedding (no mask: padded text tokens are zero embeddings).

    With `added_kv_proj_dim` (Wan2.1 I2V / FLF2V) the same queries also attend to the embedded CLIP image tokens
    through their own k/v projections (`add_k_proj`, `add_v_proj`, `norm_added_k`); the two attention outputs are
    summed before the output projection.
    """

    def __init__(self, dim: int, num_heads: int, eps: float, added_kv_proj_dim: int | None = None):
        super().__init__()
        self.head_dim = dim // num_heads  # heads are counted from the projections' width: a TP rank holds some
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.Linear(dim, dim)
        self.norm_q = nn.RMSNorm(dim, eps=eps)
        self.norm_k = nn.RMSNorm(dim, eps=eps)
        if added_kv_proj_dim is not None:
            self.add_k_proj = nn.Linear(added_kv_proj_dim, dim)
            self.add_v_proj = nn.Linear(added_kv_proj_dim, dim)
            self.norm_added_k = nn.RMSNorm(dim, eps=eps)
        self.attention = Attention(role="cross")

    def project_kv(self, context: torch.Tensor, image: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """(k, v) of the embedded text, followed by the image tokens' (k, v) when `image` is given."""
        k = self.norm_k(self.to_k(context)).unflatten(2, (-1, self.head_dim))
        v = self.to_v(context).unflatten(2, (-1, self.head_dim))
        if image is None:
            return k, v
        k_img = self.norm_added_k(self.add_k_proj(image)).unflatten(2, (-1, self.head_dim))
        v_img = self.add_v_proj(image).unflatten(2, (-1, self.head_dim))
        return k, v, k_img, v_img

    def forward(
        self, x: torch.Tensor, context: torch.Tensor | tuple[torch.Tensor, ...], image: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`context`: the embedded text [B, L, D] (and `image`, the embedded image tokens [B, N, D], for an
        image model), or their (k, v[, k_img, v_img]) from `project_kv`, computed once per prompt."""
        q = self.norm_q(self.to_q(x)).unflatten(2, (-1, self.head_dim))
        kv = context if isinstance(context, tuple) else self.project_kv(context, image)
        out = self.attention(q, kv[0], kv[1]).flatten(2)
        if len(kv) == 4:  # the image tokens: same queries, their own keys and values
            out = out + self.attention(q, kv[2], kv[3]).flatten(2)
        return self.to_out(out)


class WanFeedForward(nn.Module):
    """Linear -> GELU (tanh approximation by default) -> Linear."""

    def __init__(self, dim: int, ffn_dim: int, out_dim: int | None = None, approximate: str = "tanh"):
        super().__init__()
        self.approximate = approximate
        self.fc_in = nn.Linear(dim, ffn_dim)
        self.fc_out = nn.Linear(ffn_dim, out_dim or dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x), approximate=self.approximate))


class WanTransformerBlock(nn.Module):
    """Self-attention, cross-attention and FFN, each modulated by the timestep (adaLN with gates)."""

    def __init__(self, config: WanTransformerConfig):
        super().__init__()
        dim, heads, eps = config.hidden_size, config.num_attention_heads, config.eps
        self.norm1 = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.attn1 = WanSelfAttention(dim, heads, eps)
        self.norm2 = FP32LayerNorm(dim, eps, elementwise_affine=True) if config.cross_attn_norm else nn.Identity()
        self.attn2 = WanCrossAttention(dim, heads, eps, config.added_kv_proj_dim)
        self.norm3 = FP32LayerNorm(dim, eps, elementwise_affine=False)
        self.ffn = WanFeedForward(dim, config.ffn_dim)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        timestep_proj: torch.Tensor,
        rotary: Rotary,
        attn_mask: torch.Tensor | None = None,
        kv_cache=None,
        token_grid: tuple[int, int, int] | None = None,
        image: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, S, D]; timestep_proj [B, T, 6, D]: T = 1 (one timestep for all tokens), T = frames (one per
        latent frame, the tokens of a frame being contiguous) or T = S (one per token, Wan2.2 TI2V): T
        contiguous groups of S / T tokens, each modulated by its own row; token_grid: x's (frames, rows, cols);
        image: the embedded image tokens [B, N, D] of an image model when `context` is the embedded text."""
        t = timestep_proj.shape[1]
        mods = (self.scale_shift_table.unsqueeze(1) + timestep_proj.float()).chunk(6, dim=2)  # each [B, T, 1, D]
        shift1, scale1, gate1, shift2, scale2, gate2 = mods

        def per_frame(h: torch.Tensor) -> torch.Tensor:  # [B, S, D] -> [B, T, S/T, D] (a group per timestep)
            return h.unflatten(1, (t, -1))

        h = (self.norm1(per_frame(x).float()) * (1 + scale1) + shift1).flatten(1, 2).type_as(x)
        attn = self.attn1(h, rotary, attn_mask, kv_cache, token_grid)
        x = (per_frame(x).float() + per_frame(attn) * gate1).flatten(1, 2).type_as(x)

        h = self.norm2(x.float()).type_as(x)
        x = x + self.attn2(h, context, image)

        h = (self.norm3(per_frame(x).float()) * (1 + scale2) + shift2).flatten(1, 2).type_as(x)
        ff = self.ffn(h)
        x = (per_frame(x).float() + per_frame(ff).float() * gate2).flatten(1, 2).type_as(x)
        return x


class WanTextProjection(nn.Module):
    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x), approximate="tanh"))


class WanImageEmbedding(nn.Module):
    """CLIP image tokens -> model width: LN -> Linear -> GELU -> Linear -> LN (fp32 norms). A first-last-frame
    model (`pos_embed_seq_len`) takes both images' tokens as one sequence with a learned position embedding."""

    def __init__(self, image_dim: int, dim: int, pos_embed_seq_len: int | None = None):
        super().__init__()
        self.norm1 = FP32LayerNorm(image_dim)
        self.ff = WanFeedForward(image_dim, image_dim, dim, approximate="none")
        self.norm2 = FP32LayerNorm(dim)
        self.pos_embed = nn.Parameter(torch.zeros(1, pos_embed_seq_len, image_dim)) if pos_embed_seq_len else None

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        """[B * n, N, image_dim] (n images per video: 1, or 2 with `pos_embed`) -> [B, n * N, D]."""
        if self.pos_embed is not None:
            image = image.unflatten(0, (-1, self.pos_embed.shape[1] // image.shape[1])).flatten(1, 2)
            image = image + self.pos_embed
        return self.norm2(self.ff(self.norm1(image)))


class WanConditionEmbedder(nn.Module):
    """Timestep -> (temb, six modulation vectors); text embedding -> model width; CLIP image tokens -> model
    width (image models)."""

    def __init__(self, config: WanTransformerConfig):
        super().__init__()
        dim = config.hidden_size
        self.freq_dim = config.freq_dim
        self.time_embedder = MLPEmbedder(config.freq_dim, dim)
        self.time_proj = nn.Linear(dim, 6 * dim)
        self.text_embedder = WanTextProjection(config.text_dim, dim)
        if config.takes_image:
            self.image_embedder = WanImageEmbedding(config.image_dim, dim, config.pos_embed_seq_len)

    def embed_timestep(self, timestep: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """timestep [B], [B, F] (per latent frame) or [B, S] (per token) -> temb [B, T, D] and timestep_proj
        [B, T, 6, D] in `dtype` (the activations' dtype), T being 1, F or S."""
        grid = timestep.shape if timestep.ndim == 2 else (timestep.shape[0], 1)
        freq = self.timestep_frequencies(timestep.flatten())
        weight_dtype = self.time_embedder.linear_1.weight.dtype
        temb = self.time_embedder(freq.to(weight_dtype)).to(dtype)
        proj = self.time_proj(F.silu(temb)).unflatten(1, (6, -1))
        return temb.unflatten(0, grid), proj.unflatten(0, grid)

    def timestep_frequencies(self, timestep: torch.Tensor) -> torch.Tensor:
        """[N] timesteps -> [N, freq_dim] sinusoids, [cos | sin], in fp32; the caller casts them to the embedder's
        dtype (a variant computing them at another precision overrides this: SkyReels-V2's in float64)."""
        return sinusoidal_timestep_embedding(timestep, self.freq_dim)

    def embed_text(self, text: torch.Tensor) -> torch.Tensor:
        return self.text_embedder(text)

    def embed_image(self, image: torch.Tensor) -> torch.Tensor:
        return self.image_embedder(image)


def check_timestep_layout(timestep: torch.Tensor, batch: int, grid: tuple[int, int, int], sharded: bool) -> None:
    """Refuse a timestep the blocks cannot spread over the tokens: [B], [B, frames] or [B, tokens] (metadata only,
    no device sync). Per-token timesteps are not split over sequence-parallel ranks (per-frame ones are)."""
    frames, tokens = grid[0], math.prod(grid)
    per = {1: "one", frames: "per frame", tokens: "per token"}
    groups = 1 if timestep.ndim == 1 else timestep.shape[1] if timestep.ndim == 2 else None
    if timestep.shape[0] != batch or groups not in per:
        raise InvalidInputError(f"timestep of shape {list(timestep.shape)} for {batch} rows of {frames} latent frames "
                                f"({tokens} tokens): expected [{batch}], [{batch}, {frames}] or [{batch}, {tokens}]")
    if sharded and groups not in (1, frames):
        raise UnsupportedError("per-token timesteps under sequence parallelism are not supported: give one timestep "
                               "per latent frame (a conditioning-frame mask is constant over each frame)")


class WanTransformer3DModel(RunsBlocks, nn.Module):
    """Wan2.1 / Wan2.2 DiT. Loads diffusers `WanTransformer3DModel` checkpoints and the original Wan release's."""

    class_names = ("WanTransformer3DModel", "WanModel")
    config_class = WanTransformerConfig
    # The repeated transformer blocks (an nn.ModuleList): what regional compilation compiles once and
    # layerwise offload streams to the device.
    repeated_blocks = "blocks"
    # checkpoint naming -> composer naming (see composer/loader/weights.py)
    param_name_mappings = {"diffusers": DIFFUSERS_TO_COMPOSER, "original": ORIGINAL_TO_COMPOSER}
    ignored_checkpoint_keys = (r"\.norm_added_q\.",)
    # The declarative split/gather plan (composer/models/runner.py): under sequence parallelism each rank keeps its
    # part of every frame from patchify on (RoPE and per-frame modulation act on the local part), and proj_out's
    # (narrow) output is gathered back before unpatchify. The hooks fill the block runner; the forward below
    # only hands it the tokens and the blocks.
    token_plan = TokenPlan(gather_at="proj_out")
    # Kept in fp32 whatever the load dtype, as the reference keeps them.
    keep_in_fp32 = (
        r"^condition_embedder\.time_embedder\.", r"scale_shift_table$", r"^blocks\.\d+\.norm2\.",
        r"^condition_embedder\.image_embedder\.norm[12]\.",
    )
    # Tensor parallelism (composer/parallel/tensor.py): module name -> how its weight is split over the ranks.
    # "column": output features (whole heads, or a block of the FFN's hidden units), "row": input features (the
    # partial outputs are summed), "norm": the q/k RMSNorm over all heads, computed from the local heads' slice.
    # Everything else is replicated.
    tensor_parallel_plan = {
        r"^blocks\.\d+\.attn[12]\.to_[qkv]$": "column",
        r"^blocks\.\d+\.attn[12]\.to_out$": "row",
        r"^blocks\.\d+\.attn[12]\.norm_[qk]$": "norm",
        r"^blocks\.\d+\.attn2\.add_[kv]_proj$": "column",  # image models: the image tokens' k/v
        r"^blocks\.\d+\.attn2\.norm_added_k$": "norm",
        r"^blocks\.\d+\.ffn\.fc_in$": "column",
        r"^blocks\.\d+\.ffn\.fc_out$": "row",
    }

    def __init__(self, config: WanTransformerConfig):
        super().__init__()
        config.check_supported()
        self.config = config
        dim = config.hidden_size
        self.patch_embedding = nn.Conv3d(
            config.in_channels, dim, kernel_size=config.patch_size, stride=config.patch_size
        )
        self.condition_embedder = WanConditionEmbedder(config)
        self.blocks = nn.ModuleList([WanTransformerBlock(config) for _ in range(config.num_layers)])
        self.norm_out = FP32LayerNorm(dim, config.eps, elementwise_affine=False)
        self.proj_out = nn.Linear(dim, config.out_channels * math.prod(config.patch_size))
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)
        self._rope_cache: OrderedDict[tuple, Rotary] = OrderedDict()

    @property
    def dtype(self) -> torch.dtype:
        return self.proj_out.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.proj_out.weight.device

    def rotary(self, grid: tuple[int, int, int], device: torch.device, frame_offset: int = 0) -> Rotary:
        """RoPE cos/sin for a token grid, cached per (grid, offset, device): steps reuse one table. Positions
        stay below rope_max_seq_len on every axis (diffusers' table holds that many; a grid past it is refused,
        as diffusers cannot run it either)."""
        key = (grid, frame_offset, str(device))
        limit = self.config.rope_max_seq_len
        if frame_offset + grid[0] > limit or grid[1] > limit or grid[2] > limit:
            raise InvalidInputError(
                f"a token grid of {grid[0]} x {grid[1]} x {grid[2]} (frames x rows x columns, the first frame at "
                f"position {frame_offset}) passes this Wan transformer's rope_max_seq_len = {limit} RoPE positions "
                "per axis: ask for fewer frames or a smaller size"
            )
        if key not in self._rope_cache:
            if len(self._rope_cache) >= 8:
                self._rope_cache.popitem(last=False)
            self._rope_cache[key] = rope_frequencies(
                self.config.attention_head_dim, grid, frame_offset, ROPE_THETA, device
            )
        return self._rope_cache[key]

    def patchify(self, latents: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """[B, C, F, H, W] -> tokens [B, F'*H'*W', D] and the token grid (F', H', W')."""
        x = self.patch_embedding(latents)
        grid = tuple(x.shape[2:])
        return x.flatten(2).transpose(1, 2).contiguous(), grid

    def unpatchify(self, tokens: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """[B, S, C*pt*ph*pw] -> [B, C, F, H, W]."""
        pt, ph, pw = self.config.patch_size
        f, h, w = grid
        x = tokens.reshape(tokens.shape[0], f, h, w, pt, ph, pw, -1)
        return x.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)

    def cross_attention_kv(
        self, encoder_hidden_states: torch.Tensor, encoder_hidden_states_image: torch.Tensor | None = None
    ) -> list[tuple[torch.Tensor, ...]]:
        """Each block's cross-attention (k, v) for a text embedding, followed by the image tokens' (k, v) for an
        image model given CLIP image states: compute once per prompt, reuse every step."""
        context = self.condition_embedder.embed_text(encoder_hidden_states)
        image = self._embedded_image(encoder_hidden_states_image)
        return [block.attn2.project_kv(context, image) for block in self.cross_attention_blocks()]

    def cross_attention_blocks(self) -> list[nn.Module]:
        """The blocks whose cross-attention reads the text, in the order of `cross_attention_kv`'s entries: the
        repeated blocks, then a variant's own (VACE's control blocks, composer/models/wan/vace.py)."""
        return list(self.blocks)

    def block_residuals(self, x: torch.Tensor, *, contexts: list, timestep_proj: torch.Tensor, rotary: Rotary,
                        token_grid: tuple[int, int, int] | None, image: torch.Tensor | None,
                        split: Callable[[torch.Tensor], torch.Tensor]) -> dict[int, torch.Tensor | Callable]:
        """{block index: residual [B, S, D]} added to the stream after that block: a variant's control branch,
        computed from the blocks' input `x` (this rank's tokens) and what the blocks read (`contexts`: one entry per
        `cross_attention_blocks()`); `split(tokens)` gives this rank's part of more tokens of x's grid. A residual may
        also be a function of the stream after its block (stream -> residual). The plain DiT has none; VACE's hints
        are its (composer/models/wan/vace.py), with the control latents `_forward` was given by keyword, and so are
        Wan Animate's face adapters (functions: composer/models/wan/animate.py)."""
        return {}

    def _embedded_image(self, encoder_hidden_states_image: torch.Tensor | None) -> torch.Tensor | None:
        """The CLIP image states in the model's width; an image model requires them, a text model refuses them."""
        if self.config.takes_image != (encoder_hidden_states_image is not None):
            raise ValueError(
                "this Wan transformer needs encoder_hidden_states_image (CLIP image states)" if self.config.takes_image
                else "this Wan transformer has no image cross-attention: encoder_hidden_states_image must be None"
            )
        return None if encoder_hidden_states_image is None else self.condition_embedder.embed_image(
            encoder_hidden_states_image)

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_hidden_states_image: torch.Tensor | None = None,
        *variant_args,
        cross_kv: list[tuple[torch.Tensor, ...]] | None = None,
        frame_offset: int = 0,
        attn_mask: torch.Tensor | None = None,
        kv_cache=None,
        **variant_kwargs,
    ) -> torch.Tensor:
        """hidden_states [B, C, F, H, W], timestep [B] (or [B, F]: one per latent frame, or [B, S]: one per
        token, as Wan2.2 TI2V's `expand_timesteps` gives it), and the text as encoder_hidden_states
        [B, L, text_dim] or its precomputed `cross_kv` -> prediction [B, C, F, H, W].
        An image model (I2V / FLF2V) also takes the CLIP image states, encoder_hidden_states_image [B * n, N,
        image_dim] (n = 2 images per video for FLF2V), or their k/v in `cross_kv`; its hidden_states hold the noisy
        latents and the image condition concatenated on the channel axis, as diffusers' I2V pipeline passes them.

        Causal generation uses the keyword-only arguments: `frame_offset` (absolute index of the first frame,
        for RoPE), `attn_mask` (a [S, S] boolean mask over tokens) and `kv_cache` (a composer.cache.KVCache:
        this pass covers frames [frame_offset, frame_offset + F); their keys/values are appended to it, or
        overwrite the newest frames on a re-run, and every cached frame the window shows is attended to).
        A variant's own inputs (VACE's control latents, Animate's pose and face, SkyReels-V2's fps) follow
        encoder_hidden_states_image positionally or come by keyword, as its `variant_inputs` takes them; the plain
        DiT takes none.
        """
        hidden_states, control = self.variant_inputs(hidden_states, *variant_args, frame_offset=frame_offset,
                                                     attn_mask=attn_mask, kv_cache=kv_cache, **variant_kwargs)
        if kv_cache is not None:
            with kv_cache.pass_over(frame_offset, hidden_states.shape[2]):
                return self._forward(hidden_states, timestep, encoder_hidden_states, cross_kv, frame_offset,
                                     attn_mask, kv_cache, encoder_hidden_states_image, **control)
        return self._forward(hidden_states, timestep, encoder_hidden_states, cross_kv, frame_offset, attn_mask,
                             image=encoder_hidden_states_image, **control)

    def variant_inputs(self, hidden_states: torch.Tensor, *, frame_offset: int, attn_mask: torch.Tensor | None,
                       kv_cache) -> tuple[torch.Tensor, dict[str, Any]]:
        """A variant's own forward inputs, checked: its signature is the variant's (after hidden_states, the
        positional ones in diffusers' order, then the keyword-only ones; forward's `frame_offset`, `attn_mask` and
        `kv_cache` by keyword, for a variant that refuses causal passes) -> (the DiT's input, what `_forward` then
        takes by keyword: `block_residuals`' inputs, or a `modulation_bias`). The plain DiT takes none: anything
        more is a TypeError naming it, as an unknown argument of forward is."""
        return hidden_states, {}

    def _forward(self, hidden_states, timestep, encoder_hidden_states, cross_kv, frame_offset, attn_mask,
                 kv_cache=None, image=None, modulation_bias=None, **control) -> torch.Tensor:
        """`control`: a variant's own inputs, by keyword, for its `block_residuals` (none for the plain DiT).
        `modulation_bias` [B, 6, D]: added to every timestep's modulation vectors (not to the output norm's), in the
        activations' dtype: a variant's per-row conditioning (SkyReels-V2's fps embedding), from its
        `variant_inputs`."""
        x, grid = self.patchify(hidden_states)
        rotary = self.rotary(grid, x.device, frame_offset)
        runner = self.runner
        check_timestep_layout(timestep, x.shape[0], grid, sharded=not runner.holds_whole_sequence)
        whole_rotary = rotary
        x, rotary = runner.enter(x, rotary, frames=grid[0])  # this rank's tokens, once for all blocks
        # the token grid, for a windowed attention backend: only a pass holding every token of the grid
        token_grid = grid if runner.holds_whole_sequence and kv_cache is None else None
        if cross_kv is None:
            context = self.condition_embedder.embed_text(encoder_hidden_states)
            contexts = [context] * len(self.cross_attention_blocks())
            image = self._embedded_image(image)
            act_dtype = encoder_hidden_states.dtype
        else:
            contexts, image = cross_kv, None  # an image model's cross_kv holds the image tokens' k/v too
            act_dtype = cross_kv[0][0].dtype
        temb, timestep_proj = self.condition_embedder.embed_timestep(timestep, act_dtype)
        if modulation_bias is not None:
            timestep_proj = timestep_proj + modulation_bias.unsqueeze(1)  # [B, T, 6, D] + [B, 1, 6, D]
        residuals = self.block_residuals(
            x, contexts=contexts, timestep_proj=timestep_proj, rotary=rotary, token_grid=token_grid, image=image,
            split=lambda tokens: runner.enter(tokens, whole_rotary, frames=grid[0])[0], **control)

        def run_blocks(x: torch.Tensor, start: int = 0, end: int | None = None) -> torch.Tensor:
            for i in range(start, len(self.blocks) if end is None else end):
                layer_cache = kv_cache.layer(i) if kv_cache is not None else None
                x = self.blocks[i](x, contexts[i], timestep_proj, rotary, attn_mask, layer_cache, token_grid, image)
                if i in residuals:  # a tensor, or a function of the stream here (Animate's face adapters)
                    residual = residuals[i]
                    x = x + (residual(x) if callable(residual) else residual)
            return x

        # a step cache (composer.accel.step_cache) may reuse an earlier step's residual instead of the blocks
        x = runner.run_blocks(run_blocks, x, len(self.blocks))

        # output norm + modulation, per frame (or token) when timesteps are per frame (or token)
        shift, scale = (self.scale_shift_table.unsqueeze(1) + temb.unsqueeze(2)).chunk(2, dim=2)  # [B, T, 1, D]
        h = x.unflatten(1, (temb.shape[1], -1))
        # proj_out's output is the whole sequence again (token_plan's gather, under sequence parallelism)
        x = self.proj_out((self.norm_out(h.float()) * (1 + scale) + shift).flatten(1, 2).type_as(x))
        return self.unpatchify(x, grid)


EntryClass = WanTransformer3DModel
