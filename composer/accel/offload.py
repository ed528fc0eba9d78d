"""Weight offloading: keep weights in host memory (or on disk) and bring them to the device only when used.

- `ModelOffload` (`offload = model`): whole components; each is on the device only inside `on_device(...)`,
  which the pipeline wraps around the stage that uses it.
- `LayerwiseOffload` (`offload = layerwise`, and `disk` with a `DiskStore` from composer.accel.disk): the
  transformer's repeated blocks stay on the host; forward hooks load block i + 1 (up to `prefetch` ahead)
  before block i runs and evict each block after it ran. Everything else of the model stays on the device.

Modules and parameters stay the same Python objects: weights move by swapping `param.data` (buffers by
swapping the entry in `module._buffers`), so stages keep their references and `remove()` leaves a plain
model. Weights are treated as read-only while offloaded: an in-place edit of a device copy is dropped at
eviction (apply LoRA fusing and similar edits before offloading). Tensors a module keeps outside its
parameters and buffers (caches such as Wan's RoPE table) are not moved, as `nn.Module.to` does not move them.

LoRA adapters can be set, swapped and removed while offloaded (`offload = model | layerwise`): the hook listens
to each denoiser's LoraAdapters and, when a change adds or removes modules, re-arranges that model
(`ModelOffload.rebind`, `LayerwiseOffload.rebind`: the new adapter weights are staged on the host and streamed like
the rest); a swap in place (same layers and ranks) writes into the host copies and needs nothing. `offload = disk`
streams the blocks from the checkpoint, where adapters cannot go: changing them is refused there. The hooks
(block forward hooks, the stage scope, the listeners) are attached with `composer.attach` at offload's order
key, so they run before cancel's checks whenever they were (re)attached, and removing the hook leaves the plain
model on the device.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from composer.accel.blocks import block_names
from composer.accel.blocks import repeated_blocks as find_repeated_blocks
from composer.accel.transfer import Pending, Transfer, transfer_for
from composer.attach import Handle, attach, current_order
from composer.errors import ConfigError, InvalidInputError, UnsupportedError


class TensorSlot:
    """One parameter or buffer of a module, addressed by (module, attribute): what the module computes with."""

    __slots__ = ("module", "name", "is_param", "qualname")

    def __init__(self, module: nn.Module, name: str, is_param: bool, qualname: str):
        self.module, self.name, self.is_param, self.qualname = module, name, is_param, qualname

    def get(self) -> torch.Tensor:
        """The Parameter (or buffer) object itself."""
        return (self.module._parameters if self.is_param else self.module._buffers)[self.name]

    def data(self) -> torch.Tensor:
        """The tensor the slot holds now, without the Parameter wrapper (whose data `set` swaps)."""
        tensor = self.get()
        return tensor.data if self.is_param else tensor

    def set(self, tensor: torch.Tensor) -> None:
        if not self.is_param:
            self.module._buffers[self.name] = tensor
            return
        param = self.module._parameters[self.name]
        if param.is_meta != tensor.is_meta:
            # `.data` cannot cross between meta and real tensors; this only happens to a model just built on
            # the meta device, before anything holds its parameters.
            self.module._parameters[self.name] = nn.Parameter(tensor, requires_grad=False)
        else:
            param.data = tensor


def collect_slots(root: nn.Module, prefix: str = "", skip: frozenset[int] = frozenset()) -> list[TensorSlot]:
    """Every parameter and buffer under `root` (submodules whose id is in `skip` excluded), a shared
    parameter once."""
    seen: set[int] = set()
    slots = []
    for mod_name, module in root.named_modules(prefix=prefix.rstrip(".")):
        if id(module) in skip:
            continue
        base = f"{mod_name}." if mod_name else ""
        for store, is_param in ((module._parameters, True), (module._buffers, False)):
            for name, tensor in store.items():
                if tensor is None or id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                slots.append(TensorSlot(module, name, is_param, base + name))
    return slots


def repeated_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's repeated blocks (`accel.hooks.repeated_blocks`); UnsupportedError when it has none."""
    found = find_repeated_blocks(model)
    if found is None:
        name = getattr(type(model), "repeated_blocks", "blocks")
        blocks = getattr(model, name, None) if name else None
        raise UnsupportedError(
            f"layerwise offloading needs the model's repeated blocks as a non-empty nn.ModuleList attribute "
            f"'{name}' (named by the class attribute `repeated_blocks`); {type(model).__name__} has "
            f"{type(blocks).__name__ if blocks is not None else 'none'}. Use offload='model' for this component"
        )
    return found


# -- offload = model ----------------------------------------------------------------------------------------
@dataclass
class _Component:
    module: nn.Module
    slots: list[TensorSlot]
    host: list[torch.Tensor]
    pending: Pending | None = None
    device_tensors: list[torch.Tensor] | None = None
    users: int = 0


class ModelOffload:
    """Components live in host memory (pinned on CUDA) and visit the device inside `on_device(...)`."""

    def __init__(self, modules: Iterable[nn.Module], device: torch.device | str, *, transfer: Transfer | None = None):
        self.device = torch.device(device)
        self.transfer = transfer or transfer_for(self.device)
        self._components: dict[int, _Component] = {}
        owner: dict[int, str] = {}
        for module in modules:
            if id(module) in self._components:
                continue
            slots = collect_slots(module)
            for slot in slots:
                tensor_id = id(slot.get())
                if tensor_id in owner:
                    raise InvalidInputError(
                        f"{type(module).__name__} shares tensor '{slot.qualname}' with {owner[tensor_id]}: "
                        "offloaded components must not share weights (offload their common parent instead)"
                    )
                owner[tensor_id] = type(module).__name__
            host = [self.transfer.stage(slot.data()) for slot in slots]
            for slot, tensor in zip(slots, host):
                slot.set(tensor)
            self._components[id(module)] = _Component(module, slots, host)

    def _lookup(self, modules: Iterable[nn.Module]) -> list[_Component]:
        found = []
        for module in modules:
            component = self._components.get(id(module))
            if component is None:
                raise InvalidInputError(
                    f"{type(module).__name__} is not managed by this ModelOffload: pass it to ModelOffload(...) "
                    "when offloading is set up"
                )
            if all(c is not component for c in found):
                found.append(component)
        return found

    def prefetch(self, modules: Iterable[nn.Module]) -> None:
        """Start copying components to the device now (e.g. during the previous stage); `on_device` finishes."""
        for component in self._lookup(modules):
            if component.device_tensors is None and component.pending is None:
                component.pending = self.transfer.load(id(component.module), component.host)

    def is_on_device(self, module: nn.Module) -> bool:
        return self._lookup([module])[0].device_tensors is not None

    @contextmanager
    def on_device(self, modules: Iterable[nn.Module]) -> Iterator[None]:
        """The given components are on the device for the block's duration, then back on the host. Nests."""
        components = self._lookup(modules)
        self.prefetch(c.module for c in components)  # issue every copy before waiting for any
        for component in components:
            if component.device_tensors is None:
                tensors = self.transfer.wait(component.pending)
                component.pending = None
                for slot, tensor in zip(component.slots, tensors):
                    slot.set(tensor)
                component.device_tensors = tensors
            component.users += 1
        try:
            yield
        finally:
            for component in components:
                component.users -= 1
                if component.users == 0:
                    self._to_host(component)

    def _to_host(self, component: _Component) -> None:
        for k, slot in enumerate(component.slots):
            current, host = slot.data(), component.host[k]
            if not slot.is_param and current is not host:
                # Buffers may be state the module updates or replaces (counters, caches): keep what it holds now.
                if current.shape == host.shape and current.dtype == host.dtype:
                    host.copy_(current)
                else:
                    staged = self.transfer.stage(current)
                    component.host[k] = staged.clone() if staged is current else staged
            slot.set(component.host[k])
        self.transfer.release(id(component.module), component.device_tensors)
        component.device_tensors = None

    def rebind(self, module: nn.Module) -> None:
        """`module`'s parameters changed (adapter layers added or removed): take over the ones it holds now, on the
        host. Only while it is not on the device (between stages)."""
        component = self._lookup([module])[0]
        if component.users or component.device_tensors is not None:
            raise UnsupportedError(f"{type(module).__name__} changed while its stage runs: change it between requests")
        if component.pending is not None:  # a prefetch of the old arrangement: dropped
            self.transfer.release(id(module), self.transfer.wait(component.pending))
            component.pending = None
        component.slots = collect_slots(module)
        component.host = [self.transfer.stage(slot.data()) for slot in component.slots]
        for slot, tensor in zip(component.slots, component.host):
            slot.set(tensor)

    def remove(self) -> None:
        """Stop offloading: every component stays on the device from now on, as without offload."""
        for component in self._components.values():
            if component.device_tensors is None:
                pending = component.pending or self.transfer.load(id(component.module), component.host)
                for slot, tensor in zip(component.slots, self.transfer.wait(pending)):
                    slot.set(tensor)
        self._components.clear()


# -- offload = layerwise / disk -----------------------------------------------------------------------------
class BlockStore:
    """Where a block's weights live between uses. The default, `HostStore`, keeps host copies in RAM."""

    def bind(self, slots: list[list[TensorSlot]], transfer: Transfer) -> None:
        """Take over the blocks' tensors (slots[i]: block i's parameters and buffers)."""
        raise NotImplementedError

    def fetch(self, index: int) -> list[torch.Tensor]:
        """Host tensors to load block `index` from, in slot order."""
        raise NotImplementedError

    def evicted(self, index: int) -> list[torch.Tensor]:
        """What block `index`'s slots hold while it is not on the device."""
        raise NotImplementedError

    def release(self, index: int) -> None:
        """Block `index`'s device copy is gone."""

    def materialize(self, index: int) -> list[torch.Tensor]:
        """Tensors the block can keep for good (used by `remove()`)."""
        return self.fetch(index)

    def close(self) -> None:
        """Offloading ended; drop what the store holds."""


class HostStore(BlockStore):
    """Block weights held in host memory (pinned on CUDA); an evicted block's slots hold the host copies."""

    def bind(self, slots, transfer):
        self.host = [[transfer.stage(slot.data()) for slot in block] for block in slots]

    def fetch(self, index):
        return self.host[index]

    def evicted(self, index):
        return self.host[index]

    def close(self):
        self.host = []


@dataclass
class OffloadStats:
    """Counts since the offload was applied: `misses` are loads not issued ahead of the block's use;
    `faults` are blocks used outside their own forward (e.g. `cross_attention_kv`)."""

    loads: int = 0
    misses: int = 0
    faults: int = 0


class LayerwiseOffload:
    """Streams the repeated blocks of `model` through the device, `prefetch` blocks ahead, with forward hooks.

    Resident on the device: everything but the blocks, and at most `prefetch + 1` blocks, none between two
    forwards. Works across any number of forwards (denoising steps, causal blocks with a KV cache), under
    `torch.inference_mode()`. A block used outside its forward (a method of the model reading block weights)
    is loaded on demand. `remove()` takes the hooks off and leaves every weight on the device.
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device | str,
        *,
        prefetch: int = 1,
        transfer: Transfer | None = None,
        store: BlockStore | None = None,
        order: float | None = None,
    ):
        if prefetch < 0:
            raise ConfigError(f"prefetch = {prefetch}: expected the number of blocks to load ahead, 0 or more")
        self.model = model
        self.device = torch.device(device)
        self.prefetch = prefetch
        self.transfer = transfer or transfer_for(self.device)
        self.store = store or HostStore()
        self.order = current_order() if order is None else order  # where its hooks run among others' (attach.py)
        self.stats = OffloadStats()
        self._hooks: list[Handle] = []
        self._pending: dict[int, Pending] = {}
        self._loaded: dict[int, list[torch.Tensor]] = {}
        self._arrange()

    def _arrange(self) -> None:
        model = self.model
        _, self.blocks = repeated_blocks(model)
        in_blocks = frozenset(id(m) for block in self.blocks for m in block.modules())
        for slot in collect_slots(model, skip=in_blocks):  # the rest of the model lives on the device
            slot.set(slot.data().to(self.device))
        self.slots = [collect_slots(block, prefix=f"{qualname}.")
                      for qualname, block in zip(block_names(model), self.blocks)]
        self.store.bind(self.slots, self.transfer)
        for i in range(len(self.blocks)):
            self._set(i, self.store.evicted(i))
        self._attach()

    def _attach(self) -> None:
        def hook(module: nn.Module, fn, kind: str = "forward_pre", **extra) -> None:
            self._hooks.append(attach(module, fn, kind=kind, order=self.order, record=False, **extra))

        hook(self.model, self._begin_forward)
        hook(self.model, self._end_forward, "forward", always_call=True)
        for i, block in enumerate(self.blocks):
            hook(block, self._block_hook(i, self._enter))
            hook(block, self._block_hook(i, self._evict), "forward", always_call=True)
            owners = {id(slot.module): slot.module for slot in self.slots[i] if slot.module is not block}
            for module in owners.values():
                hook(module, self._block_hook(i, self._fault))

    def _detach(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def set_order(self, order: float) -> None:
        """Run this offload's hooks at `order` among the other hooks of the same modules (attach.py)."""
        self.order = order
        self._detach()
        self._attach()

    def rebind(self) -> None:
        """The blocks' modules or parameters changed (adapter layers added or removed, between forwards): take the
        hooks off and arrange the blocks again, the new weights on the host like the others."""
        if not isinstance(self.store, HostStore):
            raise UnsupportedError(f"the blocks of {type(self.model).__name__} stream from {type(self.store).__name__}"
                                   ": their modules cannot change while offloaded")
        self._detach()
        self._evict_all()
        self._arrange()

    @staticmethod
    def _block_hook(index: int, action):
        def hook(module, *args):
            action(index)

        return hook

    @property
    def resident(self) -> list[int]:
        """Blocks on the device or on their way there."""
        return sorted({*self._pending, *self._loaded})

    def _set(self, index: int, tensors: list[torch.Tensor]) -> None:
        for slot, tensor in zip(self.slots[index], tensors):
            slot.set(tensor)

    def _issue(self, index: int) -> None:
        self._pending[index] = self.transfer.load(index, self.store.fetch(index))
        self.stats.loads += 1

    def _evict(self, index: int) -> None:
        if index in self._loaded:
            tensors = self._loaded.pop(index)
            self._set(index, self.store.evicted(index))
        elif index in self._pending:
            tensors = self._pending.pop(index).tensors
        else:
            return
        self.transfer.release(index, tensors)
        self.store.release(index)

    def _evict_all(self) -> None:
        for index in self.resident:
            self._evict(index)

    def _begin_forward(self, module, args) -> None:
        # Blocks left over (used outside a forward, or a forward that raised) go; the first blocks start
        # loading now, so their copies overlap the patch and condition embedding.
        self._evict_all()
        for index in range(min(self.prefetch, len(self.blocks))):
            self._issue(index)

    def _end_forward(self, module, args, output) -> None:
        self._evict_all()  # blocks prefetched but skipped (e.g. by a step cache) go too

    def _enter(self, index: int) -> None:
        """Block `index` is about to run: it is made ready, the next `prefetch` blocks start loading."""
        window = range(index, min(index + self.prefetch, len(self.blocks) - 1) + 1)
        for other in self.resident:
            if other not in window:
                self._evict(other)
        if index not in self._loaded:
            if index not in self._pending:
                self._issue(index)
                self.stats.misses += 1
            tensors = self.transfer.wait(self._pending.pop(index))
            self._set(index, tensors)
            self._loaded[index] = tensors
        for ahead in window[1:]:
            if ahead not in self._pending and ahead not in self._loaded:
                self._issue(ahead)

    def _fault(self, index: int) -> None:
        if index not in self._loaded:
            self.stats.faults += 1
            self._enter(index)

    def remove(self) -> None:
        """Take the hooks off and put every block on the device for good: the model is a plain model again."""
        self._detach()
        self._evict_all()
        for index in range(len(self.blocks)):
            self._set(index, self.transfer.wait(self.transfer.load(index, self.store.materialize(index))))
        self.store.close()



class OffloadHook:
    """Hook phase for `offload = model | layerwise | disk`.

    - model: every component loads on the host; each stage's modules go to the device while it runs.
    - layerwise: the transformers load on the host; everything but their blocks moves to the device and the
      blocks stream through it one block ahead.
    - disk: as layerwise, but a transformer's blocks are never read into memory: they stream from the
      memory-mapped safetensors files (composer.accel.disk).
    In the layerwise modes the engine's once-per-prompt cross-attention k/v pass reads every block outside
    its forward: each block is loaded on demand for it (`LayerwiseOffload.stats.faults`), with the same
    prefetch, so a prompt costs one extra pass over the weights instead of projecting the text in every step.
    """

    name = "offload"

    def __init__(self, mode: str):
        self.mode = mode
        self.done: dict[str, LayerwiseOffload] = {}
        self.models: ModelOffload | None = None

    @classmethod
    def from_runtime(cls, runtime) -> OffloadHook:
        return cls(runtime.offload)

    def load_device(self, pipeline, name: str, device: torch.device) -> torch.device:
        streamed = self.mode in ("layerwise", "disk") and name in pipeline.denoiser_names()
        return torch.device("cpu") if self.mode == "model" or streamed else device

    def apply(self, pipeline) -> str:
        if self.mode == "model":
            modules = [m for m in pipeline.modules.values() if isinstance(m, nn.Module)]
            models = self.models = ModelOffload(modules, pipeline.device)
            attach(undo=models.remove, what="components on the host")
            attach(pipeline.stage_scopes, lambda stage: models.on_device(stage.modules()),
                   what="each stage's components on the device while it runs")
            for name in pipeline.denoisers():
                attach(pipeline.lora_adapters(name).listeners, lambda adapters: models.rebind(adapters.model),
                       what=f"{name}: re-arranged after a LoRA change")
            return f"model: {len(modules)} components on the host, each on {pipeline.device} while its stage runs"
        lines = []
        for name, model in pipeline.denoisers().items():
            if name not in self.done:
                self.done[name] = LayerwiseOffload(model, pipeline.device)
            else:  # made while loading (disk): its hooks take offload's place among the others now
                self.done[name].set_order(current_order())
            offload = self.done[name]
            attach(undo=offload.remove, what=f"{name}: blocks streamed")
            adapters = pipeline.lora_adapters(name)
            if self.mode == "disk":
                attach((adapters, "locked"), "offload = disk streams the transformer's blocks straight from the "
                       "checkpoint, where adapters cannot be added; use offload = layerwise",
                       what=f"{name}: LoRA changes refused")
            else:
                attach(adapters.listeners, lambda adapters, offload=offload: offload.rebind(),
                       what=f"{name}: re-arranged after a LoRA change")
            source = "memory-mapped safetensors" if self.mode == "disk" else "host memory"
            lines.append(f"{name}: {len(self.done[name].blocks)} blocks streamed from {source}, one block ahead")
        return f"{self.mode}: " + "; ".join(lines)
