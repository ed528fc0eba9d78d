"""KVCache bookkeeping: slots, re-runs, the sink, end indices, visibility, memory, errors."""

from __future__ import annotations

import pytest
import torch

from composer.cache import KVCache, KVCacheSpec
from composer.errors import InvalidInputError

TPF = 3  # tokens per frame


def make(window=None, sink=0, capacity=12, layers=2):
    spec = KVCacheSpec(num_layers=layers, batch_size=1, num_heads=2, head_dim=4, tokens_per_frame=TPF,
                       capacity_frames=capacity, window_frames=window, sink_frames=sink)
    return KVCache(spec, torch.float32, "cpu")


def frame_kv(start, end, tag=0.0):
    """k/v whose every entry holds its frame index (+ tag), so slots can be read back as frame numbers."""
    frames = torch.arange(start, end, dtype=torch.float32).repeat_interleave(TPF) + tag
    k = frames.view(1, -1, 1, 1).expand(1, -1, 2, 4).clone()
    return k, -k


def run_pass(cache, start, end, tag=0.0):
    cache.begin(start, end - start)
    k, v = frame_kv(start, end, tag)
    out = [cache.layer(i).update(k, v) for i in range(cache.spec.num_layers)]
    cache.finish()
    return out[0]


def frames_seen(k):
    return sorted(set(k[0, :, 0, 0].tolist()))


def test_global_slots_and_visibility():
    cache = make()
    k, v = run_pass(cache, 0, 3)
    assert frames_seen(k) == [0, 1, 2] and torch.equal(v, -k)
    k, _ = run_pass(cache, 3, 6)
    assert frames_seen(k) == list(range(6)) and cache.end_frame == 6


def test_rerunning_the_newest_block_writes_the_same_slots():
    cache = make(window=5, sink=1)
    for start in (0, 2, 4, 6):
        run_pass(cache, start, start + 2, tag=0.5)  # a denoising step (noisy keys)
        before = [t.clone() for t in cache.keys]
        run_pass(cache, start, start + 2)  # the clean pass over the same frames
        changed = [(b != a).any(dim=(0, 2, 3)).nonzero().flatten().tolist() for b, a in zip(before, cache.keys)]
        slots = sorted(cache.slot(f) for f in (start, start + 1))
        expected_tokens = [s * TPF + t for s in slots for t in range(TPF)]
        assert changed[0] == expected_tokens and changed[1] == expected_tokens
        assert cache.end_frame == start + 2


def test_sink_never_changes_and_window_rolls():
    cache = make(window=5, sink=1)
    run_pass(cache, 0, 2)
    sink = cache.keys[0][:, :TPF].clone()
    for start in range(2, 20, 2):
        k, _ = run_pass(cache, start, start + 2)
        end = start + 2
        assert torch.equal(cache.keys[0][:, :TPF], sink)
        expected = sorted({0, *range(max(0, end - 4), end)})  # f < 1 or end-(5-1) <= f < end
        assert frames_seen(k) == expected
        assert sorted(cache.visible_frames(end)) == expected


def test_window_without_sink():
    cache = make(window=4)
    for start in range(0, 12, 2):
        k, _ = run_pass(cache, start, start + 2)
        assert frames_seen(k) == list(range(max(0, start - 2), start + 2))


def test_slot_formula():
    cache = make(window=6, sink=2)
    assert [cache.slot(f) for f in range(12)] == [0, 1, 2, 3, 4, 5, 2, 3, 4, 5, 2, 3]


def test_passes_must_append_or_rerun_the_newest_frames():
    cache = make()
    run_pass(cache, 0, 3)
    with pytest.raises(InvalidInputError, match="must append"):
        cache.begin(5, 2)  # skips frames 3 and 4
    with pytest.raises(InvalidInputError, match="must append"):
        cache.begin(0, 2)  # rewrites an old frame
    run_pass(cache, 1, 3)  # re-running the newest frames is fine


def test_global_capacity_and_window_fit_errors():
    with pytest.raises(InvalidInputError, match="allocated for 4 frames"):
        make(capacity=4).begin(0, 5)
    with pytest.raises(InvalidInputError, match="do not fit the rolling window of 2 frames"):
        make(window=3, sink=1).begin(0, 4)
    with pytest.raises(InvalidInputError, match="must exceed sink_size"):
        make(window=2, sink=2)
    with pytest.raises(InvalidInputError, match="sink_size needs a rolling window"):
        make(sink=1)


def test_layer_outside_a_pass_is_an_error():
    cache = make()
    with pytest.raises(RuntimeError, match="outside a pass"):
        cache.layer(0)


def test_reset_starts_over_and_memory_matches_the_buffers():
    cache = make(window=5, sink=1, layers=3)
    run_pass(cache, 0, 2)
    cache.reset()
    assert cache.end_frame == 0
    k, _ = run_pass(cache, 0, 1)
    assert frames_seen(k) == [0]
    actual = sum(t.numel() * t.element_size() for t in cache.keys + cache.values)
    assert cache.nbytes == actual == 2 * 3 * 5 * TPF * 2 * 4 * 4
    assert cache.spec.nbytes(torch.bfloat16) == actual // 2
