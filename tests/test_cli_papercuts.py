"""The CLI's papercuts (issue 47): one-line usage errors with a suggestion, "did you mean" for a model name,
size limits checked before loading, flags named as typed, short --help with real defaults."""

from __future__ import annotations

import pytest

from composer.errors import ModelNotFoundError


def run_main(capsys, *args: str) -> tuple[int, str]:
    """`composer ARGS` in-process: its exit code and stderr."""
    from composer.cli.main import main

    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def test_an_unknown_flag_is_one_line_naming_the_nearest_flag(capsys):
    code, err = run_main(capsys, "generate", "--promt", "a cat")
    assert code == 1
    assert err.splitlines() == ["composer generate: error: unknown flag --promt; did you mean --prompt? (see "
                                "`composer generate --help`)"]


def test_every_usage_error_is_one_line(capsys):
    code, err = run_main(capsys, "generate", "--steps")
    assert code == 1 and len(err.splitlines()) == 1 and "--steps: expected one argument" in err
    code, err = run_main(capsys, "models", "--promt")
    assert code == 1 and err.splitlines() == ["composer models: error: unknown flag --promt (see `composer models "
                                              "--help`)"]
    code, err = run_main(capsys, "generate", "a cat")
    assert code == 1 and len(err.splitlines()) == 1 and "unexpected argument 'a cat'" in err
    code, err = run_main(capsys, "generat", "--prompt", "a cat")
    assert code == 1 and len(err.splitlines()) == 1 and "invalid choice: 'generat'" in err
    assert "did you mean generate?" in err


@pytest.mark.parametrize(("typed", "meant"), [("shapes-t2", "shapes-t2v"), ("composer/shapes-causl", "shapes-causal"),
                                              ("tiny-dlm", "tiny-dllm")])
def test_a_mistyped_embedded_model_name_suggests_the_nearest(typed, meant):
    from composer.loader.resolve import resolve_model_path

    with pytest.raises(ModelNotFoundError, match=f"model folder {typed} does not exist; did you mean {meant}\\?"):
        resolve_model_path(typed)


def test_a_name_near_no_embedded_model_lists_them():
    from composer.loader.resolve import resolve_model_path

    with pytest.raises(ModelNotFoundError, match="embedded models: shapes-t2v, shapes-causal, tiny-dllm"):
        resolve_model_path("nothing-like-it")


@pytest.mark.parametrize("doc", ["adding-a-model-family.md", "wan22.md"])
def test_every_source_path_a_contributors_doc_names_exists_from_the_repository_root(doc):
    """`composer/configs/wan.py`, not `configs/wan.py` (the repository's configs/ holds YAML presets)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    text = (root / "docs" / doc).read_text()
    paths = re.findall(r"(?<![\w./-])((?:[a-z_0-9]+/)+[a-z_0-9]+\.py)(?![\w/-])", text)
    assert paths or doc == "wan22.md"
    assert [p for p in paths if not (root / p).is_file()] == []


def test_wan22_docs_do_not_list_per_expert_lora_as_missing():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "wan22.md").read_text()
    not_done = text.split("## Not done", 1)[1]
    assert "LoRA" not in not_done.split("\n## ", 1)[0]


def test_another_models_knob_says_what_this_model_does_before_loading(cli, monkeypatch):
    from composer.generator import VideoGenerator

    monkeypatch.setattr(VideoGenerator, "from_pretrained", lambda *a, **k: pytest.fail("the model was loaded"))
    code, _, err = cli("generate", "--model-path", "shapes-t2v", "--prompt", "a cat", "--video", "in.mp4")
    assert code == 1
    assert "--video in.mp4: expected unset (shapes-t2v cannot do video-to-video: it does text-to-video; models " \
           "that take --video: wan2.1-t2v" in err
    assert "unknown sampling parameter" not in err


@pytest.mark.parametrize("typed", ["--max-new-tokens", "--gen-length"])
def test_a_flag_is_named_as_typed(cli, typed):
    code, _, err = cli("generate", "--model-path", "shapes-t2v", "--prompt", "a cat", typed, "5", "--steps", "x")
    assert code == 1
    assert f"{typed} 5: expected unset (shapes-t2v cannot generate text: it does text-to-video" in err
    assert "--steps x: expected an integer" in err and ("gen_length" not in err) and ("--gen-length" in err) == (
        typed == "--gen-length")


def test_the_api_and_the_server_say_what_the_model_does(monkeypatch):
    from composer.errors import ConfigError
    from composer.generator import VideoGenerator
    from composer.serve.requests import RequestProblem, ServerLimits, check_body

    gen = VideoGenerator.from_pretrained("shapes-t2v", progress=False)
    with pytest.raises(ConfigError, match="video given, but shapes-t2v cannot do video-to-video: it does "
                                          "text-to-video"):
        gen.generate_video("a cat", video="in.mp4")
    with pytest.raises(RequestProblem, match="start_video given, but shapes-t2v cannot continue a video") as info:
        check_body({"prompt": "a cat", "start_video": "AAAA"}, gen, ServerLimits())
    assert info.value.field == "start_video"


def test_runs_at_once_share_one_progress_bar(capsys):
    """Three threads' bars: one line, "denoising (3 runs)" over their 12 steps, no cursor movements (tqdm's
    stacked bars move the cursor up, which garbles anything but a live terminal)."""
    import threading

    from composer import logging as clog

    together = threading.Barrier(3)

    def run(steps: int) -> None:
        with clog.progress_bar(steps, "denoising", "step") as advance:
            together.wait(timeout=10)
            for _ in range(steps):
                advance()
            together.wait(timeout=10)

    threads = [threading.Thread(target=run, args=(4,)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    err = capsys.readouterr().err
    assert "denoising (3 runs)" in err and "/12 " in err and "12/12" in err
    assert "\x1b[" not in err and "\n" not in err.strip("\n")  # one line, redrawn in place
    assert clog._bars == {}


def test_a_run_that_stops_early_takes_its_steps_off_the_shared_bar(capsys):
    from composer import logging as clog

    with clog.progress_bar(10, "denoising", "step") as first:
        with clog.progress_bar(10, "denoising", "step") as second:
            second(3)  # cancelled after 3 of its 10 steps
        assert clog._bars[("denoising", "step")]["bar"].total == 13
        first(10)
    assert clog._bars == {}


def test_concurrent_generate_video_calls_draw_one_readable_bar(capsys):
    import threading

    from composer.generator import VideoGenerator

    gen = VideoGenerator.from_pretrained("shapes-t2v", progress=True)
    capsys.readouterr()
    threads = [threading.Thread(target=gen.generate_video, args=(f"a red circle {i}",),
                                kwargs=dict(height=32, width=32, num_frames=5, num_inference_steps=3, seed=i))
               for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    err = capsys.readouterr().err
    assert "denoising" in err and "\x1b[" not in err


def test_short_help_lists_the_common_flags_with_the_models_defaults(capsys):
    from composer.cli.main import main

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    short = capsys.readouterr().out
    assert len(short.splitlines()) < 100
    flat = " ".join(short.split())
    assert "frame height in pixels (default: 64)" in flat and "the model family's" not in flat
    assert "--ar-step" not in flat and "composer generate --help-all" in flat
    assert "Defaults shown are shapes-t2v's (the default model)" in flat
    with pytest.raises(SystemExit):
        main(["generate", "--model-path", "shapes-causal", "--help"])
    assert "denoising steps (default: 8)" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit):
        main(["generate", "--help-all"])
    full = capsys.readouterr().out
    assert "--ar-step" in full and len(full.splitlines()) > len(short.splitlines())


def test_models_marks_what_is_usable_offline(cli, monkeypatch, tmp_path, tiny_wan_dir):
    import shutil

    cache = tmp_path / "hub"
    snapshot = cache / "models--Wan-AI--Wan2.1-T2V-1.3B-Diffusers" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_wan_dir, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    code, out, _ = cli("models")
    assert code == 0
    assert out.splitlines()[0].startswith("Embedded models (in the package: no download, usable offline")
    assert "shapes-t2v, shapes-causal, tiny-dllm" in out.splitlines()[0]
    import re

    families = re.split(r"\n  (?=\S)", out)
    by_name = {block.splitlines()[0]: block for block in families}
    assert "local:    embedded: usable offline (--model-path shapes-t2v)" in by_name["shapes-t2v"]
    assert "in the Hugging Face cache: usable offline (Wan-AI/Wan2.1-T2V-1.3B-Diffusers)" in by_name["wan2.1-t2v"]
    assert "not downloaded (`hf download Wan-AI/Wan2.2-T2V-A14B-Diffusers`" in by_name["wan2.2-t2v-a14b"]


def test_every_line_of_a_prompt_file_is_held_to_the_text_limit_before_loading(cli, tmp_path):
    from composer.request_check import MAX_TEXT_CHARS

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n" + "a" * (MAX_TEXT_CHARS + 1) + "\n")
    code, _, err = cli("generate", "--prompt-file", prompts, "-o", tmp_path / "clip.mp4")
    assert code == 1 and f"{prompts} prompt 2 = 'aaa" in err and f"at most {MAX_TEXT_CHARS} characters" in err
