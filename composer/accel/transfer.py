"""How weights travel between host memory and the compute device.

Offloading code never calls a device API itself: it asks a `Transfer` to stage host copies, to start loading a group
of tensors (`load` -> `Pending`), to make the compute wait for them (`wait`) and to drop them (`release`).

- `SyncTransfer`: a plain blocking `.to(device)`; on the CPU a load is the host tensor itself (no copy).
- `StreamTransfer`: pinned host copies, loads issued on a side stream and fenced with events, so a block's
  copy overlaps the previous block's compute (CUDA and every accelerator whose platform has streams:
  composer/platform/).
- `RecordingTransfer`: for tests; real, separate copies on the CPU and a log of load / wait / evict events.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from composer.platform import platform_for


@dataclass
class Pending:
    """Tensors being copied to the device; usable by the compute only after `Transfer.wait`."""

    key: Hashable
    tensors: list[torch.Tensor]
    event: Any = None  # the platform's event, on a device with streams


class Transfer:
    """Moves groups of tensors host -> device. Subclasses decide how (sync, side stream, recorded)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)

    def stage(self, tensor: torch.Tensor) -> torch.Tensor:
        """The host copy to load `tensor` from later (the tensor itself when it already lives on the host)."""
        return tensor if tensor.device.type == "cpu" else tensor.to("cpu")

    def load(self, key: Hashable, tensors: Sequence[torch.Tensor]) -> Pending:
        """Start copying `tensors` to the device."""
        return Pending(key, [t.to(self.device) for t in tensors])

    def wait(self, pending: Pending) -> list[torch.Tensor]:
        """Make the compute wait for a load; returns the device tensors."""
        return pending.tensors

    def release(self, key: Hashable, tensors: Sequence[torch.Tensor]) -> None:
        """The device tensors of `key` are no longer used by the model."""


class SyncTransfer(Transfer):
    """Blocking copies; free on the CPU, where the device tensor is the host tensor."""


class StreamTransfer(Transfer):
    """Pinned host copies; loads on a side stream, fenced by events, so copies overlap compute."""

    def __init__(self, device: torch.device | str):
        super().__init__(device)
        self.platform = platform_for(self.device)
        self.device = self.platform.default_device(self.device.index)
        self.stream = self.platform.new_stream(self.device)

    def stage(self, tensor: torch.Tensor) -> torch.Tensor:
        # Only page-locked memory can be copied asynchronously; pageable copies block the host and go through
        # a driver staging buffer at a fraction of the bandwidth.
        return self.platform.pinned(tensor)

    def load(self, key: Hashable, tensors: Sequence[torch.Tensor]) -> Pending:
        with self.platform.on_stream(self.stream):
            out = [t.to(self.device, non_blocking=True) for t in tensors]
            event = self.platform.record_event(self.stream)
        return Pending(key, out, event)

    def wait(self, pending: Pending) -> list[torch.Tensor]:
        compute = self.platform.current_stream(self.device)
        self.platform.wait_event(compute, pending.event)
        # The memory was allocated on the side stream: tell the caching allocator the compute stream uses it,
        # or it could hand the memory out again while kernels that read these weights are still queued.
        for tensor in pending.tensors:
            self.platform.keep_alive_on(tensor, compute)
        return pending.tensors


@dataclass
class RecordingTransfer(Transfer):
    """Test double: real copies (clones) on the CPU, every load / wait / evict logged as (event, key).

    Released copies are filled with NaN, so a model that kept using an evicted copy gives NaN outputs.
    """

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    log: list[tuple[str, Hashable]] = field(default_factory=list)
    resident: set = field(default_factory=set)
    max_resident: int = 0

    def load(self, key: Hashable, tensors: Sequence[torch.Tensor]) -> Pending:
        self.log.append(("load", key))
        self.resident.add(key)
        self.max_resident = max(self.max_resident, len(self.resident))
        return Pending(key, [t.clone() for t in tensors])

    def wait(self, pending: Pending) -> list[torch.Tensor]:
        self.log.append(("wait", pending.key))
        return pending.tensors

    def release(self, key: Hashable, tensors: Sequence[torch.Tensor]) -> None:
        self.log.append(("evict", key))
        self.resident.discard(key)
        for tensor in tensors:
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))

    def events(self, kind: str) -> list[Hashable]:
        """The keys of one kind of event, in order."""
        return [key for event, key in self.log if event == kind]


def transfer_for(device: torch.device | str) -> Transfer:
    """The transfer a device wants: side-stream copies where its platform has streams (CUDA, other
    accelerators), plain ones elsewhere (the host)."""
    device = torch.device(device)
    if platform_for(device).async_copies:
        return StreamTransfer(device)
    return SyncTransfer(device)
