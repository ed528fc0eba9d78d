"""Text files composer reads (presets, model_index.json and component configs, safetensors indexes, prompt files,
a PEFT adapter_config.json): one that is not UTF-8, or not valid JSON, is one typed error line naming the file,
never a UnicodeDecodeError traceback."""

from __future__ import annotations

import shutil

import pytest

from composer.errors import CheckpointError, ConfigError

NOT_UTF8 = "modèle: ü".encode("latin-1")  # 0xe8 and 0xfc start no UTF-8 sequence here
SMALL = ["--height", "32", "--width", "32", "--num-frames", "5", "--steps", "1", "--seed", "0"]


def test_a_preset_that_is_not_utf8_is_one_error_naming_it(cli, tmp_path):
    from composer.presets import load_preset

    preset = tmp_path / "preset.yaml"
    preset.write_bytes(b"sampling:\n  prompt: " + NOT_UTF8 + b"\n")
    with pytest.raises(ConfigError, match=f"preset {preset} is not UTF-8 text"):
        load_preset(preset)
    code, _, err = cli("generate", "--config", preset, "--prompt", "x")
    assert code == 1 and "Traceback" not in err
    assert err.strip().splitlines() == [f"composer: error: preset {preset} is not UTF-8 text (byte 23: invalid "
                                        "continuation byte); save it as UTF-8 YAML"]


@pytest.mark.parametrize("name", ["model_index.json", "transformer/config.json"])
@pytest.mark.parametrize("content", [NOT_UTF8, b"{not json"])
def test_a_broken_model_config_is_one_error_naming_it(cli, tiny_wan_dir, tmp_path, name, content):
    folder = tmp_path / "model"
    shutil.copytree(tiny_wan_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    (folder / name).write_bytes(content)
    code, _, err = cli("generate", "--model-path", folder, "--prompt", "x", *SMALL, "--output", tmp_path / "o.mp4")
    assert code == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"{folder / name} is not valid JSON" in err


def test_a_safetensors_index_that_is_not_utf8_names_it(tmp_path):
    from composer.loader.weights import find_weight_files

    (tmp_path / "model.safetensors.index.json").write_bytes(NOT_UTF8)
    with pytest.raises(CheckpointError, match="model.safetensors.index.json is not a valid safetensors index"):
        find_weight_files(tmp_path)


def test_a_prompt_file_that_is_not_utf8_names_it(tmp_path):
    from composer.prompt_lists import read_prompt_file

    (tmp_path / "prompts.txt").write_bytes(NOT_UTF8)
    with pytest.raises(ConfigError, match=f"--prompt-file {tmp_path / 'prompts.txt'}: not UTF-8 text"):
        read_prompt_file(tmp_path / "prompts.txt")


def test_a_peft_adapter_config_that_is_not_utf8_names_it(tmp_path):
    from composer.accel.lora_names import _adapter_config

    (tmp_path / "adapter_config.json").write_bytes(NOT_UTF8)
    with pytest.raises(CheckpointError, match="adapter_config.json is not a JSON object"):
        _adapter_config(tmp_path / "adapter_model.safetensors", {})


def test_convert_names_a_broken_base_config(cli, tiny_wan_dir, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(tiny_wan_dir, base, ignore=shutil.ignore_patterns("*.safetensors"))
    (base / "transformer" / "config.json").write_bytes(NOT_UTF8)
    (tmp_path / "sf.pt").write_bytes(b"")
    code, _, err = cli("convert", "self-forcing", "--checkpoint", tmp_path / "sf.pt", "--base", base,
                       "--out", tmp_path / "out")
    assert code == 1 and "Traceback" not in err
    assert f"{base / 'transformer' / 'config.json'} is not valid JSON" in err
