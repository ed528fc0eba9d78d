"""Reading LoRA files: the namings people publish, turned into one model's module names.

A LoRA file holds, for each adapted Linear, a down matrix A [r, in] and an up matrix B [out, r]; the layer
computes W x + b + scale * (alpha / r) * B A x. Three namings are in use for Wan:

    diffusers / PEFT   transformer.blocks.0.attn1.to_q.lora_A.weight           alpha: header metadata (or PEFT's
                                                                               adapter_config.json), else r
    original Wan       diffusion_model.blocks.0.self_attn.q.lora_down.weight   (or lora_A), optional .alpha
    kohya / musubi     lora_unet_blocks_0_self_attn_q.lora_down.weight         .alpha

Module names are translated with the model's own checkpoint naming rules (the class attribute
`param_name_mappings`, the table the weight loader uses), so a model family whose checkpoints load gets its
LoRA names for free. Everything is checked against the model before an adapter touches it.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils.other import get_pattern_key
from safetensors import SafetensorError, safe_open
from torch import nn

from composer.errors import CheckpointError, ModelNotFoundError, UnsupportedError
from composer.loader.weights import apply_rules

# diffusers' safetensors header key: the LoraConfig as JSON, each key prefixed by its component.
METADATA_KEY = "lora_adapter_metadata"

# What a key's ending says its tensor is (".diff_b" before ".diff": both are suffixes of the same key).
_SUFFIXES = (
    (".lora_A.weight", "down"),
    (".lora_down.weight", "down"),
    (".lora_B.weight", "up"),
    (".lora_up.weight", "up"),
    (".lora_B.bias", "lora_bias"),  # PEFT's lora_bias: scaled by alpha / r like the product
    (".diff_b", "diff_b"),  # original Wan: a bias delta, scaled by the strength only
    (".alpha", "alpha"),
    (".diff", "diff"),  # original Wan: a full weight (or norm) delta
    (".dora_scale", "dora_scale"),
)

# Key prefix -> (naming, the scheme of `param_name_mappings` to try first). Tried in order; the empty prefix
# is PEFT's bare names (`get_peft_model_state_dict`).
_PREFIXES = (
    ("transformer.", "diffusers", "diffusers"),
    ("base_model.model.", "peft", "diffusers"),
    ("model.diffusion_model.", "original", "original"),
    ("diffusion_model.", "original", "original"),
    ("lora_unet_", "kohya", "original"),
    ("lora_transformer_", "kohya", "diffusers"),
    ("", "peft", "diffusers"),
)
_MAX_UNDERSCORES = 12  # a kohya name has 2**underscores dotted readings; real ones have fewer than 8


@dataclass(frozen=True)
class LoraModule:
    """One adapted Linear: y = W x + b + scale * ((alpha / rank) * up @ down @ x + bias)."""

    down: torch.Tensor  # [rank, in_features], as stored in the file (dtype included)
    up: torch.Tensor  # [out_features, rank]
    alpha: float
    bias: torch.Tensor | None = None  # [out_features] fp32: the bias delta at scale 1

    @property
    def rank(self) -> int:
        return self.down.shape[0]


@dataclass
class LoraFile:
    """A LoRA file read against one model: the adapted modules under the model's own names."""

    path: Path
    naming: str  # diffusers | peft | original | kohya
    modules: dict[str, LoraModule]
    ignored: list[str] = field(default_factory=list)  # all-zero `.diff` keys: exact no-ops, logged

    def summary(self) -> str:
        """`name [naming, rank 16, alpha 8, 300 modules]` for the log."""

        def span(values: set) -> str:
            low, high = min(values), max(values)
            return f"{low:g}" if low == high else f"{low:g}-{high:g}"

        ranks = {m.rank for m in self.modules.values()}
        alphas = {m.alpha for m in self.modules.values()}
        extra = f", {len(self.ignored)} zero .diff keys ignored" if self.ignored else ""
        return (f"{self.path.name} [{self.naming} naming, rank {span(ranks)}, alpha {span(alphas)}, "
                f"{len(self.modules)} modules{extra}]")


def _listing(names: list[str], limit: int = 6) -> str:
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def find_lora_file(path: str | Path) -> Path:
    """The .safetensors file a LoRA path names (the file, or the one file in a folder); the errors set_lora raises."""
    path = Path(path)
    if path.is_dir():  # diffusers' save_lora_weights writes a folder with one pytorch_lora_weights.safetensors
        files = sorted(path.glob("*.safetensors"))
        if len(files) != 1:
            found = f"{len(files)} ({_listing([f.name for f in files])})" if files else "none"
            raise CheckpointError(f"LoRA folder {path} should hold exactly one .safetensors file, found {found}: "
                                  "give the file's path instead")
        return files[0]
    if not path.is_file():
        raise ModelNotFoundError(f"LoRA file {path} does not exist: give the path of a .safetensors LoRA file "
                                 "(or of a folder holding one)")
    return path


def _read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return {key: f.get_tensor(key) for key in f.keys()}, f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file ({exc}): LoRA files must be "
                              "safetensors; convert a .pt/.bin/.ckpt with safetensors.torch.save_file") from exc


def _split_prefix(name: str) -> tuple[str, str, str]:
    """File module name -> (naming, preferred scheme, the name without its prefix)."""
    for prefix, naming, scheme in _PREFIXES:
        if name.startswith(prefix):
            return naming, scheme, name[len(prefix):]
    raise AssertionError("the empty prefix matches every name")


def _readings(stem: str, naming: str) -> list[str]:
    """The dotted names a module name may stand for: kohya joins with `_` what module names also contain."""
    if naming != "kohya":
        return [stem]
    parts = stem.split("_")
    if len(parts) - 1 > _MAX_UNDERSCORES:
        return []
    readings = []
    for joins in itertools.product("._", repeat=len(parts) - 1):
        readings.append(parts[0] + "".join(j + p for j, p in zip(joins, parts[1:])))
    return readings


def model_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every submodule by name, a PEFT-wrapped layer standing for its base layer (adapters may be active)."""
    found: dict[str, nn.Module] = {}

    def walk(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            full = prefix + name
            if isinstance(child, BaseTunerLayer):
                found[full] = child.get_base_layer()
                continue
            found[full] = child
            walk(full + ".", child)

    walk("", model)
    return found


def _resolve(path: Path, names: list[str], model: nn.Module, modules: Mapping[str, nn.Module]
             ) -> tuple[str, dict[str, str]]:
    """(naming, file module name -> model module name), or one error naming every module that fits nothing.

    The model's naming schemes are tried whole (a file uses one), preferred scheme first: the same name can
    mean different modules in two namings (original Wan's `norm3` is composer's `norm2`).
    """
    schemes = {"composer": [], **getattr(type(model), "param_name_mappings", {})}
    parsed = {name: _split_prefix(name) for name in names}
    naming, preferred = Counter((n, s) for n, s, _ in parsed.values()).most_common(1)[0][0]
    best: tuple[str, dict[str, str], dict[str, list[str]]] | None = None
    for scheme in sorted(schemes, key=lambda s: s != preferred):
        found, ambiguous = {}, {}
        for name, (name_naming, _, stem) in parsed.items():
            # the rules are written for parameter names: map the module's weight, then drop ".weight"
            hits = {apply_rules(reading + ".weight", schemes[scheme]).removesuffix(".weight")
                    for reading in _readings(stem, name_naming)} & modules.keys()
            if len(hits) == 1:
                found[name] = hits.pop()
            elif hits:
                ambiguous[name] = sorted(hits)
        if best is None or len(found) > len(best[1]):
            best = (scheme, found, ambiguous)
    assert best is not None
    scheme, found, ambiguous = best
    cls = type(model).__name__
    if ambiguous:
        raise CheckpointError(f"{path}: {len(ambiguous)} kohya module name(s) can be read as several layers of "
                              f"{cls}: " + _listing([f"{k} -> {' or '.join(v)}" for k, v in ambiguous.items()]))
    unmatched = sorted(set(names) - found.keys())
    if unmatched:
        example = next((n for n, m in modules.items() if isinstance(m, nn.Linear) and ".0." in n), "")
        raise CheckpointError(
            f"{path}: {len(unmatched)} LoRA module(s) match no layer of {cls} (read as {naming} naming, "
            f"translated with its '{scheme}' rules): {_listing(unmatched)}. Expected the names of its Linear "
            f"layers (e.g. {example}) in diffusers/PEFT, original Wan or kohya naming; is this a LoRA for "
            "another model or size, or for a text encoder?"
        )
    targets = Counter(found.values())
    doubled = sorted(name for name, count in targets.items() if count > 1)
    if doubled:
        raise CheckpointError(f"{path}: several LoRA entries adapt the same layer (two namings in one file?): "
                              + _listing(doubled))
    not_linear = sorted(f"{ours} ({type(modules[ours]).__name__})" for ours in found.values()
                        if not isinstance(modules[ours], nn.Linear))
    if not_linear:
        raise UnsupportedError(f"{path}: LoRA is supported on Linear layers only; the file adapts "
                               + _listing(not_linear))
    return naming, found


def _adapter_config(path: Path, metadata: Mapping[str, str]) -> dict | None:
    """The LoraConfig the file was saved with, if it says: diffusers' header metadata, or the
    `adapter_config.json` PEFT's `save_pretrained` writes next to `adapter_model.safetensors`."""
    sidecar = path.parent / "adapter_config.json"
    if METADATA_KEY in metadata:
        source, raw = f"the header metadata '{METADATA_KEY}'", metadata[METADATA_KEY]
    elif path.name == "adapter_model.safetensors" and sidecar.is_file():
        source, raw = str(sidecar), sidecar.read_bytes()
    else:
        return None
    try:
        config = json.loads(raw)  # bytes: a non-UTF-8 sidecar is a ValueError here too
        if not isinstance(config, dict):
            raise ValueError(f"a {type(config).__name__}, not an object")
    except ValueError as exc:
        raise CheckpointError(f"{path}: {source} is not a JSON object: {exc}") from exc
    if any(k.startswith("transformer.") for k in config):  # diffusers prefixes each component's keys
        config = {k.removeprefix("transformer."): v for k, v in config.items() if k.startswith("transformer.")}
    if config.get("use_dora"):
        raise UnsupportedError(f"{path} is a DoRA adapter (use_dora in {source}): only plain LoRA is supported")
    return config


def _config_alpha(config: dict | None) -> Callable[[str, int], float]:
    """alpha for a module without an `.alpha` tensor: the saved LoraConfig's (PEFT's own pattern rules), else
    the rank (scaling 1)."""
    if config is None:
        return lambda stem, rank: float(rank)
    default, patterns = config.get("lora_alpha"), config.get("alpha_pattern") or {}
    rslora = bool(config.get("use_rslora"))

    def alpha(stem: str, rank: int) -> float:
        value = patterns.get(get_pattern_key(list(patterns), stem), default)
        value = float(rank if value is None else value)
        return value * math.sqrt(rank) if rslora else value  # rsLoRA scales by alpha / sqrt(r)

    return alpha


def _refuse_non_finite(path: Path, part: tuple[str, torch.Tensor] | None) -> None:
    """A NaN or inf in an adapter's tensor makes every frame NaN (unfused: a black video, silently); refuse the
    file when it is read, in every mode."""
    if part is None or not part[1].is_floating_point():
        return
    key, tensor = part
    finite = torch.isfinite(tensor)
    if not finite.all():
        bad = int((~finite).sum())
        kinds = " and ".join(k for k, has in (("NaN", torch.isnan(tensor).any()), ("inf", torch.isinf(tensor).any()))
                             if has)
        raise CheckpointError(f"{path}: {key} holds {kinds} ({bad} of {tensor.numel()} values): the adapter would "
                              "make every frame NaN; the file is broken (export it again)")


def _module(path: Path, layer: nn.Linear, parts: dict[str, tuple[str, torch.Tensor]],
            config_alpha: Callable[[str, int], float], stem: str) -> LoraModule:
    down, up = parts.get("down"), parts.get("up")
    if (down is None) != (up is None):
        key = (down or up)[0]
        missing = "up (lora_B / lora_up)" if up is None else "down (lora_A / lora_down)"
        raise CheckpointError(f"{path}: {key} has no matching {missing} matrix: the file is incomplete")
    if "diff_b" in parts and "lora_bias" in parts:
        raise CheckpointError(f"{path}: {parts['diff_b'][0]} and {parts['lora_bias'][0]} both give the bias delta "
                              "of one layer: keep one")
    bias_part = parts.get("diff_b") or parts.get("lora_bias")
    for part in (down, up, bias_part):
        _refuse_non_finite(path, part)
    if down is None and bias_part is None:
        raise CheckpointError(f"{path}: {parts['alpha'][0]} belongs to no LoRA matrices (no lora_A/lora_B or "
                              "lora_down/lora_up for that layer)")
    if bias_part is not None and tuple(bias_part[1].shape) != (layer.out_features,):
        raise CheckpointError(f"{path}: {bias_part[0]} is {list(bias_part[1].shape)}, the layer's bias is "
                              f"[{layer.out_features}]")
    if down is None:  # a bias delta alone rides on a rank-1 adapter whose matrices are zero
        zero_down = torch.zeros(1, layer.in_features)
        return LoraModule(zero_down, torch.zeros(layer.out_features, 1), 1.0, bias_part[1].float())
    (down_key, a), (up_key, b) = down, up
    if a.ndim != 2 or b.ndim != 2:
        raise UnsupportedError(f"{path}: {down_key} is {list(a.shape)}: only LoRA of Linear layers (2-D "
                               "matrices) is supported, not convolution LoRA")
    rank = a.shape[0]
    if a.shape[1] != layer.in_features or tuple(b.shape) != (layer.out_features, rank):
        raise CheckpointError(
            f"{path}: {down_key} is {list(a.shape)} and {up_key} is {list(b.shape)}, but the layer is "
            f"Linear({layer.in_features} -> {layer.out_features}): expected [r, {layer.in_features}] and "
            f"[{layer.out_features}, r] with the same r. Is this a LoRA for another model size?"
        )
    alpha = float(parts["alpha"][1].float().item()) if "alpha" in parts else config_alpha(stem, rank)
    if not math.isfinite(alpha) or alpha == 0:
        raise CheckpointError(f"{path}: alpha of {down_key.removesuffix('.weight')} is {alpha}: expected a "
                              "finite non-zero number")
    bias = None
    if bias_part is not None:
        # diff_b is the delta itself; PEFT's lora_B.bias is scaled by alpha / r like the product
        bias = bias_part[1].float() * (alpha / rank if "diff_b" not in parts else 1.0)
    return LoraModule(a, b, alpha, bias)


def read_lora(path: str | Path, model: nn.Module) -> LoraFile:
    """Read and check a LoRA file against `model`: per adapted Linear (in the model's module names) its down
    [r, in] and up [out, r] matrices, alpha and bias delta. Nothing in the model changes."""
    path = find_lora_file(path)
    tensors, metadata = _read(path)
    groups: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    unknown = []
    for key, tensor in tensors.items():
        match = next(((suffix, kind) for suffix, kind in _SUFFIXES if key.endswith(suffix)), None)
        if match is None:
            unknown.append(key)
            continue
        groups.setdefault(key[: -len(match[0])], {})[match[1]] = (key, tensor)
    if unknown:
        raise UnsupportedError(
            f"{path}: {len(unknown)} tensor(s) are not LoRA tensors composer reads: {_listing(sorted(unknown))}. "
            "Read: lora_A/lora_B or lora_down/lora_up matrices, .alpha, .diff_b and lora_B.bias (LoKr, LoHa and "
            "other LyCORIS formats are not supported)"
        )
    if not groups:
        raise CheckpointError(f"{path} holds no tensors: not a LoRA file")
    dora = sorted(parts["dora_scale"][0] for parts in groups.values() if "dora_scale" in parts)
    if dora:
        raise UnsupportedError(f"{path} is a DoRA adapter ({_listing(dora)}): only plain LoRA is supported")
    ignored, weight_deltas = [], []
    for name in list(groups):
        diff = groups[name].pop("diff", None)
        if diff is not None:
            (ignored if not diff[1].any() else weight_deltas).append(diff[0])
        if not groups[name]:
            del groups[name]
    if weight_deltas:
        raise UnsupportedError(
            f"{path}: full weight deltas (.diff) are not supported, only low-rank ones: "
            f"{_listing(sorted(weight_deltas))}. Extract a LoRA from them, or merge them into the model's weights"
        )
    if not groups:
        raise CheckpointError(f"{path} holds only all-zero .diff tensors: there is nothing to apply")
    modules = model_modules(model)
    naming, targets = _resolve(path, sorted(groups), model, modules)
    config_alpha = _config_alpha(_adapter_config(path, metadata))
    adapted = {
        targets[name]: _module(path, modules[targets[name]], parts, config_alpha, _split_prefix(name)[2])
        for name, parts in groups.items()
    }
    return LoraFile(path, naming, dict(sorted(adapted.items())), sorted(ignored))
