"""TextSamplingParam: one text request, with diffusers' names (LLaDA2Pipeline's `__call__` arguments)."""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any

from composer._fields import field_types
from composer.configs.base import SamplingSettings
from composer.errors import InvalidInputError

SAMPLING_METHODS = ("auto", "greedy", "multinomial")


@dataclass
class TextSamplingParam(SamplingSettings):
    """What one text request asks for. The defaults are diffusers' LLaDA2Pipeline's; a family or a model folder
    (composer.json `sampling`) may state others, and a request's own values win over both."""

    _what = "text sampling parameter"
    _uncoerced = ("prompt",)

    prompt: str | list[str] | None = field(default=None, metadata={"help": "the prompt (generate_text also takes a "
                                                                           "list: one text per prompt)"})
    gen_length: int = field(default=2048, metadata={"help": "tokens to generate (--max-new-tokens)"})
    block_length: int | None = field(default=None, metadata={"help": "tokens refined together (default: the "
                                                                     "folder's scheduler config)"})
    num_inference_steps: int = field(default=32, metadata={"help": "refinement steps per block (--steps)"})
    temperature: float = field(default=0.0, metadata={"help": "sampling temperature (0: the most likely token)"})
    top_p: float | None = field(default=None, metadata={"help": "nucleus sampling cutoff"})
    top_k: int | None = field(default=None, metadata={"help": "top-k sampling cutoff"})
    sampling_method: str = field(default="multinomial", metadata={"help": "auto, greedy or multinomial"})
    threshold: float = field(default=0.7, metadata={"help": "commit every masked token more confident than this"})
    editing_threshold: float | None = field(default=0.5, metadata={"help": "replace a committed token when another "
                                                                           "is more confident than this (<= 0: off)"})
    max_post_steps: int = field(default=16, metadata={"help": "editing steps after a block has no mask left"})
    minimal_topk: int = field(default=1, metadata={"help": "tokens committed per step at least"})
    eos_early_stop: bool = field(default=True, metadata={"help": "stop a row once its EOS is committed"})
    use_chat_template: bool = field(default=True, metadata={"help": "wrap the prompt in the tokenizer's chat "
                                                                    "template"})
    add_generation_prompt: bool = field(default=True, metadata={"help": "end the chat template with the "
                                                                        "assistant's turn"})
    decoding: str = field(default="exact", metadata={"help": "decoding strategy: exact (the reference's), or "
                                                                "threshold / hierarchical / credit, smooth, kv joined "
                                                                "with + (docs/text-diffusion.md)"})
    low_threshold: float = field(default=0.5, metadata={"help": "hierarchical decoding: commit each masked run's "
                                                                "best token above this"})
    smoothing_weight: float = field(default=0.5, metadata={"help": "iteration smoothing (smooth): weight of the "
                                                                   "expected embedding at a masked position"})
    refresh_every: int = field(default=0, metadata={"help": "vicinity KV refresh (kv): recompute the cached K/V "
                                                            "every this many steps (0: at each block's start)"})
    seed: int | None = field(default=None, metadata={"help": "random seed (torch.Generator('cpu').manual_seed, as "
                                                             "diffusers); default: random"})

    def updated(self, **overrides: Any) -> TextSamplingParam:
        """As SamplingSettings.updated, except that None given for a setting that takes None is that setting's None
        (diffusers' meaning: `editing_threshold=None` is the scheduler config's threshold and no editing steps,
        `top_p=None` no cutoff), not "keep the default"."""
        updated = super().updated(**overrides)
        hints = field_types(type(self))
        nones = {key: None for key, value in overrides.items()
                 if value is None and key in hints and type(None) in typing.get_args(hints[key])}
        return dataclasses.replace(updated, **nones) if nones else updated

    def check(self, prompt: bool = True) -> None:
        """Every bad value in one InvalidInputError (the request's input, checked once before any work; the prompt
        too unless `prompt` is False: the CLI checks the settings before it has read a prompt file)."""
        problems = []
        prompts = [self.prompt] if isinstance(self.prompt, str) else self.prompt
        if not prompt:
            pass
        elif not prompts or not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            problems.append("prompt: give a string or a non-empty list of strings")
        elif any(not p.strip() for p in prompts):
            problems.append("prompt: empty; give the text the model answers or continues")
        problems += _type_problems(self)
        if problems:  # a value of the wrong type: the range rules below would only repeat it
            raise InvalidInputError("invalid text request: " + "; ".join(problems))
        for name in ("gen_length", "num_inference_steps", "minimal_topk"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} = {getattr(self, name)}: must be > 0")
        if self.block_length is not None and self.block_length <= 0:
            problems.append(f"block_length = {self.block_length}: must be > 0")
        if self.max_post_steps < 0:
            problems.append(f"max_post_steps = {self.max_post_steps}: must be >= 0")
        if not self.temperature >= 0:
            problems.append(f"temperature = {self.temperature}: must be >= 0 (0: the most likely token)")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p = {self.top_p}: must be in (0, 1] (1 or none: no cutoff)")
        if self.top_k is not None and self.top_k < 0:
            problems.append(f"top_k = {self.top_k}: must be >= 0 (0 or none: no cutoff)")
        if not self.threshold >= 0:
            problems.append(f"threshold = {self.threshold}: must be >= 0 (above 1: commit the top-k only)")
        if self.seed is not None and not -2**63 <= self.seed < 2**64:
            problems.append(f"seed = {self.seed}: must be in [-2**63, 2**64) (what torch.Generator takes)")
        if not self.low_threshold >= 0:
            problems.append(f"low_threshold = {self.low_threshold}: must be >= 0")
        if self.sampling_method not in SAMPLING_METHODS:
            problems.append(f"sampling_method = {self.sampling_method!r}: one of {', '.join(SAMPLING_METHODS)}")
        from composer.text.strategies import parse

        try:
            parse(self.decoding)
        except InvalidInputError as exc:
            problems.append(str(exc))
        if not 0.0 <= self.smoothing_weight <= 1.0:
            problems.append(f"smoothing_weight = {self.smoothing_weight}: must be in [0, 1]")
        if self.refresh_every < 0:
            problems.append(f"refresh_every = {self.refresh_every}: must be >= 0")
        if problems:
            raise InvalidInputError("invalid text request: " + "; ".join(problems))


def _type_problems(sp: TextSamplingParam) -> list[str]:
    """Values of the wrong type (an API caller's 2.5 tokens, "hot" degrees) and numbers that are not finite (nan,
    inf): each setting's own message, before any range rule compares them."""
    problems = []
    for f in dataclasses.fields(sp):
        if f.name.startswith("_") or f.name == "prompt":
            continue
        value, kinds = getattr(sp, f.name), typing.get_args(field_types(type(sp))[f.name]) or (
            field_types(type(sp))[f.name],)
        if value is None and type(None) in kinds:
            continue
        if int in kinds and (isinstance(value, bool) or not isinstance(value, int)):
            problems.append(f"{f.name} = {value!r}: must be a whole number")
        elif float in kinds and (isinstance(value, bool) or not isinstance(value, (int, float))):
            problems.append(f"{f.name} = {value!r}: must be a number")
        elif float in kinds and not math.isfinite(value):
            problems.append(f"{f.name} = {value!r}: must be a finite number")
        elif bool in kinds and not isinstance(value, bool):
            problems.append(f"{f.name} = {value!r}: must be true or false")
        elif str in kinds and not isinstance(value, str):
            problems.append(f"{f.name} = {value!r}: must be a string")
    return problems
