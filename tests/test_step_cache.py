"""TeaCache (`cache = teacache`): threshold 0 is the exact path bit for bit; a large threshold skips the blocks on
most steps; the schedule planned before the loop equals TeaCache's step-by-step rule; no state leaks between
videos; batched and sequential CFG make the same decisions; causal models run it per block."""

from __future__ import annotations

import pytest
import torch

from composer import VideoGenerator
from composer.accel.step_cache import IDENTITY, TeaCachePlanner, plan_schedule, rescale
from composer.errors import ConfigError

REQUEST = dict(prompt="a red ball", negative_prompt="blurry", height=48, width=80, num_frames=9,
               num_inference_steps=12, guidance_scale=5.0, seed=3)


def _gen(folder, **runtime):
    return VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False, **runtime)


def _hook(gen):
    return next(h for h in gen.pipeline.hooks if h.name == "cache").hooks[0]


def _count_block_calls(gen) -> list[int]:
    calls = [0]
    gen.pipeline.modules["transformer"].blocks[0].register_forward_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.fixture(scope="module")
def exact(tiny_wan_dir):
    return _gen(tiny_wan_dir).generate_video(**REQUEST)


def test_threshold_zero_is_the_exact_path_bit_for_bit(tiny_wan_dir, exact, one_thread):
    gen = _gen(tiny_wan_dir, cache="teacache", cache_threshold=0.0)
    result = gen.generate_video(**REQUEST)
    assert torch.equal(result.latents, exact.latents)
    assert _hook(gen).stats.skipped == 0 and _hook(gen).stats.calls == REQUEST["num_inference_steps"]


def test_a_large_threshold_skips_most_steps_and_the_blocks_with_them(tiny_wan_dir, exact, one_thread):
    gen = _gen(tiny_wan_dir, cache="teacache", cache_threshold=100.0, cache_warmup_steps=2)
    blocks = _count_block_calls(gen)
    result = gen.generate_video(**REQUEST)
    stats = _hook(gen).stats
    steps = REQUEST["num_inference_steps"]
    assert stats.skipped == steps - 3  # the 2 warmup steps and the last one run
    assert blocks[0] == 3  # one batched CFG call per step that ran
    assert not torch.equal(result.latents, exact.latents)  # approximate...
    assert torch.isfinite(result.latents).all()


def test_the_plan_made_before_the_loop_equals_the_step_by_step_rule():
    gen = torch.Generator().manual_seed(0)
    signals = [torch.randn(1, 1, 6, 32, generator=gen) * (1 + 0.05 * i) for i in range(20)]
    for threshold in (0.0, 0.3, 1.0, 3.0):
        for coefficients in (IDENTITY, (0.0, 0.0, 1.0, 0.5, 0.0)):
            planned = plan_schedule(signals, threshold, coefficients, warmup_steps=2)
            planner = TeaCachePlanner(threshold, coefficients, 2, len(signals))
            assert planned == [planner.decide(i, s) for i, s in enumerate(signals)]
            assert planned[:2] == [True, True] and planned[-1]
    assert rescale((1.0, 2.0, 3.0), 2.0) == 11.0  # highest power first, as numpy.poly1d


def test_a_change_the_polynomial_maps_below_zero_runs_its_step():
    """Outside the range it was fitted on a polynomial can go negative: such a step runs (and is counted) instead
    of pulling the running sum down and skipping every step after it."""
    signals = [torch.full((1, 4), 1.0 + i) for i in range(8)]  # relative changes 1, 0.5, 0.33, ...
    falls = (-1.0, 0.0, 0.0)  # -x^2: negative for every change
    planner = TeaCachePlanner(0.1, falls, 1, len(signals))
    assert plan_schedule(signals, 0.1, falls, 1, planner) == [True] * 8
    assert planner.out_of_range == 6  # steps 1..6 (0 has no previous step, 7 is the last)


def test_no_state_leaks_between_videos_of_different_sizes(tiny_wan_dir, one_thread):
    runtime = dict(cache="teacache", cache_threshold=0.5)
    small = dict(REQUEST, height=32, width=32)
    fresh = _gen(tiny_wan_dir, **runtime).generate_video(**small)
    used = _gen(tiny_wan_dir, **runtime)
    used.generate_video(**REQUEST)  # another size first, then the same request as the fresh generator's
    again = used.generate_video(**small)
    assert torch.equal(again.latents, fresh.latents)


def test_sequential_cfg_makes_the_same_decisions_as_batched(tiny_wan_dir, one_thread):
    runtime = dict(cache="teacache", cache_threshold=0.5)
    batched_gen = _gen(tiny_wan_dir, **runtime)
    batched = batched_gen.generate_video(**REQUEST)
    sequential_gen = _gen(tiny_wan_dir, cfg_mode="sequential", **runtime)
    sequential = sequential_gen.generate_video(**REQUEST)
    assert _hook(batched_gen).stats.per_run == _hook(sequential_gen).stats.per_run
    assert 0 < _hook(batched_gen).stats.skipped
    torch.testing.assert_close(sequential.latents, batched.latents, atol=1e-5, rtol=0)


def test_causal_blocks_each_plan_their_own_few_steps(tiny_causal_dir, one_thread):
    request = dict(prompt="a red ball", height=64, width=64, num_frames=13, seed=5)
    exact = _gen(tiny_causal_dir).generate_video(**request)
    gen = _gen(tiny_causal_dir, cache="teacache", cache_threshold=0.0)
    assert torch.equal(gen.generate_video(**request).latents, exact.latents)
    loose = _gen(tiny_causal_dir, cache="teacache", cache_threshold=100.0, cache_warmup_steps=1)
    result = loose.generate_video(**request)
    plans = _hook(loose).stats.per_run
    assert len(plans) > 1  # one plan per block
    assert all(plan[0] and plan[-1] for plan in plans.values())  # each block's first and last steps run
    assert torch.isfinite(result.latents).all()


@pytest.mark.parametrize("kwargs, message", [
    (dict(cache="magic"), "cache = 'magic'"),
    (dict(cache="teacache", cache_threshold=-1), "cache_threshold = -1"),
    (dict(cache="teacache", cache_warmup_steps=0), "cache_warmup_steps = 0"),
])
def test_bad_cache_settings_are_refused_before_loading(kwargs, message):
    from composer.runtime import RuntimeArgs

    with pytest.raises(ConfigError, match=message):
        RuntimeArgs.from_kwargs(device="cpu", **kwargs)


def _psnr(a, b) -> float:
    import numpy as np

    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


def test_thresholds_default_to_the_family_recommendation(tiny_wan_dir):
    """Unset, `cache_threshold` is the family's: Wan's per fitted width, else the raw-change default; dbcache's."""
    from composer.configs.demo import ShapesT2VConfig
    from composer.configs.wan import WanT2VConfig

    gen = _gen(tiny_wan_dir, cache="teacache")  # width 64: no fitted coefficients
    assert _hook(gen).threshold == WanT2VConfig().teacache_threshold
    assert WanT2VConfig().teacache_thresholds.keys() == WanT2VConfig().teacache_coefficients.keys()
    assert _hook(_gen(tiny_wan_dir, cache="teacache", cache_threshold=0.3)).threshold == 0.3
    shapes = _gen(None, cache="dbcache")
    assert shapes.pipeline.modules["transformer"].step_cache.threshold == ShapesT2VConfig().dbcache_threshold
    shapes = _hook(_gen(None, cache="teacache"))  # fitted coefficients for its width: the per-width threshold
    assert shapes.coefficients == ShapesT2VConfig().teacache_coefficients[128] != IDENTITY
    assert shapes.threshold == ShapesT2VConfig().teacache_thresholds[128]


@pytest.mark.slow
def test_defaults_on_the_shapes_model_skip_half_at_30_db(one_thread):
    """The recommendation, small: `cache=teacache` / `cache=dbcache` with no other knob on the shipped shapes
    model at 30 steps keep PSNR >= 30 dB; teacache (the better) skips at least half the steps, dbcache a third."""
    request = dict(prompt="a red circle moving left", seed=0, num_inference_steps=30)
    exact = _gen(None).generate_video(**request).frames
    for cache, least in (("teacache", 0.5), ("dbcache", 1 / 3)):
        gen = _gen(None, cache=cache)
        frames = gen.generate_video(**request).frames
        stats = _hook(gen).stats
        assert stats.skipped >= least * stats.calls, (cache, stats.summary())
        assert _psnr(frames, exact) >= 30.0, cache
