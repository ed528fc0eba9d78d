"""Typed errors. Each says what was expected, what was given, and how to fix it.

The CLI prints a `ComposerError` as one message without a traceback and exits non-zero; anything else is a
bug and keeps its traceback.
"""

from __future__ import annotations


class ComposerError(Exception):
    """Base class of every error composer raises on purpose."""


def problems_message(head: str, problems: list[str]) -> str:
    """One line for one or several problems: `head: p` or `head (2 problems): p1; p2`. The CLI promises one error
    line, so every problem is on it, the first one first."""
    if len(problems) == 1:
        return f"{head}: {problems[0]}"
    return f"{head} ({len(problems)} problems): " + "; ".join(problems)


class ConfigError(ComposerError, ValueError):
    """A runtime or sampling setting is unknown or out of range."""


class InvalidInputError(ComposerError, ValueError):
    """A generation request cannot be run as given (bad size, frame count, step count, prompt...)."""


class MemoryBudgetError(InvalidInputError):
    """A request (or a model's placement) whose predicted memory does not fit the memory budget: refused before it
    runs, with the numbers (composer/memory/)."""


class OutputError(ComposerError, OSError):
    """The video could not be written (the disk filled up, the folder went away...); the target is untouched."""


class ModelNotFoundError(ComposerError, FileNotFoundError):
    """A model folder or hub id could not be found (locally or in the Hugging Face cache)."""


class ModelFormatError(ComposerError, ValueError):
    """A model folder exists but is not laid out as expected (no model_index.json, bad JSON, missing part)."""


class UnknownModelError(ComposerError, KeyError):
    """No registered model family, pipeline or model class matches what the folder asks for."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class CheckpointError(ComposerError, ValueError):
    """A weights file is corrupt, or its tensors do not fit the model (names or shapes)."""


class UnsupportedError(ComposerError, NotImplementedError):
    """The model or option is recognised but not supported by this version of composer."""


class StageVerificationError(InvalidInputError):
    """A stage's input or output check failed. Names the stage, the field, the value and the rule."""

    def __init__(self, stage: str, phase: str, failures: list[tuple[str, str, str]]):
        self.stage = stage
        self.phase = phase
        self.failures = failures
        lines = [f"{field} = {value}: expected {rule}" for field, value, rule in failures]
        super().__init__(problems_message(f"{stage} {phase} check{'s' if len(lines) > 1 else ''} failed", lines))


class Cancelled(ComposerError):
    """The request was cancelled (`CancelToken.cancel()`, Ctrl-C in the CLI) before it finished.

    An ordinary exception, not a KeyboardInterrupt: a server catches it for the one request it cancelled and
    goes on, and cleanup written as `except Exception` (offload's block eviction, the KV cache's aborted
    pass) runs. The CLI exits 130 on it, as on Ctrl-C."""


class WorkerError(ComposerError):
    """A worker process of a multi-process generator (`num_gpus` > 1) failed alone or died, or the workers are
    stopped. `rank` names the failing worker (None when no one rank is to blame)."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank

    def __reduce__(self):
        return type(self), (self.args[0] if self.args else "", self.rank)


class RequestError(InvalidInputError):
    """A request that cannot run, found before any work: every failing field with its value and rule."""

    def __init__(self, failures: list[tuple[str, str, str]], cli: bool = False):
        self.failures = failures
        lines = [f"{field}: expected {rule}" if not value else
                 f"{field} {value}: expected {rule}" if cli else f"{field} = {value}: expected {rule}"
                 for field, value, rule in failures]
        head = "invalid request (nothing was loaded or generated)" if cli else "invalid request"
        super().__init__(problems_message(head, lines))
