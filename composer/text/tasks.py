"""The scored task of the embedded text model `tiny-dllm`: addition of two numbers below 1000.

A prompt is the two operands, zero-padded to three digits, one token per digit: "0 4 7 + 5 9 1 =" (8 tokens). The
answer is the sum's digits, "6 3 8", then EOS. Pairs with (1000 a + b) % 97 == 0 (10,310 of the million) are held
out: never trained on, the problems every accuracy figure is measured on.
"""

from __future__ import annotations

import random
import re

DIGITS = 3
HELD_OUT_MODULUS = 97

# The model's chat template (its tokenizer_config.json): the last user message, when it is a sum of two numbers of
# up to three digits however spaced ("123+456=", "7 + 5"), written as prompt_for writes it ("1 2 3 + 4 5 6 ="); any
# other text as it is. Applied to plain prompts too (its composer.json: use_chat_template).
CHAT_TEMPLATE = (
    "{%- set ns = namespace(text='') -%}"
    "{%- for m in messages if m['role'] == 'user' -%}{%- set ns.text = m['content'] -%}{%- endfor -%}"
    "{%- set parts = ns.text.replace(' ', '').rstrip('=').split('+') -%}"
    "{%- if parts | length == 2 and parts[0].isdecimal() and parts[1].isdecimal() and parts[0] | length <= 3"
    " and parts[1] | length <= 3 -%}"
    "{{ ('%03d' | format(parts[0] | int)) | list | join(' ') }} + "
    "{{ ('%03d' | format(parts[1] | int)) | list | join(' ') }} ="
    "{%- else -%}{{ ns.text }}{%- endif -%}")


def prompt_for(a: int, b: int) -> str:
    return " ".join(f"{a:0{DIGITS}d}") + " + " + " ".join(f"{b:0{DIGITS}d}") + " ="


def answer_for(a: int, b: int) -> str:
    return " ".join(str(a + b))


def is_held_out(a: int, b: int) -> bool:
    return (1000 * a + b) % HELD_OUT_MODULUS == 0


def held_out_problems(count: int, seed: int = 0) -> list[tuple[str, str]]:
    """`count` distinct held-out problems (prompt, answer), the same for a seed on every machine."""
    pairs = [(a, b) for a in range(10**DIGITS) for b in range(10**DIGITS) if is_held_out(a, b)]
    chosen = random.Random(seed).sample(pairs, count)
    return [(prompt_for(a, b), answer_for(a, b)) for a, b in chosen]


def training_pair(rng: random.Random) -> tuple[int, int]:
    """A random pair that is not held out."""
    while True:
        a, b = rng.randrange(10**DIGITS), rng.randrange(10**DIGITS)
        if not is_held_out(a, b):
            return a, b


def correct(text: str, answer: str) -> bool:
    """Whether generated text states the answer: its digits (spaces and anything after them ignored) are the sum's."""
    found = re.match(r"\s*([0-9 ]+)", text)
    return found is not None and found.group(1).replace(" ", "") == answer.replace(" ", "")
