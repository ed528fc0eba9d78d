"""One admission queue: who gets a shared resource next (a memory budget, KV pages, a place on the pipeline).

Requests ask in priority order, then in arrival order (`Ticket`); only the queue's head is ever granted (nobody
overtakes a waiting request of the same or a higher priority), and a grant is the resource itself (a reservation,
pages, a place). A queue is a policy, its subclass's `_grant(ticket)`: what it would hand the head now, or None.

Two ways to wait, for the same queue and the same order:
- a task (composer/engine/loop.py `Admit`) yields its ticket to the engine core, which polls it whenever a queue it
  waits on changes (`listen`): no thread waits on the request's behalf, however many requests wait;
- code on a caller's own thread calls `wait(ticket, cancel)`, which blocks that thread (checking its cancel token
  every `CANCEL_POLL_S`).

`changed()` is what a release calls (a request ended, pages went back): waiting threads look again and the
listeners (the engine cores holding tickets) are woken.

Used by composer.memory.admission (`MemoryAdmission`: requests against a memory budget), composer.cache.kv_pool
(`KVPool`: a causal stream's KV pages), composer.pipelines.base (`RequestGate`: a place on the pipeline, and the
barrier of an adapter switch), and the server's queues: serve/worker.py (`Worker`: video jobs, their slots and
adapter sets) and serve/slots.py (`Slots`: the text routes, whose waiters are asyncio futures).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

CANCEL_POLL_S = 0.1  # a thread waiting on a queue checks its cancel token this often


@dataclass(eq=False)
class Ticket:
    """A request's place in a queue: what it asks for (`need`, the queue's own type), its priority, its owner (a
    thread's or a task's identity: `AdmissionQueue.position`)."""

    need: Any
    priority: int
    seq: int
    owner: Any = None
    waited: bool = False  # whether it was not granted at once (counted once in `_waits`)

    @property
    def key(self) -> tuple[int, int]:
        return (-self.priority, self.seq)


class AdmissionQueue:
    """A priority queue of tickets over one resource (see the module). Subclasses implement `_grant`, and may
    override `_waiting` (a log line when a ticket first waits)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._queue: list[Ticket] = []
        self._seq = itertools.count()
        self._waits = 0
        self._listeners: list[Callable[[], None]] = []

    # -- the policy ----------------------------------------------------------------------------------------
    def _grant(self, ticket: Ticket) -> Any:
        """(The queue's lock held; `ticket` is the head.) The resource for `ticket` if it can have it now, else
        None."""
        raise NotImplementedError

    def _waiting(self, ticket: Ticket) -> None:
        """(The queue's lock held.) `ticket` could not be granted at once: say so (a log line)."""

    # -- asking --------------------------------------------------------------------------------------------
    def ticket(self, need: Any, priority: int = 0, owner: Any = None) -> Ticket:
        """A new ticket in the queue (its place: after every ticket of a higher or the same priority)."""
        ticket = Ticket(need, int(priority), next(self._seq), owner)
        with self._cv:
            self._queue.append(ticket)
            self._queue.sort(key=lambda t: t.key)
        return ticket

    def poll(self, ticket: Ticket) -> tuple[bool, Any]:
        """Never waits: (True, the grant) when `ticket` is the head and the policy grants it now (the ticket then
        leaves the queue), else (False, None)."""
        with self._cv:
            if self._queue and self._queue[0] is ticket:
                grant = self._grant(ticket)
                if grant is not None:
                    self._queue.pop(0)
                    self._notify()
                    return True, grant
            if not ticket.waited:
                ticket.waited = True
                self._waits += 1
                self._waiting(ticket)
            return False, None

    def take_now(self, need: Any, priority: int = 0) -> Any:
        """The grant if `need` can have it at once and nobody waits ahead of it, else None (nothing stays queued)."""
        with self._cv:
            if self._queue and self._queue[0].priority >= priority:  # someone of this priority or a higher one waits
                return None
            return self._grant(Ticket(need, int(priority), -1))

    def wait(self, ticket: Ticket, cancel: Any = None) -> Any:
        """Block this thread until `ticket` is granted; its grant. Raises Cancelled (the ticket withdrawn) when
        `cancel` is cancelled meanwhile."""
        with self._cv:  # (a Condition over an RLock: poll takes it again)
            try:
                while True:
                    granted, grant = self.poll(ticket)
                    if granted:
                        return grant
                    self._cv.wait(timeout=CANCEL_POLL_S)
                    if cancel is not None:
                        cancel.check()
            except BaseException:
                self.withdraw(ticket)
                raise

    def withdraw(self, ticket: Ticket) -> None:
        """Take `ticket` out of the queue (cancelled or failed: it will not be granted); the others may go on."""
        with self._cv:
            if ticket in self._queue:
                self._queue.remove(ticket)
                self._notify()

    def wait_for(self, need: Any, priority: int = 0, cancel: Any = None, owner: Any = None) -> Any:
        """`wait(ticket(need, priority, owner), cancel)`."""
        return self.wait(self.ticket(need, priority, owner), cancel)

    # -- what changes it ----------------------------------------------------------------------------------
    def changed(self) -> None:
        """Something was given back (or a policy's state changed): waiters look again."""
        with self._cv:
            self._notify()

    def _notify(self) -> None:
        """(The queue's lock held.) Wake the threads waiting here and the listeners (the cores holding tickets)."""
        self._cv.notify_all()
        for listener in list(self._listeners):
            listener()

    def listen(self, listener: Callable[[], None]) -> None:
        """Call `listener()` (which must not block: an engine core's `wake`) whenever the queue may grant again."""
        with self._cv:
            if listener not in self._listeners:
                self._listeners.append(listener)

    # -- what it holds ------------------------------------------------------------------------------------
    def position(self, owner: Any) -> int | None:
        """The place of `owner`'s ticket (0: the head), None when it has none waiting."""
        with self._cv:
            for i, ticket in enumerate(self._queue):
                if ticket.owner == owner:
                    return i
        return None

    @property
    def waiting(self) -> int:
        with self._cv:
            return len(self._queue)

