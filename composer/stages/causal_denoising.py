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

Every model pass goes through the pipeline's DenoisingEngine: each block's steps are one `engine.run` with the
`FewStepFlow` step rule, and the prefill and clean passes are engine calls of kind "context".

Classifier-free guidance (guidance_scale > 1; Self-Forcing's distilled models run without it): the prompt and
the negative prompt are two branches. Batched (the engine's default) they run as one doubled batch, rows
[cond; uncond], over one KV cache of twice the batch; sequential, each branch has its own cache. The flow is
uncond + g (cond - uncond) and both branches continue from the same guided clean frames. The noise draws stay
those of the unguided batch, so a seed keeps its meaning.

Long videos and prompt switches: a segment (prompt, num_blocks) may span several rollouts of
`rollout_blocks` blocks. Each new rollout, and each new prompt, starts a fresh cache (frame positions
restart at 0) prefilled at `context_noise` with the last `overlap_frames` latent frames generated so far,
in chunks of one block; a new prompt also gets new cross-attention keys/values. The first rollout is
prefilled with the request's start latents (image-to-video / video extension), if any. A live segment
source may end its current segment early (`CausalPlan.ends_segment`): the next segment (a new prompt) then
starts from the next block, and the blocks made before it are those of the unswitched video.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from composer.batch import ForwardBatch, LatentBlock, RequestStats
from composer.cache import KVCache, KVCacheSpec
from composer.configs.causal_wan import CausalWanConfig
from composer.engine import ClassifierFreeGuidance, DenoisingEngine, FewStepFlow, ModelInputs
from composer.errors import InvalidInputError
from composer.models.wan.causal import block_causal_mask
from composer.schedulers import FlowMatchTable
from composer.stages.base import Stage
from composer.stages.validators import V, VerificationResult


@dataclass
class CausalPlan:
    """What a causal request asks for beyond ForwardBatch's common fields (CausalWanPipeline.prepare)."""

    segments: Iterable[tuple[str, int]]  # (prompt, num_blocks) pairs, read lazily (interactive prompts)
    rollout_blocks: int | None = None  # blocks per rollout (None: one rollout per segment)
    overlap_frames: int = 3  # latent frames carried into the next rollout / prompt
    use_kv_cache: bool = True  # off: the uncached block-causal recompute (the reference)
    keep_video: bool = True  # off: keep only the latent frames the next rollout needs (endless streams)
    # A live source's cut (stream_video sets it from the source's `ends_segment`): asked before each block of a
    # segment after the segment's first, with that block's index; True ends the segment there and the next
    # segment is read. The blocks already made stay those of the unswitched video (composer serve's streams).
    ends_segment: Callable[[int], bool] | None = None


@dataclass
class CausalStats(RequestStats):
    """Profile of a causal generation (filled as blocks finish)."""

    block_seconds: list[float] = field(default_factory=list)
    prefill_seconds: float = 0.0
    kv_cache_bytes: int = 0
    rollouts: int = 0

    def summary(self) -> str:
        blocks = self.block_seconds
        parts = [f"{len(blocks)} blocks"]
        if blocks:
            parts.append(f"block latency mean {sum(blocks) / len(blocks) * 1000:.0f} ms "
                         f"(first {blocks[0] * 1000:.0f} ms, last {blocks[-1] * 1000:.0f} ms)")
        common = super().summary()
        if common:
            parts.append(common)
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
    """Runs every block of every segment; `stream` yields them as they finish."""

    concurrent = True  # transformer calls go through the engine's step scheduler

    def __init__(
        self,
        engine: DenoisingEngine,
        encode_prompts: Callable[[list[str]], torch.Tensor],
        config: CausalWanConfig,
        spatial_factor: int,
        kv_cache_offload: bool = False,
        progress: bool = True,
    ):
        self.engine = engine
        self.spatial_factor = spatial_factor  # the VAE's: latent height = height // spatial_factor
        self.encode_prompts = encode_prompts
        self.config = config
        self.kv_cache_offload = kv_cache_offload
        self.progress = progress
        self.table = FlowMatchTable(config.timestep_shift, config.num_train_timesteps)
        self.steps = self.table.step_list(config.denoising_step_list, config.warp_denoising_step)

    @property
    def transformer(self):
        return self.engine.transformer

    def modules(self) -> list[torch.nn.Module]:
        """The transformer, and the text encoder this stage encodes each new segment's prompt with."""
        encoder_stage = getattr(self.encode_prompts, "__self__", None)
        extra = encoder_stage.modules() if isinstance(encoder_stage, Stage) else []
        return [*super().modules(), *extra]

    @property
    def window(self) -> tuple[int | None, int]:
        local = self.config.local_attn_size
        return (None if local == -1 else local), self.config.sink_size

    def verify_input(self, batch: ForwardBatch, result: VerificationResult) -> None:
        result.add_check("generator", batch.generator, V.not_none)
        result.add_check("causal plan (CausalPlan)", batch.get(CausalPlan, None), V.not_none)
        if batch.start_latents is not None:
            result.add_check("start_latents", batch.start_latents, V.ndim(5))
        if batch.do_classifier_free_guidance:
            result.add_check("negative_prompt_embeds", batch.negative_prompt_embeds, V.ndim(3))

    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        # Streaming callers report each block themselves; the whole-video path gets a progress bar.
        with tqdm(desc="blocks", unit="block", disable=not self.progress, leave=False) as bar:
            for _ in self.stream(batch, None):
                bar.update()
        return batch

    # -- the sampler ---------------------------------------------------------------------------------
    def _new_caches(self, batch_size: int, branches: int, capacity: int, tokens_per_frame: int,
                    ) -> list[KVCache | None]:
        """One cache per guidance branch; batched branches share one cache holding all their rows."""
        cfg = self.transformer.config
        window, sink = self.window
        heads, tokens = cfg.num_attention_heads, tokens_per_frame
        if hasattr(self.transformer, "kv_cache_layout"):  # split over ranks: this rank's heads / tokens
            heads, tokens = self.transformer.kv_cache_layout(tokens_per_frame)

        def cache(rows: int) -> KVCache:
            spec = KVCacheSpec(
                num_layers=cfg.num_layers, batch_size=rows, num_heads=heads,
                head_dim=cfg.attention_head_dim, tokens_per_frame=tokens, capacity_frames=capacity,
                window_frames=window, sink_frames=sink,
            )
            return KVCache(spec, self.transformer.dtype, self.transformer.device, offload=self.kv_cache_offload)

        if branches > 1 and self.engine.batched_cfg:
            return [cache(batch_size * branches)] * branches
        # CFG parallel: a rank keeps the cache of its own branch only
        return [cache(batch_size) if self.engine.owns_branch(i) else None for i in range(branches)]

    def _chunks(self, start: int, end: int) -> list[tuple[int, int]]:
        n = self.config.num_frames_per_block
        return [(s, min(s + n, end)) for s in range(start, end, n)]

    def _timesteps(self, value: float, batch_size: int, frames: int) -> torch.Tensor:
        return torch.full((batch_size, frames), float(value), device=self.transformer.device)

    @torch.inference_mode()  # also around each resumption of this generator
    def stream(self, batch: ForwardBatch, upstream: Iterator | None = None) -> Iterator[LatentBlock]:
        """Generate block by block, yielding each finished block. Sets batch.stats (CausalStats) at once and, at
        the end, batch.latents: every latent frame (start frames included), or with keep_video off only the
        newest `overlap_frames`."""
        model, cfg, engine = self.transformer, self.config, self.engine
        plan = batch.get(CausalPlan)
        dtype, device = model.dtype, model.device
        bsz = batch.batch_size
        channels = model.config.in_channels
        h, w = batch.height // self.spatial_factor, batch.width // self.spatial_factor
        tpf = model.tokens_per_frame(h, w)
        guidance = None
        uncond_text = None
        if batch.do_classifier_free_guidance:
            guidance = ClassifierFreeGuidance(float(batch.guidance_scale), fp32=True)
            uncond_text = engine.text_inputs(batch.negative_prompt_embeds.to(device, dtype))
        branches = 2 if guidance is not None else 1
        n = cfg.num_frames_per_block
        overlap = plan.overlap_frames
        stats = batch.stats = CausalStats()

        # Clean latent chunks [B, C, f, h, w] on the device, fp32: the whole video, or (keep_video off, for
        # endless streams) only the newest `overlap` frames the next rollout starts from.
        video: list[torch.Tensor] = []
        frames_done = 0
        if batch.start_latents is not None:
            video.append(batch.start_latents.to(device, torch.float32))
            frames_done = batch.start_latents.shape[2]
        block_index = 0
        first_rollout = True
        for segment, (prompt, num_blocks) in enumerate(checked_segments(plan.segments)):
            texts = [engine.text_inputs(self.encode_prompts([prompt] * bsz).to(device, dtype))]
            if uncond_text is not None:
                texts.append(uncond_text)
            segment_start = block_index
            remaining = num_blocks
            while remaining > 0 and not self._cut(plan, segment_start, block_index):
                blocks = min(remaining, plan.rollout_blocks or remaining)
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
                caches = self._new_caches(bsz, branches, prefix + blocks * n, tpf) if plan.use_kv_cache else None
                stats.rollouts += 1
                if caches is not None:
                    held = {id(c): c for c in caches if c is not None}.values()
                    stats.kv_cache_bytes = max(stats.kv_cache_bytes, sum(c.nbytes for c in held))

                start = time.perf_counter()
                if caches is not None and context is not None:
                    for s, e in self._chunks(0, prefix):
                        engine.forward_branches(
                            context[:, :, s:e], self._timesteps(cfg.context_noise, bsz, e - s),
                            _cached(texts, caches, s), kind="context",
                        )
                _sync(device)
                stats.prefill_seconds += time.perf_counter() - start

                noise = torch.randn((bsz, blocks * n, channels, h, w), generator=batch.generator)
                noise = noise.permute(0, 2, 1, 3, 4).to(device)  # [B, C, F, h, w]
                # the recompute path re-reads the rollout's clean frames; the cached path has them as keys
                rollout_clean = [] if context is None or caches is not None else [context]
                for b in range(blocks):
                    if b > 0 and self._cut(plan, segment_start, block_index):
                        remaining = 0  # the rest of this rollout's noise goes unused
                        break
                    start = time.perf_counter()
                    s = prefix + b * n
                    x = noise[:, :, b * n:(b + 1) * n]
                    if caches is not None:
                        inputs = _cached(texts, caches, s)
                    else:
                        inputs = self._recompute_inputs(texts, rollout_clean, prefix, n, tpf, device)
                    steps = FewStepFlow(self.table, self.steps.tolist(), batch.generator)
                    with self._block_in_loop():  # concurrent streams wait for this block's passes, not its decode
                        x0 = engine.run(x, steps, inputs[0], inputs[1] if guidance else None, guidance,
                                        run=block_index)
                        if caches is not None:  # the clean pass leaves the block's keys/values in the cache
                            engine.forward_branches(x0, self._timesteps(cfg.context_noise, bsz, n), inputs,
                                                    kind="context")
                    x0 = x0.float()
                    if caches is None:
                        rollout_clean.append(x0)
                    video.append(x0)
                    if not plan.keep_video:
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

    def _block_in_loop(self):
        """While a block's passes run, the step scheduler counts this request as denoising (so the others' next
        call waits for its units too); between blocks (its decode, its reader) it does not."""
        from contextlib import nullcontext

        from composer.engine.scheduler import current_request

        scheduler, request = self.engine.scheduler, current_request()
        if scheduler is None or request is None:
            return nullcontext()
        return scheduler.denoising(request)

    @staticmethod
    def _cut(plan: CausalPlan, segment_start: int, block_index: int) -> bool:
        """Whether a live source ends the current segment before `block_index` (never before its first block)."""
        return plan.ends_segment is not None and block_index > segment_start and bool(plan.ends_segment(block_index))

    def _recompute_inputs(self, texts: list[ModelInputs], rollout_clean: list[torch.Tensor], prefill_frames: int,
                          n: int, tpf: int, device: torch.device) -> list[ModelInputs]:
        """Uncached reference: every frame of the rollout so far as clean context before the block, through a
        block-causal mask whose chunks are the cached path's passes (the prefill in blocks, then each block)."""
        context = torch.cat(rollout_clean, dim=2) if rollout_clean else None
        prefix = 0 if context is None else context.shape[2]
        chunks = self._chunks(0, prefill_frames) + self._chunks(prefill_frames, prefix + n)
        window, sink = self.window
        mask = block_causal_mask(chunks, tpf, window, sink, device)
        context_t = self._timesteps(self.config.context_noise, context.shape[0], prefix) if context is not None else None
        return [t.at(0, attn_mask=mask, context=context, context_timestep=context_t) for t in texts]


def _cached(texts: list[ModelInputs], caches: list[KVCache], start_frame: int) -> list[ModelInputs]:
    """Each branch's inputs for a cached pass starting at `start_frame`."""
    return [t.at(start_frame, kv_cache=c) for t, c in zip(texts, caches)]


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
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            raise InvalidInputError(f"segment '{prompt}': num_blocks must be an integer >= 1, got {num_blocks!r}")
        yield prompt, num_blocks
