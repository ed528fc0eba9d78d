"""Text requests share model forwards: each refinement step's forward of every request running at once goes into
one padded call.

Requests run their own loops (their own generators, draws and commits), each a task of the model's engine core
(composer/engine/core.py); a step's forward is a unit the task waits for (`Queued`) on the pipeline's
`ForwardBatcher`, whose calls the core runs, so no thread waits for a request's logits. It is one of the core's CallBatchers (the VAE decodes are another):
a call takes the pending units in order (higher priority first, then the oldest) while they fit `max_rows` rows (the
runtime's `max_batch_size`) and `max_tokens` (`max_batch_tokens`, rows x padded length); the others wait. Rows of different lengths are padded on the right: each keeps its own
positions, the padding is masked out of every row's attention, and a row's logits are its own positions' (a causal
model never sees the padding after it; a bidirectional one has it masked). So a request's ids are its solo run's
(tests/test_text_batching.py checks them equal; the logits agree to float rounding).

While a call runs, the units of the other requests queue; the next call takes them all: requests in step with one
another share every call.

Under tensor parallel every rank holds a slice of the model and each forward holds collectives: the batcher is
registered on the plan channel (composer/parallel/plan.py), rank 0 plans its calls and the other ranks run the same
ones, each unit named by its request's key (a digest of the request, equal on every rank) and its forward's number;
a decoding strategy's own model calls (`call`: its KV cache) go through the same queue, alone, so that every call
with collectives is planned.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from composer.engine.batcher import CallBatcher
from composer.engine.loop import Queued


@dataclass
class BatchStats:
    calls: int = 0  # model forwards run
    units: int = 0  # requests' steps served
    batched_units: int = 0  # units that shared their call with another request's
    largest: int = 0  # the most units one call served
    extras: dict = field(default_factory=dict)


class ForwardBatcher(CallBatcher):
    """The text model's forwards as calls of one CallBatcher (composer/engine/batcher.py): every pending forward is
    compatible (rows are padded), the highest priority goes first, and a call holds at most `max_rows` rows and
    `max_tokens` padded tokens. Its batches run on the core's main lane."""

    def __init__(self, model: torch.nn.Module, pad_id: int, max_rows: int | None = None,
                 max_tokens: int | None = None):
        super().__init__(self._forward, max_rows=max_rows, lane="main", by_priority=True, fits=self._fits)
        self.model = model
        self.pad_id = pad_id
        self.max_tokens = max_tokens
        self.stats = BatchStats()

    def forward(self, ids: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor, block: int,
                priority: int = 0, plan_key: Any = None) -> Queued:
        """What a request's task waits for: the logits of the last `block` positions of `ids` [rows, length], run
        with whatever else is pending (higher `priority` first, then the oldest). `plan_key`: the forward's name on
        every rank, where rank 0 plans the calls (tensor parallel)."""
        return Queued(self, ("forward", (ids, attention, positions, block), ids.shape[0], plan_key, priority))

    def call(self, fn: Callable[[], Any], rows: int, priority: int = 0, plan_key: Any = None) -> Queued:
        """What a request's task waits for: `fn()`, a model call of its own (a decoding strategy's forward with its
        KV cache), run alone, in this queue's order: under tensor parallel every call that holds collectives is
        one of this queue's, which rank 0 plans."""
        return Queued(self, (None, fn, rows, plan_key, priority))

    def _fits(self, rows: int, chosen: list, call) -> bool:
        if self.max_tokens is None:
            return True
        length = max(c.payload[0].shape[1] for c in [*chosen, call])
        return (rows + call.rows) * length <= self.max_tokens

    @torch.inference_mode()
    def _forward(self, payloads: list[tuple]) -> list[torch.Tensor]:
        try:
            if len(payloads) == 1 and callable(payloads[0]):  # a call of its own (`call`: never batched)
                return [payloads[0]()]
            if len(payloads) == 1:
                ids, attention, positions, block = payloads[0]
                return [self.model(ids, attention_mask=attention, position_ids=positions).logits[:, -block:, :]]
            length = max(p[0].shape[1] for p in payloads)
            ids = torch.cat([_pad(p[0], length, self.pad_id) for p in payloads])
            attention = torch.cat([_pad(p[1], length, 0) for p in payloads])
            positions = torch.cat([_pad(p[2], length, 0) for p in payloads])
            out = self.model(ids, attention_mask=attention, position_ids=positions).logits
            results, row = [], 0
            for p_ids, _, _, block in payloads:
                n, end = p_ids.shape[0], p_ids.shape[1]
                results.append(out[row:row + n, end - block:end, :])
                row += n
            return results
        finally:
            stats = self.stats
            stats.calls += 1
            stats.units += len(payloads)
            stats.batched_units += len(payloads) if len(payloads) > 1 else 0
            stats.largest = max(stats.largest, len(payloads))


def _pad(t: torch.Tensor, length: int, value: int) -> torch.Tensor:
    if t.shape[1] == length:
        return t
    return torch.nn.functional.pad(t, (0, length - t.shape[1]), value=value)
