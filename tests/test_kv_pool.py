"""KVPool / PagedKVCache (composer/cache/kv_pool.py): a paged cache returns KVCache's tensors bit for bit (global
attention, rolling windows with and without a sink, 2-row CFG-style caches, a fragmented arena, offload), rolling
windows reuse their pages, forks share pages copy-on-write, export/load round trips, admission (a waiting stream,
priorities, cancel, a request larger than the budget), kv_cache_memory validation, and concurrent streams through
the generator under a budget that fits two of them."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from composer.cache import KVCache, KVCacheSpec
from composer.cache.kv_pool import KVPool, PagedKVCache
from composer.cancel import CancelToken
from composer.errors import Cancelled, ConfigError, InvalidInputError

TPF = 3  # tokens per frame
HEADS, DIM, LAYERS = 2, 4, 2
F32 = torch.float32


def spec(window=None, sink=0, capacity=13, rows=1, layers=LAYERS):
    return KVCacheSpec(num_layers=layers, batch_size=rows, num_heads=HEADS, head_dim=DIM, tokens_per_frame=TPF,
                       capacity_frames=capacity, window_frames=window, sink_frames=sink)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def paged(s, pool, device="cpu", **kwargs):
    return PagedKVCache(s, F32, device, pool, **kwargs)


def frame_kv(start, end, tag=0.0, rows=1):
    """k/v whose every entry holds its frame index (+ tag, + 100 * row), so pages read back as frame numbers."""
    frames = torch.arange(start, end, dtype=F32).repeat_interleave(TPF) + tag
    k = torch.stack([frames + 100 * r for r in range(rows)]).view(rows, -1, 1, 1).expand(-1, -1, HEADS, DIM).clone()
    return k, -k


def run_pass(cache, start, end, tag=0.0):
    """One pass writing frame_kv into every layer; the visible keys of layer 0."""
    cache.begin(start, end - start)
    k, v = frame_kv(start, end, tag, cache.spec.batch_size)
    out = [cache.layer(i).update(k, v) for i in range(cache.spec.num_layers)]
    cache.finish()
    return out[0][0]


def seen(k, row=0):
    """The (frame + tag) values a pass saw, in slot order, for one row."""
    return [x - 100 * row for x in k[row, ::TPF, 0, 0].tolist()]


def blocks(start, end, block=2, steps=3):
    """(start, end) of a causal sampler's passes over frames [start, end): per block `steps` noisy passes over its
    frames (the first appends, the others re-run them) and the clean pass that leaves the block's keys."""
    return [(s, min(s + block, end)) for s in range(start, end, block) for _ in range(steps + 1)]


def sampler_passes(total, prefix=1):
    """A context prefill of `prefix` frames, then blocks up to frame `total`."""
    return [(0, prefix)] + blocks(prefix, total)


def same_passes(caches, passes, seed=0):
    """Run the same random k/v through every cache; assert each layer's visible (k, v) are torch.equal."""
    g = torch.Generator().manual_seed(seed)
    first = caches[0]
    for start, end in passes:
        for c in caches:
            c.begin(start, end - start)
        for i in range(first.spec.num_layers):
            shape = (first.spec.batch_size, (end - start) * TPF, HEADS, DIM)
            k, v = torch.randn(shape, generator=g).to(first.device), torch.randn(shape, generator=g).to(first.device)
            ref_k, ref_v = first.layer(i).update(k, v)
            for c in caches[1:]:
                got_k, got_v = c.layer(i).update(k, v)
                assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v), (start, end, i)
        for c in caches:
            c.finish()


def fragment(pool, s, offload=False, device="cpu"):
    """Fill `pool`'s arena for spec `s` (and `offload`) so that its free pages are enough for one cache of `s` but in no run long
    enough: four fillers of half an extent, the first and third closed. Returns the fillers still open."""
    extent = s.batch_size * s.slots
    half = (extent + 1) // 2
    fillers = [paged(spec(capacity=half), pool, device, offload=offload) for _ in range(4)]
    fillers[0].close()
    fillers[2].close()
    return [fillers[1], fillers[3]]


LAYOUTS = {"global": dict(window=None), "window": dict(window=5), "window+sink": dict(window=5, sink=1)}


# -- bit-identity with KVCache ------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fragmented", [False, True], ids=["contiguous", "fragmented"])
@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("rows", [1, 2], ids=["1row", "cfg2rows"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_paged_cache_returns_the_contiguous_caches_tensors(layout, rows, offload, fragmented, device):
    s = spec(rows=rows, **LAYOUTS[layout])
    pool = KVPool(device=device)
    keep = fragment(pool, s, offload, device) if fragmented else []
    cache = paged(s, pool, device, offload=offload)
    assert (cache.base is None) == fragmented  # a fragmented arena gives scattered pages: reads gather
    same_passes([KVCache(s, F32, device, offload=offload), cache], sampler_passes(13), seed=rows)
    assert cache.end_frame == 13
    for c in keep:
        c.close()
    cache.close()
    assert pool.stats().used_bytes == 0


def test_rolling_window_reuses_its_pages_and_the_sink_never_changes():
    pool = KVPool()
    cache = paged(spec(window=5, sink=1, rows=2, capacity=60), pool)
    run_pass(cache, 0, 1)
    arena = cache.arena
    sink_pages = cache.table[:, 0].tolist()
    sink_k = arena.keys[:, sink_pages].clone()
    sink_v = arena.values[:, sink_pages].clone()
    allocated = pool.stats().allocated_bytes
    for start in range(1, 60, 2):
        for tag in (0.5, 0.25, 0.0):  # noisy re-runs, then the clean pass
            k = run_pass(cache, start, start + 2, tag)
        expected = [0.0] + [float(f) for f in range(max(1, start + 2 - 4), start + 2)]
        assert sorted(seen(k)) == expected and sorted(seen(k, row=1)) == expected
        assert arena.used == 2 * 5  # rows x window pages, however many frames went through
        assert torch.equal(arena.keys[:, sink_pages], sink_k) and torch.equal(arena.values[:, sink_pages], sink_v)
    assert pool.stats().used_bytes == 2 * 5 * arena.page_bytes == cache.nbytes
    assert pool.stats().allocated_bytes == allocated
    cache.close()


# -- fork ------------------------------------------------------------------------------------------------
def test_a_fork_shares_history_until_written_and_each_sees_its_own_new_frames():
    pool = KVPool()
    parent = paged(spec(capacity=8), pool)
    run_pass(parent, 0, 3)
    run_pass(parent, 3, 5)
    child = parent.fork()
    assert child.end_frame == 5
    assert pool.stats().shared_pages == 5 and pool.stats().sessions == 2
    assert seen(run_pass(child, 5, 6, tag=0.25)) == [0, 1, 2, 3, 4, 5.25]
    assert seen(run_pass(parent, 5, 6, tag=0.5)) == [0, 1, 2, 3, 4, 5.5]
    assert seen(run_pass(child, 6, 7, tag=0.25)) == [0, 1, 2, 3, 4, 5.25, 6.25]
    assert pool.stats().shared_pages == 5  # the history: written by neither
    page = parent.arena.page_bytes
    assert pool.stats().used_bytes == 2 * 8 * page  # two extents; the shared pages count once
    parent.close()
    child.close()
    assert pool.stats().used_bytes == 0 and pool.stats().shared_pages == 0 and pool.stats().sessions == 0


def test_rewriting_shared_frames_copies_them_for_the_other_side():
    """Re-running the newest frames (a block's next step) rewrites pages a fork shares: either side keeps the
    other's view intact, the parent (whose extent holds the pages) as well as the fork."""
    pool = KVPool()
    parent = paged(spec(capacity=8), pool)
    run_pass(parent, 0, 5)
    child = parent.fork()
    assert seen(run_pass(parent, 3, 5, tag=0.5)) == [0, 1, 2, 3.5, 4.5]  # the parent re-runs frames 3, 4
    assert seen(run_pass(child, 5, 6, tag=0.25)) == [0, 1, 2, 3, 4, 5.25]  # the fork still has the old ones
    assert pool.stats().shared_pages == 3
    assert seen(run_pass(child, 4, 6, tag=0.75)) == [0, 1, 2, 3, 4.75, 5.75]
    assert seen(run_pass(parent, 5, 6)) == [0, 1, 2, 3.5, 4.5, 5]
    assert pool.stats().shared_pages == 3
    child.close()
    parent.close()
    assert pool.stats().used_bytes == 0


@pytest.mark.parametrize("writer", ["parent", "fork"])
def test_rolling_forks_keep_their_windows_apart(writer):
    """In a rolling window new frames overwrite the slots of frames that left it: pages the other side shares."""
    pool = KVPool()
    ref = KVCache(spec(window=4, sink=1, capacity=40), F32, "cpu")
    parent = paged(spec(window=4, sink=1, capacity=40), pool)
    same_passes([ref, parent], sampler_passes(7), seed=1)
    child = parent.fork()
    twin = KVCache(ref.spec, F32, "cpu")  # the fork's contiguous twin: a copy of the reference
    twin.keys, twin.values, twin.end_frame = [k.clone() for k in ref.keys], [v.clone() for v in ref.values], 7
    first, second = ((parent, ref), (child, twin)) if writer == "parent" else ((child, twin), (parent, ref))
    same_passes(list(first), blocks(7, 15), seed=2)  # frames 7..14 on one side
    same_passes(list(second), blocks(7, 11), seed=3)  # then frames 7..10 on the other
    same_passes(list(first), [(15, 16)] * 2, seed=4)
    child.close()
    parent.close()
    assert pool.stats().used_bytes == 0 and pool.stats().shared_pages == 0


def test_a_fork_outlives_its_parent_and_forks_of_forks_share_too():
    pool = KVPool()
    parent = paged(spec(capacity=6), pool)
    run_pass(parent, 0, 4)
    child = parent.fork()
    grandchild = child.fork()
    assert pool.stats().shared_pages == 4
    parent.close()  # its pages live on in the forks
    assert seen(run_pass(child, 4, 5, tag=0.5)) == [0, 1, 2, 3, 4.5]
    assert seen(run_pass(grandchild, 3, 4, tag=0.25)) == [0, 1, 2, 3.25]
    assert seen(run_pass(child, 5, 6)) == [0, 1, 2, 3, 4.5, 5]
    child.close()
    assert seen(run_pass(grandchild, 4, 6)) == [0, 1, 2, 3.25, 4, 5]
    grandchild.close()
    assert pool.stats().used_bytes == 0 and pool.stats().sessions == 0


def test_a_failed_pass_of_a_fork_leaves_its_shared_frames():
    pool = KVPool()
    parent = paged(spec(capacity=6), pool)
    run_pass(parent, 0, 4)
    child = parent.fork()
    with pytest.raises(RuntimeError, match="forward failed"):
        with child.pass_over(2, 2):
            raise RuntimeError("forward failed")  # before any layer wrote
    assert seen(run_pass(child, 4, 5)) == [0, 1, 2, 3, 4]
    assert seen(run_pass(parent, 4, 5, tag=0.5)) == [0, 1, 2, 3, 4.5]
    parent.close()
    child.close()
    assert pool.stats().used_bytes == 0


def test_fork_during_a_pass_or_of_a_closed_cache_is_an_error():
    pool = KVPool()
    cache = paged(spec(capacity=4), pool)
    cache.begin(0, 1)
    with pytest.raises(RuntimeError, match="during a pass"):
        cache.fork()
    cache.abort()
    cache.close()
    with pytest.raises(RuntimeError, match="closed"):
        cache.fork()
    with pytest.raises(RuntimeError, match="closed"):
        cache.begin(0, 1)
    assert pool.stats().used_bytes == 0


# -- export / load -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_group_of_paged_caches_reads_what_each_reads_alone(layout, offload, device):
    """KVCacheGroup over caches of one arena joins their pages once a pass and serves a layer with one index_copy_
    and one index_select: a fork reading shared history, a cache of scattered pages, 2-row caches and a plain one,
    each in a group equal to its contiguous twin alone, pass after pass (copy-on-write of the shared pages
    included)."""
    from composer.cache import KVCacheGroup
    from composer.cache.kv_pool import _PagedGroupPass

    pool = KVPool(device=device)
    s1, s2 = spec(**LAYOUTS[layout]), spec(rows=2, **LAYOUTS[layout])
    keep = fragment(pool, s2, offload, device)
    scattered = paged(s2, pool, device, offload=offload)
    assert scattered.base is None
    parent = paged(s1, pool, device, offload=offload)
    twin_parent = KVCache(s1, F32, device, offload=offload)
    same_passes([twin_parent, parent], sampler_passes(5), seed=5)
    child = parent.fork()
    twin_child = KVCache(s1, F32, device, offload=offload)
    twin_child.keys = [k.clone() for k in twin_parent.keys]
    twin_child.values = [v.clone() for v in twin_parent.values]
    twin_child.end_frame = 5
    plain = paged(s1, pool, device, offload=offload)
    twins = [KVCache(s, F32, device, offload=offload) for s in (s2, s1)]
    same_passes([twins[0], scattered], sampler_passes(5), seed=6)
    same_passes([twins[1], plain], sampler_passes(5), seed=7)
    members, alone = [child, scattered, parent, plain], [twin_child, twins[0], twin_parent, twins[1]]
    group = KVCacheGroup(members)
    g = torch.Generator().manual_seed(8)
    for start, end in blocks(5, 11):
        with group.pass_over(start, end - start):
            assert isinstance(group._fused, _PagedGroupPass)
            for c in alone:
                c.begin(start, end - start)
            for i in range(LAYERS):
                shape = (sum(group.rows), (end - start) * TPF, HEADS, DIM)
                k, v = torch.randn(shape, generator=g).to(device), torch.randn(shape, generator=g).to(device)
                got_k, got_v = group.layer(i).update(k, v)
                want = [c.layer(i).update(kp, vp) for c, kp, vp in zip(alone, k.split(group.rows), v.split(group.rows))]
                assert torch.equal(got_k, torch.cat([w[0] for w in want])), (start, end, i)
                assert torch.equal(got_v, torch.cat([w[1] for w in want])), (start, end, i)
            for c in alone:
                c.finish()
    assert [c.end_frame for c in members] == [11] * 4
    for c in [*members, *keep]:
        c.close()
    assert pool.stats().used_bytes == 0


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_export_load_round_trip_continues_identically(layout):
    s = spec(rows=2, **LAYOUTS[layout])
    original = paged(s, KVPool())
    same_passes([original], sampler_passes(9), seed=5)
    data = original.export()
    assert data["keys"].device.type == "cpu" and data["end_frame"] == 9
    pool = KVPool()
    fragment(pool, s)
    loaded = paged(s, pool)  # a fresh cache in another pool, scattered pages
    loaded.load(data)
    assert loaded.end_frame == 9
    for a, b in zip(original.keys + original.values, loaded.keys + loaded.values):
        assert torch.equal(a, b)
    same_passes([original, loaded], blocks(9, 13), seed=6)  # frames 9..12 on both
    assert torch.equal(loaded.export()["keys"], original.export()["keys"])


def test_load_refuses_a_snapshot_of_another_shape():
    original = paged(spec(window=5, sink=1), KVPool())
    run_pass(original, 0, 3)
    data = original.export()
    pool = KVPool()
    for other in (spec(window=5), spec(window=6, sink=1), spec(window=5, sink=1, rows=2), spec(window=5, sink=1,
                                                                                                 layers=3)):
        with pytest.raises(InvalidInputError, match="this snapshot's KV cache has the shape"):
            paged(other, pool).load(data)
    longer = paged(spec(capacity=6), pool)
    run_pass(longer, 0, 3)
    with pytest.raises(InvalidInputError, match="holds 3 frames; this cache has room for 2"):
        paged(spec(capacity=2), pool).load(longer.export())
    with pytest.raises(InvalidInputError, match="holds 3 frames of keys but says it has 2 frames"):
        paged(spec(capacity=6), pool).load(longer.export() | {"end_frame": 2})


# -- admission ------------------------------------------------------------------------------------------------
def extent_bytes(s):
    return s.nbytes(F32)


def in_thread(fn):
    """Run fn() on a thread; (thread, box) with box['result'] or box['error'] once it ends."""
    box = {}

    def target():
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


def wait_until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_stream_waits_for_pages_and_gets_them_when_another_closes():
    s = spec(capacity=4)
    pool = KVPool(2 * extent_bytes(s))
    a, b = paged(s, pool), paged(s, pool)
    thread, box = in_thread(lambda: paged(s, pool))
    thread.join(timeout=0.3)
    assert thread.is_alive() and not box  # blocked: the budget holds two
    stats = pool.stats()
    assert stats.waiting == 1 and stats.waits == 1 and stats.sessions == 2
    assert stats.used_bytes == stats.budget_bytes == 2 * extent_bytes(s)
    assert pool.position(thread) == 0 and pool.position() is None  # this thread is not waiting
    a.close()
    thread.join(timeout=10)
    assert not thread.is_alive() and "error" not in box
    third = box["result"]
    assert third.waited_s > 0.2
    assert seen(run_pass(third, 0, 2)) == [0, 1]
    stats = pool.stats()
    assert stats.waiting == 0 and stats.sessions == 2 and stats.peak_used_bytes == 2 * extent_bytes(s)
    b.close()
    third.close()
    assert pool.stats().used_bytes == 0


def test_waiters_are_admitted_by_priority_then_arrival():
    s = spec(capacity=4)
    pool = KVPool(extent_bytes(s))
    holder = paged(s, pool)
    admitted = []

    def wait(name, priority):
        cache = paged(s, pool, priority=priority)
        admitted.append(name)
        return cache

    low, low_box = in_thread(lambda: wait("low", 0))
    wait_until(lambda: pool.stats().waiting == 1)
    low2, low2_box = in_thread(lambda: wait("low2", 0))
    wait_until(lambda: pool.stats().waiting == 2)
    high, high_box = in_thread(lambda: wait("high", 5))  # made last, admitted first
    wait_until(lambda: pool.stats().waiting == 3)
    assert [pool.position(t) for t in (high, low, low2)] == [0, 1, 2]
    holder.close()
    high.join(timeout=10)
    assert admitted == ["high"] and low.is_alive() and low2.is_alive()
    high_box["result"].close()
    low.join(timeout=10)
    assert admitted == ["high", "low"] and low2.is_alive()
    low_box["result"].close()
    low2.join(timeout=10)
    assert admitted == ["high", "low", "low2"]
    low2_box["result"].close()
    assert pool.stats().used_bytes == 0 and pool.stats().waits == 3


def test_a_request_larger_than_the_budget_is_refused_at_once():
    s = spec(capacity=4)
    pool = KVPool(extent_bytes(s) - 1)
    start = time.monotonic()
    with pytest.raises(InvalidInputError, match="kv_cache_memory"):
        paged(s, pool)
    assert time.monotonic() - start < 1 and pool.stats().waiting == 0 and pool.stats().used_bytes == 0


def test_a_cancelled_waiter_raises_and_leaves_the_queue():
    s = spec(capacity=4)
    pool = KVPool(extent_bytes(s))
    holder = paged(s, pool)
    token = CancelToken()
    thread, box = in_thread(lambda: paged(s, pool, cancel=token))
    wait_until(lambda: pool.stats().waiting == 1)
    after, after_box = in_thread(lambda: paged(s, pool))  # behind the cancelled one
    wait_until(lambda: pool.stats().waiting == 2)
    token.cancel()
    thread.join(timeout=10)
    assert isinstance(box.get("error"), Cancelled)
    assert pool.stats().waiting == 1 and pool.position(after) == 0
    holder.close()
    after.join(timeout=10)
    assert "result" in after_box and pool.stats().used_bytes == extent_bytes(s)
    after_box["result"].close()
    assert pool.stats().used_bytes == 0 and pool.stats().sessions == 0


def test_a_fork_waits_for_its_extent_like_any_stream():
    s = spec(capacity=4)
    pool = KVPool(2 * extent_bytes(s))
    parent, other = paged(s, pool), paged(s, pool)
    run_pass(parent, 0, 2)
    thread, box = in_thread(parent.fork)
    wait_until(lambda: pool.stats().waiting == 1)
    other.close()
    thread.join(timeout=10)
    child = box["result"]
    assert seen(run_pass(child, 2, 3)) == [0, 1, 2] and pool.stats().shared_pages == 2
    child.close()
    # a parent closed while its fork waits: the fork cannot share what is gone
    other = paged(s, pool)
    thread, box = in_thread(parent.fork)
    wait_until(lambda: pool.stats().waiting == 1)
    parent.close()
    thread.join(timeout=10)
    assert isinstance(box.get("error"), RuntimeError) and "closed" in str(box["error"])
    other.close()
    assert pool.stats().used_bytes == 0 and pool.stats().sessions == 0


def test_a_fork_that_could_only_wait_for_its_own_parent_is_refused():
    s = spec(capacity=4)
    pool = KVPool(extent_bytes(s) * 3 // 2)
    parent = paged(s, pool)
    run_pass(parent, 0, 2)
    with pytest.raises(InvalidInputError, match="besides its parent's"):
        parent.fork()
    assert pool.stats().waiting == 0 and pool.stats().sessions == 1
    parent.close()


def test_kv_pool_budget_forms():
    assert KVPool(None).budget_bytes is None
    assert KVPool(1000000).budget_bytes == 1000000
    assert KVPool(2e9).budget_bytes == 2_000_000_000
    assert 0 < KVPool(0.5, "cpu").budget_bytes
    for bad in (0, -1, float("nan"), float("inf"), True, "x"):
        with pytest.raises(InvalidInputError, match="kv_cache_memory"):
            KVPool(bad)


@pytest.mark.parametrize("value, message", [
    (0, "kv_cache_memory = 0.0: expected a positive number of bytes, or a fraction in \\(0, 1\\]"),
    (-1, "kv_cache_memory = -1.0: expected a positive number of bytes"),
    (float("nan"), "kv_cache_memory = nan: expected a number of bytes, or a fraction in \\(0, 1\\]"),
    (float("inf"), "kv_cache_memory = inf: expected a number of bytes, or a fraction in \\(0, 1\\]"),
    ("x", "kv_cache_memory = 'x': expected float"),
    (True, "kv_cache_memory = True: expected float"),
    (1.5, "kv_cache_memory = 1.5: expected a whole number of bytes"),
])
def test_kv_cache_memory_must_be_bytes_or_a_fraction(value, message):
    from composer.runtime import RuntimeArgs

    with pytest.raises(ConfigError, match=message) as info:
        RuntimeArgs.from_kwargs(device="cpu", kv_cache_memory=value)
    assert "problems" not in str(info.value)  # one clear error, not the same one twice


@pytest.mark.parametrize("value", [0.5, 2e9, 1000000])
def test_kv_cache_memory_accepts_bytes_and_fractions(value):
    from composer.runtime import RuntimeArgs

    assert RuntimeArgs.from_kwargs(device="cpu", kv_cache_memory=value).kv_cache_memory == value


def test_a_requests_branch_caches_are_admitted_together():
    """Sequential CFG keeps one cache per branch: both are taken in one admission, so two requests can never each
    hold one branch's pages while both wait for the other's (they did, and waited forever)."""
    s = spec(capacity=4)
    pool = KVPool(3 * extent_bytes(s))
    first = PagedKVCache.several([s, s], F32, "cpu", pool)
    thread, box = in_thread(lambda: PagedKVCache.several([s, s], F32, "cpu", pool))
    wait_until(lambda: pool.stats().waiting == 1)
    thread.join(timeout=0.2)
    assert thread.is_alive() and pool.stats().used_bytes == 2 * extent_bytes(s)  # the waiter holds nothing
    first[0].close()
    thread.join(timeout=10)
    second = box["result"]
    assert pool.stats().sessions == 3 and pool.stats().used_bytes == 3 * extent_bytes(s)
    pages = [set(c.own.flatten().tolist()) for c in (first[1], *second)]
    assert not (pages[0] & pages[1]) and not (pages[0] & pages[2]) and not (pages[1] & pages[2])
    for i, cache in enumerate(second):
        assert seen(run_pass(cache, 0, 2, tag=0.5 * i)) == [0.5 * i, 1 + 0.5 * i]
    for cache in (first[1], *second):
        cache.close()
    assert pool.stats().used_bytes == 0 and pool.stats().sessions == 0


# -- through the generator ---------------------------------------------------------------------------------
PROMPTS = ["a red circle moving left", "a blue square moving right", "a green triangle moving up"]


def run_threads(fn, args_list):
    results, errors = {}, {}
    barrier = threading.Barrier(len(args_list))

    def target(key, *args):
        try:
            barrier.wait()
            results[key] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors[key] = exc

    threads = [threading.Thread(target=target, args=(a[0], *a), daemon=True) for a in args_list]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a stream hung"
    return results, errors


def stream(gen, i, **kw):
    s = gen.stream_video(PROMPTS[i], seed=i, **kw)
    return np.concatenate([c.frames for c in s]), s.stats


@pytest.fixture(scope="module")
def unlimited(one_thread):
    from composer import VideoGenerator

    return VideoGenerator.from_pretrained("shapes-causal", progress=False)


@pytest.mark.slow  # 4 s
def test_three_streams_under_a_budget_for_two_all_finish_as_alone(unlimited):
    from composer import VideoGenerator

    solo = {i: stream(unlimited, i, num_frames=17) for i in range(3)}
    need = solo[0][1].kv_cache_bytes
    assert need > 0 and all(stats.kv_cache_bytes == need for _, stats in solo.values())
    gen = VideoGenerator.from_pretrained("shapes-causal", progress=False, kv_cache_memory=2 * need)
    pool = gen.pipeline.stage("CausalDenoisingStage").kv_pool
    assert pool.budget_bytes == 2 * need
    results, errors = run_threads(lambda i: stream(gen, i, num_frames=17), [(i,) for i in range(3)])
    assert not errors, errors
    for i in range(3):  # the bar of tests/test_scheduler.py's concurrent streams: batching may reorder floats
        frames = results[i][0]
        assert frames.shape == solo[i][0].shape
        assert np.abs(frames.astype(np.int16) - solo[i][0].astype(np.int16)).max() <= 1
    stats = pool.stats()
    assert stats.waits >= 1  # the third stream waited for pages
    assert stats.peak_used_bytes == 2 * need and stats.used_bytes == 0 and stats.sessions == 0
    assert stats.waiting == 0


def test_a_keep_switch_under_a_budget_for_one_cache_does_not_wait_for_itself(unlimited):
    """A 'keep' prompt switch makes the next segment's cache from the old one: the old pages go back first (the
    keys/values pass through the host), so a budget that holds the larger of the two caches is enough (the
    stream used to wait forever for the pages it held itself)."""
    from composer import VideoGenerator

    kw = dict(seed=0, prompt_switch="keep")
    segments = [(PROMPTS[0], 2), (PROMPTS[1], 2)]
    s = unlimited.stream_video(segments, **kw)
    expected = np.concatenate([c.frames for c in s])
    gen = VideoGenerator.from_pretrained("shapes-causal", progress=False, kv_cache_memory=s.stats.kv_cache_bytes)
    results, errors = run_threads(lambda _: np.concatenate([c.frames for c in gen.stream_video(segments, **kw)]),
                                  [(0,)])
    assert not errors, errors
    assert np.array_equal(results[0], expected)
    pool = gen.pipeline.stage("CausalDenoisingStage").kv_pool
    assert pool.stats().waits == 0 and pool.stats().used_bytes == 0


def test_arenas_of_several_shapes_stay_within_the_budget():
    """Pages of another shape (streams of another resolution or model size) live in another arena: the free pages
    at an arena's end give their memory back when another arena needs it under the budget (without that, the
    arenas together held 1.7x the budget)."""
    small, large = spec(capacity=8), spec(capacity=8, layers=LAYERS + 1)
    budget = extent_bytes(large)
    pool = KVPool(budget)
    for s in (small, large, small, large):
        cache = paged(s, pool)
        assert seen(run_pass(cache, 0, 2)) == [0, 1]
        assert pool.stats().allocated_bytes <= budget
        cache.close()
    pool = KVPool(extent_bytes(small) + extent_bytes(large))
    held, dropped = paged(small, pool), paged(small, pool)  # the small arena grows to two extents
    run_pass(held, 0, 2)
    dropped.close()  # the end of its arena is free again
    other = paged(large, pool)
    assert pool.stats().allocated_bytes <= extent_bytes(small) + extent_bytes(large)
    assert seen(run_pass(held, 2, 3)) == [0, 1, 2]  # the live cache kept its pages through the trim
    held.close()
    other.close()


# -- host memory under pressure --------------------------------------------------------------------------------
def test_an_idle_lower_priority_cache_moves_to_the_host_for_a_higher_priority_stream():
    s = spec(capacity=4, rows=2)
    pool = KVPool(extent_bytes(s))  # room for one cache
    low = paged(s, pool, priority=0)
    run_pass(low, 0, 2, tag=0.5)
    before = low.export()
    low.idle = True  # its stream is suspended between blocks
    thread, box = in_thread(lambda: paged(s, pool, priority=1))
    thread.join(timeout=10)
    assert "error" not in box and not thread.is_alive()  # admitted without waiting for `low` to close
    high = box["result"]
    stats = pool.stats()
    assert stats.swaps == 1 and stats.swapped_bytes == extent_bytes(s) and stats.used_bytes == extent_bytes(s)
    assert seen(run_pass(high, 0, 2)) == [0, 1]
    # `low` comes back (waiting for room) when its stream goes on, with its keys and values as they were
    thread, box = in_thread(low.resume)
    thread.join(timeout=0.3)
    assert thread.is_alive()  # `high` holds the budget
    high.close()
    thread.join(timeout=10)
    assert "error" not in box and low.swapped is None and pool.stats().swapped_bytes == 0
    after = low.export()
    assert after["end_frame"] == before["end_frame"] and torch.equal(after["keys"], before["keys"])
    assert torch.equal(after["values"], before["values"])
    assert seen(run_pass(low, 2, 4)) == [0.5, 1.5, 2, 3]
    low.close()
    assert pool.stats().used_bytes == 0


def test_only_idle_caches_of_lower_priority_move_to_the_host():
    s = spec(capacity=4)
    for holder, waiter, idle in ((1, 0, True), (0, 0, True), (0, 1, False)):
        pool = KVPool(extent_bytes(s))
        held = paged(s, pool, priority=holder)
        run_pass(held, 0, 1)
        held.idle = idle
        thread, box = in_thread(lambda pool=pool, waiter=waiter: paged(s, pool, priority=waiter))
        thread.join(timeout=0.3)
        assert thread.is_alive() and pool.stats().swaps == 0, (holder, waiter, idle)  # it waits instead
        held.close()
        thread.join(timeout=10)
        box["result"].close()


def test_a_closed_swapped_cache_frees_nothing_twice():
    s = spec(capacity=4)
    pool = KVPool(extent_bytes(s))
    low = paged(s, pool)
    run_pass(low, 0, 1)
    low.idle = True
    high = paged(s, pool, priority=5)
    assert low.swapped is not None
    low.close()
    assert pool.stats().swapped_bytes == 0 and pool.stats().used_bytes == extent_bytes(s)
    high.close()
    assert pool.stats().used_bytes == 0


@pytest.mark.slow
def test_a_session_between_extends_lends_its_pages_to_a_higher_priority_stream(unlimited):
    """A 'keep' session holds its KV cache between extends; under a budget for one stream, a priority-1 stream
    moves that idle cache to host memory, runs to its end, and the session's next extend brings it back and
    continues exactly as the linear stream."""
    from composer import VideoGenerator

    kw = dict(seed=2, prompt_switch="keep")
    linear = np.concatenate([c.frames for c in unlimited.stream_video([(PROMPTS[0], 2), (PROMPTS[1], 2)], **kw)])
    other = unlimited.stream_video(PROMPTS[2], seed=4, num_frames=9)
    alone = np.concatenate([c.frames for c in other])
    gen = VideoGenerator.from_pretrained("shapes-causal", progress=False,
                                         kv_cache_memory=max(other.stats.kv_cache_bytes, 2 ** 20) * 4)
    pool = gen.pipeline.stage("CausalDenoisingStage").kv_pool
    with gen.open_session(**kw) as session:
        list(session.extend(PROMPTS[0], 2))
        held = pool.stats().used_bytes
        assert held > 0
        pool.budget_bytes = max(held, other.stats.kv_cache_bytes)  # room for the new stream only without it
        results, errors = run_threads(
            lambda _: np.concatenate([c.frames for c in gen.stream_video(PROMPTS[2], seed=4, num_frames=9,
                                                                          priority=1)]), [(0,)])
        assert not errors, errors
        assert np.array_equal(results[0], alone)
        assert pool.stats().swaps == 1
        pool.budget_bytes = None
        list(session.extend(PROMPTS[1], 2))
        assert np.array_equal(session.frames, linear)
    assert pool.stats().used_bytes == 0 and pool.stats().swapped_bytes == 0


def test_the_pool_benchmark_runs_and_finds_the_same_tensors(capsys):
    """benchmarks/kv_pool.py --tiny (the GPU suite's kv-pool part at CPU size): contiguous, paged view and paged
    gather give identical keys/values, and the table is printed."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "kv_pool.py"
    spec_ = importlib.util.spec_from_file_location("kv_pool_bench", path)
    module = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(module)
    assert module.main(["--tiny", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "| paged, scattered (gather) |" in out and "identical to the contiguous cache's: True" in out
