"""Shared machinery for the settings dataclasses (RuntimeArgs, SamplingParam): one name per knob
across Python kwargs, CLI flags, YAML presets and HTTP requests, with every bad knob reported at once."""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import functools
import math
import operator
import types
import typing
from typing import Any

from composer.errors import ConfigError, problems_message


def field_types(cls: type) -> dict[str, Any]:
    """Field name -> evaluated annotation (works under `from __future__ import annotations`)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if not f.name.startswith("_")}


def field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]


def unknown_key_errors(cls: type, keys: typing.Iterable[str], what: str) -> list[str]:
    """One message per key that is not a field of `cls`, with the closest field name as a suggestion."""
    known = field_names(cls)
    errors = []
    for key in keys:
        if key in known:
            continue
        close = difflib.get_close_matches(key, known, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        errors.append(f"unknown {what} '{key}'{hint}")
    return errors


def raise_if_errors(errors: list[str], what: str) -> None:
    if errors:
        raise ConfigError(problems_message(f"invalid {what}", errors))


def _without_none(annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else None
    return annotation


def base_type(annotation: Any) -> type | None:
    """The plain type behind `int`, `int | None`, `Optional[float]`, `list[str]` (-> list)... (None for anything
    fancier)."""
    annotation = _without_none(annotation)
    if typing.get_origin(annotation) is list:
        return list
    return annotation if isinstance(annotation, type) else None


def item_type(annotation: Any) -> type | None:
    """The item type of a `list[X]` (or `list[X] | None`) field, else None."""
    annotation = _without_none(annotation)
    if typing.get_origin(annotation) is not list:
        return None
    (item,) = typing.get_args(annotation) or (str,)
    return item if isinstance(item, type) else None


def coerce(value: Any, annotation: Any, name: str, errors: list[str]) -> Any:
    """Coerce a value from YAML / CLI / JSON to the field's type, recording a message when it cannot."""
    if value is None:
        return None
    item = item_type(annotation)
    if item is not None:  # a list: a list/tuple, one value, or (from a CLI or env string) comma-separated values
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        elif not isinstance(value, (list, tuple)):
            value = [value]
        return [coerce(v, item, f"{name}[{i}]", errors) for i, v in enumerate(value)]
    typ = base_type(annotation)
    try:
        if typ is bool:
            if isinstance(value, str):
                lowered = value.strip().lower()
                if lowered in ("1", "true", "yes", "on"):
                    return True
                if lowered in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            return bool(value)
        if typ is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if typ is float:
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if typ is str:
            if isinstance(value, (list, tuple, dict, set)):  # str() would turn ['a', 'b'] into one string
                raise TypeError(value)
            return str(value)
    except (TypeError, ValueError):
        errors.append(f"{name} = {value!r}: expected {typ.__name__}")
        return value
    return value


# -- JSON values against annotations (model folders' config files) ------------------------------------------------

_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null"}


def json_value_problem(value: Any, annotation: Any, strict: bool = True) -> str | None:
    """What `annotation` expects when the JSON `value` does not fit it ("an integer"), else None.

    `strict` (composer's own configs): int, float and bool are told apart (true is not 1, 2.5 is not an integer)
    and a number must be finite. Not strict (a library's class, whose annotations are looser than its behaviour):
    only the kind is checked (a number, a string, a list; null always passes), so "four" for an int is still
    caught. An annotation
    this check cannot read (a numpy array, a class) accepts anything."""
    fits = _fits(value, annotation, strict)
    return None if fits is not False else _describe(annotation, strict)


def _fits(value: Any, annotation: Any, strict: bool) -> bool | None:
    """True, False, or None when the annotation is beyond this check."""
    if annotation is Any:
        return None
    if value is None and not strict:  # libraries write null for many settings they annotate without None
        return True
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        answers = [_fits(value, arm, strict) for arm in args]
        return True if True in answers else None if None in answers else False
    if origin is typing.Literal:
        return value in args
    if origin in (list, tuple, collections.abc.Sequence):
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis and strict:
            if len(args) != len(value):
                return False
            answers = [_fits(v, a, strict) for v, a in zip(value, args)]
        else:  # a list, tuple[X, ...], or a library's Tuple[int] (which often means any length)
            item = _item_annotation(args)
            answers = [_fits(v, item, strict) for v in value] if args else [None]
        return False if False in answers else None if None in answers else True
    if origin is dict:
        return isinstance(value, dict)
    if annotation in (list, tuple):
        return isinstance(value, (list, tuple))
    if annotation is dict:
        return isinstance(value, dict)
    if annotation is type(None):
        return value is None
    if annotation in (int, float, bool):
        if not strict:
            return isinstance(value, (int, float))  # bool is an int
        if annotation is bool:
            return isinstance(value, bool)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        return isinstance(value, int) if annotation is int else math.isfinite(value)
    if annotation is str:
        return isinstance(value, str)
    return None


def _describe(annotation: Any, strict: bool) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arm, strict) for arm in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple and args and args[-1] is not Ellipsis and strict:
        return f"a list of {len(args)} ({', '.join(_describe(a, strict) for a in args)})"
    if origin in (list, tuple, collections.abc.Sequence) or annotation in (list, tuple):
        item = _item_annotation(args)
        return f"a list of {_plural(_describe(item, strict))}" if args else "a list"
    if origin is dict or annotation is dict:
        return "an object"
    if annotation in (int, float) and not strict:
        return "a number"
    if annotation is float:
        return "a finite number"
    return _KINDS.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _item_annotation(args: tuple) -> Any:
    """The annotation one item of a list / tuple annotation's items must fit (None: no item annotation)."""
    items = [a for a in args if a is not Ellipsis]
    return functools.reduce(operator.or_, items) if items else None


def _plural(kind: str) -> str:
    return {"an integer": "integers", "a number": "numbers", "a finite number": "finite numbers",
            "true or false": "booleans", "a string": "strings"}.get(kind, kind)


def json_field_problems(values: dict[str, Any], hints: dict[str, Any], strict: bool = True) -> list[str]:
    """`field = value: expected ...` for each key of `values` whose annotation in `hints` it does not fit
    (keys without an annotation are left to their reader)."""
    problems = []
    for key, value in values.items():
        if key in hints and (expected := json_value_problem(value, hints[key], strict)) is not None:
            problems.append(f"{key} = {value!r}: expected {expected}")
    return problems


def signature_types(function: Any) -> dict[str, Any]:
    """Parameter name -> evaluated annotation of a function (a library class's `__init__`); annotations that do
    not evaluate are left out."""
    import inspect

    try:
        return {k: v for k, v in typing.get_type_hints(function).items() if k != "return"}
    except Exception:  # noqa: BLE001 - a library's forward reference we cannot resolve: keep the plain ones
        try:
            parameters = inspect.signature(function).parameters.values()
        except (TypeError, ValueError):
            return {}
        return {p.name: p.annotation for p in parameters if not isinstance(p.annotation, str)
                and p.annotation is not inspect.Parameter.empty}
