"""Block refinement of masked-diffusion text (LLaDA-style): the rules that turn one model forward into commits.

A request's generated tokens start as the mask token. Blocks of `block_length` tokens are refined left to right;
within a block each step runs the model on the sequence up to the block's end, samples a token and its
probability at every position of the block, then commits masked positions: every one whose probability is above
`threshold`, or (when fewer are) the most probable ones, as many as the block's schedule gives this step. Once a
block has no mask left, editing (a positive `editing_threshold`) may still replace committed tokens that the
model now predicts otherwise with high confidence, for up to `max_post_steps` more steps. A row that commits an
EOS with everything before it committed is finished (`eos_early_stop`).

This is composer's own code for the rules of diffusers' BlockRefinementScheduler in its mask mode and of
LLaDA2Pipeline's loop; `exact` decoding gives the same token ids on the same model, inputs and seed (the draws
from the request's generator are made in the same order: one multinomial over the rows of a step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def transfer_schedule(block_length: int, steps: int) -> list[int]:
    """How many tokens each step of a block commits at least: the block spread evenly, the first steps one more."""
    base, extra = divmod(block_length, steps)
    return [base + (1 if i < extra else 0) for i in range(steps)]


def _keep_top_k(logits: torch.Tensor, top_k: int | None) -> torch.Tensor:
    if top_k is None or top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k=top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, torch.finfo(logits.dtype).min)


def _keep_top_p(logits: torch.Tensor, top_p: float | None) -> torch.Tensor:
    if top_p is None or top_p >= 1.0:
        return logits
    ordered, order = torch.sort(logits, descending=True, dim=-1)
    mass = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
    drop = mass > float(top_p)
    drop = torch.cat([torch.zeros_like(drop[..., :1]), drop[..., :-1]], dim=-1)  # keep the token that crosses p
    ordered = ordered.masked_fill(drop, torch.finfo(ordered.dtype).min)
    return logits.scatter(-1, order, ordered)


def sample(logits: torch.Tensor, *, temperature: float, top_k: int | None, top_p: float | None,
           multinomial: bool, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A token and its probability at every position of `logits` [rows, positions, vocab]: the most likely one
    (temperature 0 or not `multinomial`), else one draw from the tempered, top-k / top-p filtered distribution."""
    rows = logits.reshape(-1, logits.shape[-1])
    if temperature == 0.0 or not multinomial:
        probs = torch.softmax(rows.float(), dim=-1)
        token = rows.argmax(dim=-1, keepdim=True)
    else:
        scaled = rows / temperature if temperature != 1.0 else rows
        probs = torch.softmax(_keep_top_p(_keep_top_k(scaled, top_k), top_p).float(), dim=-1)
        if generator is not None and generator.device != probs.device:  # a CPU seed for a model on a GPU
            token = torch.multinomial(probs.cpu(), num_samples=1, generator=generator).to(probs.device)
        else:
            token = torch.multinomial(probs, num_samples=1, generator=generator)
    chosen = probs.gather(-1, token)
    return token.view(logits.shape[:-1]), chosen.view(logits.shape[:-1])


@dataclass
class Commit:
    """One step's outcome for a block [rows, block_length]: the new block, what was committed or edited, and the
    sampled tokens."""

    block: torch.Tensor
    committed: torch.Tensor
    edited: torch.Tensor
    sampled: torch.Tensor

    @property
    def changed(self) -> torch.Tensor:
        return self.committed | self.edited


def commit(block: torch.Tensor, tokens: torch.Tensor, probs: torch.Tensor, *, mask_id: int, count: int,
           threshold: float, editing_threshold: float | None, prompt_positions: torch.Tensor) -> Commit:
    """Commit masked positions of `block` [rows, L]: those above `threshold`, or the `count` most probable
    (fewer if fewer are masked); edit committed non-prompt positions whose sampled token differs with probability
    above a positive `editing_threshold`."""
    masked = block == mask_id
    committed = torch.zeros_like(masked)
    if bool(masked.any()):
        confidence = torch.where(masked, probs.float(), torch.full_like(probs, float("-inf"), dtype=torch.float32))
        for row in range(block.shape[0]):
            sure = confidence[row] > threshold
            if int(sure.sum()) >= count:
                committed[row] = sure
                continue
            k = min(count, int(masked[row].sum()))
            if k > 0:
                committed[row, torch.topk(confidence[row], k=k).indices] = True
    edited = torch.zeros_like(masked)
    if editing_threshold is not None and editing_threshold > 0.0:
        editable = ~masked & ~prompt_positions.unsqueeze(0)
        edited = editable & (probs.float() > float(editing_threshold)) & (tokens != block)
    changed = committed | edited
    new = torch.where(changed, tokens, block)
    return Commit(new, committed, edited, tokens)


def finished_rows(sequence: torch.Tensor, sampled: torch.Tensor, changed: torch.Tensor, finished: torch.Tensor, *,
                  eos_id: int, mask_id: int, prompt_length: int) -> torch.Tensor:
    """Rows that have now committed an EOS (`changed` positions of `sampled`) with no mask between the prompt and
    their first EOS in `sequence`."""
    finished = finished.clone()
    for row in range(sequence.shape[0]):
        if finished[row] or not bool((sampled[row][changed[row]] == eos_id).any()):
            continue
        where = (sequence[row] == eos_id).nonzero()
        if where.numel() == 0:
            continue
        first = int(where[0, 0])
        if first >= prompt_length and bool((sequence[row, prompt_length:first] != mask_id).all()):
            finished[row] = True
    return finished


def block_goes_on(*, step: int, steps: int, had_masks: bool, editing: bool, edited: bool, post_steps: int,
                  max_post_steps: int, finished: torch.Tensor) -> bool:
    """Whether a block takes another step: while it had masks before this step and has steps left; after that,
    while editing still changes tokens (at most `max_post_steps` steps); never once every row is finished."""
    if bool(finished.all()):
        return False
    if had_masks:
        return step < steps
    return editing and edited and post_steps <= max_post_steps
