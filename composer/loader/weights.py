"""Loading safetensors checkpoints into composer's own models.

A model class declares, as data: `param_name_mappings` (naming scheme -> ordered regex rules that turn
checkpoint names into composer names), `ignored_checkpoint_keys` and `keep_in_fp32` patterns. The loader
picks the naming scheme the checkpoint uses, checks every name and shape before touching the model, and
streams tensors from disk straight to the target device and dtype.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
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
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
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


@dataclass
class WeightPlan:
    """How a checkpoint fills a model: checked names, where each tensor lives, and which stay fp32."""

    match: NameMatch
    where: dict[str, tuple[Path, tuple[int, ...]]]  # checkpoint name -> (file, shape)
    keep_in_fp32: Sequence[str]

    def dtype_for(self, ours: str, dtype: torch.dtype) -> torch.dtype:
        """The dtype a floating tensor named `ours` (composer name) is loaded in."""
        return torch.float32 if any(re.search(p, ours) for p in self.keep_in_fp32) else dtype


@dataclass(frozen=True)
class TensorSource:
    """Where one composer tensor is stored: file, checkpoint name, and the dtype it is used in."""

    path: Path
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None  # None: not floating, used as stored


@dataclass(frozen=True)
class TensorShard:
    """A model tensor that holds part of a checkpoint tensor: the checkpoint tensor's `full_shape`, and the
    `index` (slices, one per leading dim) that cuts this part out of it. Tensor parallelism loads this way."""

    full_shape: tuple[int, ...]
    index: tuple[slice, ...]


def plan_weights(model: nn.Module, folder: Path, shards: Mapping[str, TensorShard] | None = None) -> WeightPlan:
    """Match the checkpoint in `folder` to `model` from the headers only.

    `shards`: composer name -> TensorShard for tensors the model holds a slice of (checked against the full
    shape). Raises CheckpointError naming every missing, unexpected or wrongly shaped tensor.
    """
    cls = type(model)
    shards = shards or {}
    expected = {
        name: shards[name].full_shape if name in shards else tuple(t.shape) for name, t in model.state_dict().items()
    }
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
    return WeightPlan(match, where, getattr(cls, "keep_in_fp32", ()))


def tensor_sources(model: nn.Module, folder: Path, dtype: torch.dtype) -> dict[str, TensorSource]:
    """Composer tensor name -> where it is stored and the dtype it is used in (the checks of `load_weights`,
    nothing read but the headers)."""
    plan = plan_weights(model, folder)
    sources = {}
    for path in dict.fromkeys(p for p, _ in plan.where.values()):
        with _open(path) as f:
            for name in f.keys():
                ours = plan.match.mapped.get(name)
                if ours is None:
                    continue
                floating = f.get_slice(name).get_dtype() in _FLOATING
                sources[ours] = TensorSource(
                    path, name, plan.where[name][1], plan.dtype_for(ours, dtype) if floating else None
                )
    return sources


# safetensors' dtype names of floating tensors (the ones loading casts)
_FLOATING = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4"}


def load_weights(
    model: nn.Module,
    folder: Path,
    device: torch.device,
    dtype: torch.dtype,
    *,
    skip: Callable[[str], bool] | None = None,
    shards: Mapping[str, TensorShard] | None = None,
    on_read: Callable[[str, torch.Tensor], None] | None = None,
) -> str:
    """Fill `model` (usually built on the meta device) from the safetensors in `folder`.

    Returns the naming scheme the checkpoint used. Raises CheckpointError naming every missing, unexpected
    or wrongly shaped tensor before anything is loaded. `skip(composer_name)` true: that tensor is not read
    and keeps what the model holds (the disk offload tier leaves its block weights on disk this way).
    `shards`: composer name -> TensorShard: only that slice of the checkpoint tensor is read from disk (the
    whole tensor is never materialised). `on_read(composer_name, tensor)` sees each tensor as read from the
    file, before any cast (accounting of what was read).
    """
    shards = shards or {}
    plan = plan_weights(model, folder, shards)
    match, where = plan.match, plan.where
    by_file: dict[Path, list[str]] = {}
    for name in match.mapped:
        if skip is None or not skip(match.mapped[name]):
            by_file.setdefault(where[name][0], []).append(name)
    state: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        with _open(path, str(device)) as f:
            for name in names:
                ours = match.mapped[name]
                shard = shards.get(ours)
                tensor = f.get_slice(name)[shard.index].to(device) if shard else f.get_tensor(name)
                if on_read is not None:
                    on_read(ours, tensor)
                if tensor.is_floating_point():
                    tensor = tensor.to(plan.dtype_for(ours, dtype))
                state[ours] = tensor
    model.load_state_dict(state, strict=skip is None, assign=True)
    return match.scheme
