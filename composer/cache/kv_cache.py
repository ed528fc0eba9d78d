"""KVCache: preallocated self-attention keys/values for block-autoregressive video generation.

Frames are the unit of bookkeeping (a frame is `tokens_per_frame` tokens). Two layouts share one rule,
"frame f lives in slot slot(f)":

- global attention (`window_frames=None`): slot(f) = f, capacity = the longest rollout asked for;
- sink + rolling window (`window_frames=L`, `sink_frames=S`): the first S frames keep slots [0, S) for good,
  later frames cycle through the L - S slots after them: slot(f) = S + (f - S) mod (L - S).

A pass over frames [start, end) writes their keys/values into their slots, then attends to every slot
written so far: frames f < S and end - (L - S) <= f < end. Slots fill in order, so the visible slots are
always the contiguous prefix [0, min(end, L)) and attention reads a view, never a gather. Keys are stored
after RoPE (absolute frame positions), so the order of slots does not matter to attention.

A pass may append frames (start == the cache's end) or re-run the newest frames (end == the cache's end, as
every denoising step of a block does, and the final clean pass that leaves the block's keys in the cache);
either way the same frame goes to the same slot.

With `offload=True` the buffers live in (pinned) CPU memory and each layer's visible slots are copied to the
compute device for its attention: device memory for the cache drops to one layer's worth, at the cost of a
host-to-device copy per layer per pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from composer.errors import InvalidInputError
from composer.platform import platform_for


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of a cache. `window_frames=None` means global attention over `capacity_frames` frames."""

    num_layers: int
    batch_size: int
    num_heads: int
    head_dim: int
    tokens_per_frame: int
    capacity_frames: int
    window_frames: int | None = None
    sink_frames: int = 0

    def __post_init__(self):
        if self.window_frames is not None:
            if self.window_frames <= self.sink_frames:
                raise InvalidInputError(
                    f"local_attn_size ({self.window_frames} frames) must exceed sink_size ({self.sink_frames})"
                )
        elif self.sink_frames:
            raise InvalidInputError("sink_size needs a rolling window (local_attn_size > 0)")

    @property
    def slots(self) -> int:
        """Frames the buffers hold."""
        return self.window_frames if self.window_frames is not None else self.capacity_frames

    def nbytes(self, dtype: torch.dtype) -> int:
        """Memory of keys + values for all layers."""
        element = torch.empty((), dtype=dtype).element_size()
        per_layer = self.batch_size * self.slots * self.tokens_per_frame * self.num_heads * self.head_dim
        return 2 * self.num_layers * per_layer * element


class _LayerHandle:
    """What one transformer layer sees of the cache during a pass: `update(k, v)` -> visible (k, v)."""

    __slots__ = ("cache", "index")

    def __init__(self, cache: KVCache, index: int):
        self.cache = cache
        self.index = index

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache._write_and_read(self.index, k, v)


class KVCache:
    """Preallocated keys/values per layer, [batch, slots * tokens_per_frame, heads, head_dim] each."""

    def __init__(
        self, spec: KVCacheSpec, dtype: torch.dtype, device: torch.device | str, offload: bool = False
    ):
        self.spec = spec
        self.dtype = dtype
        self.device = torch.device(device)
        self.offload = offload  # on a CPU device the copies are no-ops, but the same code path runs
        storage = torch.device("cpu") if self.offload else self.device
        shape = (spec.batch_size, spec.slots * spec.tokens_per_frame, spec.num_heads, spec.head_dim)
        if self.offload:  # page-locked host memory where the device has it, so copies to it are asynchronous
            host = platform_for(self.device)
            self.keys = [host.empty_host(shape, dtype) for _ in range(spec.num_layers)]
            self.values = [host.empty_host(shape, dtype) for _ in range(spec.num_layers)]
        else:
            self.keys = [torch.zeros(shape, dtype=dtype, device=storage) for _ in range(spec.num_layers)]
            self.values = [torch.zeros(shape, dtype=dtype, device=storage) for _ in range(spec.num_layers)]
        self.end_frame = 0  # frames [0, end_frame) have been written
        self._pass: tuple[int, int] | None = None  # (start, end) of the pass in progress

    # -- bookkeeping -----------------------------------------------------------------------------
    def slot(self, frame: int) -> int:
        s = self.spec
        if s.window_frames is None:
            return frame
        if frame < s.sink_frames:
            return frame
        return s.sink_frames + (frame - s.sink_frames) % (s.window_frames - s.sink_frames)

    def visible_frames(self, end: int) -> list[int]:
        """The frames a pass ending at frame `end` attends to, in slot order."""
        s = self.spec
        if s.window_frames is None:
            return list(range(end))
        recent = range(max(s.sink_frames, end - (s.window_frames - s.sink_frames)), end)
        frames = list(range(min(end, s.sink_frames))) + list(recent)
        return sorted(frames, key=self.slot)

    def begin(self, start: int, num_frames: int) -> KVCache:
        """Position the cache on frames [start, start + num_frames) for the next forward pass."""
        end = start + num_frames
        s = self.spec
        if num_frames < 1:
            raise InvalidInputError(f"a pass needs at least one frame, got {num_frames}")
        if not (start == self.end_frame or end == self.end_frame):
            raise InvalidInputError(
                f"KV cache holds frames [0, {self.end_frame}); a pass over [{start}, {end}) must append "
                f"(start at {self.end_frame}) or re-run the newest frames (end at {self.end_frame})"
            )
        if s.window_frames is None and end > s.capacity_frames:
            raise InvalidInputError(
                f"KV cache was allocated for {s.capacity_frames} frames of global attention; frame {end - 1} "
                "does not fit (allocate more, or use local_attn_size for a rolling window)"
            )
        if s.window_frames is not None and end - max(start, s.sink_frames) > s.window_frames - s.sink_frames:
            raise InvalidInputError(
                f"frames [{start}, {end}) do not fit the rolling window of {s.window_frames - s.sink_frames} frames "
                f"(local_attn_size {s.window_frames} - sink_size {s.sink_frames}); make the window larger"
            )
        self._pass = (start, end)
        return self

    @contextmanager
    def pass_over(self, start: int, num_frames: int) -> Iterator[KVCache]:
        """`begin` .. `finish` around one forward pass; a pass that raises leaves the cache as it was."""
        self.begin(start, num_frames)
        try:
            yield self
        except BaseException:
            self.abort()
            raise
        self.finish()

    def finish(self) -> None:
        """Close the pass begun with `begin`: its frames now count as written."""
        if self._pass is None:
            raise RuntimeError("KVCache.finish() without begin()")
        self.end_frame = max(self.end_frame, self._pass[1])
        self._pass = None

    def abort(self) -> None:
        """Drop the pass begun with `begin` (its forward failed): nothing counts as written."""
        self._pass = None

    def reset(self) -> None:
        """Forget every frame (the buffers are reused, not cleared: unwritten slots are never read)."""
        self.end_frame = 0
        self._pass = None

    @classmethod
    def group_pass(cls, caches: list[KVCache]):
        """An object whose `write_and_read(index, k, v)` serves a KVCacheGroup's layer for all of `caches` at once,
        or None: each cache writes and reads its own rows (the contiguous cache has nothing better)."""
        return None

    def layer(self, index: int) -> _LayerHandle:
        if self._pass is None:
            raise RuntimeError("KVCache.layer() outside a pass: call begin(start, num_frames) first")
        return _LayerHandle(self, index)

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes(self.dtype)

    # -- data --------------------------------------------------------------------------------------
    def _token_slots(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """(first frame, first slot, frame count) runs of consecutive slots for frames [start, end)."""
        runs: list[tuple[int, int, int]] = []
        for frame in range(start, end):
            slot = self.slot(frame)
            if runs and runs[-1][1] + runs[-1][2] == slot:
                first, first_slot, count = runs[-1]
                runs[-1] = (first, first_slot, count + 1)
            else:
                runs.append((frame, slot, 1))
        return runs

    # Bookkeeping in Python ints (slots, runs): kept out of torch.compile graphs, so a compiled block does not
    # specialise on the frame position and recompile for every block.
    @torch.compiler.disable
    def _write_and_read(self, index: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self._pass
        tpf = self.spec.tokens_per_frame
        if k.shape[1] != (end - start) * tpf:
            raise InvalidInputError(
                f"pass over {end - start} frames of {tpf} tokens got {k.shape[1]} key tokens"
            )
        keys, values = self.keys[index], self.values[index]
        for frame, slot, count in self._token_slots(start, end):
            src = slice((frame - start) * tpf, (frame - start + count) * tpf)
            dst = slice(slot * tpf, (slot + count) * tpf)
            keys[:, dst].copy_(k[:, src], non_blocking=self.offload)
            values[:, dst].copy_(v[:, src], non_blocking=self.offload)
        visible = min(end, self.spec.slots) * tpf
        k_all, v_all = keys[:, :visible], values[:, :visible]
        if self.offload:
            k_all = k_all.to(self.device, non_blocking=True)
            v_all = v_all.to(self.device, non_blocking=True)
        return k_all, v_all


class KVCacheGroup:
    """Several requests' KV caches as one batch for a transformer call (the step scheduler batches causal passes):
    rows in cache order, each cache writing its own rows into its own slots. The caches must show the same frames
    for the pass (same layout, same end: `KVCacheGroup.signature`), so their visible keys stack along the batch."""

    def __init__(self, caches: list[KVCache]):
        self.caches = caches
        self.rows = [c.spec.batch_size for c in caches]
        self._fused = None  # during a pass: the caches' own way to serve every cache at once (PagedKVCache's), if any

    @staticmethod
    def signature(cache: KVCache, start: int, num_frames: int) -> tuple:
        """What must be equal for two caches' passes over [start, start + num_frames) to share a call."""
        s = cache.spec
        end = start + num_frames
        return (s.window_frames, s.sink_frames, s.tokens_per_frame, s.num_heads, s.head_dim, s.num_layers,
                min(end, s.slots), cache.dtype, str(cache.device), cache.offload)

    @contextmanager
    def pass_over(self, start: int, num_frames: int) -> Iterator[KVCacheGroup]:
        """Every cache's `pass_over`: all of them finish, or (the call raised) all of them abort."""
        from contextlib import ExitStack

        with ExitStack() as stack:
            for cache in self.caches:
                stack.enter_context(cache.pass_over(start, num_frames))
            kind = type(self.caches[0])
            self._fused = kind.group_pass(self.caches) if all(type(c) is kind for c in self.caches) else None
            try:
                yield self
            finally:
                self._fused = None

    def layer(self, index: int) -> _GroupLayerHandle:
        return _GroupLayerHandle(self, index)


class _GroupLayerHandle:
    __slots__ = ("group", "index")

    def __init__(self, group: KVCacheGroup, index: int):
        self.group = group
        self.index = index

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.group._fused is not None:
            return self.group._fused.write_and_read(self.index, k, v)
        rows = self.group.rows
        seen = [cache._write_and_read(self.index, kp, vp)
                for cache, kp, vp in zip(self.group.caches, k.split(rows), v.split(rows))]
        return torch.cat([s[0] for s in seen]), torch.cat([s[1] for s in seen])
