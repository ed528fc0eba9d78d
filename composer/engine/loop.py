"""Requests as tasks: a request's state is a suspended Python generator, advanced one unit at a time by one loop.

A *task* is a generator that yields what it waits for, and reads the answer from that object once resumed:

    step = ModelStep(engine, latents, timestep, branches, merged, kind, step_info)
    yield step; pred = step.outcome()                 # a transformer unit (or: pred = yield from wait_for(step))
    work = Blocking(fn)
    yield work; value = work.outcome()                # other work (a stage, a decode, a file)

The answer travels on the object (`result`, or `error`, which `outcome()` raises where the task waits), so a
wait can pass unchanged through generators that only relay it: a causal stream's blocks go through the decoding
stage's `for block in upstream` loop, which yields the waits it meets as they are.

`drive(task)` runs a task on the calling thread: each ModelStep goes to its engine at once (queued on the engine's step
scheduler when there is one, this thread waiting for the engine core to run it), each Blocking runs inline: a
pipeline whose requests cannot be tasks (model offload, a parallel layout) runs this way.

`EngineCore` (composer/engine/core.py) runs many tasks on one thread, none of them holding a thread between units:
- a ModelStep is queued on its engine's scheduler (`StepScheduler.enqueue`), and the core runs the scheduler's
  batches: compatible units of every task (and of any thread waiting on a unit meanwhile) share transformer calls,
  so each output is the one a lone call makes;
- a Blocking (text encoding, the VAE decode, writing a file) runs on the core's stage threads (`stage_threads`),
  which a task holds only while that work runs;
- an Admit (a memory reservation, KV pages, a place on the pipeline: composer/admission.py) is a ticket the core
  holds and polls when its queue changes: no thread waits for it;
- each resumption runs with the task's RequestContext as the thread's request (its cancel token, its priority) and
  under `torch.inference_mode`.

`VideoGenerator.generate_video` / `submit_video` / `agenerate_video`, `VideoStream.next_task` and `composer serve`'s
jobs and streams run this way.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import torch

from composer.engine.scheduler import RequestContext
from composer.logging import get_logger

logger = get_logger(__name__)

Task = Generator[Any, Any, Any]


class Wait:
    """What a task waits for; whoever does it sets `result` or `error`, then the task reads `outcome()`."""

    result: Any = None
    error: BaseException | None = None

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.result

    def run_here(self, request: RequestContext) -> None:
        """Do it on this thread, now; the answer (or the error) on the object."""
        try:
            self.result = self._run(request)
        except BaseException as exc:  # noqa: BLE001 - the task's, raised where it waits
            self.error = exc

    def _run(self, request: RequestContext) -> Any:
        raise NotImplementedError


def wait_for(item: Wait):
    """In a task: `value = yield from wait_for(item)`."""
    yield item
    return item.outcome()


def is_wait(item: Any) -> bool:
    return isinstance(item, Wait)


@dataclass(eq=False)
class ModelStep(Wait):
    """A task waits for its engine's transformer to predict its guidance branches (one output per branch)."""

    engine: Any  # composer.engine.engine.DenoisingEngine
    latents: torch.Tensor
    timestep: torch.Tensor
    branches: list
    merged: Any
    kind: str
    step: Any

    @torch.inference_mode()
    def _run(self, request: RequestContext) -> list[torch.Tensor]:
        """On the calling thread (a task driven by `drive`): what a thread-per-request loop does (under inference
        mode, as every transformer call is)."""
        engine = self.engine
        if engine.scheduler is None:
            previous, engine._step = engine._step, self.step
            try:
                return engine._forward_branches(self.latents, self.timestep, self.branches, self.kind, self.merged)
            finally:
                engine._step = previous
        return engine.scheduler.submit(self.latents, self.timestep, self.branches, self.merged, self.kind, request,
                                       self.step)


@dataclass(eq=False)
class Queued(Wait):
    """A task waits for a unit of a unit queue other than a step scheduler (a text model's forward: its
    ForwardBatcher, a CallBatcher): `queue.enqueue(*args, on_done=...)` on the engine core, which runs the queue's
    batches; driven on a thread, `queue.submit(*args)` (the thread waits for the core to run it)."""

    queue: Any  # composer.engine.batcher.CallBatcher
    args: tuple

    def _run(self, request: RequestContext) -> Any:
        return self.queue.submit(*self.args)


@dataclass(eq=False)
class Blocking(Wait):
    """A task waits for `fn()` (work that is not a transformer unit: a stage, a file write), which runs on the
    engine core's stage threads. It must not wait for other requests (they may need those threads): waiting for a
    shared resource is an `Admit`."""

    fn: Callable[[], Any]

    def _run(self, request: RequestContext) -> Any:
        return self.fn()


@dataclass(eq=False)
class Admit(Wait):
    """A task waits for a grant of an admission queue (composer/admission.py: a memory reservation, KV pages, a
    place on the pipeline), in the queue's priority and arrival order. The engine core holds its ticket and polls
    it whenever the queue changes: no thread waits for it. Driven on a thread, the thread waits (`queue.wait`).
    A cancel of `cancel` meanwhile ends the wait with Cancelled."""

    queue: Any  # composer.admission.AdmissionQueue
    need: Any
    priority: int = 0
    cancel: Any = None
    ticket: Any = None

    def _run(self, request: RequestContext) -> Any:
        return self.queue.wait_for(self.need, self.priority, self.cancel, owner=request)


def admitted(queue: Any, need: Any, priority: int = 0, cancel: Any = None):
    """In a task: `grant = yield from admitted(queue, need, priority, cancel)`: the grant at once when nobody waits
    ahead and the policy gives it now (`take_now`), else after waiting in the queue (`Admit`)."""
    grant = queue.take_now(need, priority)
    if grant is None:
        grant = yield from wait_for(Admit(queue, need, priority, cancel))
    return grant


def drive(task: Task, request: RequestContext | None = None) -> Any:
    """Run `task` to its end on this thread (each thing it waits for is done here, now); its return value."""
    from composer.engine.scheduler import current_request

    while True:
        try:
            item = next(task)
        except StopIteration as stop:
            return stop.value
        if not isinstance(item, Wait):
            task.close()
            raise TypeError(f"a task yielded {type(item).__name__}; expected a Wait (ModelStep, Queued, Blocking, Admit)")
        item.run_here(request or current_request() or RequestContext())
