"""Ring attention: the LSE merge against one softmax, and 2- and 4-rank gloo rings against single-process SDPA."""

from __future__ import annotations

import datetime
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from composer.errors import InvalidInputError
from composer.parallel.ring import RingAttention, block_attention, merge_partials

B, H, D = 2, 2, 8
JOIN_TIMEOUT_S = 120


def sdpa(q, k, v, mask=None):
    """Single-process reference on [B, S, H, D] tensors."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask).transpose(1, 2)


def block_causal(seq: int, block: int) -> torch.Tensor:
    """[S, S] mask: a token sees every token of its own and earlier blocks (the causal model's shape)."""
    blocks = torch.arange(seq) // block
    return blocks[:, None] >= blocks[None, :]


def qkv(seq: int, seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, seq, H, D, generator=gen).to(dtype) for _ in range(3)]


# (name, shard lengths per world size, mask kind); a length list not divisible evenly is a ragged shard
CASES = {
    2: [("even", [6, 6], None), ("even-causal", [6, 6], "causal"), ("ragged", [4, 3], None),
        ("ragged-causal", [4, 3], "causal"), ("empty-shard", [3, 0], "causal"), ("padded", [4, 4], "padded")],
    4: [("even", [3, 3, 3, 3], None), ("even-causal", [3, 3, 3, 3], "causal"), ("ragged", [3, 3, 3, 1], None),
        ("ragged-causal", [3, 3, 2, 2], "causal"), ("padded", [2, 2, 2, 2], "padded")],
}


def make_mask(kind: str | None, seq: int) -> torch.Tensor | None:
    if kind is None:
        return None
    if kind == "causal":
        return block_causal(seq, block=2)
    # the sequence was padded to a multiple of the ranks: the last key is padding, masked out for every query
    mask = block_causal(seq, block=3)
    mask[:, -1] = False
    mask[-1, -1] = True  # the padding query must see something for SDPA to be defined; its output is dropped
    return mask


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    try:
        torch.set_num_threads(1)
        ring = RingAttention(dist.group.WORLD)
        results = {}
        for i, (name, lengths, kind) in enumerate(CASES[world]):
            seq = sum(lengths)
            q, k, v = qkv(seq, seed=i)
            start, stop = sum(lengths[:rank]), sum(lengths[:rank + 1])
            mask = make_mask(kind, seq)
            rows = mask[start:stop] if mask is not None else None
            shards = [t[:, start:stop] for t in (q, k, v)]
            results[name] = ring(*shards, attn_mask=rows)
        # a bf16 shard comes back bf16, and the fp32 merge keeps it at bf16 accuracy
        q, k, v = qkv(8, seed=99, dtype=torch.bfloat16)
        per = 8 // world
        results["bf16"] = ring(*[t[:, rank * per:(rank + 1) * per] for t in (q, k, v)])
        if world == 4:
            # a ring over a sub-group: peers are group ranks, mapped to global ranks for the exchange
            sub = dist.new_group([1, 3])  # every rank takes part in creating it
            if rank in (1, 3):
                q, k, v = qkv(5, seed=42)
                start, stop = (0, 3) if rank == 1 else (3, 5)
                ring_sub = RingAttention(sub)
                results["subgroup"] = ring_sub(*[t[:, start:stop] for t in (q, k, v)],
                                               attn_mask=block_causal(5, 2)[start:stop])
        torch.save(results, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ring(world: int, out_dir: str) -> list[dict]:
    """Spawn `world` gloo ranks; a rank that fails or hangs fails the test instead of hanging it."""
    ctx = mp.spawn(_worker, args=(world, _free_port(), out_dir), nprocs=world, join=False)
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"ring attention with {world} ranks did not finish in {JOIN_TIMEOUT_S} s")
    finally:
        for process in ctx.processes:
            if process.is_alive():
                process.kill()
    return [torch.load(f"{out_dir}/rank{r}.pt") for r in range(world)]


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # quick tier: 2 ranks
def test_ring_attention_matches_single_process_sdpa(world, tmp_path):
    results = run_ring(world, str(tmp_path))
    for i, (name, lengths, kind) in enumerate(CASES[world]):
        seq = sum(lengths)
        q, k, v = qkv(seq, seed=i)
        mask = make_mask(kind, seq)
        expected = sdpa(q, k, v, mask)
        got = torch.cat([r[name] for r in results], dim=1)
        assert got.shape == expected.shape and got.dtype == torch.float32, name
        if kind == "padded":  # the padding query's row is not part of the answer
            got, expected = got[:, :-1], expected[:, :-1]
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    if world == 4:
        q, k, v = qkv(5, seed=42)
        got = torch.cat([results[1]["subgroup"], results[3]["subgroup"]], dim=1)
        torch.testing.assert_close(got, sdpa(q, k, v, block_causal(5, 2)), atol=1e-5, rtol=1e-5)
    q, k, v = qkv(8, seed=99, dtype=torch.bfloat16)
    got = torch.cat([r["bf16"] for r in results], dim=1)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), sdpa(q.float(), k.float(), v.float()), atol=2e-2, rtol=2e-2)


def _merged(q, k, v, mask, bounds):
    out = lse = None
    for start, stop in bounds:
        block = block_attention(q, k[:, start:stop], v[:, start:stop], mask[..., start:stop])
        out, lse = block if out is None else merge_partials(out, lse, *block)
    return out.transpose(1, 2), lse


def test_lse_merge_equals_one_softmax_with_fully_masked_blocks():
    """Merging per-block partials gives the full softmax, exactly, also where a row sees no key of a block
    (lse -inf for that block) and where a whole block is masked for every row."""
    q, k, v = qkv(10, seed=3)
    mask = block_causal(10, block=2)
    mask[:, 6:8] = False  # keys 6-7 visible to no query: a fully masked block
    bounds = [(0, 3), (3, 6), (6, 8), (8, 10)]
    out, lse = _merged(q, k, v, mask, bounds)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out, sdpa(q, k, v, mask), atol=1e-6, rtol=1e-6)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / D**0.5
    torch.testing.assert_close(lse, torch.logsumexp(scores.masked_fill(~mask, float("-inf")), -1))
    # the order blocks arrive in (each rank's ring order differs) does not change the result
    reordered, _ = _merged(q, k, v, mask, bounds[2:] + bounds[:2])
    torch.testing.assert_close(reordered, out, atol=1e-6, rtol=1e-6)


def test_block_attention_row_with_no_visible_key_weighs_nothing():
    q, k, v = qkv(4, seed=5)
    mask = torch.zeros(4, 4, dtype=torch.bool)
    out, lse = block_attention(q, k, v, mask)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    merged, merged_lse = merge_partials(out, lse, out, lse)
    assert torch.equal(merged, out) and torch.isneginf(merged_lse).all()


def test_fused_block_attention_equals_the_explicit_scores():
    """The fused kernel (torch's flash attention with its log-sum-exp, on CPU here) gives the explicit fp32
    computation's output and LSE, masked rows included; an empty key block gives (0, -inf) without a kernel."""
    from composer.parallel.ring import _explicit

    q, k, v = qkv(6, seed=7)
    mask = torch.rand(6, 6, generator=torch.Generator().manual_seed(0)) > 0.4
    mask[2] = False  # a row that sees nothing
    for m in (None, mask, mask[0:1]):
        out, lse = block_attention(q, k, v, m)
        ref_out, ref_lse = _explicit(*(t.transpose(1, 2) for t in (q, k, v)), m, D ** -0.5)
        torch.testing.assert_close(out, ref_out, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(lse, ref_lse, atol=1e-6, rtol=1e-6)
    out, lse = block_attention(q, k[:, :0], v[:, :0])
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_ring_attention_rejects_a_mask_not_over_the_full_key_sequence():
    """Checked before any exchange: a single-rank gloo group is enough."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        q, k, v = qkv(4, seed=0)
        ring = RingAttention()
        with pytest.raises(InvalidInputError, match="full_kv"):
            ring(q, k, v, attn_mask=torch.ones(4, 3, dtype=torch.bool))
        with pytest.raises(InvalidInputError, match="boolean"):
            ring(q, k, v, attn_mask=torch.zeros(4, 4))
        with pytest.raises(InvalidInputError, match="heads"):
            ring(q, k[:, :, :1], v[:, :, :1])
        # one rank: the ring is plain attention
        torch.testing.assert_close(ring(q, k, v, attn_mask=block_causal(4, 2)), sdpa(q, k, v, block_causal(4, 2)))
    finally:
        dist.destroy_process_group()
