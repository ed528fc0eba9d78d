"""What a convolution holds on the CPU beyond its output while it runs: the memory trace's transient at each one.

PyTorch picks a backend per call from the shapes (`torch._C._select_conv_backend`, asked with the same tensors, fake
ones included), and the backends' scratch differs by an order of magnitude (measured on single convolutions,
docs/memory.md):

- `Slow2d` / `Slow3d` (the native kernels: a batch-1 3x3(x3) convolution whose batch x channels x depth x height is
  at most 20480 elements, e.g. a narrow VAE's layers on one frame plus its two cached ones): an im2col buffer of
  `input channels x kernel volume` rows by the output's positions, 27x the output's positions for a 3x3x3 kernel at
  each input channel. A 1x1 kernel with stride 1 and no padding needs none.
- `Mkldnn` (oneDNN): its kernels read and write a blocked layout whose channel block is 16 with AVX-512, 8 otherwise,
  so a channel count that is not a multiple is padded up. The input is reordered into that layout (except a "first
  convolution": fewer input channels than a block, a kernel larger than 1x1, read as it is), the weight too, and the
  output is written blocked and then copied into the plain tensor PyTorch returns once the reordered input is freed.
  In bf16 / fp16 the kernels (brgemm, measured with AMX) work channels-last, unpadded, and copy the output twice.
  A channels-last input is used in place: only the weight is reordered.
"""

from __future__ import annotations

import math
import os

import torch

# the op names a dispatch mode sees (conv3d arrives whole, not as aten.convolution)
CONVOLUTIONS = frozenset({"convolution", "_convolution", "conv1d", "conv2d", "conv3d", "mkldnn_convolution"})

_SLOW = frozenset({"Slow2d", "Slow3d", "SlowDilated2d", "SlowDilated3d"})
_NARROW_ISAS = ("sse41", "avx", "avx2")  # ONEDNN_MAX_CPU_ISA values that cap oneDNN below AVX-512


def channel_block() -> int:
    """oneDNN's channel block for fp32 convolutions on this CPU: 16 with AVX-512, 8 with AVX2 (or when
    ONEDNN_MAX_CPU_ISA caps it there)."""
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").lower()
    if cap.startswith(_NARROW_ISAS) and not cap.startswith("avx512") and not cap.startswith("avx10"):
        return 8
    avx512 = getattr(torch.cpu, "_is_avx512_supported", None)
    if avx512 is not None:
        return 16 if avx512() else 8
    return 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8


def convolution_scratch(func, args: tuple, kwargs: dict, out: torch.Tensor) -> int:
    """Bytes a CPU convolution holds above its returned output `out` while it runs (0 off the CPU)."""
    bound = _bind(func, args, kwargs)
    x, weight = bound.get("input", bound.get("self")), bound.get("weight")
    if not (isinstance(x, torch.Tensor) and isinstance(weight, torch.Tensor) and isinstance(out, torch.Tensor)):
        return 0
    if x.device.type != "cpu":
        return 0
    if bound.get("transposed", False):  # no composer model has one; not measured: the input and weight, as before
        return _nbytes(x) + _nbytes(weight)
    dims = weight.dim() - 2
    stride, dilation = _per_dim(bound.get("stride", 1), dims), _per_dim(bound.get("dilation", 1), dims)
    padding = _padding(bound.get("padding", 0), weight.shape[2:], dilation, dims)
    groups = int(bound.get("groups", 1))
    if x.dim() != weight.dim() or out.dim() != weight.dim():  # an unbatched input: not measured
        return _nbytes(x) + _nbytes(weight)
    try:
        backend = str(torch._C._select_conv_backend(x, weight, bound.get("bias"), stride, padding, dilation, False,
                                                    [0] * dims, groups, None)).rsplit(".", 1)[-1]
    except (RuntimeError, TypeError):
        backend = "unknown"
    if backend in _SLOW:
        return _im2col(x, weight, out, stride, padding, backend)
    if backend == "Mkldnn":
        return _onednn(x, weight, out, groups)
    if backend == "Empty":
        return 0
    return _nbytes(x) + _nbytes(weight)  # a backend not measured: its input and weight copied


def _im2col(x, weight, out, stride, padding, backend) -> int:
    """The native kernels unfold the input into a column buffer (the whole batch at once; one sample at a time when
    dilated), from a contiguous copy of the input when it is not."""
    kernel = tuple(weight.shape[2:])
    copy = 0 if x.is_contiguous() else _nbytes(x)
    if all(k == 1 for k in kernel) and all(s == 1 for s in stride) and not any(padding):
        return copy
    rows = 1 if "Dilated" in backend else x.shape[0]
    positions = math.prod(out.shape[-len(kernel):])
    return copy + rows * weight.shape[1] * math.prod(kernel) * positions * x.element_size()


def _onednn(x, weight, out, groups) -> int:
    """oneDNN's reordered input and weight and its blocked output (module docstring)."""
    out_bytes = _nbytes(out)
    channels_last = torch.channels_last_3d if x.dim() == 5 else torch.channels_last
    if x.dim() in (4, 5) and not x.is_contiguous() and x.is_contiguous(memory_format=channels_last):
        return _nbytes(weight)
    if x.element_size() < 4:  # bf16 / fp16: channels-last kernels, no padding; the output copied twice
        src, dst = _nbytes(x), out_bytes
        return max(src + _nbytes(weight) + dst - out_bytes, 2 * dst)
    block = channel_block()
    kernel = tuple(weight.shape[2:])
    first = groups == 1 and x.shape[1] < block and any(k > 1 for k in kernel)
    element = x.element_size()
    src = 0 if first else x.shape[0] * _padded(x.shape[1], block) * math.prod(x.shape[2:]) * element
    weight_in = weight.shape[1] if first else _padded(weight.shape[1], block)
    wei = _padded(weight.shape[0], block) * weight_in * math.prod(kernel) * element
    dst = out.shape[0] * _padded(out.shape[1], block) * math.prod(out.shape[2:]) * element
    # while it runs: the reordered input, the weight and the blocked output; then the blocked output and the copy
    return max(src + wei + dst - out_bytes, dst)


def _padded(channels: int, block: int) -> int:
    return -(-int(channels) // block) * block


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _bind(func, args: tuple, kwargs: dict) -> dict:
    """The operator's arguments by name, its schema's defaults filled in."""
    bound = {}
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args):
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


def _per_dim(value, dims: int) -> list[int]:
    values = [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
    return values * dims if len(values) == 1 else values


def _padding(value, kernel, dilation: list[int], dims: int) -> list[int]:
    if value == "valid":
        return [0] * dims
    if value == "same":
        return [d * (int(k) - 1) // 2 for k, d in zip(kernel, dilation)]
    return _per_dim(value, dims)
