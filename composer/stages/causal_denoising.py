"""CausalDenoisingStage: block-autoregressive sampling with a KV cache (Self-Forcing / CausVid semantics).

For each block of `num_frames_per_block` latent frames:
  start from the block's slice of the rollout's noise; for each timestep of the few-step list:
    v = model(x_t), x0 = x_t - sigma(t) v (float64); unless last: x = (1 - sigma') x0 + sigma' eps
  then run the model once more on the clean x0 at timestep `context_noise`, which leaves the block's
  keys/values in the cache for the blocks after it.

Noise order (Self-Forcing's, so a seed gives the noise a CPU fp32 run of Self-Forcing draws; its own scripts
draw on the GPU in bf16, which gives other values): one seeded CPU generator; at the start of a rollout the
whole rollout's noise [B, F, C, h, w]; then for each block and each non-final step one draw of
[B * frames_in_block, C, h, w].

Classifier-free guidance (guidance_scale > 1; Self-Forcing's distilled models run without it): every model pass
runs the prompt and the negative prompt as one doubled batch, rows [cond; uncond], over one KV cache of twice
the batch; the flow is uncond + g (cond - uncond) and both halves continue from the same guided clean
frames. The noise draws stay those of the unguided batch, so a seed keeps its meaning.

Long videos and prompt switches: a segment (prompt, num_blocks) may span several rollouts of
`rollout_blocks` blocks. Each new rollout, and each new prompt, starts a fresh cache (frame positions
restart at 0) prefilled at `context_noise` with the last `overlap_frames` latent frames generated so far,
in chunks of one block; a new prompt also gets new cross-attention keys/values. The first rollout is
prefilled with the request's start latents (image-to-video / video extension), if any.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from composer.batch import ForwardBatch
from composer.cache import KVCache, KVCacheSpec
from composer.configs.causal_wan import CausalWanConfig
from composer.errors import InvalidInputError
from composer.models.wan.causal import CausalWanTransformer3DModel
from composer.schedulers import FlowMatchTable
from composer.stages.base import Stage
from composer.stages.validators import V, VerificationResult

# Keys this stage reads from ForwardBatch.extra.
SEGMENTS = "segments"  # iterable of (prompt, num_blocks); read lazily (interactive prompts)
ROLLOUT_BLOCKS = "rollout_blocks"  # int | None
OVERLAP_FRAMES = "overlap_frames"  # int
USE_KV_CACHE = "kv_cache"  # bool
KEEP_VIDEO = "keep_video"  # bool: keep every latent frame (off: only what the next rollout needs)
STATS = "causal_stats"  # written: CausalStats


@dataclass
class LatentBlock:
    """One finished block: clean latents [B, C, n, h, w] (fp32) and where it sits in the video."""

    index: int
    segment: int
    prompt: str
    start_frame: int  # latent frame index in the whole video
    latents: torch.Tensor
    seconds: float


@dataclass
class CausalStats:
    """Profile of a causal generation (filled as blocks finish)."""

    block_seconds: list[float] = field(default_factory=list)
    prefill_seconds: float = 0.0
    kv_cache_bytes: int = 0
    rollouts: int = 0
    time_to_first_frame: float | None = None  # set by the streaming pipeline
    total_seconds: float | None = None
    frames: int = 0  # decoded frames

    @property
    def frames_per_second(self) -> float | None:
        if not self.total_seconds or not self.frames:
            return None
        return self.frames / self.total_seconds

    def summary(self) -> str:
        blocks = self.block_seconds
        parts = [f"{len(blocks)} blocks"]
        if blocks:
            parts.append(f"block latency mean {sum(blocks) / len(blocks) * 1000:.0f} ms "
                         f"(first {blocks[0] * 1000:.0f} ms, last {blocks[-1] * 1000:.0f} ms)")
        if self.time_to_first_frame is not None:
            parts.append(f"time to first frame {self.time_to_first_frame:.2f} s")
        if self.frames_per_second is not None:
            parts.append(f"{self.frames_per_second:.1f} frames/s ({self.frames} frames)")
        parts.append(f"KV cache {format_bytes(self.kv_cache_bytes)}")
        if self.rollouts > 1:
            parts.append(f"{self.rollouts} rollouts")
        return ", ".join(parts)


def format_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class CausalDenoisingStage(Stage):
    """Runs every block of every segment; `iter_blocks` yields them as they finish (for streaming)."""

    def __init__(
        self,
        transformer: CausalWanTransformer3DModel,
        encode_prompts: Callable[[list[str]], torch.Tensor],
        config: CausalWanConfig,
        spatial_factor: int,
        kv_cache_offload: bool = False,
        progress: bool = True,
    ):
        self.transformer = transformer
        self.spatial_factor = spatial_factor  # the VAE's: latent height = height // spatial_factor
        self.encode_prompts = encode_prompts
        self.config = config
        self.kv_cache_offload = kv_cache_offload
        self.progress = progress
        self.table = FlowMatchTable(config.timestep_shift, config.num_train_timesteps)
        self.steps = self.table.step_list(config.denoising_step_list, config.warp_denoising_step)

    @property
    def window(self) -> tuple[int | None, int]:
        local = self.config.local_attn_size
        return (None if local == -1 else local), self.config.sink_size

    def verify_input(self, batch: ForwardBatch, result: VerificationResult) -> None:
        result.add_check("generator", batch.generator, V.not_none)
        result.add_check(f"extra['{SEGMENTS}']", batch.extra.get(SEGMENTS), V.not_none)
        if batch.start_latents is not None:
            result.add_check("start_latents", batch.start_latents, V.ndim(5))
        if batch.do_classifier_free_guidance:
            result.add_check("negative_prompt_embeds", batch.negative_prompt_embeds, V.ndim(3))

    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        # Streaming callers report each block themselves; the whole-video path gets a progress bar.
        with tqdm(desc="blocks", unit="block", disable=not self.progress, leave=False) as bar:
            for _ in self.iter_blocks(batch):
                bar.update()
        return batch

    # -- the sampler ---------------------------------------------------------------------------------
    def _new_cache(self, batch_size: int, capacity: int, tokens_per_frame: int) -> KVCache:
        cfg = self.transformer.config
        window, sink = self.window
        spec = KVCacheSpec(
            num_layers=cfg.num_layers, batch_size=batch_size, num_heads=cfg.num_attention_heads,
            head_dim=cfg.attention_head_dim, tokens_per_frame=tokens_per_frame, capacity_frames=capacity,
            window_frames=window, sink_frames=sink,
        )
        return KVCache(spec, self.transformer.dtype, self.transformer.device, offload=self.kv_cache_offload)

    def _chunks(self, start: int, end: int) -> list[tuple[int, int]]:
        n = self.config.num_frames_per_block
        return [(s, min(s + n, end)) for s in range(start, end, n)]

    def _timesteps(self, value: float, batch_size: int, frames: int) -> torch.Tensor:
        return torch.full((batch_size, frames), float(value), device=self.transformer.device)

    @torch.inference_mode()  # also around each resumption of this generator
    def iter_blocks(self, batch: ForwardBatch) -> Iterator[LatentBlock]:
        """Generate block by block, yielding each finished block. Sets extra[STATS] at once and, at the end,
        batch.latents: every latent frame (start frames included), or with keep_video off only the newest
        `overlap_frames`."""
        model, cfg = self.transformer, self.config
        dtype, device = model.dtype, model.device
        bsz = batch.batch_size
        channels = model.config.in_channels
        h, w = batch.height // self.spatial_factor, batch.width // self.spatial_factor
        tpf = model.tokens_per_frame(h, w)
        guidance = float(batch.guidance_scale) if batch.do_classifier_free_guidance else None
        rows = 2 * bsz if guidance is not None else bsz  # model batch: [cond; uncond] with CFG
        negative = batch.negative_prompt_embeds.to(device, dtype) if guidance is not None else None
        n = cfg.num_frames_per_block
        use_cache = batch.extra.get(USE_KV_CACHE, True)
        rollout_blocks = batch.extra.get(ROLLOUT_BLOCKS)
        overlap = batch.extra.get(OVERLAP_FRAMES, n)
        keep_video = batch.extra.get(KEEP_VIDEO, True)
        stats = batch.extra[STATS] = CausalStats()

        # Clean latent chunks [B, C, f, h, w] on the device, fp32: the whole video, or (keep_video off, for
        # endless streams) only the newest `overlap` frames the next rollout starts from.
        video: list[torch.Tensor] = []
        frames_done = 0
        if batch.start_latents is not None:
            video.append(batch.start_latents.to(device, torch.float32))
            frames_done = batch.start_latents.shape[2]
        block_index = 0
        first_rollout = True
        for segment, (prompt, num_blocks) in enumerate(checked_segments(batch.extra[SEGMENTS])):
            context_embeds = self.encode_prompts([prompt] * bsz).to(device, dtype)
            if negative is not None:
                context_embeds = torch.cat([context_embeds, negative])
            cross_kv = model.cross_attention_kv(context_embeds)
            remaining = num_blocks
            while remaining > 0:
                blocks = min(remaining, rollout_blocks or remaining)
                remaining -= blocks
                # Rollout context: the start latents (first rollout) or the newest `overlap` frames.
                so_far = torch.cat(video, dim=2) if video else None
                if so_far is None:
                    context = None
                elif first_rollout:
                    context = so_far
                else:
                    context = so_far[:, :, max(0, so_far.shape[2] - overlap):] if overlap > 0 else None
                first_rollout = False
                prefix = 0 if context is None else context.shape[2]
                cache = self._new_cache(rows, prefix + blocks * n, tpf) if use_cache else None
                stats.rollouts += 1
                stats.kv_cache_bytes = max(stats.kv_cache_bytes, cache.nbytes if cache else 0)

                start = time.perf_counter()
                if cache is not None and context is not None:
                    for s, e in self._chunks(0, prefix):
                        model.forward_cached(
                            _rows(context[:, :, s:e], rows).to(dtype), self._timesteps(cfg.context_noise, rows, e - s),
                            cross_kv, cache, s,
                        )
                _sync(device)
                stats.prefill_seconds += time.perf_counter() - start

                noise = torch.randn((bsz, blocks * n, channels, h, w), generator=batch.generator)
                noise = noise.permute(0, 2, 1, 3, 4).to(device)  # [B, C, F, h, w]
                # the recompute path re-reads the rollout's clean frames; the cached path has them as keys
                rollout_clean = [] if context is None or use_cache else [context]
                for b in range(blocks):
                    start = time.perf_counter()
                    s = prefix + b * n
                    x = noise[:, :, b * n:(b + 1) * n]
                    x0 = self._denoise_block(x, s, cross_kv, cache, rollout_clean, prefix, batch.generator, guidance)
                    if cache is not None:
                        model.forward_cached(
                            _rows(x0, rows).to(dtype), self._timesteps(cfg.context_noise, rows, n), cross_kv, cache, s
                        )
                    x0 = x0.float()
                    if not use_cache:
                        rollout_clean.append(x0)
                    video.append(x0)
                    if not keep_video:
                        video = _newest_frames(video, overlap)
                    _sync(device)
                    elapsed = time.perf_counter() - start
                    stats.block_seconds.append(elapsed)
                    yield LatentBlock(block_index, segment, prompt, frames_done, x0, elapsed)
                    frames_done += n
                    block_index += 1
        if block_index == 0 and batch.start_latents is None:
            raise InvalidInputError("nothing to generate: every segment has 0 blocks")
        batch.latents = torch.cat(video, dim=2) if video else None

    def _denoise_block(
        self,
        x: torch.Tensor,
        start_frame: int,
        cross_kv,
        cache: KVCache | None,
        rollout_clean: list[torch.Tensor],
        prefill_frames: int,
        generator: torch.Generator,
        guidance: float | None = None,
    ) -> torch.Tensor:
        """The few-step loop for one block; returns its clean x0 (in the model's output dtype; fp32 with CFG)."""
        model = self.transformer
        dtype = model.dtype
        bsz, channels, n, h, w = x.shape
        rows = 2 * bsz if guidance is not None else bsz
        steps = self.steps.tolist()
        x0 = x
        for i, t in enumerate(steps):
            timestep = self._timesteps(t, rows, n)
            if cache is not None:
                flow = model.forward_cached(_rows(x, rows).to(dtype), timestep, cross_kv, cache, start_frame)
            else:
                clean = [_rows(c, rows) for c in rollout_clean]
                flow = self._recompute(_rows(x, rows), timestep, cross_kv, clean, prefill_frames)
            if guidance is not None:
                cond, uncond = flow.float().chunk(2)
                flow = uncond + guidance * (cond - uncond)
            x0 = self.table.to_x0(flow, x, t)
            if i < len(steps) - 1:
                eps = torch.randn((bsz * n, channels, h, w), generator=generator)
                eps = eps.unflatten(0, (bsz, n)).permute(0, 2, 1, 3, 4).to(x.device)
                x = self.table.add_noise(x0, eps, steps[i + 1])
        return x0

    def _recompute(self, x, timestep, cross_kv, rollout_clean: list[torch.Tensor], prefill_frames: int):
        """Uncached reference: every frame of the rollout so far through a block-causal mask whose chunks are
        the cached path's passes (the prefill in blocks, then each generated block)."""
        model, cfg = self.transformer, self.config
        context = torch.cat(rollout_clean, dim=2) if rollout_clean else x[:, :, :0]
        prefix = context.shape[2]
        frames = torch.cat([context, x], dim=2).to(model.dtype)
        times = torch.cat([self._timesteps(cfg.context_noise, x.shape[0], prefix), timestep], dim=1)
        chunks = self._chunks(0, prefill_frames) + self._chunks(prefill_frames, prefix + x.shape[2])
        window, sink = self.window
        out = model.forward_masked(frames, times, cross_kv, chunks, window, sink)
        return out[:, :, prefix:]


def _rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [B, ...] as the model batch of `rows` rows: itself, or [x; x] for CFG's cond and uncond halves."""
    return x if x.shape[0] == rows else torch.cat([x] * (rows // x.shape[0]))


def _newest_frames(chunks: list[torch.Tensor], count: int) -> list[torch.Tensor]:
    """The last `count` latent frames of a list of [B, C, f, h, w] chunks (as one chunk)."""
    if count <= 0:
        return []
    tail = torch.cat(chunks, dim=2)
    return [tail[:, :, max(0, tail.shape[2] - count):]]


def checked_segments(segments: Iterable[tuple[str, int]]) -> Iterator[tuple[str, int]]:
    """The segments, each checked as it is read (a lazy source stays lazy)."""
    for item in segments:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise InvalidInputError(f"a segment is a (prompt, num_blocks) pair, got {item!r}")
        prompt, num_blocks = item
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidInputError(f"segment prompt must be a non-empty string, got {prompt!r}")
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0:
            raise InvalidInputError(f"segment '{prompt}': num_blocks must be an integer >= 0, got {num_blocks!r}")
        yield prompt, num_blocks
