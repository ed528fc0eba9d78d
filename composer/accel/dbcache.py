"""DBCache (`cache = dbcache`): on steps whose first blocks' residual barely changed, skip the middle blocks and
add the middle residual kept from the last computed step.

After cache-dit's "Dual Block Cache": the first `cache_fn_blocks` blocks always run, and the relative L1 change of
their residual (their output - the blocks' input) against the one of the last computed step is compared with
`cache_threshold`. Under it, the middle blocks are skipped and their residual (middle output - middle input) kept
from the last computed step is added; otherwise they run and their residual is kept. The last `cache_bn_blocks`
blocks always run, correcting the approximation. The first `cache_warmup_steps` steps and the last step always
run; `cache_max_cached_steps` and `cache_max_consecutive` cap the cached steps per loop and in a row.
`cache_taylorseer` extrapolates the middle residual to the step (first order, from the last two computed steps,
with the step index as the variable) instead of reusing the last one as is.

**Decided from the data, step by step.** Unlike TeaCache (planned from the timesteps before the loop), the
decision reads the first blocks' output: one device-to-host read of two sums per step. Under sequence
parallelism each rank holds a part of the tokens, so the two sums (numerator and denominator of the relative L1)
are all-reduced over the sequence-parallel group first, and every rank makes the same decision.

**One decision per step.** The first step call of a step decides, from the rows of its first guidance branch
(the prompt's under batched or sequential CFG); a later call of the same step (the negative branch, sequential)
follows it. Batched and sequential CFG thus decide alike. Residuals are kept per branch set (the rows of one call)
and per run (a text-to-video loop, each causal block's steps); everything is reset when a loop starts. Causal
"context" passes always run every block and keep nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from composer.accel.step_cache import PerRequestStepCache, StepCacheStats
from composer.engine import EngineHook
from composer.errors import ConfigError
from composer.logging import get_logger

logger = get_logger(__name__)


class DualBlockCache:
    """What a model's `run_blocks` consults (`model.step_cache`) under dbcache: the first blocks always run, the
    middle ones run or are replaced by a kept residual, the last ones always run. The engine hook sets, per call,
    the key (None: run everything, keep nothing), the step index and whether the step may be cached."""

    def __init__(self, fn_blocks: int, bn_blocks: int, threshold: float, taylorseer: bool = False,
                 sp_group: Any = None):
        self.fn_blocks = fn_blocks
        self.bn_blocks = bn_blocks
        self.threshold = threshold
        self.taylorseer = taylorseer
        self.sp_group = sp_group  # the sequence-parallel group whose ranks share the decision (None: one rank)
        # set per call by the engine hook
        self.key: tuple | None = None
        self.index = 0
        self.may_cache = False
        # per step: None until the step's first call decides; True: the middle blocks run
        self.computed: bool | None = None
        self.reused = False  # the last call added the kept residual
        # per loop
        self._signal: torch.Tensor | None = None  # first blocks' residual (first branch) at the last computed step
        self._history: dict[tuple, list[tuple[int, torch.Tensor]]] = {}  # key -> last (index, middle residual)s

    def reset(self) -> None:
        """Forget every residual (a loop starts)."""
        self._signal = None
        self._history.clear()
        self.key, self.computed, self.reused, self.may_cache = None, None, False, False

    def change(self, signal: torch.Tensor) -> float:
        """Relative L1 change of `signal` against the last computed step's, over every sequence-parallel rank."""
        before = self._signal.float()
        sums = torch.stack([(signal.float() - before).abs().sum(), before.abs().sum()])
        if self.sp_group is not None and dist.is_available() and dist.is_initialized():
            dist.all_reduce(sums, group=self.sp_group)
        num, den = sums.tolist()  # the one device-to-host read per step
        return num / max(den, 1e-12)

    def _decide(self, signal: torch.Tensor) -> bool:
        """Whether the middle blocks run this step (the step's first call decides for all its calls)."""
        run = True
        if self.may_cache and self._signal is not None and self._signal.shape == signal.shape:
            run = self.change(signal) >= self.threshold
        if run:
            self._signal = signal
        return run

    def residual(self, key: tuple, shape: torch.Size) -> torch.Tensor | None:
        """The middle residual to add at this step: the last computed one, or its TaylorSeer extrapolation."""
        history = self._history.get(key)
        if not history or history[-1][1].shape != shape:
            return None
        last_index, last = history[-1]
        if not self.taylorseer or len(history) < 2:
            return last
        first_index, first = history[0]
        slope = (last - first) / (last_index - first_index)
        return last + slope * (self.index - last_index)

    def run_blocks(self, run: Callable[..., torch.Tensor], x: torch.Tensor, num_blocks: int) -> torch.Tensor:
        self.reused = False
        if self.key is None:
            return run(x)
        middle_end = num_blocks - self.bn_blocks
        h = run(x, 0, self.fn_blocks)
        if self.computed is None:
            branches = len(self.key[1])
            self.computed = self._decide((h - x).chunk(branches)[0])
        kept = None if self.computed else self.residual(self.key, h.shape)
        if kept is not None:
            h = h + kept
            self.reused = True
        else:
            middle = run(h, self.fn_blocks, middle_end)
            history = self._history.setdefault(self.key, [])
            history.append((self.index, middle - h))
            del history[:-2 if self.taylorseer else -1]
            h = middle
        return run(h, middle_end, num_blocks) if self.bn_blocks else h


class DBCacheEngineHook(EngineHook):
    """Tells the model's DualBlockCache what each step call may do (warmup, the last step, the caps), resets it
    when a loop starts, and counts the calls that reused the middle residual."""

    def __init__(self, cache: DualBlockCache, warmup_steps: int | None, max_cached_steps: int | None,
                 max_consecutive: int | None):
        self.cache = cache
        self.warmup_steps = warmup_steps
        self.max_cached_steps = max_cached_steps
        self.max_consecutive = max_consecutive
        self.stats = StepCacheStats()
        self._cached = 0  # cached steps in this loop
        self._consecutive = 0  # cached steps in a row

    def before_step(self, info) -> None:
        cache = self.cache
        if info.index == 0:  # a loop starts: forget every residual of the runs before
            if info.run == 0:
                self.stats = StepCacheStats()
            cache.reset()
            self._cached = self._consecutive = 0
            self.stats.per_run[info.run] = []
        warmup = self.warmup_steps if self.warmup_steps is not None else max(1, round(0.1 * info.num_steps))
        cache.may_cache = (warmup <= info.index < info.num_steps - 1
                           and (self.max_cached_steps is None or self._cached < self.max_cached_steps)
                           and (self.max_consecutive is None or self._consecutive < self.max_consecutive))
        cache.index = info.index
        cache.computed = None

    def around_model(self, call, model_call):
        step = model_call.step
        if model_call.kind != "step" or step is None:  # context passes always run their blocks, keep nothing
            self.cache.key = None
            return call(model_call)
        self.cache.key = (step.run, model_call.branches)
        self.stats.calls += 1
        try:
            out = call(model_call)
        finally:
            self.cache.key = None
        self.stats.skipped += int(self.cache.reused)
        return out

    def after_step(self, info) -> None:
        computed = self.cache.computed is not False
        self.stats.per_run.setdefault(info.run, []).append(computed)
        if computed:
            self._consecutive = 0
        else:
            self._cached += 1
            self._consecutive += 1
        if info.index == info.num_steps - 1:
            logger.info("dbcache: %s", self.stats.summary())


class DBCacheHook:
    """Hook phase: `cache = dbcache` on every denoising transformer (a DualBlockCache in the model's `step_cache`
    slot and an engine hook on each of its engines), picked by the HOOKS table for `cache = dbcache`."""

    name = "cache"

    def __init__(self, runtime: Any):
        self.runtime = runtime
        self.hooks: list[PerRequestStepCache] = []
        self._caches: dict[int, DualBlockCache] = {}

    @classmethod
    def from_runtime(cls, runtime: Any) -> DBCacheHook:
        return cls(runtime)

    def apply(self, pipeline: Any) -> str:
        from composer.accel.blocks import repeated_blocks

        r = self.runtime
        threshold, source = self.threshold(pipeline)
        lines = []
        for name, model in pipeline.denoisers().items():
            found = repeated_blocks(model)
            if not hasattr(type(model), "step_cache") or found is None:
                lines.append(f"{name}: no step_cache slot (not cached)")
                continue
            count = len(found[1])
            if r.cache_fn_blocks + r.cache_bn_blocks >= count:  # equal: no middle block, nothing to skip
                raise ConfigError(f"cache_fn_blocks {r.cache_fn_blocks} + cache_bn_blocks {r.cache_bn_blocks} = "
                                  f"{r.cache_fn_blocks + r.cache_bn_blocks}, but {name} has {count} blocks: "
                                  f"expected fewer than {count}, so that some middle blocks are left to cache; "
                                  "lower cache_fn_blocks or cache_bn_blocks")
            sp = getattr(model, "sequence_parallel", None)
            cache = DualBlockCache(r.cache_fn_blocks, r.cache_bn_blocks, threshold, r.cache_taylorseer,
                                   getattr(sp, "sp_group", None))
            model.step_cache = cache
            self._caches[id(model)] = cache
            lines.append(f"{name} (F{r.cache_fn_blocks}B{r.cache_bn_blocks} of {count} blocks)")
        warmup = r.cache_warmup_steps if r.cache_warmup_steps is not None else "a tenth of the"
        taylor = ", TaylorSeer" if r.cache_taylorseer else ""
        return f"dbcache{taylor}, threshold {threshold:g} ({source}), warmup {warmup} steps: " + "; ".join(lines)

    def threshold(self, pipeline: Any) -> tuple[float, str]:
        """`cache_threshold`, or the family's measured default when it is unset, and which it is."""
        if self.runtime.cache_threshold is not None:
            return self.runtime.cache_threshold, "set"
        return float(getattr(pipeline.config, "dbcache_threshold", 0.1)), "the family's default"

    def configure_engine(self, engine) -> None:
        cache = self._caches.get(id(engine.transformer))
        if cache is None:
            return
        r = self.runtime

        def make() -> tuple[DBCacheEngineHook, DualBlockCache]:
            per_request = DualBlockCache(cache.fn_blocks, cache.bn_blocks, cache.threshold, cache.taylorseer,
                                         cache.sp_group)
            hook = DBCacheEngineHook(per_request, r.cache_warmup_steps, r.cache_max_cached_steps,
                                     r.cache_max_consecutive)
            return hook, per_request

        hook = PerRequestStepCache(engine.transformer, make)
        self.hooks.append(hook)
        engine.add_hook(hook)
