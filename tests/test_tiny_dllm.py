"""The embedded text model tiny-dllm (composer/demo/models/tiny-dllm, trained by demo/dllm.py): it loads by name and
as TextGenerator's default, states its sampling defaults in its folder, answers held-out additions on the exact
path, and parallel decoding needs several times fewer forwards at the same accuracy (benchmarks/dllm.py measures
the full table)."""

from __future__ import annotations

import pytest

from composer import TextGenerator
from composer.text import tasks


@pytest.fixture(scope="module")
def gen():
    return TextGenerator.from_pretrained(progress=False)  # the embedded default text model


@pytest.fixture(scope="module")
def problems():
    return tasks.held_out_problems(64, seed=1)


def _score(results, problems):
    return sum(tasks.correct(r.text, answer) for r, (_, answer) in zip(results, problems)) / len(problems)


def test_it_loads_by_name_with_its_folders_defaults(gen):
    assert gen.family == "tiny-dllm" and type(gen.pipeline.modules["model"]).__name__ == "LLaDAModelLM"
    sp = gen.default_sampling
    assert (sp.gen_length, sp.block_length, sp.num_inference_steps, sp.use_chat_template) == (8, 8, 8, False)
    assert TextGenerator.from_pretrained("composer/tiny-dllm", progress=False).family == "tiny-dllm"


def test_it_answers_held_out_additions_and_parallel_decoding_keeps_them(gen, problems):
    prompts = [p for p, _ in problems]
    exact = gen.generate_text(prompts, seed=0)
    fast = gen.generate_text(prompts, seed=0, decoding="threshold", threshold=0.9)
    assert _score(exact, problems) >= 0.95  # 300 of 300 when it was trained (docs/text-diffusion.md)
    assert _score(fast, problems) >= _score(exact, problems) - 0.02
    assert fast[0].stats.forwards * 3 <= exact[0].stats.forwards  # >= 3x fewer forwards for the batch
    assert tasks.correct("1 2 3", "1 2 3") and not tasks.correct("1 2 3 4", "1 2 3") and not tasks.correct("", "1")
