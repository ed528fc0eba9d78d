"""Step caching (`cache = teacache`): skip the transformer's blocks on steps whose input barely changed, reusing
the residual (blocks' output - input) of the last step that ran them.

TeaCache (Liu et al., "Timestep Embedding Tells: It's Time to Cache for Video Diffusion Model", 2024): the
signal is the timestep-modulated input of the blocks. Between consecutive steps its relative L1 change is
rescaled by a polynomial fitted per model (`teacache_coefficients` in the family's config, keyed by the
transformer's hidden size) and accumulated; while the sum stays under `cache_threshold` the step reuses the
cached residual, otherwise the blocks run and the sum restarts. The first `cache_warmup_steps` steps and the
last step always run.

**Planned before the loop.** For Wan the modulated input (the timestep projection) depends on the timestep
alone, so the whole schedule is decided from the timesteps when a loop starts: no device-to-host sync per
step. `plan_schedule` and `TeaCachePlanner.decide` are the same rule (a test checks they agree), so a model
whose signal depends on the latents (e.g. a modulated first-block input) can decide step by step instead.

State is per guidance branch set (the rows of one transformer call: both branches when CFG is batched, one
each when sequential or CFG-parallel) and per run (a text-to-video loop; each causal block's few steps), and
is reset when a run starts, so nothing leaks between videos. A causal "context" pass (writing the KV cache)
always runs its blocks.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from composer.attach import attach
from composer.engine import EngineHook
from composer.engine.scheduler import calling_requests, current_request
from composer.logging import get_logger, log_once

logger = get_logger(__name__)

# Used where the family's config has no coefficients for a model: the raw relative change, no rescaling.
IDENTITY = (0.0, 0.0, 0.0, 1.0, 0.0)


def rescale(coefficients: Sequence[float], value: float) -> float:
    """The polynomial (highest power first, as numpy.poly1d) at `value`."""
    out = 0.0
    for c in coefficients:
        out = out * value + c
    return out


def relative_l1(now: torch.Tensor, before: torch.Tensor) -> float:
    """mean |now - before| / mean |before|, in fp32."""
    before = before.float()
    return float((now.float() - before).abs().mean() / before.abs().mean().clamp_min(1e-12))


@dataclass
class TeaCachePlanner:
    """TeaCache's rule, one step at a time: feed each step's signal to `decide`; True means run the blocks."""

    threshold: float
    coefficients: Sequence[float] = IDENTITY
    warmup_steps: int = 1
    num_steps: int = 0
    _previous: torch.Tensor | None = None
    _accumulated: float = 0.0
    # steps whose change the polynomial mapped below 0: outside the range it was fitted on (e.g. far fewer steps
    # than it was fitted for); such a step runs, as a change too large to estimate
    out_of_range: int = 0

    def decide(self, index: int, signal: torch.Tensor) -> bool:
        run = True
        if self._previous is not None and self.warmup_steps <= index < self.num_steps - 1:
            estimate = rescale(self.coefficients, relative_l1(signal, self._previous))
            if estimate < 0:
                self.out_of_range += 1
                estimate = float("inf")
            self._accumulated += estimate
            if self._accumulated < self.threshold:
                run = False
            else:
                self._accumulated = 0.0
        elif self._previous is not None:
            self._accumulated = 0.0
        self._previous = signal
        return run


def plan_schedule(signals: Sequence[torch.Tensor], threshold: float, coefficients: Sequence[float] = IDENTITY,
                  warmup_steps: int = 1, planner: TeaCachePlanner | None = None) -> list[bool]:
    """Whether each step runs the blocks (True) or reuses the cached residual, decided for the whole loop."""
    planner = planner or TeaCachePlanner(threshold, coefficients, warmup_steps, len(signals))
    return [planner.decide(i, s) for i, s in enumerate(signals)]


@dataclass
class StepCacheStats:
    """What the cache did over the last request: step calls made and how many reused the residual."""

    calls: int = 0
    skipped: int = 0
    per_run: dict[int, list[bool]] = field(default_factory=dict)  # run -> the plan (True: blocks ran)

    def summary(self) -> str:
        share = self.skipped / self.calls if self.calls else 0.0
        return f"{self.skipped} of {self.calls} transformer calls reused the cached residual ({share:.0%})"


class ResidualCache:
    """What a model's `run_blocks` consults (`model.step_cache`): run the blocks and keep their residual, or
    add the kept residual, for the call in progress (set by the engine hook)."""

    def __init__(self):
        self.key: tuple | None = None  # (run, branches) of the call in progress; None: run, keep nothing
        self.reuse = False  # this call may reuse the residual kept under `key`
        self.residuals: dict[tuple, torch.Tensor] = {}

    def reset(self) -> None:
        self.residuals.clear()
        self.key, self.reuse = None, False

    def run_blocks(self, run: Callable[..., torch.Tensor], x: torch.Tensor, num_blocks: int) -> torch.Tensor:
        kept = self.residuals.get(self.key) if self.key is not None else None
        if self.reuse and kept is not None and kept.shape == x.shape:
            return x + kept
        out = run(x)
        if self.key is not None:
            self.residuals[self.key] = out - x
        return out


class TeaCacheEngineHook(EngineHook):
    """Plans each loop's skips from its timesteps (before its first step) and tells the model's ResidualCache
    what each step call may do."""

    def __init__(self, model: torch.nn.Module, cache: ResidualCache, threshold: float,
                 coefficients: Sequence[float], warmup_steps: int | None):
        self.model = model
        self.cache = cache
        self.threshold = threshold
        self.coefficients = tuple(coefficients)
        self.warmup_steps = warmup_steps
        self.stats = StepCacheStats()
        self._plan: list[bool] = []
        self._run: int | None = None

    def signal(self, timestep: float) -> torch.Tensor:
        """The blocks' timestep-modulated input for one timestep: the model's timestep projection."""
        model = self.model
        t = torch.tensor([timestep], device=model.device)
        if hasattr(model, "timestep_signal"):  # a model that states its own (HunyuanVideo)
            return model.timestep_signal(t)
        return model.condition_embedder.embed_timestep(t, model.dtype)[1]

    def before_step(self, info) -> None:
        if info.index == 0:  # a loop starts: plan it, forget every residual of the runs before
            if info.run == 0:
                self.stats = StepCacheStats()
            self.cache.reset()
            with torch.no_grad():
                signals = [self.signal(t) for t in info.timesteps]
            warmup = self.warmup_steps if self.warmup_steps is not None else max(1, round(0.1 * len(signals)))
            planner = TeaCachePlanner(self.threshold, self.coefficients, warmup, len(signals))
            self._plan = plan_schedule(signals, self.threshold, self.coefficients, warmup, planner)
            if planner.out_of_range:
                log_once(logger, f"teacache-out-of-range-{len(signals)}", f"teacache: at {len(signals)} steps, "
                         f"{planner.out_of_range} step changes fall outside the range the coefficients were fitted on "
                         "(the polynomial gives a negative change); those steps run")
            self._run = info.run
            self.stats.per_run[info.run] = list(self._plan)

    def around_model(self, call, model_call):
        step = model_call.step
        if model_call.kind != "step" or step is None:  # context passes always run their blocks, keep nothing
            self.cache.key, self.cache.reuse = None, False
            return call(model_call)
        self.cache.key = (step.run, model_call.branches)
        self.cache.reuse = not self._plan[step.index] if step.index < len(self._plan) else False
        self.stats.calls += 1
        try:
            out = call(model_call)
        finally:
            reused = self.cache.reuse
            self.cache.key, self.cache.reuse = None, False
        self.stats.skipped += int(reused)
        return out

    def after_step(self, info) -> None:
        if info.index == info.num_steps - 1 and info.run == self._run:
            logger.info("teacache: %s", self.stats.summary())


class StepCacheHook:
    """Hook phase: `cache = teacache` on every denoising transformer (the model's `step_cache` slot and an
    engine hook on each of its engines); `from_runtime` hands `cache = dbcache` to DBCacheHook."""

    name = "cache"

    def __init__(self, runtime: Any):
        self.runtime = runtime
        self.hooks: list[PerRequestStepCache] = []
        self._models: dict[int, tuple[torch.nn.Module, ResidualCache, tuple[float, ...], float]] = {}

    @classmethod
    def from_runtime(cls, runtime: Any) -> Any:
        """This hook for `cache = teacache` (the HOOKS table picks composer.accel.dbcache's for `cache = dbcache`)."""
        return cls(runtime)

    def _coefficients(self, pipeline: Any, model: torch.nn.Module) -> tuple[float, ...]:
        table = getattr(pipeline.config, "teacache_coefficients", None) or {}
        width = getattr(getattr(model, "config", None), "hidden_size", None)
        if width in table:
            return tuple(table[width])
        log_once(logger, f"teacache-uncalibrated-{width}", f"teacache: no coefficients for this model (hidden size "
                 f"{width}) in the family's config: the raw relative change is used; pick cache_threshold by "
                 "measuring (benchmarks) or add fitted coefficients")
        return IDENTITY

    def _threshold(self, pipeline: Any, model: torch.nn.Module, calibrated: bool) -> tuple[float, str]:
        """`cache_threshold`, or the family's measured default for this model when it is unset: per width where
        the coefficients are fitted (the rescaled change), else the family's default for the raw change."""
        if self.runtime.cache_threshold is not None:
            return self.runtime.cache_threshold, "set"
        width = getattr(getattr(model, "config", None), "hidden_size", None)
        table = getattr(pipeline.config, "teacache_thresholds", None) or {}
        if calibrated and width in table:
            return float(table[width]), "the family's default"
        return float(getattr(pipeline.config, "teacache_threshold", 0.2)), "the family's default"

    def apply(self, pipeline: Any) -> str:
        lines = []
        for name, model in pipeline.denoisers().items():
            if not hasattr(type(model), "step_cache"):
                lines.append(f"{name}: no step_cache slot (not cached)")
                continue
            cache = ResidualCache()
            attach((model, "step_cache"), cache, what=f"{name}.step_cache")
            coefficients = self._coefficients(pipeline, model)
            threshold, source = self._threshold(pipeline, model, coefficients != IDENTITY)
            self._models[id(model)] = (model, cache, coefficients, threshold)
            calibrated = "fitted coefficients" if coefficients != IDENTITY else "uncalibrated"
            lines.append(f"{name} ({calibrated}, threshold {threshold:g}: {source})")
        r = self.runtime
        warmup = r.cache_warmup_steps if r.cache_warmup_steps is not None else "a tenth of the"
        return f"teacache, warmup {warmup} steps: " + "; ".join(lines)

    def configure_engine(self, engine) -> None:
        found = self._models.get(id(engine.transformer))
        if found is None:
            return
        model, cache, coefficients, threshold = found
        warmup = self.runtime.cache_warmup_steps

        def make() -> tuple[TeaCacheEngineHook, ResidualCache]:
            per_request = ResidualCache()
            return TeaCacheEngineHook(model, per_request, threshold, coefficients, warmup), per_request

        hook = PerRequestStepCache(model, make)
        self.hooks.append(hook)
        attach(engine, hook, what="teacache engine hook")


class PerRequestStepCache(EngineHook):
    """A step cache's engine hook and the model's cache object, one pair per request, so concurrent requests
    (scheduled together, one request per call: the pipeline's "interleave" mode) each keep their own plan,
    residuals and counts and decide for themselves, exactly as each would alone. `make()` gives a new
    (engine hook, cache) pair. `before_step` / `after_step` run on the request's thread (`current_request`);
    `around_model` on whichever thread runs the call, for the request the call holds (`calling_requests`), and
    puts that request's cache in the model's `step_cache` slot for the call (one call at a time per engine)."""

    def __init__(self, model: torch.nn.Module, make: Callable[[], tuple[EngineHook, Any]]):
        self.model = model
        self.make = make
        self.stats = StepCacheStats()  # the last loop a request finished (what a single caller reads)
        self._states: dict[Any, tuple[EngineHook, Any]] = {}
        self._lock = threading.Lock()
        self._settings = make()[0]  # what every request's hook is made with (threshold, coefficients, ...)

    def __getattr__(self, name: str) -> Any:  # the settings: threshold, coefficients, warmup_steps, ...
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._settings, name)

    def _state(self, request: Any) -> tuple[EngineHook, Any]:
        key = None if request is None else id(request)
        with self._lock:
            state = self._states.get(key)
            if state is None:
                state = self._states[key] = self.make()
                if request is not None:  # forgotten with its request
                    weakref.finalize(request, self._forget, key)
            return state

    def _forget(self, key: Any) -> None:
        with self._lock:
            self._states.pop(key, None)

    def before_step(self, info) -> None:
        self._state(current_request())[0].before_step(info)

    def around_model(self, call, model_call):
        requests = calling_requests()
        hook, cache = self._state(requests[0] if requests else current_request())
        self.model.step_cache = cache
        return hook.around_model(call, model_call)

    def after_step(self, info) -> None:
        hook = self._state(current_request())[0]
        hook.after_step(info)
        self.stats = hook.stats
