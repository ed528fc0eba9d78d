"""Tensor parallelism (Megatron-style) for composer's transformers: each rank of a process group holds a slice of
the attention and FFN weights and computes on its own heads / hidden units.

    model = load_tensor_parallel(cls, config, folder, device, torch.bfloat16, group)  # reads only this rank's slices
    shard_model(model, group)                                                        # or: shard a loaded model

A model class states what is split as data, `tensor_parallel_plan`: regex of module names -> "column" | "row" |
"norm". A "column" Linear holds a block of output features (whole heads of q/k/v, a block of the FFN's hidden
units) and needs no communication; a "row" Linear holds the matching block of input features and sums the partial
outputs over the group (one all-reduce per attention and per FFN); a "norm" is an RMSNorm over all features
computed from the local slice (one small all-reduce of the sums of squares). Everything else is replicated, so
every rank ends a block with the same full hidden states, and the model code runs unchanged on local heads.

The sharded layers keep the logical (full) `in_features` / `out_features` / `normalized_shape` of the layer they
stand for; their parameters hold the local slice. So LoRA files (written for the full model) read and check as
usual, and `shard_lora` slices each adapter the way the base weight is sliced. The collectives are plain
`torch.distributed` ones (gloo and NCCL), not differentiable: this is for inference.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from composer.errors import ConfigError
from composer.loader.components import ComposerModelLoader
from composer.loader.weights import TensorShard

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TensorParallelRMSNorm",
    "allowed_tp_sizes",
    "check_tp_size",
    "load_tensor_parallel",
    "shard_model",
    "tensor_parallel_shards",
]


def _size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _block(full: int, tp_size: int, tp_rank: int, what: str) -> slice:
    """This rank's contiguous block of `full` features."""
    if full % tp_size:
        raise ConfigError(f"tensor parallelism: {what} of {full} features does not divide by tp_size {tp_size}")
    local = full // tp_size
    return slice(tp_rank * local, (tp_rank + 1) * local)


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None, tp_size: int) -> torch.Tensor:
    if tp_size > 1:
        dist.all_reduce(x, group=group)
    return x


class _Sharded:
    """What every tensor-parallel layer has: its group and place in it, and the slices it holds."""

    group: dist.ProcessGroup | None
    tp_size: int
    tp_rank: int

    def _join(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.tp_size, self.tp_rank = _size_and_rank(group)

    def shards(self) -> dict[str, TensorShard]:
        """Parameter name -> the slice of the full tensor this rank holds (parameters not listed are whole)."""
        raise NotImplementedError

    def _take(self, full: nn.Module) -> None:
        """Take this rank's slices of `full`'s parameters (same names); on meta, keep the local meta shapes."""
        shards = self.shards()
        for name in [n for n, _ in self.named_parameters(recurse=False)]:
            source = getattr(full, name)
            if source.is_meta:
                continue
            data = source.detach()[shards[name].index] if name in shards else source.detach()
            setattr(self, name, nn.Parameter(data.clone(), requires_grad=source.requires_grad))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tp_rank={self.tp_rank}, tp_size={self.tp_size}"


class ColumnParallelLinear(_Sharded, nn.Linear):
    """nn.Linear split by output feature: rank r holds rows [r*out/tp, (r+1)*out/tp) of the weight and bias and
    returns that slice of the output features (no communication). `out_features` is the full count;
    `local_out_features` is what `weight` holds."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 group: dist.ProcessGroup | None = None, device=None, dtype=None):
        tp_size, tp_rank = _size_and_rank(group)
        block = _block(out_features, tp_size, tp_rank, "a column-parallel Linear's output")
        nn.Linear.__init__(self, in_features, out_features // tp_size, bias, device=device, dtype=dtype)
        self._join(group)
        self.feature_block = block
        self.local_out_features = self.out_features
        self.out_features = out_features

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: dist.ProcessGroup | None = None) -> ColumnParallelLinear:
        """This rank's shard of `linear` (sliced in memory; on meta, just the local shapes)."""
        sharded = cls(linear.in_features, linear.out_features, linear.bias is not None, group=group,
                      device=linear.weight.device, dtype=linear.weight.dtype)
        sharded._take(linear)
        return sharded

    def shards(self) -> dict[str, TensorShard]:
        out = {"weight": TensorShard((self.out_features, self.in_features), (self.feature_block,))}
        if self.bias is not None:
            out["bias"] = TensorShard((self.out_features,), (self.feature_block,))
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def shard_lora(self, peft_layer: nn.Module, adapter: str) -> None:
        """Slice a PEFT LoRA adapter on this layer (full-size, as read from its file) like the weight: lora_B's
        rows and bias by output feature; lora_A stays whole. PEFT's merge then gives this rank's rows of
        the merged weight."""
        lora_b = peft_layer.lora_B[adapter]
        if lora_b.weight.shape[0] == self.local_out_features:
            return
        lora_b.weight = nn.Parameter(lora_b.weight.detach()[self.feature_block].clone(), requires_grad=False)
        if lora_b.bias is not None:
            lora_b.bias = nn.Parameter(lora_b.bias.detach()[self.feature_block].clone(), requires_grad=False)
        lora_b.out_features = self.local_out_features


class RowParallelLinear(_Sharded, nn.Linear):
    """nn.Linear split by input feature: rank r holds columns [r*in/tp, (r+1)*in/tp) of the weight and the whole
    bias, takes that slice of the input features (a column-parallel layer's output) and returns the full output:
    all_reduce_sum(x_local @ W_local^T) + bias (the bias added once, after the sum, in the output dtype)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 group: dist.ProcessGroup | None = None, device=None, dtype=None):
        tp_size, tp_rank = _size_and_rank(group)
        block = _block(in_features, tp_size, tp_rank, "a row-parallel Linear's input")
        nn.Linear.__init__(self, in_features // tp_size, out_features, bias, device=device, dtype=dtype)
        self._join(group)
        self.feature_block = block
        self.local_in_features = self.in_features
        self.in_features = in_features

    @classmethod
    def from_linear(cls, linear: nn.Linear, group: dist.ProcessGroup | None = None) -> RowParallelLinear:
        """This rank's shard of `linear` (sliced in memory; on meta, just the local shapes)."""
        sharded = cls(linear.in_features, linear.out_features, linear.bias is not None, group=group,
                      device=linear.weight.device, dtype=linear.weight.dtype)
        sharded._take(linear)
        return sharded

    def shards(self) -> dict[str, TensorShard]:
        return {"weight": TensorShard((self.out_features, self.in_features), (slice(None), self.feature_block))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _all_reduce(F.linear(x, self.weight), self.group, self.tp_size)
        return out if self.bias is None else out + self.bias

    def shard_lora(self, peft_layer: nn.Module, adapter: str) -> None:
        """Slice a PEFT LoRA adapter on this layer (full-size, as read from its file) like the weight: lora_A's
        columns by input feature, and its rank-sized output summed over the group before lora_B, so
        base(x) + lora_B(sum_r lora_A_r(x_r)) * scale is exact. lora_B (and its bias, added once) stays whole."""
        lora_a = peft_layer.lora_A[adapter]
        if lora_a.weight.shape[1] == self.local_in_features:
            return
        reduced = _SummedLinear(self.local_in_features, lora_a.out_features, group=self.group,
                                device=lora_a.weight.device, dtype=lora_a.weight.dtype)
        reduced.weight = nn.Parameter(lora_a.weight.detach()[:, self.feature_block].clone(), requires_grad=False)
        peft_layer.lora_A[adapter] = reduced


class _SummedLinear(nn.Linear):
    """A bias-free Linear on a slice of the input features whose output is summed over the group: a row-parallel
    layer's lora_A (rank-sized output, so the all-reduce is tiny)."""

    def __init__(self, in_features: int, out_features: int, *, group: dist.ProcessGroup | None, device=None,
                 dtype=None):
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)
        self.group = group
        self.tp_size = dist.get_world_size(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _all_reduce(F.linear(x, self.weight), self.group, self.tp_size)


class TensorParallelRMSNorm(_Sharded, nn.Module):
    """RMSNorm over all `normalized_shape` features when each rank holds a block of them (the q/k of its heads):
    mean of squares = all_reduce_sum(local sum of squares) / full size. Numerics as torch's nn.RMSNorm: computed
    in fp32 (weight included), cast back to the input dtype; eps None means the input dtype's machine epsilon."""

    def __init__(self, normalized_shape: int, eps: float | None = None, elementwise_affine: bool = True, *,
                 group: dist.ProcessGroup | None = None, device=None, dtype=None):
        super().__init__()
        self._join(group)
        self.feature_block = _block(normalized_shape, self.tp_size, self.tp_rank, "an RMSNorm")
        self.normalized_shape = (normalized_shape,)
        self.local_features = normalized_shape // self.tp_size
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        weight = torch.ones(self.local_features, device=device, dtype=dtype) if elementwise_affine else None
        self.weight = None if weight is None else nn.Parameter(weight)

    @classmethod
    def from_rmsnorm(cls, norm: nn.RMSNorm, group: dist.ProcessGroup | None = None) -> TensorParallelRMSNorm:
        """This rank's shard of `norm` (a 1-D nn.RMSNorm); sliced in memory, on meta just the local shape."""
        if len(norm.normalized_shape) != 1:
            raise ConfigError(f"tensor parallelism shards RMSNorm over one dimension, got {norm.normalized_shape}")
        weight = norm.weight
        sharded = cls(norm.normalized_shape[0], norm.eps, norm.elementwise_affine, group=group,
                      device=None if weight is None else weight.device, dtype=None if weight is None else weight.dtype)
        sharded._take(norm)
        return sharded

    def shards(self) -> dict[str, TensorShard]:
        return {} if self.weight is None else {"weight": TensorShard(self.normalized_shape, (self.feature_block,))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        squares = _all_reduce(xf.square().sum(-1, keepdim=True), self.group, self.tp_size)
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        y = xf * torch.rsqrt(squares / self.normalized_shape[0] + eps)
        if self.weight is not None:
            y = y * self.weight.float()
        return y.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
                f"tp_rank={self.tp_rank}, tp_size={self.tp_size}")


_SHARDERS: dict[str, tuple[type[nn.Module], Callable[..., nn.Module]]] = {
    "column": (nn.Linear, ColumnParallelLinear.from_linear),
    "row": (nn.Linear, RowParallelLinear.from_linear),
    "norm": (nn.RMSNorm, TensorParallelRMSNorm.from_rmsnorm),
}


def allowed_tp_sizes(config) -> list[int]:
    """The tensor-parallel sizes a model config allows: those dividing both its attention heads (whole heads per
    rank) and its FFN hidden size (`num_attention_heads`, `ffn_dim`)."""
    common = math.gcd(config.num_attention_heads, config.ffn_dim)
    return [n for n in range(1, common + 1) if common % n == 0]


def check_tp_size(config, tp_size: int) -> None:
    """ConfigError unless `tp_size` divides the config's attention heads and FFN hidden size."""
    heads, ffn = config.num_attention_heads, config.ffn_dim
    if heads % tp_size or ffn % tp_size:
        raise ConfigError(
            f"tensor parallelism splits the {heads} attention heads and the FFN's {ffn} hidden units over the "
            f"ranks: tp_size {tp_size} does not divide "
            + " and ".join(f"{what} {n}" for what, n in (("num_attention_heads", heads), ("ffn_dim", ffn))
                           if n % tp_size)
            + f"; this model allows tp_size in {allowed_tp_sizes(config)}"
        )


def _plan_kind(plan: dict[str, str], name: str) -> str | None:
    kinds = {kind for pattern, kind in plan.items() if re.search(pattern, name)}
    if len(kinds) > 1:
        raise ConfigError(f"tensor_parallel_plan gives module {name} several kinds: {sorted(kinds)}")
    return kinds.pop() if kinds else None


def shard_model(model: nn.Module, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Replace, in place, the modules `type(model).tensor_parallel_plan` names with their tensor-parallel
    versions holding this rank's slices (sliced in memory; on the meta device, just the local shapes).
    Returns `model`. Call it before LoRA adapters are applied. ConfigError when the heads or the FFN hidden
    size do not divide by the group's size."""
    plan = getattr(type(model), "tensor_parallel_plan", None)
    if not plan:
        raise ConfigError(f"{type(model).__name__} has no tensor_parallel_plan: it cannot run tensor parallel")
    check_tp_size(model.config, dist.get_world_size(group))
    targets = [(name, kind) for name, _ in model.named_modules() if (kind := _plan_kind(plan, name))]
    if not targets:
        raise ConfigError(f"{type(model).__name__}.tensor_parallel_plan matches none of its modules")
    for name, kind in targets:
        module = model.get_submodule(name)
        base_type, shard = _SHARDERS[kind]
        if isinstance(module, _Sharded) or type(module) is not base_type:
            raise ConfigError(f"tensor parallelism: {name} is {type(module).__name__}, expected a plain "
                              f"{base_type.__name__} for a '{kind}' split (already sharded, or wrapped by LoRA?)")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, shard(module, group))
    return model


def tensor_parallel_shards(model: nn.Module) -> dict[str, TensorShard]:
    """Parameter name -> TensorShard, for every parameter of `model` that holds a slice of a full tensor."""
    return {
        f"{module_name}.{name}": shard
        for module_name, module in model.named_modules()
        if isinstance(module, _Sharded)
        for name, shard in module.shards().items()
    }


def load_tensor_parallel(
    model_cls: type[nn.Module],
    config,
    folder: str | Path,
    device: torch.device | str,
    dtype: torch.dtype,
    group: dist.ProcessGroup | None = None,
    *,
    on_read: Callable[[str, torch.Tensor], None] | None = None,
) -> nn.Module:
    """Build `model_cls(config)` on meta, shard it for this rank (`shard_model`) and fill it from the safetensors
    in `folder` (a component folder, e.g. model/transformer), reading from disk only this rank's slice of each
    sharded tensor, so no rank ever holds a whole sharded weight. Names, checks and dtypes (`keep_in_fp32`) as
    `composer.loader.weights.load_weights`; `on_read(name, tensor)` sees each tensor as read. Every rank of
    `group` must call it. `ComposerModelLoader.model_class_and_config(folder, spec)` gives class and config."""
    with torch.device("meta"):
        model = model_cls(config)
    shard_model(model, group)
    return ComposerModelLoader.fill(model, Path(folder), torch.device(device), dtype,
                                    shards=tensor_parallel_shards(model), on_read=on_read)
