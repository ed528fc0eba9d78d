"""KVPool: every causal session's keys/values in pages of one pool per model (PagedAttention, for frames).

A *page* holds one latent frame of one batch row for every layer: `tokens_per_frame` tokens x heads x head_dim keys
and as many values. Pages of one shape (layers, tokens per frame, heads, head_dim, dtype, device) live in one
*arena*, two tensors [layers, pages, tokens_per_frame, heads, head_dim] that grow as sessions need them; the free
pages at an arena's end give their memory back when another arena needs it under the budget.

A session's cache (`PagedKVCache`, the same bookkeeping as `KVCache`: frame f lives in slot slot(f)) holds a *page
table* [rows, slots] -> page id. When it is made it is given an *extent* of rows x slots pages of its own (the most
it can hold at once: the rolling window, or the rollout's frames under global attention), so a session never
runs out of pages in the middle of a stream:

- **admission**: an extent is allocated only when the pool's budget (`kv_cache_memory`) has room; otherwise the
  session waits, in priority then arrival order, and its position is visible (`KVPool.stats`,
  `KVPool.position`). A request larger than the whole budget is refused at once. The caches of one request (its
  guidance branches) are admitted together (`PagedKVCache.several`): a request never waits holding pages.
- **rolling windows** reuse the pages of frames that left the window (slot(f) cycles), **sinks** keep theirs.
- **fork** (`PagedKVCache.fork`): the new cache's table points at the parent's pages (reference counted) and its
  own extent waits unused. Copy-on-write, on either side: a pass that writes a slot whose page another cache also
  points at first gives one of the two caches a copy in its own extent's page for that slot (the fork, when the
  fork writes a page it borrowed; each borrower, when the page's owner writes it: re-running the newest frames, or
  a rolling window's new frames overwriting old ones). Branches share their history until they overwrite it, and a
  pass that fails leaves the other branch's frames, and its own, as they were.
- **export / load**: the visible frames' keys and values as tensors, for snapshots that continue in another
  process.

Reads: while a table points only at the cache's own extent in slot order (every cache that was not forked, and a
fork once it has written its whole window), a layer's visible keys are a *view* of the arena, exactly the
contiguous cache's layout, no copy; otherwise the visible pages are gathered (`index_select`) into that layout. The
order of keys is the contiguous cache's either way, so attention gets the same tensors and the output is
bit-identical to `KVCache`'s (tests/test_kv_pool.py).

With `offload=True` the arena lives in (pinned) CPU memory and each layer's visible keys are copied to the compute
device for its attention, as `KVCache(offload=True)` does.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from composer.admission import AdmissionQueue, Ticket
from composer.cache.kv_cache import KVCache, KVCacheSpec
from composer.errors import InvalidInputError
from composer.platform import platform_for


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class _Arena:
    """Pages of one shape: keys/values [layers, pages, tokens_per_frame, heads, head_dim], a reference count per page."""

    def __init__(self, pool: KVPool, layers: int, tpf: int, heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, offload: bool):
        self.pool = pool
        self.page_shape = (tpf, heads, head_dim)
        self.layers = layers
        self.dtype = dtype
        self.device = device  # where attention runs
        self.offload = offload
        self.storage = torch.device("cpu") if offload else device
        self.page_bytes = 2 * layers * tpf * heads * head_dim * _element_size(dtype)
        self.keys = self._empty(0)
        self.values = self._empty(0)
        self.refs: list[int] = []
        self.caches: weakref.WeakSet[PagedKVCache] = weakref.WeakSet()  # open caches with pages here
        self.lock = threading.RLock()  # writes, reads and growth of these tensors, page tables' changes

    def _empty(self, pages: int) -> torch.Tensor:
        """Normal tensors, never inference tensors (the arena may grow inside a stream's inference mode): its
        pages are written in place in and outside inference mode (a stream's passes, a fork's copy-on-write from a
        session, load)."""
        with torch.inference_mode(False):
            if self.offload:  # page-locked where the device has such host memory: its copies are asynchronous
                return platform_for(self.device).empty_host((self.layers, pages, *self.page_shape), self.dtype)
            return torch.zeros((self.layers, pages, *self.page_shape), dtype=self.dtype, device=self.storage)

    @property
    def capacity(self) -> int:
        return len(self.refs)

    @property
    def used(self) -> int:
        return sum(1 for r in self.refs if r > 0)

    def allocate(self, count: int) -> tuple[list[int], bool]:
        """`count` free pages (refcount 1), a contiguous run when there is one (then True), growing the arena if
        needed. The pool's budget was checked by the caller."""
        with self.lock:
            run = self._free_run(count)
            if run is None and sum(1 for r in self.refs if r == 0) < count:
                self._grow(count)
                run = self._free_run(count)
            if run is not None:
                pages, contiguous = list(range(run, run + count)), True
            else:
                pages, contiguous = [i for i, r in enumerate(self.refs) if r == 0][:count], False
            for p in pages:
                self.refs[p] = 1
            return pages, contiguous

    def _free_run(self, count: int) -> int | None:
        length = 0
        for i, r in enumerate(self.refs):
            length = length + 1 if r == 0 else 0
            if length == count:
                return i - count + 1
        return None

    @torch.inference_mode()
    def _grow(self, count: int) -> None:
        """Room for `count` more free pages at the end (a doubling, so growth is rare); the old pages are copied."""
        free_tail = 0
        for r in reversed(self.refs):
            if r:
                break
            free_tail += 1
        needed = self.capacity + count - free_tail
        new_capacity = max(needed, 2 * self.capacity)
        limit = self.pool.page_limit(self, needed)
        if limit is not None:
            new_capacity = max(min(new_capacity, limit), needed)
        keys, values = self._empty(new_capacity), self._empty(new_capacity)
        if self.capacity:
            keys[:, :self.capacity].copy_(self.keys)
            values[:, :self.capacity].copy_(self.values)
        self.keys, self.values = keys, values
        self.refs.extend([0] * (new_capacity - len(self.refs)))

    def trim(self) -> None:
        """Give back the memory of the free pages at the arena's end (pages in use keep their ids)."""
        with self.lock:
            keep = len(self.refs)
            while keep and self.refs[keep - 1] == 0:
                keep -= 1
            if keep == len(self.refs):
                return
            keys, values = self._empty(keep), self._empty(keep)
            if keep:
                keys.copy_(self.keys[:, :keep])
                values.copy_(self.values[:, :keep])
            self.keys, self.values = keys, values
            del self.refs[keep:]

    def retain(self, pages: list[int]) -> None:
        with self.lock:
            for p in pages:
                if self.refs[p] <= 0:
                    raise RuntimeError(f"KV page {p} is free: it cannot be shared")
                self.refs[p] += 1

    def unref(self, pages: list[int]) -> None:
        """Drop one reference to each page (the caller holds the lock, or takes it here; it tells the pool)."""
        with self.lock:
            for p in pages:
                if self.refs[p] <= 0:
                    raise RuntimeError(f"KV page {p} released more often than taken")
                self.refs[p] -= 1

    def release(self, pages: list[int]) -> None:
        self.unref(pages)
        self.pool.changed()  # outside the arena's lock: the pool's lock comes first where both are taken

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Pages `dst` := pages `src` (keys and values, every layer). The caller holds the lock."""
        dst = dst.to(self.keys.device)
        src = src.to(self.keys.device)
        self.keys.index_copy_(1, dst, self.keys.index_select(1, src))
        self.values.index_copy_(1, dst, self.values.index_select(1, src))

    def unshare(self, pages: list[int], owner: PagedKVCache) -> int:
        """`owner` is about to write `pages` of its extent: every other cache pointing at one of them gets a copy in
        its own extent's page for that slot. Returns the references dropped. The caller holds the lock."""
        wanted = torch.tensor(pages, dtype=torch.long)
        dropped = 0
        for cache in list(self.caches):
            if cache is owner:
                continue
            hit = torch.isin(cache.table, wanted) & (cache.table != cache.own)
            if hit.any():
                src, dst = cache.table[hit], cache.own[hit]
                self.copy(src, dst)
                cache.table[hit] = dst
                cache._table_changed()
                cache._foreign -= int(hit.sum())
                self.unref(src.tolist())
                dropped += len(src)
        return dropped


@dataclass
class KVPoolStats:
    """What the pool holds now (bytes count pages in use, shared pages once)."""

    budget_bytes: int | None
    used_bytes: int
    allocated_bytes: int  # arenas' size, used or free
    peak_used_bytes: int
    sessions: int  # caches holding pages
    waiting: int  # sessions waiting for pages (admission)
    waits: int  # sessions that had to wait, since the pool was made
    shared_pages: int  # pages referenced by more than one cache (forks)
    swaps: int = 0  # idle caches moved to host memory for a higher-priority stream, since the pool was made
    swapped_bytes: int = 0  # keys/values on the host now


@dataclass(frozen=True)
class PageNeed:
    """What a ticket of the pool asks for: `count` pages of `arena` for `caches` new caches (0: a cache coming back
    from host memory)."""

    arena: Any  # _Arena
    count: int
    caches: int = 1

    @property
    def nbytes(self) -> int:
        return self.count * self.arena.page_bytes


class KVPool(AdmissionQueue):
    """The pages of one model's causal sessions, under one memory budget (see the module docstring): an admission
    queue (composer/admission.py) whose grant is (page ids, whether they are one run). A task waits for pages with
    `Admit(pool, pool.need(...), priority, cancel)` on the engine core; a thread in `take`.

    `budget`: bytes; a float in (0, 1] for that fraction of the device's free memory when the pool is made; None
    for no limit (pages are still pooled and reused, nothing waits).
    """

    def __init__(self, budget: int | float | None = None, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.budget_bytes = resolve_budget(budget, self.device)
        super().__init__()
        self._arenas: dict[tuple, _Arena] = {}
        self._sessions = 0
        self._peak = 0
        self.swaps = 0  # caches moved to host memory (since the pool was made)
        self.swapped_bytes = 0  # keys/values on the host now

    # -- arenas ------------------------------------------------------------------------------------------
    def arena(self, spec: KVCacheSpec, dtype: torch.dtype, device: torch.device, offload: bool) -> _Arena:
        key = (spec.num_layers, spec.tokens_per_frame, spec.num_heads, spec.head_dim, dtype, str(device), offload)
        with self._cv:
            if key not in self._arenas:
                self._arenas[key] = _Arena(self, spec.num_layers, spec.tokens_per_frame, spec.num_heads,
                                           spec.head_dim, dtype, device, offload)
            return self._arenas[key]

    def used_bytes(self) -> int:
        return sum(a.used * a.page_bytes for a in self._arenas.values())

    def page_limit(self, arena: _Arena, needed: int) -> int | None:
        """The most pages `arena` may grow to (it needs `needed`): what the budget leaves after the other arenas'
        memory, whose free pages at their ends are given back first when they stand in the way (pages of another
        shape: streams of another resolution). The caller holds the pool's lock."""
        if self.budget_bytes is None:
            return None
        others = [a for a in self._arenas.values() if a is not arena]
        if sum(a.capacity * a.page_bytes for a in others) + needed * arena.page_bytes > self.budget_bytes:
            for a in others:
                a.trim()
        return max(0, (self.budget_bytes - sum(a.capacity * a.page_bytes for a in others)) // arena.page_bytes)

    # -- admission -----------------------------------------------------------------------------------------
    def need(self, arena: _Arena, count: int, caches: int = 1) -> PageNeed:
        """What `count` pages of `arena` for `caches` new caches ask of the pool. Raises InvalidInputError when they
        exceed the whole budget (such a request would wait for ever)."""
        need = PageNeed(arena, count, caches)
        if self.budget_bytes is not None and need.nbytes > self.budget_bytes:
            raise InvalidInputError(
                f"this stream's KV cache needs {_fmt(need.nbytes)} ({count} pages of {_fmt(arena.page_bytes)}) but "
                f"kv_cache_memory is {_fmt(self.budget_bytes)}: raise kv_cache_memory, or use a shorter rollout "
                "(rollout_blocks) or a smaller resolution"
            )
        return need

    def take(self, arena: _Arena, count: int, priority: int = 0, cancel: Any = None, caches: int = 1,
             ) -> tuple[list[int], bool]:
        """Allocate `count` pages of `arena` for `caches` new caches, this thread waiting (in priority, then arrival
        order) until the budget has room. Raises InvalidInputError when `count` pages exceed the whole budget."""
        return self.wait_for(self.need(arena, count, caches), priority, cancel, owner=id(threading.current_thread()))

    def _grant(self, ticket: Ticket) -> tuple[list[int], bool] | None:
        need: PageNeed = ticket.need
        while not self._fits(need.nbytes):
            if not self._make_room(need.nbytes, ticket.priority):
                return None
        pages, contiguous = need.arena.allocate(need.count)
        self._sessions += need.caches
        self._peak = max(self._peak, self.used_bytes())
        return pages, contiguous

    def _waiting(self, ticket: Ticket) -> None:
        from composer.logging import get_logger

        get_logger(__name__).info(
            "a stream waits for KV pages: it needs %s, %s of %s in use; %d ahead of it", _fmt(ticket.need.nbytes),
            _fmt(self.used_bytes()), _fmt(self.budget_bytes or 0),
            self._queue.index(ticket) if ticket in self._queue else 0,
        )

    def _make_room(self, need: int, priority: int) -> bool:
        """Move idle caches of lower priority than `priority` to host memory (lowest priority first, then the
        largest) until `need` bytes fit; whether any moved."""
        idle = [c for a in self._arenas.values() for c in list(a.caches) if c.idle and c.priority < priority]
        moved = False
        for cache in sorted(idle, key=lambda c: (c.priority, -c.nbytes)):
            if self._fits(need):
                break
            moved = cache.swap_out() or moved
        return moved

    def _fits(self, need: int) -> bool:
        return self.budget_bytes is None or self.used_bytes() + need <= self.budget_bytes

    def position(self, thread: Any = None) -> int | None:  # type: ignore[override]
        """A thread's place in the admission queue (0: next; default: the calling thread's), None when it is not
        waiting."""
        return super().position(id(thread if thread is not None else threading.current_thread()))

    def _closed_session(self) -> None:
        with self._cv:
            self._sessions -= 1
            self._notify()

    def reset_peak(self) -> None:
        """Start `peak_used_bytes` over from the bytes in use now (to measure one stretch of traffic)."""
        with self._cv:
            self._peak = self.used_bytes()

    def stats(self) -> KVPoolStats:
        with self._cv:
            arenas = list(self._arenas.values())
            return KVPoolStats(
                budget_bytes=self.budget_bytes,
                used_bytes=sum(a.used * a.page_bytes for a in arenas),
                allocated_bytes=sum(a.capacity * a.page_bytes for a in arenas),
                peak_used_bytes=self._peak,
                sessions=self._sessions,
                waiting=len(self._queue),
                waits=self._waits,
                shared_pages=sum(sum(1 for r in a.refs if r > 1) for a in arenas),
                swaps=self.swaps, swapped_bytes=self.swapped_bytes,
            )


def budget_problem(budget: Any) -> str | None:
    """What is wrong with a kv_cache_memory value (None: nothing)."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget != budget or budget in (
            float("inf"), float("-inf")):
        return "a number of bytes, or a fraction in (0, 1] of the free device memory"
    if budget <= 0:
        return "a positive number of bytes, or a fraction in (0, 1]"
    if isinstance(budget, float) and budget > 1.0 and not budget.is_integer():
        return "a whole number of bytes (or a fraction in (0, 1])"
    return None


def resolve_budget(budget: int | float | None, device: torch.device) -> int | None:
    """kv_cache_memory as bytes: a number > 1 is bytes; a float in (0, 1] a fraction of the device's free memory
    (host memory for a CPU device)."""
    if budget is None:
        return None
    if (problem := budget_problem(budget)) is not None:
        raise InvalidInputError(f"kv_cache_memory = {budget!r}: expected {problem}")
    if isinstance(budget, float) and budget <= 1.0:
        free, _ = platform_for(device).memory_info(device)  # the host's available memory for a CPU device
        return int(free * budget)
    return int(budget)


def _fmt(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


class PagedKVCache(KVCache):
    """A KVCache whose slots are pages of a KVPool (see the module docstring); same interface and results."""

    def __init__(self, spec: KVCacheSpec, dtype: torch.dtype, device: torch.device | str, pool: KVPool,
                 offload: bool = False, priority: int = 0, cancel: Any = None, _parent: PagedKVCache | None = None,
                 _pages: list[int] | None = None):
        self.spec = spec
        self.dtype = dtype
        self.device = torch.device(device)
        self.offload = offload
        self.pool = pool
        self.arena = pool.arena(spec, dtype, self.device, offload)
        rows, slots = spec.batch_size, spec.slots
        self.waited_s = 0.0
        if _pages is None:
            start = time.perf_counter()
            _pages, _ = pool.take(self.arena, rows * slots, priority, cancel)
            self.waited_s = time.perf_counter() - start
        pages = _pages
        self.own = torch.tensor(pages, dtype=torch.long).view(rows, slots)  # this cache's extent
        self.base = pages[0] if pages == list(range(pages[0], pages[0] + len(pages))) else None
        self.table = self.own.clone()  # [rows, slots] -> page
        self._own_rows = self.own.tolist()  # the extent as Python lists: the bookkeeping of a pass needs no tensors
        self._foreign = 0  # table entries pointing at pages not of the extent (a fork's shared history)
        self._version = 0  # counts the table's changes: a pass's pages are kept while the table stays as it was
        self._pages_key: tuple | None = None
        self._pages: tuple[torch.Tensor, torch.Tensor] | None = None  # a pass's (written, read) pages, on the host
        self._device_pages: tuple[torch.Tensor, torch.Tensor] | None = None  # the same on the arena's device
        self._closed = False
        self.end_frame = 0
        self._pass = None
        self.priority = priority
        self.cancel = cancel
        self.idle = False  # its stream is suspended between blocks: its pages may go to host memory
        self.swapped: tuple[torch.Tensor, torch.Tensor] | None = None  # its pages' keys/values while on the host
        with self.arena.lock:
            self.arena.caches.add(self)
        if _parent is not None:
            try:
                self._share(_parent)
            except BaseException:
                self.close()
                raise

    @classmethod
    def several(cls, specs: list[KVCacheSpec], dtype: torch.dtype, device: torch.device | str, pool: KVPool,
                offload: bool = False, priority: int = 0, cancel: Any = None) -> list[PagedKVCache]:
        """Caches admitted together (one request's guidance branches): one wait for all their pages, so two
        requests never each hold part of what they need while both wait for the rest. The specs differ at most in
        rows and frames (one arena). This thread waits; a task asks `page_need` and waits on the engine core."""
        if not specs:
            return []
        need = cls.page_need(specs, dtype, device, pool, offload)
        start = time.perf_counter()
        grant = pool.wait_for(need, priority, cancel, owner=id(threading.current_thread()))
        return cls.granted(specs, dtype, device, pool, offload, grant, priority, cancel, time.perf_counter() - start)

    @classmethod
    def page_need(cls, specs: list[KVCacheSpec], dtype: torch.dtype, device: torch.device | str, pool: KVPool,
                  offload: bool = False) -> PageNeed:
        """What the caches of `specs` ask of `pool` together (raises InvalidInputError when it is more than the
        whole budget)."""
        arena = pool.arena(specs[0], dtype, torch.device(device), offload)
        if any(pool.arena(s, dtype, torch.device(device), offload) is not arena for s in specs):
            raise ValueError("PagedKVCache.several: the caches' pages must have one shape")
        return pool.need(arena, sum(s.batch_size * s.slots for s in specs), caches=len(specs))

    @classmethod
    def granted(cls, specs: list[KVCacheSpec], dtype: torch.dtype, device: torch.device | str, pool: KVPool,
                offload: bool, grant: tuple[list[int], bool], priority: int = 0, cancel: Any = None,
                waited_s: float = 0.0) -> list[PagedKVCache]:
        """The caches of `specs` over the pages `pool` granted to their `page_need`."""
        pages, _ = grant
        out, first = [], 0
        for s in specs:
            size = s.batch_size * s.slots
            out.append(cls(s, dtype, device, pool, offload, priority, cancel, _pages=pages[first:first + size]))
            out[-1].waited_s = waited_s
            first += size
        return out

    # -- pages -------------------------------------------------------------------------------------------
    def _share(self, parent: PagedKVCache) -> None:
        with self.arena.lock:
            if parent._closed:  # closed while this fork waited for its extent
                raise RuntimeError("fork() of a KV cache that was closed")
            written = min(parent.end_frame, self.spec.slots)
            shared = parent.table[:, :written]
            self.arena.retain(shared.flatten().tolist())
            self.table[:, :written] = shared
            self._table_changed()
            self._foreign = int((shared != self.own[:, :written]).sum())
            self.end_frame = parent.end_frame

    def fork(self, priority: int = 0, cancel: Any = None) -> PagedKVCache:
        """A cache with this one's frames, sharing its pages until either writes them (waits for its own extent)."""
        if self._closed:
            raise RuntimeError("fork() of a KV cache that was closed")
        if self._pass is not None:
            raise RuntimeError("fork() during a pass")
        self._resident()
        budget = self.pool.budget_bytes
        if budget is not None and 2 * self.nbytes > budget:  # it would wait for pages its own parent holds
            raise InvalidInputError(
                f"a fork's KV cache needs {_fmt(self.nbytes)} besides its parent's {_fmt(self.nbytes)} but "
                f"kv_cache_memory is {_fmt(budget)}: raise kv_cache_memory to fork this stream"
            )
        return PagedKVCache(self.spec, self.dtype, self.device, self.pool, self.offload, priority, cancel,
                            _parent=self)

    def close(self) -> None:
        """Give the pages back to the pool (a fork may still hold some of them)."""
        if self._closed:
            return
        self._closed = True
        with self.arena.lock:
            self.arena.caches.discard(self)
            if self.swapped is not None:  # its pages went back when it moved to the host
                self.swapped = None
                self.pool.swapped_bytes -= self.nbytes
            else:
                foreign = self.table[self.table != self.own].tolist()
                self.arena.unref(self.own.flatten().tolist() + foreign)
        self.pool._closed_session()

    def __del__(self):  # a stream dropped without closing still gives its pages back
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def begin(self, start: int, num_frames: int) -> PagedKVCache:
        if self._closed:
            raise RuntimeError("this KV cache was closed")
        self.resume()
        super().begin(start, num_frames)
        self._write_own(sorted({self.slot(f) for f in range(start, start + num_frames)}))
        return self

    def _table_changed(self) -> None:
        self._version += 1
        self._pages_key = self._pages = self._device_pages = None

    def pass_pages(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pages this pass writes ([rows * frames], row-major) and the pages it reads ([rows * visible], the
        contiguous cache's order), on the host. Taken from the table once a pass, not once a layer, and kept for the
        next pass over the same frames (a block's steps) while the table is unchanged (`_table_changed`: this
        cache's copy-on-write in begin(), a lender's, a resume)."""
        start, end = self._pass
        key = (start, end, self._version)
        if self._pages_key != key:
            slots = [self.slot(f) for f in range(start, end)]
            self._pages = (self.table[:, slots].flatten(), self.table[:, :min(end, self.spec.slots)].flatten())
            self._device_pages, self._pages_key = None, key
        return self._pages

    def _pass_device_pages(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        pages = self.pass_pages()
        if self._device_pages is None or self._device_pages[0].device != device:
            self._device_pages = _to_device(pages, device)
        return self._device_pages

    @classmethod
    def group_pass(cls, caches: list[KVCache]) -> _PagedGroupPass | None:
        """One index_copy_ and one index_select a layer for a group of caches of one arena (see KVCacheGroup)."""
        if len(caches) > 1 and all(type(c) is cls and c.arena is caches[0].arena for c in caches):
            return _PagedGroupPass(caches)
        return None

    def _write_own(self, slots: list[int]) -> None:
        """Copy-on-write before `slots` are written: the pages of those slots become this cache's alone, with the
        keys/values they held (a pass that fails before writing them all leaves the frames as they were)."""
        arena = self.arena
        if not self._foreign:  # the table is the extent: nothing borrowed, only pages lent to forks to take back
            with arena.lock:
                refs = arena.refs
                lent = [row[s] for row in self._own_rows for s in slots if refs[row[s]] > 1]
                dropped = arena.unshare(lent, self) if lent else 0
            if dropped:
                self.pool.changed()
            return
        idx = torch.tensor(slots, dtype=torch.long)
        with arena.lock:
            current, own = self.table[:, idx], self.own[:, idx]
            mine = current == own
            lent = [p for p in current[mine].tolist() if arena.refs[p] > 1]
            dropped = arena.unshare(lent, self) if lent else 0  # forks keep their copy of the old frames
            borrowed = ~mine
            if borrowed.any():  # pages of another cache: take the extent's page of the slot, with their data
                src, dst = current[borrowed], own[borrowed]
                arena.copy(src, dst)
                self.table[:, idx] = own
                self._table_changed()
                self._foreign -= int(borrowed.sum())
                arena.unref(src.tolist())
                dropped += len(src)
        if dropped:
            self.pool.changed()

    # -- host memory under pressure ----------------------------------------------------------------------
    def swap_out(self) -> bool:
        """Move this idle cache's pages to host memory and give them back to the pool (a higher-priority stream
        needs them); False when it cannot go now (running, shared with a fork, already out)."""
        arena = self.arena
        with arena.lock:
            if (self._closed or not self.idle or self._pass is not None or self.swapped is not None or self._foreign
                    or any(arena.refs[p] != 1 for p in self.own.flatten().tolist())):
                return False
            idx = self.own.flatten().to(arena.keys.device)
            platform = platform_for(arena.keys.device)
            keys, values = arena.keys.index_select(1, idx), arena.values.index_select(1, idx)
            self.swapped = (platform.pinned(keys), platform.pinned(values))
            arena.caches.discard(self)
            arena.unref(self.own.flatten().tolist())
            self.pool.swaps += 1
            self.pool.swapped_bytes += self.nbytes
        return True

    def resume_need(self) -> PageNeed | None:
        """What coming back from host memory asks of the pool (None: the cache is resident)."""
        if self.swapped is None:
            return None
        return self.pool.need(self.arena, self.spec.batch_size * self.spec.slots, caches=0)

    @torch.inference_mode()
    def resume(self, grant: tuple[list[int], bool] | None = None) -> None:
        """Back from host memory, if it went there: new pages (`grant`, the pool's answer to `resume_need`; None:
        this thread waits for the pool's room like a new stream, never an out-of-memory error), the keys/values
        copied back. A no-op for a resident cache."""
        self.idle = False
        if self.swapped is None:
            return
        rows, slots = self.spec.batch_size, self.spec.slots
        if grant is None:
            grant = self.pool.take(self.arena, rows * slots, self.priority, self.cancel, caches=0)
        pages, _ = grant
        arena = self.arena
        with arena.lock:
            idx = torch.tensor(pages, dtype=torch.long)
            keys, values = self.swapped
            arena.keys.index_copy_(1, idx.to(arena.keys.device), keys.to(arena.keys.device))
            arena.values.index_copy_(1, idx.to(arena.keys.device), values.to(arena.keys.device))
            self.own = idx.view(rows, slots)
            self._own_rows = self.own.tolist()
            self.base = pages[0] if pages == list(range(pages[0], pages[0] + len(pages))) else None
            self.table = self.own.clone()
            self._table_changed()
            self.swapped = None
            arena.caches.add(self)
            self.pool.swapped_bytes -= self.nbytes

    def _resident(self) -> None:
        """Back from the host if it went there, still idle if it was (a fork or an export of a parked cache)."""
        idle = self.idle
        self.resume()
        self.idle = idle

    def reset(self) -> None:
        super().reset()
        if self._foreign:
            with self.arena.lock:
                self.arena.unref(self.table[self.table != self.own].tolist())
                self.table = self.own.clone()
                self._table_changed()
                self._foreign = 0
            self.pool.changed()

    @property
    def nbytes(self) -> int:
        return self.spec.batch_size * self.spec.slots * self.arena.page_bytes

    @property
    def keys(self) -> list[torch.Tensor]:
        """Per layer, the slots' keys [rows, slots * tokens_per_frame, heads, head_dim] (a copy when gathered)."""
        return [self._read(self.arena.keys[i], self.spec.slots) for i in range(self.spec.num_layers)]

    @property
    def values(self) -> list[torch.Tensor]:
        return [self._read(self.arena.values[i], self.spec.slots) for i in range(self.spec.num_layers)]

    def _read(self, layer: torch.Tensor, visible: int, pages: torch.Tensor | None = None) -> torch.Tensor:
        """The `visible` slots' keys (or values) of one layer of the arena: a view of the extent when the table is
        the extent in slot order, else the pages gathered (`pages`: the table's, already on the layer's device)."""
        rows, slots = self.spec.batch_size, self.spec.slots
        tpf, heads, dim = self.arena.page_shape
        if self._foreign == 0 and self.base is not None:
            extent = layer[self.base:self.base + rows * slots].view(rows, slots * tpf, heads, dim)
            return extent[:, :visible * tpf]
        if pages is None:
            pages = self.table[:, :visible].flatten().to(layer.device)
        return layer.index_select(0, pages).view(rows, visible * tpf, heads, dim)

    # -- data ----------------------------------------------------------------------------------------------
    @torch.compiler.disable
    def _write_and_read(self, index: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self._pass
        tpf = self.spec.tokens_per_frame
        rows = self.spec.batch_size
        if k.shape[1] != (end - start) * tpf:
            raise InvalidInputError(f"pass over {end - start} frames of {tpf} tokens got {k.shape[1]} key tokens")
        arena = self.arena
        with arena.lock:
            keys, values = arena.keys[index], arena.values[index]
            written, read = self._pass_device_pages(keys.device)
            frames = end - start
            kp = k.reshape(rows, frames, tpf, *k.shape[2:]).flatten(0, 1).to(keys.device, keys.dtype)
            vp = v.reshape(rows, frames, tpf, *v.shape[2:]).flatten(0, 1).to(keys.device, keys.dtype)
            keys.index_copy_(0, written, kp)
            values.index_copy_(0, written, vp)
            visible = min(end, self.spec.slots)
            k_all, v_all = self._read(keys, visible, read), self._read(values, visible, read)
        if self.offload:
            k_all = k_all.to(self.device, non_blocking=True)
            v_all = v_all.to(self.device, non_blocking=True)
        return k_all, v_all

    # -- snapshots -----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def export(self) -> dict[str, Any]:
        """Everything needed to rebuild this cache: the written slots' keys/values [layers, rows, slots*tpf, h, d]
        (on the CPU) and where the cache stands."""
        self._resident()
        written = min(self.end_frame, self.spec.slots)
        with self.arena.lock:
            keys = torch.stack([self._read(self.arena.keys[i], written) for i in range(self.spec.num_layers)])
            values = torch.stack([self._read(self.arena.values[i], written) for i in range(self.spec.num_layers)])
        return {"spec": self.spec.__dict__.copy(), "dtype": str(self.dtype).removeprefix("torch."),
                "end_frame": self.end_frame, "keys": keys.cpu(), "values": values.cpu()}

    @torch.inference_mode()
    def load(self, data: dict[str, Any]) -> None:
        """Fill a fresh cache (same spec) from `export`'s data."""
        same = ("num_layers", "batch_size", "num_heads", "head_dim", "tokens_per_frame", "window_frames", "sink_frames")
        if any(data["spec"][k] != getattr(self.spec, k) for k in same):
            raise InvalidInputError(f"this snapshot's KV cache has the shape {data['spec']}, this model makes "
                                    f"{self.spec.__dict__}")
        written = data["keys"].shape[2] // self.spec.tokens_per_frame
        if written > self.spec.slots or int(data["end_frame"]) > (self.spec.capacity_frames
                                                                 if self.spec.window_frames is None else 1 << 62):
            raise InvalidInputError(f"the snapshot's KV cache holds {data['end_frame']} frames; this cache has room "
                                    f"for {self.spec.slots}")
        if written != min(int(data["end_frame"]), self.spec.slots):
            raise InvalidInputError(f"the snapshot's KV cache holds {written} frames of keys but says it has "
                                    f"{data['end_frame']} frames")
        if self._closed or self._pass is not None:
            raise RuntimeError("load() into a closed KV cache or during a pass")
        tpf = self.spec.tokens_per_frame
        rows = self.spec.batch_size
        if written:
            self._write_own(list(range(written)))
        with self.arena.lock:
            pages = self.table[:, :written].flatten().to(self.arena.keys.device)
            for i in range(self.spec.num_layers):
                for store, src in ((self.arena.keys, data["keys"]), (self.arena.values, data["values"])):
                    part = src[i].reshape(rows, written, tpf, *src.shape[3:]).flatten(0, 1)
                    store[i].index_copy_(0, pages, part.to(store.device, store.dtype))
        self.end_frame = int(data["end_frame"])


def _to_device(pages: tuple[torch.Tensor, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Host index tensors on `device` in one copy that does not wait for the device's queued work (a plain copy from
    pageable memory synchronises the stream: once a layer, it kept the host from running ahead of the device)."""
    if device.type == "cpu":
        return pages
    return platform_for(device).to_device(torch.cat(pages), device).split([len(p) for p in pages])


class _PagedGroupPass:
    """A KVCacheGroup's pass over caches of one arena: their pages joined once a pass, then one index_copy_ (keys,
    values) and one index_select a layer for every cache together, instead of each cache's own copies and reads and a
    concatenation. Every written page belongs to its writer alone (copy-on-write in begin()), so writing all before
    reading any reads what each cache alone would: the same tensors as the per-cache path, bit for bit."""

    def __init__(self, caches: list[PagedKVCache]):
        self.caches = caches
        self.arena = caches[0].arena
        self._of: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._device_pages: tuple[torch.Tensor, torch.Tensor] | None = None

    def pages(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        per_cache = [c.pass_pages() for c in self.caches]
        if self._device_pages is None or any(a is not b for a, b in zip(per_cache, self._of)):
            self._of = per_cache
            self._device_pages = _to_device((torch.cat([w for w, _ in per_cache]), torch.cat([r for _, r in per_cache])),
                                            device)
        return self._device_pages

    @torch.compiler.disable
    def write_and_read(self, index: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        first = self.caches[0]
        start, end = first._pass
        tpf, heads, dim = self.arena.page_shape
        if k.shape[1] != (end - start) * tpf:
            raise InvalidInputError(f"pass over {end - start} frames of {tpf} tokens got {k.shape[1]} key tokens")
        rows, frames, visible = k.shape[0], end - start, min(end, first.spec.slots)
        with self.arena.lock:
            keys, values = self.arena.keys[index], self.arena.values[index]
            written, read = self.pages(keys.device)
            keys.index_copy_(0, written, k.reshape(rows * frames, tpf, *k.shape[2:]).to(keys.device, keys.dtype))
            values.index_copy_(0, written, v.reshape(rows * frames, tpf, *v.shape[2:]).to(keys.device, keys.dtype))
            k_all = keys.index_select(0, read).view(rows, visible * tpf, heads, dim)
            v_all = values.index_select(0, read).view(rows, visible * tpf, heads, dim)
        if first.offload:
            k_all = k_all.to(first.device, non_blocking=True)
            v_all = v_all.to(first.device, non_blocking=True)
        return k_all, v_all
