"""LoRA on two-expert and image models: `lora_expert` picks the denoiser(s) each file goes to (Wan2.2 A14B, against
diffusers' `load_lora_weights(..., load_into_transformer_2=...)`), I2V LoRA keys (`k_img`, `v_img`, `img_emb`) load
by name, and a LoRA that leaves out layers its neighbours adapt says so (the coverage report, in the log and on the
result) instead of applying partly in silence."""

from __future__ import annotations

import pytest
import torch
from conftest import diffusers_frames, max_uint8_diff
from safetensors.torch import save_file

from composer import VideoGenerator
from composer.accel.lora import LoraAdapters, files_for
from composer.errors import CheckpointError, ConfigError, InvalidInputError
from composer.models.wan.config import WanTransformerConfig
from composer.models.wan.transformer import WanTransformer3DModel
from composer.runtime import RuntimeArgs

LAYERS = 2


def i2v_model(image: bool = True) -> WanTransformer3DModel:
    torch.manual_seed(0)
    extra = dict(image_dim=12, added_kv_proj_dim=32) if image else {}
    return WanTransformer3DModel(WanTransformerConfig(
        num_attention_heads=2, attention_head_dim=16, in_channels=8, out_channels=4, text_dim=8, freq_dim=16,
        ffn_dim=32, num_layers=LAYERS, **extra)).eval()


def original_lora(path, model, names: list[str], seed: int = 0):
    """A rank-2 LoRA in the original Wan release's naming (`diffusion_model.blocks.0.cross_attn.k_img...`)."""
    g = torch.Generator().manual_seed(seed)
    composer_names = {"cross_attn.q": "attn2.to_q", "cross_attn.k": "attn2.to_k", "cross_attn.v": "attn2.to_v",
                      "cross_attn.o": "attn2.to_out", "cross_attn.k_img": "attn2.add_k_proj",
                      "cross_attn.v_img": "attn2.add_v_proj"}
    tensors = {}
    for i in range(LAYERS):
        for name in names:
            linear = model.get_submodule(f"blocks.{i}.{composer_names[name]}")
            tensors[f"diffusion_model.blocks.{i}.{name}.lora_A.weight"] = torch.randn(2, linear.in_features,
                                                                                      generator=g) * 0.1
            tensors[f"diffusion_model.blocks.{i}.{name}.lora_B.weight"] = torch.randn(linear.out_features, 2,
                                                                                      generator=g) * 0.1
    save_file(tensors, str(path))
    return str(path)


def test_lora_expert_picks_the_files_of_each_denoiser():
    names = ["transformer", "transformer_2"]
    assert files_for("transformer", names, ["a", "b"], None, None) == (["a", "b"], None)  # no experts: all
    experts = ["transformer", "both"]
    assert files_for("transformer", names, ["a", "b"], [0.5, 1.0], experts) == (["a", "b"], [0.5, 1.0])
    assert files_for("transformer_2", names, ["a", "b"], [0.5, 1.0], experts) == (["b"], [1.0])
    with pytest.raises(InvalidInputError, match="transformer_2.*denoisers are transformer"):
        files_for("transformer", ["transformer"], ["a"], None, ["transformer_2"])
    with pytest.raises(ConfigError, match="lora_expert\\[0\\] = 'high'"):
        RuntimeArgs.from_kwargs(lora_path=[__file__], lora_expert=["high"])
    with pytest.raises(ConfigError, match="lora_expert has 1 value"):
        RuntimeArgs.from_kwargs(lora_path=[__file__, __file__], lora_expert=["both"])
    with pytest.raises(ConfigError, match="lora_expert is set but lora_path is not"):
        RuntimeArgs.from_kwargs(lora_expert=["both"])


def test_image_lora_keys_load_by_name_and_a_partial_lora_says_so(tmp_path, log):
    model = i2v_model()
    with torch.no_grad():
        base = model(torch.randn(1, 8, 2, 4, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([500.0]),
                     torch.randn(1, 3, 8), torch.randn(1, 5, 12))
    adapters = LoraAdapters(model)
    # a T2V-trained LoRA on the I2V model: the text cross-attention is adapted, its image keys are not
    text_only = original_lora(tmp_path / "t2v.safetensors", model, ["cross_attn.q", "cross_attn.k", "cross_attn.v",
                                                                    "cross_attn.o"])
    adapters.set([text_only])
    coverage = {kind: (got, of) for kind, got, of in adapters.coverage()}
    assert coverage["blocks.*.attn2.to_k"] == (LAYERS, LAYERS)
    assert coverage["blocks.*.attn2.add_k_proj"] == (0, LAYERS) and coverage["blocks.*.attn2.add_v_proj"] == (0, LAYERS)
    assert "blocks.*.ffn.fc_in" not in coverage  # the file adapts nothing of the FFN: not reported
    assert "PARTIAL: not adapted: blocks.*.attn2.add_k_proj 0/2, blocks.*.attn2.add_v_proj 0/2" in adapters.describe()
    assert "WARNING LoRA" in log.getvalue()  # the image keys left out: a warning, not silence
    # with the image keys (k_img / v_img), every cross-attention layer is adapted: no partial application
    full = original_lora(tmp_path / "i2v.safetensors", model, ["cross_attn.q", "cross_attn.k", "cross_attn.v",
                                                               "cross_attn.o", "cross_attn.k_img", "cross_attn.v_img"])
    adapters.set([full])
    assert all(got == of for _, got, of in adapters.coverage()) and "PARTIAL" not in adapters.describe()
    assert "blocks.1.attn2.add_v_proj" in adapters._wrapped
    adapters.unset()
    with torch.no_grad():
        again = model(torch.randn(1, 8, 2, 4, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([500.0]),
                      torch.randn(1, 3, 8), torch.randn(1, 5, 12))
    assert again.shape == base.shape
    # the image LoRA on a text-to-video model: refused, naming the image keys it has no layer for
    with pytest.raises(CheckpointError, match="k_img"):
        LoraAdapters(i2v_model(image=False)).set([full])


@pytest.mark.slow
@pytest.mark.parametrize("expert", ["transformer", "transformer_2"])
def test_a_lora_on_one_expert_equals_diffusers(tmp_path, expert):
    """lora_expert = transformer is diffusers' default `load_lora_weights` (the high-noise expert only);
    transformer_2 is its `load_into_transformer_2=True` (the low-noise expert only). The result reports it."""
    from test_wan22 import A14B_CASES, PROMPT, _diffusers, _write_lora

    from composer.testing import build_tiny_wan22_a14b

    folder = build_tiny_wan22_a14b(tmp_path / "a14b")
    plain = VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False)
    lora = _write_lora(tmp_path / "style.safetensors", plain.pipeline.modules["transformer"], seed=4)
    gen = VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False, lora_path=[str(lora)],
                                         lora_expert=[expert])
    other = "transformer_2" if expert == "transformer" else "transformer"
    assert gen.pipeline.lora_adapters(expert).active and not gen.pipeline.lora_adapters(other).active
    case = dict(A14B_CASES["cfg-two-scales"])
    seed = case.pop("seed")
    result = gen.generate_video(PROMPT, seed=seed, **case)
    assert result.lora[expert].startswith("LoRA (unfused") and result.lora[other] == "LoRA: none"
    pipe = _diffusers(folder)
    pipe.load_lora_weights(str(lora), load_into_transformer_2=expert == "transformer_2")
    assert max_uint8_diff(result.frames, diffusers_frames(pipe, PROMPT, seed, **case)) <= 1
    assert max_uint8_diff(result.frames, plain.generate_video(PROMPT, seed=seed, **case).frames) > 1
    # set_lora switches experts the same way
    assert "transformer_2: LoRA (unfused" in plain.set_lora([str(lora)], experts="transformer_2")
    assert not plain.pipeline.lora_adapters("transformer").active
