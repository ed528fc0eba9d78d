"""LLaDAModelLM: composer's code for LLaDA's dense masked-diffusion language model, on LLaDA's own weight names.

A Llama-style stack with bidirectional attention (every position sees every valid position):

    wte -> blocks x n_layers (att_norm -> q/k/v (RoPE on q, k) -> attention -> attn_out; ff_norm -> SiLU(ff_proj)
    * up_proj -> ff_out) -> ln_f -> ff_out (the output head)

Beyond the plain forward (`model(ids, attention_mask=..., position_ids=...).logits`, as diffusers' LLaDA2Pipeline
drives a model), it can take `inputs_embeds` (soft embeddings: iteration smoothing) and a prefix's K/V
(`past_key_values`, `use_cache=True` returns the new positions' K/V): the vicinity KV refresh strategy reuses the
K/V of the positions outside the active block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from composer.models.llada.config import LLaDAConfig

KV = tuple[torch.Tensor, torch.Tensor]  # a layer's keys and values [rows, kv_heads, positions, head_dim]


@dataclass
class LLaDAOutput:
    logits: torch.Tensor
    past_key_values: list[KV] | None = None  # the new positions' K/V per layer (use_cache=True)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in full precision, the halves' rotation (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)."""
    dtype = x.dtype
    x = x.float()
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + turned * sin).to(dtype)


class LLaDABlock(nn.Module):
    def __init__(self, config: LLaDAConfig):
        super().__init__()
        d, kv = config.d_model, config.kv_heads * config.head_dim
        bias, qkv_bias = config.include_bias, config.include_bias or config.include_qkv_bias
        self.heads, self.kv_heads, self.head_dim = config.n_heads, config.kv_heads, config.head_dim
        self.att_norm = RMSNorm(d, config.rms_norm_eps)
        self.q_proj = nn.Linear(d, d, bias=qkv_bias)
        self.k_proj = nn.Linear(d, kv, bias=qkv_bias)
        self.v_proj = nn.Linear(d, kv, bias=qkv_bias)
        self.attn_out = nn.Linear(d, d, bias=bias)
        self.ff_norm = RMSNorm(d, config.rms_norm_eps)
        self.ff_proj = nn.Linear(d, config.mlp_hidden_size, bias=bias)
        self.up_proj = nn.Linear(d, config.mlp_hidden_size, bias=bias)
        self.ff_out = nn.Linear(config.mlp_hidden_size, d, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                past: KV | None) -> tuple[torch.Tensor, KV]:
        rows, length, _ = x.shape
        h = self.att_norm(x)
        # heads from the projections' widths: under tensor parallel each rank holds whole heads of q and of k/v
        q = self.q_proj(h).view(rows, length, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(rows, length, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(rows, length, -1, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        new = (k, v)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        if k.shape[1] != q.shape[1]:  # grouped-query attention: each k/v head serves a run of q heads
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.attn_out(out.transpose(1, 2).reshape(rows, length, -1))
        h = self.ff_norm(x)
        return x + self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h)), new


class _Transformer(nn.Module):
    def __init__(self, config: LLaDAConfig):
        super().__init__()
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(config.rows, config.d_model),
            "blocks": nn.ModuleList(LLaDABlock(config) for _ in range(config.n_layers)),
            "ln_f": RMSNorm(config.d_model, config.rms_norm_eps),
        })
        if not config.weight_tying:
            self.transformer["ff_out"] = nn.Linear(config.d_model, config.rows, bias=config.include_bias)


class LLaDAModelLM(nn.Module):
    """LLaDA's masked-diffusion LM (checkpoint names `model.transformer.*`, as the released LLaDA-8B folders)."""

    class_names = ("LLaDAModelLM",)
    config_class = LLaDAConfig
    supports_prefix_cache = True  # takes past_key_values / use_cache (composer/text/strategies.py: kv)
    # Tensor parallelism (composer/parallel/tensor.py): whole heads of q and of k/v and a block of the MLP's hidden
    # units per rank ("column"); the attention output and the MLP's down projection sum the ranks' parts ("row")
    tensor_parallel_plan = {
        r"^model\.transformer\.blocks\.\d+\.[qkv]_proj$": "column",
        r"^model\.transformer\.blocks\.\d+\.attn_out$": "row",
        r"^model\.transformer\.blocks\.\d+\.(ff_proj|up_proj)$": "column",
        r"^model\.transformer\.blocks\.\d+\.ff_out$": "row",
    }

    def __init__(self, config: LLaDAConfig):
        super().__init__()
        self.config = config
        self.model = _Transformer(config)
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2).float() / config.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def blocks(self) -> nn.ModuleList:
        return self.model.transformer["blocks"]

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.transformer["wte"]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.transformer["wte"](ids)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.model.transformer["ln_f"](hidden)
        layers = self.model.transformer
        if "ff_out" in layers:
            return layers["ff_out"](hidden)
        return F.linear(hidden, layers["wte"].weight)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.is_meta:  # built on meta and filled from a checkpoint: the buffer is computed, not loaded
            self.inv_freq = 1.0 / (self.config.rope_theta ** (
                torch.arange(0, self.config.head_dim, 2, device=positions.device).float() / self.config.head_dim))
        inv_freq = self.inv_freq.to(positions.device)
        angles = positions.float()[..., None] * inv_freq  # [rows, positions, head_dim / 2]
        angles = torch.cat([angles, angles], dim=-1)[:, None]  # [rows, 1, positions, head_dim]
        return angles.cos(), angles.sin()

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                past_key_values: list[KV] | None = None, use_cache: bool = False) -> LLaDAOutput:
        """Logits [rows, positions, vocab] of `input_ids` (or `inputs_embeds`). `attention_mask` [rows, past +
        positions] marks valid keys (0: padding); `past_key_values`: a prefix's K/V per layer, which the new
        positions attend to as well; `use_cache`: also return the new positions' K/V."""
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        rows, length = x.shape[:2]
        past = past_key_values[0][0].shape[2] if past_key_values else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + length, device=x.device).unsqueeze(0).expand(rows, -1)
        cos, sin = self._rope(position_ids)
        mask = None
        if attention_mask is not None and not bool(attention_mask.all()):
            mask = attention_mask.bool()[:, None, None, :]  # [rows, 1, 1, keys]: every query sees every valid key
        new: list[KV] = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, cos, sin, mask, past_key_values[i] if past_key_values else None)
            if use_cache:
                new.append(kv)
        logits = self.head(x)
        return LLaDAOutput(logits[..., : self.config.vocab_size], new if use_cache else None)


EntryClass = LLaDAModelLM
