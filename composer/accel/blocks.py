"""A model's repeated transformer blocks: what regional compile, layerwise offload, quantization and the cancel
points act on (below the hooks, which all use it)."""

from __future__ import annotations

from torch import nn


def repeated_blocks(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """(attribute, blocks): the model's repeated transformer blocks, the non-empty nn.ModuleList named by the
    class attribute `repeated_blocks` (default "blocks"); None when it has none. What regional compile,
    layerwise offload and the cancel points act on.

    A model with several kinds of blocks run one list after the other (HunyuanVideo: dual-stream then
    single-stream) names them all, a tuple in run order: the blocks are then those lists' blocks in that
    order (a new nn.ModuleList over the same modules) and the attribute is the names joined with "+" (each
    block's own name is in `block_names`)."""
    names = _block_list_names(model)
    lists = [getattr(model, name, None) for name in names]
    if not names or not all(isinstance(b, nn.ModuleList) and len(b) for b in lists):
        return None
    if len(lists) == 1:
        return names[0], lists[0]
    return "+".join(names), nn.ModuleList([block for blocks in lists for block in blocks])


def block_names(model: nn.Module) -> list[str]:
    """The qualified name of each of `repeated_blocks(model)`'s blocks ("blocks.0", ...), in the same order."""
    return [f"{name}.{i}" for name in _block_list_names(model) for i in range(len(getattr(model, name)))]


def _block_list_names(model: nn.Module) -> tuple[str, ...]:
    name = getattr(type(model), "repeated_blocks", "blocks")
    return tuple(name) if isinstance(name, (tuple, list)) else ((name,) if name else ())
