"""Process groups for one parallel layout, made from RuntimeArgs, on torch.distributed (NCCL on GPUs, gloo on CPU).

A layout is four degrees whose product is the world size: `cfg` (2 with cfg_parallel: the prompt and the
negative prompt on two halves of the ranks), `ring` and `ulysses` (sequence parallel: sp = ring x ulysses) and
`tp` (tensor parallel). Ranks are numbered over the mesh (cfg, ring, ulysses, tp), the last fastest: tensor
parallel, which talks every layer, runs on neighbouring ranks (one NVLink island); Ulysses groups are the next
neighbours and the ring runs across them (USP); the two CFG halves only exchange one prediction per step.

    state = init_parallel(runtime)     # None for one process; joins torchrun's process group otherwise
    state.group("ulysses")             # this rank's Ulysses group (None where the degree is 1)

The same seeded CPU generator runs on every rank (a request's seed is agreed from rank 0), so every rank
draws the same noise. Rank 0 alone logs at INFO, shows progress bars and writes files.
"""

from __future__ import annotations

import atexit
import itertools
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from composer import seeds
from composer.errors import ConfigError
from composer.logging import get_logger, set_rank
from composer.platform import accelerator_device, platform_for

logger = get_logger(__name__)

MESH_DIMS = ("cfg", "ring", "ulysses", "tp")  # outermost first
# Groups a rank may ask for: a mesh dimension, or "sp" (ring x ulysses: every rank holding a part of the
# token sequence) and "model" (everything but cfg: the ranks that run one branch's transformer together).
GROUP_DIMS: dict[str, tuple[str, ...]] = {
    "cfg": ("cfg",), "ring": ("ring",), "ulysses": ("ulysses",), "tp": ("tp",),
    "sp": ("ring", "ulysses"), "model": ("ring", "ulysses", "tp"), "world": MESH_DIMS,
}


@dataclass(frozen=True)
class ParallelLayout:
    """Degrees of each parallel mode; `world_size` is their product."""

    ulysses: int = 1
    ring: int = 1
    tp: int = 1
    cfg: int = 1

    @classmethod
    def from_runtime(cls, runtime: Any) -> ParallelLayout:
        return cls(ulysses=runtime.ulysses_degree, ring=runtime.ring_degree, tp=runtime.tp_size,
                   cfg=2 if runtime.cfg_parallel else 1)

    @property
    def world_size(self) -> int:
        return self.ulysses * self.ring * self.tp * self.cfg

    @property
    def sp(self) -> int:
        return self.ulysses * self.ring

    @property
    def parallel(self) -> bool:
        return self.world_size > 1

    def degree(self, dim: str) -> int:
        return getattr(self, dim)

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along each mesh dimension."""
        out = {}
        for dim in reversed(MESH_DIMS):
            out[dim] = rank % self.degree(dim)
            rank //= self.degree(dim)
        return out

    def rank_of(self, coords: dict[str, int]) -> int:
        rank = 0
        for dim in MESH_DIMS:
            rank = rank * self.degree(dim) + coords[dim]
        return rank

    def group_ranks(self, name: str) -> list[list[int]]:
        """Every group of kind `name` as a list of global ranks, in a fixed order (each group's ranks ordered
        by their index inside the group: for "sp", part p = ring index x ulysses + ulysses index)."""
        inside = GROUP_DIMS[name]
        outside = [d for d in MESH_DIMS if d not in inside]
        groups = []
        for fixed in itertools.product(*(range(self.degree(d)) for d in outside)):
            base = dict(zip(outside, fixed))
            ranks = [self.rank_of({**base, **dict(zip(inside, idx))})
                     for idx in itertools.product(*(range(self.degree(d)) for d in inside))]
            groups.append(ranks)
        return groups

    def describe(self) -> str:
        parts = [f"{dim} {self.degree(dim)}" for dim in ("ulysses", "ring", "tp") if self.degree(dim) > 1]
        if self.cfg > 1:
            parts.append("cfg-parallel")
        return " x ".join(parts) if parts else "one process"


def layout_errors(runtime: Any) -> list[str]:
    """What is wrong with the runtime's parallel degrees, before any process starts or model loads."""
    errors = []
    for name in ("ulysses_degree", "ring_degree", "tp_size"):
        value = getattr(runtime, name)
        if not isinstance(value, int) or value < 1:
            errors.append(f"{name} = {value!r}: expected a positive integer (1: off)")
    if errors:
        return errors
    layout = ParallelLayout.from_runtime(runtime)
    num_gpus = getattr(runtime, "num_gpus", None)
    if num_gpus is not None:
        if num_gpus < 1:
            errors.append(f"num_gpus = {num_gpus}: expected a positive integer")
        elif layout.world_size != num_gpus:
            errors.append(f"num_gpus = {num_gpus} but the parallel degrees multiply to {layout.world_size} "
                          f"({_product(layout)}); make ulysses_degree x ring_degree x tp_size x (2 if cfg_parallel) "
                          f"equal num_gpus")
    device = str(getattr(runtime, "device", "auto"))
    if layout.parallel and device.startswith("cuda:"):
        errors.append(f"device = {device!r} puts every one of the {layout.world_size} ranks on one GPU; use "
                      "device = 'auto' or 'cuda' (each rank takes cuda:LOCAL_RANK), and CUDA_VISIBLE_DEVICES "
                      "to choose the GPUs")
    env_world = _env_world_size()
    if env_world is not None and num_gpus is None and layout.world_size != env_world:
        errors.append(f"this launch has {env_world} processes (WORLD_SIZE) but the parallel degrees multiply to "
                      f"{layout.world_size} ({_product(layout)}); set --ulysses-degree/--ring-degree/--tp-size/"
                      f"--cfg-parallel so that the product is {env_world}")
    return errors


def _product(layout: ParallelLayout) -> str:
    return (f"ulysses_degree {layout.ulysses} x ring_degree {layout.ring} x tp_size {layout.tp}"
            f"{' x 2 (cfg_parallel)' if layout.cfg > 1 else ''}")


def _env_world_size() -> int | None:
    """WORLD_SIZE set by torchrun (or a launcher like it); None outside one."""
    value = os.environ.get("WORLD_SIZE")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def under_launcher() -> bool:
    """True inside a torchrun-style launch of more than one process."""
    return (_env_world_size() or 1) > 1


@dataclass
class ParallelState:
    """This process's place in the layout: rank, device and process groups."""

    layout: ParallelLayout
    rank: int
    local_rank: int
    device: torch.device
    groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that logs, shows progress and writes files."""
        return self.rank == 0

    def group(self, name: str) -> dist.ProcessGroup | None:
        """This rank's group of kind `name` ("ulysses", "ring", "sp", "tp", "cfg", "model", "world"); None
        when that kind has one rank (nothing to communicate)."""
        return self.groups.get(name)

    def index(self, dim: str) -> int:
        return self.layout.coords(self.rank)[dim]

    def agree(self, value: Any) -> Any:
        """Rank 0's `value` on every rank (a seed, a request): every rank must call it together."""
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order, on every rank (each rank's memory plan): every rank must call it
        together."""
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value)
        return values


EXIT_BARRIER_S = 10  # how long a rank leaving waits for its peers to leave too (gloo)
_STATE: ParallelState | None = None
_OWNS_PROCESS_GROUP = False


def current() -> ParallelState | None:
    """The process's parallel state (None: one process)."""
    return _STATE


def is_main_process() -> bool:
    return _STATE is None or _STATE.is_main


def random_seed() -> int:
    """A fresh random seed; under several ranks, rank 0's on every rank (each must draw the same noise)."""
    seed = seeds.draw_seed()
    return _STATE.agree(seed) if _STATE is not None else seed


def init_parallel(runtime: Any) -> ParallelState | None:
    """Join (or reuse) the process group for the runtime's layout, make its groups and pick this rank's device.

    Raises ConfigError when the degrees do not multiply to the world size (before any model loads). One
    process with every degree 1 returns None and touches nothing."""
    global _STATE, _OWNS_PROCESS_GROUP
    errors = layout_errors(runtime)
    if errors:
        raise ConfigError("parallel settings: " + "; ".join(errors))
    layout = ParallelLayout.from_runtime(runtime)
    if not layout.parallel:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            raise ConfigError(f"this process is one of {dist.get_world_size()} ranks but no parallel degree is set: "
                              "set ulysses_degree / ring_degree / tp_size / cfg_parallel for them")
        return None
    if _STATE is not None:
        if _STATE.layout != layout:
            raise ConfigError(f"this process already runs the parallel layout {_STATE.layout.describe()}; a second "
                              f"model in it must use the same one, not {layout.describe()}")
        return _STATE
    if not dist.is_initialized():
        if not under_launcher():
            raise ConfigError(
                f"{layout.describe()} needs {layout.world_size} processes: launch with `torchrun --nproc-per-node="
                f"{layout.world_size} ...`, or pass num_gpus={layout.world_size} to VideoGenerator.from_pretrained"
            )
        backend = platform_for(runtime.torch_device).dist_backend  # nccl on CUDA, gloo on the host
        dist.init_process_group(backend, timeout=timedelta(seconds=runtime.dist_timeout))
        _OWNS_PROCESS_GROUP = True
        atexit.register(shutdown)
    if dist.get_world_size() != layout.world_size:
        raise ConfigError(f"the process group has {dist.get_world_size()} ranks but the parallel degrees multiply "
                          f"to {layout.world_size} ({_product(layout)})")
    rank = dist.get_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = _rank_device(runtime.device, local_rank)
    groups: dict[str, dist.ProcessGroup | None] = {}
    for name in GROUP_DIMS:
        members = layout.group_ranks(name)
        if len(members[0]) == 1:
            groups[name] = None
            continue
        for ranks in members:  # every rank creates every group, in one order (torch.distributed's rule)
            group = dist.group.WORLD if len(ranks) == dist.get_world_size() else dist.new_group(ranks)
            if rank in ranks:
                groups[name] = group
    _STATE = ParallelState(layout, rank, local_rank, device, groups)
    _quiet_other_ranks(_STATE)
    logger.info("parallel: %s on %d ranks (%s); rank 0 logs and writes files", layout.describe(),
                layout.world_size, dist.get_backend())
    return _STATE


def _rank_device(device: str, local_rank: int) -> torch.device:
    """`auto` / `cuda` (any accelerator's bare type) -> that accelerator's device LOCAL_RANK where it is
    available; an explicit `cuda:i` or `cpu` is kept."""
    wanted = accelerator_device() if device == "auto" else torch.device(device)
    if wanted.type != "cpu" and (device == "auto" or wanted.index is None):
        platform = platform_for(wanted)
        if platform.is_available():
            platform.set_device(local_rank)
            return torch.device(wanted.type, local_rank)
    if device == "auto":
        return torch.device("cpu")
    return wanted


def _quiet_other_ranks(state: ParallelState) -> None:
    """Ranks other than 0 log warnings and errors only (each prefixed with its rank), never INFO lines."""
    set_rank(state.rank, state.world_size)


_LEFT_KEY = "composer/left"


def _wait_for_peers_to_leave(store, world_size: int) -> None:
    deadline = time.monotonic() + EXIT_BARRIER_S
    try:
        while store.add(_LEFT_KEY, 0) < world_size - 1 and time.monotonic() < deadline:
            time.sleep(0.02)
    except Exception:  # noqa: BLE001 - a store that fails now cannot be waited on
        pass


def shutdown() -> None:
    """Leave the process group composer joined (called at exit): every rank exits cleanly."""
    global _STATE, _OWNS_PROCESS_GROUP
    if _OWNS_PROCESS_GROUP and dist.is_initialized():
        store, rank, world = None, dist.get_rank(), dist.get_world_size()
        try:
            if dist.get_backend() == "gloo":
                # every rank done talking before any tears its gloo context down (a rank leaving while a peer
                # still finishes its last collective can abort the peer at exit); short, as a rank that failed
                # or died never comes
                dist.monitored_barrier(timeout=timedelta(seconds=EXIT_BARRIER_S))
                store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001 - a peer that already left must not turn a clean exit into an error
            pass
        if store is not None and rank == 0:
            # rank 0 leaves last when it hosts the TCP store: a peer still tearing down when the store went
            # away aborted (SIGABRT) at exit; bounded, as a peer that died never says it left
            _wait_for_peers_to_leave(store, world)
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - as above
            pass
        if store is not None and rank != 0:
            try:
                store.add(_LEFT_KEY, 1)
            except Exception:  # noqa: BLE001 - rank 0 gone already: nothing left to tell
                pass
    _OWNS_PROCESS_GROUP = False
    _STATE = None


def reset_for_tests() -> None:
    """Forget the state without touching the process group (the test harness owns it)."""
    global _STATE
    _STATE = None
