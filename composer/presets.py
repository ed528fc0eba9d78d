"""YAML presets (`composer generate --config preset.yaml`): a model path, runtime options and sampling
defaults, under the same names as everywhere else.

    model_path: Wan-AI/Wan2.1-T2V-1.3B-Diffusers
    runtime:
      dtype: bf16
    sampling:
      height: 480
      num_inference_steps: 50
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from composer._fields import raise_if_errors, unknown_key_errors
from composer.configs.base import SamplingParam
from composer.errors import ConfigError
from composer.runtime import RuntimeArgs

_TOP_LEVEL = ("model_path", "runtime", "sampling")


@dataclass
class Preset:
    model_path: str | None = None
    runtime: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)


def load_preset(path: str | Path) -> Preset:
    """Read and check a preset; one ConfigError lists every unknown key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"preset {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as exc:
        raise ConfigError(f"preset {path} is not UTF-8 text (byte {exc.start}: {exc.reason}); save it as UTF-8 "
                          "YAML") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"preset {path} is not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"preset {path} must be a mapping with keys {', '.join(_TOP_LEVEL)}")
    errors = [f"unknown top-level key '{k}' (expected {', '.join(_TOP_LEVEL)})" for k in raw if k not in _TOP_LEVEL]
    runtime, sampling = raw.get("runtime") or {}, raw.get("sampling") or {}
    for name, section in (("runtime", runtime), ("sampling", sampling)):
        if not isinstance(section, dict):
            errors.append(f"'{name}' must be a mapping, got {type(section).__name__}")
    if not errors:
        from composer.registry.configs import sampling_field_names

        errors += unknown_key_errors(RuntimeArgs, runtime, "runtime option")
        known = sampling_field_names()
        errors += unknown_key_errors(SamplingParam, [k for k in sampling if k not in known], "sampling parameter")
    raise_if_errors(errors, f"preset {path}")
    model_path = raw.get("model_path")
    return Preset(model_path=str(model_path) if model_path is not None else None, runtime=runtime, sampling=sampling)
