"""Ring attention: exact attention over a sequence sharded across the ranks of a process group.

Each rank holds a contiguous shard of q, k, v ([batch, seq_shard, heads, head_dim]). The K/V shards travel
round the ring (P - 1 steps: send to the next rank, receive from the previous one), and each rank attends its
queries to every visiting block. A block gives a partial output and its log-sum-exp; the partials are merged
exactly in fp32 (out = sum_i exp(lse_i - lse) out_i, lse = logsumexp_i lse_i). A block's kernel and its LSE come
from the attention backend registry (a backend declaring `lse` in its capabilities), never from private kernel
calls here; the explicit fp32 scores are the fallback and the reference.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from composer.errors import InvalidInputError
from composer.logging import get_logger

logger = get_logger(__name__)


def block_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    backend=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `query` [B, Sq, H, D] to one key block [B, Sk, H, D], with its log-sum-exp.

    Returns (out [B, H, Sq, D], lse [B, H, Sq]), both fp32. `attn_mask` is boolean (True: attend) and
    broadcasts to [B, H, Sq, Sk]. A row that may see no key of the block has lse = -inf and out = 0, so that
    it weighs nothing in the merge. The kernel comes from the attention backend registry: `backend`'s own
    `attention_with_lse` where its capabilities declare one and take the inputs (flash-attn), else SDPA's fused
    kernels (no [Sq, Sk] score matrix); where no kernel takes them, the scores are computed explicitly in fp32.
    """
    from composer.models.attention.backends import attention_with_lse

    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if key.shape[1] == 0 or query.shape[1] == 0:  # an empty shard (fused kernels fail on it): nothing to attend
        out = query.new_zeros((query.shape[0], query.shape[2], query.shape[1], query.shape[3]), dtype=torch.float32)
        return out, torch.full(out.shape[:3], float("-inf"), device=query.device)
    fused = attention_with_lse(backend, query, key, value, attn_mask, scale)
    if fused is not None:
        out, lse = fused
        out = out.transpose(1, 2)
        if attn_mask is not None:  # kernels give fully masked rows lse 0 (or NaN): make them weigh nothing
            seen = attn_mask.any(dim=-1).expand(lse.shape)
            lse = torch.where(seen, lse, torch.full_like(lse, float("-inf")))
            out = torch.where(seen.unsqueeze(-1), out, torch.zeros_like(out))
        return out, lse
    return _explicit(*(t.transpose(1, 2) for t in (query, key, value)), attn_mask, scale)


def _explicit(q, k, v, attn_mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: scores in fp32, masked, exponentiated against their log-sum-exp."""
    q, k, v = q.float(), k.float(), v.float()
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    # exp(-inf - (-inf)) is NaN: subtract 0 on fully masked rows instead, where every exp(-inf) is already 0.
    safe_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(scores - safe_lse.unsqueeze(-1))
    return torch.matmul(probs, v), lse


def merge_partials(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold one block's (out, lse) into the running (out, lse), as if both blocks' keys were one softmax.

    All fp32, out [B, H, Sq, D], lse [B, H, Sq]. Rows with lse = -inf on both sides stay (0, -inf).
    """
    new_lse = torch.logaddexp(lse, block_lse)
    # Same NaN guard as in block_attention: a row no key has reached yet keeps weight 0 on both sides.
    safe = torch.where(torch.isfinite(new_lse), new_lse, torch.zeros_like(new_lse))
    weight = torch.exp(lse - safe).unsqueeze(-1)
    block_weight = torch.exp(block_lse - safe).unsqueeze(-1)
    return out * weight + block_out * block_weight, new_lse


class RingAttention:
    """Exact attention of a sequence shard's queries to the whole sequence's keys, over `group` (a ring).

    `forward(q, k, v, attn_mask)` takes this rank's contiguous shards [B, S_r, H, D] (rank r holds the r-th
    shard in group-rank order; shards may differ in length, even be empty) and returns this rank's output
    shard [B, S_r, H, D] in q's dtype. `attn_mask` (optional, boolean, True: attend) is this rank's query rows
    over the full key sequence: it broadcasts to [B, H, S_r, S], S the sum of the K/V shard lengths.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, scale: float | None = None):
        self.group = group if group is not None else dist.group.WORLD
        self.scale = scale
        self.backend = None  # the attention backend whose LSE kernel computes each block (None: SDPA's)

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        return self.forward(*args, **kwargs)

    def shard_lengths(self, kv_len: int, device: torch.device) -> list[int]:
        """Every rank's K/V shard length, in group-rank order (one small all-gather)."""
        world = dist.get_world_size(self.group)
        lengths = torch.empty(world, dtype=torch.int64, device=device)
        mine = torch.tensor([kv_len], dtype=torch.int64, device=device)
        # all_gather_single is all_gather_into_tensor's new name; the old one warns from torch 2.13 on
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(lengths, mine, group=self.group)
        return lengths.tolist()

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        kv_lengths: Sequence[int] | None = None,
        backend=None,
    ) -> torch.Tensor:
        """Ring attention of this rank's shards; `kv_lengths` (every rank's K/V shard length) skips the
        all-gather that otherwise finds them; `backend` (default: the one set on this ring, else SDPA) computes
        each block with its log-sum-exp."""
        backend = backend if backend is not None else self.backend
        _check_shards(query, key, value)
        world = dist.get_world_size(self.group)
        rank = dist.get_rank(self.group)
        lengths = list(kv_lengths) if kv_lengths is not None else self.shard_lengths(key.shape[1], key.device)
        if len(lengths) != world or lengths[rank] != key.shape[1]:
            raise InvalidInputError(
                f"kv_lengths must list the {world} ranks' K/V shard lengths with this rank's ({rank}) = "
                f"{key.shape[1]}, got {lengths}"
            )
        offsets = [sum(lengths[:i]) for i in range(world)]
        total = sum(lengths)
        if attn_mask is not None:
            _check_mask(attn_mask, query, total)

        # Pad K/V to the longest shard so every exchange has one shape (receive buffers are allocated once);
        # the padding is sliced off on arrival, by the sender's known length, so it never reaches a score.
        longest = max(lengths)
        kv = torch.stack([key, value])
        if kv.shape[2] < longest:
            pad = kv.new_zeros(*kv.shape[:2], longest - kv.shape[2], *kv.shape[3:])
            kv = torch.cat([kv, pad], dim=2)
        kv = kv.contiguous()

        next_peer = dist.get_global_rank(self.group, (rank + 1) % world)
        prev_peer = dist.get_global_rank(self.group, (rank - 1) % world)
        out = lse = None
        for step in range(world):
            pending = []
            if step < world - 1:
                # Start passing this block on (and fetching the next) before computing on it: the exchange
                # overlaps the compute where the backend runs it asynchronously.
                incoming = torch.empty_like(kv)
                pending = dist.batch_isend_irecv([
                    dist.P2POp(dist.isend, kv, next_peer, self.group),
                    dist.P2POp(dist.irecv, incoming, prev_peer, self.group),
                ])
            source = (rank - step) % world
            start, length = offsets[source], lengths[source]
            mask = attn_mask[..., start:start + length] if attn_mask is not None else None
            block_out, block_lse = block_attention(
                query, kv[0, :, :length], kv[1, :, :length], mask, self.scale, backend
            )
            if out is None:
                out, lse = block_out, block_lse
            else:
                out, lse = merge_partials(out, lse, block_out, block_lse)
            for request in pending:
                request.wait()
            if step < world - 1:
                kv = incoming
        return out.transpose(1, 2).to(query.dtype)


def _check_shards(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise InvalidInputError(
            f"ring attention expects [batch, seq, heads, head_dim] shards, got q {tuple(query.shape)}, "
            f"k {tuple(key.shape)}, v {tuple(value.shape)}"
        )
    if key.shape != value.shape:
        raise InvalidInputError(f"k and v shards must have one shape, got k {tuple(key.shape)}, v {tuple(value.shape)}")
    if (query.shape[0], query.shape[2], query.shape[3]) != (key.shape[0], key.shape[2], key.shape[3]):
        raise InvalidInputError(
            f"q and k shards must share batch, heads and head_dim, got q {tuple(query.shape)}, k {tuple(key.shape)}"
        )


def _check_mask(attn_mask: torch.Tensor, query: torch.Tensor, total: int) -> None:
    if attn_mask.dtype != torch.bool:
        raise InvalidInputError(
            f"ring attention takes a boolean mask (True: attend), got {attn_mask.dtype}; convert an additive "
            "mask with `mask == 0`"
        )
    target = (query.shape[0], query.shape[2], query.shape[1], total)
    if attn_mask.dim() < 2 or attn_mask.shape[-1] != total or not _broadcasts(attn_mask.shape, target):
        raise InvalidInputError(
            f"attn_mask must broadcast to [batch, heads, q_shard, full_kv] = {list(target)} (this rank's query "
            f"rows over every key), got {list(attn_mask.shape)}"
        )


def _broadcasts(shape: Sequence[int], target: Sequence[int]) -> bool:
    if len(shape) > len(target):
        return False
    return all(s in (1, t) for s, t in zip(reversed(shape), reversed(target)))
