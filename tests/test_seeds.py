"""A seed left to chance is drawn in one place (composer/seeds.py), from one range, whichever way the request came:
the Python API, a served job's record, a text request, rank 0 of a parallel layout."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

import composer
from composer import seeds

DRAWN = 4_000_000_000  # inside [0, 2**32), outside the old servers' [0, 2**31)


@pytest.fixture()
def fixed_draw(monkeypatch):
    monkeypatch.setattr(seeds, "draw_seed", lambda: DRAWN)


def test_the_python_api_and_a_served_job_take_the_one_draw(fixed_draw):
    from composer import VideoGenerator
    from composer.serve.requests import ServerLimits, check_body

    gen = VideoGenerator.from_pretrained("shapes-t2v", progress=False)
    assert gen.generate_video("a red circle", height=32, width=32, num_frames=5, num_inference_steps=1).seed == DRAWN
    assert check_body({"prompt": "a red circle"}, gen, ServerLimits()).params["seed"] == DRAWN


def test_a_text_request_takes_the_one_draw(fixed_draw):
    from composer import TextGenerator

    gen = TextGenerator.from_pretrained(None, progress=False)  # the embedded tiny-dllm
    assert gen.generate_text("1 + 2 =", gen_length=4, num_inference_steps=2).seed == DRAWN


def test_rank_0_draws_for_a_call_that_left_its_seed_to_chance(fixed_draw):
    from composer.parallel.ranks import RankLeader

    leader = SimpleNamespace(_generator=SimpleNamespace(default_sampling=SimpleNamespace(seed=None)))
    assert RankLeader._seeded(leader, {"prompt": "x"})["seed"] == DRAWN
    assert RankLeader._seeded(leader, {"prompt": "x", "seed": 7})["seed"] == 7


def test_draws_are_in_the_one_range_and_no_other_module_draws():
    assert all(0 <= seeds.draw_seed() < seeds.DRAWN_SEED_RANGE for _ in range(100))
    package = Path(composer.__file__).parent
    drawing = [str(p.relative_to(package)) for p in package.rglob("*.py")
               if "randrange(" in p.read_text() and p.name != "seeds.py"]
    assert drawing == ["text/tasks.py"], drawing  # (tiny-dllm's task data, not a request's seed)
