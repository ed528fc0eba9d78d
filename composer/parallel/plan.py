"""PlanChannel: rank 0's step-scheduler plans to the other ranks of a parallel layout.

Under torchrun every rank makes the same generate_video / stream_video calls (from as many threads as it likes).
Each rank's step schedulers (composer/engine/scheduler.py; one per denoising engine, of every pipeline the process
loaded) would batch and order them by that rank's own threads' timing, and ranks whose transformer calls differ
hang in their collectives. So on rank 0 every scheduler's call is announced before it runs, one call at a time in
the process: (scheduler index, [(request key, position), ...]) broadcast on a gloo group of its own. On every
other rank one waiting thread at a time receives the next plan and runs it on the scheduler it names, taking that
scheduler's pending units of the same requests at the same place (waiting for its threads to submit them). A
request's key is a digest of its arguments (the same on every rank; two requests with equal keys make equal
calls, so either may stand for the other). Schedulers are numbered in the order the process made them, which is
the same on every rank (the same models loaded in the same order).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

_channel: PlanChannel | None = None
_made = threading.Lock()


def plan_channel(timeout_s: float) -> PlanChannel:
    """The process's channel (made on first use: every rank makes it at the same point, loading its models)."""
    global _channel
    with _made:
        if _channel is None or _channel.world_group is not dist.group.WORLD:  # a new process group: a new channel
            _channel = PlanChannel(timeout_s)
        return _channel


class PlanChannel:
    def __init__(self, timeout_s: float):
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.world_group = dist.group.WORLD
        self.leader = self.rank == 0
        self.timeout_s = float(timeout_s)
        # its own group: plans never interleave with the model's collectives on the layout's groups
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
        self.schedulers: list[Any] = []
        self._turn = threading.Lock()  # one call at a time in this process, in plan order

    def register(self, scheduler: Any) -> None:
        scheduler.planner = self
        scheduler.plan_index = len(self.schedulers)
        self.schedulers.append(scheduler)

    def _share(self, plan: Any) -> Any:
        box = [plan if self.leader else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def lead(self, scheduler: Any, plan: list, run: Callable[[], None]) -> None:
        """Rank 0: announce `scheduler`'s next call, then run it, before any other call of this process."""
        with self._turn:
            self._share((scheduler.plan_index, plan))
            run()

    def follow_once(self, stop: Callable[[], bool]) -> bool:
        """Another rank: if no other thread is receiving, receive rank 0's next plan and run it (True); False when
        another thread has the channel. `stop()` is asked once the channel is ours: True skips receiving (the
        caller's unit was run meanwhile)."""
        if not self._turn.acquire(blocking=False):
            return False
        try:
            if stop():
                return True
            index, plan = self._share(None)
            self.schedulers[index].run_planned(plan)
            return True
        finally:
            self._turn.release()


def take_planned(pending: list, plan: list, name_of: Callable[[Any], Any], cv: Any, timeout_s: float,
                 what: str) -> tuple[list, list]:
    """(`cv`'s lock held; a rank other than 0) The items of `pending` rank 0's plan names, in its order (`name_of(item)`
    is an item's name in a plan), waiting on `cv` for this rank's threads to submit them; returns (the chosen items,
    the rest of `pending`). A plan naming work this rank never gets is a WorkerError after `timeout_s` (the ranks'
    calls differ), never a hang; `what` says what rank 0 ran ("a step of a request")."""
    deadline = time.monotonic() + timeout_s
    while True:
        chosen: list = []
        for name in plan:
            match = next((item for item in pending if name_of(item) == name and all(item is not c for c in chosen)),
                         None)
            if match is None:
                break
            chosen.append(match)
        if len(chosen) == len(plan):
            taken = {id(item) for item in chosen}
            return chosen, [item for item in pending if id(item) not in taken]
        if time.monotonic() > deadline:
            from composer.errors import WorkerError

            raise WorkerError(f"rank 0 ran {what} this rank has not made (after {timeout_s:.0f} s): every rank must "
                              "make the same generate_video / stream_video calls with the same arguments")
        cv.wait(timeout=0.05)
