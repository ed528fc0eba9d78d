"""CLI flags generated from the settings dataclasses: field `num_frames` is flag `--num-frames`."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from composer._fields import base_type, field_types

ALIASES = {"num_inference_steps": ["--steps"], "output_path": ["--output", "-o"]}


def add_dataclass_flags(group: argparse._ArgumentGroup, cls: type, skip: tuple[str, ...] = ()) -> list[str]:
    """One flag per field (default None, so only what the user typed overrides presets)."""
    types_ = field_types(cls)
    names = []
    for f in dataclasses.fields(cls):
        if f.name in skip or f.name.startswith("_"):
            continue
        typ = base_type(types_[f.name])
        flags = [f"--{f.name.replace('_', '-')}", *ALIASES.get(f.name, [])]
        help_text = f.metadata.get("help", "")
        if typ is bool:
            group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            metavar = {int: "INT", float: "FLOAT"}.get(typ, "STR")
            group.add_argument(*flags, dest=f.name, type=str, default=None, metavar=metavar, help=help_text)
        names.append(f.name)
    return names


def collect(args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    """The flags the user gave (values stay strings; the dataclasses coerce and report bad ones)."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}
