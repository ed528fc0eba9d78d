"""Sequence parallelism in the Wan DiT (Ulysses, Ring, USP) on 2 and 4 gloo ranks equals one process: the
bidirectional model, per-frame timesteps, the causal model's masked reference and its KV-cached blocks, for
token counts per frame that do not divide by the degree."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from composer.cache import KVCache, KVCacheSpec
from composer.errors import ConfigError
from composer.models.wan.causal import CausalWanTransformer3DModel
from composer.models.wan.config import WanTransformerConfig
from composer.models.wan.transformer import WanTransformer3DModel
from composer.parallel import state as parallel_state
from composer.parallel.sequence import SequenceParallel, TokenSplit, apply_sequence_parallel
from composer.testing.distributed import spawn

CONFIG = dict(num_attention_heads=4, attention_head_dim=16, text_dim=16, ffn_dim=64, num_layers=2, freq_dim=32)


def _model(cls=WanTransformer3DModel):
    torch.manual_seed(0)
    model = cls(WanTransformerConfig(**CONFIG)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def _runtime(ulysses: int, ring: int):
    return SimpleNamespace(ulysses_degree=ulysses, ring_degree=ring, tp_size=1, cfg_parallel=False, num_gpus=None,
                           device="cpu", dist_timeout=30.0)


def _sequence_parallel(ulysses: int, ring: int) -> SequenceParallel:
    state = parallel_state.init_parallel(_runtime(ulysses, ring))
    return SequenceParallel(state.group("ulysses"), state.group("ring"), state.group("sp"))


def _inputs(latent_hw=(6, 10), frames=3, batch=2):
    gen = torch.Generator().manual_seed(1)
    latents = torch.randn(batch, 16, frames, *latent_hw, generator=gen)  # 3 x 5 = 15 tokens a frame
    text = torch.randn(batch, 7, 16, generator=gen)
    return latents, text


def _bidirectional_worker(rank, world, ulysses, ring):
    model = _model()
    latents, text = _inputs()
    t = torch.tensor([700.0, 300.0])
    per_frame = torch.tensor([[900.0, 500.0, 100.0], [50.0, 60.0, 70.0]])
    with torch.no_grad():
        expected = [model(latents, t, text), model(latents, per_frame, text)]
        apply_sequence_parallel(model, _sequence_parallel(ulysses, ring))
        got = [model(latents, t, text), model(latents, per_frame, text)]
    for e, g in zip(expected, got):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=0)


def _causal_worker(rank, world, ulysses, ring):
    model = _model(CausalWanTransformer3DModel)
    latents, text = _inputs(frames=4, batch=1)
    chunks = [(0, 2), (2, 4)]
    with torch.no_grad():
        cross_kv = model.cross_attention_kv(text)
        timestep = torch.tensor([[500.0, 500.0, 200.0, 200.0]])
        expected = model.forward_masked(latents, timestep, cross_kv, chunks)
        apply_sequence_parallel(model, _sequence_parallel(ulysses, ring))
        masked = model.forward_masked(latents, timestep, cross_kv, chunks)
        torch.testing.assert_close(masked, expected, atol=1e-5, rtol=0)

        heads, tpf = model.kv_cache_layout(model.tokens_per_frame(6, 10))
        # the cache is sharded by heads under Ulysses and by tokens (this ring rank's parts of each frame) under
        # a ring: 4 heads, 15 tokens a frame on one device
        assert heads == 4 // ulysses
        assert tpf == (15 if ring == 1 else -(-15 // (ulysses * ring)) * ulysses)
        cache = KVCache(KVCacheSpec(num_layers=2, batch_size=1, num_heads=heads, head_dim=16, tokens_per_frame=tpf,
                                    capacity_frames=4), torch.float32, "cpu")
        cached = [model.forward_cached(latents[:, :, s:e], timestep[:, s:e], cross_kv, cache, s) for s, e in chunks]
        torch.testing.assert_close(torch.cat(cached, dim=2), expected, atol=1e-5, rtol=0)


LAYOUTS = [(2, 1), (1, 2), (4, 1), (1, 4), (2, 2)]


def _ids(layout):
    return f"ulysses{layout[0]}-ring{layout[1]}"


@pytest.mark.parametrize("layout", [pytest.param(x, marks=pytest.mark.slow) if x[0] * x[1] == 4 else x
                                    for x in LAYOUTS], ids=_ids)
def test_sequence_parallel_dit_equals_one_process(layout):
    spawn(_bidirectional_worker, layout[0] * layout[1], *layout)


@pytest.mark.parametrize("layout", [pytest.param(x, marks=pytest.mark.slow) if x[0] * x[1] == 4 else x
                                    for x in LAYOUTS], ids=_ids)
def test_sequence_parallel_causal_masked_and_cached_equal_one_process(layout):
    spawn(_causal_worker, layout[0] * layout[1], *layout)


def test_token_split_parts_cover_every_frame_once():
    split = TokenSplit(frames=3, tokens_per_frame=15, degree=4)
    assert split.part == 4 and split.padded == 16
    assert [split.valid(p, 1) for p in range(4)] == [4, 4, 4, 3]
    assert split.valid(2, 2) == 7


def _heads_worker(rank, world):
    model = _model()  # 4 heads: Ulysses 4 fits, but TP-local heads of 3 would not
    sp = _sequence_parallel(world, 1)
    with pytest.raises(ConfigError, match="does not divide the 3 attention heads"):
        sp.check_heads(3)
    apply_sequence_parallel(model, sp)


def test_ulysses_refuses_heads_it_cannot_split():
    spawn(_heads_worker, 2)
