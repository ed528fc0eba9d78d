"""RuntimeArgs and SamplingParam: one name per knob, coercion from strings, all errors at once, presets."""

from __future__ import annotations

import pytest
import torch

from composer.configs.base import SamplingParam
from composer.errors import ConfigError
from composer.presets import load_preset
from composer.runtime import RuntimeArgs


def test_runtime_defaults_and_dtypes():
    args = RuntimeArgs.from_kwargs()
    assert args.torch_device.type in ("cpu", "cuda")
    expected = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    assert args.torch_dtype == expected
    assert args.vae_torch_dtype == torch.float32
    args = RuntimeArgs.from_kwargs(dtype=torch.bfloat16, text_encoder_dtype="fp16", device="cpu")
    assert (args.torch_dtype, args.text_encoder_torch_dtype) == (torch.bfloat16, torch.float16)


def test_runtime_values_from_strings():
    args = RuntimeArgs.from_kwargs(progress="false", verify_values="yes")
    assert args.progress is False and args.verify_values is True
    with pytest.raises(ConfigError, match="progress = 'maybe': expected bool"):
        RuntimeArgs.from_kwargs(progress="maybe")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_requested_without_a_gpu():
    with pytest.raises(ConfigError, match="CUDA is not available"):
        RuntimeArgs.from_kwargs(device="cuda")


def test_sampling_updates_coerce_and_report_every_bad_key():
    sp = SamplingParam().updated(height="64", guidance_scale="3.5", seed="7", prompt="x")
    assert (sp.height, sp.guidance_scale, sp.seed, sp.prompt) == (64, 3.5, 7, "x")
    with pytest.raises(ConfigError) as info:
        SamplingParam().updated(heigth=64, num_frames=3.5, guidance="high")
    message = str(info.value)
    assert "unknown sampling parameter 'heigth' (did you mean 'height'?)" in message
    assert "num_frames = 3.5: expected int" in message
    assert "unknown sampling parameter 'guidance'" in message


def test_preset_loads_and_rejects_unknown_keys(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("model_path: /models/wan\nruntime:\n  dtype: bf16\nsampling:\n  num_inference_steps: 30\n")
    preset = load_preset(good)
    assert preset.model_path == "/models/wan"
    assert preset.runtime == {"dtype": "bf16"} and preset.sampling == {"num_inference_steps": 30}

    bad = tmp_path / "bad.yaml"
    bad.write_text("modelpath: x\nruntime:\n  dtyp: bf16\nsampling:\n  steps: 3\n")
    with pytest.raises(ConfigError) as info:
        load_preset(bad)
    assert "unknown top-level key 'modelpath'" in str(info.value)

    bad.write_text("runtime:\n  dtyp: bf16\nsampling:\n  steps: 3\n")
    with pytest.raises(ConfigError) as info:
        load_preset(bad)
    assert "'dtyp' (did you mean 'dtype'?)" in str(info.value)
    assert "unknown sampling parameter 'steps'" in str(info.value)

    with pytest.raises(ConfigError, match="not valid YAML"):
        bad.write_text("runtime: [unclosed")
        load_preset(bad)


@pytest.mark.parametrize("name", ["wan2.1-t2v-1.3b.yaml", "wan2.1-t2v-14b.yaml", "wan2.1-t2v-14b-720p.yaml"])
def test_shipped_presets_are_valid(name):
    from pathlib import Path

    preset = load_preset(Path(__file__).parent.parent / "configs" / name)
    SamplingParam().updated(**preset.sampling)
    RuntimeArgs.from_kwargs(**{k: v for k, v in preset.runtime.items() if k != "device"})
