"""Bad input gets a clear, typed error and loses nothing (the loaded generator keeps working)."""

from __future__ import annotations

import json
import shutil

import pytest

from composer import VideoGenerator
from composer.errors import (
    CheckpointError,
    ConfigError,
    InvalidInputError,
    ModelFormatError,
    ModelNotFoundError,
    UnknownModelError,
)
from composer.request_check import RequestError

SMALL = dict(height=32, width=32, num_frames=5, num_inference_steps=2)


@pytest.fixture()
def model_copy(tiny_wan_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_wan_dir, folder)
    return folder


def test_missing_folder(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        VideoGenerator.from_pretrained(tmp_path / "nowhere")


def test_file_instead_of_folder(tmp_path):
    (tmp_path / "weights.safetensors").write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match="is a file"):
        VideoGenerator.from_pretrained(tmp_path / "weights.safetensors")


def test_folder_without_model_index(tmp_path):
    (tmp_path / "transformer").mkdir()
    with pytest.raises(ModelFormatError, match="no model_index.json.*holds: transformer"):
        VideoGenerator.from_pretrained(tmp_path)


def test_model_index_not_json(model_copy):
    (model_copy / "model_index.json").write_text("{not json")
    with pytest.raises(ModelFormatError, match="not valid JSON"):
        VideoGenerator.from_pretrained(model_copy)


def test_unknown_pipeline_class_name(model_copy):
    index = json.loads((model_copy / "model_index.json").read_text())
    index["_class_name"] = "MochiPipeline"
    (model_copy / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(UnknownModelError, match="'MochiPipeline', which composer does not serve"):
        VideoGenerator.from_pretrained(model_copy)


def test_missing_component_folder(model_copy):
    shutil.rmtree(model_copy / "vae")
    with pytest.raises(ModelFormatError, match="lists component 'vae'.*does not exist"):
        VideoGenerator.from_pretrained(model_copy)


def test_corrupt_vae_weights(model_copy):
    path = model_copy / "vae" / "diffusion_pytorch_model.safetensors"
    path.write_bytes(path.read_bytes()[:64])
    with pytest.raises((CheckpointError, ModelFormatError), match="'vae'"):
        VideoGenerator.from_pretrained(model_copy)


def test_wan22_boundary_ratio_without_a_second_expert_is_refused(model_copy):
    """boundary_ratio makes a WanPipeline folder Wan2.2 A14B (composer/pipelines/wan22.py), which needs
    transformer_2: refused before loading."""
    index = json.loads((model_copy / "model_index.json").read_text())
    index["boundary_ratio"] = 0.875
    (model_copy / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="sets boundary_ratio but has no transformer_2"):
        VideoGenerator.from_pretrained(model_copy)


def test_bad_runtime_options_are_all_reported_before_loading(tiny_wan_dir):
    with pytest.raises(ConfigError) as info:
        VideoGenerator.from_pretrained(tiny_wan_dir, dtype="fp8", attention_backend="xformers", dtpye="bf16")
    message = str(info.value)
    assert "unknown runtime option 'dtpye' (did you mean 'dtype'?)" in message
    assert "dtype = 'fp8'" not in message or "expected one of fp32, bf16, fp16" in message


def test_bad_runtime_values_are_all_reported(tiny_wan_dir):
    with pytest.raises(ConfigError) as info:
        VideoGenerator.from_pretrained(tiny_wan_dir, dtype="fp8", attention_backend="xformers", vae_dtype="int4")
    message = str(info.value)
    assert "dtype = 'fp8': expected one of fp32, bf16, fp16" in message
    assert "vae_dtype = 'int4'" in message
    assert "attention_backend = 'xformers'" in message


@pytest.mark.parametrize(
    "kwargs, field, rule",
    [
        (dict(height=65), "height", "multiple of 16 (nearest valid: 64)"),
        (dict(width=100), "width", "multiple of 16 (nearest valid: 96)"),
        (dict(num_frames=10), "num_frames", "4k+1 (nearest valid: 9)"),
        (dict(num_frames=0), "num_frames", "4k+1"),
        (dict(num_inference_steps=0), "num_inference_steps", "a positive integer"),
        (dict(guidance_scale=-1.0), "guidance_scale", "a finite number >= 0"),
        (dict(flow_shift=0.0), "flow_shift", "a finite number > 0"),
        (dict(seed=-5), "seed", "an integer in [0, 9223372036854775807]"),
    ],
)
def test_bad_sampling_values_are_typed_errors_naming_the_field(composer_gen, kwargs, field, rule):
    with pytest.raises(RequestError) as info:  # the up-front request check, before any work
        composer_gen.generate_video("a cat", **{**SMALL, **kwargs})
    assert [f for f, _, _ in info.value.failures] == [field]
    assert rule in str(info.value)


def test_missing_or_empty_prompt(composer_gen):
    for prompt in (None, "   "):  # refused up front, before the stages run
        with pytest.raises(InvalidInputError, match="prompt"):
            composer_gen.generate_video(prompt, **SMALL)


def test_unknown_or_mistyped_sampling_parameters(composer_gen):
    with pytest.raises(ConfigError, match="unknown sampling parameter 'num_steps'"):
        composer_gen.generate_video("a cat", num_steps=4)
    with pytest.raises(ConfigError, match="height = 'tall': expected int"):
        composer_gen.generate_video("a cat", height="tall")


def test_generator_keeps_working_after_bad_requests(composer_gen):
    with pytest.raises(RequestError):
        composer_gen.generate_video("a cat", **{**SMALL, "height": 33})
    result = composer_gen.generate_video("a cat", seed=1, **SMALL)
    assert result.frames.shape == (5, 32, 32, 3)


def test_unwritable_output_suffix(composer_gen, tmp_path):
    from composer.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="the suffix '.xyz' is none of them"):
        composer_gen.generate_video("a cat", seed=1, output_path=str(tmp_path / "out.xyz"), **SMALL)
