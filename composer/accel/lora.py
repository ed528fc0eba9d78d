"""LoRA adapters on a composer transformer, through PEFT.

    adapters = LoraAdapters(transformer)
    adapters.set(["style.safetensors", "motion.safetensors"], [0.8, 1.0])   # PEFT layers beside the weights
    adapters.set(["style.safetensors"], fuse=True)                          # merged into the weights
    adapters.unset()                                                        # the base model, bit for bit

Unfused, each file is a PEFT adapter injected next to the layers it names (several active at once, each at
its own scale); switching files swaps the small adapter layers and leaves the base weights alone. Fused, the
adapters are merged into the weights with PEFT's `merge` and the layers go back to plain `nn.Linear` (no
per-step LoRA cost); a CPU copy of every touched weight is kept, because subtracting the delta again would not
give the original bits back. After `unset` the model holds its own `nn.Linear` modules again (what
torch.compile and offloading see) and computes exactly what it computed before.

Swapping to files that adapt the same layers with the same ranks (and the same number of files), unfused, copies
the new weights into the adapter layers already there (a hotswap): no module changes, so offloading keeps its
arrangement and a compiled graph stays valid (it recompiles only when a layer's scaling, a Python number the
graph is specialised on, changes). Any other change replaces modules; `listeners` (callables taking the
LoraAdapters) are told after each such change, which is how offloading re-arranges the new weights
(composer/accel/offload.py), so adapters can be set, swapped and removed while the model is offloaded.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch
from peft import LoraConfig, inject_adapter_in_model
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from composer.accel.lora_names import LoraFile, read_lora
from composer.attach import attach
from composer.errors import CheckpointError, InvalidInputError, UnsupportedError
from composer.logging import get_logger
from composer.runtime import lora_scale_problem

__all__ = ["LoraAdapters", "read_lora"]

logger = get_logger(__name__)


def _kind(name: str) -> str:
    """A layer's kind: its name with the block indices replaced by `*`."""
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def files_for(denoiser: str, denoisers: Sequence[str], paths: Sequence, scales: Sequence[float] | None,
              experts: Sequence[str] | None) -> tuple[list, list[float] | None]:
    """The LoRA files (and their scales) that go to `denoiser`: those whose expert is "both" or its name
    (RuntimeArgs.lora_expert, one per file; None: every file to every denoiser). An expert naming a denoiser the
    model does not have is refused."""
    paths = list(paths)
    if experts is None:
        return paths, None if scales is None else list(scales)
    experts = list(experts)
    if len(experts) != len(paths):
        raise InvalidInputError(f"{len(experts)} LoRA expert(s) for {len(paths)} LoRA file(s): give one per file")
    unknown = sorted({e for e in experts if e != "both" and e not in denoisers})
    if unknown:
        raise InvalidInputError(f"lora_expert {', '.join(map(repr, unknown))}: this model's denoisers are "
                                f"{', '.join(denoisers)} (use 'both', or one of them)")
    keep = [i for i, e in enumerate(experts) if e in ("both", denoiser)]
    return [paths[i] for i in keep], None if scales is None else [list(scales)[i] for i in keep]


def _peft_config(file: LoraFile) -> LoraConfig:
    """A LoraConfig adapting exactly the file's layers; the most common rank and alpha are the defaults and
    the other layers get PEFT's per-layer patterns (escaped: a layer name is not a regex)."""
    modules = file.modules
    rank = Counter(m.rank for m in modules.values()).most_common(1)[0][0]
    alpha = Counter(m.alpha for m in modules.values()).most_common(1)[0][0]
    return LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=sorted(modules),  # exact names: PEFT matches a list entry to a name or its dotted end
        rank_pattern={re.escape(name): m.rank for name, m in modules.items() if m.rank != rank},
        alpha_pattern={re.escape(name): m.alpha for name, m in modules.items() if m.alpha != alpha},
        lora_bias=any(m.bias is not None for m in modules.values()),
        lora_dropout=0.0,
        inference_mode=True,
    )


def _check_scales(count: int, scales: Sequence[float] | None) -> list[float]:
    if scales is None:
        return [1.0] * count
    scales = list(scales)
    if len(scales) != count:
        raise InvalidInputError(f"{len(scales)} LoRA scale(s) for {count} LoRA file(s): give one scale per file "
                                "(or none, for 1.0 each)")
    bad = [s for s in scales if lora_scale_problem(s) is not None]
    if bad:
        raise InvalidInputError(f"LoRA scales = {bad}: expected {lora_scale_problem(bad[0])}")
    return [float(s) for s in scales]


class LoraAdapters:
    """LoRA adapters on one composer transformer (unfused PEFT layers, or fused into the weights)."""

    def __init__(self, transformer: nn.Module):
        self.model = transformer
        self._files: list[LoraFile] = []
        self._scales: list[float] = []
        self._fused = False
        self._wrapped: set[str] = set()  # layers that are PEFT layers now
        self._originals: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}  # fused: weight, bias on CPU
        self._requires_grad: dict[str, bool] = {}  # PEFT freezes the base parameters; given back on unset
        self.listeners: list = []  # called with self after the model's modules changed (attach(listeners, fn))
        self.hotswaps = 0  # swaps done in place (same layers and ranks: no module changed)
        self.locked: str | None = None  # why the adapters cannot change now (set by a hook, e.g. offload = disk)

    @property
    def active(self) -> bool:
        """Whether any adapter is applied."""
        return bool(self._files)

    @property
    def fused(self) -> bool:
        """Whether the active adapters are merged into the weights."""
        return self._fused

    def set(self, paths: Sequence[str | Path], scales: Sequence[float] | None = None, fuse: bool = False) -> None:
        """Replace whatever adapters are active with these files (scale 1.0 each by default).

        Every file is read and checked before the model changes: a bad file leaves the model as it was. An error
        while applying them (out of memory, say) leaves the base model, with no adapter.
        """
        self._check_unlocked()
        paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
        scales = _check_scales(len(paths), scales)
        files = [read_lora(path, self.model) for path in paths]
        if not fuse and self._can_hotswap(files):
            self._hotswap(files, scales)
        else:
            had = bool(self._wrapped or self._originals)
            self._unset()
            if files:
                try:
                    self._inject(files, scales)
                    if fuse:
                        self._fuse()
                except BaseException:
                    self._unset()
                    self._changed()
                    raise
            if had or files:
                self._changed()
        if not files:
            return
        self._files, self._scales, self._fused = files, scales, fuse
        # a warning where the application is partial in a way a user would not choose: a kind adapted in some
        # blocks only, or a layer's added (image) keys left out while the rest of its attention is adapted
        odd = [kind for kind, got, of in self.coverage() if 0 < got < of or (got == 0 and ".add_" in kind)]
        logger.log(logging.WARNING if odd else logging.INFO, self.describe())

    def unset(self) -> None:
        """Remove every adapter: the base model's outputs come back bit for bit (fused too)."""
        changed = bool(self._wrapped or self._originals)
        if changed:
            self._check_unlocked()
        self._unset()
        if changed:
            self._changed()

    def _check_unlocked(self) -> None:
        if self.locked:
            raise UnsupportedError(f"changing LoRA adapters is not supported here: {self.locked}")

    def _changed(self) -> None:
        for listener in list(self.listeners):
            listener(self)

    def _can_hotswap(self, files: list[LoraFile]) -> bool:
        """Whether `files` can replace the active unfused adapters in place: as many files, each adapting the same
        layers with the same ranks and bias as the one it replaces, on layers that hold whole weights."""
        if self._fused or not self._files or len(files) != len(self._files):
            return False
        for old, new in zip(self._files, files):
            if old.modules.keys() != new.modules.keys():
                return False
            for name, lora in new.modules.items():
                was = old.modules[name]
                if lora.rank != was.rank or (lora.bias is None) != (was.bias is None):
                    return False
        for name in self._wrapped:
            layer = self.model.get_submodule(name)
            if not isinstance(layer, BaseTunerLayer) or hasattr(layer.get_base_layer(), "shard_lora"):
                return False
        return True

    def _hotswap(self, files: list[LoraFile], scales: list[float]) -> None:
        """Copy `files`' weights into the adapter layers in place (the same tensors: offloaded host copies and
        compiled graphs stay valid); each layer's alpha and scale as a fresh injection would set them."""
        names = [f"lora{i}" for i in range(len(files))]
        with torch.no_grad():
            for adapter, file, scale in zip(names, files, scales):
                for name, lora in file.modules.items():
                    layer = self.model.get_submodule(name)
                    layer.lora_A[adapter].weight.copy_(lora.down)
                    layer.lora_B[adapter].weight.copy_(lora.up)
                    bias = layer.lora_B[adapter].bias
                    if bias is not None:
                        bias.copy_(lora.bias * (lora.rank / lora.alpha) if lora.bias is not None else 0.0)
                    layer.lora_alpha[adapter] = lora.alpha
                    layer.set_scale(adapter, scale)
        self.hotswaps += 1

    def _unset(self) -> None:
        for name in sorted(self._wrapped):
            layer = self.model.get_submodule(name)
            if isinstance(layer, BaseTunerLayer):
                self._replace(name, layer.get_base_layer())
        with torch.no_grad():
            for name, (weight, bias) in self._originals.items():
                layer = self.model.get_submodule(name)
                layer.weight.copy_(weight)
                if bias is not None:
                    layer.bias.copy_(bias)
        for name, param in self.model.named_parameters():
            if name in self._requires_grad:
                param.requires_grad_(self._requires_grad[name])
        self._drop_peft_config()
        self._files, self._scales, self._fused = [], [], False
        self._wrapped, self._originals, self._requires_grad = set(), {}, {}

    def describe(self) -> str:
        """One line for the log: files, ranks, scales, fused or not, modules touched, and the layers left out
        where the files adapt their neighbours (`coverage`)."""
        if not self._files:
            return "LoRA: none"
        touched = set().union(*(f.modules for f in self._files))
        files = "; ".join(f"{f.summary()} x{s:g}" for f, s in zip(self._files, self._scales))
        mode = "fused" if self._fused else "unfused"
        left = [f"{kind} {got}/{of}" for kind, got, of in self.coverage() if got < of]
        partial = f"; PARTIAL: not adapted: {', '.join(left)}" if left else ""
        return f"LoRA ({mode}, {len(touched)} layers touched): {files}{partial}"

    def coverage(self) -> list[tuple[str, int, int]]:
        """(layer kind, layers adapted, layers of that kind in the model) for every kind of Linear layer under a
        module the files adapt anything in: a kind is a layer name with its block index replaced by `*`
        (`blocks.*.attn2.add_k_proj`), a module the parent of such names (`blocks.*.attn2`). So a file that adapts a
        model's cross-attention but not its image keys (`k_img` / `v_img`: `attn2.add_k_proj` / `add_v_proj`), or
        some blocks only, shows it instead of applying partly in silence."""
        if not self._files:
            return []
        touched = set().union(*(f.modules for f in self._files))
        kinds: dict[str, list[int]] = {}
        for name, module in self.model.named_modules():
            if isinstance(module, BaseTunerLayer):
                module = module.get_base_layer()
            if isinstance(module, nn.Linear) and ".lora_" not in name and ".base_layer" not in name:
                entry = kinds.setdefault(_kind(name), [0, 0])
                entry[1] += 1
                entry[0] += name in touched
        parents = {kind.rpartition(".")[0] for kind, (got, _) in kinds.items() if got}
        return [(kind, got, of) for kind, (got, of) in sorted(kinds.items())
                if kind.rpartition(".")[0] in parents]

    def _inject(self, files: list[LoraFile], scales: list[float]) -> None:
        self._requires_grad = {name: p.requires_grad for name, p in self.model.named_parameters()}
        names = [f"lora{i}" for i in range(len(files))]
        for adapter, file in zip(names, files):
            self._drop_peft_config()  # else PEFT warns about "multiple adapters": that is what we want
            with warnings.catch_warnings():  # quantized base layers (quantize hook): merge is refused up front
                warnings.filterwarnings("ignore", message="TorchaoLoraLinear was instantiated without")
                inject_adapter_in_model(_peft_config(file), self.model, adapter_name=adapter)
            self._wrapped.update(file.modules)
            with torch.no_grad():  # PEFT creates the layers in the base weight's dtype and device
                for name, lora in file.modules.items():
                    layer = self.model.get_submodule(name)
                    layer.lora_A[adapter].weight.copy_(lora.down)
                    layer.lora_B[adapter].weight.copy_(lora.up)
                    bias = layer.lora_B[adapter].bias
                    if bias is not None:  # PEFT scales lora_B's bias by alpha / r: store the delta over that
                        bias.copy_(lora.bias * (lora.rank / lora.alpha) if lora.bias is not None else 0.0)
                    # a base layer holding a slice of its weight (tensor parallel) slices its adapter the same way
                    shard_lora = getattr(layer.get_base_layer(), "shard_lora", None)
                    if shard_lora is not None:
                        shard_lora(layer, adapter)
        self._drop_peft_config()
        for name in self._wrapped:
            layer = self.model.get_submodule(name)
            layer.set_adapter([a for a in names if a in layer.lora_A], inference_mode=True)
            for adapter, scale in zip(names, scales):
                layer.set_scale(adapter, scale)  # no-op for an adapter this layer does not have

    def _fuse(self) -> None:
        for name in sorted(self._wrapped):
            layer = self.model.get_submodule(name)
            base = layer.get_base_layer()
            bias = None if base.bias is None else base.bias.detach().to("cpu", copy=True)
            self._originals[name] = (base.weight.detach().to("cpu", copy=True), bias)
            # in place (not safe_merge, which swaps in new tensors): the parameters keep their storage, which
            # offloading or a compiled graph may hold
            layer.merge(adapter_names=list(layer.active_adapters))
            if not (torch.isfinite(base.weight).all() and (base.bias is None or torch.isfinite(base.bias).all())):
                raise CheckpointError(f"fusing the LoRA into {name} gives non-finite weights: check the file, "
                                      "or use a smaller scale")
            self._replace(name, base)
            self._wrapped.discard(name)

    def _replace(self, name: str, module: nn.Module) -> None:
        parent, _, child = name.rpartition(".")
        setattr(self.model.get_submodule(parent) if parent else self.model, child, module)

    def _drop_peft_config(self) -> None:
        # inject_adapter_in_model leaves its configs on the model; the layers themselves do not need them
        self.model.__dict__.pop("peft_config", None)


class LoraHook:
    """Hook phase: the runtime's `lora_path` / `lora_scale` / `lora_fuse` on every denoising transformer; removing
    it unsets the adapters (whatever `set_lora` made of them since)."""

    name = "lora"

    def apply(self, pipeline) -> str:
        runtime = pipeline.runtime
        lines = []
        names = list(pipeline.denoisers())
        for name in names:
            adapters = pipeline.lora_adapters(name)
            paths, scales = files_for(name, names, runtime.lora_path, runtime.lora_scale, runtime.lora_expert)
            adapters.set(paths, scales, fuse=runtime.lora_fuse)
            attach(undo=adapters.unset, what=f"{name}: LoRA adapters")
            lines.append(f"{name}: {adapters.describe()}")
        return "; ".join(lines)
