"""Weight-only quantization as a hook (`quantize = none | int8 | fp8`): none is the exact path bit for bit, int8
quantizes the repeated blocks' linears (about 1/4 of their fp32 bytes) and keeps the frames close, fp8 needs fp8
hardware, LoRA works unfused and is refused fused; a folder quantized once loads to the same outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_lora import lora_weights, write_lora

from composer import VideoGenerator
from composer.errors import ConfigError

pytest.importorskip("torchao", reason="the optional extra `quant` (torchao) is not installed")

from composer.accel.quantize import block_linears, is_quantized, linear_weight_bytes  # noqa: E402

REQUEST = dict(negative_prompt="blurry", guidance_scale=4.0, height=32, width=32, num_frames=5,
               num_inference_steps=3, seed=3)
PROMPT = "a red ball bouncing"
PSNR_FLOOR_DB = 25.0


def _gen(folder, **runtime):
    return VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False, **runtime)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


@pytest.fixture(scope="module")
def base_gen(tiny_wan_dir):
    return _gen(tiny_wan_dir)


@pytest.fixture(scope="module")
def base(base_gen):
    return base_gen.generate_video(PROMPT, **REQUEST)


@pytest.fixture(scope="module")
def int8_gen(tiny_wan_dir):
    return _gen(tiny_wan_dir, quantize="int8")


@pytest.fixture(scope="module")
def int8_result(int8_gen):
    return int8_gen.generate_video(PROMPT, **REQUEST)


@pytest.fixture(scope="module")
def lora_file(base_gen, tmp_path_factory):
    model = base_gen.pipeline.modules["transformer"]
    return write_lora(tmp_path_factory.mktemp("lora") / "one.safetensors", "diffusers", lora_weights(model, seed=1))


def test_quantize_none_is_the_exact_path_bit_for_bit(tiny_wan_dir, base):
    gen = _gen(tiny_wan_dir, quantize="none")
    assert not any(line.startswith("quantize") for line in gen.pipeline.applied_hooks)
    assert not any(is_quantized(p) for p in gen.pipeline.modules["transformer"].parameters())
    out = gen.generate_video(PROMPT, **REQUEST)
    assert np.array_equal(out.frames, base.frames)
    assert torch.equal(out.latents, base.latents)


def test_int8_quantizes_the_block_linears_to_a_quarter_of_their_bytes(base_gen, int8_gen):
    full, quant = base_gen.pipeline.modules["transformer"], int8_gen.pipeline.modules["transformer"]
    linears = block_linears(quant)
    assert linears and all(is_quantized(m.weight) for m in linears)
    # what is outside the blocks stays as it was
    assert not is_quantized(quant.proj_out.weight) and quant.proj_out.weight.dtype == torch.float32
    ratio = linear_weight_bytes(quant) / linear_weight_bytes(full)
    assert 0.24 < ratio < 0.30, ratio  # int8 data plus one fp32 scale per output row
    assert int8_gen.pipeline.applied_hooks[0].startswith("quantize: int8 weight-only (torchao")


def test_int8_frames_stay_close_to_the_exact_ones(base, int8_result):
    assert torch.isfinite(int8_result.latents).all()
    assert not torch.equal(int8_result.latents, base.latents)  # it did change the model
    value = psnr(int8_result.frames, base.frames)
    print(f"int8 vs exact: PSNR {value:.1f} dB")
    assert value >= PSNR_FLOOR_DB, f"PSNR {value:.1f} dB"


def test_fp8_without_fp8_hardware_is_a_clear_config_error(tiny_wan_dir):
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this machine has fp8 hardware")
    with pytest.raises(ConfigError, match=r"fp8 needs a GPU with fp8 support \(compute capability 8.9\+\): this "
                                          r"machine has"):
        _gen(tiny_wan_dir, quantize="fp8", device="cpu")


def test_a_bad_value_is_a_config_error_listing_the_choices(tiny_wan_dir):
    with pytest.raises(ConfigError, match="quantize = 'int4': expected one of none, int8, fp8"):
        _gen(tiny_wan_dir, quantize="int4")


def test_fused_lora_on_a_quantized_model_is_refused(tiny_wan_dir, lora_file):
    with pytest.raises(ConfigError, match="lora_fuse with quantize = int8"):
        _gen(tiny_wan_dir, quantize="int8", lora_path=[str(lora_file)], lora_fuse=True)
    with pytest.raises(ConfigError, match="quantize = int8 with offload = disk"):
        _gen(tiny_wan_dir, quantize="int8", offload="disk")


def test_unfused_lora_runs_beside_the_quantized_layers(tiny_wan_dir, int8_result, lora_file):
    gen = _gen(tiny_wan_dir, quantize="int8", lora_path=[str(lora_file)])
    assert [line.split(":")[0] for line in gen.pipeline.applied_hooks][:2] == ["quantize", "lora"]
    with_lora = gen.generate_video(PROMPT, **REQUEST)
    assert torch.isfinite(with_lora.latents).all()
    assert not torch.equal(with_lora.latents, int8_result.latents)  # the adapter acts
    # unset gives the quantized model back exactly
    gen.pipeline.lora_adapters("transformer").unset()
    assert torch.equal(gen.generate_video(PROMPT, **REQUEST).latents, int8_result.latents)
    # and the same adapter on the quantized layers computes what it computes on their dequantized weights
    exact = _gen(tiny_wan_dir, lora_path=[str(lora_file)])
    dequantized(exact.pipeline.modules["transformer"], gen.pipeline.modules["transformer"])
    assert torch.allclose(exact.generate_video(PROMPT, **REQUEST).latents, with_lora.latents, atol=1e-4)


def dequantized(target: torch.nn.Module, quantized: torch.nn.Module) -> None:
    """Copy `quantized`'s block linears, dequantized, into `target`'s (LoRA-wrapped or plain) linears."""
    for (name, q), t in zip(_named_block_linears(quantized), (m for _, m in _named_block_linears(target))):
        with torch.no_grad():
            t.weight.copy_(q.weight.dequantize())
        assert name


def _named_block_linears(model):
    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and ".blocks." in f".{n}" and "lora_" not in n]


# -- quantize once: the converted folder ----------------------------------------------------------------
def test_a_quantized_folder_loads_to_the_same_outputs_as_quantizing_at_load(tiny_wan_dir, int8_result, tmp_path):
    from composer.cli.main import main

    out = tmp_path / "tiny-int8"
    assert main(["convert", "quantize", "--model-path", str(tiny_wan_dir), "--quantize", "int8",
                 "--out", str(out)]) == 0
    assert (out / "transformer" / "quantized.pt").is_file()
    assert not list((out / "transformer").glob("*.safetensors"))  # the full-precision weights are not copied
    assert (out / "vae").is_dir() and list((out / "vae").iterdir())
    gen = _gen(out)  # quantize unset: the folder turns it on
    assert gen.pipeline.applied_hooks[0].startswith("quantize: int8") and "read quantized" in \
        gen.pipeline.applied_hooks[0]
    assert all(is_quantized(m.weight) for m in block_linears(gen.pipeline.modules["transformer"]))
    result = gen.generate_video(PROMPT, **REQUEST)
    assert torch.equal(result.latents, int8_result.latents)
    assert np.array_equal(result.frames, int8_result.frames)
    with pytest.raises(ConfigError, match="holds int8 weights"):
        _gen(out, quantize="fp8")


def test_quantize_and_step_cache_compose(tiny_wan_dir, int8_result, one_thread):
    """int8 weights under teacache: the cache plans from the timestep projection (not quantized), so its plan is
    the full-precision one, and the step it skips reuses the int8 blocks' residual."""
    cache = dict(cache="teacache", cache_threshold=100.0, cache_warmup_steps=1)

    def run(**runtime):
        gen = _gen(tiny_wan_dir, **cache, **runtime)
        result = gen.generate_video(PROMPT, **REQUEST)
        return gen, result, next(h for h in gen.pipeline.hooks if h.name == "cache").hooks[0].stats

    _, plain_result, plain = run()
    stacked_gen, stacked, stats = run(quantize="int8")
    assert stats.per_run == plain.per_run and 0 < stats.skipped < stats.calls
    assert all(is_quantized(m.weight) for m in block_linears(stacked_gen.pipeline.modules["transformer"]))
    assert not np.array_equal(stacked.frames, int8_result.frames)  # a step was skipped
    assert not np.array_equal(stacked.frames, plain_result.frames)  # on int8 weights
