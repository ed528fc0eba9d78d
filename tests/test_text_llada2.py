"""Diffusion language models (composer/text): a tiny LLaDA2Pipeline folder in exact diffusers layout, built here
(word-level tokenizer with a chat template and a mask token, a small transformers causal LM, a
BlockRefinementScheduler config). composer's token ids equal diffusers' LLaDA2Pipeline's on the same folder,
prompt, settings and seed: greedy and sampled, top-k / top-p, threshold, editing on and off, EOS early stop on
and off, block lengths, minimal_topk, a list of prompts. Streaming gives the same ids; bad input is refused whole."""

from __future__ import annotations

import pytest
import torch

from composer import TextGenerator, VideoGenerator
from composer.cancel import CancelToken
from composer.errors import Cancelled, ConfigError, InvalidInputError, UnsupportedError
from composer.testing.tiny_llada2 import TinyLLaDA2Spec, build_tiny_llada2

PROMPT = "what is two plus two ?"
PROMPTS = ["what is two plus two ?", "the cat is red", "sort the list one five two"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_llada2(tmp_path_factory.mktemp("text") / "tiny-llada2")


@pytest.fixture(scope="module")
def eos_folder(tmp_path_factory):  # an output head that favours EOS: rows finish early
    return build_tiny_llada2(tmp_path_factory.mktemp("text") / "tiny-llada2-eos", TinyLLaDA2Spec(eos_scale=2.0, seed=1))


def _reference(folder):
    from diffusers import DiffusionPipeline
    from transformers import AutoTokenizer

    # diffusers leaves LLaDA2Pipeline's optional tokenizer unloaded unless it is given
    pipe = DiffusionPipeline.from_pretrained(folder, tokenizer=AutoTokenizer.from_pretrained(folder / "tokenizer"))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def reference(folder):
    return _reference(folder)


@pytest.fixture(scope="module")
def gen(folder):
    return TextGenerator.from_pretrained(folder, progress=False)


SETTINGS = {
    "greedy": {},
    "sampled": {"temperature": 1.0},
    "top-k-top-p-threshold": {"temperature": 0.8, "top_k": 10, "top_p": 0.9, "threshold": 0.05},
    "no-editing": {"temperature": 1.0, "editing_threshold": 0.0},
    "block-4-minimal-topk-2": {"block_length": 4, "minimal_topk": 2, "temperature": 0.7},
    "greedy-method-auto": {"sampling_method": "auto", "temperature": 0.5, "max_post_steps": 2},
    "no-chat-template": {"use_chat_template": False, "temperature": 1.0},
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_token_ids_equal_diffusers_llada2(name, gen, reference):
    settings = {"gen_length": 21, "num_inference_steps": 4, **SETTINGS[name]}
    for seed in (0, 7):
        expected = reference(prompt=PROMPT, generator=torch.Generator("cpu").manual_seed(seed), **settings)
        got = gen.generate_text(PROMPT, seed=seed, **settings)
        assert got.token_ids == expected.sequences[0].tolist(), (name, seed)  # no EOS committed: every id
        assert got.text == expected.texts[0]
        assert got.seed == seed and got.stats.forwards > 0 and got.stats.tokens == 21


@pytest.fixture(scope="module")
def scheduler_pair(tmp_path_factory):  # a scheduler config whose values differ from every call default
    folder = build_tiny_llada2(tmp_path_factory.mktemp("text") / "tiny-llada2-scheduler", TinyLLaDA2Spec(
        block_length=6, scheduler_config={"threshold": 0.8, "editing_threshold": 0.9, "num_inference_steps": 5}))
    return TextGenerator.from_pretrained(folder, progress=False), _reference(folder)


@pytest.mark.parametrize("settings", [
    {"temperature": 0.0, "threshold": 0.35, "editing_threshold": None},  # issue 47's case
    {"temperature": 1.0, "editing_threshold": None, "top_p": None, "max_post_steps": 2},
    {"temperature": 0.0, "editing_threshold": 0.0, "block_length": None},
    {"temperature": 0.7, "threshold": 0.2},
], ids=["greedy-editing-none", "sampled-editing-none", "editing-off", "sampled-defaults"])
def test_a_call_none_and_a_length_of_no_whole_blocks_equal_diffusers(scheduler_pair, settings):
    """A call's None for a setting that takes None is diffusers' None (editing_threshold=None: the scheduler config's
    threshold within steps, no editing steps after a block), not the family's default; 40 tokens in blocks of 6."""
    gen, reference = scheduler_pair
    settings = {"gen_length": 40, "num_inference_steps": 3, **settings}
    for seed in (0, 3):
        expected = reference(prompt=PROMPT, generator=torch.Generator("cpu").manual_seed(seed), **settings)
        got = gen.generate_text(PROMPT, seed=seed, **settings)
        eos = reference.tokenizer.eos_token_id
        row = expected.sequences[0].tolist()
        assert got.token_ids == (row[: row.index(eos) + 1] if eos in row else row), (settings, seed)


@pytest.mark.parametrize("early_stop", [True, False])
def test_eos_early_stop_and_a_list_of_prompts_equal_diffusers(early_stop, eos_folder):
    gen = TextGenerator.from_pretrained(eos_folder, progress=False)
    reference = _reference(eos_folder)
    settings = {"gen_length": 40, "num_inference_steps": 4, "temperature": 1.0, "use_chat_template": False,
                "eos_early_stop": early_stop}
    stopped = False
    for seed in (0, 1, 2):
        expected = reference(prompt=PROMPTS, generator=torch.Generator("cpu").manual_seed(seed), **settings)
        got = gen.generate_text(PROMPTS, seed=seed, **settings)
        assert [r.prompt for r in got] == PROMPTS
        eos = reference.tokenizer.eos_token_id
        for row, result in zip(expected.sequences.tolist(), got):
            until = row[: row.index(eos) + 1] if eos in row else row  # diffusers decodes up to the first EOS
            assert result.token_ids == until, (seed, early_stop)
        assert [r.text for r in got] == expected.texts
        stopped |= any(len(r.token_ids) < 40 for r in got)
    assert stopped  # some rows did commit EOS


def test_stream_text_gives_the_generate_text_ids_block_by_block(gen):
    settings = {"gen_length": 21, "num_inference_steps": 4, "temperature": 1.0, "seed": 3}
    whole = gen.generate_text(PROMPT, **settings)
    pieces = list(gen.stream_text(PROMPT, **settings))
    assert pieces[-1].done and pieces[-1].token_ids == whole.token_ids and pieces[-1].so_far == whole.text
    assert "".join(p.text for p in pieces) == whole.text
    assert len([p for p in pieces if not p.done]) >= 2  # text came out before the end (21 tokens: 4 blocks of 8)
    assert all(p.text for p in pieces) and [p.done for p in pieces].count(True) == 1  # no empty last piece
    assert pieces[-1].stats.tokens == 21
    rows = list(gen.stream_text(PROMPTS, **settings))  # a list: one last piece a prompt, each with its text
    assert sorted(p.row for p in rows if p.done) == [0, 1, 2] and all(p.text for p in rows)
    with pytest.raises(InvalidInputError, match="temperature"):
        gen.stream_text(PROMPT, temperature=-1)  # refused when called, not at the first piece


def test_the_folder_defaults_and_explicit_settings(gen, folder):
    assert gen.family == "llada2"
    sp = gen.sampling_param(gen_length=64)
    assert sp.gen_length == 64 and sp.threshold == 0.7 and sp.block_length is None
    assert gen.pipeline.scheduler_block_length() == 8  # the folder's scheduler config
    with pytest.raises(ConfigError, match="did you mean 'gen_length'"):
        gen.sampling_param(gen_lenght=3)


def test_a_calls_none_is_the_settings_none_not_the_default(gen):
    stated = gen.sampling_param(top_p=0.9, top_k=5, editing_threshold=0.8, block_length=4)  # as a folder states
    cleared = stated.updated(top_p=None, top_k=None, editing_threshold=None, block_length=None, threshold=None)
    assert (cleared.top_p, cleared.top_k, cleared.editing_threshold, cleared.block_length) == (None,) * 4
    assert cleared.threshold == stated.threshold  # a setting that takes no None keeps its value


@pytest.mark.parametrize("bad, message", [
    ({"gen_length": 0}, "gen_length = 0"),
    ({"gen_length": -1}, "gen_length = -1"),
    ({"gen_length": 2.5}, "gen_length = 2.5"),
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": float("nan")}, "temperature = nan: must be a finite number"),
    ({"threshold": float("inf")}, "threshold = inf"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": 0}, "top_p = 0"),
    ({"sampling_method": "beam"}, "sampling_method"),
    ({"decoding": "turbo"}, "decoding = 'turbo'"),
    ({"seed": 2**64}, "seed = 18446744073709551616"),
    ({"prompt": ""}, "prompt: empty"),
    ({"prompt": ["the cat", "  "]}, "prompt: empty"),
])
def test_bad_requests_are_refused_before_any_forward(gen, bad, message):
    prompt = bad.pop("prompt", PROMPT)
    forwards = gen.pipeline.batcher.stats.calls
    with pytest.raises((InvalidInputError, ConfigError), match=message):
        gen.generate_text(prompt, **bad)
    with pytest.raises((InvalidInputError, ConfigError), match=message):
        next(iter(gen.stream_text(prompt, **bad)))
    assert gen.pipeline.batcher.stats.calls == forwards
    with pytest.raises(InvalidInputError, match="prompt"):
        gen.generate_text(None)


def test_cancel_stops_before_the_next_forward(gen):
    token = CancelToken()
    token.cancel("stop")
    with pytest.raises(Cancelled):
        gen.generate_text(PROMPT, gen_length=16, cancel=token, seed=0)


def test_video_and_text_loaders_refuse_each_others_folders(folder):
    with pytest.raises(UnsupportedError, match="TextGenerator"):
        VideoGenerator.from_pretrained(folder, progress=False)
    with pytest.raises(UnsupportedError, match="VideoGenerator"):
        TextGenerator.from_pretrained("shapes-t2v", progress=False)


@pytest.mark.slow
def test_composer_generate_prints_a_text_models_text(folder, gen, capsys, log):
    from composer.cli.main import main

    expected = gen.generate_text(PROMPT, gen_length=16, num_inference_steps=4, seed=1, temperature=1.0)
    args = ["generate", "--model-path", str(folder), "--prompt", PROMPT, "--max-new-tokens", "16", "--steps", "4",
            "--seed", "1", "--temperature", "1.0", "--no-progress"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert out.strip() == expected.text
    assert "16 tokens in" in err and "llada2" in err
    assert main([*args, "--stream"]) == 0
    out, _ = capsys.readouterr()
    assert out.strip() == expected.text
    assert main([*args, "--height", "64"]) == 0  # a video setting: a WARNING, and ignored
    assert "WARNING ignoring video settings for a text model: --height" in log.getvalue()


@pytest.mark.parametrize("flags, message", [
    (["--max-new-tokens", "0"], "gen_length = 0"),
    (["--max-new-tokens", "-1"], "gen_length = -1"),
    (["--max-new-tokens", "2.5"], "gen_length = '2.5'"),
    (["--max-new-tokens", "1000000000"], "more than tiny-llada2's context of 512 positions"),
    (["--temperature", "nan"], "temperature = nan"),
    (["--temperature", "-1"], "temperature = -1"),
    (["--top-p", "0"], "top_p = 0"),
    (["--top-p", "1.5"], "top_p = 1.5"),
    (["--decoding", "turbo"], "decoding = 'turbo'"),
    (["--prompt", ""], "prompt: empty"),
])
def test_composer_generate_refuses_bad_text_settings_before_loading(folder, capsys, monkeypatch, flags, message):
    from composer.cli.main import main
    from composer.text.pipeline import TextPipeline

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(TextPipeline, "load_modules", no_loading)
    assert main(["generate", "--model-path", str(folder), "--prompt", PROMPT, *flags, "--no-progress"]) != 0
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_a_prompt_past_the_models_context_is_refused_before_any_forward(tmp_path):
    from composer.text.limits import TextLimits

    folder = build_tiny_llada2(tmp_path / "short", TinyLLaDA2Spec())
    config = folder / "model" / "config.json"
    import json

    config.write_text(json.dumps({**json.loads(config.read_text()), "max_position_embeddings": 32}))
    gen = TextGenerator.from_pretrained(folder, progress=False)
    assert gen.limits == TextLimits(context=32, block_length=8, name="short")
    long = " ".join(["the cat is red"] * 6)  # 24 tokens (plain): with 16 new ones, 40 positions
    with pytest.raises(InvalidInputError, match="the prompt is 24 tokens and gen_length = 16: 40 positions"):
        gen.generate_text(long, gen_length=16, use_chat_template=False)
    with pytest.raises(InvalidInputError, match="ask for at most 8 new tokens"):
        gen.generate_text(long, gen_length=16, use_chat_template=False)
    assert gen.pipeline.batcher.stats.calls == 0
    assert len(gen.generate_text(long, gen_length=8, use_chat_template=False, seed=0).token_ids) <= 8
    with pytest.raises(InvalidInputError, match="gen_length = 40"):
        gen.generate_text("the cat", gen_length=40)


def test_text_limits_count_whole_blocks_and_whole_canvases():
    from composer.text.limits import TextLimits, check_text_request
    from composer.text.sampling import TextSamplingParam

    sp = TextSamplingParam(prompt="p", gen_length=20, block_length=None)
    blocks, canvases = TextLimits(context=32, block_length=8), TextLimits(context=32, canvas_length=8)
    assert blocks.positions(10, sp) == 32 and canvases.positions(10, sp) == 34  # ceil(30/8)*8; 10 + 3 canvases
    check_text_request(sp, blocks, prompt_tokens=[10, 4])
    with pytest.raises(InvalidInputError, match=r"prompt\[0\] is 10 tokens .* ask for at most 16 new tokens"):
        check_text_request(sp, canvases, prompt_tokens=[10, 4])
    with pytest.raises(InvalidInputError, match="takes exact only"):
        check_text_request(TextSamplingParam(prompt="p", decoding="threshold"), TextLimits(strategies=("exact",)))


def test_a_model_in_the_folders_own_code_runs_when_trusted(tmp_path):
    """The released LLaDA2 folders define their model class in their own files (config.json auto_map): composer
    refuses to run that code unless told to trust it, and then gives the ids diffusers' pipeline gives over the
    same class."""
    from diffusers import BlockRefinementScheduler, LLaDA2Pipeline
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = build_tiny_llada2(tmp_path / "remote", TinyLLaDA2Spec(model="remote"))
    with pytest.raises(UnsupportedError, match="trust_remote_code"):
        TextGenerator.from_pretrained(folder, progress=False)
    gen = TextGenerator.from_pretrained(folder, progress=False, trust_remote_code=True)
    assert type(gen.pipeline.modules["model"]).__name__ == "TinyRemoteLM"
    pipe = LLaDA2Pipeline(model=AutoModelForCausalLM.from_pretrained(folder / "model", trust_remote_code=True),
                          scheduler=BlockRefinementScheduler.from_pretrained(folder / "scheduler"),
                          tokenizer=AutoTokenizer.from_pretrained(folder / "tokenizer"))
    pipe.set_progress_bar_config(disable=True)
    expected = pipe(prompt=PROMPT, gen_length=16, num_inference_steps=4, temperature=1.0,
                    generator=torch.Generator("cpu").manual_seed(4)).sequences[0].tolist()
    assert gen.generate_text(PROMPT, gen_length=16, num_inference_steps=4, temperature=1.0, seed=4).token_ids == \
        expected
