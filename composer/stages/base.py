"""Stage: one step of a pipeline. The base class owns checking, timing, logging and error context.

A stage transforms the whole batch (`forward`), and a streaming stage can also hand out its result piece by
piece (`stream`): the causal denoiser yields latent blocks as they finish, the decoder turns each into frames.
The pipeline runs both kinds through the public `__call__` / `iter_call`; nothing runs a stage by hand.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

from torch import nn

from composer.batch import ForwardBatch
from composer.engine.loop import drive, is_wait
from composer.errors import StageVerificationError
from composer.logging import get_logger
from composer.stages.validators import VerificationResult

logger = get_logger(__name__)
_NOTE = "(raised in pipeline stage "


def drives_task(forward):
    """Mark a stage's `forward` as `drive(self.forward_task(batch))` (see `Stage.has_task`)."""
    forward.drives_task = True
    return forward


_tokenizer_locks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_tokenizer_locks_guard = threading.Lock()


def tokenizer_lock(tokenizer: Any) -> threading.RLock:
    """The process-wide lock of a tokenizer, held around every call of it. A fast tokenizer keeps its truncation and
    padding settings on its Rust object and sets them at each call, so two threads calling it with different settings
    (a prompt's length counted untruncated beside another request's padded encoding) get each other's: a prompt
    padded to 6 tokens instead of 24."""
    with _tokenizer_locks_guard:
        lock = _tokenizer_locks.get(tokenizer)
        if lock is None:
            lock = _tokenizer_locks[tokenizer] = threading.RLock()
        return lock


class StageInvariantError(AssertionError):
    """A stage's input check failed: an invariant of the engine, not a user's error. A request reaches the stages
    only after the one request check (composer.request_check.check_request), which refuses every bad value with
    the user's words; the stages' input checks assert what it and the stages before established, naming the
    stage and the field."""

    def __init__(self, stage: str, failures: list[tuple[str, str, str]] = ()):
        self.stage = stage
        self.failures = list(failures)
        lines = "; ".join(f"{field} = {value}: expected {rule}" for field, value, rule in self.failures)
        super().__init__(stage, self.failures)
        self.message = (f"{stage}: input invariant broken ({lines}); the request check at submit refuses such a "
                        "request, so this one skipped it or an earlier stage wrote it wrong (a bug in composer)")

    def __str__(self) -> str:
        return self.message


class Stage:
    """`forward(batch) -> batch`, with optional `verify_input` / `verify_output` built from validators.

    Subclasses implement `forward` and, where useful, the two checks; `__call__` runs verify_input (assertions:
    StageInvariantError) -> forward -> verify_output, times `forward` into `batch.timings[name]`, and names the
    stage on any exception that escapes it. Streaming stages also implement `stream(batch, upstream)`.
    """

    # Whether checks may read tensor values (a device sync): off by default, on for debugging.
    check_values: bool = False
    # A streaming stage that only transforms an upstream stage's pieces (a decoder) cannot start a stream.
    streams_from_upstream: bool = False
    # Whether several requests may run this stage at once (denoising stages: their transformer calls are scheduled
    # by the engine). Other stages run one request at a time per module (the pipeline holds a lock per module).
    concurrent: bool = False

    @property
    def name(self) -> str:
        return type(self).__name__

    @property
    def streams(self) -> bool:
        """Whether this stage can yield its result in pieces (it implements `stream`)."""
        return type(self).stream is not Stage.stream

    def modules(self) -> list[nn.Module]:
        """The torch modules this stage runs (what must be on the device while it runs): its nn.Module
        attributes and those of its denoising engine."""
        found: list[nn.Module] = []
        for value in list(vars(self).values()):  # (a copy: another request's run may set an attribute meanwhile)
            if isinstance(value, nn.Module):
                found.append(value)
            elif isinstance(getattr(value, "transformer", None), nn.Module):  # a DenoisingEngine
                found.append(value.transformer)
        return list({id(m): m for m in found}.values())

    def skips(self, batch: ForwardBatch) -> bool:
        """Whether this request gives the stage nothing to do (one expert of two with none of the request's steps):
        the pipeline then runs neither the stage nor its scopes, so offloading never brings its modules over."""
        return False

    def verify_input(self, batch: ForwardBatch, result: VerificationResult) -> None:
        """Add checks on the fields this stage reads: invariants (a failure is StageInvariantError, a bug). A user's
        value is checked at submit (composer.request_check); what only this stage can know of it (a decoded
        video's length against the request) it refuses in `forward`, as InvalidInputError."""

    def verify_output(self, batch: ForwardBatch, result: VerificationResult) -> None:
        """Add checks on the fields this stage wrote."""

    def verify_stream_input(self, batch: ForwardBatch, result: VerificationResult) -> None:
        """Checks before streaming (default: those of `verify_input`; a stage fed by an upstream stream
        checks less here, its pieces arrive later)."""
        self.verify_input(batch, result)

    def verify_stream_output(self, batch: ForwardBatch, result: VerificationResult) -> None:
        """Checks after a stream is exhausted (default: those of `verify_output`)."""
        self.verify_output(batch, result)

    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        raise NotImplementedError

    def stream(self, batch: ForwardBatch, upstream: Iterator[Any] | None) -> Iterator[Any]:
        """Yield the result in pieces; `upstream` is the previous streaming stage's pieces, if any."""
        raise NotImplementedError(f"{self.name} does not stream")

    def check(self, batch: ForwardBatch, phase: str) -> None:
        """Run the checks of `phase` ("input", "output", "stream_input", "stream_output"); raise listing every
        failure. An input check is an assertion (StageInvariantError): a user's request was checked once, at
        submit (composer.request_check.check_request), and what a stage reads was written by that check and the
        stages before it, so a failure here is a bug. An output check raises StageVerificationError."""
        result = VerificationResult(check_values=self.check_values)
        verify = {"input": self.verify_input, "output": self.verify_output,
                  "stream_input": self.verify_stream_input, "stream_output": self.verify_stream_output}
        verify[phase](batch, result)
        if result.ok:
            return
        if phase in ("input", "stream_input"):
            raise StageInvariantError(self.name, result.failures)
        raise StageVerificationError(self.name, phase.removeprefix("stream_"), result.failures)

    def _note(self, exc: BaseException) -> None:
        # An upstream stage's error passes through the streaming stages after it: name only where it arose.
        if hasattr(exc, "add_note") and not any(n.startswith(_NOTE) for n in getattr(exc, "__notes__", ())):
            exc.add_note(f"{_NOTE}{self.name})")

    def __call__(self, batch: ForwardBatch) -> ForwardBatch:
        return drive(self.call_task(batch))

    # A stage whose work is transformer units defines `forward_task(batch)`: `forward` as a task
    # (composer/engine/loop.py) that yields its units; the engine core then runs it with no thread held between them.
    # Its `forward` is then `drive(self.forward_task(batch))`, marked with `@drives_task`.
    forward_task = None

    @property
    def has_task(self) -> bool:
        """Whether the stage runs as a task: it has `forward_task` and its `forward` is still the one that drives
        it (a `forward` replaced in a subclass, or patched, is run as it is)."""
        return self.forward_task is not None and getattr(self.forward, "drives_task", False)

    def call_task(self, batch: ForwardBatch):
        """The stage's run as a task: the input checks, `forward_task` (or `forward`, which waits for nothing), its
        time in `batch.timings`, the output checks. `__call__` drives it on the calling thread."""
        self.check(batch, "input")
        start = time.perf_counter()
        try:
            if self.has_task:
                batch = yield from self.forward_task(batch)
            else:
                batch = self.forward(batch)
        except Exception as exc:
            self._note(exc)
            raise
        elapsed = time.perf_counter() - start
        batch.timings[self.name] += elapsed
        logger.debug("%s took %.3f s", self.name, elapsed)
        self.check(batch, "output")
        return batch

    def iter_call(self, batch: ForwardBatch, upstream: Iterator[Any] | None = None) -> Iterator[Any]:
        """The streaming `__call__`: checks, then each piece of `stream` as it is made (time spent making it,
        less the time spent waiting on `upstream`, goes to `batch.timings[name]`), then the output checks."""
        self.check(batch, "stream_input")
        timed_upstream = _TimedIterator(upstream) if upstream is not None else None
        pieces = self.stream(batch, timed_upstream)
        while True:
            start = time.perf_counter()
            waited = timed_upstream.seconds if timed_upstream is not None else 0.0
            try:
                piece = next(pieces)
            except StopIteration:
                break
            except Exception as exc:
                self._note(exc)
                raise
            finally:
                upstream_time = (timed_upstream.seconds - waited) if timed_upstream is not None else 0.0
                batch.timings[self.name] += time.perf_counter() - start - upstream_time
            if is_wait(piece):  # a wait (composer/engine/loop.py): its time is this stage's, unless relayed
                relayed = timed_upstream is not None and piece is timed_upstream.last
                began = time.perf_counter()
                yield piece
                if not relayed:
                    batch.timings[self.name] += time.perf_counter() - began
                continue
            yield piece
        self.check(batch, "stream_output")


class _TimedIterator:
    """An iterator that adds up the time spent in its `next` calls."""

    def __init__(self, items: Iterator[Any]):
        self._items = iter(items)
        self.seconds = 0.0
        self.last: Any = None  # the latest item (a wait relayed from upstream is told apart by it)

    def __iter__(self) -> _TimedIterator:
        return self

    def __next__(self) -> Any:
        start = time.perf_counter()
        try:
            self.last = next(self._items)
            return self.last
        finally:
            self.seconds += time.perf_counter() - start
