"""The platform layer: everything that differs between kinds of device, in one place.

composer's offload, KV cache, parallel state, stages and benchmarks never call `torch.cuda` (or any other device
module) themselves: they ask the `Platform` of the device they run on for

- what the device is: `device_type`, `is_available()`, `device_count()`, `default_device()`, `set_device()`,
  `device_name()`, `capability()`;
- how ranks talk: `dist_backend` (nccl on CUDA, gloo on the host, the accelerator's own elsewhere);
- streams and events: `new_stream()`, `on_stream()`, `current_stream()`, `record_event()`, `wait_event()`,
  `keep_alive_on()` (the caching allocator told that another stream uses a tensor), `synchronize()`;
- host memory for fast copies: `pins_host_memory`, `pinned()`, `empty_host()`;
- memory statistics: `memory_info()` (free, total), `memory_allocated()`, `max_memory_allocated()`,
  `reset_peak_memory_stats()`, `empty_cache()`.

Three kinds exist: `HostPlatform` (the CPU: no streams, nothing to pin, gloo), `AcceleratorPlatform` (any device
torch drives through its `torch.accelerator` API: xpu, mps, an NPU whose torch plug-in is installed) and
`CudaPlatform` (CUDA, through `torch.cuda`, the path measured on H100/H200). A device kind torch does not know
by itself is added from outside the package: `register_platform(device_type, factory)`, or a distribution's
entry point in the group `composer.platforms` (name: the device type; object: a factory taking the device type),
loaded the first time that device type is asked for.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from composer.logging import get_logger, log_once

logger = get_logger(__name__)

ENTRY_POINT_GROUP = "composer.platforms"


class HostPlatform:
    """The CPU. Copies are synchronous (no streams: a stream or event is None and waiting on it is a no-op),
    there is nothing to pin, and ranks talk over gloo."""

    device_type = "cpu"
    dist_backend = "gloo"
    pins_host_memory = False  # whether page-locked host copies make host -> device copies asynchronous
    async_copies = False  # whether copies issued on a side stream overlap the compute

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def default_device(self, index: int | None = None) -> torch.device:
        return torch.device(self.device_type)

    def set_device(self, device: torch.device | int) -> None:
        """Make `device` this process's current device (a rank takes its local one)."""

    def device_name(self, device: torch.device | None = None) -> str:
        import platform

        return platform.processor() or platform.machine() or "cpu"

    def capability(self, device: torch.device | None = None) -> tuple[int, int] | None:
        """The compute capability (major, minor) where the device has one (CUDA); None elsewhere."""
        return None

    # -- streams and events ---------------------------------------------------------------------------
    def synchronize(self, device: torch.device | None = None) -> None:
        """Wait until every kernel queued on `device` has run."""

    def new_stream(self, device: torch.device) -> Any:
        return None

    def on_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """Queue the work of a `with` block on `stream` (no-op on the host)."""
        return contextlib.nullcontext()

    def current_stream(self, device: torch.device) -> Any:
        return None

    def record_event(self, stream: Any) -> Any:
        """An event recorded on `stream` now: what a later `wait_event` fences on."""
        return None

    def wait_event(self, stream: Any, event: Any) -> None:
        """Make `stream` wait for `event` (without blocking the host)."""

    def keep_alive_on(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the allocator that `stream` uses `tensor`, which was allocated on another stream."""

    # -- host memory ----------------------------------------------------------------------------------
    def pinned(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` in host memory the device can copy from asynchronously (the tensor itself when it already
        is, or when this platform has no such memory)."""
        host = tensor if tensor.device.type == "cpu" else tensor.to("cpu")
        if not self.pins_host_memory or host.is_pinned():
            return host
        copy = torch.empty_like(host, device="cpu", pin_memory=True)
        copy.copy_(host)
        return copy

    def to_device(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A host tensor (noise drawn on the CPU generator, an index) on `device` without waiting for the device's
        queued work: a plain copy from pageable memory synchronises the stream, so a host that makes one per step
        could never run ahead of the device. Through pinned memory, copied asynchronously (the caching host
        allocator keeps the pinned block until the copy is done); the same values either way."""
        device = torch.device(device)
        if device.type == "cpu" or tensor.device == device:
            return tensor.to(device)
        return self.pinned(tensor).to(device, non_blocking=True)

    def empty_host(self, shape: tuple[int, ...], dtype: torch.dtype, pinned: bool = True) -> torch.Tensor:
        """Zeroed host memory, page-locked when `pinned` and this platform pins."""
        return torch.zeros(shape, dtype=dtype, device="cpu", pin_memory=pinned and self.pins_host_memory)

    # -- memory statistics ----------------------------------------------------------------------------
    def memory_info(self, device: torch.device | None = None) -> tuple[int, int]:
        """(free, total) bytes: the memory the host can still give (MemAvailable: free pages and the page cache it
        can drop; free pages where /proc is missing) and its physical memory."""
        page = os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * page
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024, total
        except OSError:
            pass
        return os.sysconf("SC_AVPHYS_PAGES") * page, total

    def memory_allocated(self, device: torch.device | None = None) -> int | None:
        """Bytes the allocator holds in tensors now; None where it keeps no count (the host)."""
        return None

    def max_memory_allocated(self, device: torch.device | None = None) -> int | None:
        """The peak of `memory_allocated` since the last `reset_peak_memory_stats`; None on the host (measure the
        process's RSS there)."""
        return None

    def reset_peak_memory_stats(self, device: torch.device | None = None) -> None:
        pass

    def empty_cache(self) -> None:
        """Return the allocator's cached, unused blocks to the device."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device_type!r})"


class AcceleratorPlatform(HostPlatform):
    """A device torch drives through `torch.accelerator`, `torch.Stream` and `torch.Event` (xpu, mps, an NPU with
    its torch plug-in imported). Its process-group backend is torch's default for the device type."""

    pins_host_memory = True
    async_copies = True

    def __init__(self, device_type: str):
        self.device_type = device_type
        import torch.distributed as dist

        default = getattr(dist.Backend, "default_device_backend_map", {}) if dist.is_available() else {}
        self.dist_backend = default.get(device_type, "gloo")

    def _device(self, device: torch.device | int | None) -> torch.device:
        if device is None:
            return torch.device(self.device_type, torch.accelerator.current_device_index())
        if isinstance(device, int):
            return torch.device(self.device_type, device)
        device = torch.device(device)
        if device.index is None:
            return torch.device(self.device_type, torch.accelerator.current_device_index())
        return device

    def is_available(self) -> bool:
        current = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        return current is not None and current.type == self.device_type

    def device_count(self) -> int:
        return torch.accelerator.device_count() if self.is_available() else 0

    def default_device(self, index: int | None = None) -> torch.device:
        return self._device(index)

    def set_device(self, device: torch.device | int) -> None:
        torch.accelerator.set_device_index(self._device(device).index)

    def device_name(self, device: torch.device | None = None) -> str:
        return str(self._device(device))

    def capability(self, device: torch.device | None = None) -> tuple[int, int] | None:
        return None

    def synchronize(self, device: torch.device | None = None) -> None:
        torch.accelerator.synchronize(self._device(device))

    def new_stream(self, device: torch.device) -> Any:
        return torch.Stream(device=self._device(device))

    def on_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return stream if stream is not None else contextlib.nullcontext()

    def current_stream(self, device: torch.device) -> Any:
        return torch.accelerator.current_stream(self._device(device))

    def record_event(self, stream: Any) -> Any:
        event = torch.Event(device=stream.device)
        event.record(stream)
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def keep_alive_on(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def memory_info(self, device: torch.device | None = None) -> tuple[int, int]:
        return torch.accelerator.get_memory_info(self._device(device))

    def memory_allocated(self, device: torch.device | None = None) -> int | None:
        return torch.accelerator.memory_allocated(self._device(device))

    def max_memory_allocated(self, device: torch.device | None = None) -> int | None:
        return torch.accelerator.max_memory_allocated(self._device(device))

    def reset_peak_memory_stats(self, device: torch.device | None = None) -> None:
        torch.accelerator.reset_peak_memory_stats(self._device(device))

    def empty_cache(self) -> None:
        torch.accelerator.empty_cache()


class CudaPlatform(AcceleratorPlatform):
    """CUDA (and ROCm's CUDA-compatible torch) through `torch.cuda`: side-stream copies fenced by events,
    pinned host memory, NCCL between ranks."""

    def __init__(self, device_type: str = "cuda"):
        super().__init__(device_type)
        self.dist_backend = "nccl"

    def _device(self, device: torch.device | int | None) -> torch.device:
        if device is None:
            return torch.device("cuda", torch.cuda.current_device())
        if isinstance(device, int):
            return torch.device("cuda", device)
        device = torch.device(device)
        return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def set_device(self, device: torch.device | int) -> None:
        torch.cuda.set_device(self._device(device))

    def device_name(self, device: torch.device | None = None) -> str:
        return torch.cuda.get_device_name(self._device(device))

    def capability(self, device: torch.device | None = None) -> tuple[int, int] | None:
        return tuple(torch.cuda.get_device_capability(self._device(device)))

    def synchronize(self, device: torch.device | None = None) -> None:
        torch.cuda.synchronize(self._device(device))

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(self._device(device))

    def on_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def current_stream(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(self._device(device))

    def record_event(self, stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def memory_info(self, device: torch.device | None = None) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self._device(device))

    def memory_allocated(self, device: torch.device | None = None) -> int | None:
        return torch.cuda.memory_allocated(self._device(device))

    def max_memory_allocated(self, device: torch.device | None = None) -> int | None:
        return torch.cuda.max_memory_allocated(self._device(device))

    def reset_peak_memory_stats(self, device: torch.device | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(self._device(device))

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


# -- the registry ----------------------------------------------------------------------------------------
_factories: dict[str, Callable[[str], HostPlatform]] = {"cpu": lambda _: HostPlatform(), "cuda": CudaPlatform}
_platforms: dict[str, HostPlatform] = {}
_lock = threading.Lock()
_entry_points_read = False


def register_platform(device_type: str, factory: Callable[[str], HostPlatform]) -> None:
    """Make `factory(device_type)` the platform of `device_type` (replacing an earlier one, built or not)."""
    with _lock:
        _factories[device_type] = factory
        _platforms.pop(device_type, None)


def _read_entry_points() -> None:
    """Platforms other distributions declare (group `composer.platforms`), registered once, without overriding
    one registered in this process."""
    global _entry_points_read
    if _entry_points_read:
        return
    _entry_points_read = True
    from importlib.metadata import entry_points

    for point in entry_points(group=ENTRY_POINT_GROUP):
        if point.name in _factories:
            continue
        try:
            _factories[point.name] = point.load()
        except Exception as exc:  # a broken plug-in must not break composer on every other device
            log_once(logger, f"platform-plugin:{point.name}", f"platform plug-in {point.name} ({point.value}) did "
                     f"not load: {type(exc).__name__}: {exc}")


def platform_for(device: torch.device | str | torch.Tensor | None = None) -> HostPlatform:
    """The platform of `device` (a device, its name, or a tensor on it); None: the current accelerator's, or the
    host's where there is none."""
    if device is None:
        return current_platform()
    if isinstance(device, torch.Tensor):
        device = device.device
    kind = torch.device(device).type
    with _lock:
        if kind in _platforms:
            return _platforms[kind]
        if kind not in _factories:
            _read_entry_points()
        factory = _factories.get(kind, AcceleratorPlatform)
        _platforms[kind] = factory(kind)
        return _platforms[kind]


def current_platform() -> HostPlatform:
    """The accelerator this process has (CUDA first), or the host."""
    if torch.cuda.is_available():
        return platform_for("cuda")
    if torch.accelerator.is_available():
        accelerator = torch.accelerator.current_accelerator()
        if accelerator is not None:
            return platform_for(accelerator)
    return platform_for("cpu")


AUTO_SKIPS = ("mps",)  # accelerators `device = auto` does not pick (composer is not tested on them): name them


def accelerator_device() -> torch.device:
    """`device = auto`: the current accelerator's device type (no index: asking for the current index would
    initialise CUDA in this process, which a process that forks workers or only checks settings must not), else the
    CPU."""
    platform = current_platform()
    if platform.device_type in ("cpu", *AUTO_SKIPS):
        return torch.device("cpu")
    return torch.device(platform.device_type)


@contextlib.contextmanager
def peak_memory(device: torch.device) -> Iterator[dict[str, int | None]]:
    """Measure a block's peak device memory: yields a dict whose `peak` is filled on exit with the allocator's
    peak during the block (bytes; None on the host, which keeps no count)."""
    platform = platform_for(device)
    platform.synchronize(device)
    platform.reset_peak_memory_stats(device)
    out: dict[str, int | None] = {"peak": None}
    try:
        yield out
    finally:
        platform.synchronize(device)
        out["peak"] = platform.max_memory_allocated(device)


__all__ = [
    "ENTRY_POINT_GROUP", "AcceleratorPlatform", "CudaPlatform", "HostPlatform", "accelerator_device",
    "current_platform", "peak_memory", "platform_for", "register_platform",
]
