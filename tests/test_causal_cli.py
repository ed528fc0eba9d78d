"""CLI for causal models: convert, --stream, --segment, --interactive (stdin), errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import imageio.v3 as iio
import pytest
from helpers import write_self_forcing_checkpoint

SIZE = ["--height", "32", "--width", "48", "--seed", "1"]


def cli(*args, stdin=None):
    return subprocess.run(
        [sys.executable, "-m", "composer.cli.main", *map(str, args)], input=stdin, capture_output=True, text=True,
        env=os.environ.copy(), timeout=600,
    )


@pytest.fixture(scope="module")
def causal_dir(tiny_wan_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("causal-cli")
    write_self_forcing_checkpoint(tiny_wan_dir, root / "sf.pt")
    run = cli("convert", "self-forcing", "--checkpoint", root / "sf.pt", "--base", tiny_wan_dir, "--out",
              root / "model", "--use-ema", "--num-frames-per-block", "2", "--local-attn-size", "6", "--sink-size", "2")
    assert run.returncode == 0, run.stderr
    assert f"wrote {root / 'model'}" in run.stdout
    index = json.loads((root / "model" / "model_index.json").read_text())
    assert (index["num_frames_per_block"], index["local_attn_size"], index["sink_size"]) == (2, 6, 2)
    assert index["_composer_source"]["weights"] == "generator_ema"
    return root / "model"


@pytest.mark.slow  # a real process
def test_stream_writes_the_video_block_by_block(causal_dir, tmp_path):
    out = tmp_path / "stream.mp4"
    run = cli("generate", "--model-path", causal_dir, "--prompt", "a red circle", *SIZE, "--num-frames", "29",
              "--stream", "--output", out)
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stdout.splitlines() if line.startswith("block ")]
    assert len(lines) == 4 and lines[0].startswith("block 0 (segment 0): 5 frames")
    assert "profile: 4 blocks" in run.stdout and "time to first frame" in run.stdout
    assert iio.imread(out, plugin="pyav").shape == (29, 32, 48, 3)


@pytest.mark.slow  # moved to the full tier: the quick tier must stay under 5 minutes
def test_segments_switch_prompts_and_set_the_length(causal_dir, tmp_path):
    out = tmp_path / "segments.mp4"
    run = cli("generate", "--model-path", causal_dir, "--segment", "a red circle::2", "--segment", "a cat::1",
              *SIZE, "--output", out)
    assert run.returncode == 0, run.stderr
    assert iio.imread(out, plugin="pyav").shape[0] == 4 * (3 * 2 - 1) + 1
    assert "2 rollouts" in run.stdout


@pytest.mark.slow  # moved to the full tier: the quick tier must stay under 5 minutes
def test_interactive_reads_prompts_from_stdin(causal_dir, tmp_path):
    out = tmp_path / "interactive.mp4"
    run = cli("generate", "--model-path", causal_dir, "--prompt", "a red circle", *SIZE, "--interactive",
              "--blocks-per-prompt", "1", "--output", out, stdin="a blue square::2\nbad::x\na green star\n\n")
    assert run.returncode == 0, run.stderr
    segments = [line.split("(segment ")[1][0] for line in run.stdout.splitlines() if line.startswith("block ")]
    assert segments == ["0", "1", "1", "2"]
    assert "expected PROMPT::BLOCKS" in run.stderr  # the bad line is reported and skipped
    assert iio.imread(out, plugin="pyav").shape[0] == 4 * (2 * 4 - 1) + 1


@pytest.mark.slow
def test_causal_errors_are_one_line(causal_dir, tiny_wan_dir, tmp_path):
    run = cli("generate", "--model-path", causal_dir, "--prompt", "x", *SIZE, "--num-frames", "9",
              "--output", tmp_path / "y.mp4")
    assert run.returncode == 1 and "--num-frames 9: expected a length whose latent frames fill whole 2-frame blocks" in run.stderr
    assert "Traceback" not in run.stderr
    run = cli("generate", "--model-path", tiny_wan_dir, "--prompt", "x", "--height", "32", "--width", "32",
              "--num-frames", "5", "--stream", "--output", tmp_path / "x.mp4")
    assert run.returncode == 1 and "cannot stream" in run.stderr and "Traceback" not in run.stderr
    run = cli("generate", "--model-path", tiny_wan_dir, "--prompt", "x", "--start-image", "a.png",
              "--height", "32", "--width", "32", "--num-frames", "5")
    assert run.returncode == 1 and "--start-image a.png: expected unset (wan2.1-t2v cannot start a stream" in run.stderr
    run = cli("convert", "self-forcing", "--checkpoint", tmp_path / "none.pt", "--base", tiny_wan_dir,
              "--out", tmp_path / "o")
    assert run.returncode == 1 and "does not exist" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.slow  # 3 s: a CLI process
def test_interactive_without_a_first_prompt_is_a_clear_error(causal_dir):
    run = cli("generate", "--model-path", causal_dir, *SIZE, "--interactive", stdin="a cat\n\n")
    assert run.returncode == 1 and "streaming needs a first prompt" in run.stderr and "Traceback" not in run.stderr
