"""Text requests share model forwards: each refinement step's forward of every request running at once goes into
one padded call.

Requests run their own loops (their own generators, draws and commits), each on its thread; a step's forward is a
unit handed to the pipeline's `ForwardBatcher`, whose calls the pipeline's engine core runs (composer/engine/core.py:
the request's thread only waits for its logits). A call takes every pending unit (oldest
first, up to `max_rows` rows: the runtime's `max_batch_size`; `max_tokens`: `max_batch_tokens`, rows x padded
length), the others wait for their logits. Rows of different lengths are padded on the right: each keeps its own
positions, the padding is masked out of every row's attention, and a row's logits are its own positions' (a causal
model never sees the padding after it; a bidirectional one has it masked). So a request's ids are its solo run's
(tests/test_text_batching.py checks them equal; the logits agree to float rounding).

While a call runs, the units of the other requests queue; the next call takes them all: requests in step with one
another share every call.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

import torch

from composer.engine.batcher import UnitQueue


@dataclass(eq=False)
class _Unit:
    ids: torch.Tensor  # [rows, length]
    attention: torch.Tensor
    positions: torch.Tensor
    block: int
    priority: int = 0
    seq: int = 0
    result: torch.Tensor | None = None
    error: BaseException | None = None
    done: bool = False


@dataclass
class BatchStats:
    calls: int = 0  # model forwards run
    units: int = 0  # requests' steps served
    batched_units: int = 0  # units that shared their call with another request's
    largest: int = 0  # the most units one call served
    extras: dict = field(default_factory=dict)


class ForwardBatcher(UnitQueue):
    def __init__(self, model: torch.nn.Module, pad_id: int, max_rows: int | None = None,
                 max_tokens: int | None = None):
        self.model = model
        self.pad_id = pad_id
        self.max_rows = max_rows
        self.max_tokens = max_tokens
        self.stats = BatchStats()
        self._cv = threading.Condition()
        self._pending: list[_Unit] = []
        self._running = False
        self._seq = itertools.count()

    def logits(self, ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor,
               block: int, priority: int = 0) -> torch.Tensor:
        """The logits of the last `block` positions of `ids` [rows, length], run with whatever else is pending
        (higher `priority` first, then the oldest)."""
        unit = _Unit(ids, attention, positions, block, priority, next(self._seq))
        with self._cv:
            self._queue(unit)
            self._await(unit)
        if unit.error is not None:
            raise unit.error
        return unit.result

    def take(self) -> list[_Unit]:
        """(Lock held) The pending units in pick order (higher priority first, then the oldest) while they fit the
        budgets (at least one)."""
        chosen, rows, longest = [], 0, 0
        for unit in sorted(self._pending, key=lambda u: (-u.priority, u.seq)):
            n, length = unit.ids.shape[0], max(longest, unit.ids.shape[1])
            if chosen and ((self.max_rows is not None and rows + n > self.max_rows)
                           or (self.max_tokens is not None and (rows + n) * length > self.max_tokens)):
                break
            chosen.append(unit)
            rows, longest = rows + n, length
        taken = {id(u) for u in chosen}
        self._pending = [u for u in self._pending if id(u) not in taken]
        self._running = True
        return chosen

    def execute(self, units: list[_Unit]) -> None:
        self._run(units)

    def finish(self, units: list[_Unit]) -> None:
        self._running = False
        for u in units:
            u.done = True
        self._cv.notify_all()

    @torch.inference_mode()
    def _run(self, units: list[_Unit]) -> None:
        try:
            if len(units) == 1:
                u = units[0]
                out = self.model(u.ids, attention_mask=u.attention, position_ids=u.positions).logits
                u.result = out[:, -u.block:, :]
            else:
                length = max(u.ids.shape[1] for u in units)
                ids = torch.cat([_pad(u.ids, length, self.pad_id) for u in units])
                attention = torch.cat([_pad(u.attention, length, 0) for u in units])
                positions = torch.cat([_pad(u.positions, length, 0) for u in units])
                out = self.model(ids, attention_mask=attention, position_ids=positions).logits
                row = 0
                for u in units:
                    n, end = u.ids.shape[0], u.ids.shape[1]
                    u.result = out[row:row + n, end - u.block:end, :]
                    row += n
        except BaseException as exc:  # noqa: BLE001 - every unit of the call gets it
            for u in units:
                u.error = exc
        finally:
            stats = self.stats
            stats.calls += 1
            stats.units += len(units)
            stats.batched_units += len(units) if len(units) > 1 else 0
            stats.largest = max(stats.largest, len(units))


def _pad(t: torch.Tensor, length: int, value: int) -> torch.Tensor:
    if t.shape[1] == length:
        return t
    return torch.nn.functional.pad(t, (0, length - t.shape[1]), value=value)
