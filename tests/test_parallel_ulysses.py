"""Ulysses sequence parallelism on gloo: 2 and 4 CPU processes, each attending on its sequence shard, must give
unsharded attention (self and cross, lengths that do and do not divide, masks); heads that do not divide are a
clear error; shard_sequence / gather_sequence round-trip."""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from composer.errors import ConfigError, InvalidInputError
from composer.models.attention.backends import resolve_backend, run_attention
from composer.parallel.ulysses import UlyssesAttention, gather_sequence, shard_sequence
from composer.testing.distributed import SpawnTimeout, spawn


def _spawn(worker, world_size: int, *args) -> None:
    try:
        spawn(worker, world_size, *args, timeout_s=90)
    except SpawnTimeout as exc:
        pytest.fail(str(exc))


def _sdpa():
    return functools.partial(run_attention, resolve_backend("sdpa"))


def _reference(q, k, v, mask=None):
    return _sdpa()(q, k, v, mask)


def _check_self(world_size: int, seq_len: int, mask: torch.Tensor | None = None) -> None:
    gen = torch.Generator().manual_seed(1000 + seq_len)
    q, k, v = (torch.randn(2, seq_len, 4, 8, generator=gen) for _ in range(3))  # every rank draws the same
    expected = _reference(q, k, v, mask)

    shards = [shard_sequence(x, None) for x in (q, k, v)]
    pad = shards[0][1]
    assert pad == (-seq_len) % world_size
    local = UlyssesAttention(None, _sdpa())(*(s for s, _ in shards), attn_mask=mask, full_len=seq_len)

    expected_local, _ = shard_sequence(expected, None)
    torch.testing.assert_close(local, expected_local, atol=1e-5, rtol=0)
    torch.testing.assert_close(gather_sequence(local, None, seq_len), expected, atol=1e-5, rtol=0)


def _check_cross(world_size: int, seq_len: int, text_len: int, mask: torch.Tensor | None = None) -> None:
    gen = torch.Generator().manual_seed(2000 + seq_len)
    q = torch.randn(2, seq_len, 4, 8, generator=gen)
    k, v = (torch.randn(2, text_len, 4, 8, generator=gen) for _ in range(2))  # the text: whole on every rank
    expected = _reference(q, k, v, mask)

    q_local, _ = shard_sequence(q, None)
    local = UlyssesAttention(None, _sdpa(), role="cross")(q_local, k, v, attn_mask=mask, full_len=seq_len)
    torch.testing.assert_close(gather_sequence(local, None, seq_len), expected, atol=1e-5, rtol=0)


def _attention_worker(rank: int, world_size: int) -> None:
    # lengths: divisible by 2 and 4 (8), by neither (7, 5), and shorter than the degree (3)
    for seq_len in (8, 7, 5, 3):
        _check_self(world_size, seq_len)
    for seq_len in (8, 7):
        _check_cross(world_size, seq_len, text_len=5)

    # a per-head boolean mask (every row keeps its diagonal, so none is fully masked) is sliced to local heads
    gen = torch.Generator().manual_seed(3)
    mask = (torch.rand(2, 4, 7, 7, generator=gen) > 0.5) | torch.eye(7, dtype=torch.bool)
    _check_self(world_size, 7, mask)
    # a text-padding mask shared by the heads: the last two text tokens of sample 1 are padding
    text_mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    text_mask[1, ..., 3:] = False
    _check_cross(world_size, 7, 5, text_mask)


def _errors_worker(rank: int, world_size: int) -> None:
    ulysses = UlyssesAttention(None, _sdpa())
    q = torch.randn(1, 2, 3, 8)  # 3 heads divide by neither 2 nor 4
    with pytest.raises(ConfigError, match="3 heads do not divide by the sequence-parallel degree"):
        ulysses(q, q, q)
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(InvalidInputError, match="full_len"):
        ulysses(q, q, q, full_len=2 * world_size + 1)


def _round_trip_worker(rank: int, world_size: int) -> None:
    x = torch.arange(2 * 7 * 3, dtype=torch.float32).reshape(2, 7, 3)
    for dim in (1, 2):
        local, pad = shard_sequence(x, None, dim=dim)
        length = x.shape[dim]
        shard_len = -(-length // world_size)
        assert pad == shard_len * world_size - length
        assert local.shape[dim] == shard_len
        start = rank * shard_len
        real = max(0, min(shard_len, length - start))  # positions of this shard that are not padding
        torch.testing.assert_close(local.narrow(dim, 0, real), x.narrow(dim, start, real), atol=0, rtol=0)
        assert not local.narrow(dim, real, shard_len - real).any()  # the padding is zeros
        torch.testing.assert_close(gather_sequence(local, None, length, dim=dim), x, atol=0, rtol=0)
    with pytest.raises(InvalidInputError, match="full_len"):
        gather_sequence(local, None, 0, dim=2)


def _failing_worker(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 fails before the collective")
    dist.barrier()  # rank 0 would wait here for rank 1 forever without the harness's handling


def _all_checks_worker(rank: int, world_size: int) -> None:
    # one process group per degree for every check: starting P interpreters costs far more than the checks
    _attention_worker(rank, world_size)
    _errors_worker(rank, world_size)
    _round_trip_worker(rank, world_size)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ulysses_equals_unsharded_attention_with_clear_errors_and_round_trip(world_size):
    """Attention (self, cross, masks, any length), the heads / length errors and shard-gather, on P ranks."""
    _spawn(_all_checks_worker, world_size)


def test_failing_rank_fails_the_test_without_hanging():
    # Which rank's error is reported races: rank 1's own, or rank 0's barrier seeing the peer's connection
    # close. Either way the test must fail at once, well inside the collective and join timeouts.
    start = time.monotonic()
    with pytest.raises(mp.ProcessRaisedException):
        _spawn(_failing_worker, 2)
    assert time.monotonic() - start < 30
