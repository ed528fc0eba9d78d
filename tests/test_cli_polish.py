"""Warnings for settings that are ignored or costly, and CLI polish: usage errors exit 1, --version, defaults in
--help, --no-progress silences the libraries' bars, log lines never share a line with a progress bar."""

from __future__ import annotations

import io
import logging

import pytest
from test_cli import composer_process

import composer.logging as clog
from composer import VideoGenerator

SMALL = dict(height=32, width=32, num_frames=5, num_inference_steps=1, seed=0)


@pytest.fixture()
def fresh_log_once(monkeypatch):
    """Forget what log_once has said, so a once-per-process warning shows again in this test."""
    monkeypatch.setattr(clog, "_said", set())


def test_negative_prompt_without_guidance_warns_once(composer_gen, fresh_log_once, log):
    composer_gen.generate_video("a cat", negative_prompt="blurry", guidance_scale=1.0, **SMALL)
    composer_gen.generate_video("a cat", negative_prompt="grainy", guidance_scale=0.5, **SMALL)
    assert "WARNING negative_prompt is ignored: guidance_scale = 1.0 (<= 1)" in log.getvalue()
    assert log.getvalue().count("negative_prompt is ignored") == 1


def test_the_familys_own_negative_prompt_is_not_warned_about(composer_gen, fresh_log_once, log):
    composer_gen.generate_video("a cat", guidance_scale=1.0, **SMALL)
    composer_gen.generate_video("a cat", negative_prompt="blurry", guidance_scale=3.0, **SMALL)
    assert "WARNING" not in log.getvalue()


def test_half_precision_on_the_cpu_warns(tiny_wan_dir, fresh_log_once, log):
    VideoGenerator.from_pretrained(tiny_wan_dir, dtype="bf16", device="cpu", progress=False)
    assert "WARNING dtype = bf16 on the CPU is much slower than fp32" in log.getvalue()


def test_a_named_attention_backend_that_is_missing_warns(tiny_wan_dir, fresh_log_once, log):
    from composer.models.attention.backends import _load

    if _load("flash") is not None:
        pytest.skip("flash-attn is installed here")
    VideoGenerator.from_pretrained(tiny_wan_dir, attention_backend="flash", progress=False)
    assert "WARNING attention_backend = flash is not usable here" in log.getvalue()
    assert "using sdpa" in log.getvalue()


def test_log_lines_clear_a_live_progress_bar_first():
    from tqdm import tqdm

    stream = io.StringIO()
    handler = clog._TqdmHandler(stream)
    with tqdm(total=3, file=stream, desc="denoising") as bar:
        bar.update()
        handler.emit(logging.LogRecord("composer", logging.WARNING, __file__, 1, "careful", None, None))
    lines = stream.getvalue().replace("\r", "\n").split("\n")
    assert "careful" in lines  # on a line of its own, not appended to the bar's


def test_library_progress_bars_are_off_within_the_block_and_restored():
    from diffusers.utils import logging as dlog
    from huggingface_hub.utils import are_progress_bars_disabled
    from transformers.utils import logging as tlog

    def state():
        return tlog.is_progress_bar_enabled(), dlog.is_progress_bar_enabled(), are_progress_bars_disabled()

    before = state()  # an in-process CLI run with --no-progress earlier in the session turns them off for good
    with clog.library_progress_bars(False):
        assert state() == (False, False, True)
    assert state() == before


@pytest.mark.slow  # (subprocess launches: the full tier)
def test_usage_errors_exit_1_and_version_prints():
    bad = composer_process("generate", "--no-such-flag")
    assert bad.returncode == 1 and "unknown flag --no-such-flag" in bad.stderr
    missing = composer_process("generate", "--segment")
    assert missing.returncode == 1 and "expected one argument" in missing.stderr
    version = composer_process("--version")
    from composer import __version__

    assert version.returncode == 0 and version.stdout.strip() == f"composer {__version__}"


def test_help_shows_defaults():
    """Every flag (--help-all) with the default model's real values, never "the model family's"."""
    from composer.cli.help import generate_help
    from composer.cli.main import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices["generate"]
    text = " ".join(generate_help(sub, everything=True, model_path=None).split())
    assert "--overlap-frames INT causal models: latent frames carried into the next rollout / prompt (not a setting " \
           "of shapes-t2v)" in text
    assert "frame height in pixels (default: 64)" in text and "(default: the model family's)" not in text
    assert "(default: auto)" in text and "VAE precision (fp32 keeps decode quality) (default: fp32)" in text
    assert "show progress bars for long steps (default: on)" in text
    assert "(default: None)" not in text
    causal = " ".join(generate_help(sub, everything=True, model_path="shapes-causal").split())
    assert "latent frames carried into the next rollout / prompt (default: 3)" in causal
    assert "denoising steps (default: 8)" in causal  # the folder's step list, not the family's 4


@pytest.mark.slow
def test_no_progress_silences_every_bar(tiny_wan_dir, tmp_path):
    run = composer_process("generate", "--model-path", tiny_wan_dir, "--prompt", "a cat", "--height", "32", "--width",
                           "32", "--num-frames", "5", "--steps", "1", "--seed", "0", "--no-progress",
                           "--output", tmp_path / "out.mp4")
    assert run.returncode == 0, run.stderr
    assert "Loading weights" not in run.stderr and "it/s" not in run.stderr and "\r" not in run.stderr
