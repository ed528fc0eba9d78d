"""A model folder's composer.json says what it is: its family and sampling defaults survive a rename."""

from __future__ import annotations

import json
import shutil

import pytest

from composer import VideoGenerator
from composer.demo.packaged import PACKAGED
from composer.errors import ConfigError, UnknownModelError


def copy_with_settings(src, dst, settings=None):
    """A renamed copy of a model folder, with `settings` as its composer.json (None: keep the source's)."""
    shutil.copytree(src, dst)
    if settings is not None:
        (dst / "composer.json").write_text(settings if isinstance(settings, str) else json.dumps(settings))
    return dst


def test_a_renamed_copy_of_the_shapes_model_keeps_its_family_and_defaults(tmp_path):
    gen = VideoGenerator.from_pretrained(copy_with_settings(PACKAGED / "shapes-t2v", tmp_path / "my-model"),
                                         progress=False)
    assert gen.family == "shapes-t2v"
    result = gen.generate_video("a red circle moving left", seed=0)
    assert result.frames.shape == (17, 64, 64, 3)
    assert (result.sampling.num_inference_steps, result.sampling.guidance_scale, result.sampling.fps) == (24, 5.0, 8)
    assert result.sampling.flow_shift == 3.0  # the scheduler-derived folder default still applies
    # the user's explicit values win over the file
    small = gen.generate_video("a red circle moving left", seed=0, height=32, num_frames=5, num_inference_steps=2)
    assert small.frames.shape == (5, 32, 64, 3) and small.sampling.num_inference_steps == 2


@pytest.mark.parametrize("name", ["shapes-t2v", "shapes-causal"])
def test_shipped_files_state_their_families_defaults(name):
    from composer.registry.configs import registered_families

    family = next(f for f in registered_families() if f.name == name)
    stated = json.loads((PACKAGED / name / "composer.json").read_text())
    assert stated["family"] == name
    defaults = family.sampling_param_cls()
    assert stated["sampling"] == {k: getattr(defaults, k) for k in stated["sampling"]}


def test_the_file_wins_over_family_and_scheduler_defaults_and_loses_to_the_option(tiny_wan_dir, tmp_path):
    folder = copy_with_settings(tiny_wan_dir, tmp_path / "renamed", {
        "family": "shapes-t2v", "sampling": {"num_frames": 9, "flow_shift": 2.0, "negative_prompt": None},
    })
    gen = VideoGenerator.from_pretrained(folder, progress=False)
    sp = gen.default_sampling
    assert gen.family == "shapes-t2v" and (sp.height, sp.num_inference_steps) == (64, 24)  # the family's
    assert (sp.num_frames, sp.flow_shift, sp.negative_prompt) == (9, 2.0, None)  # the file's (None clears)
    assert gen.sampling_param(num_frames=13).num_frames == 13
    # the runtime option names the family outright; the file's sampling values still apply over it
    gen = VideoGenerator.from_pretrained(folder, progress=False, model_family="wan2.1-t2v")
    assert gen.family == "wan2.1-t2v" and gen.default_sampling.height == 480 and gen.default_sampling.num_frames == 9
    # sampling alone: the family still comes from the path (here Wan2.1's detector)
    folder = copy_with_settings(tiny_wan_dir, tmp_path / "only-sampling", {"sampling": {"height": 32}})
    gen = VideoGenerator.from_pretrained(folder, progress=False)
    assert gen.family == "wan2.1-t2v" and (gen.default_sampling.height, gen.default_sampling.width) == (32, 832)


@pytest.mark.parametrize(
    "settings, error, message",
    [
        ("{not json", ConfigError, "is not valid JSON"),
        ("[1, 2]", ConfigError, "holds a list; expected {\"family\""),
        ({"familly": "shapes-t2v"}, ConfigError, "unknown key 'familly' (did you mean 'family'?)"),
        ({"sampling": {"hieght": 64}}, ConfigError, "unknown sampling default 'hieght' (did you mean 'height'?)"),
        ({"sampling": {"height": "tall"}}, ConfigError, "height = 'tall': expected int"),
        ({"sampling": {"seed": 3}}, ConfigError, "sampling.seed: a request's own setting"),
        ({"sampling": [64]}, ConfigError, "sampling = [64]: expected an object"),
        ({"family": "no-such-family"}, UnknownModelError, "family = 'no-such-family': no registered family"),
    ],
)
def test_a_bad_file_is_one_error_naming_it(tiny_wan_dir, tmp_path, settings, error, message):
    folder = copy_with_settings(tiny_wan_dir, tmp_path / "bad", settings)
    with pytest.raises(error) as info:
        VideoGenerator.from_pretrained(folder, progress=False)
    assert str(folder / "composer.json") in str(info.value)
    assert message in str(info.value)
