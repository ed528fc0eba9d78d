"""Shared machinery for the settings dataclasses (RuntimeArgs, SamplingParam): one name per knob
across Python kwargs, CLI flags, YAML presets and HTTP requests, with every bad knob reported at once."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any

from composer.errors import ConfigError


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
        raise ConfigError(f"invalid {what}:\n  " + "\n  ".join(errors))


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
