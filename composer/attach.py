"""One way to attach a hook, and to take it off again.

    handle = attach(target, hook, order=5)   # returns a Handle
    handle.remove()                          # undoes exactly that attachment (a second call does nothing)

`target` is what the hook plugs into:

    an nn.Module, with `kind`          a torch forward hook ("forward_pre", "forward"; `always_call` as torch's)
    an object with a `hooks` list      a denoising engine's hooks (before_step / after_step / around_model)
    a list                             a pipeline's `stage_scopes`, a LoRA adapter set's change listeners
    (obj, "attribute")                 an attribute set after construction (a model's block-runner slot, an
                                       engine's `branch_parallel`, a compiled `forward`): removal restores what
                                       was there, or takes the instance attribute away
    undo=callable (no target)          a change the hook made itself (adapters injected, a backend chosen, weights
                                       arranged for offload): the callable undoes it

Hooks on one target run in order of their `order` key (ties: in the order attached); what was attached without
a key (torch hooks registered directly, `engine.add_hook`) keeps its place and runs after keyed hooks attached
later only if their key says so. The order keys of the hook phase are the positions in
`composer.accel.hooks.HOOKS` (quantize 0 ... cancel 7), so offload's block hooks always run before cancel's
check, whichever was (re)attached last.

The hook phase attaches each runtime hook inside `attaching(pipeline.attachments, name, order)`: every handle
made meanwhile (and while that hook configures an engine later) belongs to the hook's `HookHandle`, whose
`remove()` takes them off last-attached first. `pipeline.attachments` lists every hook of a pipeline with what
it attached, and removes any of them.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from composer.errors import UnsupportedError

__all__ = ["Attachments", "Handle", "HookHandle", "attach", "attaching", "current_order", "order_of"]

LAST = math.inf  # the order key of what was attached without one

_MISSING = object()
_lock = threading.RLock()
# order keys of list elements (engine hooks, stage scopes, listeners) and of torch hook ids
_element_orders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_element_orders_by_id: dict[int, float] = {}  # elements that cannot be weakly referenced (rare: bound methods)
_torch_orders: dict[int, float] = {}


class Handle:
    """One attachment. `remove()` undoes it (idempotent); `what` says what it was, for listings and errors."""

    def __init__(self, what: str, undo: Callable[[], None] | None, order: float = LAST):
        self.what = what
        self.order = order
        self._undo = undo
        self._removed = False

    @property
    def removed(self) -> bool:
        return self._removed

    @property
    def removable(self) -> bool:
        return self._undo is not None

    def remove(self) -> None:
        with _lock:
            if self._removed:
                return
            if self._undo is None:
                raise UnsupportedError(f"{self.what} cannot be removed (no undo is known for it): load the model "
                                       "again without it")
            self._removed = True
            undo, self._undo = self._undo, None
        undo()

    def __repr__(self) -> str:
        state = "removed" if self._removed else f"order {self.order:g}"
        return f"Handle({self.what}, {state})"


@dataclass(eq=False)
class HookHandle:
    """A runtime hook as attached to one pipeline: its name, order key, the hook object and every handle it made
    (`parts`, in the order made). `remove()` takes the parts off, last first."""

    name: str
    order: float
    hook: Any = None
    parts: list[Handle] = field(default_factory=list)
    line: str = ""  # what the hook's apply said it did
    _removed: bool = False

    @property
    def removed(self) -> bool:
        return self._removed

    @property
    def removable(self) -> bool:
        return all(p.removable or p.removed for p in self.parts)

    def remove(self) -> None:
        if self._removed:
            return
        stuck = [p.what for p in self.parts if not p.removable and not p.removed]
        if stuck:
            raise UnsupportedError(f"hook {self.name} cannot be removed: {'; '.join(stuck)} has no undo (load the "
                                   f"model again without {self.name})")
        for part in reversed(self.parts):
            part.remove()
        self._removed = True

    def __repr__(self) -> str:
        state = "removed" if self._removed else f"{len(self.parts)} attachment(s)"
        return f"HookHandle({self.name}, order {self.order:g}, {state})"


class Attachments:
    """Every hook attached to one pipeline, in order key order."""

    def __init__(self) -> None:
        self._hooks: list[HookHandle] = []

    def add(self, name: str, order: float, hook: Any = None) -> HookHandle:
        entry = HookHandle(name, order, hook)
        self._hooks.append(entry)
        self._hooks.sort(key=lambda h: h.order)  # stable: equal keys keep the order they came in
        return entry

    def __iter__(self) -> Iterator[HookHandle]:
        return iter([h for h in self._hooks if not h.removed])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def names(self) -> list[str]:
        return [h.name for h in self]

    def get(self, name: str) -> HookHandle | None:
        return next((h for h in self if h.name == name), None)

    def remove(self, name: str | None = None) -> list[str]:
        """Take hook `name` off (None: every hook, the last in order first); returns the names removed."""
        todo = [h for h in self if name is None or h.name == name]
        if name is not None and not todo:
            raise KeyError(f"no hook {name!r} is attached (attached: {', '.join(self.names()) or 'none'})")
        stuck = [h.name for h in todo if not h.removable]
        if stuck:  # refused before anything is taken off
            raise UnsupportedError(f"hook(s) {', '.join(stuck)} cannot be removed: they changed the weights for good "
                                   "(load the model again without them)")
        for entry in reversed(todo):
            entry.remove()
        return [h.name for h in todo]

    def describe(self) -> list[str]:
        return [f"{h.order:g} {h.name}: " + ", ".join(p.what for p in h.parts if not p.removed) for h in self]


@dataclass
class _Owner:
    entry: HookHandle


_owner: ContextVar[_Owner | None] = ContextVar("composer_attach_owner", default=None)


@contextmanager
def attaching(entry: HookHandle) -> Iterator[HookHandle]:
    """Handles made inside belong to `entry` (a hook's HookHandle) and take its order key."""
    token = _owner.set(_Owner(entry))
    try:
        yield entry
    finally:
        _owner.reset(token)


def current_order() -> float:
    """The order key of the hook being attached now (LAST outside the hook phase)."""
    owner = _owner.get()
    return owner.entry.order if owner is not None else LAST


def _record(handle: Handle) -> Handle:
    owner = _owner.get()
    if owner is not None:
        owner.entry.parts.append(handle)
    return handle


def order_of(element: Any) -> float:
    """The order key `element` was attached with (LAST for what was added another way)."""
    try:
        found = _element_orders.get(element, _MISSING)
    except TypeError:
        found = _MISSING
    if found is _MISSING:
        found = _element_orders_by_id.get(id(element), LAST)
    return found


def _remember(element: Any, order: float) -> None:
    try:
        _element_orders[element] = order
    except TypeError:
        _element_orders_by_id[id(element)] = order


def _forget(element: Any) -> None:
    try:
        _element_orders.pop(element, None)
    except TypeError:
        pass
    _element_orders_by_id.pop(id(element), None)


def attach(target: Any = None, hook: Any = None, *, order: float | None = None, kind: str | None = None,
           undo: Callable[[], None] | None = None, what: str | None = None, always_call: bool = False,
           record: bool = True) -> Handle:
    """Attach `hook` to `target` (see the module's docstring for the kinds of target) at `order` (default: the
    order key of the hook being attached, else last); returns the Handle that removes it. With no target, `undo`
    is the function that undoes a change already made (None: a change that cannot be undone). `record=False`:
    the handle is the caller's alone (an object that manages its own handles), not a part of the hook being
    attached."""
    order = current_order() if order is None else float(order)
    keep = _record if record else (lambda handle: handle)
    if target is None:
        return keep(Handle(what or "a change", undo, order))
    if isinstance(target, tuple) and len(target) == 2 and isinstance(target[1], str):
        return keep(_attach_attribute(target[0], target[1], hook, order, what))
    if isinstance(target, nn.Module) and kind is not None:
        return keep(_attach_torch(target, hook, kind, order, always_call, what))
    if isinstance(target, list):
        return keep(_attach_to_list(target, hook, order, what or f"{_name(hook)} in a list"))
    hooks = getattr(target, "hooks", None)
    if isinstance(hooks, list):
        return keep(_attach_to_list(hooks, hook, order, what or f"{_name(hook)} on {type(target).__name__}"))
    raise TypeError(f"cannot attach to {type(target).__name__}: expected an nn.Module with kind=, an object with a "
                    "hooks list, a list, or (object, attribute)")


def _name(obj: Any) -> str:
    return getattr(obj, "__qualname__", None) or type(obj).__name__


def _attach_to_list(items: list, element: Any, order: float, what: str) -> Handle:
    with _lock:
        at = len(items)
        while at > 0 and order_of(items[at - 1]) > order:
            at -= 1
        items.insert(at, element)
        _remember(element, order)

    def undo() -> None:
        with _lock:
            for i, item in enumerate(items):
                if item is element:
                    del items[i]
                    break
            if not any(item is element for item in items):
                _forget(element)

    return Handle(what, undo, order)


def _attach_attribute(obj: Any, attribute: str, value: Any, order: float, what: str | None) -> Handle:
    slot = isinstance(getattr(type(obj), attribute, None), property)  # e.g. a model's block-runner slot
    if slot:
        had = getattr(obj, attribute)
    else:
        had = obj.__dict__.get(attribute, _MISSING) if hasattr(obj, "__dict__") else _MISSING
    setattr(obj, attribute, value)

    def undo() -> None:
        if had is _MISSING:
            if attribute in getattr(obj, "__dict__", {}):
                delattr(obj, attribute)  # the class's own attribute (a method such as forward) shows again
        else:
            setattr(obj, attribute, had)

    return Handle(what or f"{type(obj).__name__}.{attribute}", undo, order)


_TORCH_KINDS = {"forward_pre": ("register_forward_pre_hook", "_forward_pre_hooks"),
                "forward": ("register_forward_hook", "_forward_hooks")}


def _attach_torch(module: nn.Module, fn: Callable, kind: str, order: float, always_call: bool,
                  what: str | None) -> Handle:
    if kind not in _TORCH_KINDS:
        raise ValueError(f"kind = {kind!r}: expected one of {sorted(_TORCH_KINDS)}")
    register, table = _TORCH_KINDS[kind]
    with _lock:
        extra = {"always_call": True} if always_call and kind == "forward" else {}
        handle = getattr(module, register)(fn, **extra)
        _torch_orders[handle.id] = order
        _sort_torch(getattr(module, table))

    def undo() -> None:
        with _lock:
            handle.remove()
            _torch_orders.pop(handle.id, None)

    return Handle(what or f"{kind} hook {_name(fn)} on {type(module).__name__}", undo, order)


def _sort_torch(table: dict) -> None:
    """Our hooks (keyed) in order key order, each in one of the places our hooks held; the others stay put."""
    keys = list(table)
    ours = sorted((k for k in keys if k in _torch_orders), key=lambda k: (_torch_orders[k], k))
    if not ours:
        return
    it = iter(ours)
    items = [(next(it) if k in _torch_orders else k) for k in keys]
    items = [(k, table[k]) for k in items]
    table.clear()
    table.update(items)
