"""Loading composer's DiT from safetensors: single file, shards, original Wan naming, dtypes, bad files."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import to_original_name
from safetensors.torch import load_file, save_file

from composer.errors import CheckpointError, ModelFormatError
from composer.loader.components import ComposerModelLoader
from composer.loader.model_index import ComponentSpec

SPEC = ComponentSpec("transformer", "diffusers", "WanTransformer3DModel")
CPU = torch.device("cpu")

def load(folder, dtype=torch.float32):
    return ComposerModelLoader().load(folder, SPEC, CPU, dtype)


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture()
def transformer_dir(tiny_wan_dir, tmp_path):
    folder = tmp_path / "transformer"
    shutil.copytree(tiny_wan_dir / "transformer", folder)
    return folder


@pytest.fixture(scope="module")
def reference_state(tiny_wan_dir):
    return state(load(tiny_wan_dir / "transformer"))


def test_sharded_checkpoint_loads_the_same_weights(transformer_dir, reference_state):
    tensors = load_file(transformer_dir / "diffusion_pytorch_model.safetensors")
    (transformer_dir / "diffusion_pytorch_model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"diffusion_pytorch_model-00001-of-00002.safetensors": names[::2],
              "diffusion_pytorch_model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, transformer_dir / file)
        weight_map.update({k: file for k in keys})
    (transformer_dir / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    loaded = state(load(transformer_dir))
    assert loaded.keys() == reference_state.keys()
    assert all(torch.equal(loaded[k], reference_state[k]) for k in loaded)


def test_original_wan_naming_loads_the_same_weights(transformer_dir, reference_state):
    tensors = load_file(transformer_dir / "diffusion_pytorch_model.safetensors")
    original = {to_original_name(k): v for k, v in tensors.items()}
    assert "blocks.0.self_attn.q.weight" in original and "head.head.weight" in original
    save_file(original, transformer_dir / "diffusion_pytorch_model.safetensors")
    loaded = state(load(transformer_dir))
    assert all(torch.equal(loaded[k], reference_state[k]) for k in reference_state)


def test_original_wan_config_and_comfy_prefix(transformer_dir, reference_state):
    """The original release's config.json (dim, num_heads, in_dim...) and a `model.diffusion_model.` prefix."""
    diffusers_config = json.loads((transformer_dir / "config.json").read_text())
    original_config = {
        "_class_name": "WanModel", "model_type": "t2v", "text_len": 512,
        "dim": diffusers_config["num_attention_heads"] * diffusers_config["attention_head_dim"],
        "num_heads": diffusers_config["num_attention_heads"], "in_dim": 16, "out_dim": 16,
        "ffn_dim": diffusers_config["ffn_dim"], "freq_dim": diffusers_config["freq_dim"],
        "text_dim": diffusers_config["text_dim"], "num_layers": diffusers_config["num_layers"], "eps": 1e-6,
        "qk_norm": True, "cross_attn_norm": True, "window_size": [-1, -1],
    }
    (transformer_dir / "config.json").write_text(json.dumps(original_config))
    tensors = load_file(transformer_dir / "diffusion_pytorch_model.safetensors")
    save_file({"model.diffusion_model." + to_original_name(k): v for k, v in tensors.items()},
              transformer_dir / "diffusion_pytorch_model.safetensors")
    loaded = state(load(transformer_dir))
    assert all(torch.equal(loaded[k], reference_state[k]) for k in reference_state)


def test_bf16_load_keeps_reference_fp32_parameters(tiny_wan_dir):
    model = load(tiny_wan_dir / "transformer", torch.bfloat16)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes["blocks.0.attn1.to_q.weight"] == torch.bfloat16
    assert dtypes["proj_out.weight"] == torch.bfloat16
    for fp32_name in ("scale_shift_table", "blocks.1.scale_shift_table", "blocks.0.norm2.weight",
                      "condition_embedder.time_embedder.linear_2.bias"):
        assert dtypes[fp32_name] == torch.float32, fp32_name
    assert not any(p.requires_grad for p in model.parameters())


def test_corrupt_safetensors_is_a_checkpoint_error(transformer_dir):
    path = transformer_dir / "diffusion_pytorch_model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load(transformer_dir)


def test_garbage_safetensors_is_a_checkpoint_error(transformer_dir):
    (transformer_dir / "diffusion_pytorch_model.safetensors").write_bytes(b"\x00" * 4096)
    with pytest.raises(CheckpointError):
        load(transformer_dir)


def test_mismatched_shapes_name_the_tensor(transformer_dir):
    config = json.loads((transformer_dir / "config.json").read_text())
    config["ffn_dim"] = config["ffn_dim"] * 2
    (transformer_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as info:
        load(transformer_dir)
    message = str(info.value)
    assert "6 tensors have the wrong shape" in message  # 3 FFN tensors x 2 blocks, all listed up front
    assert "blocks.0.ffn.net.0.proj.weight is [128, 64], blocks.0.ffn.fc_in.weight expects [256, 64]" in message


def test_missing_and_unexpected_tensors_are_listed(transformer_dir):
    path = transformer_dir / "diffusion_pytorch_model.safetensors"
    tensors = load_file(path)
    del tensors["blocks.1.attn2.to_k.weight"]
    tensors["blocks.9.mystery.weight"] = torch.zeros(2)
    save_file(tensors, path)
    with pytest.raises(CheckpointError) as info:
        load(transformer_dir)
    message = str(info.value)
    assert "missing 1 tensors: blocks.1.attn2.to_k.weight" in message
    assert "blocks.9.mystery.weight" in message


def test_folder_without_weights_or_config(transformer_dir):
    (transformer_dir / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(ModelFormatError, match="no .safetensors weights"):
        load(transformer_dir)
    (transformer_dir / "config.json").unlink()
    with pytest.raises(ModelFormatError, match="no config.json"):
        load(transformer_dir)


def test_index_listing_a_missing_shard(transformer_dir):
    (transformer_dir / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"proj_out.weight": "gone-00001.safetensors"}})
    )
    with pytest.raises(CheckpointError, match="gone-00001.safetensors"):
        load(transformer_dir)


def test_half_configured_image_cross_attention_is_refused(transformer_dir):
    """image_dim without added_kv_proj_dim: no image k/v to load (a full I2V config loads: test_wan_i2v_dit)."""
    from composer.errors import UnsupportedError

    config = json.loads((transformer_dir / "config.json").read_text())
    config["image_dim"] = 1280
    (transformer_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedError, match="image_dim = 1280 but added_kv_proj_dim = None"):
        load(transformer_dir)
