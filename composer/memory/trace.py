"""Peak memory of a piece of model code, found by running it on fake tensors.

A `FakeTensorMode` runs every operator for its output's shape, dtype and device only: no memory is allocated and
nothing is computed, so the 14B transformer's forward at 720p "runs" in a second on any machine. `LiveBytes`, a
dispatch mode under it, sees every tensor an operator returns: it adds its storage's bytes when the storage first
appears and subtracts them when Python frees it (a weakref finalizer), so its `peak` is the largest sum of live
tensor bytes on the device the code reached: what `torch.cuda.max_memory_allocated` measures, less the allocator's
rounding and the kernels' private workspaces (docs/memory.md gives the measured gap).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from composer.memory.cpu_convolution import CONVOLUTIONS, convolution_scratch

REAL_LIMIT = 1 << 20  # bytes: bookkeeping outputs up to this size are computed for real (see LiveBytes)


def fake_mode():
    """A FakeTensorMode that accepts real tensors as inputs (a tokenizer's ids, a scheduler's timesteps: converted
    to fake ones as they meet fake ones)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the tensors operators create on `device` (every device when None) while it is active:
    `live` now, `peak` at most. Tensors that existed before it started (the weights, the inputs) are not counted.

    Pushed over a fake mode, it runs for real the operators none of whose inputs is fake (`real_bookkeeping`):
    the small tensors of a scheduler or a seeded draw, whose values the code reads."""

    def __init__(self, device: torch.device | str | None = None, real_bookkeeping: bool = True):
        super().__init__()
        self.real_bookkeeping = real_bookkeeping
        self.device_type = None if device is None else torch.device(device).type
        self.live = 0
        self.peak = 0
        self._seen: dict[int, int] = {}

    def _count(self, tensor: torch.Tensor) -> None:
        if self.device_type is not None and tensor.device.type != self.device_type:
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without a storage (a nested or sparse one)
            return
        key = id(storage)
        if key in self._seen:
            return
        nbytes = storage.nbytes()
        self._seen[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, key, nbytes)

    def _freed(self, key: int, nbytes: int) -> None:
        if self._seen.pop(key, None) is not None:
            self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.real_bookkeeping and not any(_is_fake(a) for a in tree_flatten((args, kwargs))[0]):
            # no fake input (a factory, or maths on real tensors): a scheduler's timesteps, a seeded noise draw.
            # Run for real when its output is small, so code that reads their values (float(t), .item()) works;
            # fake weights keep every model computation fake. A large one (an attention mask over a 720p video's
            # tokens) stays fake: it is shapes only, as it must be to cost nothing.
            from torch.utils._python_dispatch import _disable_current_modes

            inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            if inputs:  # maths on real tensors: real while they are small (their outputs are alike)
                real = sum(t.numel() * t.element_size() for t in inputs) <= REAL_LIMIT
            else:  # a factory: its output's size from a fake run first
                out = func(*args, **kwargs)
                real = sum(t.numel() * t.element_size() for t in tree_flatten(out)[0]
                           if isinstance(t, torch.Tensor)) <= REAL_LIMIT
            if real:
                with _disable_current_modes():
                    out = func(*args, **kwargs)
            elif inputs:
                out = func(*args, **kwargs)
        else:
            if self.device_type != "cpu":
                args, kwargs = self._same_device(func, args, kwargs)
            out = func(*args, **kwargs)
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self._count(value)
        if self.device_type in (None, "cpu") and getattr(func, "_opname", None) in CONVOLUTIONS:
            # what the CPU kernel holds beyond its output while it runs (an im2col buffer, oneDNN's reordered
            # copies: composer/memory/cpu_convolution.py): a transient, it raises the peak, not `live`
            self.peak = max(self.peak, self.live + convolution_scratch(func, args, kwargs, out))
        return out

    def _same_device(self, func, args, kwargs):
        """A small tensor the twin made on the host (a timestep embedding's table, say) where the real run has it
        on the device: moved to the device for the operator, as the real run's would be. Copies between devices
        are left as they are."""
        if func in (torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default):
            return args, kwargs
        flat, spec = tree_flatten((args, kwargs))
        tensors = [a for a in flat if isinstance(a, torch.Tensor) and a.dim() > 0]
        on_device = [t.device for t in tensors if t.device.type == self.device_type]
        if not on_device or not any(t.device.type == "cpu" for t in tensors):
            return args, kwargs
        device = on_device[0]
        flat = [a.to(device) if isinstance(a, torch.Tensor) and a.dim() > 0 and a.device.type == "cpu" else a
                for a in flat]
        return tree_unflatten(flat, spec)

    @contextmanager
    def mark(self) -> Iterator[Callable[[], int]]:
        """The peak above `live` at entry while inside (a function returning it, read after the block)."""
        start, saved = self.live, self.peak
        self.peak = self.live
        result = {"peak": 0}
        try:
            yield lambda: result["peak"]
        finally:
            result["peak"] = self.peak - start
            self.peak = max(saved, self.peak)


def _is_fake(value: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(value, FakeTensor)


def traced_peak(fn: Callable[[], Any], mode=None, device: torch.device | str | None = None) -> tuple[int, Any]:
    """(peak bytes of the tensors `fn` creates on `device`, fn's result), `fn` run under `mode` (a fake mode: the
    tensors it touches must be fake or real inputs) in inference mode."""
    mode = mode or fake_mode()
    tracker = LiveBytes(device)
    with mode, torch.inference_mode(), tracker:
        result = fn()
    return tracker.peak, result
