"""What a text model can take, read from its folder (one source for the CLI before loading, `TextGenerator` and the
text server), and the one check of a text request against it.

    limits = TextLimits.from_folder(folder, pipeline_cls)   # model/config.json, scheduler/scheduler_config.json
    check_text_request(sp, limits)                           # settings: ranges, finite numbers, decoding, length
    check_text_request(sp, limits, prompt_tokens=[12, 9])    # and the tokenized prompts against the context

The context is the positions the model was made for (its config's `max_position_embeddings`, LLaDA's
`max_sequence_length`, ...). A request's positions: LLaDA2's refinement runs whole blocks, so the prompt and the
generated tokens together rounded up to a whole number of blocks; DiffusionGemma's canvases, so the prompt plus
`gen_length` rounded up to whole canvases.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from composer.errors import InvalidInputError

CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length")


def model_context(config: Any) -> int | None:
    """The positions a model config (a dict or a config object; its `text_config` too) states, else None."""
    for conf in (config, _get(config, "text_config")):
        for name in CONTEXT_KEYS:
            value = _get(conf, name)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _get(config: Any, name: str) -> Any:
    if isinstance(config, dict):
        return config.get(name)
    return getattr(config, name, None)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@dataclass(frozen=True)
class TextLimits:
    """A text model's limits: its context (positions; None: unknown), the block length its scheduler states (LLaDA2;
    a request's `block_length` wins), the canvas length (DiffusionGemma), the decoding values it takes (None:
    every strategy), and its name for messages."""

    context: int | None = None
    block_length: int | None = None
    canvas_length: int | None = None
    strategies: tuple[str, ...] | None = None
    name: str = "this model"

    @classmethod
    def from_folder(cls, folder: str | Path, pipeline_cls: Any = None, name: str | None = None) -> TextLimits:
        """Read from the folder's model and scheduler configs (nothing loaded)."""
        folder = Path(folder)
        model = _read_json(folder / "model" / "config.json")
        scheduler = _read_json(folder / "scheduler" / "scheduler_config.json")
        block = scheduler.get("block_length")
        canvas = model.get("canvas_length")
        return cls(context=model_context(model),
                   block_length=block if isinstance(block, int) and block > 0 else None,
                   canvas_length=canvas if isinstance(canvas, int) and canvas > 0 else None,
                   strategies=getattr(pipeline_cls, "strategies", None), name=name or folder.name)

    def positions(self, prompt_tokens: int, sp: Any) -> int:
        """The positions a prompt of `prompt_tokens` tokens and `sp.gen_length` new tokens take."""
        if self.canvas_length:
            return prompt_tokens + -(-sp.gen_length // self.canvas_length) * self.canvas_length
        block = getattr(sp, "block_length", None) or self.block_length or 1
        return -(-(prompt_tokens + sp.gen_length) // block) * block


def check_text_request(sp: Any, limits: TextLimits | None = None, prompt_tokens: list[int] | None = None,
                       check_prompt: bool = True) -> None:
    """Refuse a text request (a TextSamplingParam) before any work, every problem in one InvalidInputError: the
    settings' types and ranges (`sp.check`), a decoding the model does not take, and a length past the model's
    context: `gen_length` alone, or with each prompt's tokens (`prompt_tokens`, once tokenized). `check_prompt`
    False leaves the prompt out (the CLI checks before it reads a prompt file)."""
    sp.check(prompt=check_prompt)
    if limits is None:
        return
    problems = []
    if limits.strategies is not None and sp.decoding not in limits.strategies:
        problems.append(f"decoding = {sp.decoding!r}: {limits.name} takes {', '.join(limits.strategies)} only")
    context = limits.context
    if context is not None:
        longest = max(prompt_tokens) if prompt_tokens else 0
        needed = limits.positions(longest, sp)
        if needed > context and not prompt_tokens:
            problems.append(f"gen_length = {sp.gen_length} (--max-new-tokens): more than {limits.name}'s context of "
                            f"{context} positions; ask for at most {_room(limits, sp, 0)} new tokens")
        elif needed > context:
            which = f"prompt[{prompt_tokens.index(longest)}]" if len(prompt_tokens) > 1 else "the prompt"
            room = _room(limits, sp, longest)
            fix = (f"ask for at most {room} new tokens or shorten the prompt" if room > 0 else
                   "shorten the prompt")
            problems.append(f"{which} is {longest} tokens and gen_length = {sp.gen_length}: {needed} positions "
                            f"{'(in whole blocks) ' if not limits.canvas_length else '(in whole canvases) '}over "
                            f"{limits.name}'s context of {context}; {fix}")
    if problems:
        raise InvalidInputError("invalid text request: " + "; ".join(problems))


def _room(limits: TextLimits, sp: Any, prompt_tokens: int) -> int:
    """The most new tokens that fit after a prompt of `prompt_tokens` tokens."""
    if limits.canvas_length:
        return max((limits.context - prompt_tokens) // limits.canvas_length * limits.canvas_length, 0)
    block = getattr(sp, "block_length", None) or limits.block_length or 1
    return max(limits.context // block * block - prompt_tokens, 0)


def check_before_loading(model_path: str | Path | None, settings: dict[str, Any], family: str | None = None) -> None:
    """A text request as the CLI gives it (flag values as strings), checked against the model folder's stated
    defaults and limits before any weight loads: one ConfigError / InvalidInputError naming every bad value."""
    from composer.demo.packaged import TEXT_NAME
    from composer.registry.resolve import resolve_model

    resolved = resolve_model(TEXT_NAME if model_path is None else model_path, family)
    sp = resolved.stated.updated(**settings)
    check_text_request(sp, TextLimits.from_folder(resolved.index.folder, resolved.pipeline_cls))
