"""An independent reference of Self-Forcing's causal inference, for parity tests.

It follows the structure of Self-Forcing's public code (original Wan module names, RoPE applied in
complex float64, float64 sinusoidal timesteps, per-frame modulation, a KV cache that evicts by shifting
entries left, the global torch RNG for noise) and shares no code with composer. Only the frames-per-token
count is computed from the input instead of Self-Forcing's hard-coded 1560.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def sinusoidal_embedding_1d(dim, position):
    half = dim // 2
    position = position.type(torch.float64)
    sinusoid = torch.outer(position, torch.pow(10000, -torch.arange(half).to(position).div(half)))
    return torch.cat([torch.cos(sinusoid), torch.sin(sinusoid)], dim=1)


def rope_params(max_seq_len, dim, theta=10000):
    freqs = torch.outer(
        torch.arange(max_seq_len), 1.0 / torch.pow(theta, torch.arange(0, dim, 2).to(torch.float64).div(dim))
    )
    return torch.polar(torch.ones_like(freqs), freqs)


def causal_rope_apply(x, grid, freqs, start_frame):
    n, c = x.size(2), x.size(3) // 2
    freqs = freqs.split([c - 2 * (c // 3), c // 3, c // 3], dim=1)
    f, h, w = grid
    seq_len = f * h * w
    out = []
    for i in range(x.shape[0]):
        x_i = torch.view_as_complex(x[i, :seq_len].to(torch.float64).reshape(seq_len, n, -1, 2))
        freqs_i = torch.cat([
            freqs[0][start_frame:start_frame + f].view(f, 1, 1, -1).expand(f, h, w, -1),
            freqs[1][:h].view(1, h, 1, -1).expand(f, h, w, -1),
            freqs[2][:w].view(1, 1, w, -1).expand(f, h, w, -1),
        ], dim=-1).reshape(seq_len, 1, -1)
        out.append(torch.view_as_real(x_i * freqs_i).flatten(2))
    return torch.stack(out).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(dim=-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class LayerNorm(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x.float()).type_as(x)


def attention(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


class SelfAttention(nn.Module):
    def __init__(self, dim, num_heads, local_attn_size, sink_size, eps):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.local_attn_size, self.sink_size = local_attn_size, sink_size
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q, self.norm_k = RMSNorm(dim, eps), RMSNorm(dim, eps)

    def forward(self, x, grid, freqs, kv_cache, current_start, frame_seqlen):
        b, s, n, d = *x.shape[:2], self.num_heads, self.head_dim
        q = self.norm_q(self.q(x)).view(b, s, n, d)
        k = self.norm_k(self.k(x)).view(b, s, n, d)
        v = self.v(x).view(b, s, n, d)
        start_frame = current_start // frame_seqlen
        roped_q = causal_rope_apply(q, grid, freqs, start_frame).type_as(v)
        roped_k = causal_rope_apply(k, grid, freqs, start_frame).type_as(v)
        current_end = current_start + roped_q.shape[1]
        sink_tokens = self.sink_size * frame_seqlen
        cache_size = kv_cache["k"].shape[1]
        num_new = roped_q.shape[1]
        max_attention = cache_size
        local_end, global_end = kv_cache["local_end_index"], kv_cache["global_end_index"]
        if self.local_attn_size != -1 and current_end > global_end and num_new + local_end > cache_size:
            evicted = num_new + local_end - cache_size
            rolled = local_end - evicted - sink_tokens
            for key in ("k", "v"):
                kv_cache[key][:, sink_tokens:sink_tokens + rolled] = \
                    kv_cache[key][:, sink_tokens + evicted:sink_tokens + evicted + rolled].clone()
            new_local_end = local_end + current_end - global_end - evicted
        else:
            new_local_end = local_end + current_end - global_end
        local_start = new_local_end - num_new
        kv_cache["k"][:, local_start:new_local_end] = roped_k
        kv_cache["v"][:, local_start:new_local_end] = v
        lo = max(0, new_local_end - max_attention)
        out = attention(roped_q, kv_cache["k"][:, lo:new_local_end], kv_cache["v"][:, lo:new_local_end])
        kv_cache["global_end_index"] = current_end
        kv_cache["local_end_index"] = new_local_end
        return self.o(out.flatten(2))


class CrossAttention(nn.Module):
    def __init__(self, dim, num_heads, eps):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q, self.norm_k = RMSNorm(dim, eps), RMSNorm(dim, eps)

    def forward(self, x, context, cache):
        b, n, d = x.size(0), self.num_heads, self.head_dim
        q = self.norm_q(self.q(x)).view(b, -1, n, d)
        if not cache.get("is_init"):
            cache["k"] = self.norm_k(self.k(context)).view(b, -1, n, d)
            cache["v"] = self.v(context).view(b, -1, n, d)
            cache["is_init"] = True
        return self.o(attention(q, cache["k"], cache["v"]).flatten(2))


class Block(nn.Module):
    def __init__(self, dim, ffn_dim, num_heads, local_attn_size, sink_size, eps=1e-6):
        super().__init__()
        self.norm1 = LayerNorm(dim, eps, elementwise_affine=False)
        self.self_attn = SelfAttention(dim, num_heads, local_attn_size, sink_size, eps)
        self.norm3 = LayerNorm(dim, eps, elementwise_affine=True)
        self.cross_attn = CrossAttention(dim, num_heads, eps)
        self.norm2 = LayerNorm(dim, eps, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(ffn_dim, dim))
        self.modulation = nn.Parameter(torch.zeros(1, 6, dim))

    def forward(self, x, e, grid, freqs, context, kv_cache, crossattn_cache, current_start, frame_seqlen):
        num_frames, fs = e.shape[1], x.shape[1] // e.shape[1]
        e = (self.modulation.unsqueeze(1) + e).chunk(6, dim=2)
        y = self.self_attn(
            (self.norm1(x).unflatten(1, (num_frames, fs)) * (1 + e[1]) + e[0]).flatten(1, 2),
            grid, freqs, kv_cache, current_start, frame_seqlen,
        )
        x = x + (y.unflatten(1, (num_frames, fs)) * e[2]).flatten(1, 2)
        x = x + self.cross_attn(self.norm3(x), context, crossattn_cache)
        y = self.ffn((self.norm2(x).unflatten(1, (num_frames, fs)) * (1 + e[4]) + e[3]).flatten(1, 2))
        return x + (y.unflatten(1, (num_frames, fs)) * e[5]).flatten(1, 2)


class Head(nn.Module):
    def __init__(self, dim, out_dim, patch_size, eps=1e-6):
        super().__init__()
        self.norm = LayerNorm(dim, eps, elementwise_affine=False)
        self.head = nn.Linear(dim, out_dim * math.prod(patch_size))
        self.modulation = nn.Parameter(torch.zeros(1, 2, dim))

    def forward(self, x, e):
        num_frames, fs = e.shape[1], x.shape[1] // e.shape[1]
        e = (self.modulation.unsqueeze(1) + e).chunk(2, dim=2)
        return self.head(self.norm(x).unflatten(1, (num_frames, fs)) * (1 + e[1]) + e[0]).flatten(1, 2)


class CausalWanModel(nn.Module):
    """Original-Wan-named causal model; `load_state_dict` takes a Self-Forcing generator state dict."""

    def __init__(self, dim, ffn_dim, freq_dim, text_dim, num_heads, num_layers, in_dim=16, out_dim=16,
                 patch_size=(1, 2, 2), local_attn_size=-1, sink_size=0, text_len=512):
        super().__init__()
        self.dim, self.freq_dim, self.num_heads, self.out_dim = dim, freq_dim, num_heads, out_dim
        self.patch_size, self.text_len = patch_size, text_len
        self.local_attn_size = local_attn_size
        self.patch_embedding = nn.Conv3d(in_dim, dim, kernel_size=patch_size, stride=patch_size)
        self.text_embedding = nn.Sequential(nn.Linear(text_dim, dim), nn.GELU(approximate="tanh"), nn.Linear(dim, dim))
        self.time_embedding = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, dim * 6))
        self.blocks = nn.ModuleList(
            [Block(dim, ffn_dim, num_heads, local_attn_size, sink_size) for _ in range(num_layers)]
        )
        self.head = Head(dim, out_dim, patch_size)
        d = dim // num_heads
        self.freqs = torch.cat(
            [rope_params(1024, d - 4 * (d // 6)), rope_params(1024, 2 * (d // 6)), rope_params(1024, 2 * (d // 6))],
            dim=1,
        )

    def forward(self, x, t, context, kv_cache, crossattn_cache, current_start):
        """x [B, C, F, H, W], t [B, F] (or [B, 1]), context [B, L, text_dim]."""
        x = self.patch_embedding(x)
        grid = tuple(x.shape[2:])
        frame_seqlen = grid[1] * grid[2]
        x = x.flatten(2).transpose(1, 2)
        e = self.time_embedding(sinusoidal_embedding_1d(self.freq_dim, t.flatten()).type_as(x))
        e0 = self.time_projection(e).unflatten(1, (6, self.dim)).unflatten(dim=0, sizes=t.shape)
        context = self.text_embedding(context)
        for i, block in enumerate(self.blocks):
            x = block(x, e0, grid, self.freqs, context, kv_cache[i], crossattn_cache[i], current_start, frame_seqlen)
        x = self.head(x, e.unflatten(dim=0, sizes=t.shape).unsqueeze(2))
        c = self.out_dim
        out = []
        for u in x:
            u = u[:math.prod(grid)].view(*grid, *self.patch_size, c)
            u = torch.einsum("fhwpqrc->cfphqwr", u)
            out.append(u.reshape(c, *[i * j for i, j in zip(grid, self.patch_size)]))
        return torch.stack(out)


class FlowMatchScheduler:
    def __init__(self, shift=5.0, num_train_timesteps=1000):
        self.num_train_timesteps = num_train_timesteps
        sigmas = torch.linspace(1.0, 0.0, num_train_timesteps + 1)[:-1]
        self.sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
        self.timesteps = self.sigmas * num_train_timesteps

    def add_noise(self, original_samples, noise, timestep):
        timestep_id = torch.argmin((self.timesteps.unsqueeze(0) - timestep.unsqueeze(1)).abs(), dim=1)
        sigma = self.sigmas[timestep_id].reshape(-1, 1, 1, 1)
        return ((1 - sigma) * original_samples + sigma * noise).type_as(noise)

    def flow_to_x0(self, flow_pred, xt, timestep):
        original_dtype = flow_pred.dtype
        flow_pred, xt, sigmas, timesteps = (u.double() for u in (flow_pred, xt, self.sigmas, self.timesteps))
        timestep_id = torch.argmin((timesteps.unsqueeze(0) - timestep.unsqueeze(1)).abs(), dim=1)
        return (xt - sigmas[timestep_id].reshape(-1, 1, 1, 1) * flow_pred).to(original_dtype)


def inference(model, prompt_embeds, noise, num_frame_per_block=3, denoising_step_list=(1000, 750, 500, 250),
              warp=True, shift=5.0, context_noise=0, initial_latent=None):
    """Self-Forcing's CausalInferencePipeline.inference, noise [B, F, C, h, w] -> latents [B, F(+input), C, h, w].

    Noise during the steps comes from the global RNG (seed it with torch.manual_seed before drawing `noise`).
    """
    scheduler = FlowMatchScheduler(shift)
    steps = torch.tensor(denoising_step_list, dtype=torch.long)
    if warp:
        timesteps = torch.cat((scheduler.timesteps, torch.tensor([0], dtype=torch.float32)))
        steps = timesteps[1000 - steps]
    batch_size, num_frames, num_channels, height, width = noise.shape
    num_input = initial_latent.shape[1] if initial_latent is not None else 0
    frame_seqlen = (height // model.patch_size[1]) * (width // model.patch_size[2])
    total = num_frames + num_input
    cache_frames = total if model.local_attn_size == -1 else model.local_attn_size
    d = model.dim // model.num_heads
    kv_cache = [
        {"k": torch.zeros(batch_size, cache_frames * frame_seqlen, model.num_heads, d),
         "v": torch.zeros(batch_size, cache_frames * frame_seqlen, model.num_heads, d),
         "global_end_index": 0, "local_end_index": 0}
        for _ in model.blocks
    ]
    cross_cache = [{"is_init": False} for _ in model.blocks]

    def generator(x, t, start):  # Self-Forcing's WanDiffusionWrapper: flow -> x0, [B, F, C, h, w] layout
        flow = model(x.permute(0, 2, 1, 3, 4), t, prompt_embeds, kv_cache, cross_cache, start * frame_seqlen)
        flow = flow.permute(0, 2, 1, 3, 4)
        return scheduler.flow_to_x0(flow.flatten(0, 1), x.flatten(0, 1), t.flatten(0, 1)).unflatten(0, flow.shape[:2])

    output = torch.zeros(batch_size, total, num_channels, height, width)
    current = 0
    if initial_latent is not None:
        t0 = torch.zeros(batch_size, 1)
        for _ in range(math.ceil(num_input / num_frame_per_block)):
            ref = initial_latent[:, current:current + num_frame_per_block]
            output[:, current:current + ref.shape[1]] = ref
            generator(ref, t0.expand(-1, 1) * context_noise, current)
            current += ref.shape[1]
    for _ in range(num_frames // num_frame_per_block):
        n = num_frame_per_block
        noisy = noise[:, current - num_input:current + n - num_input]
        for index, step in enumerate(steps):
            timestep = torch.ones(batch_size, n, dtype=torch.int64) * step
            denoised = generator(noisy, timestep, current)
            if index < len(steps) - 1:
                nxt = steps[index + 1]
                noisy = scheduler.add_noise(
                    denoised.flatten(0, 1), torch.randn_like(denoised.flatten(0, 1)),
                    nxt * torch.ones(batch_size * n, dtype=torch.long),
                ).unflatten(0, denoised.shape[:2])
        output[:, current:current + n] = denoised
        generator(denoised, torch.ones_like(timestep) * context_noise, current)
        current += n
    return output
