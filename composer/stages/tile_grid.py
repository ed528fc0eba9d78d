"""The tile grids of the exact tiled VAE decode and encode (vae_tiling.py: the Wan VAE; vae_tiling_hunyuan.py:
HunyuanVideo's): spans of a side and the tiles of a frame. Plain arithmetic, shared by both."""

from __future__ import annotations

import math


def _spans(size: int, tile: int) -> list[tuple[int, int]]:
    """[start, end) spans of at most `tile` covering `size`, as even as possible."""
    count = max(1, math.ceil(size / tile))
    edges = [round(i * size / count) for i in range(count + 1)]
    return [(edges[i], edges[i + 1]) for i in range(count)]


def _tiles(height: int, width: int, step: int, at_least: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The (row span, column span) tiles of a height x width grid, at most `step` a side, and at least `at_least` of
    them (smaller tiles along the longer side until there are: every rank of a split decode gets one)."""
    rows, cols = _spans(height, step), _spans(width, step)
    while len(rows) * len(cols) < at_least and (len(rows) < height or len(cols) < width):
        if (len(cols) < width and width / len(cols) >= height / len(rows)) or len(rows) >= height:
            cols = _spans(width, -(-width // (len(cols) + 1)))
        else:
            rows = _spans(height, -(-height // (len(rows) + 1)))
    return [(r, c) for r in rows for c in cols]


def _aligned_spans(size: int, tile: int, align: int) -> list[tuple[int, int]]:
    """[start, end) spans of about `tile` covering `size`, every edge a multiple of `align` (the last at `size`)."""
    count = max(1, math.ceil(size / tile))
    edges = sorted({min(size, round(i * size / count / align) * align) for i in range(count)} | {size})
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]
