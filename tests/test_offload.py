"""Weight offloading (composer/accel): model offload, layerwise streaming of the transformer blocks and the
disk tier give the outputs of no offload; the layerwise schedule is checked through a recording transfer."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from composer.accel.disk import MappedSafetensors, load_with_blocks_on_disk
from composer.accel.offload import LayerwiseOffload, ModelOffload
from composer.accel.transfer import RecordingTransfer, SyncTransfer, transfer_for
from composer.cache import KVCache, KVCacheSpec
from composer.errors import ConfigError, InvalidInputError, UnsupportedError
from composer.loader.components import ComposerModelLoader
from composer.loader.model_index import ComponentSpec
from composer.loader.weights import load_weights, tensor_sources
from composer.models.wan.causal import CausalWanTransformer3DModel

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")
SPEC = ComponentSpec("transformer", "diffusers", "WanTransformer3DModel")
NUM_LAYERS = 4


@pytest.fixture(scope="module")
def wan4_dir(tmp_path_factory):
    """A tiny Wan2.1 transformer folder (diffusers' class and layout) with 4 blocks: enough for a schedule."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(3)
    folder = tmp_path_factory.mktemp("models") / "tiny-wan-4"
    WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=32, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=64, ffn_dim=128, num_layers=NUM_LAYERS, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
    ).save_pretrained(folder / "transformer")
    return folder


def load_transformer(folder, dtype=torch.float32):
    return ComposerModelLoader().load(folder / "transformer", SPEC, CPU, dtype)


def inputs(frames: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(1, 16, frames, 8, 8, generator=g)
    text = torch.randn(1, 6, 32, generator=g)
    return latents, text


def run_steps(model, steps=(900.0, 500.0, 100.0)):
    latents, text = inputs()
    with torch.inference_mode():
        return [model(latents.to(model.dtype), torch.tensor([t]), text.to(model.dtype)) for t in steps]


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))


class RunLog:
    """Logs, into the transfer's log, ("forward", None) when the model's forward starts (hook registered
    before the offload's own, so it comes first), ("embed", None) when the patch embedding runs and
    ("run", i) when block i starts (after the offload's hook): events interleave with load / wait / evict."""

    def __init__(self, model, transfer: RecordingTransfer):
        self.model, self.log = model, transfer.log
        model.register_forward_pre_hook(lambda m, a: self.log.append(("forward", None)))
        model.patch_embedding.register_forward_pre_hook(lambda m, a: self.log.append(("embed", None)))

    def blocks(self) -> None:
        for i, block in enumerate(self.model.blocks):
            block.register_forward_pre_hook(lambda m, a, i=i: self.log.append(("run", i)))

    def forwards(self) -> list[list[tuple]]:
        """The log split at each forward's start."""
        cuts = [k for k, e in enumerate(self.log) if e[0] == "forward"] + [len(self.log)]
        return [self.log[a:b] for a, b in zip(cuts, cuts[1:])]


# -- layerwise -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_layerwise_offload_equals_no_offload(wan4_dir, prefetch):
    model = load_transformer(wan4_dir)
    reference = run_steps(copy.deepcopy(model))
    offload = LayerwiseOffload(model, CPU, prefetch=prefetch, transfer=RecordingTransfer())
    assert max_diff(run_steps(model), reference) <= 1e-5
    assert offload.resident == []


@pytest.mark.parametrize("prefetch", [1, 2])
def test_layerwise_schedule_loads_ahead_and_evicts_after_use(wan4_dir, prefetch):
    model = load_transformer(wan4_dir)
    transfer = RecordingTransfer()
    runlog = RunLog(model, transfer)
    offload = LayerwiseOffload(model, CPU, prefetch=prefetch, transfer=transfer)
    runlog.blocks()
    run_steps(model, steps=(900.0, 500.0, 100.0))
    forwards = runlog.forwards()
    assert len(forwards) == 3
    for log in forwards:
        run = [log.index(("run", i)) for i in range(NUM_LAYERS)]
        # the first blocks of each forward start loading as it begins, before the patch embedding
        assert log.index(("load", 0)) < log.index(("embed", None)) < run[0]
        for i in range(NUM_LAYERS):
            if i + 1 < NUM_LAYERS:  # block i + 1's load is issued before block i runs
                assert log.index(("load", i + 1)) < run[i]
            assert log.index(("wait", i)) < run[i]
            evict = log.index(("evict", i))
            assert run[i] < evict  # each block is evicted after its use, before the next block runs
            assert i + 1 == NUM_LAYERS or evict < run[i + 1]
        assert sorted(transfer.events("load")) == sorted(transfer.events("evict"))  # nothing left behind
    assert transfer.max_resident <= prefetch + 1
    assert transfer.resident == set() and offload.resident == []
    assert offload.stats.misses == 0 and offload.stats.loads == 3 * NUM_LAYERS


def test_layerwise_without_prefetch_loads_each_block_when_it_runs(wan4_dir):
    model = load_transformer(wan4_dir)
    transfer = RecordingTransfer()
    offload = LayerwiseOffload(model, CPU, prefetch=0, transfer=transfer)
    RunLog(model, transfer).blocks()
    run_steps(model, steps=(500.0,))
    assert transfer.max_resident == 1
    assert offload.stats.misses == NUM_LAYERS
    assert [e for e in transfer.log if e[0] not in ("forward", "embed")] == [
        e for i in range(NUM_LAYERS) for e in (("load", i), ("wait", i), ("run", i), ("evict", i))
    ]


def test_layerwise_keeps_the_rest_of_the_model_and_the_same_parameters(wan4_dir):
    model = load_transformer(wan4_dir)
    params = dict(model.named_parameters())
    outside = {n: p.data for n, p in params.items() if not n.startswith("blocks.")}
    offload = LayerwiseOffload(model, CPU, transfer=RecordingTransfer())
    run_steps(model)
    assert dict(model.named_parameters()) == params  # the same Parameter objects
    for name, data in outside.items():  # embeddings, head, fp32 tables: never moved (here: same memory)
        assert params[name].data_ptr() == data.data_ptr()
    # an evicted block holds its host copy, not a (poisoned) device copy
    assert all(torch.isfinite(p).all() for p in model.blocks.parameters())
    offload.remove()


def test_layerwise_offload_of_causal_model_with_kv_cache(wan4_dir):
    wan = load_transformer(wan4_dir)
    model = CausalWanTransformer3DModel(wan.config).eval().requires_grad_(False)
    model.load_state_dict(wan.state_dict())
    reference_model = copy.deepcopy(model)
    cfg = model.config

    def rollout(m):
        latents, text = inputs(frames=6, seed=1)
        spec = KVCacheSpec(num_layers=cfg.num_layers, batch_size=1, num_heads=cfg.num_attention_heads,
                           head_dim=cfg.attention_head_dim, tokens_per_frame=16, capacity_frames=6)
        cache = KVCache(spec, torch.float32, CPU)
        outs = []
        with torch.inference_mode():
            cross_kv = m.cross_attention_kv(text)  # reads every block's weights outside the forward
            for start in (0, 2, 4):
                for t in (800.0, 300.0):  # a re-run of the newest frames, then the next block appended
                    block = latents[:, :, start : start + 2]
                    outs.append(m.forward_cached(block, torch.full((1, 2), t), cross_kv, cache, start))
        return outs

    reference = rollout(reference_model)
    transfer = RecordingTransfer()
    offload = LayerwiseOffload(model, CPU, prefetch=1, transfer=transfer)
    assert max_diff(rollout(model), reference) <= 1e-5
    assert offload.stats.faults == NUM_LAYERS  # cross_attention_kv loaded each block on demand
    assert transfer.max_resident <= 2
    assert offload.resident == [] and transfer.resident == set()


def test_layerwise_offload_in_the_pipeline_gives_the_same_video(tiny_wan_dir):
    from composer import VideoGenerator

    gen = VideoGenerator.from_pretrained(tiny_wan_dir, dtype="fp32", progress=False)
    request = dict(seed=5, num_frames=5, height=64, width=64, num_inference_steps=3, guidance_scale=4.0)
    expected = gen.generate_video("a blue cube", **request)
    transfer = RecordingTransfer()
    offload = LayerwiseOffload(gen.pipeline.modules["transformer"], CPU, transfer=transfer)
    result = gen.generate_video("a blue cube", **request)
    assert float((result.latents - expected.latents).abs().max()) <= 1e-5
    assert (result.frames == expected.frames).all()
    # the engine's cross-attention k/v pass (once per prompt: cond and uncond) loads blocks on demand
    assert offload.stats.loads >= 3 * 2 and offload.stats.faults > 0
    assert transfer.resident == set()


def test_remove_restores_plain_behaviour(wan4_dir):
    model = load_transformer(wan4_dir)
    reference = run_steps(copy.deepcopy(model))
    params = dict(model.named_parameters())
    transfer = RecordingTransfer()
    offload = LayerwiseOffload(model, CPU, transfer=transfer)
    run_steps(model)
    offload.remove()
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    events = len(transfer.log)
    assert max_diff(run_steps(model), reference) <= 1e-5
    assert len(transfer.log) == events  # no transfer involved any more
    assert dict(model.named_parameters()) == params


class Layered(nn.Module):
    """A model whose repeated blocks are called `layers`, named by the class attribute."""

    repeated_blocks = "layers"

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(3))

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return x


def test_repeated_blocks_attribute_names_the_blocks():
    torch.manual_seed(0)
    model = Layered().requires_grad_(False)
    x = torch.randn(2, 4)
    expected = model(x)
    transfer = RecordingTransfer()
    LayerwiseOffload(model, CPU, transfer=transfer)
    assert torch.equal(model(x), expected)
    assert transfer.events("load") == [0, 1, 2]


def test_model_without_repeated_blocks_is_refused():
    with pytest.raises(UnsupportedError, match="repeated blocks.*'blocks'.*offload='model'"):
        LayerwiseOffload(nn.Sequential(nn.Linear(2, 2)), CPU)

    class Empty(nn.Module):
        blocks = nn.ModuleList()

    with pytest.raises(UnsupportedError, match="non-empty"):
        LayerwiseOffload(Empty(), CPU)
    with pytest.raises(ConfigError, match="prefetch"):
        LayerwiseOffload(Layered(), CPU, prefetch=-1)


def test_transfer_for_picks_by_device():
    assert type(transfer_for("cpu")) is SyncTransfer
    t = torch.ones(3)
    assert SyncTransfer(CPU).load(0, [t]).tensors[0] is t  # on the CPU a load is free


# -- model offload --------------------------------------------------------------------------------------
class Counter(nn.Module):
    """A module with a persistent and a non-persistent buffer it updates as it runs."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("scratch", torch.ones(3), persistent=False)

    def forward(self, x):
        self.calls += 1
        return self.lin(x) * self.scratch


def test_model_offload_moves_modules_and_brings_them_back():
    torch.manual_seed(0)
    a, b = Counter().requires_grad_(False), nn.Linear(3, 3).requires_grad_(False)
    x = torch.randn(2, 3)
    expected = a(x), b(x)
    a.calls.zero_()
    weight = a.lin.weight
    transfer = RecordingTransfer()
    offload = ModelOffload([a, b], CPU, transfer=transfer)
    host = a.lin.weight.data
    assert not offload.is_on_device(a)
    with offload.on_device([a]):
        assert offload.is_on_device(a) and not offload.is_on_device(b)
        assert a.lin.weight.data_ptr() != host.data_ptr()  # a separate (device) copy
        with offload.on_device([a, b]):  # nesting: a stays until the outer block ends
            assert torch.equal(b(x), expected[1])
        assert offload.is_on_device(a) and not offload.is_on_device(b)
        assert torch.equal(a(x), expected[0])
    assert a.lin.weight is weight and a.lin.weight.data_ptr() == host.data_ptr()  # same Parameter, host copy
    assert float(a.calls) == 1 and torch.equal(a.scratch, torch.ones(3))  # buffer state kept
    assert transfer.resident == set() and transfer.events("load") == [id(a), id(b)]
    with pytest.raises(InvalidInputError, match="not managed"):
        with offload.on_device([nn.Linear(1, 1)]):
            pass
    offload.prefetch([b])  # issued now, waited for by on_device
    with offload.on_device([b]):
        assert torch.equal(b(x), expected[1])
    offload.remove()
    assert torch.equal(b(x), expected[1])


def test_model_offload_refuses_shared_weights():
    lin = nn.Linear(2, 2)
    with pytest.raises(InvalidInputError, match="share"):
        ModelOffload([nn.Sequential(lin), nn.Sequential(lin)], CPU)


def test_model_offload_of_pipeline_components_equals_no_offload(tiny_wan_dir):
    from composer import VideoGenerator

    gen = VideoGenerator.from_pretrained(tiny_wan_dir, dtype="fp32", progress=False)
    expected = gen.generate_video("a red ball", seed=3, num_frames=5, height=64, width=64,
                                  num_inference_steps=2).frames
    modules = gen.pipeline.modules
    components = [modules["text_encoder"], modules["transformer"], modules["vae"]]
    transfer = RecordingTransfer()
    offload = ModelOffload(components, CPU, transfer=transfer)
    # the pipeline will wrap each stage; here all three are on the device for one generation
    with offload.on_device(components):
        frames = gen.generate_video("a red ball", seed=3, num_frames=5, height=64, width=64,
                                    num_inference_steps=2).frames
    assert (frames == expected).all()
    assert transfer.resident == set()


# -- disk tier ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_disk_tier_equals_eager_loading(wan4_dir, dtype):
    eager = load_transformer(wan4_dir, dtype)
    model, offload = load_with_blocks_on_disk(wan4_dir / "transformer", CPU, dtype)
    # block weights are stand-ins until used; fp32 tables keep their dtype
    assert all(p.stride() == (0,) * p.ndim for p in model.blocks.parameters())
    assert model.blocks[0].scale_shift_table.dtype == torch.float32
    assert model.blocks[0].attn1.to_q.weight.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 0.0
    assert max_diff(run_steps(model), run_steps(eager)) <= tol
    assert offload.resident == []
    offload.remove()  # weights read for good, maps closed
    assert max_diff(run_steps(model), run_steps(eager)) <= tol
    assert all(p.stride() != (0,) * p.ndim for p in model.blocks.parameters())


def test_disk_tier_releases_the_pages_of_each_block(wan4_dir, monkeypatch):
    released = []
    original = MappedSafetensors.release
    monkeypatch.setattr(MappedSafetensors, "release", lambda self, s, e: (released.append((s, e)), original(self, s, e)))
    model, offload = load_with_blocks_on_disk(wan4_dir / "transformer", CPU, torch.float32)
    run_steps(model, steps=(500.0,))
    block_spans = {file.span(key) for plan in offload.store._plan for file, key, _ in plan}
    assert block_spans <= set(released)


def test_loader_can_leave_named_weights_on_disk(wan4_dir):
    folder = wan4_dir / "transformer"
    model = ComposerModelLoader().build(folder, SPEC)
    load_weights(model, folder, CPU, torch.bfloat16, skip=lambda name: name.startswith("blocks."))
    assert all(p.is_meta for p in model.blocks.parameters())
    assert not any(p.is_meta for n, p in model.named_parameters() if not n.startswith("blocks."))
    sources = tensor_sources(model, folder, torch.bfloat16)
    assert set(sources) == set(model.state_dict())
    assert sources["blocks.0.attn1.to_out.weight"].key == "blocks.0.attn1.to_out.0.weight"  # diffusers naming
    assert sources["blocks.0.attn1.to_q.weight"].dtype == torch.bfloat16
    assert sources["blocks.0.scale_shift_table"].dtype == torch.float32  # keep_in_fp32


def test_mapped_safetensors_reads_what_safetensors_reads(tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = {
        "f32": torch.randn(3, 5), "bf16": torch.randn(4, 2).bfloat16(), "f16": torch.randn(7).half(),
        "i64": torch.arange(6).view(2, 3), "flag": torch.tensor([True, False]), "empty": torch.zeros(0, 3),
    }
    path = tmp_path / "mixed.safetensors"
    save_file(tensors, str(path))
    mapped = MappedSafetensors(path)
    for name, expected in load_file(str(path)).items():
        got = mapped.tensor(name)
        assert got.dtype == expected.dtype and torch.equal(got, expected), name
        mapped.release(*mapped.span(name))
        assert torch.equal(mapped.tensor(name), expected)  # released pages read back from the file
    del got
    mapped.close()
