"""Tensor parallelism (composer/parallel/tensor.py) on gloo: the sharded layers equal their unsharded versions,
a tiny Wan DiT (bidirectional and causal) loaded with `load_tensor_parallel` on 2 and 4 ranks gives the
single-process output, each rank reads and holds only its slices, LoRA (unfused and fused) under TP equals
single-process LoRA, and sizes that do not divide are a clear ConfigError."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from composer.errors import ConfigError
from composer.loader.components import ComposerModelLoader
from composer.loader.model_index import ComponentSpec
from composer.models.wan.causal import CausalWanTransformer3DModel
from composer.models.wan.config import WanTransformerConfig
from composer.models.wan.transformer import WanTransformer3DModel
from composer.parallel.tensor import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallelRMSNorm,
    check_tp_size,
    load_tensor_parallel,
    shard_model,
    tensor_parallel_shards,
)
from composer.testing.distributed import SpawnTimeout, spawn

pytestmark = pytest.mark.usefixtures("one_thread")

# 4 heads of 16 and an FFN of 96: tp 2 and 4 both divide
MODEL = dict(num_attention_heads=4, attention_head_dim=16, text_dim=32, ffn_dim=96, num_layers=2, freq_dim=32)
LATENTS, TEXT_LEN = (2, 16, 3, 6, 10), 7  # non-square 3x5 tokens per frame, 3 frames, batch 2
LORA_RANK, LORA_ALPHA, LORA_SCALE = 4, 6.0, 0.7
# composer layer -> its name in the original Wan release's LoRA naming
LORA_LAYERS = {"attn1.to_q": "self_attn.q", "attn1.to_out": "self_attn.o", "attn2.to_k": "cross_attn.k",
               "attn2.to_out": "cross_attn.o", "ffn.fc_in": "ffn.0", "ffn.fc_out": "ffn.2"}


def _spawn(worker, world_size: int, *args) -> None:
    try:
        spawn(worker, world_size, *args, timeout_s=120)
    except SpawnTimeout as exc:
        pytest.fail(str(exc))


# -- the layers ----------------------------------------------------------------------------------------
def _layers_worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)  # every rank builds and draws the same full layers and tensors
    gen = torch.Generator().manual_seed(0)
    dim, hidden = 64, 96
    block = slice(rank * dim // world_size, (rank + 1) * dim // world_size)

    for dtype in (torch.float32, torch.bfloat16):
        norm = nn.RMSNorm(dim, eps=1e-6, dtype=dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(dim, generator=gen))
        x = torch.randn(3, 5, dim, generator=gen).to(dtype)
        sharded = TensorParallelRMSNorm.from_rmsnorm(norm, None)
        assert sharded.weight.shape == (dim // world_size,) and sharded.normalized_shape == (dim,)
        got, expected = sharded(x[..., block]), norm(x)[..., block]
        assert got.dtype == dtype
        tolerance = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: the sum of squares is added in another order
        assert (got.float() - expected.float()).abs().max() <= tolerance, dtype

    # column -> row, as q/k/v -> out and fc_in -> fc_out: the full output on every rank
    fc_in, fc_out = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
    x = torch.randn(2, 7, dim, generator=gen)
    col, row = ColumnParallelLinear.from_linear(fc_in, None), RowParallelLinear.from_linear(fc_out, None)
    assert (col.in_features, col.out_features, col.local_out_features) == (dim, hidden, hidden // world_size)
    assert (row.in_features, row.out_features, row.local_in_features) == (hidden, dim, hidden // world_size)
    assert col.weight.shape == (hidden // world_size, dim) and row.weight.shape == (dim, hidden // world_size)
    assert (col.tp_size, col.tp_rank, row.tp_size, row.tp_rank) == (world_size, rank, world_size, rank)
    with torch.no_grad():
        hidden_block = slice(rank * hidden // world_size, (rank + 1) * hidden // world_size)
        assert (col(x) - fc_in(x)[..., hidden_block]).abs().max() <= 1e-6
        assert (row(torch.tanh(col(x))) - fc_out(torch.tanh(fc_in(x)))).abs().max() <= 1e-5

    # heads that do not divide: refused before anything is sharded
    config = WanTransformerConfig(num_attention_heads=3, attention_head_dim=8, ffn_dim=32, num_layers=1,
                                  text_dim=16, freq_dim=16)
    with torch.device("meta"):
        model = WanTransformer3DModel(config)
    try:
        shard_model(model, None)
    except ConfigError as exc:
        assert "num_attention_heads 3" in str(exc) and "[1]" in str(exc), str(exc)
    else:
        raise AssertionError("3 heads on 2 ranks should be a ConfigError")
    assert isinstance(model.blocks[0].attn1.to_q, nn.Linear) and not isinstance(
        model.blocks[0].attn1.to_q, ColumnParallelLinear)


def test_sharded_layers_equal_the_unsharded_ones():
    _spawn(_layers_worker, 2)


def test_sizes_that_do_not_divide_are_a_config_error():
    config = WanTransformerConfig(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824)  # Wan2.1 14B
    check_tp_size(config, 8)
    with pytest.raises(ConfigError, match=r"num_attention_heads 40.*tp_size in \[1, 2, 4, 8\]"):
        check_tp_size(config, 16)
    with pytest.raises(ConfigError, match=r"ffn_dim 100.*tp_size in \[1, 2, 4\]") as info:
        check_tp_size(WanTransformerConfig(num_attention_heads=8, ffn_dim=100), 8)
    assert "num_attention_heads" not in str(info.value).split("does not divide")[1]


# -- the model -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dit_folder(tmp_path_factory):
    """A tiny diffusers WanTransformer3DModel folder, every parameter perturbed (norm weights are not all 1)."""
    from diffusers import WanTransformer3DModel as ReferenceWan

    torch.manual_seed(0)
    ref = ReferenceWan(**MODEL).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    folder = tmp_path_factory.mktemp("tp") / "transformer"
    ref.save_pretrained(folder)
    return folder


def _inputs():
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(LATENTS, generator=g)
    text = torch.randn(LATENTS[0], TEXT_LEN, MODEL["text_dim"], generator=g)
    per_frame = torch.tensor([[900.0, 500.0, 100.0], [999.0, 0.0, 437.25]])
    return latents, text, torch.tensor([999.0, 437.25]), per_frame


def _outputs(model: nn.Module) -> dict[str, torch.Tensor]:
    """The forwards every model is checked on: timestep [B] and [B, F], and for a causal model forward_masked."""
    latents, text, timestep, per_frame = _inputs()
    with torch.inference_mode():
        out = {"timestep": model(latents, timestep, text), "per_frame": model(latents, per_frame, text)}
        if isinstance(model, CausalWanTransformer3DModel):
            out["masked"] = model.forward_masked(latents, per_frame, model.cross_attention_kv(text), [(0, 1), (1, 3)])
    return out


def _write_lora(model: nn.Module, path) -> None:
    """A LoRA in the original Wan naming, with bias deltas (diff_b): column and row layers, attn1/attn2/ffn."""
    g = torch.Generator().manual_seed(2)
    tensors = {}
    for i in range(len(model.blocks)):
        for layer, original in LORA_LAYERS.items():
            linear = model.get_submodule(f"blocks.{i}.{layer}")
            stem = f"diffusion_model.blocks.{i}.{original}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(LORA_RANK, linear.in_features, generator=g) * 0.15
            tensors[f"{stem}.lora_B.weight"] = torch.randn(linear.out_features, LORA_RANK, generator=g) * 0.15
            tensors[f"{stem}.alpha"] = torch.tensor(LORA_ALPHA)
            tensors[f"{stem}.diff_b"] = torch.randn(linear.out_features, generator=g) * 0.1
    save_file(tensors, str(path))


def _model_worker(rank: int, world_size: int, folder, out_dir, lora_path) -> None:
    # imported here, not at the top: every spawned rank imports this module, and the layer test needs no peft
    from composer.accel.lora import LoraAdapters

    spec = ComponentSpec("transformer", "diffusers", "WanTransformer3DModel")
    cls, config = ComposerModelLoader.model_class_and_config(folder, spec)
    read: dict[str, tuple[int, ...]] = {}
    model = load_tensor_parallel(cls, config, folder, "cpu", torch.float32, None,
                                 on_read=lambda name, t: read.setdefault(name, tuple(t.shape)))
    full = ComposerModelLoader().build(folder, spec)  # meta: the unsharded shapes, for the byte count
    full_shapes = {name: tuple(t.shape) for name, t in full.state_dict().items()}

    shards = tensor_parallel_shards(model)
    local = dict(model.state_dict())
    assert set(read) == set(local) == set(full_shapes)  # every tensor read once, nothing else read
    for name, tensor in local.items():
        assert read[name] == tuple(tensor.shape), name  # read from disk at the local shape: a slice, never whole
        if name in shards:
            assert shards[name].full_shape == full_shapes[name]
            assert tensor.numel() * world_size == torch.Size(full_shapes[name]).numel(), name
        else:
            assert tuple(tensor.shape) == full_shapes[name], name
    sharded_bytes = sum(local[n].numel() * local[n].element_size() for n in shards)
    full_sharded_bytes = sum(torch.Size(full_shapes[n]).numel() * 4 for n in shards)
    assert sharded_bytes * world_size == full_sharded_bytes
    # per block, attn1 and attn2: q/k/v weight and bias, to_out weight (its bias is whole), norm_q/norm_k weight;
    # then fc_in weight and bias, fc_out weight
    assert len(shards) == config.num_layers * (2 * (3 * 2 + 1 + 2) + 3)

    results = _outputs(model)
    # shard_model on a model loaded whole: the same shards, sliced in memory
    in_memory = shard_model(ComposerModelLoader().load(folder, spec, torch.device("cpu"), torch.float32), None)
    assert all(torch.equal(t, local[n]) for n, t in in_memory.state_dict().items())
    results["in_memory_timestep"] = _outputs(in_memory)["timestep"]
    try:
        shard_model(in_memory, None)
    except ConfigError as exc:
        assert "already sharded" in str(exc), str(exc)
    else:
        raise AssertionError("sharding twice should be a ConfigError")
    causal = load_tensor_parallel(CausalWanTransformer3DModel, config, folder, "cpu", torch.float32, None)
    results |= {f"causal_{k}": v for k, v in _outputs(causal).items()}
    if lora_path is not None:
        adapters = LoraAdapters(model)
        adapters.set([lora_path], [LORA_SCALE])
        results |= {f"lora_{k}": v for k, v in _outputs(model).items()}
        adapters.set([lora_path], [LORA_SCALE], fuse=True)
        assert type(model.blocks[0].attn1.to_out) is RowParallelLinear  # fused: the TP layer, merged
        results |= {f"fused_{k}": v for k, v in _outputs(model).items()}
        adapters.unset()
        torch.testing.assert_close(_outputs(model)["timestep"], results["timestep"], atol=0, rtol=0)
    torch.save(results, out_dir / f"rank{rank}.pt")
    dist.barrier()


def _reference(folder, lora_path) -> dict[str, torch.Tensor]:
    from composer.accel.lora import LoraAdapters

    spec = ComponentSpec("transformer", "diffusers", "WanTransformer3DModel")
    model = ComposerModelLoader().load(folder, spec, torch.device("cpu"), torch.float32)
    expected = _outputs(model)
    _, config = ComposerModelLoader.model_class_and_config(folder, spec)
    causal = ComposerModelLoader.fill(_meta(CausalWanTransformer3DModel, config), folder, torch.device("cpu"),
                                      torch.float32)
    expected |= {f"causal_{k}": v for k, v in _outputs(causal).items()}
    if lora_path is not None:
        adapters = LoraAdapters(model)
        adapters.set([lora_path], [LORA_SCALE])
        expected |= {f"lora_{k}": v for k, v in _outputs(model).items()}
        adapters.unset()
    return expected


def _meta(cls, config):
    with torch.device("meta"):
        return cls(config)


def _check_ranks(world_size: int, out_dir, expected: dict[str, torch.Tensor]) -> None:
    for rank in range(world_size):
        got = torch.load(out_dir / f"rank{rank}.pt")
        for key, value in got.items():
            reference = expected[key.replace("fused_", "lora_").replace("in_memory_", "")]  # fused LoRA == unfused LoRA, one process
            assert value.shape == reference.shape == LATENTS
            diff = (value - reference).abs().max().item()
            assert diff <= 1e-5, f"rank {rank} of {world_size}, {key}: max abs diff {diff}"


@pytest.mark.slow  # (the quick tier keeps the sharded layers' parity)
def test_tp2_model_and_lora_equal_one_process(dit_folder, tmp_path):
    lora_path = tmp_path / "lora.safetensors"
    _write_lora(_meta(WanTransformer3DModel, WanTransformerConfig.from_dict(MODEL)), lora_path)
    _spawn(_model_worker, 2, dit_folder, tmp_path, lora_path)
    expected = _reference(dit_folder, lora_path)
    assert (expected["lora_timestep"] - expected["timestep"]).abs().max() > 1e-2  # the LoRA shows
    got = torch.load(tmp_path / "rank0.pt")
    assert {"lora_per_frame", "fused_per_frame", "causal_masked", "in_memory_timestep"} <= set(got)
    _check_ranks(2, tmp_path, expected)


@pytest.mark.slow
def test_tp4_model_equals_one_process(dit_folder, tmp_path):
    _spawn(_model_worker, 4, dit_folder, tmp_path, None)
    _check_ranks(4, tmp_path, _reference(dit_folder, None))
