"""DBCache (`cache = dbcache`): threshold 0 is the exact path bit for bit; a large threshold skips the middle
blocks only, within the warmup, the caps and Fn/Bn; no state leaks between videos; batched and sequential CFG
decide alike; TaylorSeer changes only the cached steps; bad settings are refused."""

from __future__ import annotations

import pytest
import torch

from composer import VideoGenerator
from composer.accel.dbcache import DualBlockCache
from composer.errors import ConfigError
from composer.testing import build_tiny_wan

REQUEST = dict(prompt="a red ball", negative_prompt="blurry", height=48, width=80, num_frames=9,
               num_inference_steps=12, guidance_scale=5.0, seed=3)
STEPS = REQUEST["num_inference_steps"]


def _gen(folder, **runtime):
    return VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False, **runtime)


def _hook(gen):
    return next(h for h in gen.pipeline.hooks if h.name == "cache").hooks[0]


def _count_block_calls(gen) -> list[int]:
    """Forwards of each block, counted with forward hooks."""
    blocks = gen.pipeline.modules["transformer"].blocks
    calls = [0] * len(blocks)
    for i, block in enumerate(blocks):
        block.register_forward_hook(lambda *a, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


def _model_outputs(gen) -> list[torch.Tensor]:
    outputs = []
    gen.pipeline.modules["transformer"].register_forward_hook(lambda m, a, out: outputs.append(out.detach().clone()))
    return outputs


@pytest.fixture(scope="module")
def deep_wan_dir(tmp_path_factory):
    """The tiny model with 4 blocks: room for first, middle and last blocks."""
    return build_tiny_wan(tmp_path_factory.mktemp("models") / "tiny-wan-deep", num_layers=4)


@pytest.fixture(scope="module")
def exact(tiny_wan_dir):
    return _gen(tiny_wan_dir).generate_video(**REQUEST)


@pytest.mark.parametrize("taylorseer", [False, True])
def test_threshold_zero_is_the_exact_path_bit_for_bit(tiny_wan_dir, exact, one_thread, taylorseer):
    gen = _gen(tiny_wan_dir, cache="dbcache", cache_threshold=0.0, cache_taylorseer=taylorseer)
    result = gen.generate_video(**REQUEST)
    assert torch.equal(result.latents, exact.latents)
    assert _hook(gen).stats.skipped == 0 and _hook(gen).stats.calls == STEPS


def test_causal_threshold_zero_is_exact_and_each_block_decides_its_own_steps(tiny_causal_dir, one_thread):
    request = dict(prompt="a red ball", height=64, width=64, num_frames=13, seed=5)
    exact = _gen(tiny_causal_dir).generate_video(**request)
    gen = _gen(tiny_causal_dir, cache="dbcache", cache_threshold=0.0)
    assert torch.equal(gen.generate_video(**request).latents, exact.latents)
    loose = _gen(tiny_causal_dir, cache="dbcache", cache_threshold=100.0, cache_warmup_steps=1)
    result = loose.generate_video(**request)
    plans = _hook(loose).stats.per_run
    assert len(plans) > 1  # one loop per causal block
    assert all(plan[0] and plan[-1] for plan in plans.values())  # each block's first and last steps run
    assert _hook(loose).stats.skipped == sum(not ran for plan in plans.values() for ran in plan) > 0
    assert torch.isfinite(result.latents).all()


@pytest.mark.parametrize("fn, bn", [(1, 1), (2, 1), (1, 0)])
def test_a_large_threshold_skips_only_the_middle_blocks(deep_wan_dir, one_thread, fn, bn):
    gen = _gen(deep_wan_dir, cache="dbcache", cache_threshold=100.0, cache_warmup_steps=2,
               cache_fn_blocks=fn, cache_bn_blocks=bn)
    calls = _count_block_calls(gen)
    result = gen.generate_video(**REQUEST)
    stats = _hook(gen).stats
    assert stats.skipped == STEPS - 3  # the 2 warmup steps and the last one compute the middle
    assert stats.per_run == {0: [True, True] + [False] * (STEPS - 3) + [True]}
    ran = 3  # one batched CFG call per step that ran the middle blocks
    assert calls == [STEPS] * fn + [ran] * (4 - fn - bn) + [STEPS] * bn
    assert torch.isfinite(result.latents).all()


def test_max_cached_steps_and_max_consecutive_force_computed_steps(tiny_wan_dir, one_thread):
    runtime = dict(cache="dbcache", cache_threshold=100.0, cache_warmup_steps=1)
    capped = _gen(tiny_wan_dir, cache_max_cached_steps=4, **runtime)
    capped.generate_video(**REQUEST)
    assert _hook(capped).stats.per_run[0] == [True] + [False] * 4 + [True] * (STEPS - 5)
    assert _hook(capped).stats.skipped == 4
    in_a_row = _gen(tiny_wan_dir, cache_max_consecutive=2, **runtime)
    in_a_row.generate_video(**REQUEST)
    # steps 1..10 may be cached, two at a time; the last step runs
    assert _hook(in_a_row).stats.per_run[0] == [True] + [False, False, True] * 3 + [False, True]


def test_no_state_leaks_between_videos_of_different_sizes(tiny_wan_dir, one_thread):
    runtime = dict(cache="dbcache", cache_threshold=0.2, cache_taylorseer=True)
    small = dict(REQUEST, height=32, width=32)
    fresh = _gen(tiny_wan_dir, **runtime).generate_video(**small)
    used = _gen(tiny_wan_dir, **runtime)
    used.generate_video(**REQUEST)  # another size first, then the same request as the fresh generator's
    again = used.generate_video(**small)
    assert torch.equal(again.latents, fresh.latents)


def test_sequential_cfg_makes_the_same_decisions_as_batched(tiny_wan_dir, one_thread):
    runtime = dict(cache="dbcache", cache_threshold=0.15)  # each step's change is >= 0.0015 away from it
    batched_gen = _gen(tiny_wan_dir, **runtime)
    batched = batched_gen.generate_video(**REQUEST)
    sequential_gen = _gen(tiny_wan_dir, cfg_mode="sequential", **runtime)
    sequential = sequential_gen.generate_video(**REQUEST)
    plan = _hook(batched_gen).stats.per_run
    assert plan == _hook(sequential_gen).stats.per_run
    assert 0 < plan[0].count(False) < STEPS - 2  # some steps cached, not all
    assert _hook(sequential_gen).stats.skipped == 2 * _hook(batched_gen).stats.skipped  # one call per branch
    torch.testing.assert_close(sequential.latents, batched.latents, atol=1e-5, rtol=0)


def test_taylorseer_changes_only_the_cached_steps(tiny_wan_dir, one_thread):
    runtime = dict(cache="dbcache", cache_threshold=0.2, cache_warmup_steps=2)
    plain = _gen(tiny_wan_dir, **runtime)
    plain_out = _model_outputs(plain)
    plain.generate_video(**REQUEST)
    taylor = _gen(tiny_wan_dir, cache_taylorseer=True, **runtime)
    taylor_out = _model_outputs(taylor)
    result = taylor.generate_video(**REQUEST)
    plan = _hook(plain).stats.per_run[0]
    first = next(i for i, (a, b) in enumerate(zip(plain_out, taylor_out, strict=True)) if not torch.equal(a, b))
    assert not plan[first]  # the first step that differs reused the (extrapolated) residual
    assert _hook(taylor).stats.per_run[0][:first + 1] == plan[:first + 1]
    assert torch.isfinite(result.latents).all()


def test_taylorseer_extrapolates_the_middle_residual_linearly_in_the_step_index():
    cache = DualBlockCache(fn_blocks=1, bn_blocks=0, threshold=1.0, taylorseer=True)
    key = (0, (0,))
    cache._history[key] = [(2, torch.full((1, 3), 1.0)), (4, torch.full((1, 3), 2.0))]
    cache.index = 7
    assert torch.equal(cache.residual(key, torch.Size((1, 3))), torch.full((1, 3), 3.5))
    cache.taylorseer = False
    assert torch.equal(cache.residual(key, torch.Size((1, 3))), torch.full((1, 3), 2.0))
    assert cache.residual(key, torch.Size((2, 3))) is None  # another size: no residual to reuse


@pytest.mark.parametrize("kwargs, message", [
    (dict(cache="dbcache", cache_fn_blocks=0), "cache_fn_blocks = 0"),
    (dict(cache="dbcache", cache_bn_blocks=-1), "cache_bn_blocks = -1"),
    (dict(cache="dbcache", cache_max_cached_steps=-1), "cache_max_cached_steps = -1"),
    (dict(cache="dbcache", cache_max_consecutive=0), "cache_max_consecutive = 0"),
    (dict(cache="dbcache", cache_threshold=-0.1), "cache_threshold = -0.1"),
])
def test_bad_dbcache_settings_are_refused_before_loading(kwargs, message):
    from composer.runtime import RuntimeArgs

    with pytest.raises(ConfigError, match=message):
        RuntimeArgs.from_kwargs(device="cpu", **kwargs)


@pytest.mark.parametrize("fn, bn", [(2, 0), (1, 1), (2, 3)])
def test_first_and_last_blocks_must_leave_middle_blocks(tiny_wan_dir, fn, bn):
    with pytest.raises(ConfigError, match=f"cache_fn_blocks {fn} \\+ cache_bn_blocks {bn} = {fn + bn}, but "
                                          "transformer has 2 blocks"):
        _gen(tiny_wan_dir, cache="dbcache", cache_fn_blocks=fn, cache_bn_blocks=bn)


def test_under_sequence_parallelism_the_decision_sums_every_ranks_part(monkeypatch):
    """Each rank holds part of the tokens: the relative change is that of the whole residual, all-reduced."""
    from composer.accel import dbcache

    gen = torch.Generator().manual_seed(0)
    before, now = torch.randn(1, 8, 4, generator=gen), torch.randn(1, 8, 4, generator=gen)
    other_before, other_now = before[:, 4:], now[:, 4:]  # the peer rank's tokens

    def all_reduce(sums, group):  # the peer's two sums arrive
        assert group == "sp"
        sums += torch.stack([(other_now - other_before).abs().sum(), other_before.abs().sum()])

    monkeypatch.setattr(dbcache.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dbcache.dist, "all_reduce", all_reduce)
    cache = DualBlockCache(fn_blocks=1, bn_blocks=0, threshold=1.0, sp_group="sp")
    cache._signal = before[:, :4]
    whole = float((now - before).abs().sum() / before.abs().sum())
    assert cache.change(now[:, :4]) == pytest.approx(whole, rel=1e-6)
