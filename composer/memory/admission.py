"""Concurrent requests admitted against one shared memory budget (docs/memory.md, "Concurrent requests").

The weights are counted once (the plan's, on the device). Each request's predicted activations (composer.memory.
predict) are split in two (`MemoryShare`):

- `held`: the most it needs outside its transformer calls: its text encoding, the latents and embeddings it carries
  through its denoising loop, its decode. A running request reserves it from admission to its end.
- `call`: what one of its transformer calls adds to what it carries (the forward's activations over its tokens, the
  solver's step), kept as `excess`, the part above `held`. Calls run one at a time per step scheduler, and a batched
  call's activations are its units' summed (rows do not interact: they scale with the summed tokens), so the
  running calls are counted when they run, not per request. (What a denoising request allocates between its calls,
  the solver's latent-sized tensors, is left to the planner's headroom.)

So, with `held` summed over the running requests and `in flight` the excess of the calls running now:

    admission   a request starts when  held + its held + max(every excess, in flight) <= room   (room: the budget
                after headroom, less the weights); otherwise it waits, in priority then arrival order, until
                requests end; one that does not fit even alone was refused before (MemoryGuard.check), and one
                alone always starts
    a call      its units' excess summed, beside `held` and the other schedulers' calls in flight, must fit: a
                compatible unit joins a batch only while it does (StepScheduler.call_memory); a lone unit always
                runs once no other call is in flight (admission guaranteed it fits then)

A request's output never depends on this: admission only delays when it starts, and the call rule only keeps units
out of a batch, as max_batch_tokens does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from composer.admission import AdmissionQueue, Ticket
from composer.logging import get_logger
from composer.memory.predict import RequestMemory, fmt_bytes

logger = get_logger(__name__)


@dataclass(frozen=True)
class MemoryShare:
    """One request's part of a shared budget (see the module): `held` through its run, `excess` on top while one of
    its transformer calls runs (<= 0: its calls need no more than it holds anyway)."""

    held: int
    excess: int = 0

    @property
    def peak(self) -> int:
        """The request's predicted peak alone (weights not included)."""
        return self.held + max(0, self.excess)

    @classmethod
    def of(cls, request: RequestMemory) -> MemoryShare:
        """Split a request's stages: a stage whose transformer calls go through a step scheduler (`StageMemory.
        calls`) holds what it carries; its own peak is a call's."""
        held = max((s.carried if s.calls else s.carried + s.peak for s in request.stages), default=0)
        call = max((s.carried + s.peak for s in request.stages if s.calls), default=0)
        return cls(held, call - held)


@dataclass(eq=False)
class Reservation:
    """A request's admitted share; `release()` (once: later calls do nothing) gives it back."""

    admission: MemoryAdmission
    share: MemoryShare
    priority: int = 0
    released: bool = False

    def release(self) -> None:
        self.admission.release(self)


@dataclass(frozen=True)
class AdmissionStats:
    """What the admission holds now (bytes) and its counts."""

    room: int  # the budget after headroom, less the weights
    weights: int  # the weights on the device, counted once
    reserved: int  # held by the running requests, plus the largest of their calls' excess (or the calls in flight)
    running: int  # requests admitted and not ended
    waiting: int  # requests waiting for memory now
    waits: int  # requests that had to wait, since the model loaded
    in_flight: int  # excess of the transformer calls running now


class MemoryAdmission(AdmissionQueue):
    """Admits requests against one budget (see the module): a queue of `MemoryShare`s (composer/admission.py: in
    priority, then arrival order; a task waits on the engine core, a thread in `reserve`) whose grant is a
    `Reservation`. The step schedulers ask it about their calls."""

    def __init__(self, room: int, weights: int = 0):
        super().__init__()
        self.room = int(room)
        self.weights = int(weights)
        self._running: list[Reservation] = []
        self._in_flight: dict[int, int] = {}  # id(scheduler) -> its running call's excess

    # -- requests ------------------------------------------------------------------------------------------
    def _grant(self, ticket: Ticket) -> Reservation | None:
        share = ticket.need
        return self._admit(share, ticket.priority) if self._fits(share) else None

    def _waiting(self, ticket: Ticket) -> None:
        share = ticket.need
        more = f" ({fmt_bytes(share.excess)} more in its transformer calls)" if share.excess > 0 else ""
        logger.info("a request waits for memory: it needs %s%s; %s of %s is reserved by %d running; %d ahead of it",
                    fmt_bytes(share.held), more, fmt_bytes(self._reserved()), fmt_bytes(self.room),
                    len(self._running), self._queue.index(ticket) if ticket in self._queue else 0)

    def try_reserve(self, share: MemoryShare, priority: int = 0) -> Reservation | None:
        """The reservation if `share` fits now and nobody waits ahead of it (never waits); else None."""
        return self.take_now(share, priority)

    def reserve(self, share: MemoryShare, priority: int = 0, cancel: Any = None) -> Reservation:
        """Wait on this thread until `share` fits beside the running requests and every request before it (higher
        priority, or as high and earlier) is admitted; raises Cancelled when `cancel` is cancelled meanwhile. (A
        task waits with `Admit(admission, share, priority, cancel)` instead, holding no thread.)"""
        return self.wait_for(share, priority, cancel)

    def release(self, reservation: Reservation) -> None:
        with self._cv:
            if reservation.released:
                return
            reservation.released = True
            self._running.remove(reservation)
            self._notify()

    def _admit(self, share: MemoryShare, priority: int) -> Reservation:
        reservation = Reservation(self, share, priority)
        self._running.append(reservation)
        return reservation

    def _held(self) -> int:
        return sum(r.share.held for r in self._running)

    def _reserved(self) -> int:
        excess = max((r.share.excess for r in self._running), default=0)
        return self._held() + max(0, excess, sum(self._in_flight.values()))

    def _fits(self, share: MemoryShare) -> bool:
        if not self._running and not self._in_flight:  # alone: MemoryGuard.check accepted it (never wait forever)
            return True
        excess = max(0, share.excess, *(r.share.excess for r in self._running))
        return self._held() + share.held + max(excess, sum(self._in_flight.values())) <= self.room

    # -- transformer calls (StepScheduler.call_memory) --------------------------------------------------------
    @staticmethod
    def _excess(units: list) -> int:
        """The units' calls' excess over what their requests hold (a unit of a request without a reservation,
        a stream's, counts nothing: streams are checked alone)."""
        total = 0
        for unit in units:
            reservation = getattr(unit.request, "memory", None)
            if isinstance(reservation, Reservation):
                total += max(0, reservation.share.excess)
        return total

    def admits(self, scheduler: Any, units: list) -> bool:
        """Whether a call over `units` fits beside the running requests and the other schedulers' calls in flight.
        A lone unit fits whenever no other call is in flight: admission made room for any one call."""
        with self._cv:
            others = {k: v for k, v in self._in_flight.items() if k != id(scheduler)}
            if len(units) == 1 and not others:
                return True
            return self._held() + sum(others.values()) + self._excess(units) <= self.room

    def started(self, scheduler: Any, units: list) -> None:
        with self._cv:
            self._in_flight[id(scheduler)] = self._excess(units)

    def ended(self, scheduler: Any) -> None:
        with self._cv:
            self._in_flight.pop(id(scheduler), None)
            self._notify()

    # -- what /metrics shows --------------------------------------------------------------------------------
    def stats(self) -> AdmissionStats:
        with self._cv:
            return AdmissionStats(room=self.room, weights=self.weights, reserved=self._reserved(),
                                  running=len(self._running), waiting=len(self._queue), waits=self._waits,
                                  in_flight=sum(self._in_flight.values()))
