"""`composer generate` / `composer models`: playable mp4s, presets, errors without tracebacks."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import imageio.v3 as iio
import pytest

SMALL = ["--height", "32", "--width", "48", "--num-frames", "9", "--steps", "2", "--seed", "3"]


def composer_process(*args, env=None, cwd=None):
    """A real `composer` process (exit code, stdout, stderr as a user sees them)."""
    return subprocess.run(
        [sys.executable, "-m", "composer.cli.main", *map(str, args)],
        capture_output=True, text=True, env={**os.environ, **(env or {})}, cwd=cwd, timeout=600,
    )


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture()
def composer(capsys):
    """The same CLI entry point in-process (no interpreter start-up per call)."""
    from composer.cli.main import main

    def run(*args):
        capsys.readouterr()
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        return Run(code, out, err)

    return run


def read_video(path):
    frames = iio.imread(path, plugin="pyav")
    return frames  # [T, H, W, 3]


@pytest.mark.slow  # a real process (the quick tier keeps test_bad_inputs.py's)
def test_generate_writes_a_playable_mp4(tiny_wan_dir, tmp_path):
    out = tmp_path / "clip.mp4"
    run = composer_process("generate", "--model-path", tiny_wan_dir, "--prompt", "a red circle", *SMALL,
                   "--fps", "8", "--output", out)
    assert run.returncode == 0, run.stderr
    assert f"wrote {out} (9 frames, 48x32, 8 fps, seed 3)" in run.stdout
    frames = read_video(out)
    assert frames.shape == (9, 32, 48, 3)
    meta = iio.immeta(out, plugin="pyav")
    assert meta["fps"] == 8 and meta["codec"] == "h264"


def test_generated_file_matches_the_api_frames(composer, tiny_wan_dir, tmp_path, composer_gen):
    """The mp4 holds the generated frames (up to lossy video coding)."""
    out = tmp_path / "clip.mp4"
    run = composer("generate", "--model-path", tiny_wan_dir, "--prompt", "a red circle", *SMALL, "--output", out)
    assert run.returncode == 0, run.stderr
    api = composer_gen.generate_video("a red circle", height=32, width=48, num_frames=9, num_inference_steps=2,
                                      seed=3, negative_prompt=composer_gen.default_sampling.negative_prompt)
    decoded = read_video(out).astype(float)
    assert abs(decoded.mean() - api.frames.mean()) < 8


def test_preset_then_flags_take_precedence(composer, tiny_wan_dir, tmp_path):
    preset = tmp_path / "preset.yaml"
    preset.write_text(
        f"model_path: {tiny_wan_dir}\nruntime:\n  dtype: fp32\n"
        "sampling:\n  height: 32\n  width: 32\n  num_frames: 5\n  num_inference_steps: 2\n  fps: 4\n"
    )
    out = tmp_path / "from-preset.mp4"
    run = composer("generate", "--config", preset, "--prompt", "a cat", "--num-frames", "9", "--output", out)
    assert run.returncode == 0, run.stderr
    assert read_video(out).shape == (9, 32, 32, 3)  # num_frames from the flag, size from the preset
    assert "4 fps" in run.stdout


def test_default_output_path_is_under_outputs(composer, tiny_wan_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = composer("generate", "--model-path", tiny_wan_dir, "--prompt", "A Cat, Surfing!", *SMALL)
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "outputs" / "a-cat-surfing-3.mp4").is_file()


def test_gif_and_png_outputs(composer, tiny_wan_dir, tmp_path):
    run = composer("generate", "--model-path", tiny_wan_dir, "--prompt", "x", *SMALL, "--output", tmp_path / "a.gif")
    assert run.returncode == 0, run.stderr
    assert iio.imread(tmp_path / "a.gif").shape[0] == 9
    run = composer("generate", "--model-path", tiny_wan_dir, "--prompt", "x", *SMALL, "--output", tmp_path / "pngs")
    assert run.returncode == 0, run.stderr
    assert len(list((tmp_path / "pngs").glob("frame_*.png"))) == 9


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model-path", "/no/such/folder", "--prompt", "x"], "model folder /no/such/folder does not exist"),
        (["--height", "65"], "--height 65: expected a positive multiple of 16 (nearest valid: 64)"),
        (["--num-frames", "8"], "--num-frames 8: expected a positive integer of the form 4k+1 (nearest valid: 9)"),
        (["--steps", "0"], "--steps 0: expected a positive integer"),
        (["--steps", "many"], "--steps many: expected an integer"),
        (["--dtype", "fp64"], "dtype = 'fp64': expected one of fp32, bf16, fp16"),
        (["--config", "/no/preset.yaml"], "preset /no/preset.yaml does not exist"),
    ],
)
def test_errors_print_one_message_without_traceback(composer, tiny_wan_dir, args, message):
    base = ["generate", "--model-path", tiny_wan_dir, "--prompt", "x", "--height", "32", "--width", "32",
            "--num-frames", "5", "--steps", "1"]
    run = composer(*base, *args)
    assert run.returncode == 1
    assert message in run.stderr
    assert "Traceback" not in run.stderr


def test_missing_model_index_in_a_real_process(tmp_path):
    run = composer_process("generate", "--model-path", tmp_path, "--prompt", "x")
    assert run.returncode == 1 and "no model_index.json" in run.stderr and "Traceback" not in run.stderr


def test_models_lists_families_pipelines_and_classes(composer):
    run = composer("models")
    assert run.returncode == 0, run.stderr
    for text in ("wan2.1-t2v", "Wan-AI/Wan2.1-T2V-14B-Diffusers", "WanPipeline -> composer.pipelines.wan.WanPipeline",
                 "WanTransformer3DModel -> composer.models.wan.transformer.WanTransformer3DModel"):
        assert text in run.stdout


@pytest.mark.slow  # moved to the full tier: the quick tier must stay under 5 minutes
def test_generate_without_model_path_uses_the_embedded_default(tmp_path):
    run = composer_process("generate", "--prompt", "a red circle moving left on a black background", "--steps", "4",
                           "--num-frames", "5", "--seed", "0", "--output", tmp_path / "demo.mp4")
    assert run.returncode == 0, run.stderr
    assert "with shapes-t2v" in run.stdout
    assert read_video(tmp_path / "demo.mp4").shape == (5, 64, 64, 3)
