"""Text requests at once share model forwards (composer/text/batching.py), and each gives its solo run's ids:
different prompts, lengths, block lengths, seeds, sampled and greedy, a list-of-prompts request, and a strategy
that cannot share (kv) running beside them; on a causal transformers model and on composer's bidirectional LLaDA."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers import held, until

from composer import TextGenerator
from composer.errors import UnsupportedError
from composer.testing.tiny_llada2 import TinyLLaDA2Spec, build_tiny_llada2

pytestmark = pytest.mark.slow
REQUESTS = [
    ("what is two plus two ?", {"gen_length": 16, "seed": 1}),
    ("the cat is red", {"gen_length": 24, "seed": 2, "temperature": 1.0}),
    (["sort the list one five two", "why is the sky blue ?"], {"gen_length": 12, "seed": 3, "temperature": 0.8,
                                                               "use_chat_template": False}),
    ("a big dog", {"gen_length": 20, "seed": 4, "block_length": 4, "temperature": 1.0, "decoding": "threshold",
                   "threshold": 0.3}),
]


class SlowForward(torch.nn.Module):
    """The model, 20 ms slower a forward: the other requests' steps queue meanwhile (as on a real model)."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def forward(self, *args, **kwargs):
        time.sleep(0.02)
        return self.inner(*args, **kwargs)


def _together(gen, requests, batched: int):
    """The requests at once, each on its thread; the batcher is held until `batched` of them have their first
    forward queued, so those share it whatever the threads' timing."""
    results = [None] * len(requests)

    def run(i, prompt, settings):
        results[i] = gen.generate_text(prompt, num_inference_steps=4, **settings)

    threads = [threading.Thread(target=run, args=(i, p, s)) for i, (p, s) in enumerate(requests)]
    with held(gen, batched):
        for t in threads:
            t.start()
    for t in threads:
        t.join(120)
    return results


@pytest.mark.parametrize("model", ["llama", "llada"])
def test_requests_at_once_share_forwards_and_each_equals_its_solo_run(model, tmp_path):
    folder = build_tiny_llada2(tmp_path / model, TinyLLaDA2Spec(model=model))
    gen = TextGenerator.from_pretrained(folder, progress=False)
    requests = list(REQUESTS)
    if model == "llada":  # a request whose strategy runs its own forwards (the prefix K/V), beside the others
        requests.append(("the sea is blue", {"gen_length": 16, "seed": 5, "decoding": "threshold+kv",
                                             "threshold": 0.3}))
    solo = [gen.generate_text(p, num_inference_steps=4, **s) for p, s in requests]
    batcher = gen.pipeline.batcher
    batcher.model = SlowForward(batcher.model)
    before = batcher.stats.calls, batcher.stats.units
    together = _together(gen, requests, batched=len(REQUESTS))  # (the kv request runs its own forwards)
    for alone, shared in zip(solo, together):
        alone, shared = (alone, shared) if isinstance(alone, list) else ([alone], [shared])
        assert [r.token_ids for r in shared] == [r.token_ids for r in alone]
        assert [r.text for r in shared] == [r.text for r in alone]
    calls, units = batcher.stats.calls - before[0], batcher.stats.units - before[1]
    assert calls < units and batcher.stats.batched_units > 0, (calls, units)


def test_the_batch_budget_and_unsupported_hooks(tmp_path):
    folder = build_tiny_llada2(tmp_path / "m")
    gen = TextGenerator.from_pretrained(folder, progress=False, max_batch_size=1)
    gen.pipeline.batcher.model = SlowForward(gen.pipeline.batcher.model)
    _together(gen, REQUESTS[:2], batched=2)
    assert gen.pipeline.batcher.stats.largest == 1  # one row a call
    with pytest.raises(UnsupportedError, match="cache"):
        TextGenerator.from_pretrained(folder, progress=False, cache="teacache")


def test_a_higher_priority_requests_forwards_go_first_and_priorities_change_no_output():
    """Units queued while the batcher is held: with one row a call, the higher priority's forward runs first, then
    the others oldest first; each unit's logits are its own forward's whatever the order."""
    from composer.engine.core import EngineCore
    from composer.engine.loop import wait_for
    from composer.engine.scheduler import RequestContext
    from composer.text.batching import ForwardBatcher

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.order: list[int] = []

        def forward(self, ids, attention_mask=None, position_ids=None):
            self.order += ids[:, 0].tolist()
            return type("Out", (), {"logits": ids[..., None].float().repeat(1, 1, 3)})()

    model = Logits()
    batcher = ForwardBatcher(model, pad_id=0, max_rows=1)
    core = EngineCore(lambda: [batcher], stage_threads=1)
    got: dict[int, torch.Tensor] = {}

    def ask(first_id: int, priority: int):  # a request's task: it waits for one forward
        ids = torch.tensor([[first_id, 10 * first_id, 10 * first_id + 1]])
        got[first_id] = yield from wait_for(batcher.forward(ids, torch.ones_like(ids), torch.arange(3)[None], 2,
                                                            priority))

    futures = []
    with batcher.held():
        for i, args in enumerate(((1, 0), (2, 0), (3, 5))):
            futures.append(core.submit(ask(*args), RequestContext(priority=args[1])))
            assert batcher.wait_for_units(i + 1, 30)  # queued in this order
    for future in futures:
        future.result(30)
    core.close()
    assert model.order == [3, 1, 2]
    for first_id, logits in got.items():  # the last 2 positions of its own ids
        own = torch.tensor([[10 * first_id, 10 * first_id + 1]]).float()[..., None].repeat(1, 1, 3)
        assert torch.equal(logits, own), first_id


def test_text_requests_are_tasks_of_the_engine_core_no_thread_waits_for_them():
    """submit_text: each request is a task of the model's engine core (its tokenizing on the core's stage threads,
    its forwards queued on the batcher), so requests at once add no thread of their own; each result equals its
    solo generate_text, and a stream read piece by piece gives the same ids."""
    gen = TextGenerator.from_pretrained(None, progress=False)  # the embedded tiny-dllm
    asks = [("1 2 3 + 4 5 6 =", 1), ("7 + 5", 2), ("0 4 7 + 5 9 1 =", 3)]
    solo = [gen.generate_text(p, gen_length=8, seed=s) for p, s in asks]
    batcher = gen.pipeline.batcher
    outside = {t.ident for t in threading.enumerate() if not t.name.startswith(gen.core.name)}
    with batcher.held():
        futures = [gen.submit_text(p, gen_length=8, seed=s, priority=i) for i, (p, s) in enumerate(asks)]
        assert batcher.wait_for_units(len(asks), 60)  # every request's first forward is queued, none has run
        assert gen.core.active == len(asks)
        extra = [t.name for t in threading.enumerate()
                 if t.ident not in outside and not t.name.startswith(gen.core.name)]
        assert not extra, extra  # no thread waits on a request's behalf
    together = [f.result(120) for f in futures]
    assert [r.token_ids for r in together] == [r.token_ids for r in solo]
    pieces = list(gen.stream_text(asks[0][0], gen_length=8, seed=asks[0][1]))
    assert pieces[-1].done and pieces[-1].token_ids == solo[0].token_ids


def test_astream_text_awaits_each_block_on_the_core_and_equals_stream_text():
    """astream_text: the same pieces as stream_text, each block a task of the engine core awaited on the event loop
    (the core's tasks count them); a reader that stops early leaves the pipeline (its place at the gate is given
    back)."""
    import asyncio

    gen = TextGenerator.from_pretrained(None, progress=False)
    settings = {"gen_length": 16, "block_length": 4, "seed": 3}
    expected = [(p.row, p.text, p.token_ids, p.done) for p in gen.stream_text("1 2 3 + 4 5 6 =", **settings)]

    async def read(limit=None):
        got = []
        pieces = gen.astream_text("1 2 3 + 4 5 6 =", **settings)
        try:
            async for piece in pieces:
                got.append((piece.row, piece.text, piece.token_ids, piece.done))
                if limit is not None and len(got) >= limit:
                    break
        finally:
            await pieces.aclose()
        return got

    before = gen.core.submitted
    assert asyncio.run(read()) == expected
    assert gen.core.submitted - before >= 2  # a task per block, and one that finds the end
    assert asyncio.run(read(limit=1)) == expected[:1]
    assert until(lambda: gen.pipeline.gate.running == 0)  # the early reader's request left the pipeline
