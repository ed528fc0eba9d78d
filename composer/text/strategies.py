"""Decoding strategies (`decoding=`): dInfer's ideas on composer's block refinement loop, each measured against the
exact path (benchmarks/dllm.py, docs/text-diffusion.md).

`exact` is the reference's loop (composer/text/refinement.py). The others, joined with "+" ("threshold+kv"):

- `threshold`: parallel decoding by confidence: each step commits every masked token above `threshold`, at least
  the most confident one; a block ends as soon as it has no mask (no step schedule, no trailing forward).
- `hierarchical`: as `threshold`, and also, in every run of consecutive masked positions, the most confident one
  when it is above `low_threshold`: tokens far apart are committed first, each run shrinking from its most
  certain point.
- `credit`: a position's confidence accumulates while the model keeps predicting the same token there
  (credit = 1 - (1 - credit)(1 - p) while it agrees, p when it changes its mind); a token is committed once its
  credit passes `threshold` (at least the most credited one each step).
- `smooth` (iteration smoothing): a still-masked position enters the next forward as the mask embedding mixed with
  the expected embedding under its last distribution (weight `smoothing_weight`); needs a model whose input
  embeddings can be read (`get_input_embeddings`) and that takes `inputs_embeds`.
- `kv` (vicinity KV refresh): the K/V of the positions before the active block are computed at the block's first
  step (and every `refresh_every` steps when > 0) and reused; the other steps run the block's positions only. Needs
  a model that takes `past_key_values` as composer's LLaDA model does (composer/models/llada).

`threshold`, `hierarchical` and `credit` choose what to commit (one of them at most); `smooth` and `kv` change the
forward. Every strategy but `exact` is approximate: its quality cost is measured next to its speed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from composer.errors import InvalidInputError, UnsupportedError
from composer.text import refinement

COMMIT_RULES = ("threshold", "hierarchical", "credit")
FORWARD_RULES = ("smooth", "kv")
NAMES = ("exact", *COMMIT_RULES, *FORWARD_RULES)


def parse(decoding: str) -> tuple[str, ...]:
    """The strategy names of a `decoding` value, checked (InvalidInputError naming the problem)."""
    names = tuple(n.strip() for n in decoding.split("+") if n.strip())
    unknown = [n for n in names if n not in NAMES]
    if not names or unknown:
        raise InvalidInputError(f"decoding = {decoding!r}: strategies are {', '.join(NAMES)} (join several with +)")
    if "exact" in names and len(names) > 1:
        raise InvalidInputError(f"decoding = {decoding!r}: exact is the reference path and combines with nothing")
    if sum(n in COMMIT_RULES for n in names) > 1:
        raise InvalidInputError(f"decoding = {decoding!r}: one of {', '.join(COMMIT_RULES)} at most")
    return names


@dataclass
class Decoder:
    """One request's strategy state across its blocks."""

    names: tuple[str, ...]
    threshold: float
    low_threshold: float
    smoothing_weight: float
    refresh_every: int
    mask_id: int
    credit: torch.Tensor | None = None
    last_tokens: torch.Tensor | None = None
    last_probs: torch.Tensor | None = None  # the block's full distributions at the last step (smooth)
    prefix: list | None = None  # the K/V of the positions before the block (kv)
    since_refresh: int = 0
    full_forwards: int = 0
    extras: dict = field(default_factory=dict)

    @property
    def exact(self) -> bool:
        return self.names == ("exact",)

    @property
    def rule(self) -> str | None:
        return next((n for n in self.names if n in COMMIT_RULES), None)

    def check_model(self, model: torch.nn.Module) -> None:
        if "kv" in self.names and not getattr(model, "supports_prefix_cache", False):
            raise UnsupportedError(f"decoding 'kv' needs a model that reuses K/V (composer's LLaDA model code); "
                                   f"{type(model).__name__} does not")
        if "smooth" in self.names and not callable(getattr(model, "get_input_embeddings", None)):
            raise UnsupportedError(f"decoding 'smooth' needs the model's input embeddings; {type(model).__name__} "
                                   "has no get_input_embeddings")

    def new_block(self) -> None:
        self.credit = self.last_tokens = self.last_probs = self.prefix = None
        self.since_refresh = 0

    # -- the forward

    @property
    def plain_forward(self) -> bool:
        """Whether this step's forward is a plain one over the window (which other requests' may share): neither
        `smooth` (its own input embeddings) nor `kv` (its own cached prefix)."""
        return "smooth" not in self.names and "kv" not in self.names

    def logits(self, model: torch.nn.Module, window: torch.Tensor, attention: torch.Tensor, positions: torch.Tensor,
               block: int) -> torch.Tensor:
        """The block's logits [rows, block, vocab] for this step."""
        embeds = self._embeds(model, window, block) if "smooth" in self.names else None
        if "kv" not in self.names:
            out = model(None if embeds is not None else window, attention_mask=attention, position_ids=positions,
                        **({"inputs_embeds": embeds} if embeds is not None else {}))
            return out.logits[:, -block:, :]
        # a full forward at the block's first step and, with refresh_every = N > 0, every N steps (N = 1: always)
        refresh = self.prefix is None or (self.refresh_every > 0 and self.since_refresh + 1 >= self.refresh_every)
        if refresh:  # every position, keeping the K/V of those before the block
            out = model(None if embeds is not None else window, attention_mask=attention, position_ids=positions,
                        inputs_embeds=embeds, use_cache=True)
            cut = window.shape[1] - block
            self.prefix = [(k[:, :, :cut], v[:, :, :cut]) for k, v in out.past_key_values]
            self.since_refresh, self.full_forwards = 0, self.full_forwards + 1
            return out.logits[:, -block:, :]
        self.since_refresh += 1
        out = model(None if embeds is not None else window[:, -block:], attention_mask=attention,
                    position_ids=positions[:, -block:], past_key_values=self.prefix,
                    inputs_embeds=None if embeds is None else embeds[:, -block:])
        return out.logits

    def _embeds(self, model: torch.nn.Module, window: torch.Tensor, block: int) -> torch.Tensor:
        table = model.get_input_embeddings().weight
        embeds = table[window]
        if self.last_probs is None:
            return embeds
        masked = window[:, -block:] == self.mask_id
        expected = self.last_probs.to(table.dtype) @ table  # [rows, block, d]
        tail = embeds[:, -block:]
        mixed = (1 - self.smoothing_weight) * tail + self.smoothing_weight * expected
        embeds[:, -block:] = torch.where(masked[..., None], mixed, tail)
        return embeds

    # -- what to commit

    def commit(self, current: torch.Tensor, logits: torch.Tensor, tokens: torch.Tensor,
               probs: torch.Tensor) -> refinement.Commit:
        """Which masked positions of `current` take their sampled token this step (at least one per row that has a
        mask)."""
        masked = current == self.mask_id
        p = probs.float()
        if "smooth" in self.names:
            self.last_probs = torch.softmax(logits.float(), dim=-1)
        rule = self.rule or "threshold"
        if rule == "credit":
            if self.credit is None:
                credit = p
            else:  # agreeing with the last step: the evidence adds up; changing its mind: it starts over
                credit = torch.where(tokens == self.last_tokens, 1 - (1 - self.credit) * (1 - p), p)
            self.credit, self.last_tokens = credit, tokens
            score = credit
        else:
            score = p
        score = torch.where(masked, score, torch.full_like(score, float("-inf")))
        chosen = masked & (score > self.threshold)
        if rule == "hierarchical":
            chosen |= _best_of_each_run(masked, score, self.low_threshold)
        best = score.argmax(dim=-1)
        has_mask = masked.any(dim=-1)
        chosen[torch.arange(current.shape[0], device=current.device)[has_mask], best[has_mask]] = True
        new = torch.where(chosen, tokens, current)
        return refinement.Commit(new, chosen, torch.zeros_like(chosen), tokens)


def _best_of_each_run(masked: torch.Tensor, score: torch.Tensor, low: float) -> torch.Tensor:
    """In each row, each run of consecutive masked positions: its most confident position, if above `low`."""
    out = torch.zeros_like(masked)
    for row in range(masked.shape[0]):
        run: list[int] = []
        for pos in [*range(masked.shape[1]), None]:
            if pos is not None and bool(masked[row, pos]):
                run.append(pos)
                continue
            if run:
                best = max(run, key=lambda i: float(score[row, i]))
                if float(score[row, best]) > low:
                    out[row, best] = True
                run = []
    return out


def decoder_for(decoding: str, sp, mask_id: int) -> Decoder:
    return Decoder(parse(decoding), threshold=sp.threshold, low_threshold=sp.low_threshold,
                   smoothing_weight=sp.smoothing_weight, refresh_every=sp.refresh_every, mask_id=mask_id)
