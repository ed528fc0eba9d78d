"""Sequence parallelism for a video DiT: the token sequence split over ranks once per forward, attention made
exact across them with Ulysses (all-to-all to head shards), a ring (K/V passed round) or both (USP).

**Frame-wise token split.** A video's tokens are frames x tokens_per_frame (frame-major). Every frame's tokens
are cut into `degree` parts of `part = ceil(tokens_per_frame / degree)` tokens (the last parts zero-padded),
and rank p keeps part p of every frame. So each rank's shard is itself frame-major with the same number of
tokens per frame: per-frame modulation, per-frame timesteps and a frame-slotted KV cache work on a shard as
on the whole, and no token count is refused for not dividing.

**Attention** (self role; cross attention needs nothing: local queries attend to the whole text):
- Ulysses inside its group of U ranks: q/k/v all-to-all from [this part of every frame, all heads] to
  [the group's parts of every frame, heads/U]; the parts are put back in frame order and the padding is cut,
  so attention (with any mask or KV cache) sees exactly the unsharded sequence for its heads.
- Ring across R groups (each holding U parts of every frame): keys/values travel round the ring and partial
  outputs are merged in fp32 by log-sum-exp; padded keys are masked out by position.
- USP = both: Ulysses first, then the ring over the Ulysses groups' wider shards.

KV caches follow the attention: under Ulysses a cache holds the whole sequence for the rank's heads; under a
ring it holds the rank's parts of every frame (all its heads after Ulysses): `kv_cache_layout` says which.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from composer.errors import ConfigError, InvalidInputError
from composer.models.attention.backends import run_attention
from composer.parallel.ring import RingAttention
from composer.parallel.ulysses import heads_to_seq, seq_to_heads


@dataclass(frozen=True)
class TokenSplit:
    """How one forward pass's tokens are split: `frames` frames of `tokens_per_frame` tokens, each frame cut
    into `degree` parts of `part` tokens (padded)."""

    frames: int
    tokens_per_frame: int
    degree: int

    @property
    def part(self) -> int:
        return -(-self.tokens_per_frame // self.degree)

    @property
    def padded(self) -> int:
        return self.part * self.degree

    def valid(self, first_part: int, parts: int) -> int:
        """Real (unpadded) tokens per frame in parts [first_part, first_part + parts)."""
        return max(0, min(self.tokens_per_frame - first_part * self.part, parts * self.part))


def _degree(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if group is not None else 1


def _rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if group is not None else 0


class SequenceParallel:
    """Splits a model's tokens over `ulysses` x `ring` ranks and computes attention across them.

    Set on a model's block runner (composer/models/runner.py: the runner calls `split` before the blocks, and a hook
    on the model's `token_plan.gather_at` module calls `gather`) and on each `Attention` module as
    `attention.parallel` (which calls `attention`). `sp_group` holds every rank of both, ordered part
    p = ring index x U + ulysses index.
    """

    def __init__(self, ulysses_group: dist.ProcessGroup | None, ring_group: dist.ProcessGroup | None,
                 sp_group: dist.ProcessGroup | None):
        self.ulysses_group = ulysses_group
        self.ring_group = ring_group
        self.sp_group = sp_group
        self.ulysses = _degree(ulysses_group)
        self.ring = _degree(ring_group)
        self.degree = self.ulysses * self.ring
        if _degree(sp_group) != self.degree:
            raise ConfigError(f"sequence-parallel group of {_degree(sp_group)} ranks for ulysses {self.ulysses} x "
                              f"ring {self.ring}")
        self.part_index = _rank(ring_group) * self.ulysses + _rank(ulysses_group)
        self.ring_attention = RingAttention(ring_group) if ring_group is not None else None
        self.split_info: TokenSplit | None = None  # the forward pass in progress (one at a time per process)
        self._mask_cache: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def check_heads(self, num_heads: int) -> None:
        """Ulysses splits heads: refuse (before any work) a head count it cannot split."""
        if num_heads % self.ulysses:
            raise ConfigError(
                f"ulysses_degree {self.ulysses} does not divide the {num_heads} attention heads per rank: choose a "
                f"Ulysses degree dividing {num_heads}, or use ring_degree (any head count)"
            )

    # -- tokens ------------------------------------------------------------------------------------
    def split(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], frames: int
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x [B, frames * tokens_per_frame, D] and RoPE cos/sin [1, S, 1, d] -> this rank's part of every frame."""
        if x.shape[1] % frames:
            raise InvalidInputError(f"{x.shape[1]} tokens do not form {frames} frames")
        info = TokenSplit(frames, x.shape[1] // frames, self.degree)
        self.split_info = info
        return self._local(x, info), tuple(self._local(t, info) for t in rotary)

    def _local(self, x: torch.Tensor, info: TokenSplit) -> torch.Tensor:
        frames = x.unflatten(1, (info.frames, info.tokens_per_frame))
        start = self.part_index * info.part
        local = frames[:, :, start:start + info.part]
        if local.shape[2] < info.part:  # the last parts of a frame hold padding
            pad = local.new_zeros(*local.shape[:2], info.part - local.shape[2], *local.shape[3:])
            local = torch.cat([local, pad], dim=2)
        return local.flatten(1, 2).contiguous()

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's [B, frames * part, C] -> the whole sequence [B, frames * tokens_per_frame, C] on every rank."""
        info = self._info()
        gathered = x.new_empty((self.degree * x.shape[0], *x.shape[1:]))
        # all_gather_single is all_gather_into_tensor's new name (the old one warns from torch 2.13 on)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(gathered, x.contiguous(), group=self.sp_group)
        gathered = gathered.unflatten(0, (self.degree, x.shape[0]))
        # [parts, B, F * part, C] -> [B, F, parts * part, C], padding cut
        whole = gathered.unflatten(2, (info.frames, info.part)).permute(1, 2, 0, 3, 4).flatten(2, 3)
        return whole[:, :, :info.tokens_per_frame].flatten(1, 2)

    def _info(self) -> TokenSplit:
        if self.split_info is None:
            raise RuntimeError("sequence parallel: attention or gather before split() in this forward pass")
        return self.split_info

    def kv_cache_layout(self, num_heads: int, tokens_per_frame: int) -> tuple[int, int]:
        """(heads, tokens per frame) one rank's KV cache holds: Ulysses keeps whole frames of heads/U, a ring
        keeps the rank's parts of each frame."""
        info = TokenSplit(1, tokens_per_frame, self.degree)
        tokens = tokens_per_frame if self.ring == 1 else info.part * self.ulysses
        return num_heads // self.ulysses, tokens

    # -- attention ---------------------------------------------------------------------------------
    @torch.compiler.disable  # collectives and Python bookkeeping: compiled blocks call this eagerly
    def attention(self, backend, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attn_mask: torch.Tensor | None = None, kv_cache=None, joint_text: int = 0) -> torch.Tensor:
        """Self-attention of this rank's tokens [B, F * part, H, d] over the whole sequence (and the KV cache).
        `joint_text`: the last tokens are text every rank holds whole (joint attention, `_joint`)."""
        info = self._info()
        self.check_heads(query.shape[2])
        if joint_text:
            return self._joint(backend, query, key, value, attn_mask, joint_text, info)
        u = self.ulysses
        if u > 1:  # [my part of every frame, all heads] -> [the group's parts of every frame, heads / U]
            query, key, value = (self._gather_heads(t, info) for t in (query, key, value))
        if self.ring == 1:
            # Whole frames, in order: exactly the unsharded attention for these heads.
            if kv_cache is not None:
                key, value = kv_cache.update(key, value)
            out = run_attention(backend, query, key, value, attn_mask)
        else:
            out = self._ring(backend, query, key, value, attn_mask, kv_cache, info)
        if u > 1:
            out = self._scatter_heads(out, info)
        return out

    def _joint(self, backend, query, key, value, attn_mask, text_len: int, info: TokenSplit) -> torch.Tensor:
        """Joint attention over [this rank's video tokens; the whole text] under Ulysses: the video goes to head
        shards by all-to-all, the text (the same on every rank) is head-sliced locally, attention runs over the
        whole video followed by the text (`attn_mask` covers that order) for this rank's heads, and the text's
        output heads are all-gathered back. A ring would have to count the shared text keys once: refused."""
        if self.ring > 1:
            raise ConfigError("ring_degree > 1 is not supported for joint video + text attention (HunyuanVideo): "
                              "use ulysses_degree for its sequence parallelism")
        u, index = self.ulysses, _rank(self.ulysses_group)

        def heads(t: torch.Tensor) -> torch.Tensor:  # the text's block of heads this rank computes
            return t.unflatten(2, (u, -1))[:, :, index]

        video = [t[:, :-text_len] for t in (query, key, value)]
        text = [heads(t[:, -text_len:]) for t in (query, key, value)]
        if u > 1:
            video = [self._gather_heads(t, info) for t in video]
        q, k, v = (torch.cat([a, b], dim=1) for a, b in zip(video, text))
        out = run_attention(backend, q, k, v, attn_mask, joint_text=text_len)
        out_video, out_text = out[:, :-text_len], out[:, -text_len:]
        if u > 1:
            out_video = self._scatter_heads(out_video, info)
            gathered = out_text.new_empty((u * out_text.shape[0], *out_text.shape[1:]))
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            gather(gathered, out_text.contiguous(), group=self.ulysses_group)
            out_text = gathered.unflatten(0, (u, -1)).permute(1, 2, 0, 3, 4).flatten(2, 3)  # heads in rank order
        return torch.cat([out_video, out_text], dim=1)

    def _gather_heads(self, x: torch.Tensor, info: TokenSplit) -> torch.Tensor:
        """Ulysses all-to-all, then the group's parts of each frame side by side (padding cut when there is no
        ring: the sequence is then whole)."""
        u = self.ulysses
        x = seq_to_heads(x, self.ulysses_group)  # [B, U * F * part, H/U, d], part-major
        x = x.unflatten(1, (u, info.frames, info.part)).transpose(1, 2).flatten(2, 3)  # [B, F, U * part, ...]
        if self.ring == 1:
            x = x[:, :, :info.tokens_per_frame]
        return x.flatten(1, 2)

    def _scatter_heads(self, x: torch.Tensor, info: TokenSplit) -> torch.Tensor:
        """Inverse of `_gather_heads`: back to this rank's part of every frame, all heads."""
        u = self.ulysses
        x = x.unflatten(1, (info.frames, -1))
        if x.shape[2] < u * info.part:
            x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, u * info.part - x.shape[2]))
        x = x.unflatten(2, (u, info.part)).transpose(1, 2).flatten(1, 3)  # [B, U * F * part, H/U, d]
        return heads_to_seq(x.contiguous(), self.ulysses_group)

    def _ring(self, backend, query, key, value, attn_mask, kv_cache, info: TokenSplit) -> torch.Tensor:
        """Ring attention over shards of `width` tokens per frame; padded keys masked by position."""
        width = info.part * self.ulysses  # tokens per frame in each ring rank's shard
        ring_index = _rank(self.ring_group)
        if kv_cache is not None:
            if attn_mask is not None:
                raise InvalidInputError("a KV-cached pass takes no attention mask (the cache's window masks)")
            key, value = kv_cache.update(key, value)
        key_frames = key.shape[1] // width
        mask = None
        if attn_mask is not None:
            mask = self._ring_mask(attn_mask, info, width, ring_index)
        elif info.padded != info.tokens_per_frame:  # some keys are padding: mask them by position
            valid = torch.arange(width, device=key.device)
            keep = [valid < info.valid(i * self.ulysses, self.ulysses) for i in range(self.ring)]
            mask = torch.cat([k.repeat(key_frames) for k in keep])[None]  # [1, R * key_frames * width]
        lengths = [key.shape[1]] * self.ring
        return self.ring_attention(query, key, value, attn_mask=mask, kv_lengths=lengths, backend=backend)

    def _ring_mask(self, attn_mask: torch.Tensor, info: TokenSplit, width: int, ring_index: int) -> torch.Tensor:
        """A mask over the natural token order [S, S] -> this ring rank's query rows over every ring rank's keys,
        in the shards' order, padding never attended (built once per mask, reused by every layer)."""
        if self._mask_cache is not None and self._mask_cache[0] == id(attn_mask) and self._mask_cache[1] is attn_mask:
            return self._mask_cache[2]
        if attn_mask.dim() != 2:
            raise InvalidInputError(f"sequence parallel takes a [S, S] token mask, got {list(attn_mask.shape)}")
        device = attn_mask.device
        frame = torch.arange(info.frames, device=device).repeat_interleave(width)
        pos = torch.arange(width, device=device).repeat(info.frames)

        def tokens(i: int) -> tuple[torch.Tensor, torch.Tensor]:  # natural index of ring rank i's tokens, valid
            col = i * width + pos
            return frame * info.tokens_per_frame + col.clamp(max=info.tokens_per_frame - 1), col < info.tokens_per_frame

        rows, row_ok = tokens(ring_index)
        cols, col_ok = zip(*(tokens(i) for i in range(self.ring)))
        cols, col_ok = torch.cat(cols), torch.cat(col_ok)
        mask = attn_mask[rows][:, cols] & row_ok[:, None] & col_ok[None, :]
        self._mask_cache = (id(attn_mask), attn_mask, mask)
        return mask

    def __repr__(self) -> str:
        return f"SequenceParallel(ulysses={self.ulysses}, ring={self.ring}, part={self.part_index})"


def apply_sequence_parallel(model: torch.nn.Module, sp: SequenceParallel) -> int:
    """Make `model` (a class with a `token_plan`) split its tokens over `sp` (its block runner splits them, a hook
    on the plan's `gather_at` module gathers them), and every self-attention
    `Attention` module compute across the ranks; returns how many attention modules were wrapped. Raises
    ConfigError when Ulysses cannot split the model's heads."""
    from composer.models.attention import Attention
    from composer.models.runner import runner_of, token_plan_of

    plan = token_plan_of(model)
    if plan is None:
        raise ConfigError(f"{type(model).__name__} does not support sequence parallelism (it declares no token_plan: "
                          "composer/models/runner.py)")
    heads = getattr(getattr(model, "config", None), "num_attention_heads", None)
    if heads is not None:
        sp.check_heads(heads)
    runner = runner_of(model)
    runner.sequence_parallel = sp
    runner.attach_gather(model, plan)
    count = 0
    for module in model.modules():
        if isinstance(module, Attention) and module.role == "self":
            module.parallel = sp
            count += 1
    return count
