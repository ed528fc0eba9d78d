"""composer's LLaDA model (composer/models/llada) and the decoding strategies (composer/text/strategies.py).

The model loads from a folder in LLaDA's own config keys and weight names through composer's model registry; its
prefix K/V reproduce the full forward; each strategy's rule does what it says; `kv` refreshed every step and
`smooth` at weight 0 change nothing; strategies that cannot run on a model say so before any forward."""

from __future__ import annotations

import pytest
import torch

from composer import TextGenerator
from composer.errors import InvalidInputError, UnsupportedError
from composer.testing.tiny_llada2 import TinyLLaDA2Spec, build_tiny_llada2
from composer.text import strategies

pytestmark = pytest.mark.slow
PROMPT = "what is two plus two ?"


@pytest.fixture(scope="module")
def llada(tmp_path_factory):
    folder = build_tiny_llada2(tmp_path_factory.mktemp("text") / "tiny-llada", TinyLLaDA2Spec(model="llada"))
    return TextGenerator.from_pretrained(folder, progress=False)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = build_tiny_llada2(tmp_path_factory.mktemp("text") / "tiny-llama")
    return TextGenerator.from_pretrained(folder, progress=False)


def test_the_llada_model_loads_in_its_own_names_and_reuses_prefix_kv(llada):
    model = llada.pipeline.modules["model"]
    assert type(model).__name__ == "LLaDAModelLM"
    assert "model.transformer.blocks.0.attn_out.weight" in model.state_dict()
    ids = torch.randint(0, model.config.vocab_size, (2, 14))
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[1, :3] = 0  # padding keys
    full = model(ids, attention_mask=mask, use_cache=True)
    prefix = [(k[:, :, :10], v[:, :, :10]) for k, v in full.past_key_values]
    tail = model(ids[:, 10:], attention_mask=mask, position_ids=torch.arange(10, 14).expand(2, -1),
                 past_key_values=prefix)
    torch.testing.assert_close(tail.logits, full.logits[:, 10:], atol=1e-5, rtol=1e-5)
    bidirectional = model(ids[:, :10], attention_mask=mask[:, :10]).logits  # earlier positions see later ones
    assert not torch.allclose(bidirectional, full.logits[:, :10], atol=1e-4)


def test_commit_rules():
    mask = 9
    current = torch.tensor([[mask, mask, 4, mask, mask, mask]])
    tokens = torch.tensor([[1, 2, 3, 4, 5, 6]])
    probs = torch.tensor([[0.95, 0.2, 0.99, 0.6, 0.3, 0.7]])

    def decoder(decoding, **kw):
        settings = dict(threshold=0.9, low_threshold=0.5, smoothing_weight=0.5, refresh_every=0, mask_id=mask)
        return strategies.Decoder(strategies.parse(decoding), **{**settings, **kw})

    logits = torch.zeros(1, 6, 10)
    got = decoder("threshold").commit(current, logits, tokens, probs)
    assert got.committed.tolist() == [[True, False, False, False, False, False]]  # above 0.9, masked only
    got = decoder("threshold", threshold=0.99).commit(current, logits, tokens, probs)
    assert got.committed.sum() == 1 and bool(got.committed[0, 0])  # none above: the most confident one
    got = decoder("hierarchical").commit(current, logits, tokens, probs)
    # runs of masks: [0, 1] -> 0 (0.95), [3, 4, 5] -> 5 (0.7 > 0.5)
    assert got.committed.tolist() == [[True, False, False, False, False, True]]
    assert got.block.tolist() == [[1, mask, 4, mask, mask, 6]]
    credit = decoder("credit", threshold=0.8)
    first = credit.commit(current, logits, tokens, probs * 0 + 0.6)  # 0.6 everywhere: only the best one
    assert first.committed.sum() == 1
    second = credit.commit(current, logits, tokens, probs * 0 + 0.6)  # the same tokens again: 1 - 0.4^2 = 0.84
    assert second.committed[0, [0, 1, 3, 4, 5]].all()
    changed = decoder("credit", threshold=0.8)
    changed.commit(current, logits, tokens, probs * 0 + 0.6)
    third = changed.commit(current, logits, tokens + 1, probs * 0 + 0.6)  # another mind: the credit starts over
    assert third.committed.sum() == 1


@pytest.mark.parametrize("bad", ["fast", "exact+kv", "threshold+credit", ""])
def test_bad_decoding_values_are_refused(bad, llada):
    with pytest.raises(InvalidInputError, match="decoding"):
        llada.generate_text(PROMPT, decoding=bad, gen_length=8)


def test_kv_refreshed_every_step_and_smooth_at_weight_0_change_nothing(llada):
    settings = dict(gen_length=24, seed=0, temperature=1.0, threshold=0.3)
    plain = llada.generate_text(PROMPT, decoding="threshold", **settings)
    assert llada.generate_text(PROMPT, decoding="threshold+kv", refresh_every=1, **settings).token_ids == \
        plain.token_ids
    assert llada.generate_text(PROMPT, decoding="threshold+smooth", smoothing_weight=0.0, **settings).token_ids == \
        plain.token_ids
    for decoding in ("threshold+kv", "hierarchical+smooth", "credit+kv+smooth"):
        result = llada.generate_text(PROMPT, decoding=decoding, **settings)
        assert len(result.token_ids) == 24 and result.stats.forwards >= 3  # one block of 8 at least a step each
    exact = llada.generate_text(PROMPT, **settings)
    assert plain.stats.forwards < exact.stats.forwards  # parallel decoding: fewer forwards than the schedule's


def test_strategies_a_model_cannot_run_are_refused_before_any_forward(llama):
    with pytest.raises(UnsupportedError, match="kv"):
        llama.generate_text(PROMPT, decoding="threshold+kv", gen_length=8)
    # smoothing only needs the input embeddings: a transformers model has them
    result = llama.generate_text(PROMPT, decoding="threshold+smooth", gen_length=8, seed=0)
    assert len(result.token_ids) == 8


def test_compile_regional_gives_the_eager_ids(tmp_path):
    """compile = regional on composer's LLaDA model (each block's forward compiled once): the same ids as eager for a
    sampled request and a strategy. (A transformers model without declared blocks compiles whole, as the video
    models' hook does: tests/test_hooks.py.)"""
    for model in ("llada",):
        folder = build_tiny_llada2(tmp_path / model, TinyLLaDA2Spec(model=model))
        eager = TextGenerator.from_pretrained(folder, progress=False)
        compiled = TextGenerator.from_pretrained(folder, progress=False, compile="regional")
        for settings in ({"temperature": 1.0}, {"decoding": "threshold", "threshold": 0.3}):
            a = eager.generate_text(PROMPT, gen_length=16, num_inference_steps=4, seed=0, **settings)
            b = compiled.generate_text(PROMPT, gen_length=16, num_inference_steps=4, seed=0, **settings)
            assert a.token_ids == b.token_ids, (model, settings)


def test_tensor_parallel_on_two_ranks_gives_one_process_ids(tmp_path):
    """tp_size=2 under torchrun (2 gloo ranks): composer's LLaDA model split by heads and MLP units, each rank
    holding half of the q rows; every rank's ids equal one process's (sampled, threshold, threshold+kv)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from composer.testing.distributed import free_port

    folder = build_tiny_llada2(tmp_path / "llada", TinyLLaDA2Spec(model="llada"))
    script = Path(__file__).parent / "scripts" / "text_tp_script.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                           "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(script), str(folder),
                           str(tmp_path)], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    gen = TextGenerator.from_pretrained(folder, progress=False)
    expected = {name: gen.generate_text("what is two plus two ?", gen_length=16, num_inference_steps=4,
                                        **settings).token_ids
                for name, settings in {"sampled": {"temperature": 1.0, "seed": 1},
                                       "threshold": {"decoding": "threshold", "threshold": 0.3, "seed": 2},
                                       "kv": {"decoding": "threshold+kv", "threshold": 0.3, "seed": 3}}.items()}
    stats, unseeded = [], []
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        unseeded.append(got["unseeded"])
        assert got["ids"] == expected, rank
        assert got["concurrent"] == expected, rank  # at once, as tasks sharing forwards: each as alone
        stats.append(got["stats"])
    assert unseeded[0] == unseeded[1]  # a request without a seed: rank 0's draw on both ranks, the same ids
    assert stats[0] == stats[1]  # (calls, units, batched units): the same forwards on both ranks, rank 0's plan
    calls, units, batched = stats[0]
    assert batched >= 2 and calls < units, stats[0]  # the requests shared forwards
    assert got["q_rows"] == gen.pipeline.modules["model"].config.d_model // 2  # this rank's half of q


def test_tensor_parallel_needs_composers_model_code(llama):
    folder = llama.pipeline.folder
    with pytest.raises(UnsupportedError, match="composer's own model code"):
        TextGenerator.from_pretrained(folder, progress=False, tp_size=2)
