"""Stage: one step of a pipeline. The base class owns checking, timing, logging and error context."""

from __future__ import annotations

import time

from composer.batch import ForwardBatch
from composer.errors import StageVerificationError
from composer.logging import get_logger
from composer.stages.validators import VerificationResult

logger = get_logger(__name__)


class Stage:
    """`forward(batch) -> batch`, with optional `verify_input` / `verify_output` built from validators.

    Subclasses implement `forward` and, where useful, the two checks; `__call__` runs
    verify_input -> forward -> verify_output, times `forward` into `batch.timings[name]`, and names the stage
    on any exception that escapes it.
    """

    # Whether checks may read tensor values (a device sync): off by default, on for debugging.
    check_values: bool = False

    @property
    def name(self) -> str:
        return type(self).__name__

    def verify_input(self, batch: ForwardBatch, result: VerificationResult) -> None:
        """Add checks on the fields this stage reads."""

    def verify_output(self, batch: ForwardBatch, result: VerificationResult) -> None:
        """Add checks on the fields this stage wrote."""

    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        raise NotImplementedError

    def _verify(self, batch: ForwardBatch, phase: str) -> None:
        result = VerificationResult(check_values=self.check_values)
        (self.verify_input if phase == "input" else self.verify_output)(batch, result)
        if not result.ok:
            raise StageVerificationError(self.name, phase, result.failures)

    def __call__(self, batch: ForwardBatch) -> ForwardBatch:
        self._verify(batch, "input")
        start = time.perf_counter()
        try:
            batch = self.forward(batch)
        except Exception as exc:
            if hasattr(exc, "add_note"):
                exc.add_note(f"(raised in pipeline stage {self.name})")
            raise
        elapsed = time.perf_counter() - start
        batch.timings[self.name] += elapsed
        logger.debug("%s took %.3f s", self.name, elapsed)
        self._verify(batch, "output")
        return batch
