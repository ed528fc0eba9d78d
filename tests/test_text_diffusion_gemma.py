"""DiffusionGemma folders (composer/text/canvas.py): token ids equal diffusers' DiffusionGemmaPipeline's on a tiny
folder in exact diffusers layout built here (transformers' DiffusionGemmaForBlockDiffusion at toy sizes, the
word-level tokenizer with a chat template as processor), for each of its schedulers (BlockRefinementScheduler's
uniform mode, DiscreteDDIMScheduler with corrector sweeps, EntropyBoundScheduler), greedy and sampled, adaptive
stopping on and off, several canvases, a list of prompts and a conversation.

diffusers 0.42's pipeline passes the encoder cache to transformers as `past_key_values`, which transformers 5.24
names `cache` (its model forward would swallow the old name and run without the prompt): on 5.24 the reference runs
with that one argument renamed, nothing else changed. composer takes the name from each function's signature: the
other transformers version's convention is stood in by wrappers with that version's signature."""

from __future__ import annotations

import inspect

import pytest
import torch

from composer import TextGenerator
from composer.errors import InvalidInputError
from composer.testing.tiny_diffusion_gemma import TinyDiffusionGemmaSpec, build_tiny_diffusion_gemma
from composer.text.canvas import cache_keyword

pytestmark = pytest.mark.slow
PROMPT = "what is two plus two ?"
SCHEDULERS = {
    "refinement": ("BlockRefinementScheduler", {}),
    "ddim-corrector": ("DiscreteDDIMScheduler", {"corrector_steps": 1}),
    "entropy-bound": ("EntropyBoundScheduler", {"entropy_bound": 0.5}),
}


def _renamed(fn):
    def call(*args, past_key_values=None, **kwargs):
        if past_key_values is not None:
            kwargs["cache"] = past_key_values
        return fn(*args, **kwargs)
    return call


def _reference(folder):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    model = pipe.model
    if cache_keyword(model.forward) == "past_key_values":  # transformers 5.23: diffusers' own names
        return pipe
    model.forward = _renamed(model.forward)
    model.model.encoder.forward = _renamed(model.model.encoder.forward)
    decoder = model.model.decoder
    decoder.create_diffusion_decoder_attention_mask = _renamed(decoder.create_diffusion_decoder_attention_mask)
    return pipe


@pytest.fixture(scope="module", params=list(SCHEDULERS))
def pair(request, tmp_path_factory):
    name, config = SCHEDULERS[request.param]
    folder = build_tiny_diffusion_gemma(tmp_path_factory.mktemp("dg") / request.param,
                                        TinyDiffusionGemmaSpec(scheduler=name, scheduler_config=config))
    return TextGenerator.from_pretrained(folder, progress=False), _reference(folder)


def _until_eos(row, eos):
    return row[: row.index(eos) + 1] if eos in row else row


@pytest.mark.parametrize("settings", [
    {},
    {"temperature": 1.0},
    {"temperature": 0.7, "confidence_threshold": None},
    {"temperature": 1.0, "eos_early_stop": False, "stability_threshold": 2, "confidence_threshold": 0.5},
], ids=["greedy", "sampled", "no-adaptive-stop", "stability-2"])
def test_token_ids_equal_diffusers_diffusion_gemma(pair, settings):
    gen, reference = pair
    eos = reference.eos_token_id
    for seed in (0, 5):
        expected = reference(prompt=PROMPT, gen_length=20, num_inference_steps=5,  # 3 canvases of 8
                             generator=torch.Generator("cpu").manual_seed(seed), **settings)
        got = gen.generate_text(PROMPT, gen_length=20, num_inference_steps=5, seed=seed, **settings)
        assert got.token_ids == _until_eos(expected.sequences[0].tolist(), eos), (settings, seed)
        assert got.text == expected.texts[0]


def test_a_list_of_prompts_and_a_conversation_equal_diffusers(pair):
    gen, reference = pair
    eos = reference.eos_token_id
    prompts = [PROMPT, "why is the sky blue ?"]  # the same length: diffusers' pipeline does not pad
    expected = reference(prompt=prompts, gen_length=16, num_inference_steps=4, temperature=1.0,
                         generator=torch.Generator("cpu").manual_seed(2))
    got = gen.generate_text(prompts, gen_length=16, num_inference_steps=4, temperature=1.0, seed=2)
    assert [r.token_ids for r in got] == [_until_eos(row, eos) for row in expected.sequences.tolist()]
    uneven = gen.generate_text([PROMPT, "the cat"], gen_length=8, num_inference_steps=2, seed=2)  # padded here
    assert [r.prompt for r in uneven] == [PROMPT, "the cat"] and all(r.token_ids for r in uneven)
    messages = [{"role": "user", "content": "why is the sky blue ?"}, {"role": "assistant", "content": "the sea"},
                {"role": "user", "content": "and the sea ?"}]
    expected = reference(messages=messages, gen_length=8, num_inference_steps=4, temperature=1.0,
                         generator=torch.Generator("cpu").manual_seed(3))
    got = gen.generate_text(messages=messages, gen_length=8, num_inference_steps=4, temperature=1.0, seed=3)
    assert got.token_ids == _until_eos(expected.sequences[0].tolist(), eos)


def test_the_family_and_what_it_refuses(pair):
    gen, _ = pair
    assert gen.family == "diffusion-gemma" and gen.default_sampling.num_inference_steps == 48
    with pytest.raises(InvalidInputError, match="exact only"):
        gen.generate_text(PROMPT, decoding="threshold", gen_length=8)
    pieces = list(gen.stream_text(PROMPT, gen_length=20, num_inference_steps=3, seed=1, temperature=1.0,
                                  eos_early_stop=False))
    whole = gen.generate_text(PROMPT, gen_length=20, num_inference_steps=3, seed=1, temperature=1.0,
                              eos_early_stop=False)
    assert pieces[-1].token_ids == whole.token_ids and "".join(p.text for p in pieces) == whole.text


def _taking(fn, name):
    """`fn` behind the signature of the transformers version that names the cache argument `name`: the other name
    is a TypeError, as 5.23's decoder mask makes `cache` one."""
    other = "past_key_values" if name == "cache" else "cache"
    real = cache_keyword(fn)

    def call(*args, **kwargs):
        if other in kwargs:
            raise TypeError(f"got an unexpected keyword argument {other!r}")
        if name in kwargs:
            kwargs[real] = kwargs.pop(name)
        return fn(*args, **kwargs)

    P = inspect.Parameter
    call.__signature__ = inspect.Signature([P("args", P.VAR_POSITIONAL), P(name, P.KEYWORD_ONLY, default=None),
                                            P("kwargs", P.VAR_KEYWORD)])
    return call


def test_both_transformers_cache_conventions_give_the_same_ids(pair, monkeypatch):
    gen, reference = pair
    settings = {"gen_length": 12, "num_inference_steps": 3, "temperature": 1.0, "seed": 4}
    installed = gen.generate_text(PROMPT, **settings)
    expected = reference(prompt=PROMPT, gen_length=12, num_inference_steps=3, temperature=1.0,
                         generator=torch.Generator("cpu").manual_seed(4))
    assert installed.token_ids == _until_eos(expected.sequences[0].tolist(), reference.eos_token_id)
    model = gen.pipeline.modules["model"]
    other = "past_key_values" if cache_keyword(model.forward) == "cache" else "cache"
    decoder = model.model.decoder
    monkeypatch.setattr(model, "forward", _taking(model.forward, other))
    monkeypatch.setattr(model.model.encoder, "forward", _taking(model.model.encoder.forward, other))
    monkeypatch.setattr(decoder, "create_diffusion_decoder_attention_mask",
                        _taking(decoder.create_diffusion_decoder_attention_mask, other))
    assert gen.generate_text(PROMPT, **settings).token_ids == installed.token_ids


def test_a_transformers_without_diffusion_gemma_is_refused_before_loading(pair, monkeypatch):
    import transformers

    from composer.errors import UnsupportedError

    gen, _ = pair
    monkeypatch.setattr(transformers, "DiffusionGemmaForBlockDiffusion", None)  # as one made before it
    with pytest.raises(UnsupportedError, match="DiffusionGemma needs a transformers that has"):
        TextGenerator.from_pretrained(gen.pipeline.folder, progress=False)
