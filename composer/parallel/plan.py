"""PlanChannel: rank 0's step-scheduler plans to the other ranks of a parallel layout.

Under torchrun every rank makes the same generate_video / stream_video calls (from as many threads as it likes).
Each rank's step schedulers (composer/engine/scheduler.py; one per denoising engine, of every pipeline the process
loaded) would batch and order them by that rank's own threads' timing, and ranks whose transformer calls differ
hang in their collectives. So on rank 0 every scheduler's call is announced before it runs, one call at a time in
the process: (scheduler index, [(request key, position), ...]) broadcast on a gloo group of its own. On every
other rank an engine core (one at a time) takes the next plan and runs it on the scheduler it names, taking that
scheduler's pending units of the same requests at the same place once its threads have submitted them (the core
goes on with unplanned work meanwhile: a decode a thread waits for before it can submit the next step). The plans
are received by a thread of the channel's own, asked for one plan at a time while a unit of the rank waits: the
engine core never blocks in a receive, so its tasks go on while rank 0's next plan is on its way. A
request's key is a digest of its arguments (the same on every rank; two requests with equal keys make equal
calls, so either may stand for the other). Schedulers are numbered in the order the process made them, which is
the same on every rank (the same models loaded in the same order).
"""

from __future__ import annotations

import enum
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


class Follow(enum.Enum):
    """What `PlanChannel.follow` did."""

    RAN = "a plan's batch ran"
    NOTHING = "no plan outstanding and no unit of this rank waits"
    WAITING = "a plan waits for units this rank's threads have not queued yet (a unit queued wakes its core)"
    RECEIVING = "the channel's receiver waits for rank 0's next plan (its arrival wakes the core)"
    BUSY = "another core of this process holds the channel (look again soon)"


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
        self._next: tuple[Any, list, float] | None = None  # (another rank) a plan received, waiting for its units
        self._init_receiver()

    def _init_receiver(self) -> None:
        """(Another rank) the receiver thread's state: asked for one plan at a time; what it got, and whom to wake."""
        self._cv = threading.Condition()
        self._asked = False
        self._inbox: tuple[Any, Any] | None = None  # (plan, None) or (None, the receive's error)
        self._wakers: list[Callable[[], None]] = []
        self._receiver: threading.Thread | None = None

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

    def follow(self, stop: Callable[[], bool], wake: Callable[[], None] | None = None) -> Follow:
        """Another rank (its engine cores' call, any of them): run rank 0's next plan once this rank's threads have
        submitted every unit it names. When no plan is outstanding and `stop()` is False (a unit of this rank waits),
        asks the receiver thread for the next one and returns RECEIVING (`wake()` is called when it has come); never
        waits for a plan or for the units themselves, so the core goes on with the work no plan orders (an unplanned
        queue's batch, a task) meanwhile. A plan whose units have not all come `timeout_s` after it arrived is a
        WorkerError (the ranks' calls differ), never a hang; so is a receive that failed (rank 0 is gone)."""
        if not self._turn.acquire(blocking=False):
            return Follow.BUSY
        try:
            if self._next is None:
                with self._cv:
                    if self._inbox is None:
                        if self._asked:
                            if wake is not None and wake not in self._wakers:
                                self._wakers.append(wake)
                            return Follow.RECEIVING
                        if stop():
                            return Follow.NOTHING
                        self._ask(wake)
                        return Follow.RECEIVING
                    received, error = self._inbox
                    self._inbox = None
                if error is not None:
                    raise error
                index, plan = received
                self._next = (self.schedulers[index], [_plain(p) for p in plan], time.monotonic() + self.timeout_s)
            queue, plan, deadline = self._next
            batch = queue.take_planned(plan)
            if batch is None:
                if time.monotonic() > deadline:
                    self._next = None
                    from composer.errors import WorkerError

                    raise WorkerError(f"rank 0 ran {queue.what} this rank has not made (after {self.timeout_s:.0f} "
                                      "s): every rank must make the same generate_video / stream_video calls with the "
                                      "same arguments")
                return Follow.WAITING
            self._next = None
            queue.run_taken(batch)
            return Follow.RAN
        finally:
            self._turn.release()

    @property
    def outstanding(self) -> bool:
        """Whether a plan was received (or is being received) whose units this rank has not all submitted yet."""
        return self._next is not None or self._asked or self._inbox is not None

    def _ask(self, wake: Callable[[], None] | None) -> None:
        """(self._cv held) The receiver thread receives the next plan."""
        self._asked = True
        if wake is not None:
            self._wakers.append(wake)
        if self._receiver is None:
            self._receiver = threading.Thread(target=self._receive, name="composer-plan-receiver", daemon=True)
            self._receiver.start()
        self._cv.notify_all()

    def _receive(self) -> None:
        while True:
            with self._cv:
                while not self._asked:
                    self._cv.wait()
            try:
                got: tuple[Any, Any] = (self._share(None), None)
            except BaseException as exc:  # noqa: BLE001 - rank 0 gone or the group timed out: the followers' error
                got = (None, exc)
            with self._cv:
                self._inbox, self._asked = got, False
                wakers, self._wakers = self._wakers, []
            for wake in wakers:
                wake()


def match_planned(pending: list, plan: list, name_of: Callable[[Any], Any]) -> tuple[list, list] | None:
    """The items of `pending` rank 0's plan names, in its order (`name_of(item)` is an item's name in a plan):
    (the chosen items, the rest of `pending`), or None while one is missing."""
    chosen: list = []
    for name in plan:
        match = next((item for item in pending if name_of(item) == name and all(item is not c for c in chosen)), None)
        if match is None:
            return None
        chosen.append(match)
    taken = {id(item) for item in chosen}
    return chosen, [item for item in pending if id(item) not in taken]


def _plain(name: Any) -> Any:
    """A plan entry as sent (lists after the trip through the channel) compared as the tuple it was."""
    return tuple(_plain(v) for v in name) if isinstance(name, list) else name
