"""Weight bytes of a model folder's components, read from the safetensors headers (no tensor is read).

A component's bytes are what it holds once loaded: every floating tensor in the dtype it loads in (the runtime's),
the others as stored; weight-only int8/fp8 quantization stores the transformer blocks' linear weights in one byte
an element plus a scale per output row. The repeated blocks (`blocks.N.`, `transformer_blocks.N.`,
`single_transformer_blocks.N.`, `layers.N.`) are counted apart, since layerwise offload keeps only two of them on
the device at a time.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

# safetensors dtype names -> bytes per element
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
                "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}
_FLOATING = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
BLOCK_NAME = re.compile(r"^(?:.*\.)?((?:single_transformer_blocks|transformer_blocks|blocks|layers)\.(\d+))\.")


def read_header(path: Path) -> dict[str, dict]:
    """A safetensors file's tensor table: name -> {"dtype", "shape"} (its metadata entry left out)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


def component_tensors(folder: Path) -> dict[str, dict]:
    """Every tensor of a component folder's safetensors files (sharded or not)."""
    table: dict[str, dict] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        table.update(read_header(path))
    return table


@dataclass
class ComponentWeights:
    """A component's loaded weight bytes: `blocks` (block name -> bytes) and `other` (everything else)."""

    name: str
    other: int = 0
    blocks: dict[str, int] = field(default_factory=dict)
    source: str = "safetensors"

    @property
    def total(self) -> int:
        return self.other + sum(self.blocks.values())

    def streamed(self, resident_blocks: int = 2) -> int:
        """Device bytes under layerwise offload: everything but the blocks, and the `resident_blocks` largest
        blocks (the one running and the one being fetched)."""
        largest = sorted(self.blocks.values(), reverse=True)[:resident_blocks]
        return self.other + sum(largest)


def element_bytes(dtype: str, shape: list[int], load_dtype: torch.dtype | None) -> int:
    count = 1
    for n in shape:
        count *= n
    size = _DTYPE_BYTES.get(dtype, 4)
    if load_dtype is not None and dtype in _FLOATING:
        size = torch.empty((), dtype=load_dtype).element_size()
    return count * size


def component_weights(folder: Path, name: str, dtype: torch.dtype | None, quantize: str = "none") -> ComponentWeights:
    """The loaded bytes of the component in `folder` (see the module's docstring). A component without
    safetensors files (a .bin checkpoint) is counted by its files' size."""
    folder = Path(folder)
    out = ComponentWeights(name)
    table = component_tensors(folder)
    if not table:
        files = [p for p in folder.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".ckpt")]
        out.other = sum(p.stat().st_size for p in files)
        out.source = "file sizes"
        return out
    for tensor_name, info in table.items():
        shape = list(info["shape"])
        nbytes = element_bytes(info["dtype"], shape, dtype)
        match = BLOCK_NAME.match(tensor_name)
        if match and quantize != "none" and tensor_name.endswith(".weight") and len(shape) == 2 \
                and info["dtype"] in _FLOATING:
            nbytes = shape[0] * shape[1] + shape[0] * 4  # one byte an element, a float32 scale per output row
        if match:
            out.blocks[match.group(1)] = out.blocks.get(match.group(1), 0) + nbytes
        else:
            out.other += nbytes
    return out
