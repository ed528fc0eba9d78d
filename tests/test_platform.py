"""The platform layer (composer/platform/) and plug-ins from outside the package: the host platform's answers, a
platform with streams driving layerwise offload's copies (recorded on the CPU: the same calls CUDA gets), and a
platform and an attention backend declared by another distribution's entry points, found and used."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest
import torch

from composer.accel.offload import LayerwiseOffload
from composer.accel.transfer import StreamTransfer, SyncTransfer, transfer_for
from composer.models.attention.backends import (
    Capabilities,
    backend_choices,
    backend_names,
    capabilities_of,
    refresh_backends,
    resolve_backend,
)
from composer.platform import HostPlatform, peak_memory, platform_for, register_platform

CPU = torch.device("cpu")


def test_the_host_platform():
    host = platform_for("cpu")
    assert isinstance(host, HostPlatform) and platform_for(torch.zeros(1)) is host
    assert host.dist_backend == "gloo" and not host.async_copies and host.device_count() == 1
    assert host.new_stream(CPU) is None and host.record_event(None) is None
    free, total = host.memory_info()
    assert 0 < free <= total
    assert host.max_memory_allocated(CPU) is None  # the host keeps no allocator count: RSS measures it
    t = torch.ones(3)
    assert host.pinned(t) is t and not host.empty_host((2,), torch.float32).is_pinned()
    with peak_memory(CPU) as peak:
        torch.ones(10)
    assert peak == {"peak": None}
    assert isinstance(transfer_for(CPU), SyncTransfer)
    if not torch.cuda.is_available():
        assert platform_for(None) is host  # no accelerator: the host is the current platform
    cuda = platform_for("cuda")
    assert cuda.dist_backend == "nccl" and cuda.is_available() == torch.cuda.is_available()


class RecordingStreams(HostPlatform):
    """A platform with streams on the CPU: every stream / event call is logged, as CUDA would get it."""

    async_copies = True

    def __init__(self, _kind="cpu"):
        self.log: list[tuple] = []
        self.streams = 0

    def new_stream(self, device):
        self.streams += 1
        return f"side{self.streams}"

    def on_stream(self, stream):
        platform = self

        class Enter:
            def __enter__(self):
                platform.log.append(("enter", stream))

            def __exit__(self, *exc):
                platform.log.append(("exit", stream))

        return Enter()

    def current_stream(self, device):
        return "compute"

    def record_event(self, stream):
        self.log.append(("record", stream))
        return ("event", len(self.log))

    def wait_event(self, stream, event):
        self.log.append(("wait", stream, event))

    def keep_alive_on(self, tensor, stream):
        self.log.append(("keep", stream))

    def pinned(self, tensor):
        self.log.append(("pin",))
        return tensor.clone()


@pytest.fixture()
def recording_platform():
    platform = RecordingStreams()
    register_platform("cpu", lambda _: platform)
    try:
        yield platform
    finally:
        register_platform("cpu", lambda _: HostPlatform())


def test_layerwise_offload_copies_through_the_platforms_streams(recording_platform):
    """transfer_for asks the platform: one with streams gets side-stream loads fenced by events, the compute stream
    waits on each before the block runs, and the output equals running without offload."""
    from composer.models.wan.config import WanTransformerConfig
    from composer.models.wan.transformer import WanTransformer3DModel

    torch.manual_seed(0)
    config = WanTransformerConfig(num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4,
                                  text_dim=8, freq_dim=16, ffn_dim=32, num_layers=3)
    model = WanTransformer3DModel(config).eval()
    latents, t, text = torch.randn(1, 4, 2, 4, 4), torch.tensor([500.0]), torch.randn(1, 3, 8)
    with torch.inference_mode():
        expected = model(latents, t, text)
    offload = LayerwiseOffload(model, CPU, prefetch=1)
    assert isinstance(offload.transfer, StreamTransfer) and offload.transfer.stream == "side1"
    with torch.inference_mode():
        got = model(latents, t, text)
    assert torch.equal(got, expected)
    log = recording_platform.log
    assert ("pin",) in log  # host copies staged through the platform
    records = [e for e in log if e[0] == "record"]
    waits = [e for e in log if e[0] == "wait"]
    assert records and all(e[1] == "side1" for e in records)
    assert len(waits) == len(records) == 3 and all(e[1] == "compute" for e in waits)  # one load per block
    # every load was issued inside the side stream and recorded there before it was waited on
    for (_, _, event) in waits:
        assert log[event[1] - 1] == ("record", "side1") and log[event[1] - 2] == ("enter", "side1")
    assert any(e == ("keep", "compute") for e in log)
    offload.remove()


# -- plug-ins from another distribution (entry points) -------------------------------------------------
PLUGIN = '''
import torch
import torch.nn.functional as F

from composer.models.attention.backends import Capabilities
from composer.platform import HostPlatform

calls = []


class SplitJointBackend:
    """Joint video + text attention computed as two parts (the way an NPU fused kernel runs it): the video's
    queries and the text's, each over every key."""

    name = "split_joint"
    priority = -1
    capabilities = Capabilities(mask=True, joint_text=True)

    @classmethod
    def load(cls):
        return cls()

    def unusable_reason(self, query, attn_mask, token_grid=None):
        return None

    def __call__(self, query, key, value, attn_mask=None, token_grid=None, joint_text=0):
        calls.append(joint_text)

        def part(q, mask):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                                 attn_mask=mask)
            return out.transpose(1, 2)

        if not joint_text:
            return part(query, attn_mask)
        split = query.shape[1] - joint_text

        def rows(lo, hi):
            if attn_mask is None or attn_mask.shape[-2] == 1:
                return attn_mask
            return attn_mask[..., lo:hi, :]

        return torch.cat([part(query[:, :split], rows(0, split)), part(query[:, split:], rows(split, None))], dim=1)


class FakeDevicePlatform(HostPlatform):
    pass


def make_platform(kind):
    platform = FakeDevicePlatform()
    platform.device_type = kind
    platform.dist_backend = "fake-ccl"
    return platform
'''


@pytest.fixture()
def plugin(tmp_path):
    site = tmp_path / "site"
    (site / "composer_test_plugin").mkdir(parents=True)
    (site / "composer_test_plugin" / "__init__.py").write_text(textwrap.dedent(PLUGIN))
    info = site / "composer_test_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: composer-test-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[composer.attention_backends]\nsplit_joint = composer_test_plugin:SplitJointBackend\n\n"
        "[composer.platforms]\nhpu = composer_test_plugin:make_platform\n")
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    refresh_backends()
    try:
        yield importlib.import_module("composer_test_plugin")
    finally:
        sys.path.remove(str(site))
        sys.modules.pop("composer_test_plugin", None)
        importlib.invalidate_caches()
        refresh_backends()


def test_a_platform_from_another_distribution_is_found(plugin):
    import composer.platform as platforms

    platforms._entry_points_read = False
    try:
        hpu = platform_for("hpu")
        assert type(hpu).__name__ == "FakeDevicePlatform" and hpu.dist_backend == "fake-ccl"
    finally:
        platforms._platforms.pop("hpu", None)
        platforms._factories.pop("hpu", None)


def test_an_attention_backend_from_another_distribution_is_used(plugin, tmp_path):
    """Declared by an entry point, it is listed, accepted as a setting, never picked by `auto` over a
    higher-priority backend, and used by a model: HunyuanVideo's joint attention hands it the text's length, and
    its split computation equals SDPA's."""
    from composer.loader.components import ComponentLoader
    from composer.loader.model_index import ComponentSpec
    from composer.models.attention import set_attention_backend
    from composer.runtime import RuntimeArgs
    from composer.testing.tiny_hunyuan import TinyHunyuanSpec

    assert "split_joint" in backend_names() and "split_joint" in backend_choices()
    assert RuntimeArgs.from_kwargs(attention_backend="split_joint").attention_backend == "split_joint"
    assert capabilities_of(resolve_backend("split_joint")).joint_text
    assert resolve_backend("auto").name == "sdpa"

    from diffusers import HunyuanVideoTransformer3DModel

    spec = TinyHunyuanSpec()
    torch.manual_seed(0)
    HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=spec.num_heads, attention_head_dim=spec.head_dim,
        num_layers=1, num_single_layers=1, num_refiner_layers=1, mlp_ratio=4.0, patch_size=2, patch_size_t=1,
        guidance_embeds=True, text_embed_dim=16, pooled_projection_dim=16, rope_theta=256.0,
        rope_axes_dim=spec.rope_axes_dim,
    ).save_pretrained(folder := tmp_path / "hunyuan")
    component = ComponentSpec("transformer", "diffusers", "HunyuanVideoTransformer3DModel")
    model = ComponentLoader.for_spec(component, folder).load(folder, component, CPU, torch.float32)
    g = torch.Generator().manual_seed(1)
    x, t = torch.randn(1, 4, 2, 4, 4, generator=g), torch.tensor([600.0])
    text, pooled = torch.randn(1, 6, 16, generator=g), torch.randn(1, 16, generator=g)
    mask = torch.ones(1, 6, dtype=torch.int64)
    mask[0, 4:] = 0  # padded text: the joint mask matters
    with torch.no_grad():
        assert set_attention_backend(model, "sdpa") == ["sdpa"]
        expected = model(x, t, text, mask, pooled, torch.tensor([5.0]))
        assert set_attention_backend(model, "split_joint") == ["split_joint"]
        got = model(x, t, text, mask, pooled, torch.tensor([5.0]))
    assert (got - expected).abs().max().item() <= 1e-5
    assert any(n > 0 for n in plugin.calls)  # the joint blocks told it where the text starts


def test_backends_declare_capabilities():
    sdpa, sliding = resolve_backend("sdpa"), resolve_backend("sliding_window")
    assert capabilities_of(sdpa).lse and capabilities_of(sdpa).mask and capabilities_of(sdpa).exact
    assert not capabilities_of(sliding).exact  # approximate: `auto` never picks it
    from composer.models.attention.backends.flash import Backend as Flash

    flash = Flash(lambda q, k, v, **kw: q)
    caps = flash.capabilities
    assert caps.lse and not caps.mask and caps.devices == ("cuda",)
    q = torch.zeros(1, 2, 2, 8)
    assert flash.unusable_reason(q, None) == "inputs are on cpu"  # derived from the capabilities
    assert Capabilities(max_head_dim=4).describe() == "devices any, mask, head_dim <= 4"


# -- the declarative token plan and the block runner ---------------------------------------------------
def test_the_block_runner_splits_and_the_plan_gathers():
    """The parallel hook fills a model's runner: its split runs once before the blocks and a hook on the plan's
    `gather_at` module gathers; a model without a plan is refused, naming what it lacks."""
    from composer.errors import ConfigError
    from composer.models.runner import runner_of, token_plan_of
    from composer.models.wan.config import WanTransformerConfig
    from composer.models.wan.transformer import WanTransformer3DModel
    from composer.parallel.sequence import apply_sequence_parallel

    class KeepEverything:  # a one-rank "split": every token stays, and each call is logged
        log: list[str] = []

        def check_heads(self, heads):
            pass

        def split(self, x, rotary, frames):
            self.log.append(f"split {x.shape[1]} over {frames} frames")
            return x, rotary

        def gather(self, x):
            self.log.append(f"gather {tuple(x.shape)}")
            return x

    torch.manual_seed(0)
    model = WanTransformer3DModel(WanTransformerConfig(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=8, freq_dim=16,
        ffn_dim=32, num_layers=2)).eval()
    assert token_plan_of(model).gather_at == "proj_out"
    latents, t, text = torch.randn(1, 4, 2, 4, 4), torch.tensor([500.0]), torch.randn(1, 3, 8)
    with torch.inference_mode():
        expected = model(latents, t, text)
        sp = KeepEverything()
        assert apply_sequence_parallel(model, sp) == 2  # the self-attention modules
        runner_of(model).detach_gather()
        runner_of(model).attach_gather(model, token_plan_of(model))  # attaching twice keeps one hook
        for module in model.modules():  # attention stays local: this test checks the runner, not the ranks
            if hasattr(module, "parallel"):
                module.parallel = None
        got = model(latents, t, text)
    assert torch.equal(got, expected) and model.sequence_parallel is sp
    assert sp.log == ["split 8 over 2 frames", "gather (1, 8, 16)"]

    with pytest.raises(ConfigError, match="token_plan"):
        apply_sequence_parallel(torch.nn.Linear(2, 2), sp)
