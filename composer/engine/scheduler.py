"""StepScheduler: many requests' denoising steps through one transformer, batched per step.

Every transformer call of a denoising engine is a *unit* (one step's guidance branches, or a causal context pass)
queued here, by a task of the engine core (`enqueue`) or by a thread that waits for its result (`submit`). The
scheduler is the policy of a unit queue (composer/engine/batcher.py `UnitQueue`); the model's engine core
(composer/engine/core.py) is the one executor that runs its calls, one iteration at a time:

    pick      the first pending unit in pick order (highest priority; among equals, realtime streams whose next
              frames are due, earliest deadline first; then the oldest), and every other pending unit whose call
              is compatible with it (same kind, latent shape, dtype, conditioning layout; causal passes: KV caches
              showing the same frames), in the same order, up to `max_batch_size` videos and `max_batch_tokens`
              transformer tokens (a unit over a budget on its own still runs, alone)
    run       one transformer call over all their rows (each row its own timestep and text K/V), or the unit's
              own call when it is alone: exactly what a solo request runs
    hand out  each unit its rows; guidance is combined by each request with its own scale

A step starts only when every request inside a denoising loop has its next unit ready (or after `gather_s`), and,
while other requests of the pipeline may queue a unit soon (`active_requests`: the busy ones less those whose decode
is queued or running), a little later (`settle_s`, at most a quarter of a recent call's time), so requests that run
in step converge on one call per step. Priorities act at unit boundaries: a higher-priority
request's unit is picked first and a running call is never interrupted, so nothing is recomputed. A realtime
stream (RequestContext.target_fps) carries a deadline, when its next frames are due; once it has come, the stream's
units go before the other units of its priority (never before a higher priority): `pick_order`.

Budgets: `max_batch_size` counts videos (a unit's latent rows; a CFG pair is one video), `max_batch_tokens` counts
transformer tokens (`token_count`: rows with their guidance branches x latent positions after patchify with the
transformer's patch size). Partners join the first unit only while both budgets hold; the first unit itself always
runs, alone if it is over a budget by itself. Under a memory budget (`call_memory`: composer.memory.admission) a
partner also joins only while the call's predicted activations fit beside what the running requests hold.

Exactness: rows of one batch do not interact in the transformer (attention and norms are per row), so a request's
output equals its solo run up to the floating-point order of a larger matrix product (tests: latents <= 1e-5).
`batching=False` keeps the interleaving (and priorities) with one unit per call: bit-identical to solo runs.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from composer.engine.batcher import UnitQueue
from composer.engine.inputs import ModelInputs
from composer.logging import get_logger

logger = get_logger(__name__)

CALL_POLL_S = 0.005  # a call held back for another scheduler's call (memory_budget) is looked at again this soon

def request_key(*parts: Any) -> str:
    """A digest of a request's arguments, equal on every rank that makes the same call (object addresses, which
    differ between processes, never enter it): rank 0's step plans name requests by it (composer/parallel/plan.py)."""
    import hashlib

    import numpy as np

    digest = hashlib.sha1()

    def feed(value: Any) -> None:
        if value is None or isinstance(value, (bool, int, float, str)):
            digest.update(repr(value).encode())
        elif isinstance(value, (list, tuple)):
            digest.update(b"[")
            for v in value:
                feed(v)
            digest.update(b"]")
        elif isinstance(value, dict):
            for k in sorted(value, key=str):
                feed(str(k))
                feed(value[k])
        elif isinstance(value, torch.Tensor):
            digest.update(f"{value.dtype}{tuple(value.shape)}".encode())
            digest.update(value.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())
        elif isinstance(value, np.ndarray):
            digest.update(np.ascontiguousarray(value).tobytes())
        elif hasattr(value, "tobytes") and hasattr(value, "size"):  # a PIL image
            digest.update(value.tobytes())
        elif dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                feed(f.name)
                feed(getattr(value, f.name))
        else:
            digest.update(type(value).__name__.encode())

    for part in parts:
        feed(part)
    return digest.hexdigest()


# -- the request a thread is running -------------------------------------------------------------------------


@dataclass
class RequestContext:
    """What the scheduler knows of the request running on this thread."""

    priority: int = 0
    cancel: Any = None  # composer.cancel.CancelToken
    id: int = field(default_factory=itertools.count().__next__)
    # The request's identity on every rank of a parallel layout (a digest of its arguments): rank 0's plans name
    # units by it, since each rank numbers its own requests (`id`) in the order its threads happen to start.
    key: str = ""
    # A realtime stream (stream_video(target_fps=...)): the frame rate it states, and when (time.monotonic()) its
    # next frames are due: once a deadline has come, its units go before the waiting units of its priority.
    target_fps: float | None = None
    deadline: float | None = None
    # a background task (submit_video, a server's job): no per-step progress bar on the console
    background: bool = False
    # the request's reservation of a shared memory budget (composer.memory.admission), which `call_memory` reads
    memory: Any = None

    def due(self, now: float) -> bool:
        """Whether this request is a realtime stream whose next frames are due (or late) at `now`."""
        return self.deadline is not None and self.deadline <= now


_local = threading.local()


def current_request() -> RequestContext | None:
    """The request running on this thread (None outside a generator call)."""
    return getattr(_local, "request", None)


@contextmanager
def running_request(context: RequestContext) -> Iterator[RequestContext]:
    """Make `context` this thread's request for the duration."""
    previous = getattr(_local, "request", None)
    _local.request = context
    try:
        yield context
    finally:
        _local.request = previous


_calling = threading.local()


def calling_requests() -> tuple[RequestContext, ...] | None:
    """The requests whose rows the transformer call running on this thread holds (None: not inside a scheduled
    call; the thread's own request is the one running)."""
    return getattr(_calling, "requests", None)


class calling:  # noqa: N801 - used as a context manager
    """Mark the requests a scheduled transformer call on this thread runs for (what cancel points check)."""

    def __init__(self, requests: tuple[RequestContext, ...]):
        self.requests = requests

    def __enter__(self):
        self.previous = getattr(_calling, "requests", None)
        _calling.requests = self.requests

    def __exit__(self, *exc):
        _calling.requests = self.previous


# -- units and their compatibility ---------------------------------------------------------------------------


def _shape_key(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape[1:]), value.dtype, str(value.device))
    if isinstance(value, (list, tuple)):
        return tuple(_shape_key(v) for v in value)
    if isinstance(value, dict):  # ModelInputs.extra: a family's own inputs by name
        return tuple(sorted((name, _shape_key(v)) for name, v in value.items()))
    return ("unbatchable", id(value))


def batch_key(latents: torch.Tensor, timestep: torch.Tensor, branches: list[ModelInputs], kind: str) -> Any:
    """Units with equal keys can share one transformer call (None: this unit always runs alone)."""
    first = branches[0]
    if any(b.attn_mask is not None or b.context is not None for b in branches):
        return None  # the uncached causal reference: a mask and clean context frames of its own
    cache = None
    if first.kv_cache is not None:
        from composer.cache.kv_cache import KVCache, KVCacheGroup

        if not isinstance(first.kv_cache, KVCache) or any(b.kv_cache is not first.kv_cache for b in branches):
            return None  # branches with caches of their own (sequential CFG) or a cache we do not know
        cache = KVCacheGroup.signature(first.kv_cache, first.frame_offset, latents.shape[2])
    fields = ("text", "cross_kv", "image", "condition", "text_mask", "pooled_text", "guidance", "text_2",
              "text_mask_2", "extra")
    layout = tuple(tuple(_shape_key(getattr(b, f)) for f in fields) for b in branches)
    return (kind, _shape_key(latents), _shape_key(timestep), len(branches), first.frame_offset, cache, layout)


def token_count(latents: torch.Tensor, branches: int, patch_size: tuple[int, ...]) -> int:
    """Transformer tokens of a call over `latents` [B, C, F, H, W] with `branches` guidance branches: rows
    (B x branches) x the latents' positions after patchify (each axis divided by its patch size, the trailing
    axes matched to `patch_size` (t, h, w)). What `max_batch_tokens` counts."""
    axes = tuple(latents.shape[2:])
    patch = tuple(patch_size)[-len(axes):] if axes else ()
    patch = (1,) * (len(axes) - len(patch)) + patch
    per_row = 1
    for n, p in zip(axes, patch):
        per_row *= max(1, int(n) // max(1, int(p)))
    return int(latents.shape[0]) * branches * per_row


@dataclass(eq=False)  # compared by identity (its tensors have no truth value)
class Unit:
    """One request's transformer work for a step: its guidance branches over `latents` (rows [B, ...])."""

    latents: torch.Tensor
    timestep: torch.Tensor
    branches: list[ModelInputs]
    merged: ModelInputs | None
    kind: str
    request: RequestContext
    key: Any
    seq: int
    arrived: float
    step: Any = None  # the engine's StepInfo for this unit
    tokens: int = 0  # transformer tokens of its call (token_count): what max_batch_tokens bounds
    result: list[torch.Tensor] | None = None
    error: BaseException | None = None
    done: bool = False
    # called (lock held: quick, no scheduler calls) once the unit is done, for a request that waits for it
    # without a thread (a task of composer/engine/loop.py); None: a thread waits in `submit`
    on_done: Callable[[Unit], None] | None = None

    @property
    def videos(self) -> int:
        return int(self.latents.shape[0])


@dataclass
class SchedulerStats:
    """Counts since the scheduler was made: transformer calls, units run and how many shared a call."""

    calls: int = 0
    units: int = 0
    batched_units: int = 0  # units that ran together with at least one other
    largest_batch: int = 0  # most units in one call
    settle_seconds: float = 0.0  # time ready calls were held back for requests outside a loop (`settle_s`)


class StepScheduler(UnitQueue):
    """Runs the transformer calls of every request using one denoising engine (see the module docstring).

    `run_solo(unit)` runs one unit exactly as a request alone would; `run_batch(units)` runs several compatible
    units as one call and returns each unit's branch outputs.
    """

    def __init__(self, run_solo: Callable[[Unit], list[torch.Tensor]],
                 run_batch: Callable[[list[Unit]], list[list[torch.Tensor]]], *, batching: bool = True,
                 max_batch_size: int | None = None, max_batch_tokens: int | None = None,
                 patch_size: tuple[int, ...] = (1, 1, 1), gather_s: float = 0.05, settle_s: float = 0.005,
                 active_requests: Callable[[], int] | None = None, bucketed: bool = False):
        self.run_solo = run_solo
        self.run_batch = run_batch
        self.batching = batching
        self.max_batch_size = max_batch_size  # videos in one call (a unit's rows / its branches)
        self.max_batch_tokens = max_batch_tokens  # transformer tokens in one call (Unit.tokens)
        self.bucketed = bucketed  # compile: power-of-two videos per call (few graphs, no steady-state recompiles)
        self.planner: Any = None  # a parallel layout's PlanChannel (composer/parallel/plan.py): rank 0 plans
        # a memory budget's admission (composer.memory.admission.MemoryAdmission): `admits(self, units)` says
        # whether a call over `units` fits, `started(self, units)` / `ended(self)` count the call while it runs
        self.call_memory: Any = None
        self.patch_size = tuple(patch_size)  # (t, h, w) latent positions per token, for Unit.tokens
        self.gather_s = gather_s
        self.settle_s = settle_s
        self.active_requests = active_requests
        self.call_seconds = 0.0  # a running average of the calls' time: settling never costs more than 1/4 of one
        self.stats = SchedulerStats()
        self._cv = threading.Condition()
        self._pending: list[Unit] = []
        self._in_loop: dict[int, int] = {}  # request id -> nesting depth of its denoising loops
        self._running = False
        self._settling: float | None = None  # since when the ready call waits for requests outside a loop
        self._seq = itertools.count()

    # -- which requests are denoising -------------------------------------------------------------------
    @contextmanager
    def denoising(self, request: RequestContext) -> Iterator[None]:
        """While a request is inside a denoising loop the runner waits for its next unit before starting a step."""
        with self._cv:
            self._in_loop[request.id] = self._in_loop.get(request.id, 0) + 1
        try:
            yield
        finally:
            with self._cv:
                depth = self._in_loop.pop(request.id) - 1
                if depth:
                    self._in_loop[request.id] = depth
                self._cv.notify_all()
            self._wake_core()  # the others' step may be due now

    # -- holding: units count per request ---------------------------------------------------------------
    def pending_count(self) -> int:
        return len({u.request.id for u in self._pending})

    # -- submitting ---------------------------------------------------------------------------------------
    def _unit(self, latents, timestep, branches, merged, kind, request, step, on_done=None) -> Unit:
        key = batch_key(latents, timestep, branches, kind) if self.batching else None
        return Unit(latents, timestep, branches, merged, kind, request, key, next(self._seq), time.monotonic(), step,
                    tokens=token_count(latents, len(branches), self.patch_size), on_done=on_done)

    def submit(self, latents: torch.Tensor, timestep: torch.Tensor, branches: list[ModelInputs],
               merged: ModelInputs | None, kind: str, request: RequestContext, step: Any = None) -> list[torch.Tensor]:
        """Queue this thread's unit and return its branch outputs once a call has run it (run by the engine core;
        this thread only waits)."""
        unit = self._unit(latents, timestep, branches, merged, kind, request, step)
        with self._cv:
            self._queue(unit)
            self._await(unit)
        if unit.error is not None:
            raise unit.error
        assert unit.result is not None
        return unit.result

    def enqueue(self, latents: torch.Tensor, timestep: torch.Tensor, branches: list[ModelInputs],
                merged: ModelInputs | None, kind: str, request: RequestContext, step: Any,
                on_done: Callable[[Unit], None]) -> Unit:
        """Queue a unit without waiting for it: `on_done(unit)` is called once it has run (its `result` or
        `error` set), from the thread that ran it (the engine core's)."""
        unit = self._unit(latents, timestep, branches, merged, kind, request, step, on_done)
        with self._cv:
            self._queue(unit)
        return unit

    def due(self) -> float | None:
        """0: a call should start now; else how long to wait (None: until woken)."""
        if self._holds:
            return None
        wait = self._wait_to_gather()
        if wait == 0.0 and self.call_memory is not None and not self.call_memory.admits(
                self, [self._first(time.monotonic())]):
            return CALL_POLL_S  # another scheduler's call holds the memory this one's first unit needs
        return wait

    def _wait_to_gather(self) -> float | None:
        """`_wait_before_running` before the memory rule: when the requests in step have their units here."""
        if self._running or not self._pending:
            return None
        waiting = {u.request.id for u in self._pending}
        now = time.monotonic()
        waited = now - min(u.arrived for u in self._pending)
        if any(u.request.due(now) for u in self._pending):
            return 0.0  # a realtime stream is behind its frame rate: its call goes now, with whoever is here
        if all(rid in waiting for rid in self._in_loop):
            # Every request in a loop is here. Requests of the pipeline outside a loop (between a stream's blocks,
            # just done decoding) may be about to submit: give them `settle_s` to join this call.
            others = (self.active_requests() if self.active_requests is not None else 0) - len(waiting)
            settle = min(self.settle_s, 0.25 * self.call_seconds)
            if others > 0 and waited < settle:
                if self._settling is None:
                    self._settling = time.monotonic()
                return settle - waited
            return 0.0
        left = self.gather_s - waited
        return 0.0 if left <= 0 else left

    @staticmethod
    def pick_order(unit: Unit, now: float) -> tuple:
        """The sort key of the pending units: higher priority first; among equal priorities the units of realtime
        streams whose next frames are due at `now` (RequestContext.deadline <= now), earliest deadline first;
        then the rest (streams not yet due among them) by arrival."""
        request = unit.request
        if request.due(now):
            return (-request.priority, 0, request.deadline, unit.seq)
        return (-request.priority, 1, 0.0, unit.seq)

    def _pick(self, now: float | None = None) -> list[Unit]:
        """Take the next call's units off the queue: the first in pick order, and the compatible units after it
        (same batch key) that fit both budgets, in pick order. The first always runs, even when it alone is over
        a budget (a unit larger than max_batch_tokens runs alone rather than never)."""
        now = time.monotonic() if now is None else now
        ordered = sorted(self._pending, key=lambda u: self.pick_order(u, now))
        first = self._first(now, ordered)
        chosen = [first]
        if first.key is not None:
            videos, tokens = first.videos, first.tokens
            for unit in ordered:
                if unit is first or unit.key != first.key:
                    continue
                if self.max_batch_size is not None and videos + unit.videos > self.max_batch_size:
                    continue
                if self.max_batch_tokens is not None and tokens + unit.tokens > self.max_batch_tokens:
                    continue
                if self.call_memory is not None and not self.call_memory.admits(self, [*chosen, unit]):
                    continue  # its activations would not fit beside the others' (memory_budget)
                chosen.append(unit)
                videos += unit.videos
                tokens += unit.tokens
        if self.bucketed:
            while len(chosen) > 1 and not _power_of_two(sum(u.videos for u in chosen)):
                chosen.pop()  # the last ones wait for the next call
        taken = {id(u) for u in chosen}
        self._pending = [u for u in self._pending if id(u) not in taken]
        return chosen

    def _first(self, now: float, ordered: list[Unit] | None = None) -> Unit:
        """The unit the next call is made around: the first pending one in pick order, except that a causal pass one
        unit ahead of another stream's waits for it to catch up (`_behind`)."""
        if ordered is None:
            ordered = sorted(self._pending, key=lambda u: self.pick_order(u, now))
        return next((u for u in ordered if not any(_behind(v, u) for v in self._pending)), ordered[0])

    def take(self) -> list[Unit]:
        """(Lock held) The next call's units, off the queue; the call is counted against a memory budget."""
        units = self._pick()
        self._running = True
        if self.call_memory is not None:
            self.call_memory.started(self, units)
        if self._settling is not None:
            self.stats.settle_seconds += time.monotonic() - self._settling
            self._settling = None
        return units

    def plan_name(self, unit: Unit) -> tuple:
        return unit.request.key, plan_position(unit)

    what = "a step of a request"

    def execute(self, units: list[Unit]) -> None:
        """Run `units` as one call (no lock held) and give each its result, or every one the call's error."""
        started = time.perf_counter()
        try:
            if len(units) == 1:
                results = [self.run_solo(units[0])]
            else:
                results = self.run_batch(units)
            for unit, result in zip(units, results):
                unit.result = result
        except BaseException as exc:  # noqa: BLE001 - every unit of the failed call gets the error
            for unit in units:
                unit.error = exc
        elapsed = time.perf_counter() - started
        self.call_seconds = elapsed if not self.stats.calls else 0.8 * self.call_seconds + 0.2 * elapsed

    def finish(self, units: list[Unit]) -> None:
        """(Lock held) Count the call, mark its units done, wake their threads and the listeners."""
        if self.call_memory is not None:
            self.call_memory.ended(self)
        self._running = False
        for unit in units:
            unit.done = True
            if unit.on_done is not None:
                try:
                    unit.on_done(unit)
                except Exception:  # noqa: BLE001 - a waiter's callback must not break the call's other units
                    logger.exception("a unit's completion callback failed")
        self.stats.calls += 1
        self.stats.units += len(units)
        if len(units) > 1:
            self.stats.batched_units += len(units)
        self.stats.largest_batch = max(self.stats.largest_batch, len(units))
        self._cv.notify_all()


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def plan_position(unit: Unit) -> tuple:
    """Where a unit is in its request, the same on every rank: kind, first frame, loop run and step index."""
    step = unit.step
    return (unit.kind, unit.branches[0].frame_offset, -1 if step is None else step.run,
            -1 if step is None else step.index)


def _position(unit: Unit) -> tuple[int, int]:
    """Where a causal unit is in its stream: (first frame, step index; a clean/context pass after every step)."""
    step = unit.step if unit.kind == "step" else None
    return unit.branches[0].frame_offset, (step.index if step is not None else 1 << 30)


def _behind(other: Unit, unit: Unit) -> bool:
    """Whether `other` (another request's causal pass) is at most one block behind `unit` in the same kind of
    stream: `unit` then waits one iteration so `other` catches up and their next passes share a call (two
    streams one pass apart would otherwise alternate forever). Further apart, nobody waits (no starvation)."""
    if other.request.id == unit.request.id or other.request.priority != unit.request.priority:
        return False
    if unit.branches[0].kv_cache is None or other.branches[0].kv_cache is None:
        return False
    if other.latents.shape != unit.latents.shape or len(other.branches) != len(unit.branches):
        return False
    mine, theirs = _position(unit), _position(other)
    return theirs < mine and mine[0] - theirs[0] <= unit.latents.shape[2]


def batched_branches(units: list[Unit]) -> tuple[torch.Tensor, torch.Tensor, ModelInputs, list[int]]:
    """The units' rows as one call: latents and timesteps stacked branch by branch within each unit (what a
    unit's own batched-CFG call stacks), the conditioning batched the same way (causal units: their KV caches as
    one KVCacheGroup, each cache keeping its own rows), and each unit's row count."""
    import dataclasses

    latents, timesteps, rows = [], [], []
    for unit in units:
        n = len(unit.branches)
        latents += [unit.latents] * n
        timesteps += [unit.timestep] * n
        rows.append(unit.latents.shape[0] * n)
    if units[0].branches[0].kv_cache is None:
        merged = ModelInputs.batched([b for u in units for b in u.branches])
    else:
        from composer.cache.kv_cache import KVCacheGroup

        per_unit = [u.merged if u.merged is not None else ModelInputs.batched(u.branches) for u in units]
        merged = ModelInputs.batched([dataclasses.replace(m, kv_cache=None) for m in per_unit])
        merged = dataclasses.replace(merged, kv_cache=KVCacheGroup([m.kv_cache for m in per_unit]))
    return torch.cat(latents), torch.cat(timesteps), merged, rows
