"""HunyuanVideo DiT building blocks: embeddings, the text token refiner, dual- and single-stream blocks.

Precision follows the reference (diffusers' HunyuanVideo): everything runs in the model dtype (no fp32 norms
or residuals, unlike Wan), except the q/k RMSNorm statistics (fp32), the sinusoidal embeddings (fp32, cast to
the activations' dtype before their MLP) and the rotary products (fp32, cast back).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from composer.models.attention import Attention
from composer.models.hunyuan.config import QK_NORMS
from composer.models.layers.embeddings import MLPEmbedder, sinusoidal_timestep_embedding
from composer.models.layers.norm import FP32LayerNorm
from composer.models.layers.rotary import apply_rotary

Rotary = tuple[torch.Tensor, torch.Tensor]

# What diffusers' HunyuanVideoTransformer3DModel fixes whatever its config says:
FREQ_DIM = 256  # width of the sinusoidal timestep / guidance embedding
REFINER_MLP_RATIO = 4.0  # the token refiner's FFN width ratio (HunyuanVideoTokenRefiner's default, not `mlp_ratio`)
NORM_EPS = 1e-6  # every LayerNorm / q-k norm of the DiT and the refiner


class HeadRMSNorm(nn.Module):
    """RMSNorm over each head's channels: statistics in fp32, the scale in the weight's dtype (the reference's
    rule, so bf16 activations round where the reference rounds)."""

    def __init__(self, dim: int, eps: float = NORM_EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        normed = x * torch.rsqrt(variance + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            normed = normed.to(self.weight.dtype)
        return (normed * self.weight).to(x.dtype)


def head_norm(kind: str | None, head_dim: int) -> nn.Module:
    """The per-head q/k norm diffusers' `Attention(qk_norm=kind, eps=1e-6)` builds: RMSNorm with a scale,
    LayerNorm with a scale and bias (model dtype), LayerNorm without either computed in fp32, or none."""
    if kind is None:
        return nn.Identity()
    if kind == "rms_norm":
        return HeadRMSNorm(head_dim)
    if kind == "layer_norm":
        return nn.LayerNorm(head_dim, eps=NORM_EPS)
    if kind == "fp32_layer_norm":
        return FP32LayerNorm(head_dim, eps=NORM_EPS, elementwise_affine=False, bias=False)
    raise ValueError(f"qk_norm = {kind!r}: composer's HunyuanVideo DiT implements {', '.join(map(repr, QK_NORMS))}")


def embed_scalar(embedder: MLPEmbedder, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B] timesteps (or guidance x 1000) -> [B, D]: fp32 sinusoids [cos | sin], cast to `dtype`, then the MLP."""
    return embedder(sinusoidal_timestep_embedding(values, FREQ_DIM).to(dtype))


class FeedForward(nn.Module):
    """Linear -> activation -> Linear (GELU-tanh in the DiT blocks, SiLU in the refiner)."""

    def __init__(self, dim: int, hidden: int, activation: str):
        super().__init__()
        self.fc_in = nn.Linear(dim, hidden)
        self.fc_out = nn.Linear(hidden, dim)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc_in(x)
        h = F.silu(h) if self.activation == "silu" else F.gelu(h, approximate="tanh")
        return self.fc_out(h)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [B, S, D] * (1 + scale) + shift, with scale/shift [B, D] per row."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class AdaNorm(nn.Module):
    """LayerNorm without affine + `chunks` modulation vectors from the conditioning: Linear(SiLU(temb))."""

    def __init__(self, dim: int, chunks: int):
        super().__init__()
        self.linear = nn.Linear(dim, chunks * dim)
        self.chunks = chunks
        self.dim = dim

    def modulation(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(F.silu(temb)).chunk(self.chunks, dim=1)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.dim,), eps=NORM_EPS)


# -- the text token refiner -------------------------------------------------------------------------------
class RefinerAttention(nn.Module):
    """Plain multi-head self-attention over the text tokens (no q/k norm, no rotary)."""

    def __init__(self, dim: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.Linear(dim, dim)
        # Text-only attention, the same on every sequence-parallel rank: the role that is never sharded.
        self.attention = Attention(role="cross")

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        q, k, v = (proj(x).unflatten(2, (-1, self.head_dim)) for proj in (self.to_q, self.to_k, self.to_v))
        return self.to_out(self.attention(q, k, v, key_mask).flatten(2))


class RefinerBlock(nn.Module):
    """x += gate1 * Attn(LN(x)); x += gate2 * FFN(LN(x)), gates from the refiner's conditioning. The FFN is
    REFINER_MLP_RATIO wide whatever the DiT's `mlp_ratio` (diffusers builds the refiner with its own default)."""

    def __init__(self, dim: int, head_dim: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=NORM_EPS)
        self.attn = RefinerAttention(dim, head_dim)
        self.norm2 = nn.LayerNorm(dim, eps=NORM_EPS)
        self.ff = FeedForward(dim, int(dim * REFINER_MLP_RATIO), "silu")
        self.norm_out = AdaNorm(dim, 2)  # gates only: its LayerNorm is unused

    def forward(self, x: torch.Tensor, temb: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        gate_attn, gate_ff = self.norm_out.modulation(temb)
        x = x + self.attn(self.norm1(x), key_mask) * gate_attn.unsqueeze(1)
        return x + self.ff(self.norm2(x)) * gate_ff.unsqueeze(1)


class TokenRefiner(nn.Module):
    """Text states [B, L, text_dim] -> refined tokens [B, L, D]: projected, then a few self-attention blocks
    conditioned on the timestep and the (masked) mean of the text states. Its heads are the DiT's (`num_attention_heads`
    of `attention_head_dim`); its FFN ratio is fixed (REFINER_MLP_RATIO), as in diffusers."""

    def __init__(self, text_dim: int, dim: int, head_dim: int, num_layers: int):
        super().__init__()
        self.time_text_embed = nn.Module()
        self.time_text_embed.timestep_embedder = MLPEmbedder(FREQ_DIM, dim)
        self.time_text_embed.text_embedder = MLPEmbedder(text_dim, dim)
        self.proj_in = nn.Linear(text_dim, dim)
        self.refiner_blocks = nn.ModuleList([RefinerBlock(dim, head_dim) for _ in range(num_layers)])

    def forward(self, text: torch.Tensor, timestep: torch.Tensor, text_mask: torch.Tensor | None) -> torch.Tensor:
        if text_mask is None:
            pooled = text.mean(dim=1)
            key_mask = None
        else:
            weight = text_mask.float().unsqueeze(-1)
            pooled = ((text * weight).sum(dim=1) / weight.sum(dim=1)).to(text.dtype)
            # Padded tokens are never keys. The reference masks [query, key] pairs with both tokens real and
            # lets every query see token 0 (so a padded query row is not empty); a real query sees the same keys
            # either way, and padded queries never reach the video tokens, so a key mask gives the same output.
            key_mask = text_mask.bool().clone()
            key_mask[:, 0] = True
            key_mask = key_mask[:, None, None, :]
        embed = self.time_text_embed
        temb = embed_scalar(embed.timestep_embedder, timestep, pooled.dtype) + embed.text_embedder(pooled)
        x = self.proj_in(text)
        for block in self.refiner_blocks:
            x = block(x, temb, key_mask)
        return x


# -- the joint video + text blocks ------------------------------------------------------------------------
def rotate_video(x: torch.Tensor, rotary: Rotary, video_len: int) -> torch.Tensor:
    """RoPE on the first `video_len` tokens of [B, S, H, Dh] (the video); text tokens are not rotated."""
    if video_len == x.shape[1]:
        return apply_rotary(x, *rotary)
    return torch.cat([apply_rotary(x[:, :video_len], *rotary), x[:, video_len:]], dim=1)


class JointAttention(nn.Module):
    """q/k/v projections, a per-head norm on q and k (the config's `qk_norm`: RMSNorm in the released model), RoPE
    on the video tokens, and one attention over the video tokens followed by the text tokens (the text's padding
    masked as keys). The dual-stream blocks give the text its own projections (`add_*_proj`, `to_add_out`) and
    q/k norms of the same kind; the single-stream blocks share them."""

    def __init__(self, dim: int, head_dim: int, separate_text: bool, qk_norm: str | None = "rms_norm"):
        super().__init__()
        self.head_dim = head_dim  # heads are counted from the projections' width
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.norm_q = head_norm(qk_norm, head_dim)
        self.norm_k = head_norm(qk_norm, head_dim)
        if separate_text:
            self.add_q_proj = nn.Linear(dim, dim)
            self.add_k_proj = nn.Linear(dim, dim)
            self.add_v_proj = nn.Linear(dim, dim)
            self.norm_added_q = head_norm(qk_norm, head_dim)
            self.norm_added_k = head_norm(qk_norm, head_dim)
            self.to_out = nn.Linear(dim, dim)
            self.to_add_out = nn.Linear(dim, dim)
        self.attention = Attention(role="self")

    def _qkv(self, x, to_q, to_k, to_v, norm_q, norm_k):
        q = norm_q(to_q(x).unflatten(2, (-1, self.head_dim)))
        k = norm_k(to_k(x).unflatten(2, (-1, self.head_dim)))
        return q, k, to_v(x).unflatten(2, (-1, self.head_dim))

    def forward(self, video: torch.Tensor, text: torch.Tensor | None, rotary: Rotary,
                key_mask: torch.Tensor | None, text_len: int) -> torch.Tensor:
        """Dual-stream: `video` [B, S, D] and `text` [B, L, D] -> attention output [B, S + L, D] (before the
        output projections). Single-stream: `video` holds the joint tokens (video first) and `text` is None.
        Under sequence parallelism S is this rank's video tokens and the text is whole on every rank."""
        video_len = video.shape[1]
        q, k, v = self._qkv(video, self.to_q, self.to_k, self.to_v, self.norm_q, self.norm_k)
        if text is not None:
            q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
            tq, tk, tv = self._qkv(text, self.add_q_proj, self.add_k_proj, self.add_v_proj,
                                   self.norm_added_q, self.norm_added_k)
            q, k, v = torch.cat([q, tq], dim=1), torch.cat([k, tk], dim=1), torch.cat([v, tv], dim=1)
        else:
            video_len = rotary[0].shape[1]
            q, k = rotate_video(q, rotary, video_len), rotate_video(k, rotary, video_len)
        return self.attention(q, k, v, key_mask, joint_text=text_len).flatten(2)


class DualStreamBlock(nn.Module):
    """Video and text tokens with their own weights (norms, modulation, FFN), one joint attention."""

    def __init__(self, dim: int, head_dim: int, mlp_ratio: float, qk_norm: str | None = "rms_norm"):
        super().__init__()
        self.norm1 = AdaNorm(dim, 6)
        self.norm1_context = AdaNorm(dim, 6)
        self.attn = JointAttention(dim, head_dim, separate_text=True, qk_norm=qk_norm)
        self.ff = FeedForward(dim, int(dim * mlp_ratio), "gelu_tanh")
        self.ff_context = FeedForward(dim, int(dim * mlp_ratio), "gelu_tanh")

    def forward(self, x: torch.Tensor, text: torch.Tensor, temb: torch.Tensor, rotary: Rotary,
                key_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.norm1.modulation(temb)
        c_shift1, c_scale1, c_gate1, c_shift2, c_scale2, c_gate2 = self.norm1_context.modulation(temb)
        h = modulate(self.norm1.norm(x), shift1, scale1)
        c = modulate(self.norm1_context.norm(text), c_shift1, c_scale1)
        out = self.attn(h, c, rotary, key_mask, text.shape[1])
        video_len = x.shape[1]
        x = x + self.attn.to_out(out[:, :video_len]) * gate1.unsqueeze(1)
        text = text + self.attn.to_add_out(out[:, video_len:]) * c_gate1.unsqueeze(1)
        x = x + gate2.unsqueeze(1) * self.ff(modulate(self.norm1.norm(x), shift2, scale2))
        text = text + c_gate2.unsqueeze(1) * self.ff_context(modulate(self.norm1.norm(text), c_shift2, c_scale2))
        return x, text


class SingleStreamBlock(nn.Module):
    """The joint tokens [video; text] with shared weights: attention and MLP in parallel from one modulated
    LayerNorm, one output projection over both, one gated residual."""

    def __init__(self, dim: int, head_dim: int, mlp_ratio: float, qk_norm: str | None = "rms_norm"):
        super().__init__()
        mlp_dim = int(dim * mlp_ratio)
        self.norm = AdaNorm(dim, 3)
        self.attn = JointAttention(dim, head_dim, separate_text=False, qk_norm=qk_norm)
        self.proj_mlp = nn.Linear(dim, mlp_dim)
        self.proj_out = nn.Linear(dim + mlp_dim, dim)

    def forward(self, x: torch.Tensor, text: torch.Tensor, temb: torch.Tensor, rotary: Rotary,
                key_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        video_len = x.shape[1]
        joint = torch.cat([x, text], dim=1)
        shift, scale, gate = self.norm.modulation(temb)
        h = modulate(self.norm.norm(joint), shift, scale)
        mlp = F.gelu(self.proj_mlp(h), approximate="tanh")
        attn = self.attn(h, None, rotary, key_mask, text.shape[1])
        joint = joint + gate.unsqueeze(1) * self.proj_out(torch.cat([attn, mlp], dim=2))
        # contiguous: every block then gets inputs of one layout (a compiled block is compiled once, not again for
        # strided views)
        return joint[:, :video_len].contiguous(), joint[:, video_len:].contiguous()
