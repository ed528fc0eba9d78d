"""Loading safetensors checkpoints into composer's own models.

A model class declares, as data: `param_name_mappings` (naming scheme -> ordered regex rules that turn
checkpoint names into composer names), `ignored_checkpoint_keys` and `keep_in_fp32` patterns. The loader
picks the naming scheme the checkpoint uses, checks every name and shape before touching the model, and
streams tensors from disk straight to the target device and dtype.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from composer.errors import CheckpointError, ModelFormatError

Rules = Sequence[tuple[str, str]]


def find_weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a component folder: shards listed by an index, or the single file."""
    indexes = sorted(folder.glob("*.safetensors.index.json"))
    if indexes:
        index = indexes[0]
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {exc}") from exc
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index.name} lists shards that are not in {folder}: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt*"))
        hint = f" (found {', '.join(others)}: convert them to safetensors)" if others else ""
        raise ModelFormatError(f"no .safetensors weights in {folder}{hint}")
    if len(files) > 1:
        raise CheckpointError(
            f"{folder} holds several .safetensors files ({', '.join(f.name for f in files)}) but no "
            "*.safetensors.index.json saying how they fit together"
        )
    return files


def _open(path: Path, device: str = "cpu"):
    try:
        return safe_open(str(path), framework="pt", device=device)
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file (corrupt or truncated?): {exc}") from exc


def checkpoint_index(files: Iterable[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """Checkpoint tensor name -> (the file that holds it, its shape), from the headers only."""
    where: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for path in files:
        with _open(path) as f:
            for key in f.keys():
                where[key] = (path, tuple(f.get_slice(key).get_shape()))
    return where


def apply_rules(name: str, rules: Rules) -> str:
    for pattern, replacement in rules:
        name = re.sub(pattern, replacement, name)
    return name


@dataclass
class NameMatch:
    scheme: str
    mapped: dict[str, str]  # checkpoint name -> composer name
    missing: list[str]  # composer names nothing maps to
    unexpected: list[str]  # checkpoint names that map to nothing in the model


def match_names(
    checkpoint_names: Iterable[str],
    model_names: set[str],
    schemes: dict[str, Rules],
    ignored: Sequence[str] = (),
) -> NameMatch:
    """Map checkpoint names with each naming scheme and keep the scheme that fits best."""
    names = [n for n in checkpoint_names if not any(re.search(p, n) for p in ignored)]
    best: NameMatch | None = None
    for scheme, rules in {"composer": [], **schemes}.items():
        mapped = {n: apply_rules(n, rules) for n in names}
        hits = set(mapped.values()) & model_names
        match = NameMatch(
            scheme=scheme,
            mapped={n: m for n, m in mapped.items() if m in model_names},
            missing=sorted(model_names - hits),
            unexpected=sorted(n for n, m in mapped.items() if m not in model_names),
        )
        if best is None or len(match.missing) + len(match.unexpected) < len(best.missing) + len(best.unexpected):
            best = match
    assert best is not None
    return best


def _listing(names: list[str], limit: int = 8) -> str:
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def load_weights(
    model: nn.Module,
    folder: Path,
    device: torch.device,
    dtype: torch.dtype,
) -> str:
    """Fill `model` (usually built on the meta device) from the safetensors in `folder`.

    Returns the naming scheme the checkpoint used. Raises CheckpointError naming every missing, unexpected
    or wrongly shaped tensor before anything is loaded.
    """
    cls = type(model)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    where = checkpoint_index(find_weight_files(folder))
    match = match_names(
        where, set(expected), getattr(cls, "param_name_mappings", {}), getattr(cls, "ignored_checkpoint_keys", ())
    )
    problems = []
    if match.missing:
        problems.append(f"missing {len(match.missing)} tensors: {_listing(match.missing)}")
    if match.unexpected:
        problems.append(f"{len(match.unexpected)} tensors the model does not have: {_listing(match.unexpected)}")
    wrong_shapes = [
        f"{name} is {list(where[name][1])}, {ours} expects {list(expected[ours])}"
        for name, ours in match.mapped.items()
        if where[name][1] != expected[ours]
    ]
    if wrong_shapes:
        problems.append(
            f"{len(wrong_shapes)} tensors have the wrong shape (is config.json from the same checkpoint?): "
            + _listing(wrong_shapes, limit=4)
        )
    if problems:
        raise CheckpointError(
            f"the checkpoint in {folder} does not fit {cls.__name__} (closest naming: {match.scheme}): "
            + "; ".join(problems)
        )

    keep_fp32 = getattr(cls, "keep_in_fp32", ())
    by_file: dict[Path, list[str]] = {}
    for name in match.mapped:
        by_file.setdefault(where[name][0], []).append(name)
    state: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        with _open(path, str(device)) as f:
            for name in names:
                ours = match.mapped[name]
                tensor = f.get_tensor(name)
                if tensor.is_floating_point():
                    wanted = torch.float32 if any(re.search(p, ours) for p in keep_fp32) else dtype
                    tensor = tensor.to(wanted)
                state[ours] = tensor
    model.load_state_dict(state, strict=True, assign=True)
    return match.scheme
