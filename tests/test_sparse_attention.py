"""Sliding-window attention (`attention_backend = sliding_window`): exact dense attention under a window covering
the grid, SDPA with the equivalent boolean mask under a smaller one; one BlockMask per (grid, window, device);
cross-attention, masked and KV-cached passes stay on SDPA; the knob's checks; a tiny Wan video."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from composer import VideoGenerator
from composer.errors import ConfigError
from composer.models.attention import Attention, resolve_backend
from composer.models.attention.backends import sliding_window
from composer.models.attention.backends.sliding_window import resolve_window, window_mask
from composer.runtime import RuntimeArgs


def _sdpa(q, k, v, mask=None):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=mask).transpose(1, 2)


def _qkv(grid, heads=2, head_dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, math.prod(grid), heads, head_dim, generator=g) for _ in range(3)]


def _backend(window):
    """The backend with its compiled flex_attention path forced (on the CPU `auto` uses SDPA with the mask)."""
    return sliding_window.Backend(window, flex="always")


def _brute_force_mask(grid, window):
    """Reference: the window slid inside the grid, axis by axis, with Python loops."""
    f, h, w = grid
    sizes = [min(a, n) for a, n in zip(window, grid, strict=True)]

    def span(i, n, size):
        start = max(0, min(i - size // 2, n - size))
        return range(start, start + size)

    coords = [(a, b, c) for a in range(f) for b in range(h) for c in range(w)]
    mask = torch.zeros(len(coords), len(coords), dtype=torch.bool)
    for qi, (a, b, c) in enumerate(coords):
        for ki, (x, y, z) in enumerate(coords):
            mask[qi, ki] = x in span(a, f, sizes[0]) and y in span(b, h, sizes[1]) and z in span(c, w, sizes[2])
    return mask


@pytest.mark.parametrize("grid, window", [((3, 4, 6), (1, 3, 3)), ((2, 5, 3), (2, 2, 4)), ((4, 3, 7), (3, 1, 2))])
def test_the_mask_is_the_window_slid_inside_the_grid(grid, window):
    assert torch.equal(window_mask(grid, window), _brute_force_mask(grid, window))


@pytest.mark.parametrize("grid", [pytest.param((3, 4, 6), marks=pytest.mark.slow),
                                  pytest.param((2, 7, 5), marks=pytest.mark.slow), (1, 3, 9)])  # compiles: 10-30 s each
def test_a_window_covering_the_grid_is_dense_attention(grid):
    q, k, v = _qkv(grid)
    for window in (grid, (9, 99, 99)):  # exactly the grid, and larger than it (clipped)
        out = _backend(window)(q, k, v, token_grid=grid)
        assert (out - _sdpa(q, k, v)).abs().max() <= 1e-5


@pytest.mark.parametrize("grid, window", [((3, 8, 12), (1, 3, 5)),
                                          pytest.param((5, 6, 20), (3, 4, 4), marks=pytest.mark.slow),
                                          pytest.param((2, 17, 9), (2, 16, 3), marks=pytest.mark.slow)])
def test_a_smaller_window_is_sdpa_with_the_same_boolean_mask(grid, window):
    q, k, v = _qkv(grid, heads=3, head_dim=32, seed=1)
    out = _backend(window)(q, k, v, token_grid=grid)
    reference = _sdpa(q, k, v, window_mask(grid, window))
    assert (out - reference).abs().max() <= 1e-5
    assert (out - _sdpa(q, k, v)).abs().max() > 1e-3  # and the window does change the result


@pytest.mark.slow  # two compiled grids
def test_the_block_mask_is_built_once_per_grid_and_window():
    grid, window = (2, 6, 10), (1, 3, 3)
    q, k, v = _qkv(grid)
    backend = _backend(window)
    before = sliding_window.block_mask_builds
    for _ in range(3):
        backend(q, k, v, token_grid=grid)
    _backend(window)(q, k, v, token_grid=grid)  # another layer's instance shares the mask
    assert sliding_window.block_mask_builds == before + 1
    q2, k2, v2 = _qkv((2, 6, 8))
    backend(q2, k2, v2, token_grid=(2, 6, 8))
    assert sliding_window.block_mask_builds == before + 2


def test_on_the_cpu_auto_runs_sdpa_with_the_window_mask():
    grid, window = (2, 6, 10), (1, 3, 3)
    q, k, v = _qkv(grid)
    before = sliding_window.block_mask_builds
    out = resolve_backend("sliding_window").with_window(window)(q, k, v, token_grid=grid)
    assert sliding_window.block_mask_builds == before  # no flex_attention compiled
    assert torch.equal(out, _sdpa(q, k, v, window_mask(grid, window)))


def test_a_wrong_flex_result_is_caught_and_that_shape_runs_on_sdpa(monkeypatch, caplog):
    grid, window = (2, 3, 5), (1, 2, 2)
    q, k, v = _qkv(grid, seed=4)
    calls = []

    def broken_flex(q, k, v, block_mask):  # a kernel that gets one query row wrong (as inductor's AVX2 one did)
        calls.append(1)
        out = F.scaled_dot_product_attention(q, k, v)
        out[:, 0, 0] = 0.0
        return out

    real = sliding_window.block_mask
    monkeypatch.setattr(sliding_window, "block_mask",
                        lambda *a: (*real(*a)[:3], broken_flex))
    reference = _sdpa(q, k, v, window_mask(grid, window))
    with caplog.at_level("WARNING"):
        out = _backend(window)(q, k, v, token_grid=grid)
    assert torch.equal(out, reference)
    assert "gave a wrong result" in caplog.text and "(2, 3, 5) grid" in caplog.text
    assert _backend(window)(q, k, v, token_grid=grid).equal(reference)
    assert len(calls) == 1  # once found wrong, that shape no longer calls the kernel


@pytest.mark.slow
def test_the_result_does_not_depend_on_the_cpus_vector_width():
    """inductor's CPU flex_attention kernel vectorised for AVX2 (torch 2.13) returns a wrong first row for 72 tokens;
    run the backend with that kernel forced and check it still equals dense attention."""
    import subprocess
    import sys

    code = (
        "import math, torch, torch.nn.functional as F\n"
        "from composer.models.attention.backends.sliding_window import Backend\n"
        "grid = (3, 4, 6)\n"
        "g = torch.Generator().manual_seed(0)\n"
        "q, k, v = [torch.randn(1, math.prod(grid), 2, 16, generator=g) for _ in range(3)]\n"
        "out = Backend(grid, flex='always')(q, k, v, token_grid=grid)\n"
        "ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)\n"
        "print((out - ref).abs().max().item())\n"
    )
    runs = {}  # both at once (one thread each): most of each run is inductor compiling the kernel
    for isa in ("avx2", "default"):
        env = {**__import__("os").environ, "ATEN_CPU_CAPABILITY": isa, "OMP_NUM_THREADS": "1"}
        runs[isa] = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env)
    try:
        for isa, proc in runs.items():
            stdout, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, stderr[-2000:]
            assert float(stdout.strip().splitlines()[-1]) <= 1e-5, (isa, stdout, stderr[-2000:])
    finally:
        for proc in runs.values():
            proc.kill()


def test_the_default_window_is_every_frame_and_half_of_each_side():
    assert resolve_window((5, 30, 52), None) == (5, 15, 26)
    assert resolve_window((5, 7, 9), None) == (5, 4, 5)
    assert resolve_window((2, 3, 4), (8, 2, 9)) == (2, 2, 4)


def test_cross_attention_masks_and_kv_caches_stay_dense():
    grid = (2, 3, 4)
    q, k, v = _qkv(grid)
    backend = _backend((1, 1, 1))
    assert backend.unusable_reason(q, None, None) is not None  # no grid: cross-attention, KV cache, parallel
    assert "mask" in backend.unusable_reason(q, torch.ones(24, 24, dtype=torch.bool), grid)
    assert "query tokens" in backend.unusable_reason(q[:, :12], None, grid)
    assert backend.unusable_reason(q, None, grid) is None

    cross = Attention(role="cross", backend="sliding_window", window=[1, 1, 1])
    text_k, text_v = torch.randn(1, 7, 2, 16), torch.randn(1, 7, 2, 16)
    assert torch.allclose(cross(q, text_k, text_v, token_grid=grid), _sdpa(q, text_k, text_v), atol=1e-6)
    self_attn = Attention(role="self", backend="sliding_window", window=[1, 1, 1])
    assert torch.allclose(self_attn(q, k, v), _sdpa(q, k, v), atol=1e-6)  # no grid given: dense
    windowed = self_attn(q, k, v, token_grid=grid)
    assert torch.allclose(windowed, _sdpa(q, k, v, window_mask(grid, (1, 1, 1))), atol=1e-5)


def test_the_window_knob_is_checked():
    args = RuntimeArgs.from_kwargs(attention_backend="sliding_window", attention_window=["2", "8", "8"])
    assert args.attention_window == [2, 8, 8]
    with pytest.raises(ConfigError, match="three positive integers"):
        RuntimeArgs.from_kwargs(attention_backend="sliding_window", attention_window=[2, 0, 8])
    with pytest.raises(ConfigError, match="three positive integers"):
        RuntimeArgs.from_kwargs(attention_backend="sliding_window", attention_window=[2, 8])
    with pytest.raises(ConfigError, match="applies to attention_backend = sliding_window"):
        RuntimeArgs.from_kwargs(attention_backend="sdpa", attention_window=[2, 8, 8])


# tiny Wan: 9 frames of 48 x 80 -> a 3 x 3 x 5 token grid
REQUEST = dict(prompt="a red ball", negative_prompt="blurry", height=48, width=80, num_frames=9,
               num_inference_steps=4, guidance_scale=5.0, seed=3)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * math.log10(255**2 / mse)


def test_a_tiny_wan_video_with_the_backend(tiny_wan_dir, one_thread):
    def video(**runtime):
        gen = VideoGenerator.from_pretrained(tiny_wan_dir, dtype="fp32", progress=False, **runtime)
        return gen.generate_video(**REQUEST).frames

    dense = video(attention_backend="sdpa")
    full = video(attention_backend="sliding_window", attention_window=[3, 3, 5])
    small = video(attention_backend="sliding_window", attention_window=[1, 2, 2])
    assert np.abs(full.astype(int) - dense.astype(int)).max() <= 1
    assert np.isfinite(small.astype(float)).all() and np.abs(small.astype(int) - dense.astype(int)).max() > 1
    print(f"tiny Wan PSNR vs dense: full window {psnr(full, dense):.1f} dB, window 1x2x2 {psnr(small, dense):.1f} dB")
