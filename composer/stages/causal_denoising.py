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
from typing import Any

import torch

from composer.batch import ForwardBatch, LatentBlock, RequestStats
from composer.cache import KVCache, KVCacheSpec
from composer.cache.kv_pool import KVPool, PagedKVCache
from composer.engine import ClassifierFreeGuidance, DenoisingEngine, FewStepFlow, ModelInputs
from composer.engine.loop import Blocking, ModelStep, admitted, drive, is_wait, wait_for
from composer.engine.scheduler import current_request
from composer.errors import InvalidInputError
from composer.logging import progress_bar
from composer.models.wan.causal import block_causal_mask
from composer.platform import platform_for
from composer.schedulers import FlowMatchTable
from composer.stages.base import Stage, drives_task
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
    switch: str = "restart"  # at a prompt switch: restart | keep | recache (SWITCH_MODES)


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


SWITCH_MODES = ("restart", "keep", "recache")


def switch_problem(switch: object, kv_cache: bool = True) -> str | None:
    """What is wrong with a prompt_switch value (None: nothing). 'keep' needs the KV cache: the uncached path
    recomputes every frame of the rollout under the one prompt in use, so its old frames cannot keep the old
    prompt's cross-attention (there is no uncached reference for it)."""
    if switch not in SWITCH_MODES:
        return f"one of {', '.join(SWITCH_MODES)}"
    if switch == "keep" and not kv_cache:
        return ("'restart' or 'recache' when kv_cache is off ('keep' carries the cached keys/values of the old "
                "prompt, and the uncached path has none)")
    return None


def visible_frames(end: int, window: int | None, sink: int) -> list[int]:
    """The frames (of a rollout, in order) that a pass ending at frame `end` attends to."""
    if window is None:
        return list(range(end))
    return sorted(set(range(min(end, sink))) | set(range(max(sink, end - (window - sink)), end)))


@dataclass(eq=False)
class Rollout:
    """One KV cache's lifetime: its frames (video latent frame of each cache frame, in cache order), the noise
    of its blocks, how many are left."""

    caches: list[KVCache | None] | None  # per guidance branch (batched branches share one); None: recompute
    frames: list[int]
    blocks: int
    left: int
    prefix: int  # context frames prefilled before the first block
    noise: torch.Tensor  # [B, C, blocks * n, h, w]
    clean: list[torch.Tensor] = field(default_factory=list)  # the uncached path's clean frames

    def visible_frames(self, stage: CausalDenoisingStage) -> list[int]:
        """The video frames the cache attends to now (what a 'recache' switch recomputes)."""
        window, sink = stage.window
        return [self.frames[i] for i in visible_frames(len(self.frames), window, sink)]

    def close(self) -> None:
        """Give its KV pages back (its frames stay known: a 'recache' switch recomputes them)."""
        for cache in _unique(self.caches or []):
            if cache is not None and hasattr(cache, "close"):
                cache.close()
        self.caches = None


@dataclass(eq=False)
class CausalState:
    """Where a causal request stands between blocks: everything its next block needs. Sessions suspend it
    between `extend`s and fork or snapshot it (composer/session.py)."""

    generator: torch.Generator
    video: list[torch.Tensor] = field(default_factory=list)  # clean latent chunks [B, C, f, h, w], fp32
    video_start: int = 0  # video latent frame of video[0]'s first frame (keep_video off forgets older ones)
    pinned: dict[int, torch.Tensor] = field(default_factory=dict)  # older frames a recache still needs (sinks)
    frames_done: int = 0
    block_index: int = 0
    segment: int = -1
    prompt: str | None = None
    segment_start: int = 0
    remaining: int = 0  # blocks of the current segment not yet in a rollout
    first_rollout: bool = True
    rollout: Rollout | None = None
    texts: list[ModelInputs] | None = None  # the current segment's, encoded once
    segments: Iterator[tuple[str, int]] | None = None
    live: bool = False  # a block is being made (a state forks and exports only between blocks)

    def latent_frames(self, frames: list[int]) -> torch.Tensor:
        """The clean latents of video frames `frames` [B, C, len, h, w]."""
        tail = torch.cat(self.video, dim=2) if self.video else None
        parts = []
        for f in frames:
            if f >= self.video_start:
                parts.append(tail[:, :, f - self.video_start:f - self.video_start + 1])
            else:
                parts.append(self.pinned[f])
        return torch.cat(parts, dim=2)

    def forget_old_frames(self, keep: int, pinned: list[int] = ()) -> None:
        """Keep the newest `keep` latent frames (and `pinned` older ones)."""
        tail = torch.cat(self.video, dim=2)
        cut = max(0, tail.shape[2] - keep)
        for f in pinned:
            if self.video_start <= f < self.video_start + cut:
                self.pinned[f] = tail[:, :, f - self.video_start:f - self.video_start + 1]
        self.pinned = {f: t for f, t in self.pinned.items() if f in set(pinned)}
        self.video = [tail[:, :, cut:]] if keep > 0 else []
        self.video_start += cut

    def park(self, idle: bool) -> None:
        """Between blocks (`idle`) the rollout's KV caches may be moved to host memory under pressure; going on,
        they come back (waiting for the pool's room, like a new stream) before the next pass."""
        for cache in _unique(self.rollout.caches or []) if self.rollout is not None else []:
            if cache is not None and hasattr(cache, "resume"):
                if idle:
                    cache.idle = True
                else:
                    cache.resume()

    def resume_task(self):
        """`park(False)` as a task: a cache that went to host memory waits for the pool's room on the engine core
        (composer/engine/loop.py `Admit`), holding no thread."""
        for cache in _unique(self.rollout.caches or []) if self.rollout is not None else []:
            need = cache.resume_need() if cache is not None and hasattr(cache, "resume_need") else None
            if need is not None:
                cache.resume((yield from admitted(cache.pool, need, cache.priority, cache.cancel)))
        self.park(False)

    @property
    def swapped(self) -> bool:
        """Whether a cache of the rollout went to host memory (going on then waits for the pool's room)."""
        caches = _unique(self.rollout.caches or []) if self.rollout is not None else []
        return any(getattr(c, "swapped", None) is not None for c in caches if c is not None)

    def close_rollout(self) -> None:
        if self.rollout is not None:
            self.rollout.close()
            self.rollout = None

    # -- sessions: fork and snapshot (at a block boundary, the stream suspended) --------------------------
    def fork(self, priority: int = 0, cancel: Any = None) -> CausalState:
        """An independent state that continues exactly as this one would: its own random generator (same
        state), the same latents (never written in place), the KV caches forked (pages shared until written)."""
        if self.live:
            raise RuntimeError("a causal state forks between blocks, not while its stream runs")
        generator = torch.Generator(device=self.generator.device)
        generator.set_state(self.generator.get_state())
        rollout = None
        if self.rollout is not None:
            r = self.rollout
            caches = None
            if r.caches is not None:
                twins: dict[int, Any] = {}
                for cache in _unique(r.caches):
                    if cache is not None:
                        twins[id(cache)] = cache.fork(priority, cancel)
                caches = [None if c is None else twins[id(c)] for c in r.caches]
            rollout = Rollout(caches=caches, frames=list(r.frames), blocks=r.blocks, left=r.left, prefix=r.prefix,
                              noise=r.noise, clean=list(r.clean))
        return CausalState(
            generator=generator, video=list(self.video), video_start=self.video_start, pinned=dict(self.pinned),
            frames_done=self.frames_done, block_index=self.block_index, segment=self.segment, prompt=self.prompt,
            segment_start=self.segment_start, remaining=self.remaining, first_rollout=self.first_rollout,
            rollout=rollout, texts=self.texts,
        )

    def export(self) -> dict[str, Any]:
        """Everything `CausalDenoisingStage.restore` needs to rebuild this state in another process (CPU
        tensors, ints and strings: what `torch.load(weights_only=True)` reads)."""
        if self.live:
            raise RuntimeError("a causal state is exported between blocks, not while its stream runs")
        rollout = None
        if self.rollout is not None:
            r = self.rollout
            unique = [c for c in _unique(r.caches or []) if c is not None]
            rollout = {
                "frames": list(r.frames), "blocks": r.blocks, "left": r.left, "prefix": r.prefix,
                "noise": r.noise.cpu(), "clean": [c.cpu() for c in r.clean],
                "caches": None if r.caches is None else [c.export() for c in unique],
                "cache_index": None if r.caches is None else [-1 if c is None else unique.index(c) for c in r.caches],
            }
        return {
            "generator": self.generator.get_state(),
            "video": torch.cat(self.video, dim=2).cpu() if self.video else None,
            "video_start": self.video_start, "pinned": [[f, t.cpu()] for f, t in self.pinned.items()],
            "frames_done": self.frames_done, "block_index": self.block_index, "segment": self.segment,
            "prompt": self.prompt, "segment_start": self.segment_start, "remaining": self.remaining,
            "first_rollout": self.first_rollout, "rollout": rollout,
        }


def _unique(caches: list) -> list:
    """Each cache once (batched guidance branches share one)."""
    return list({id(c): c for c in caches}.values())


def format_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _synced(device: torch.device):
    """Wait until `device` has run the work queued so far (what a block's seconds are measured to). A task waits for
    it on one of the engine core's stage threads, so the core goes on queueing the other requests' steps meanwhile;
    on a thread, that thread waits. Nothing to wait for on the CPU."""
    if torch.device(device).type != "cpu":
        yield from wait_for(Blocking(lambda: platform_for(device).synchronize(device)))


class CausalDenoisingStage(Stage):
    """Runs every block of every segment; `stream` yields them as they finish."""

    concurrent = True  # transformer calls go through the engine's step scheduler

    def __init__(
        self,
        engine: DenoisingEngine,
        encode_prompts: Callable[[list[str]], torch.Tensor],
        config: Any,  # the pipeline's CausalWanConfig (configs/ sit above stages/)
        spatial_factor: int,
        kv_cache_offload: bool = False,
        progress: bool = True,
        kv_pool: KVPool | None = None,
    ):
        self.engine = engine
        self.spatial_factor = spatial_factor  # the VAE's: latent height = height // spatial_factor
        self.encode_prompts = encode_prompts
        self.config = config
        self.kv_cache_offload = kv_cache_offload
        # every stream's KV pages (one pool per model; kv_cache_memory bounds it)
        self.kv_pool = kv_pool if kv_pool is not None else KVPool(None, engine.transformer.device)
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

    @drives_task
    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        return drive(self.forward_task(batch))

    def forward_task(self, batch: ForwardBatch):
        """The whole video as a task: every block, each wait of its passes yielded (composer/engine/loop.py)."""
        # Streaming callers report each block themselves; the whole-video path gets a progress bar.
        request = current_request()
        quiet = not self.progress or (request is not None and request.background)
        with progress_bar(None, "blocks", "block", not quiet) as advance:  # shared by runs at once
            for piece in self.stream(batch, None):
                if is_wait(piece):
                    yield piece
                    continue
                advance()
        return batch

    # -- the sampler ---------------------------------------------------------------------------------
    def _new_caches(self, batch_size: int, branches: int, capacity: int, tokens_per_frame: int):
        """As a task: one cache per guidance branch (batched branches share one holding all their rows), pages of
        the stage's KVPool, the branches' pages in one admission (composer/admission.py): when the pool's budget has
        no room the task waits on the engine core (`Admit`), holding no thread. Returns list[KVCache | None]."""
        cfg = self.transformer.config
        window, sink = self.window
        heads, tokens = cfg.num_attention_heads, tokens_per_frame
        if hasattr(self.transformer, "kv_cache_layout"):  # split over ranks: this rank's heads / tokens
            heads, tokens = self.transformer.kv_cache_layout(tokens_per_frame)
        request = current_request()
        priority = request.priority if request is not None else 0
        cancel = request.cancel if request is not None else None

        def spec(rows: int) -> KVCacheSpec:
            return KVCacheSpec(
                num_layers=cfg.num_layers, batch_size=rows, num_heads=heads,
                head_dim=cfg.attention_head_dim, tokens_per_frame=tokens, capacity_frames=capacity,
                window_frames=window, sink_frames=sink,
            )

        batched = branches > 1 and self.engine.batched_cfg
        # CFG parallel: a rank keeps the cache of its own branch only
        owned = [0] if batched else [i for i in range(branches) if self.engine.owns_branch(i)]
        rows = batch_size * branches if batched else batch_size
        # the branches' pages in one admission: a request never holds one branch's cache while waiting for another
        specs, pool, dtype, device = [spec(rows)] * len(owned), self.kv_pool, self.transformer.dtype, self.transformer.device
        made: list = []
        if specs:
            need = PagedKVCache.page_need(specs, dtype, device, pool, self.kv_cache_offload)
            start = time.perf_counter()
            grant = yield from admitted(pool, need, priority, cancel)  # other streams may hold the room
            made = PagedKVCache.granted(specs, dtype, device, pool, self.kv_cache_offload, grant, priority, cancel,
                                        time.perf_counter() - start)
        if batched:
            return made * branches
        caches: list[KVCache | None] = [None] * branches
        for i, cache in zip(owned, made):
            caches[i] = cache
        return caches

    def _chunks(self, start: int, end: int) -> list[tuple[int, int]]:
        n = self.config.num_frames_per_block
        return [(s, min(s + n, end)) for s in range(start, end, n)]

    def _timesteps(self, value: float, batch_size: int, frames: int) -> torch.Tensor:
        return torch.full((batch_size, frames), float(value), device=self.transformer.device)

    # -- the request's state: everything the next block needs (sessions fork and snapshot it) -----------
    def start(self, batch: ForwardBatch) -> CausalState:
        """The state of a request before its first block."""
        state = CausalState(generator=batch.generator)
        if batch.start_latents is not None:
            state.video.append(batch.start_latents.to(self.transformer.device, torch.float32))
            state.frames_done = batch.start_latents.shape[2]
        return state

    def restore(self, data: dict[str, Any]) -> CausalState:
        """The CausalState `CausalState.export` wrote (another process may have written it), on this stage's
        device, its KV caches in this stage's pool."""
        device = self.transformer.device
        generator = torch.Generator()
        generator.set_state(data["generator"])
        rollout = None
        if data["rollout"] is not None:
            r = data["rollout"]
            caches = None
            if r["caches"] is not None:
                made = [self._restored_cache(c) for c in r["caches"]]
                caches = [None if i < 0 else made[i] for i in r["cache_index"]]
            rollout = Rollout(caches=caches, frames=list(r["frames"]), blocks=int(r["blocks"]), left=int(r["left"]),
                              prefix=int(r["prefix"]), noise=r["noise"].to(device),
                              clean=[c.to(device) for c in r["clean"]])
        return CausalState(
            generator=generator, video=[] if data["video"] is None else [data["video"].to(device)],
            video_start=int(data["video_start"]), pinned={int(f): t.to(device) for f, t in data["pinned"]},
            frames_done=int(data["frames_done"]), block_index=int(data["block_index"]),
            segment=int(data["segment"]), prompt=data["prompt"], segment_start=int(data["segment_start"]),
            remaining=int(data["remaining"]), first_rollout=bool(data["first_rollout"]), rollout=rollout,
        )

    def _restored_cache(self, data: dict[str, Any]) -> KVCache:
        spec = KVCacheSpec(**data["spec"])
        cfg = self.transformer.config
        window, sink = self.window
        expected = (cfg.num_layers, cfg.attention_head_dim, window, sink)
        if (spec.num_layers, spec.head_dim, spec.window_frames, spec.sink_frames) != expected:
            raise InvalidInputError(
                f"the snapshot's KV cache (layers {spec.num_layers}, head_dim {spec.head_dim}, window "
                f"{spec.window_frames}, sink {spec.sink_frames}) does not fit this model {expected}"
            )
        request = current_request()
        cache = PagedKVCache(spec, self.transformer.dtype, self.transformer.device, self.kv_pool,
                             offload=self.kv_cache_offload, priority=request.priority if request else 0,
                             cancel=request.cancel if request else None)
        cache.load(data)
        return cache

    @torch.inference_mode()  # also around each resumption of this generator
    def stream(self, batch: ForwardBatch, upstream: Iterator | None = None) -> Iterator[LatentBlock]:
        """Generate block by block, yielding each finished block. Sets batch.stats (CausalStats) at once and, at
        the end, batch.latents: every latent frame (start frames included), or with keep_video off only the
        newest frames the next rollout needs. A request that carries a CausalState (a forked or resumed session)
        goes on from it."""
        plan = batch.get(CausalPlan)
        if (problem := switch_problem(plan.switch, plan.use_kv_cache)) is not None:
            raise InvalidInputError(f"prompt_switch = {plan.switch!r}: expected {problem}")
        state = batch.get(CausalState, None)
        if state is None:
            state = self.start(batch)
            batch.attach(state)
        state.segments = checked_segments(plan.segments)
        batch.stats = CausalStats()
        try:
            while True:  # (the waits of each block's passes are yielded too: composer/engine/loop.py)
                block = yield from self._next_block_task(batch, plan, state)
                if block is None:
                    break
                state.park(True)  # suspended between blocks: an idle stream's KV pages may go to host memory
                yield block  # (a session between extends, a slow reader) for a higher-priority stream
                yield from state.resume_task()  # pages that went to host memory come back (waiting for room)
        finally:
            state.close_rollout()  # finished, failed or closed: the KV pages go back to the pool
        if state.block_index == 0 and batch.start_latents is None:
            raise InvalidInputError("nothing to generate: every segment has 0 blocks")
        batch.latents = torch.cat(state.video, dim=2) if state.video else None

    def _next_block_task(self, batch: ForwardBatch, plan: CausalPlan, state: CausalState):
        """Advance `state` by one block (reading segments and starting rollouts as needed; None when done), as a task:
        yields each pass's unit and each blocking piece (text encoding, KV pages)."""
        state.live = True
        try:
            return (yield from self._advance_task(batch, plan, state))
        finally:
            state.live = False

    def _advance_task(self, batch: ForwardBatch, plan: CausalPlan, state: CausalState):
        while True:
            rollout = state.rollout
            if rollout is not None and rollout.left > 0:
                if rollout.left < rollout.blocks and (yield from self._cut(plan, state.segment_start,
                                                                           state.block_index)):
                    rollout.left = 0  # the rest of this rollout's noise goes unused
                    state.remaining = 0
                    continue
                return (yield from self._run_block_task(batch, plan, state))
            if state.remaining > 0 and (yield from self._cut(plan, state.segment_start, state.block_index)):
                state.remaining = 0  # a live source ends the segment where a rollout ended
            if rollout is not None and (state.remaining > 0 or plan.switch == "restart"):
                state.close_rollout()  # a segment's next rollout, or a restart: this cache is done
            if state.remaining > 0:
                yield from self._start_rollout_task(batch, plan, state, switch=False)
                continue
            item = yield from self._asked(lambda: next(state.segments, None))
            if item is None:
                return None
            prompt, num_blocks = item
            switching = state.segment >= 0
            state.segment += 1
            state.prompt = prompt
            state.texts = None
            state.segment_start = state.block_index
            state.remaining = num_blocks
            if switching and state.rollout is not None:  # 'keep' / 'recache': from the old rollout
                yield from self._start_rollout_task(batch, plan, state, switch=True)

    def _texts_task(self, batch: ForwardBatch, state: CausalState):
        """The current segment's text inputs (cond, and uncond under guidance), encoded once per segment (as
        blocking work: the text encoder is shared)."""
        if state.texts is None:
            engine, model = self.engine, self.transformer
            bsz = batch.batch_size

            def encode() -> list[ModelInputs]:
                texts = [engine.text_inputs(self.encode_prompts([state.prompt] * bsz).to(model.device, model.dtype))]
                if batch.do_classifier_free_guidance:
                    texts.append(engine.text_inputs(batch.negative_prompt_embeds.to(model.device, model.dtype)))
                return texts

            state.texts = yield from wait_for(Blocking(encode))
        return state.texts

    def _geometry(self, batch: ForwardBatch) -> tuple[int, int, int, int]:
        h, w = batch.height // self.spatial_factor, batch.width // self.spatial_factor
        return self.transformer.config.in_channels, h, w, self.transformer.tokens_per_frame(h, w)

    def _start_rollout_task(self, batch: ForwardBatch, plan: CausalPlan, state: CausalState, switch: bool):
        """A new KV cache for the segment's next blocks, prefilled with the rollout's context: the start latents
        (first rollout) or the newest `overlap_frames`; at a 'recache' switch every frame the old cache attended
        to; at a 'keep' switch no prefill: the old cache's keys/values are carried over and positions go on."""
        cfg, engine = self.config, self.engine
        device = self.transformer.device
        bsz = batch.batch_size
        n = cfg.num_frames_per_block
        channels, h, w, tpf = self._geometry(batch)
        branches = 2 if batch.do_classifier_free_guidance else 1
        stats: CausalStats = batch.stats
        blocks = min(state.remaining, plan.rollout_blocks or state.remaining)
        old = state.rollout if switch else None
        carry = old if old is not None and plan.switch == "keep" and old.caches is not None else None
        if carry is not None:
            frames = list(carry.frames)
        elif old is not None:  # recache: every frame the old rollout attended to, under the new prompt
            frames = old.visible_frames(self)
        elif not state.video:
            frames = []
        elif state.first_rollout:
            frames = list(range(state.frames_done))
        else:
            frames = list(range(max(0, state.frames_done - plan.overlap_frames), state.frames_done))
        context = None if carry is not None or not frames else state.latent_frames(frames)
        state.first_rollout = False
        prefix = len(frames)
        texts = yield from self._texts_task(batch, state)  # (a new segment's prompt: outside prefill_seconds)
        start = time.perf_counter()
        # 'keep' under a rolling window: the old caches go on as they are (a window has room for any number of
        # frames). Otherwise the old cache goes back to the pool before the new one is taken: under a
        # kv_cache_memory budget that holds one of them, taking the new one first would wait for ever for this
        # stream's own pages; 'keep' (global attention: a cache with room for the new blocks) copies the old
        # keys/values out first.
        reused = carry.caches if carry is not None and self.window[0] is not None else None
        if reused is not None:
            carry.caches = None  # they are the new rollout's now: closing the old rollout leaves them open
        kept = ([c.export() if c is not None else None for c in _unique(carry.caches)]
                if carry is not None and reused is None else None)
        if old is not None:
            state.close_rollout()
        prefill = time.perf_counter() - start
        caches = reused
        if plan.use_kv_cache and caches is None:
            caches = yield from self._new_caches(bsz, branches, prefix + blocks * n, tpf)  # may wait for room
            stats.kv_cache_bytes = max(stats.kv_cache_bytes, sum(c.nbytes for c in _unique(caches) if c))
        stats.rollouts += 1
        start = time.perf_counter()
        if kept is not None:
            for new, data in zip(_unique(caches), kept):
                if new is not None and data is not None:
                    new.load(data)
        if caches is not None and context is not None:
            for s, e in self._chunks(0, prefix):
                yield from wait_for(ModelStep(engine, context[:, :, s:e], self._timesteps(cfg.context_noise, bsz, e - s),
                                              _cached(texts, caches, s), None, "context", None))
        yield from _synced(device)
        stats.prefill_seconds += prefill + time.perf_counter() - start
        noise = torch.randn((bsz, blocks * n, channels, h, w), generator=state.generator)
        state.rollout = Rollout(
            caches=caches, frames=frames, blocks=blocks, left=blocks, prefix=prefix,
            noise=platform_for(device).to_device(noise.permute(0, 2, 1, 3, 4), device),  # [B, C, F, h, w]
            # the recompute path re-reads the rollout's clean frames; the cached path has them as keys
            clean=[] if context is None or caches is not None else [context],
        )
        state.remaining -= blocks

    def _run_block_task(self, batch: ForwardBatch, plan: CausalPlan, state: CausalState):
        cfg, engine = self.config, self.engine
        rollout = state.rollout
        device = self.transformer.device
        bsz = batch.batch_size
        n = cfg.num_frames_per_block
        _, _, _, tpf = self._geometry(batch)
        guidance = (ClassifierFreeGuidance(float(batch.guidance_scale), fp32=True)
                    if batch.do_classifier_free_guidance else None)
        texts = yield from self._texts_task(batch, state)
        start = time.perf_counter()
        b = rollout.blocks - rollout.left
        x = rollout.noise[:, :, b * n:(b + 1) * n]
        if rollout.caches is not None:
            inputs = _cached(texts, rollout.caches, len(rollout.frames))
        else:
            inputs = self._recompute_inputs(texts, rollout.clean, rollout.prefix, n, tpf, device)
        steps = FewStepFlow(self.table, self.steps.tolist(), state.generator)
        with self._block_in_loop():  # concurrent streams wait for this block's passes, not its decode
            x0 = yield from engine.run_task(x, steps, inputs[0], inputs[1] if guidance else None, guidance,
                                            run=state.block_index)
            if rollout.caches is not None:  # the clean pass leaves the block's keys/values in the cache
                yield from wait_for(ModelStep(engine, x0, self._timesteps(cfg.context_noise, bsz, n), inputs, None,
                                              "context", None))
        x0 = x0.float()
        if rollout.caches is None:
            rollout.clean.append(x0)
        state.video.append(x0)
        rollout.frames.extend(range(state.frames_done, state.frames_done + n))
        rollout.left -= 1
        if rollout.left == 0 and plan.switch != "keep":
            rollout.close()  # its pages go back now: a session idle between extends holds none (a 'recache'
            # switch needs only the rollout's frames, a next rollout makes its own cache)
        if not plan.keep_video:
            keep, pinned = self._frames_to_keep(plan, state)
            state.forget_old_frames(keep, pinned)
        yield from _synced(device)
        elapsed = time.perf_counter() - start
        batch.stats.block_seconds.append(elapsed)
        block = LatentBlock(state.block_index, state.segment, state.prompt, state.frames_done, x0, elapsed)
        state.frames_done += n
        state.block_index += 1
        return block

    def _frames_to_keep(self, plan: CausalPlan, state: CausalState) -> tuple[int, list[int]]:
        """keep_video off: how many newest latent frames to keep (a next rollout's context), and the older frames
        a 'recache' switch would still recompute (the sink frames)."""
        if plan.switch != "recache" or state.rollout is None:
            return plan.overlap_frames, []
        seen = state.rollout.visible_frames(self)
        newest = state.frames_done + self.config.num_frames_per_block
        _, sink = self.window
        recent = seen[sink:] if sink else seen
        keep = max(plan.overlap_frames, newest - min(recent)) if recent else plan.overlap_frames
        return keep, (seen[:sink] if sink else [])

    def _block_in_loop(self):
        """While a block's passes run, the step scheduler counts this request as denoising (so the others' next
        call waits for its units too); between blocks (its decode, its reader) it does not."""
        from contextlib import nullcontext

        from composer.engine.scheduler import current_request

        scheduler, request = self.engine.scheduler, current_request()
        if scheduler is None or request is None:
            return nullcontext()
        return scheduler.denoising(request)

    def _cut(self, plan: CausalPlan, segment_start: int, block_index: int):
        """(In a task) whether a live source ends the current segment before `block_index` (never before its first
        block)."""
        if plan.ends_segment is None or block_index <= segment_start:
            return False
        return bool((yield from self._asked(lambda: plan.ends_segment(block_index))))

    def _asked(self, fn: Callable[[], Any]):
        """(In a task) `fn()`, a live source's answer (its next segment, whether it cuts). Under a parallel layout the
        answer is rank 0's, told to every rank: it may wait for another process, so it runs on a stage thread and the
        engine core goes on meanwhile. On one process it is asked inline (no thread hop per block)."""
        scheduler = self.engine.scheduler
        if scheduler is None or scheduler.planner is None:
            return fn()
        return (yield from wait_for(Blocking(fn)))

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
