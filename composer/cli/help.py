"""`composer generate --help`: the common flags, with the defaults of the model asked about; `--help-all`: every
flag (each model family's knobs, LoRA, offload, compile, caches, parallel).

A sampling flag's default is the model's own (its family's, with the folder's composer.json over them): the default
model's, or that of the `--model-path` given before `--help`. Only flags whose default truly lives in the folder
(a scheduler's shift) say so."""

from __future__ import annotations

import argparse
from typing import Any

# The flags plain --help shows (by dest); --help-all shows the rest too.
COMMON = ("help", "help_all", "model_path", "config", "prompt_file", "prompt", "negative_prompt", "height", "width",
          "num_frames", "num_inference_steps", "guidance_scale", "seed", "fps", "output_path", "overwrite", "device",
          "dtype", "offload", "threads", "lora_path", "progress", "stream", "segment")
SHOWN_CHARS = 48  # a longer default (a family's negative prompt) is shown cut


class HelpAction(argparse.Action):
    """-h/--help (the common flags) and --help-all (every flag), with the asked-about model's defaults."""

    def __init__(self, option_strings, dest, help=None):  # noqa: A002 - argparse's keyword
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001 - argparse's signature
        print(generate_help(parser, everything=option_string == "--help-all",
                            model_path=getattr(namespace, "model_path", None)))
        parser.exit(0)


def generate_help(parser: argparse.ArgumentParser, everything: bool, model_path: str | None) -> str:
    """The help text: every action's help restated for the model, the uncommon ones hidden unless `everything`."""
    family, defaults = model_defaults(model_path)
    saved = {id(a): a.help for a in parser._actions}
    usage = parser.usage
    try:
        hidden = 0
        sampling = set(parser.get_default("_sampling_names") or ())
        for action in parser._actions:
            flag = getattr(action, "composer_flag", None)
            if flag is not None and flag.name in sampling and defaults is not None:
                action.help = _flag_help(flag, defaults, family)
            if not everything and action.dest not in COMMON and action.help != argparse.SUPPRESS:
                action.help, hidden = argparse.SUPPRESS, hidden + 1
        whose = (f"Defaults shown are {family}'s ({'the default model' if model_path is None else model_path}); "
                 "give --model-path PATH before --help for another model's." if defaults is not None else
                 f"(The model's defaults could not be read: {family}.)")
        parser.usage = "composer generate [--model-path PATH] --prompt TEXT [options]"
        parser.epilog = whose + (f" {hidden} more flags (each model family's knobs, causal streaming, LoRA, "
                                 "offload, compile, caches, parallel): composer generate --help-all" if hidden else "")
        return parser.format_help()
    finally:
        for action in parser._actions:
            action.help = saved[id(action)]
        parser.usage, parser.epilog = usage, None


def model_defaults(model_path: str | None) -> tuple[str, dict[str, Any] | None]:
    """(family name, its sampling defaults for the model) without loading weights; (why not, None) when the
    folder cannot be read (a hub id not downloaded, say)."""
    import dataclasses

    from composer.errors import ComposerError
    from composer.registry.resolve import resolve_model

    try:
        resolved = resolve_model(model_path, None)
    except ComposerError as exc:
        return str(exc).splitlines()[0], None
    stated = resolved.stated
    steps = getattr(resolved.configs.pipeline_config().updated_from_folder(resolved.index.extra),
                    "denoising_step_list", None)
    values = {f.name: getattr(stated, f.name) for f in dataclasses.fields(stated)}
    if steps:  # a causal folder's step list fixes the step count
        values["num_inference_steps"] = len(steps)
    if values.get("flow_shift") is None and not steps:  # the folder's scheduler states it (or nothing does)
        values["flow_shift"] = _scheduler_shift(resolved.index.folder)
    return resolved.configs.family.name, values


def _scheduler_shift(folder: Any) -> float | None:
    """The shift the folder's scheduler config states (`flow_shift`, or `shift`), as the pipeline reads it."""
    import json
    from pathlib import Path

    try:
        config = json.loads((Path(folder) / "scheduler" / "scheduler_config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("flow_shift", config.get("shift")) if isinstance(config, dict) else None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _flag_help(flag: Any, defaults: dict[str, Any], family: str) -> str:
    """A sampling flag's help with the model's default (or that the model takes no such flag)."""
    text = flag.help
    if flag.choices is not None:
        choices = flag.choices() if callable(flag.choices) else flag.choices
        text = f"{text} (one of: {', '.join(choices)})"
    if flag.name not in defaults:
        return f"{text} (not a setting of {family})"
    value = defaults[flag.name]
    if "default" in flag.help:  # the help says where its default comes from (a folder's scheduler shift)
        return text if value is None else f"{text}; here: {value}"
    if value is None or value == "" or value == [] or value == ():
        return text
    shown = ("on" if value else "off") if isinstance(value, bool) else \
        " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    if len(shown) > SHOWN_CHARS:
        shown = repr(shown[:SHOWN_CHARS] + "...")
    return f"{text} (default: {shown})"
