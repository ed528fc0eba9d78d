"""A catalogue of bad inputs, through the CLI, the API and files: each one is a typed error that names the
field as the user wrote it (`--height` / `height`) and the value, exits 1 without a traceback, is found
before any model loads (or any work starts) wherever it can be, and leaves every existing file as it was."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from composer.errors import CheckpointError, ComposerError, ConfigError, InvalidInputError
from composer.request_check import RequestError
from composer.video import VideoWriter, save_video

BASE = ["--height", "32", "--width", "32", "--num-frames", "5", "--steps", "1", "--seed", "0"]
FRAMES = np.zeros((5, 32, 32, 3), dtype=np.uint8)


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` with its content hash: what a failed request must leave untouched."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture()
def workdir(tmp_path, monkeypatch):
    """A working folder with outputs from earlier runs, a file in place of a folder, and bad start frames."""
    monkeypatch.chdir(tmp_path)
    Path("old.mp4").write_bytes(b"an earlier video")
    Path("frames").mkdir()
    Path("frames/frame_00000.png").write_bytes(b"an earlier frame")
    Path("afile").write_text("not a folder")
    Path("a_folder.mp4").mkdir()
    Path("corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n garbage")
    Path("corrupt.mp4").write_bytes(b"not a video")
    save_video(FRAMES[:1], "start.png/", fps=1)  # a folder holding one good frame
    return tmp_path


@pytest.fixture()
def no_loading(monkeypatch):
    """Loading a model fails the test: these inputs must be refused before it."""
    from composer.generator import VideoGenerator
    from composer.pipelines.base import ComposedPipeline

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded for a request the up-front check should have refused")

    monkeypatch.setattr(VideoGenerator, "from_pretrained", refuse)
    monkeypatch.setattr(ComposedPipeline, "__init__", refuse)


def cli(*args) -> tuple[int, str]:
    """The CLI in-process: exit code and everything printed to stderr."""
    import contextlib
    import io

    from composer.cli.main import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main([str(a) for a in args])
    return code, err.getvalue()


# (model, extra flags, what the message must hold: the flag and value as typed, then the rule / nearest value)
CLI_CASES = [
    ("wan", ["--height", "30"], ["--height 30", "multiple of 16", "nearest valid: 32"]),
    ("wan", ["--width", "0"], ["--width 0", "positive multiple of 16"]),
    ("wan", ["--height", "-16"], ["--height -16", "positive multiple of 16"]),
    ("wan", ["--height", "32.5"], ["--height 32.5", "an integer"]),
    ("wan", ["--width", "wide"], ["--width wide", "an integer"]),
    ("wan", ["--num-frames", "10"], ["--num-frames 10", "4k+1", "nearest valid: 9"]),
    ("wan", ["--num-frames", "0"], ["--num-frames 0", "4k+1"]),
    ("wan", ["--steps", "0"], ["--steps 0", "a positive integer"]),
    ("wan", ["--steps", "-3"], ["--steps -3", "a positive integer"]),
    ("wan", ["--steps", "many"], ["--steps many", "an integer"]),
    ("wan", ["--guidance-scale", "-1"], ["--guidance-scale -1.0", ">= 0"]),
    ("wan", ["--guidance-scale", "nan"], ["--guidance-scale nan", "a finite number"]),
    ("wan", ["--guidance-scale", "high"], ["--guidance-scale high", "a number"]),
    ("wan", ["--flow-shift", "0"], ["--flow-shift 0.0", "> 0"]),
    ("wan", ["--seed", "-1"], ["--seed -1", "[0, 9223372036854775807]"]),
    ("wan", ["--seed", str(2**63)], [f"--seed {2**63}", "[0, 9223372036854775807]"]),
    ("wan", ["--seed", "1.5"], ["--seed 1.5", "an integer"]),
    ("wan", ["--fps", "0"], ["--fps 0", "a positive integer"]),
    ("wan", ["--fps", "-5", "-o", "x.gif"], ["--fps -5", "a positive integer"]),
    ("wan", ["--fps", "2.5"], ["--fps 2.5", "an integer"]),
    ("wan", ["--prompt", "  "], ["--prompt", "a non-empty prompt"]),
    ("wan", ["-o", "x.png"], ["-o x.png", ".mp4", "a folder of PNG frames", "nearest valid: x.mp4, or x"]),
    ("wan", ["-o", "x.jpg"], ["-o x.jpg", ".gif", "suffix '.jpg'"]),
    ("wan", ["-o", "afile/x.mp4"], ["-o afile/x.mp4", "afile is a file"]),
    ("wan", ["-o", "afile/sub/x.mp4"], ["-o afile/sub/x.mp4", "afile is a file"]),
    ("wan", ["-o", "/proc/composer-test.mp4"], ["-o /proc/composer-test.mp4", "a writable location"]),
    ("wan", ["-o", "old.mp4"], ["-o old.mp4", "exists; pass --overwrite"]),
    ("wan", ["-o", "a_folder.mp4", "--overwrite"], ["-o a_folder.mp4", "is a folder"]),
    ("wan", ["-o", "frames"], ["-o frames", "holds frames; pass --overwrite"]),
    ("wan", ["-o", "{wan}"], ["-o ", "holds other files", "never replaced"]),
    ("wan", ["-o", "{wan}", "--overwrite"], ["-o ", "holds other files"]),
    ("wan", ["--stream"], ["--stream", "cannot stream"]),
    ("wan", ["--segment", "a cat::2"], ["--segment", "a causal model takes prompt segments"]),
    ("wan", ["--start-image", "start.png/frame_00000.png"], ["--start-image start.png/frame_00000.png: expected unset",
                                                           "cannot start a stream from an image"]),
    ("wan", ["--height", "30", "--fps", "0", "-o", "x.png"], ["--height 30", "--fps 0", "-o x.png"]),
    ("causal", ["--num-frames", "10"], ["--num-frames 10", "2-frame blocks", "nearest valid: 13"]),
    ("causal", ["--num-frames", "9"], ["--num-frames 9", "5, 13, 21", "nearest valid: 5"]),
    ("causal", ["--segment", "x::0"], ["--segment 'x::0'", "BLOCKS >= 1"]),
    ("causal", ["--segment", "::2"], ["--segment '::2'", "non-empty PROMPT"]),
    ("causal", ["--segment", "x::two"], ["--segment 'x::two'", "integer BLOCKS"]),
    ("causal", ["--steps", "8"], ["--steps 8", "4-step schedule"]),
    ("causal", ["--flow-shift", "3"], ["--flow-shift 3.0", "unset"]),
    ("causal", ["--guidance-scale", "-2"], ["--guidance-scale -2.0", ">= 0"]),
    ("causal", ["--rollout-blocks", "0"], ["--rollout-blocks 0", "a positive integer"]),
    ("causal", ["--overlap-frames", "-1"], ["--overlap-frames -1", "an integer in [0"]),
    ("causal", ["--start-image", "missing.png"], ["--start-image missing.png", "an existing file"]),
    ("causal", ["--start-image", "corrupt.png"], ["--start-image corrupt.png", "a readable image file"]),
    ("causal", ["--start-video", "corrupt.mp4"], ["--start-video corrupt.mp4", "a readable video file"]),
    ("causal", ["--start-video", "start.png"], ["--start-video start.png", "an existing file (it is a folder)"]),
    ("causal", ["--start-image", "start.png/frame_00000.png", "--start-video", "old.mp4"],
     ["--start-video old.mp4", "give one of them"]),
    ("causal", ["--start-image", "start.png/frame_00000.png", "--num-frames", "13"],
     ["--num-frames 13", "after 1 start latent frame(s)", "9, 17, 25", "nearest valid: 9"]),
    ("causal", ["--stream", "--prompt", ""], ["--prompt", "streaming needs a first prompt"]),
    ("causal", ["--interactive", "--blocks-per-prompt", "0"], ["--blocks-per-prompt 0", "an integer >= 1"]),
    ("causal", ["--segment", "x", "--blocks-per-prompt", "-2"], ["--blocks-per-prompt -2", "an integer >= 1"]),
]


@pytest.mark.parametrize("model, flags, expected", CLI_CASES, ids=[" ".join(c[1]) for c in CLI_CASES])
def test_cli_refuses_before_loading(model, flags, expected, workdir, tiny_wan_dir, tiny_causal_dir, no_loading):
    folder = {"wan": tiny_wan_dir, "causal": tiny_causal_dir}[model]
    flags = [f.replace("{wan}", str(tiny_wan_dir)) for f in flags]
    before, model_before = snapshot(workdir), snapshot(folder)
    code, err = cli("generate", "--model-path", folder, "--prompt", "a cat", *BASE, *flags)
    assert code == 1, err
    assert err.startswith("composer: error:") and "Traceback" not in err
    assert err.count("\n") == 1, err  # one line, however many problems (README)
    for text in expected:
        assert text in err, err
    assert "= -3" not in err and "InputValidationStage" not in err  # the value as given; no internal names
    assert "--segment '" not in err or "--segment" in flags  # only flags the user gave are named
    assert snapshot(workdir) == before and snapshot(folder) == model_before  # nothing written or replaced


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--checkpoint", "{tmp}/none.pt", "--base", "{wan}"], ["checkpoint", "none.pt does not exist"]),
        (["--checkpoint", "{tmp}", "--base", "{wan}"], ["checkpoint", "is a folder"]),
        (["--checkpoint", "{pt}", "--base", "{tmp}/no-base"], ["no-base does not exist"]),
    ],
)
def test_convert_refuses_missing_files_before_loading(flags, expected, tmp_path, tiny_wan_dir, monkeypatch):
    import torch

    (tmp_path / "real.pt").write_bytes(b"x")
    loads = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a) or {})
    flags = [f.replace("{tmp}", str(tmp_path)).replace("{wan}", str(tiny_wan_dir))
             .replace("{pt}", str(tmp_path / "real.pt")) for f in flags]
    code, err = cli("convert", "self-forcing", *flags, "--out", tmp_path / "out")
    assert code == 1 and "Traceback" not in err and not loads
    for text in expected:
        assert text in err, err
    assert not (tmp_path / "out").exists()


# -- the API: the same checks before any work, named as Python keywords ----------------------------------
API_CASES = [
    (dict(height=30), "height = 30", "nearest valid: 32"),
    (dict(width=-32), "width = -32", "positive multiple of 16"),
    (dict(num_frames=10), "num_frames = 10", "nearest valid: 9"),
    (dict(num_inference_steps=-1), "num_inference_steps = -1", "a positive integer"),
    (dict(guidance_scale=float("inf")), "guidance_scale = inf", "a finite number >= 0"),
    (dict(seed=-5), "seed = -5", "[0, 9223372036854775807]"),
    (dict(fps=0), "fps = 0", "a positive integer"),
    (dict(output_path="clip.png"), "output_path = 'clip.png'", "a folder of PNG frames"),
    (dict(output_path="old.mp4"), "output_path = 'old.mp4'", "pass overwrite=True"),
    (dict(output_path="afile/clip.mp4"), "output_path = 'afile/clip.mp4'", "afile is a file"),
]


@pytest.mark.parametrize("kwargs, named, rule", API_CASES, ids=[str(c[0]) for c in API_CASES])
def test_api_refuses_before_any_work(kwargs, named, rule, composer_gen, workdir, monkeypatch):
    def no_work(*args, **kwargs):
        raise AssertionError("the pipeline ran for a request the up-front check should have refused")

    monkeypatch.setattr(composer_gen.pipeline, "prepare", no_work)
    before = snapshot(workdir)
    request = {**dict(height=32, width=32, num_frames=5, num_inference_steps=1, seed=0), **kwargs}
    with pytest.raises(RequestError) as info:
        composer_gen.generate_video("a cat", **request)
    assert named in str(info.value) and rule in str(info.value)
    assert snapshot(workdir) == before


@pytest.mark.parametrize(
    "kwargs, text",
    [
        (dict(height="tall"), "height = 'tall': expected int"),
        (dict(num_frames=9.5), "num_frames = 9.5: expected int"),
        (dict(seed=True), "seed = True: expected int"),
        (dict(guidance_scale="high"), "guidance_scale = 'high': expected float"),
        (dict(fps=2.5), "fps = 2.5: expected int"),
        (dict(overwrite="maybe"), "overwrite = 'maybe': expected bool"),
        (dict(start_image="a.png"), "start_image given, but wan2.1-t2v cannot start a stream from an image"),
    ],
)
def test_api_wrong_types_name_the_field(kwargs, text, composer_gen):
    with pytest.raises(ConfigError) as info:
        composer_gen.generate_video("a cat", **kwargs)
    assert text in str(info.value)


def test_api_segments_and_causal_values(composer_gen, tiny_causal_dir):
    with pytest.raises(RequestError, match="segments = .*a causal model takes prompt segments"):
        composer_gen.generate_video(segments=[("a cat", 2)], height=32, width=32)
    from composer import VideoGenerator

    causal = VideoGenerator.from_pretrained(tiny_causal_dir, dtype="fp32", progress=False)
    for kwargs, text in [
        (dict(segments=[("x", 0)]), "segments[0] = ('x', 0): expected a number of blocks >= 1"),
        (dict(segments=[("", 1)]), "segments[0] = ('', 1): expected a non-empty prompt"),
        (dict(segments=[]), "at least one (prompt, num_blocks) segment"),
        (dict(prompt="x", num_frames=10), "num_frames = 10: expected a length whose latent frames fill whole"),
    ]:
        with pytest.raises(RequestError) as info:
            causal.generate_video(height=32, width=32, **kwargs)
        assert text in str(info.value) and "-3" not in str(info.value)
    with pytest.raises(RequestError, match="num_frames = 10"):
        causal.stream_video("x", height=32, width=32, num_frames=10)


# -- files: weights that are corrupt or do not fit ---------------------------------------------------------
def _broken_model(tiny_wan_dir, tmp_path, how):
    folder = tmp_path / "model"
    shutil.copytree(tiny_wan_dir, folder)
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    if how == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    else:  # a config that does not match its weights
        config = json.loads((folder / "transformer" / "config.json").read_text())
        config["ffn_dim"] = config["ffn_dim"] * 2
        (folder / "transformer" / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("how, text", [("truncated", "diffusion_pytorch_model.safetensors"),
                                        ("wrong shape", "shape")])
def test_broken_weights_are_checkpoint_errors(how, text, tiny_wan_dir, tmp_path):
    from composer import VideoGenerator

    folder = _broken_model(tiny_wan_dir, tmp_path, how)
    with pytest.raises(CheckpointError, match=text):
        VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False)
    code, err = cli("generate", "--model-path", folder, "--prompt", "x", *BASE, "-o", tmp_path / "x.mp4")
    assert code == 1 and "Traceback" not in err and text in err
    assert not (tmp_path / "x.mp4").exists()


# -- files: config values of the wrong type, refused before any component loads ---------------------------
# (component, file, field, value, what the message says is expected)
CONFIG_CASES = [
    ("transformer", "config.json", "num_attention_heads", "four", "expected an integer"),
    ("transformer", "config.json", "patch_size", [1, 2], "expected a list of 3"),
    ("transformer", "config.json", "eps", True, "expected a finite number"),
    ("transformer", "config.json", "cross_attn_norm", 1, "expected true or false"),
    ("vae", "config.json", "z_dim", "sixteen", "expected a number"),
    ("vae", "config.json", "temperal_downsample", "yes", "expected a list"),
    ("text_encoder", "config.json", "d_model", "big", "expected a number"),
    ("scheduler", "scheduler_config.json", "flow_shift", "3", "expected a number"),
]


@pytest.mark.parametrize("component, file, key, value, expected", CONFIG_CASES,
                         ids=[f"{c[0]} {c[2]}" for c in CONFIG_CASES])
def test_a_config_value_of_the_wrong_type_is_one_line_before_loading(component, file, key, value, expected,
                                                                     tiny_wan_dir, tmp_path, monkeypatch):
    from composer import VideoGenerator
    from composer.errors import ModelFormatError
    from composer.loader import components

    folder = tmp_path / "model"
    shutil.copytree(tiny_wan_dir, folder)
    path = folder / component / file
    config = json.loads(path.read_text())
    config[key] = value
    path.write_text(json.dumps(config))
    loaded = []
    for cls in (components.ComposerModelLoader, components.DiffusersModelLoader,
                components.TransformersModelLoader, components.TokenizerLoader, components.SchedulerLoader):
        monkeypatch.setattr(cls, "load", lambda self, folder, spec, *a: loaded.append(spec.name))
    with pytest.raises(ModelFormatError) as info:
        VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False)
    assert loaded == []  # not even the text encoder, which loads first
    message = str(info.value)
    for text in (str(path), f"'{component}'", f"{key} = {value!r}", expected):
        assert text in message, message
    code, err = cli("generate", "--model-path", folder, "--prompt", "x", *BASE, "-o", tmp_path / "x.mp4")
    assert code == 1 and err.count("\n") == 1 and f"{key} = {value!r}" in err and "Traceback" not in err, err
    assert loaded == [] and not (tmp_path / "x.mp4").exists()


def test_a_config_value_of_the_wrong_type_is_one_line_in_a_real_process(tiny_wan_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_wan_dir, folder)
    path = folder / "transformer" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "num_attention_heads": "four"}))
    run = subprocess.run([sys.executable, "-m", "composer.cli.main", "generate", "--model-path", str(folder),
                          "--prompt", "x", *BASE], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=300)
    assert run.returncode == 1 and run.stderr.count("\n") == 1, run.stderr
    assert "transformer/config.json (component 'transformer'): num_attention_heads = 'four': expected an integer" \
        in run.stderr


# -- atomic writing: a failure or Ctrl-C leaves no half-written file ---------------------------------------
@pytest.mark.parametrize("target", ["clip.mp4", "clip.gif", "frames_out", "old.mp4", "frames"])
@pytest.mark.parametrize("failure", [RuntimeError("boom"), KeyboardInterrupt()])
def test_interrupted_writes_leave_nothing(target, failure, workdir):
    before = snapshot(workdir)
    with pytest.raises(type(failure)):
        with VideoWriter(target, fps=8) as writer:
            writer.append(FRAMES[:2])
            raise failure
    assert snapshot(workdir) == before
    assert not [p for p in workdir.rglob(".*")], "a temporary file was left behind"


def test_writes_replace_the_target_only_when_complete(workdir):
    assert save_video(FRAMES, "old.mp4", fps=8) == Path("old.mp4")
    assert Path("old.mp4").read_bytes() != b"an earlier video" and Path("old.mp4").stat().st_size > 100
    save_video(FRAMES[:3], "frames/", fps=8)  # a folder of earlier frames is replaced as a whole
    assert sorted(p.name for p in Path("frames").iterdir()) == [f"frame_{i:05d}.png" for i in range(3)]
    assert not [p for p in workdir.rglob(".*")]


@pytest.mark.parametrize("path, fps, text", [("x.png", 8, "unknown suffix '.png'"), ("x.mp4", 0, "fps = 0"),
                                             ("x.gif", -5, "fps = -5")])
def test_writer_refuses_bad_outputs(path, fps, text, workdir):
    with pytest.raises(InvalidInputError, match=text):
        VideoWriter(path, fps=fps)
    assert not Path(path).exists() and not Path(path).with_suffix("").exists()


def test_api_overwrite_replaces_an_existing_file(composer_gen, workdir):
    result = composer_gen.generate_video("a cat", height=32, width=32, num_frames=5, num_inference_steps=1,
                                         seed=0, output_path="old.mp4", overwrite=True, fps=4)
    assert result.output_path == Path("old.mp4") and Path("old.mp4").stat().st_size > 100


# -- as a user sees it: a real process, one line, no traceback ---------------------------------------------
@pytest.mark.parametrize("flags, text", [(["--fps", "-5", "-o", "x.gif"], "--fps -5"),
                                         (["-o", "/proc/composer-test/x.mp4"], "a writable location")])
def test_real_process_prints_one_line(flags, text, tiny_wan_dir, tmp_path):
    run = subprocess.run([sys.executable, "-m", "composer.cli.main", "generate", "--model-path", str(tiny_wan_dir),
                          "--prompt", "x", *BASE, *flags], capture_output=True, text=True, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, timeout=300)
    assert run.returncode == 1 and "Traceback" not in run.stderr and text in run.stderr
    assert run.stderr.count("\n") == 1 and not list(tmp_path.iterdir())


def test_composer_errors_are_typed():
    assert issubclass(RequestError, InvalidInputError) and issubclass(RequestError, ComposerError)


def test_several_problems_are_one_line_that_names_each(tiny_wan_dir, workdir, no_loading):
    code, err = cli("generate", "--model-path", tiny_wan_dir, "--prompt", "x", "--dtype", "fp13", "--cfg-mode", "both")
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith("composer: error: invalid runtime options (2 problems): dtype = 'fp13'"), err
    assert "cfg_mode = 'both'" in err
    code, err = cli("generate", "--model-path", tiny_wan_dir, "--prompt", "x", *BASE, "--height", "30", "--fps", "0")
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith("composer: error: invalid request (nothing was loaded or generated) (2 problems): "
                          "--height 30: expected"), err
