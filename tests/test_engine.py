"""The denoising engine: the one call site of the transformer, batched vs sequential CFG, and its hook points
(before/after a step, around the model call), for text-to-video and causal pipelines."""

from __future__ import annotations

import pytest
import torch

from composer import VideoGenerator
from composer.engine import EngineHook

T2V = dict(height=32, width=32, num_frames=5, num_inference_steps=4, seed=3, negative_prompt="gray")


class Recorder(EngineHook):
    """Counts steps and model calls (with their rows and kind)."""

    def __init__(self):
        self.before, self.after, self.calls = [], [], []

    def before_step(self, info):
        self.before.append((info.run, info.index, info.num_steps))

    def after_step(self, info):
        self.after.append((info.run, info.index))

    def around_model(self, call, model_call):
        self.calls.append((model_call.kind, model_call.latents.shape[0], model_call.step is not None))
        return call(model_call)


class CountForward:
    """Counts every forward of a module, however it is reached (a forward pre-hook)."""

    def __init__(self, module):
        self.count = 0
        self.handle = module.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.count += 1


def _hooked(gen, hook):
    (engine,) = gen.pipeline.engines
    engine.add_hook(hook)
    return engine


@pytest.fixture(scope="module")
def t2v_pair(tiny_wan_dir):
    batched = VideoGenerator.from_pretrained(tiny_wan_dir, dtype="fp32", progress=False)
    sequential = VideoGenerator.from_pretrained(tiny_wan_dir, dtype="fp32", progress=False, cfg_mode="sequential")
    return batched, sequential


def test_t2v_batched_cfg_is_one_call_per_step_and_equals_sequential(t2v_pair):
    batched, sequential = t2v_pair
    rec_b, rec_s = Recorder(), Recorder()
    _hooked(batched, rec_b), _hooked(sequential, rec_s)
    count_b = CountForward(batched.pipeline.modules["transformer"])
    count_s = CountForward(sequential.pipeline.modules["transformer"])
    try:
        a = batched.generate_video("a red circle", guidance_scale=5.0, **T2V)
        b = sequential.generate_video("a red circle", guidance_scale=5.0, **T2V)
    finally:
        batched.pipeline.engines[0].hooks.remove(rec_b), sequential.pipeline.engines[0].hooks.remove(rec_s)
        count_b.handle.remove(), count_s.handle.remove()
    steps = T2V["num_inference_steps"]
    assert rec_b.before == [(0, i, steps) for i in range(steps)] and len(rec_b.after) == steps
    assert rec_b.calls == [("step", 2, True)] * steps  # cond + uncond as one batch of 2
    assert rec_s.calls == [("step", 1, True)] * (2 * steps)
    # every transformer forward went through the engine's one call site
    assert count_b.count == len(rec_b.calls) and count_s.count == len(rec_s.calls)
    assert (a.latents - b.latents).abs().max().item() <= 1e-5
    assert a.frames.std() > 1.0


def test_an_around_model_hook_sees_and_can_change_the_prediction(t2v_pair):
    gen, _ = t2v_pair

    class Zero(EngineHook):
        def around_model(self, call, model_call):
            return torch.zeros_like(call(model_call))

    base = gen.generate_video("a red circle", guidance_scale=1.0, **T2V)
    engine = _hooked(gen, Zero())
    try:
        zeroed = gen.generate_video("a red circle", guidance_scale=1.0, **T2V)
    finally:
        engine.hooks.pop()
    again = gen.generate_video("a red circle", guidance_scale=1.0, **T2V)
    # a zero flow leaves the scheduler's latents at the initial noise: the hook's output is what was used
    assert (zeroed.latents - base.latents).abs().max().item() > 1e-2
    assert torch.equal(again.latents, base.latents)


CAUSAL = dict(height=32, width=48, num_frames=4 * (6 - 1) + 1, seed=4, rollout_blocks=2, overlap_frames=2)


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_causal_blocks_run_through_the_engine(tiny_causal_dir, guidance):
    gen = VideoGenerator.from_pretrained(tiny_causal_dir, progress=False)
    rec = Recorder()
    _hooked(gen, rec)
    count = CountForward(gen.pipeline.modules["transformer"])
    result = gen.generate_video("a red circle", guidance_scale=guidance, negative_prompt="", **CAUSAL)
    steps = len(gen.pipeline.config.denoising_step_list)
    blocks = 3  # 6 latent frames in blocks of 2
    rows = 2 if guidance > 1 else 1
    assert [b[0] for b in rec.before] == [b for b in range(blocks) for _ in range(steps)]
    step_calls = [c for c in rec.calls if c[0] == "step"]
    context_calls = [c for c in rec.calls if c[0] == "context"]
    assert step_calls == [("step", rows, True)] * (blocks * steps)
    # one clean pass per block, plus the prefill of the second rollout's 2 overlap frames (one chunk)
    assert context_calls == [("context", rows, False)] * (blocks + 1)
    assert count.count == len(rec.calls)
    assert result.stats.rollouts == 2


def test_causal_sequential_cfg_equals_batched(tiny_causal_dir):
    """Sequential CFG keeps one KV cache per branch; batched shares one cache of twice the rows."""
    kwargs = dict(guidance_scale=3.0, negative_prompt="a blue square", **CAUSAL)
    batched = VideoGenerator.from_pretrained(tiny_causal_dir, progress=False).generate_video("a red circle", **kwargs)
    seq_gen = VideoGenerator.from_pretrained(tiny_causal_dir, progress=False, cfg_mode="sequential")
    sequential = seq_gen.generate_video("a red circle", **kwargs)
    recomputed = seq_gen.generate_video("a red circle", kv_cache=False, **kwargs)
    assert (batched.latents - sequential.latents).abs().max().item() <= 1e-5
    assert (sequential.latents - recomputed.latents).abs().max().item() <= 1e-5
    assert batched.stats.kv_cache_bytes == sequential.stats.kv_cache_bytes


def test_cfg_mode_is_checked():
    from composer.errors import ConfigError
    from composer.runtime import RuntimeArgs

    with pytest.raises(ConfigError, match="cfg_mode = 'parallel': expected one of batched, sequential"):
        RuntimeArgs.from_kwargs(cfg_mode="parallel")
