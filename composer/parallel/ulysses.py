"""Ulysses sequence parallelism (DeepSpeed-Ulysses) around attention.

Each rank of a process group of size P holds a sequence shard of q/k/v, [batch, S_pad/P, heads, head_dim],
with every head. One all-to-all per tensor turns that into the full sequence for heads/P heads, attention runs
on those local heads (any callable on [batch, seq, heads, head_dim]), and a second all-to-all turns the output
back into sequence shards. Attention is computed on whole sequences, so the result equals unsharded attention.

A sequence that does not divide by P is zero-padded at the end (`shard_sequence`); the padding is cut off
after the first all-to-all, where every rank sees the whole sequence, so padded keys are never attended to
and no mask is needed (a mask would also rule out mask-less kernels such as flash-attn).

Only `torch.distributed` collectives are used (`all_to_all_single`, `all_gather_into_tensor`), so this runs
on gloo (CPU) and NCCL alike. The collectives are not differentiable: this is for inference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from composer.errors import ConfigError, InvalidInputError

AttentionFn = Callable[..., torch.Tensor]  # (q, k, v, attn_mask) on [batch, seq, heads, head_dim] -> same
ROLES = ("self", "cross")


def _degree_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def shard_sequence(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, dim: int = 1
) -> tuple[torch.Tensor, int]:
    """This rank's slice of `x` along `dim`, after zero-padding `dim` to a multiple of the group size.

    Returns (local shard, number of padded positions); every rank's shard has the same length. The padding
    sits at the end of the sequence, so it lands in the last ranks' shards."""
    degree, rank = _degree_and_rank(group)
    length = x.shape[dim]
    pad = (-length) % degree
    if pad:
        pad_shape = list(x.shape)
        pad_shape[dim] = pad
        x = torch.cat([x, x.new_zeros(pad_shape)], dim=dim)
    return x.chunk(degree, dim=dim)[rank].contiguous(), pad


def gather_sequence(
    local: torch.Tensor, group: dist.ProcessGroup | None, full_len: int, dim: int = 1
) -> torch.Tensor:
    """Inverse of `shard_sequence`: every rank's shard concatenated along `dim`, padding removed, on every rank."""
    degree, _ = _degree_and_rank(group)
    padded_len = local.shape[dim] * degree
    if not padded_len - degree < full_len <= padded_len:
        raise InvalidInputError(
            f"gather_sequence: full_len = {full_len} does not fit {degree} shards of {local.shape[dim]} "
            f"(expected a length L with ceil(L / {degree}) = {local.shape[dim]}); pass the length before sharding"
        )
    # all_gather_into_tensor concatenates along dim 0, so gather with the sequence dim moved first.
    moved = local.movedim(dim, 0).contiguous()
    out = moved.new_empty((padded_len, *moved.shape[1:]))
    dist.all_gather_into_tensor(out, moved, group=group)
    return out[:full_len].movedim(0, dim)


def _check_heads(num_heads: int, degree: int) -> None:
    if num_heads % degree:
        raise ConfigError(
            f"Ulysses sequence parallelism splits attention heads over the ranks: {num_heads} heads do not "
            f"divide by the sequence-parallel degree {degree}; choose a degree that divides {num_heads}"
        )


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-to-all [batch, seq/P, heads, dim] (a sequence shard, every head) -> [batch, seq, heads/P, dim]
    (the whole sequence, this rank's block of heads)."""
    degree, _ = _degree_and_rank(group)
    batch, shard_len, num_heads, head_dim = x.shape
    _check_heads(num_heads, degree)
    local_heads = num_heads // degree
    # Chunk p of dim 0 goes to rank p: rank p's block of heads, for this rank's part of the sequence.
    send = x.reshape(batch, shard_len, degree, local_heads, head_dim).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[p] is rank p's sequence shard of our heads: put the shards back in sequence order.
    return recv.permute(1, 0, 2, 3, 4).reshape(batch, degree * shard_len, local_heads, head_dim)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Inverse of `seq_to_heads`: [batch, seq, heads/P, dim] -> [batch, seq/P, heads, dim]."""
    degree, _ = _degree_and_rank(group)
    batch, padded_len, local_heads, head_dim = x.shape
    shard_len = padded_len // degree
    # Chunk p of dim 0 goes to rank p: rank p's part of the sequence, for our block of heads.
    send = x.reshape(batch, degree, shard_len, local_heads, head_dim).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[p] is our sequence shard for rank p's heads: heads in rank order rebuild the full head axis.
    return recv.permute(1, 2, 0, 3, 4).reshape(batch, shard_len, degree * local_heads, head_dim)


class UlyssesAttention(nn.Module):
    """Attention over a sequence-sharded batch: all-to-all to head shards, `attention_fn` on the local heads
    over the whole sequence, all-to-all back. Inputs and output are this rank's [batch, S_pad/P, heads, dim].

    `role="self"`: q, k and v are sequence shards (as `shard_sequence` makes them).
    `role="cross"`: q is a sequence shard, k/v are whole on every rank (the text); they are head-sliced
    locally and never communicated.
    """

    def __init__(self, group: dist.ProcessGroup | None, attention_fn: AttentionFn, role: str = "self"):
        super().__init__()
        if role not in ROLES:
            raise ConfigError(f"Ulysses attention role must be one of {ROLES}, got {role!r}")
        self.group = group
        self.attention_fn = attention_fn
        self.role = role

    def forward(
        self,
        q_shard: torch.Tensor,
        k_shard: torch.Tensor,
        v_shard: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        full_len: int | None = None,
    ) -> torch.Tensor:
        """`full_len`: the query sequence length before padding (None: the shards hold no padding).
        `attn_mask`: as for unsharded attention, over the unpadded query and key lengths; a per-head mask
        (heads on dim -3) is sliced to this rank's heads."""
        degree, rank = _degree_and_rank(self.group)
        batch, shard_len, num_heads, _ = q_shard.shape
        _check_heads(num_heads, degree)
        padded_len = shard_len * degree
        full_len = padded_len if full_len is None else full_len
        if not padded_len - degree < full_len <= padded_len:
            raise InvalidInputError(
                f"Ulysses attention: full_len = {full_len} does not fit {degree} shards of {shard_len} "
                f"(expected ceil(full_len / {degree}) = {shard_len}); pass the length before shard_sequence"
            )
        if self.role == "self" and (k_shard.shape[:3] != q_shard.shape[:3] or v_shard.shape[:3] != q_shard.shape[:3]):
            raise InvalidInputError(
                f"Ulysses self-attention needs q/k/v shards of one shape [batch, seq, heads], got "
                f"{tuple(q_shard.shape)}, {tuple(k_shard.shape)}, {tuple(v_shard.shape)}"
            )
        local_heads = num_heads // degree
        heads = slice(rank * local_heads, (rank + 1) * local_heads)

        # Cutting the padding here (every rank now holds the whole sequence) keeps padded keys out of the
        # softmax exactly, and keeps padded queries from costing attention work.
        q = seq_to_heads(q_shard, self.group)[:, :full_len]
        if self.role == "self":
            k = seq_to_heads(k_shard, self.group)[:, :full_len]
            v = seq_to_heads(v_shard, self.group)[:, :full_len]
        else:
            if k_shard.shape[2] != num_heads or v_shard.shape[2] != num_heads:
                raise InvalidInputError(
                    f"Ulysses cross-attention needs text k/v with the query's {num_heads} heads, got "
                    f"{tuple(k_shard.shape)}, {tuple(v_shard.shape)}"
                )
            k, v = k_shard[:, :, heads], v_shard[:, :, heads]
        if attn_mask is not None and attn_mask.dim() >= 3 and attn_mask.shape[-3] == num_heads and num_heads > 1:
            attn_mask = attn_mask.narrow(-3, heads.start, local_heads)

        out = self.attention_fn(q, k, v, attn_mask)
        out = F.pad(out, (0, 0, 0, 0, 0, padded_len - full_len))  # back to the padded length for the all-to-all
        return heads_to_seq(out.contiguous(), self.group)

    def extra_repr(self) -> str:
        return f"role={self.role}"
