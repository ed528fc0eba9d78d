"""The disk tier of layerwise offloading (`offload = disk`): block weights stay in the safetensors files.

Each block's tensors are read from a memory map of the checkpoint when the block is loaded, and its pages
are handed back (`madvise(MADV_DONTNEED)`) when it is evicted, so host memory holds only the non-block
weights and the blocks in flight, not the whole model. The files are mapped copy-on-write: a tensor that
needs no dtype conversion is used straight from the map on the CPU (no copy at all), and nothing can write
through to the file.

Why not `safetensors.safe_open(...).get_tensor`: it is memory-mapped too (safetensors 0.8 hands back a
tensor over its own map, paged in on first touch), but the map is not reachable, so pages a block touched
would stay charged to the process until every tensor of the file is freed.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from pathlib import Path

import torch
from torch import nn

from composer.accel.blocks import block_names
from composer.accel.offload import BlockStore, LayerwiseOffload, OffloadHook, TensorSlot, repeated_blocks
from composer.accel.transfer import Transfer
from composer.errors import CheckpointError
from composer.loader.components import ComposerModelLoader, _config_class_name
from composer.loader.model_index import ComponentSpec
from composer.loader.weights import TensorSource, load_weights, tensor_sources

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_PAGE = mmap.PAGESIZE


class MappedSafetensors:
    """A safetensors file mapped copy-on-write: zero-copy tensor views and page release by byte range."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as fh:
                self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
            (header_len,) = struct.unpack("<Q", self._map[:8])
            header = json.loads(self._map[8 : 8 + header_len])
        except (OSError, ValueError, struct.error) as exc:
            raise CheckpointError(f"{self.path} is not a readable safetensors file (corrupt or truncated?): {exc}") from exc
        base = 8 + header_len
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in _DTYPES:
                raise CheckpointError(f"{self.path}: tensor {name} has dtype {info['dtype']}, which composer cannot map")
            start, end = info["data_offsets"]
            self.entries[name] = (_DTYPES[info["dtype"]], tuple(info["shape"]), base + start, base + end)
            if base + end > len(self._map):
                raise CheckpointError(f"{self.path} is truncated: tensor {name} ends past the end of the file")

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor `name` as a view of the map: nothing is read until it is touched."""
        dtype, shape, start, end = self.entries[name]
        count = math.prod(shape)
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self._map, dtype=dtype, count=count, offset=start).view(shape)

    def span(self, name: str) -> tuple[int, int]:
        return self.entries[name][2:]

    def release(self, start: int, end: int) -> None:
        """Stop charging the pages of bytes [start, end) to this process. The mapping is private and never
        written, so a later read simply pages the file in again."""
        if hasattr(mmap, "MADV_DONTNEED"):  # Linux, macOS
            first = start - start % _PAGE
            self._map.madvise(mmap.MADV_DONTNEED, first, end - first)

    def close(self) -> None:
        try:
            self._map.close()
        except BufferError:  # views still alive (e.g. weights kept by remove()); the map goes with them
            pass


class DiskStore(BlockStore):
    """Block weights read from memory-mapped safetensors files at each load; pages released at eviction.

    `sources`: composer name -> where the tensor is stored and its dtype in use (`tensor_sources`).
    While a block is not on the device its parameters hold stand-ins of the right shape and dtype (a single
    NaN or zero, expanded), so a use outside the offload hooks shows as NaN rather than as stale weights.
    """

    def __init__(self, sources: dict[str, TensorSource]):
        self.sources = sources
        self.files: dict[Path, MappedSafetensors] = {}

    def bind(self, slots: list[list[TensorSlot]], transfer: Transfer) -> None:
        self._on_cpu = transfer.device.type == "cpu"
        self._plan: list[list[tuple[MappedSafetensors, str, torch.dtype | None]]] = []
        self._standins: list[list[torch.Tensor]] = []
        for block in slots:
            plan, standins = [], []
            for slot in block:
                source = self.sources.get(slot.qualname)
                if source is None:
                    raise CheckpointError(f"{slot.qualname} is not in the checkpoint: the disk tier cannot load it")
                current = slot.get()
                if tuple(current.shape) != source.shape:
                    raise CheckpointError(
                        f"{source.key} in {source.path} is {list(source.shape)}, {slot.qualname} expects "
                        f"{list(current.shape)}"
                    )
                if source.path not in self.files:
                    self.files[source.path] = MappedSafetensors(source.path)
                dtype = source.dtype or self.files[source.path].entries[source.key][0]
                plan.append((self.files[source.path], source.key, dtype))
                fill = float("nan") if dtype.is_floating_point else 0
                standins.append(torch.full((), fill, dtype=dtype).expand(source.shape))
            self._plan.append(plan)
            self._standins.append(standins)

    def fetch(self, index: int) -> list[torch.Tensor]:
        tensors = []
        for file, key, dtype in self._plan[index]:
            tensor = file.tensor(key)
            if tensor.dtype != dtype:
                tensor = tensor.to(dtype)
                file.release(*file.span(key))  # the converted copy is what is used: the file pages can go
            tensors.append(tensor)
        return tensors

    def evicted(self, index: int) -> list[torch.Tensor]:
        return self._standins[index]

    def release(self, index: int) -> None:
        for file, key, _ in self._plan[index]:
            file.release(*file.span(key))

    def materialize(self, index: int) -> list[torch.Tensor]:
        # Weights kept for good must own their memory: on the CPU a loaded tensor may be a view of the map.
        tensors = []
        for file, key, dtype in self._plan[index]:
            view = file.tensor(key)
            tensors.append(view.to(dtype, copy=True) if self._on_cpu or view.dtype != dtype else view)
        return tensors

    def close(self) -> None:
        for file in self.files.values():
            file.close()
        self.files = {}


def load_with_blocks_on_disk(
    folder: str | Path,
    device: torch.device | str,
    dtype: torch.dtype,
    *,
    prefetch: int = 1,
    transfer: Transfer | None = None,
    spec: ComponentSpec | None = None,
) -> tuple[nn.Module, LayerwiseOffload]:
    """Load composer's model of a component folder with only its non-block weights read (onto `device`);
    its repeated blocks stream from the memory-mapped safetensors files through a `LayerwiseOffload`."""
    folder = Path(folder)
    spec = spec or ComponentSpec(folder.name, "composer", _config_class_name(folder) or "")
    model = ComposerModelLoader().build(folder, spec)
    repeated_blocks(model)  # UnsupportedError when it has none
    prefixes = tuple(f"{qualname}." for qualname in block_names(model))

    def in_blocks(name: str) -> bool:
        return name.startswith(prefixes)

    load_weights(model, folder, torch.device(device), dtype, skip=in_blocks)
    sources = {name: src for name, src in tensor_sources(model, folder, dtype).items() if in_blocks(name)}
    model.eval().requires_grad_(False)
    offload = LayerwiseOffload(model, device, prefetch=prefetch, transfer=transfer, store=DiskStore(sources))
    return model, offload


class DiskOffloadHook(OffloadHook):
    """`offload = disk`: the offload hook whose transformer(s) load with only their non-block weights read (the
    blocks stream from the checkpoint on disk); the rest is layerwise offload's."""

    def load_module(self, pipeline, name: str, folder, spec, dtype):
        if name not in pipeline.denoiser_names():
            return None
        model, offload = load_with_blocks_on_disk(folder, pipeline.device, dtype, spec=spec)
        self.done[name] = offload
        return model
