"""Admission for the server's request routes that answer when their work is done (the text routes): at most
`max_concurrent` requests run at once; the others wait, higher `priority` first, then in order of arrival; at most
`max_queue` of them wait (one more: `QueueFull`, which the routes answer with video's 429).

A waiting request awaits an asyncio future on the event loop: no thread waits on its behalf, and a slot freed is
handed to the first waiting request at once (it never runs empty while one waits). The order is the one admission
queue's (composer/admission.py); every method is called on the event loop's thread (its lock is never contended).
"""

from __future__ import annotations

import asyncio
import time

from composer.admission import AdmissionQueue, Ticket


class QueueFull(Exception):
    """`max_queue` requests are waiting already."""


class ClientGone(Exception):
    """The request's client left while it waited: it never ran."""


class Slots(AdmissionQueue):
    """`max_concurrent` slots and a bounded queue of the requests waiting for one, by priority then arrival: an
    admission queue (composer/admission.py) whose grant is a slot, each waiting request's ticket paired with the
    future it awaits."""

    def __init__(self, max_concurrent: int, max_queue: int):
        if max_concurrent < 1 or max_queue < 0:
            raise ValueError(f"max_concurrent = {max_concurrent}, max_queue = {max_queue}: expected >= 1 and >= 0")
        super().__init__()
        self.max_concurrent, self.max_queue = max_concurrent, max_queue
        self.running = 0
        self.waits = 0  # requests that got a slot (the immediate ones count a wait of 0 s)
        self.wait_seconds = 0.0
        self._futures: dict[Ticket, asyncio.Future] = {}

    def _grant(self, ticket: Ticket) -> bool | None:
        if self.running >= self.max_concurrent:
            return None
        self.running += 1
        return True

    async def acquire(self, priority: int = 0, gone: asyncio.Future | None = None) -> None:
        """Return once the request holds a slot (call `release` when it ends). Raises QueueFull (nothing kept)
        when `max_queue` requests wait already, or ClientGone when `gone` (a task that ends when the client
        leaves) finishes first."""
        start = time.monotonic()
        if self.take_now(None, priority):
            self._waited(start)
            return
        if len(self._queue) >= self.max_queue:
            raise QueueFull
        future = asyncio.get_running_loop().create_future()
        ticket = self.ticket(None, priority)
        self._futures[ticket] = future
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
                self._futures.pop(ticket, None)
                self.withdraw(ticket)
            raise
        self._waited(start)

    def release(self) -> None:
        """A running request ended: its slot goes to the first waiting request, else it is free."""
        self.running -= 1
        while self._queue:
            head = self._queue[0]
            granted, _ = self.poll(head)  # (takes the slot back: `running` is as before)
            if not granted:
                return
            future = self._futures.pop(head, None)
            if future is not None and not future.done():
                future.set_result(None)  # the slot changes hands
                return
            self.running -= 1  # its request left meanwhile: the slot goes on

    def _waited(self, start: float) -> None:
        self.waits += 1
        self.wait_seconds += time.monotonic() - start
