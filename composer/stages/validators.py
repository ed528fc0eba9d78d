"""Named validators for stage checks: `result.add_check("height", batch.height, V.divisible_by(16))`.

A validator reads only Python values and tensor metadata (shape, dtype, device), never tensor data, so
checking never synchronises the device. Checks that must read data (`V.all_finite`) are marked
`reads_values` and run only when value checks are switched on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True)
class Validator:
    """A predicate with the rule it enforces, in words."""

    rule: str
    check: Callable[[Any], bool]
    reads_values: bool = False

    def __call__(self, value: Any) -> bool:
        try:
            return bool(self.check(value))
        except (TypeError, ValueError, AttributeError):
            return False


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class V:
    """The validator catalogue."""

    not_none = Validator("a value (not None)", lambda v: v is not None)
    positive_int = Validator("a positive integer", lambda v: _is_int(v) and v > 0)
    finite_number = Validator(
        "a finite number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    )
    non_negative_number = Validator(
        "a finite number >= 0", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
    )
    positive_number = Validator(
        "a finite number > 0", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
    )
    is_tensor = Validator("a torch.Tensor", lambda v: isinstance(v, torch.Tensor))
    non_empty_strings = Validator(
        "a non-empty list of non-empty strings",
        lambda v: isinstance(v, list) and len(v) > 0 and all(isinstance(s, str) and s.strip() for s in v),
    )
    all_finite = Validator("finite values (no NaN or inf)", lambda v: bool(torch.isfinite(v).all()), reads_values=True)

    @staticmethod
    def divisible_by(n: int) -> Validator:
        return Validator(f"a positive multiple of {n}", lambda v: _is_int(v) and v > 0 and v % n == 0)

    @staticmethod
    def congruent(modulus: int, remainder: int) -> Validator:
        return Validator(
            f"a positive integer of the form {modulus}k+{remainder}",
            lambda v: _is_int(v) and v > 0 and v % modulus == remainder % modulus,
        )

    @staticmethod
    def int_in_range(low: int, high: int) -> Validator:
        return Validator(f"an integer in [{low}, {high}]", lambda v: _is_int(v) and low <= v <= high)

    @staticmethod
    def ndim(n: int) -> Validator:
        return Validator(f"a tensor with {n} dimensions", lambda v: isinstance(v, torch.Tensor) and v.ndim == n)

    @staticmethod
    def shape(expected: Sequence[int | None]) -> Validator:
        """Tensor shape; None entries match any size."""
        text = "[" + ", ".join("*" if s is None else str(s) for s in expected) + "]"
        return Validator(
            f"a tensor of shape {text}",
            lambda v: isinstance(v, torch.Tensor)
            and v.ndim == len(expected)
            and all(e is None or e == s for e, s in zip(expected, v.shape)),
        )

    @staticmethod
    def dtype_in(*dtypes: torch.dtype) -> Validator:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        return Validator(f"a tensor of dtype {names}", lambda v: isinstance(v, torch.Tensor) and v.dtype in dtypes)


def describe(value: Any) -> str:
    """A short description of a value for error messages; tensors by metadata only (no device sync)."""
    if isinstance(value, torch.Tensor):
        return f"Tensor(shape={list(value.shape)}, dtype={str(value.dtype).replace('torch.', '')}, device={value.device})"
    if isinstance(value, np.ndarray):
        return f"ndarray(shape={list(value.shape)}, dtype={value.dtype})"
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


class VerificationResult:
    """Collects named checks; failures keep (field, value described, rule)."""

    def __init__(self, check_values: bool = False):
        self.check_values = check_values
        self.failures: list[tuple[str, str, str]] = []

    def add_check(self, field: str, value: Any, *validators: Validator, hint: str = "") -> VerificationResult:
        for validator in validators:
            if validator.reads_values and not self.check_values:
                continue
            if not validator(value):
                rule = validator.rule + (f" ({hint})" if hint else "")
                self.failures.append((field, describe(value), rule))
                break
        return self

    def add_failure(self, field: str, value: Any, rule: str) -> VerificationResult:
        self.failures.append((field, describe(value), rule))
        return self

    @property
    def ok(self) -> bool:
        return not self.failures


def check_input_length(result: VerificationResult, name: str, frames: int, limits: Any) -> None:
    """An input video whose length is the video's (a family's `length_from_input`): at most the limits' max_frames
    (a request_check.ModelLimits, or None), as num_frames would be. (The family rules in stages/ call it here, below
    the request check that calls them.)"""
    most = None if limits is None else limits.max_frames
    if most is not None and frames > most:
        result.add_failure(f"{name} frames", frames, f"at most {most} ({limits.reasons.get('max_frames', 'the limit')}"
                           "; the video made is as long as this one)")
