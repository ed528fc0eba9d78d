"""The embedded text model tiny-dllm (composer/demo/models/tiny-dllm, trained by demo/dllm.py): it loads by name and
as TextGenerator's default, states its sampling defaults in its folder, answers held-out additions on the exact
path, and parallel decoding needs several times fewer forwards at the same accuracy (benchmarks/dllm.py measures
the full table). Its chat template writes a sum as the model was trained ("123+456=" -> "1 2 3 + 4 5 6 ="), so a
newcomer's prompt and a chat request are answered; text its tokenizer does not know is a WARNING naming it."""

from __future__ import annotations

import pytest

from composer import TextGenerator
from composer.text import tasks

THRESHOLD = 0.9  # the folder's (composer.json): measured on all 10,310 held-out problems (docs/text-diffusion.md)


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
    assert (sp.gen_length, sp.block_length, sp.num_inference_steps, sp.use_chat_template) == (8, 8, 8, True)
    assert sp.threshold == THRESHOLD and gen.limits.context == 64
    assert TextGenerator.from_pretrained("composer/tiny-dllm", progress=False).family == "tiny-dllm"


def test_it_answers_held_out_additions_and_parallel_decoding_keeps_them(gen, problems):
    prompts = [p for p, _ in problems]
    one_a_step = gen.generate_text(prompts, seed=0, threshold=1.01)  # the schedule alone: one token a step
    exact = gen.generate_text(prompts, seed=0)  # the folder's threshold
    fast = gen.generate_text(prompts, seed=0, decoding="threshold")
    assert _score(one_a_step, problems) >= 0.95  # 300 of 300 when it was trained (docs/text-diffusion.md)
    assert min(_score(exact, problems), _score(fast, problems)) >= _score(one_a_step, problems)
    assert exact[0].stats.forwards * 2 <= one_a_step[0].stats.forwards  # the folder's default saves steps
    assert fast[0].stats.forwards * 3 <= one_a_step[0].stats.forwards
    assert tasks.correct("1 2 3", "1 2 3") and not tasks.correct("1 2 3 4", "1 2 3") and not tasks.correct("", "1")


def test_a_newcomers_sum_and_a_chat_request_are_answered(gen):
    assert gen.generate_text("123+456=", seed=0).text == "5 7 9"  # the chat template writes it as trained
    assert gen.generate_text("0 4 7 + 5 9 1 =", seed=0).text == "6 3 8"
    reply = gen.generate_text(messages=[{"role": "system", "content": "add"}, {"role": "user", "content": "999 + 1"}],
                              seed=0)
    assert reply.text == "1 0 0 0" and reply.prompt_tokens == 8


def test_text_the_tokenizer_does_not_know_is_a_warning_naming_it(gen, log):
    gen.generate_text("1234+5=", seed=0)  # four digits: not the model's form, left as written
    assert "WARNING the prompt has text the model's tokenizer does not know: '1234'" in log.getvalue()
    gen.generate_text(["12+5", "what is 7 plus 5"], seed=0)
    said = log.getvalue()
    assert "prompt[1] has text the model's tokenizer does not know: 'what', 'is', 'plus'" in said
    assert "prompt[0]" not in said
