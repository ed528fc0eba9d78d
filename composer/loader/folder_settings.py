"""A model folder's own `composer.json`: what it is (its family) and how to sample it, so a renamed or copied
folder does not fall back to another family's defaults.

    {"family": "shapes-t2v", "sampling": {"height": 64, "width": 64, "num_frames": 17}}

A third key, `quantization`, is written by `composer convert quantize` (composer/convert/quantize.py): the
denoisers hold quantized weights and load with that `quantize` mode.

Every key is optional. The family is used when the path or hub id does not identify one (the runtime option
`model_family` still wins); `sampling` values win over the family's defaults and the scheduler-derived folder
defaults, and lose to the user's (preset, flags, keywords). The sampling keys are checked against the family's
SamplingParam once the family is known (`SamplingParam.with_folder_defaults(values, source=path)`).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from composer.errors import ConfigError, problems_message

FILE_NAME = "composer.json"
KEYS = ("family", "sampling", "quantization")
# the `quantize` knob's modes (RuntimeArgs.quantize; "none" first): a quantized folder states one of the others
QUANTIZE_MODES = ("none", "int8", "fp8")
# A request's own fields: a model has no default prompt, seed or output file.
REQUEST_ONLY = ("prompt", "seed", "output_path", "num_videos_per_prompt")


@dataclass(frozen=True)
class FolderSettings:
    """What a folder's composer.json states (nothing when it has none)."""

    path: Path | None = None
    family: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    # written by `composer convert quantize`: the denoisers hold quantized weights (composer/convert/quantize.py)
    quantization: dict[str, Any] | None = None


def read_folder_settings(folder: Path) -> FolderSettings:
    """Read `folder/composer.json`; a missing file states nothing, a bad one is one ConfigError naming it."""
    path = Path(folder) / FILE_NAME
    if not path.is_file():
        return FolderSettings()
    fix = 'expected {"family": "<family name>", "sampling": {"<SamplingParam field>": value, ...}}'
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}); {fix}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} holds a {type(raw).__name__}; {fix}")
    errors = []
    for key in raw:
        if key not in KEYS:
            close = difflib.get_close_matches(key, KEYS, n=1)
            errors.append(f"unknown key '{key}'" + (f" (did you mean '{close[0]}'?)" if close else "")
                          + f"; the keys are {', '.join(KEYS)}")
    family, sampling = raw.get("family"), raw.get("sampling", {})
    if family is not None and (not isinstance(family, str) or not family.strip()):
        errors.append(f"family = {family!r}: expected a family name (`composer models` lists them)")
    if not isinstance(sampling, dict):
        errors.append(f"sampling = {sampling!r}: expected an object of SamplingParam fields")
        sampling = {}
    for key in REQUEST_ONLY:
        if key in sampling:
            errors.append(f"sampling.{key}: a request's own setting, not a model default; remove it")
    quantization = raw.get("quantization")
    if quantization is not None:
        errors += _quantization_errors(quantization)
    if errors:
        raise ConfigError(problems_message(f"invalid {path}", errors))
    return FolderSettings(path=path, family=family, sampling=dict(sampling), quantization=quantization)


def _quantization_errors(entry: Any) -> list[str]:
    if not isinstance(entry, dict):
        return [f"quantization = {entry!r}: expected the object `composer convert quantize` writes"]
    errors = []
    if entry.get("mode") not in QUANTIZE_MODES[1:]:
        errors.append(f"quantization.mode = {entry.get('mode')!r}: expected one of {', '.join(QUANTIZE_MODES[1:])}")
    if not isinstance(entry.get("file"), str):
        errors.append(f"quantization.file = {entry.get('file')!r}: expected the quantized weights' file name")
    return errors
