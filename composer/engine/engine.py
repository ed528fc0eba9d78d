"""DenoisingEngine: the one step loop and the one call site of a pipeline's transformer.

    for each step:  hooks.before_step -> predict -> step rule -> hooks.after_step
    predict:        one model call per guidance branch, or (batched CFG, the default) one call over the
                    branches as one batch; then guidance combines them
    model call:     hooks.around_model wrap the transformer call (outermost hook first)

Hooks are objects with any of `before_step(info)`, `after_step(info)` and `around_model(call, model_call)`;
a step cache, CFG parallel or a profiler attaches here once for every pipeline. A `before_step` that must wait for
something outside this process (the rank protocol's sync point with the other ranks) returns a Wait
(composer/engine/loop.py), which the step loop waits for as a task does: off the engine core's thread.

Several requests (threads) may run loops on one engine at once: with a `scheduler` (composer/engine/scheduler.py,
set by the pipeline) every transformer call goes through it, one call at a time, and compatible steps of different
requests share one call.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Generator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from composer.engine.guidance import ClassifierFreeGuidance
from composer.engine.inputs import ModelInputs
from composer.engine.loop import ModelStep, drive, is_wait, wait_for
from composer.engine.scheduler import (
    RequestContext,
    StepScheduler,
    Unit,
    batched_branches,
    calling,
    current_request,
    running_request,
)
from composer.engine.steps import StepRule
from composer.logging import get_logger, log_once, progress_bar

logger = get_logger(__name__)


@dataclass
class StepInfo:
    """Where a loop is: step `index` of `num_steps` at timestep `timestep`, in run `run` (a request's
    text-to-video loop is run 0; the causal sampler numbers its blocks)."""

    index: int
    num_steps: int
    timestep: float
    run: int
    latents: torch.Tensor
    timesteps: tuple[float, ...] = ()  # the loop's whole schedule (what a step cache plans from)


@dataclass
class ModelCall:
    """One transformer call: inputs [rows, C, F, H, W], timestep [rows] or [rows, F], the conditioning, and
    why it is made: "step" (a denoising prediction) or "context" (a causal pass that only writes the KV cache)."""

    latents: torch.Tensor
    timestep: torch.Tensor
    inputs: ModelInputs
    kind: str = "step"
    step: StepInfo | None = None
    branches: tuple[int, ...] = (0,)  # the guidance branches in this call's rows (0: prompt, 1: negative)


class EngineHook:
    """Base class for engine hooks: override what you need."""

    def before_step(self, info: StepInfo) -> None:
        pass

    def after_step(self, info: StepInfo) -> None:
        pass

    def around_model(self, call: Callable[[ModelCall], torch.Tensor], model_call: ModelCall) -> torch.Tensor:
        return call(model_call)


def transformer_patch_size(transformer: torch.nn.Module) -> tuple[int, int, int]:
    """The (t, h, w) latent positions one transformer token covers, from the model's config: Wan's `patch_size`
    triple, or HunyuanVideo's spatial `patch_size` with `patch_size_t`; (1, 1, 1) for a model that states none
    (tokens are then latent positions)."""
    config = getattr(transformer, "config", None)
    patch = getattr(config, "patch_size", None)
    if patch is None:
        return (1, 1, 1)
    if isinstance(patch, int):
        return (int(getattr(config, "patch_size_t", None) or 1), patch, patch)
    patch = tuple(int(p) for p in patch)[-3:]
    return (1,) * (3 - len(patch)) + patch


class DenoisingEngine:
    """Runs denoising loops over one transformer. `cfg_mode`: "batched" (prompt and negative prompt as one
    batch, one call a step) or "sequential" (one call per branch: less activation memory)."""

    def __init__(self, transformer: torch.nn.Module, cfg_mode: str = "batched", hooks: list | None = None):
        if cfg_mode not in ("batched", "sequential"):
            raise ValueError(f"cfg_mode must be 'batched' or 'sequential', got {cfg_mode!r}")
        self.transformer = transformer
        self.cfg_mode = cfg_mode
        self.hooks: list[EngineHook] = list(hooks or [])
        self._local = threading.local()  # the step this thread's loop is at (each request's loop is on its thread)
        # composer.parallel.cfg.CfgParallel (set by the parallel hook): each guidance branch on its own ranks
        self.branch_parallel = None
        self.scheduler: StepScheduler | None = None

    @property
    def _step(self) -> StepInfo | None:
        return getattr(self._local, "step", None)

    @_step.setter
    def _step(self, info: StepInfo | None) -> None:
        self._local.step = info

    def enable_scheduler(self, batching: bool = True, max_batch_size: int | None = None,
                         active_requests: Callable[[], int] | None = None,
                         max_batch_tokens: int | None = None, bucketed: bool = False) -> StepScheduler:
        """Let several requests use this engine at once: their transformer calls are queued, run one at a time,
        and (with `batching`, and batched CFG) compatible steps of different requests share one call, within
        `max_batch_size` videos and `max_batch_tokens` transformer tokens (counted with the transformer's
        patch size) per call; `bucketed` (torch.compile): only power-of-two videos per call, so the compiled
        graphs see a few batch sizes and stop recompiling once each has run."""
        self.scheduler = StepScheduler(self._run_unit, self._run_units, batching=batching and self.batched_cfg,
                                       max_batch_size=max_batch_size, max_batch_tokens=max_batch_tokens,
                                       patch_size=transformer_patch_size(self.transformer),
                                       active_requests=active_requests, bucketed=bucketed)
        return self.scheduler

    @property
    def batched_cfg(self) -> bool:
        """Guidance branches as one batch (not when CFG parallel puts them on different ranks)."""
        return self.cfg_mode == "batched" and self.branch_parallel is None

    def owns_branch(self, branch: int) -> bool:
        """Whether this process computes guidance branch `branch` (all of them, except under CFG parallel)."""
        return self.branch_parallel is None or self.branch_parallel.owns(branch)

    def add_hook(self, hook: EngineHook, order: Any = None) -> Any:
        """Attach `hook` to this engine's steps (composer.attach: placed by its order key; the Handle removes it)."""
        from composer.attach import attach

        return attach(self, hook, order=order, what=f"engine hook {type(hook).__name__}")

    # -- the model call ------------------------------------------------------------------------------
    def _call_transformer(self, call: ModelCall) -> torch.Tensor:
        model, inputs = self.transformer, call.inputs
        x, timestep = call.latents.to(model.dtype), call.timestep
        if inputs.condition is not None:  # image-to-video: [noisy latents, mask + encoded image] on the channel axis
            x = torch.cat([x, inputs.condition.to(model.dtype)], dim=1)
        prefix = 0
        if inputs.context is not None:  # the uncached causal reference: clean context frames first
            prefix = inputs.context.shape[2]
            x = torch.cat([inputs.context.to(model.dtype), x], dim=2)
            timestep = torch.cat([inputs.context_timestep, timestep], dim=1)
        out = model(x, timestep, **inputs.model_kwargs())
        return out[:, :, prefix:] if prefix else out

    def call_model(self, latents: torch.Tensor, timestep: torch.Tensor, inputs: ModelInputs,
                   kind: str = "step", branches: tuple[int, ...] = (0,)) -> torch.Tensor:
        """The one place a pipeline calls its transformer; `around_model` hooks wrap it. `branches`: the guidance
        branches the call's rows hold, in order."""
        call: Callable[[ModelCall], torch.Tensor] = self._call_transformer
        for hook in reversed(self.hooks):  # the first hook added is the outermost
            around = getattr(hook, "around_model", None)
            if around is not None:
                call = _wrap(around, call)
        return call(ModelCall(latents, timestep, inputs, kind, self._step, branches))

    def text_inputs(self, text: torch.Tensor, image: torch.Tensor | None = None,
                    **extra: torch.Tensor | None) -> ModelInputs:
        """Conditioning for a text embedding [B, L, D] (and an image model's CLIP image states): each block's
        cross-attention k/v computed once here and reused by every step (a model without `cross_attention_kv`
        gets the embeddings in every call). `extra`: ModelInputs' other conditioning fields (`text_mask`,
        `pooled_text`, `guidance`)."""
        if hasattr(self.transformer, "cross_attention_kv"):
            args = (text,) if image is None else (text, image)
            return ModelInputs(cross_kv=self.transformer.cross_attention_kv(*args), **extra)
        return ModelInputs(text=text, image=image, **extra)

    def forward_branches(self, latents: torch.Tensor, timestep: torch.Tensor, branches: list[ModelInputs],
                         kind: str = "step", merged: ModelInputs | None = None) -> list[torch.Tensor]:
        """The raw prediction of each branch: one batched call (cfg_mode batched) or one call per branch.
        `merged`: the branches already batched (a loop batches them once, not every step). With a scheduler the
        call is queued with other requests' and may share a transformer call with theirs."""
        if self.scheduler is None:
            return self._forward_branches(latents, timestep, branches, kind, merged)
        request = current_request() or RequestContext()
        return self.scheduler.submit(latents, timestep, branches, merged, kind, request, self._step)

    def _run_unit(self, unit: Unit) -> list[torch.Tensor]:
        """The scheduler runs a unit alone: exactly the call its request would make without a scheduler."""
        previous, self._step = self._step, unit.step
        try:
            with calling((unit.request,)):
                return self._forward_branches(unit.latents, unit.timestep, unit.branches, unit.kind, unit.merged)
        finally:
            self._step = previous

    def _run_units(self, units: list[Unit]) -> list[list[torch.Tensor]]:
        """The scheduler runs compatible units of several requests as one call: each unit's rows are what its own
        batched-CFG call would stack; the output is cut back into each unit's branches."""
        latents, timesteps, merged, rows = batched_branches(units)
        previous, self._step = self._step, units[0].step
        try:
            with calling(tuple(u.request for u in units)):
                branches = tuple(i for u in units for i in range(len(u.branches)))
                out = self.call_model(latents, timesteps, merged, units[0].kind, branches)
        finally:
            self._step = previous
        return [list(part.chunk(len(u.branches))) for u, part in zip(units, out.split(rows))]

    def _forward_branches(self, latents: torch.Tensor, timestep: torch.Tensor, branches: list[ModelInputs],
                          kind: str = "step", merged: ModelInputs | None = None) -> list[torch.Tensor]:
        if len(branches) == 1:
            if self.branch_parallel is not None:
                log_once(logger, "cfg-parallel-idle", "cfg_parallel is on but this request has no guidance "
                         "(guidance_scale <= 1): both rank groups compute the same single branch", logging.WARNING)
            return [self.call_model(latents, timestep, branches[0], kind)]
        if self.branch_parallel is not None:  # this rank's branch; a context pass's output is not used
            index = self.branch_parallel.index
            return self.branch_parallel.run(lambda b: self.call_model(latents, timestep, b, kind, (index,)),
                                            branches, exchange=kind != "context")
        if self.batched_cfg:
            n = len(branches)
            merged = merged if merged is not None else ModelInputs.batched(branches)
            out = self.call_model(torch.cat([latents] * n), torch.cat([timestep] * n), merged, kind, tuple(range(n)))
            return list(out.chunk(n))
        return [self.call_model(latents, timestep, b, kind, (i,)) for i, b in enumerate(branches)]

    def predict(self, latents: torch.Tensor, timestep: torch.Tensor, cond: ModelInputs,
                uncond: ModelInputs | None = None, guidance: ClassifierFreeGuidance | None = None,
                merged: ModelInputs | None = None) -> torch.Tensor:
        """The (guided) prediction for one step."""
        if guidance is None:
            return self.forward_branches(latents, timestep, [cond])[0]
        pred_cond, pred_uncond = self.forward_branches(latents, timestep, [cond, uncond], merged=merged)
        return guidance.combine(pred_cond, pred_uncond)

    # -- the loop ------------------------------------------------------------------------------------
    def run(
        self,
        latents: torch.Tensor,
        steps: StepRule,
        cond: ModelInputs,
        uncond: ModelInputs | None = None,
        guidance: ClassifierFreeGuidance | None = None,
        *,
        run: int = 0,
        progress: bool = False,
    ) -> torch.Tensor:
        """Every step of `steps` from `latents`; returns the final latents. The calling thread waits through each
        step (`run_task` is the same loop as a task, for the engine core)."""
        return drive(self.run_task(latents, steps, cond, uncond, guidance, run=run, progress=progress))

    def run_task(
        self,
        latents: torch.Tensor,
        steps: StepRule,
        cond: ModelInputs,
        uncond: ModelInputs | None = None,
        guidance: ClassifierFreeGuidance | None = None,
        *,
        run: int = 0,
        progress: bool = False,
    ) -> Generator[Any, Any, torch.Tensor]:
        """`run` as a task (composer/engine/loop.py): yields a ModelStep for each step's prediction and gets the
        branches' outputs back; returns the final latents."""
        if guidance is not None and uncond is None:
            raise ValueError("guidance needs the negative branch (uncond)")
        merged = ModelInputs.batched([cond, uncond]) if guidance is not None and self.batched_cfg else None
        request = current_request()
        with (nullcontext() if request is not None else running_request(RequestContext())) as made:
            request = request or made
            with self.scheduler.denoising(request) if self.scheduler is not None else nullcontext():
                return (yield from self._steps_task(latents, steps, cond, uncond, guidance, merged, run, progress))

    def _steps_task(self, latents, steps, cond, uncond, guidance, merged, run, progress):
        timesteps = steps.timesteps
        num_steps = len(timesteps)
        schedule = tuple(float(t) for t in timesteps)
        # closed (and cleared) even when a step raises, e.g. a cancelled request: no stale bar before its message;
        # runs in other threads at the same time share it (composer.logging.progress_bar)
        with progress_bar(num_steps, "denoising", "step", progress) as advance:
            for index, t in enumerate(timesteps):
                info = StepInfo(index, num_steps, float(t), run, latents, schedule)
                for hook in self.hooks:
                    if hasattr(hook, "before_step"):
                        wait = hook.before_step(info)
                        if is_wait(wait):  # a hook that waits for others (the rank protocol's sync point)
                            yield from wait_for(wait)
                model_timestep = steps.model_timestep(t, latents)
                if guidance is None or not guidance.active(index, num_steps):
                    pred = (yield from wait_for(ModelStep(self, latents, model_timestep, [cond], None, "step",
                                                          info)))[0]
                else:
                    pred_cond, pred_uncond = yield from wait_for(ModelStep(
                        self, latents, model_timestep, [cond, uncond], merged, "step", info))
                    pred = guidance.combine(pred_cond, pred_uncond)
                latents = steps.step(index, t, pred, latents)
                info.latents = latents
                for hook in self.hooks:
                    if hasattr(hook, "after_step"):
                        hook.after_step(info)
                advance()
        return latents


def _wrap(around, inner):
    def call(model_call: ModelCall) -> torch.Tensor:
        return around(inner, model_call)

    return call
