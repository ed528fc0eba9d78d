"""TextSamplingParam: one text request, with diffusers' names (LLaDA2Pipeline's `__call__` arguments)."""

from __future__ import annotations

from dataclasses import dataclass, field

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

    def check(self) -> None:
        """Every bad value in one InvalidInputError (the request's input, checked once before any work)."""
        problems = []
        prompts = [self.prompt] if isinstance(self.prompt, str) else self.prompt
        if not prompts or not all(isinstance(p, str) for p in prompts):
            problems.append("prompt: give a string or a non-empty list of strings")
        elif isinstance(self.prompt, list) and self.use_chat_template and len(self.prompt) > 1:
            pass  # each prompt gets its own template (composer runs rows of one request as one batch of ids)
        for name in ("gen_length", "num_inference_steps", "minimal_topk"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} = {getattr(self, name)}: must be > 0")
        if self.block_length is not None and self.block_length <= 0:
            problems.append(f"block_length = {self.block_length}: must be > 0")
        if self.max_post_steps < 0:
            problems.append(f"max_post_steps = {self.max_post_steps}: must be >= 0")
        if self.temperature < 0:
            problems.append(f"temperature = {self.temperature}: must be >= 0")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p = {self.top_p}: must be in (0, 1]")
        if self.threshold < 0:
            problems.append(f"threshold = {self.threshold}: must be >= 0 (above 1: commit the top-k only)")
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
