"""3D rotary position embedding (frames, rows, columns) on interleaved channel pairs, as Wan uses it."""

from __future__ import annotations

import torch


def rope_axis_dims(head_dim: int) -> tuple[int, int, int]:
    """How a head's channels split between the frame, height and width axes (Wan's rule)."""
    h = w = 2 * (head_dim // 6)
    return head_dim - h - w, h, w


def rope_frequencies(
    head_dim: int,
    grid: tuple[int, int, int],
    frame_offset: int = 0,
    theta: float = 10000.0,
    device: torch.device | None = None,
    axis_dims: tuple[int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [1, F*H*W, 1, head_dim // 2] for a token grid of (frames, rows, cols).

    Angles are computed in float64 and rounded to fp32 once. `frame_offset` shifts frame positions (a block
    of frames that starts at an absolute frame index). `axis_dims`: the channels of each axis when the model
    states them (HunyuanVideo's `rope_axes_dim`); default Wan's rule, `rope_axis_dims(head_dim)`.
    """
    frames, rows, cols = grid
    axis_cos, axis_sin = [], []
    dims = rope_axis_dims(head_dim) if axis_dims is None else axis_dims
    for dim, length, offset in zip(dims, grid, (frame_offset, 0, 0)):
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        angles = torch.outer(torch.arange(offset, offset + length, dtype=torch.float64), inv_freq)
        axis_cos.append(angles.cos().float())
        axis_sin.append(angles.sin().float())

    def grid_table(per_axis: list[torch.Tensor]) -> torch.Tensor:
        f, h, w = per_axis
        table = torch.cat(
            [
                f.view(frames, 1, 1, -1).expand(frames, rows, cols, -1),
                h.view(1, rows, 1, -1).expand(frames, rows, cols, -1),
                w.view(1, 1, cols, -1).expand(frames, rows, cols, -1),
            ],
            dim=-1,
        )
        return table.reshape(1, frames * rows * cols, 1, -1).to(device)

    return grid_table(axis_cos), grid_table(axis_sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of x [B, S, H, D] by the angles behind cos/sin [1, S, 1, D/2].

    The product is taken in fp32 (cos/sin are fp32) and cast back to x's dtype.
    """
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2).type_as(x)
