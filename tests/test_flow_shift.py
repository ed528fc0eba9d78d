"""The flow shift: the model folder's scheduler setting is the default, the family's value fills in only where
the folder states none, and an explicit flow_shift (kwarg, flag, preset) overrides both."""

from __future__ import annotations

import json
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest
from conftest import diffusers_frames, max_uint8_diff

from composer import VideoGenerator
from composer.errors import UnsupportedError
from composer.testing import build_tiny_wan

REPO = Path(__file__).resolve().parent.parent
PROMPT = "a red circle moving left"
# Tiny but not degenerate; CFG on, with the negative prompt given to both engines (the family's default negative
# prompt is not diffusers' default).
SMALL = dict(negative_prompt="", guidance_scale=3.0, height=32, width=32, num_frames=5, num_inference_steps=3)
FAMILY_SHIFT = 3.0  # WanT2V480PSamplingParam.flow_shift


def _diffusers_pipe(folder: Path, **scheduler_overrides):
    """diffusers' WanPipeline on the folder, its scheduler as the folder says unless overridden."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)
    if scheduler_overrides:
        pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config, **scheduler_overrides)
    return pipe


def _load(folder: Path) -> VideoGenerator:
    return VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False)


def _edit_scheduler_config(folder: Path, edit) -> None:
    path = folder / "scheduler" / "scheduler_config.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


@pytest.fixture(scope="module")
def euler5_dir(tmp_path_factory):
    return build_tiny_wan(tmp_path_factory.mktemp("models") / "euler-shift-5", scheduler="euler", flow_shift=5.0)


@pytest.fixture(scope="module")
def euler5_gen(euler5_dir):
    return _load(euler5_dir)


@pytest.fixture(scope="module")
def unipc7_dir(tmp_path_factory):
    return build_tiny_wan(tmp_path_factory.mktemp("models") / "unipc-shift-7", scheduler="unipc", flow_shift=7.0)


@pytest.mark.parametrize("scheduler, key, shift", [("euler", "shift", 5.0), ("unipc", "flow_shift", 7.0)])
def test_folder_shift_is_the_default_and_matches_diffusers(request, scheduler, key, shift):
    folder = request.getfixturevalue({"euler": "euler5_dir", "unipc": "unipc7_dir"}[scheduler])
    assert json.loads((folder / "scheduler" / "scheduler_config.json").read_text())[key] == shift
    gen = request.getfixturevalue("euler5_gen") if scheduler == "euler" else _load(folder)
    assert gen.default_sampling.flow_shift == shift

    ours = gen.generate_video(PROMPT, seed=0, **SMALL)  # no flow_shift: the folder's
    ref = diffusers_frames(_diffusers_pipe(folder), PROMPT, 0, **SMALL)
    assert ours.frames.std() > 1.0, "degenerate video: the comparison would prove nothing"
    assert max_uint8_diff(ours.frames, ref) <= 1
    assert ours.sampling.flow_shift == shift
    # The family's 3.0 (what composer used to force on every Wan folder) gives another video.
    family = gen.generate_video(PROMPT, seed=0, flow_shift=FAMILY_SHIFT, **SMALL)
    assert max_uint8_diff(family.frames, ours.frames) > 1


def test_explicit_flow_shift_kwarg_overrides_the_folder(euler5_dir, euler5_gen):
    ours = euler5_gen.generate_video(PROMPT, seed=1, flow_shift=2.0, **SMALL)
    ref = diffusers_frames(_diffusers_pipe(euler5_dir, shift=2.0), PROMPT, 1, **SMALL)
    assert max_uint8_diff(ours.frames, ref) <= 1
    assert euler5_gen.default_sampling.flow_shift == 5.0  # a request changes only itself


def _preset(tmp_path: Path, folder: Path) -> Path:
    preset = tmp_path / "preset.yaml"
    sampling = "".join(f"  {k}: {json.dumps(v)}\n" for k, v in SMALL.items())
    preset.write_text(f"model_path: {folder}\nruntime:\n  dtype: fp32\nsampling:\n{sampling}  flow_shift: 2.0\n")
    return preset


def test_preset_flow_shift_overrides_the_folder_in_the_cli_and_the_generator(euler5_dir, euler5_gen, tmp_path,
                                                                             capsys):
    from composer.cli.main import main
    from composer.presets import load_preset

    ref = diffusers_frames(_diffusers_pipe(euler5_dir, shift=2.0), PROMPT, 2, **SMALL)
    preset = _preset(tmp_path, euler5_dir)

    api = euler5_gen.generate_video(PROMPT, seed=2, **load_preset(preset).sampling)  # a preset in Python
    assert max_uint8_diff(api.frames, ref) <= 1

    out = tmp_path / "pngs"  # lossless, so the CLI's frames can be compared too
    assert main(["generate", "--config", str(preset), "--prompt", PROMPT, "--seed", "2", "--output", str(out)]) == 0
    capsys.readouterr()
    cli = np.stack([iio.imread(p) for p in sorted(out.glob("frame_*.png"))])
    assert max_uint8_diff(cli, ref) <= 1


def test_cli_flag_overrides_the_preset_and_the_folder(euler5_dir, euler5_gen, tmp_path, capsys):
    from composer.cli.main import main

    out = tmp_path / "pngs"
    code = main(["generate", "--config", str(_preset(tmp_path, euler5_dir)), "--prompt", PROMPT, "--seed", "3",
                 "--flow-shift", "8", "--output", str(out)])
    assert code == 0
    capsys.readouterr()
    cli = np.stack([iio.imread(p) for p in sorted(out.glob("frame_*.png"))])
    api = euler5_gen.generate_video(PROMPT, seed=3, flow_shift=8.0, **SMALL)
    assert max_uint8_diff(cli, api.frames) == 0


def test_folder_that_states_no_shift_gets_the_family_value(tmp_path):
    """diffusers fills a shift missing from scheduler_config.json with its own default (1.0); the folder said
    nothing, so composer's family value fills in, as it would for any setting the folder leaves open."""
    folder = build_tiny_wan(tmp_path / "no-shift", scheduler="unipc", flow_shift=7.0)
    _edit_scheduler_config(folder, lambda config: {k: v for k, v in config.items() if k != "flow_shift"})
    pipe = _diffusers_pipe(folder)
    assert pipe.scheduler.config.flow_shift == 1.0  # diffusers' filled-in default, not the folder's word

    gen = _load(folder)
    assert gen.default_sampling.flow_shift == FAMILY_SHIFT
    ours = gen.generate_video(PROMPT, seed=4, **SMALL)
    pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config, flow_shift=FAMILY_SHIFT)
    ref = diffusers_frames(pipe, PROMPT, 4, **SMALL)
    assert max_uint8_diff(ours.frames, ref) <= 1


# diffusers' EulerDiscreteScheduler trips over numpy 2's copy keyword; nothing of composer's.
@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")
def test_scheduler_without_a_shift_setting_takes_no_family_shift(tmp_path):
    """A scheduler with no shift to set: the family's 3.0 must not stand as a default it would refuse."""
    folder = build_tiny_wan(tmp_path / "no-shift-setting")
    index_path = folder / "model_index.json"
    index = json.loads(index_path.read_text())
    index["scheduler"] = ["diffusers", "EulerDiscreteScheduler"]
    index_path.write_text(json.dumps(index))
    _edit_scheduler_config(folder, lambda config: {"_class_name": "EulerDiscreteScheduler", "num_train_timesteps": 1000})

    gen = _load(folder)
    assert gen.default_sampling.flow_shift is None
    assert gen.generate_video(PROMPT, seed=0, **{**SMALL, "num_inference_steps": 2}).frames.shape == (5, 32, 32, 3)
    with pytest.raises(UnsupportedError, match="no flow shift setting"):
        gen.generate_video(PROMPT, seed=0, flow_shift=3.0, **{**SMALL, "num_inference_steps": 2})


def test_embedded_default_model_reports_its_folder_shift():
    from composer.default_model import default_model_path

    stated = json.loads((Path(default_model_path()) / "scheduler" / "scheduler_config.json").read_text())
    gen = _load(None)
    assert gen.default_sampling.flow_shift == stated["flow_shift"]


def test_help_says_the_default_is_the_folders_scheduler_setting(capsys):
    from composer.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--help-all"])  # (every flag: --help shows the common ones)
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    flow_shift_help = help_text.rsplit("--flow-shift FLOAT", 1)[1].split("--seed", 1)[0]
    assert "default: the model folder's scheduler setting" in flow_shift_help
    assert "scheduler_config.json" in flow_shift_help and "the family's value where the folder states none" in (
        flow_shift_help
    )


def test_released_presets_set_flow_shift_only_where_they_differ_from_the_folder():
    """The released Wan2.1 folders' schedulers say 3.0: the 480p presets leave the shift to the folder, the 720p
    preset chooses 5.0 on purpose."""
    from composer.presets import load_preset

    assert "flow_shift" not in load_preset(REPO / "configs" / "wan2.1-t2v-1.3b.yaml").sampling
    assert "flow_shift" not in load_preset(REPO / "configs" / "wan2.1-t2v-14b.yaml").sampling
    assert load_preset(REPO / "configs" / "wan2.1-t2v-14b-720p.yaml").sampling["flow_shift"] == 5.0
