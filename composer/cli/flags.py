"""CLI flags generated from the settings dataclasses: field `num_frames` is flag `--num-frames`."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Any

from composer._fields import base_type, field_types

ALIASES = {"num_inference_steps": ["--steps"], "output_path": ["--output", "-o"], "gen_length": ["--max-new-tokens"]}


@dataclass(frozen=True)
class Flag:
    name: str
    type: type | None
    help: str
    choices: Any = None  # a tuple of accepted values, or a function returning it (read when the parser is built)
    default: str | None = None  # the dataclass default as --help shows it (the flag's own default stays None)
    aliases: tuple[str, ...] = ()  # more spellings, from the field's metadata ("aliases": a family declares its own)


def dataclass_flags(*classes: type) -> list[Flag]:
    """One flag per field name across `classes` (the first class declaring a name gives its type and help; the
    default shown is the field's, or "the model family's" where the classes' defaults differ)."""
    flags: dict[str, Flag] = {}
    defaults: dict[str, list[Any]] = {}
    for cls in classes:
        types = field_types(cls)
        for f in dataclasses.fields(cls):
            if f.name.startswith("_"):
                continue
            defaults.setdefault(f.name, []).append(_field_default(f))
            if f.name not in flags:
                flags[f.name] = Flag(f.name, base_type(types[f.name]), f.metadata.get("help", ""),
                                     f.metadata.get("choices"), aliases=tuple(f.metadata.get("aliases", ())))
    return [dataclasses.replace(flag, default=_shown_default(defaults[name])) for name, flag in flags.items()]


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _shown_default(values: list[Any]) -> str | None:
    """How --help states a default: None shows nothing (the help text says what happens without the flag)."""
    first = values[0]
    if any(v != first for v in values[1:]):
        return "the model family's"
    if first is None or first == "" or first == [] or first == ():
        return None
    if isinstance(first, bool):
        return "on" if first else "off"
    if isinstance(first, (list, tuple)):
        return " ".join(map(str, first))
    return str(first)


class StoreTyped(argparse.Action):
    """Store the value, and the spelling the user typed (`--max-new-tokens` for gen_length) in
    `args.typed_flags`, so a problem names the flag as typed."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001 - argparse's signature
        setattr(namespace, self.dest, values)
        namespace.typed_flags = {**(getattr(namespace, "typed_flags", None) or {}), self.dest: option_string}


def add_flags(group: argparse._ArgumentGroup, flags: list[Flag]) -> list[str]:
    """Add the flags (default None, so only what the user typed overrides presets); returns their names."""
    for flag in flags:
        names = [f"--{flag.name.replace('_', '-')}", *ALIASES.get(flag.name, []), *flag.aliases]
        help_text = flag.help
        if flag.choices is not None:  # listed, not enforced here: the dataclass reports every bad value at once
            choices = flag.choices() if callable(flag.choices) else flag.choices
            help_text = f"{help_text} (one of: {', '.join(choices)})"
        if flag.default is not None and "default" not in help_text:  # a help text that states its own wins
            help_text = f"{help_text} (default: {flag.default})"
        if flag.type is bool:
            action = group.add_argument(*names, dest=flag.name, action=argparse.BooleanOptionalAction, default=None,
                                        help=help_text)
        elif flag.type is list:
            action = group.add_argument(*names, dest=flag.name, nargs="+", default=None, metavar="VALUE",
                                        help=help_text, action=StoreTyped)
        else:
            metavar = {int: "INT", float: "FLOAT"}.get(flag.type, "STR")
            action = group.add_argument(*names, dest=flag.name, type=str, default=None, metavar=metavar,
                                        help=help_text, action=StoreTyped)
        action.composer_flag = flag  # --help restates its default for the model asked about (cli/generate.py)
    return [flag.name for flag in flags]


def collect(args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    """The flags the user gave (values stay strings; the dataclasses coerce and report bad ones)."""
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}
