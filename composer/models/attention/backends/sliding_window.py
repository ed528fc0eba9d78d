"""Spatio-temporal sliding-window self-attention ("neighbourhood" / sliding-tile style) for video DiTs.

Each query token attends to the keys in a window of frames x rows x cols around it on the latent token grid
(tokens frame-major: index = f * rows * cols + r * cols + c). Near an edge the window slides inward, so every
query sees exactly min(window, grid) positions per axis; a window covering the grid is exact dense attention.

Computed with `torch.nn.attention.flex_attention` (compiled) and a BlockMask built once per (grid, window,
device) and shared by every layer. flex_attention skips whole 128 x 128 blocks of (query, key) pairs, and in
frame-major order a 128-token block is a strip of rows that nearly every window touches; so, as sliding tile
attention does, tokens are reordered into tiles of TILE (1 frame x 8 rows x 16 cols) before the call and put
back after it: a block is then a compact patch and a window skips most of them. Where flex_attention cannot run (no compiler, unsupported head size...) the
same boolean mask goes to SDPA, said once in the log.

A compiled kernel is checked, not trusted: the first call of each (grid, window, device, dtype, shape) compares
flex_attention's output with SDPA under the same boolean mask (every query row up to 4096 tokens, a strided
sample of rows beyond) and, if they differ or the output is not finite, that shape runs on SDPA from then on, said
once in the log. This is not hypothetical: torch 2.13's inductor CPU flex_attention kernel, vectorised for AVX2
(processors without AVX-512, or ATEN_CPU_CAPABILITY=avx2), returns a wrong first query row for a 72-token
sequence, while AVX-512 gives the right one. On the CPU the backend uses SDPA with the mask by default anyway
(compiled flex_attention is slower than SDPA there at every measured size, docs/sparse-attention.md);
`Backend(window, flex="always")` forces the flex path (tests use it). Only self-attention over a whole grid takes it: the model
passes the token grid for its full passes; cross-attention, KV-cached and sequence-parallel passes get none
and run on SDPA (`unusable_reason`).
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
import torch.nn.functional as F

from composer.logging import get_logger, log_once
from composer.models.attention.backends._base import Capabilities

logger = get_logger(__name__)

Grid = tuple[int, int, int]
TILE = (1, 8, 16)  # frames, rows, cols: 128 tokens, flex_attention's block size
_MAX_CACHED = 8
_block_masks: OrderedDict[tuple, object] = OrderedDict()  # (grid, window, device) -> BlockMask
_dense_masks: OrderedDict[tuple, torch.Tensor] = OrderedDict()  # same key -> [S, S] bool (SDPA fallback)
_flex_failed: str | None = None  # why compiled flex_attention failed here, once per process
_flex_checked: dict[tuple, bool] = {}  # (grid, window, device, dtype, q shape) -> flex output matched SDPA's
_CHECK_ALL_ROWS = 4096  # up to this many query tokens every row is checked, a strided sample beyond
_CHECK_SAMPLE = 512
block_mask_builds = 0  # how many BlockMasks were built in this process (tests pin the caching)


def default_window(grid: Grid) -> Grid:
    """Every frame x half of each spatial side (rounded up)."""
    frames, rows, cols = grid
    return frames, math.ceil(rows / 2), math.ceil(cols / 2)


def resolve_window(grid: Grid, window: tuple[int, ...] | None) -> Grid:
    """The window actually used on `grid`: the default when unset, each side clipped to the grid's."""
    wanted = default_window(grid) if window is None else window
    return tuple(min(int(w), n) for w, n in zip(wanted, grid, strict=True))  # type: ignore[return-value]


def _axis_visible(q: torch.Tensor, k: torch.Tensor, size: int, width: int) -> torch.Tensor:
    # the window [start, start + width) centred on q, slid inside [0, size)
    start = torch.clamp(torch.clamp(q - width // 2, max=size - width), min=0)
    return (k >= start) & (k < start + width)


def tile_order(grid: Grid, device: torch.device | str = "cpu") -> torch.Tensor:
    """Token indices (frame-major) listed tile by tile: position i of the tiled sequence holds token order[i]."""
    frames, rows, cols = grid
    f, r, c = torch.meshgrid(*(torch.arange(n) for n in grid), indexing="ij")
    tf, tr, tc = TILE
    tiles_r, tiles_c = -(-rows // tr), -(-cols // tc)
    tile = ((f // tf) * tiles_r + r // tr) * tiles_c + c // tc
    within = ((f % tf) * tr + r % tr) * tc + c % tc
    return torch.argsort((tile * math.prod(TILE) + within).flatten()).to(device)


def window_mask_mod(grid: Grid, window: Grid, order: torch.Tensor | None = None):
    """flex_attention mask_mod: True where query token q_idx may attend to key token kv_idx (positions in the
    tiled sequence when `order` is given, frame-major token indices otherwise)."""
    frames, rows, cols = grid
    wf, wr, wc = window
    per_frame = rows * cols

    def mask_mod(batch, head, q_idx, kv_idx):
        if order is not None:
            q_idx, kv_idx = order[q_idx], order[kv_idx]
        return (_axis_visible(q_idx // per_frame, kv_idx // per_frame, frames, wf)
                & _axis_visible(q_idx // cols % rows, kv_idx // cols % rows, rows, wr)
                & _axis_visible(q_idx % cols, kv_idx % cols, cols, wc))

    return mask_mod


def window_mask(grid: Grid, window: tuple[int, ...] | None, device: torch.device | str = "cpu") -> torch.Tensor:
    """The [S, S] boolean mask (True: attend) of the window on `grid`: the dense equivalent of the BlockMask."""
    resolved = resolve_window(grid, window)
    tokens = torch.arange(math.prod(grid), device=device)
    return window_mask_mod(grid, resolved)(None, None, tokens[:, None], tokens[None, :])


def _cached(cache: OrderedDict, key: tuple, build):
    if key not in cache:
        if len(cache) >= _MAX_CACHED:
            cache.popitem(last=False)
        cache[key] = build()
    return cache[key]


def block_mask(grid: Grid, window: Grid, device: torch.device):
    """(BlockMask over the tiled sequence, tile order, its inverse, compiled flex_attention) for (grid, window,
    device), built once and reused by every layer and step. Each entry compiles its own flex_attention: one
    compiled function for every mask would reach dynamo's recompile limit (8) and silently run eagerly."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: PLC0415

    def build():
        global block_mask_builds
        block_mask_builds += 1
        seq = math.prod(grid)
        order = tile_order(grid, device)
        mask = create_block_mask(window_mask_mod(grid, window, order), None, None, seq, seq, device=str(device))
        return mask, order, torch.argsort(order), torch.compile(flex_attention, dynamic=False)

    return _cached(_block_masks, (grid, window, str(device)), build)


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2


def _check_rows(seq: int, device: torch.device) -> torch.Tensor:
    if seq <= _CHECK_ALL_ROWS:
        return torch.arange(seq, device=device)
    step = seq / _CHECK_SAMPLE
    return torch.unique(torch.tensor([int(i * step) for i in range(_CHECK_SAMPLE)] + [seq - 1], device=device))


def flex_matches_sdpa(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grid: Grid,
                      window: Grid) -> tuple[bool, str]:
    """Whether flex_attention's `out` [B, H, S, D] equals SDPA under the window's boolean mask on the checked
    query rows (q, k, v [B, H, S, D], frame-major tokens); with the largest difference found."""
    rows = _check_rows(q.shape[2], q.device)
    tokens = torch.arange(q.shape[2], device=q.device)
    mask = window_mask_mod(grid, window)(None, None, rows[:, None], tokens[None, :])
    ref = F.scaled_dot_product_attention(q[:, :, rows], k, v, attn_mask=mask)
    got = out[:, :, rows]
    if not torch.isfinite(got).all():
        return False, "non-finite values"
    diff = (got.float() - ref.float()).abs().max().item()
    scale = max(1.0, ref.float().abs().max().item())
    return diff <= _tolerance(q.dtype) * scale, f"max abs diff {diff:.3g} against SDPA"


class Backend:
    name = "sliding_window"
    priority = -10  # approximate attention: never chosen by `auto`, only by name
    capabilities = Capabilities(exact=False)

    def __init__(self, window: tuple[int, ...] | None = None, flex: str = "auto"):
        if flex not in ("auto", "always", "never"):
            raise ValueError(f"flex = {flex!r}: expected 'auto' (not on the CPU), 'always' or 'never'")
        self.window = None if window is None else tuple(window)
        self.flex = flex

    @classmethod
    def load(cls) -> Backend:
        try:
            import torch.nn.attention.flex_attention  # noqa: F401, PLC0415
        except ImportError as exc:
            raise ImportError("torch.nn.attention.flex_attention is missing (torch >= 2.5 needed)") from exc
        return cls()

    def with_window(self, window: tuple[int, ...] | None) -> Backend:
        """This backend with `window` (frames, rows, cols); None: every frame x half of each side."""
        return Backend(window, self.flex)

    def unusable_reason(self, query: torch.Tensor, attn_mask: torch.Tensor | None,
                        token_grid: Grid | None = None) -> str | None:
        if token_grid is None:
            return "no token grid: cross-attention, a KV-cached or a sequence-parallel pass"
        if attn_mask is not None:
            return "an attention mask is given"
        if query.shape[1] != math.prod(token_grid):
            return f"{query.shape[1]} query tokens for a {token_grid} grid"
        return None

    def _wants_flex(self, device: torch.device) -> bool:
        if self.flex == "auto" and device.type == "cpu":
            log_once(logger, "sliding_window:cpu", "sliding_window on the CPU runs as SDPA with the window's boolean "
                     "mask (the same result; compiled flex_attention is slower there)")
            return False
        return self.flex != "never" and _flex_failed is None

    def _flex(self, q, k, v, grid: Grid, window: Grid) -> torch.Tensor | None:
        """flex_attention's output [B, H, S, D], or None where it failed or did not match SDPA for this shape."""
        global _flex_failed
        key = (grid, window, str(q.device), q.dtype, tuple(q.shape))
        if _flex_checked.get(key) is False:
            return None
        try:
            mask, order, inverse, flex = block_mask(grid, window, q.device)
            out = flex(q[:, :, order], k[:, :, order], v[:, :, order], block_mask=mask)[:, :, inverse]
        except Exception as exc:  # noqa: BLE001 - any compile/kernel failure: the dense path is exact
            _flex_failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            log_once(logger, "sliding_window:flex", f"flex_attention is unusable here ({_flex_failed}): "
                     "sliding_window attention runs as SDPA with a dense boolean mask (same result, no saving)")
            return None
        if key not in _flex_checked:
            ok, how = flex_matches_sdpa(out, q, k, v, grid, window)
            _flex_checked[key] = ok
            if not ok:
                logger.warning("compiled flex_attention gave a wrong result for the %s grid, window %s, %s %s (%s): "
                               "this shape runs as SDPA with the window's boolean mask instead", grid, window,
                               q.device, str(q.dtype).removeprefix("torch."), how)
                return None
        return out

    def __call__(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
        token_grid: Grid | None = None,
    ) -> torch.Tensor:
        grid = tuple(token_grid)  # type: ignore[arg-type]
        window = resolve_window(grid, self.window)
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        if self._wants_flex(query.device):
            out = self._flex(q, k, v, grid, window)
            if out is not None:
                return out.transpose(1, 2)
        mask = _cached(_dense_masks, (grid, window, str(query.device)),
                       lambda: window_mask(grid, window, query.device))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
