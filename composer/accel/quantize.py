"""Weight-only quantization hook (`quantize = none | int8 | fp8`), through torchao (the optional extra `quant`).

What is quantized: every `nn.Linear` inside the denoisers' repeated blocks (attention q/k/v/o projections of
self- and cross-attention, the FFN). Embeddings, the time/text projections, norms, modulation tables and the
output head stay in the runtime dtype: they are a few percent of the weights and the most sensitive to error.

- int8: torchao's `Int8WeightOnlyConfig` (per-output-channel int8 weights, `Int8Tensor`). torchao 0.18 has no
  dedicated weight-only kernel: its `Int8Tensor` linear casts the int8 weight to the activation dtype, runs an
  ordinary `torch.mm` and scales the output per channel (plain torch ops, the same on CPU and CUDA; under
  torch.compile the cast fuses). Weight memory drops to about a quarter of fp32, but each step pays the cast:
  eager, it is slower than fp32 (docs/quantization.md has the measured figures).
- fp8: torchao's `Float8WeightOnlyConfig` (e4m3 weights), only on a CUDA GPU with compute capability 8.9+
  (Ada, Hopper and later); anywhere else a ConfigError before anything loads.
- none: the hook is not even imported; the model is bit-for-bit what it is without this module.

It runs first in the hook phase: LoRA (unfused PEFT layers work on torchao weights, PEFT wraps them in its
`TorchaoLoraLinear`) and the other hooks see the quantized layers. Fused LoRA is refused: merging a delta into
int8 weights would re-quantize them (a different model). A folder written by `composer convert quantize`
(see `composer.convert.quantize`) holds the quantized weights already; `load_module` reads them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from composer.accel.blocks import repeated_blocks
from composer.errors import ConfigError, ModelFormatError
from composer.logging import get_logger

logger = get_logger(__name__)

FP8_MIN_CAPABILITY = (8, 9)


def _torchao():
    try:
        import torchao  # noqa: F401
        from torchao.quantization import quantize_
    except ImportError:
        raise ConfigError("quantize needs torchao, which is not installed: pip install 'composer[quant]' "
                          "(or pip install torchao, keeping your torch)") from None
    return quantize_


def config_for(mode: str):
    """The torchao config object for `mode` ('int8' or 'fp8')."""
    _torchao()
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig

    if mode == "int8":
        return Int8WeightOnlyConfig()
    if mode == "fp8":
        return Float8WeightOnlyConfig()
    raise ConfigError(f"quantize = {mode!r}: expected one of none, int8, fp8")


def check_supported(runtime: Any) -> None:
    """Refuse, before loading, what this machine cannot run: torchao missing, or fp8 without fp8 hardware."""
    if runtime.quantize == "none":
        return
    _torchao()
    if runtime.quantize != "fp8":
        return
    from composer.platform import platform_for

    device = runtime.torch_device
    platform = platform_for(device)
    if device.type != "cuda":
        have = (f"no CUDA GPU (device = {runtime.device!r})" if not platform_for("cuda").is_available()
                else f"device = {runtime.device!r}, not a CUDA GPU")
        raise ConfigError(f"quantize = fp8 needs a GPU with fp8 support (compute capability 8.9+): this machine "
                          f"has {have}; use quantize = int8")
    capability = platform.capability(device)
    if capability < FP8_MIN_CAPABILITY:
        raise ConfigError(
            f"quantize = fp8 needs a GPU with fp8 support (compute capability 8.9+): this machine has "
            f"{platform.device_name(device)} (compute capability {capability[0]}.{capability[1]}); use "
            "quantize = int8")


def is_quantized(tensor: torch.Tensor) -> bool:
    """True for a torchao tensor subclass (a quantized weight)."""
    return type(tensor) is not torch.Tensor and type(tensor) is not nn.Parameter and hasattr(
        tensor, "__tensor_flatten__")


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes a weight holds: a torchao tensor's inner tensors (int8 data + scales), or a plain tensor's."""
    if is_quantized(tensor):
        names = tensor.__tensor_flatten__()[0]
        return sum(tensor_bytes(getattr(tensor, n)) for n in names)
    return tensor.numel() * tensor.element_size()


def block_linears(model: nn.Module) -> list[nn.Linear]:
    """The `nn.Linear` layers inside the model's repeated blocks (what quantization acts on)."""
    found = repeated_blocks(model)
    if found is None:
        return []
    return [m for m in found[1].modules() if isinstance(m, nn.Linear)]


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of the repeated blocks' linear weights (quantized or not)."""
    return sum(tensor_bytes(m.weight) for m in block_linears(model))


def quantize_model(model: nn.Module, mode: str) -> int:
    """Quantize the repeated blocks' linears of `model` in place; returns how many layers were quantized."""
    quantize_ = _torchao()
    found = repeated_blocks(model)
    if found is None:
        raise ConfigError(f"quantize = {mode}: {type(model).__name__} declares no repeated blocks to quantize")
    todo = [m for m in block_linears(model) if not is_quantized(m.weight)]
    if todo:
        quantize_(found[1], config_for(mode))
    return len(todo)


class QuantizeHook:
    """Hook phase: the runtime's `quantize` on every denoising transformer (first, before LoRA)."""

    name = "quantize"


    def load_module(self, pipeline: Any, name: str, folder: Any, spec: Any, dtype: torch.dtype | None):
        """A denoiser of a folder written by `composer convert quantize`: its quantized weights, read as saved
        (None otherwise: the usual loader, then `apply` quantizes)."""
        from composer.loader.folder_settings import read_folder_settings

        entry = read_folder_settings(pipeline.folder).quantization
        if not entry or not name.startswith("transformer") or name not in entry.get("components", [name]):
            return None
        return load_quantized(folder, spec, entry["file"], pipeline.load_device(name), dtype or torch.float32)

    def apply(self, pipeline: Any) -> str:
        mode = pipeline.runtime.quantize
        lines = []
        for name, model in pipeline.denoisers().items():
            before = linear_weight_bytes(model)
            already = all(is_quantized(m.weight) for m in block_linears(model))
            count = quantize_model(model, mode)
            after = linear_weight_bytes(model)
            how = "read quantized from the folder" if already and not count else f"{count} linears"
            lines.append(f"{name}: {how}, block linear weights {before / 2**20:.1f} -> {after / 2**20:.1f} MiB")
        kernel = "int8 weight cast per matmul, plain torch ops" if mode == "int8" else "fp8 weight-only"
        return f"{mode} weight-only (torchao {_version()}, {kernel}): " + "; ".join(lines)


def _version() -> str:
    import torchao

    return torchao.__version__


def load_quantized(folder: Path, spec: Any, file: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A denoiser built from `folder`'s config.json on meta and filled with the quantized state dict in `file`
    (quantized weights as saved; every other floating tensor in `dtype`, or fp32 where the model keeps it so)."""
    import re

    from composer.loader.components import ComposerModelLoader

    path = folder / file
    if not path.is_file():
        raise ModelFormatError(f"{folder.parent} says its {folder.name} is quantized (composer.json) but {path} "
                               "is missing: write the folder again with `composer convert quantize`")
    model = ComposerModelLoader().build(folder, spec)
    state = torch.load(path, map_location=device, weights_only=True)
    keep = getattr(type(model), "keep_in_fp32", ())

    def cast(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if is_quantized(tensor) or not tensor.is_floating_point():
            return tensor
        return tensor.to(torch.float32 if any(re.search(p, name) for p in keep) else dtype)

    state = {k: cast(k, v) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ModelFormatError(f"{path} does not match {folder / 'config.json'}: missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]}")
    leftovers = [n for n, t in model.state_dict(keep_vars=True).items() if t.is_meta]
    if leftovers:
        raise ModelFormatError(f"{path} left tensors unloaded: {leftovers[:5]}")
    return model.eval().requires_grad_(False)
