"""Admission for the server's request routes that answer when their work is done (the text routes): at most
`max_concurrent` requests run at once; the others wait, higher `priority` first, then in order of arrival; at most
`max_queue` of them wait (one more: `QueueFull`, which the routes answer with video's 429).

A waiting request awaits an asyncio future on the event loop: no thread waits on its behalf, and a slot freed is
handed to the first waiting request at once (it never runs empty while one waits). Every method is called on the
event loop's thread (the class holds no lock).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time


class QueueFull(Exception):
    """`max_queue` requests are waiting already."""


class ClientGone(Exception):
    """The request's client left while it waited: it never ran."""


class Slots:
    """`max_concurrent` slots and a bounded queue of the requests waiting for one, by priority then arrival."""

    def __init__(self, max_concurrent: int, max_queue: int):
        if max_concurrent < 1 or max_queue < 0:
            raise ValueError(f"max_concurrent = {max_concurrent}, max_queue = {max_queue}: expected >= 1 and >= 0")
        self.max_concurrent, self.max_queue = max_concurrent, max_queue
        self.running = 0
        self.waits = 0  # requests that got a slot (the immediate ones count a wait of 0 s)
        self.wait_seconds = 0.0
        self._waiting: list[tuple[int, int, asyncio.Future]] = []  # a heap: (-priority, arrival, future)
        self._arrivals = itertools.count()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    async def acquire(self, priority: int = 0, gone: asyncio.Future | None = None) -> None:
        """Return once the request holds a slot (call `release` when it ends). Raises QueueFull (nothing kept)
        when `max_queue` requests wait already, or ClientGone when `gone` (a task that ends when the client
        leaves) finishes first."""
        start = time.monotonic()
        if self.running < self.max_concurrent and not self._waiting:
            self.running += 1
            self._waited(start)
            return
        if len(self._waiting) >= self.max_queue:
            raise QueueFull
        future = asyncio.get_running_loop().create_future()
        entry = (-priority, next(self._arrivals), future)
        heapq.heappush(self._waiting, entry)
        try:
            if gone is None:
                await future
            else:
                await asyncio.wait({future, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not future.done():
                    raise ClientGone
        except BaseException:
            if future.done() and not future.cancelled():  # handed a slot as it left: the next one takes it
                self.release()
            else:
                future.cancel()
                if entry in self._waiting:  # (a release may have passed over it once it was cancelled)
                    self._waiting.remove(entry)
                    heapq.heapify(self._waiting)
            raise
        self._waited(start)

    def release(self) -> None:
        """A running request ended: its slot goes to the first waiting request, else it is free."""
        while self._waiting:
            _, _, future = heapq.heappop(self._waiting)
            if not future.done():
                future.set_result(None)  # the slot changes hands: `running` stays
                return
        self.running -= 1

    def _waited(self, start: float) -> None:
        self.waits += 1
        self.wait_seconds += time.monotonic() - start
