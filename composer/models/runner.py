"""How a model's token sequence and repeated blocks are run: a declarative split/gather plan per model class, and a
block runner per model instance that the hook phase fills.

A model family writes no parallel or cache code. It declares, as a class attribute,

    token_plan = TokenPlan(gather_at="proj_out")

and its forward hands its tokens to the runner once, before the blocks (`runner.enter`: split over the sequence
parallel ranks when a layout asks for it), and its blocks to it (`runner.run_blocks`: through a step cache when
one is on). The plan's `gather_at` module's output is gathered back to the whole sequence by a forward hook the
sequence-parallel hook registers (composer/parallel/sequence.py); with no hook attached every call is a
pass-through, so one device runs exactly the plain loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class TokenPlan:
    """Where the sequence-parallel hook splits a model's tokens and gathers them.

    - `split`: how the video tokens are split: "frames" (each rank keeps its part of every latent frame, RoPE
      alike, so per-frame modulation and a KV cache of frames stay local).
    - `gather_at`: the submodule whose output is gathered back to the whole sequence (the narrow output
      projection: the cheapest point to gather).
    - `whole`: token streams every rank keeps whole (a joint attention's text), named for the docs and checks.
    """

    gather_at: str
    split: str = "frames"
    whole: tuple[str, ...] = ()


class BlockRunner:
    """A model's tokens and blocks, as the hooks want them run. `sequence_parallel` (a SequenceParallel) and
    `step_cache` (a step / block cache) are set by their hooks; None means plain."""

    def __init__(self):
        self.sequence_parallel = None
        self.step_cache = None
        self._gather_handle = None

    def enter(self, x: torch.Tensor, rotary: tuple[torch.Tensor, ...], frames: int
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The tokens [B, frames * tokens_per_frame, D] and RoPE tables this rank computes on: its part of every
        frame under sequence parallelism, everything otherwise."""
        if self.sequence_parallel is None:
            return x, rotary
        return self.sequence_parallel.split(x, rotary, frames=frames)

    @property
    def holds_whole_sequence(self) -> bool:
        """Whether the blocks see every token (no sequence split): what a spatially windowed backend needs."""
        return self.sequence_parallel is None

    def run_blocks(self, run: Callable[..., torch.Tensor], x: torch.Tensor, count: int) -> torch.Tensor:
        """`run(x, start=0, end=None)` runs blocks [start, end) on x; a step cache may run some of them and
        reuse an earlier step's residual for the rest."""
        if self.step_cache is None:
            return run(x)
        return self.step_cache.run_blocks(run, x, count)

    # -- attached by the sequence-parallel hook ------------------------------------------------------
    def attach_gather(self, model: nn.Module, plan: TokenPlan) -> None:
        """Gather the output of `plan.gather_at` back to the whole sequence (a forward hook)."""
        self.detach_gather()
        module = model.get_submodule(plan.gather_at)

        def gather(_module: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
            return output if self.sequence_parallel is None else self.sequence_parallel.gather(output)

        self._gather_handle = module.register_forward_hook(gather)

    def detach_gather(self) -> None:
        if self._gather_handle is not None:
            self._gather_handle.remove()
            self._gather_handle = None


def runner_of(model: nn.Module) -> BlockRunner:
    """The model's block runner (made on first use)."""
    runner = model.__dict__.get("_block_runner")
    if runner is None:
        runner = BlockRunner()
        model.__dict__["_block_runner"] = runner
    return runner


def token_plan_of(model: nn.Module) -> TokenPlan | None:
    """The model class's declared plan; None: the model cannot split its tokens over ranks."""
    return getattr(type(model), "token_plan", None)


class RunsBlocks:
    """Mixin for a model with a `token_plan`: `sequence_parallel` and `step_cache` read (and set) its runner's,
    so code that asks a model for them keeps working."""

    @property
    def runner(self) -> BlockRunner:
        return runner_of(self)

    @property
    def sequence_parallel(self):
        return runner_of(self).sequence_parallel

    @property
    def step_cache(self):
        return runner_of(self).step_cache

    @step_cache.setter
    def step_cache(self, cache) -> None:
        runner_of(self).step_cache = cache
