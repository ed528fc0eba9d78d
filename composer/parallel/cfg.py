"""CFG parallel: the prompt and the negative prompt (the two guidance branches) on two halves of the ranks.

Each half runs its branch's transformer call (itself split by sequence or tensor parallel inside the half);
the two predictions are exchanged with one all-gather before the guidance combine, which every rank then
computes identically. One transformer call per step per rank instead of a batch of two.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from composer.errors import ConfigError


class CfgParallel:
    """Runs guidance branch `index` (0: prompt, 1: negative prompt) here and exchanges predictions over `group`
    (the 2 ranks, one per half, that hold the same place in their halves)."""

    def __init__(self, group: dist.ProcessGroup, index: int):
        if dist.get_world_size(group) != 2:
            raise ConfigError(f"CFG parallel runs two branches on two rank groups; its group has "
                              f"{dist.get_world_size(group)} ranks")
        self.group = group
        self.index = index

    def owns(self, branch: int) -> bool:
        """Whether this rank computes guidance branch `branch`."""
        return branch == self.index

    def run(self, call: Callable, branches: list, exchange: bool = True) -> list[torch.Tensor | None]:
        """`call(branch_inputs)` for this rank's branch; every branch's output after the exchange (or, with
        `exchange` off, for calls whose output is not used: only this rank's, None for the other)."""
        if len(branches) != 2:
            raise ConfigError(f"CFG parallel needs exactly 2 guidance branches, got {len(branches)}")
        mine = call(branches[self.index]).contiguous()
        if not exchange:
            return [mine if i == self.index else None for i in range(2)]
        both = mine.new_empty((2 * mine.shape[0], *mine.shape[1:]))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(both, mine, group=self.group)
        return list(both.chunk(2))

    def __repr__(self) -> str:
        return f"CfgParallel(branch={self.index})"
