"""One hook primitive (composer/attach.py): attach with an order key, detach; every hook of a loaded pipeline
listed and removable, the model then computing exactly what it computed without it; LoRA adapters set, swapped and
removed while offloaded, equal to the same adapters without offload; an adapter swap that keeps the layers keeps a
compiled model's graphs."""

from __future__ import annotations

import pytest
import torch
from test_hooks import PROMPT, REQUEST, _gen, _graphs, _reset_dynamo
from test_lora import lora_weights, write_lora
from torch import nn

from composer.attach import LAST, Attachments, HookHandle, attach, attaching, order_of
from composer.cancel import Cancelled, CancelToken
from composer.errors import UnsupportedError

SMALL = {**REQUEST, "num_inference_steps": 2}


# -- the primitive ---------------------------------------------------------------------------------------
class _Engine:
    def __init__(self):
        self.hooks: list = []


def test_attach_keeps_a_target_sorted_by_order_key_and_remove_is_idempotent():
    engine = _Engine()
    foreign = object()
    engine.hooks.append(foreign)  # attached another way: no key, stays where it is relative to keyed ones after it
    late = attach(engine, "cancel", order=7)
    early = attach(engine, "lora", order=1)
    middle = attach(engine, "offload", order=5)
    tie = attach(engine, "offload-2", order=5)
    assert engine.hooks == ["lora", "offload", "offload-2", "cancel", foreign] or \
        engine.hooks == [foreign, "lora", "offload", "offload-2", "cancel"]
    assert order_of(foreign) == LAST
    middle.remove()
    middle.remove()  # idempotent
    assert "offload" not in engine.hooks and middle.removed
    for handle in (early, tie, late):
        handle.remove()
    assert engine.hooks == [foreign]


def test_torch_hooks_run_in_order_key_order_and_removal_gives_the_exact_module_back():
    torch.manual_seed(0)
    layer = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    before = layer(x)
    calls = []

    def mark(tag, scale):
        def hook(module, args):
            calls.append(tag)
            return (args[0] * scale,)

        return hook

    foreign = layer.register_forward_pre_hook(mark("foreign", 1.0))
    cancel = attach(layer, mark("cancel", 1.0), kind="forward_pre", order=7)
    offload = attach(layer, mark("offload", 3.0), kind="forward_pre", order=5)  # attached last, runs first of ours
    out = layer(x)
    assert calls == ["foreign", "offload", "cancel"]
    assert not torch.equal(out, before)
    offload.remove()
    cancel.remove()
    foreign.remove()
    assert not layer._forward_pre_hooks
    assert torch.equal(layer(x), before)

    post = attach(layer, lambda m, a, out: out * 2, kind="forward", always_call=True, order=5)
    assert torch.equal(layer(x), before * 2)
    post.remove()
    assert torch.equal(layer(x), before) and not layer._forward_hooks and not layer._forward_hooks_always_called


def test_attribute_attachments_restore_what_was_there():
    layer = nn.Linear(2, 2)
    compiled = attach((layer, "forward"), lambda x: x * 0)  # an instance attribute over the class's method
    assert torch.equal(layer(torch.ones(1, 2)), torch.zeros(1, 2))
    compiled.remove()
    assert "forward" not in layer.__dict__

    class Holder:
        value = None

    holder = Holder()
    holder.value = "old"
    handle = attach((holder, "value"), "new")
    assert holder.value == "new"
    handle.remove()
    assert holder.value == "old"


def test_a_hooks_attachments_are_its_parts_removed_last_first_and_an_irreversible_one_is_refused_whole():
    attachments = Attachments()
    entry = attachments.add("offload", 5)
    done = []
    with attaching(entry):
        attach(undo=lambda: done.append("weights back"))
        attach(undo=lambda: done.append("scope off"))
    stuck = attachments.add("quantize", 0)
    with attaching(stuck):
        attach(undo=None, what="weights replaced")
    assert attachments.names() == ["quantize", "offload"] and isinstance(entry, HookHandle)
    with pytest.raises(UnsupportedError, match="quantize"):
        attachments.remove()
    assert done == [] and attachments.names() == ["quantize", "offload"]  # nothing was taken off
    attachments.remove("offload")
    assert done == ["scope off", "weights back"] and attachments.names() == ["quantize"]
    with pytest.raises(KeyError, match="no hook 'offload'"):
        attachments.remove("offload")


# -- a loaded pipeline's hooks -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def files(tiny_wan_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-primitive")
    model = _gen(tiny_wan_dir).pipeline.modules["transformer"]
    return (write_lora(root / "one.safetensors", "kohya", lora_weights(model, seed=1)),
            write_lora(root / "two.safetensors", "diffusers", lora_weights(model, seed=2)),
            write_lora(root / "bias.safetensors", "diffusers", lora_weights(model, seed=3, with_bias=True)),
            write_lora(root / "ranks.safetensors", "diffusers-patterns", lora_weights(model, seed=4)))


def adapters_of(gen):
    return gen.pipeline.lora_adapters()


@pytest.fixture(scope="module")
def plain(tiny_wan_dir):
    return _gen(tiny_wan_dir).generate_video(PROMPT, **SMALL).latents


@pytest.mark.parametrize("offload", ["layerwise", "model"])
def test_every_hook_of_a_loaded_pipeline_is_listed_and_removable(tiny_wan_dir, files, plain, offload):
    gen = _gen(tiny_wan_dir, lora_path=[str(files[0])], cache="teacache", cache_threshold=0.5, offload=offload)
    pipeline = gen.pipeline
    assert pipeline.attachments.names() == ["lora", "attention", "cache", "offload", "cancel"]
    assert all(entry.parts for entry in pipeline.attachments)
    assert not torch.equal(gen.generate_video(PROMPT, **SMALL).latents, plain)  # the hooks change the video

    engine = pipeline.engines[0]
    assert len(engine.hooks) == 2  # teacache's, then cancel's (order keys 4 and 7)
    assert pipeline.remove_hooks() == ["lora", "attention", "cache", "offload", "cancel"]
    assert list(pipeline.attachments) == [] and pipeline.hooks == [] and pipeline.applied_hooks == []
    assert engine.hooks == [] and pipeline.stage_scopes == []
    model = pipeline.modules["transformer"]
    assert model.step_cache is None and "forward" not in model.__dict__
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    assert torch.equal(gen.generate_video(PROMPT, **SMALL).latents, plain)  # bit for bit the plain model


def test_hooks_attached_another_way_are_adopted_and_removable(tiny_wan_dir, plain):
    """dbcache fills the model's step_cache slot and adds its engine hook itself: both are recorded."""
    gen = _gen(tiny_wan_dir, cache="dbcache", cache_fn_blocks=1, cache_bn_blocks=0, cache_threshold=10.0)
    entry = gen.pipeline.attachments.get("cache")
    assert {p.what for p in entry.parts} >= {"WanTransformer3DModel.step_cache", "engine hook PerRequestStepCache"}
    assert gen.pipeline.remove_hooks("cache") == ["cache"]
    model = gen.pipeline.modules["transformer"]
    assert model.step_cache is None and len(gen.pipeline.engines[0].hooks) == 1  # cancel's
    assert torch.equal(gen.generate_video(PROMPT, **SMALL).latents, plain)


def test_quantize_cannot_be_removed_and_nothing_is_taken_off(tiny_wan_dir):
    pytest.importorskip("torchao")
    gen = _gen(tiny_wan_dir, quantize="int8")
    with pytest.raises(UnsupportedError, match="quantize"):
        gen.pipeline.remove_hooks()
    assert gen.pipeline.attachments.names() == ["quantize", "attention", "cancel"]
    assert gen.pipeline.remove_hooks("cancel") == ["cancel"]


def test_removing_one_hook_leaves_the_others(tiny_wan_dir, files, plain):
    gen = _gen(tiny_wan_dir, lora_path=[str(files[0])], offload="layerwise")
    assert gen.pipeline.remove_hooks("lora") == ["lora"]  # adapters unset under offload: re-arranged
    assert gen.pipeline.attachments.names() == ["attention", "offload", "cancel"]
    assert torch.equal(gen.generate_video(PROMPT, **SMALL).latents, plain)
    gen.pipeline.remove_hooks("offload")
    assert torch.equal(gen.generate_video(PROMPT, **SMALL).latents, plain)


def test_cancel_checks_stay_after_offloads_block_hooks_when_offload_re_attaches(tiny_wan_dir, files):
    import composer.attach as attach_module

    gen = _gen(tiny_wan_dir, offload="layerwise")
    offload = next(h for h in gen.pipeline.hooks if h.name == "offload").done["transformer"]
    gen.pipeline.lora_adapters().set([files[0]])  # offload takes its hooks off and attaches them again
    for block in offload.blocks:
        keys = [attach_module._torch_orders[k] for k in block._forward_pre_hooks if k in attach_module._torch_orders]
        assert keys == sorted(keys) and keys[0] == 5 and keys[-1] == 7
    token = CancelToken()
    token.cancel()
    with pytest.raises(Cancelled):
        gen.generate_video(PROMPT, cancel=token, **SMALL)
    assert offload.resident == []  # the block loaded for the check went again


# -- LoRA under offload ----------------------------------------------------------------------------------------
def _lora_video(tiny_wan_dir, paths, scales=None, fuse=False):
    gen = _gen(tiny_wan_dir, lora_path=[str(p) for p in paths], lora_scale=scales, lora_fuse=fuse)
    return gen.generate_video(PROMPT, **SMALL).latents


def _set(gen, paths, scales=None, fuse=False):
    """VideoGenerator.set_lora (the runtime's lora_fuse says fused or not: set here for the one fused case)."""
    runtime = gen.pipeline.runtime
    previous, runtime.lora_fuse = runtime.lora_fuse, fuse
    try:
        gen.set_lora([str(p) for p in paths], scales)
    finally:
        runtime.lora_fuse = previous


@pytest.mark.parametrize("offload", ["model", "layerwise"])
def test_set_swap_and_remove_lora_under_offload_equal_the_same_adapters_without_offload(
        tiny_wan_dir, files, plain, offload):
    gen = _gen(tiny_wan_dir, offload=offload)
    adapters = gen.pipeline.lora_adapters()
    hook = next(h for h in gen.pipeline.hooks if h.name == "offload")

    def offloaded_tensors() -> int:
        if offload == "model":
            return len(hook.models._components[id(adapters.model)].slots)
        return sum(len(s) for s in hook.done["transformer"].slots)

    bare = offloaded_tensors()
    _set(gen, [files[0], files[1]], [0.8, -0.4])  # adapter layers added: re-arranged, streamed like the rest
    assert offloaded_tensors() > bare
    assert torch.equal(gen.generate_video(PROMPT, **SMALL).latents,
                       _lora_video(tiny_wan_dir, files[:2], [0.8, -0.4]))

    _set(gen, [files[1], files[0]], [0.5, 1.0])  # same layers and ranks: written in place
    assert adapters.hotswaps == 1
    assert torch.equal(gen.generate_video(PROMPT, **SMALL).latents,
                       _lora_video(tiny_wan_dir, [files[1], files[0]], [0.5, 1.0]))

    _set(gen, [files[2]])  # another arrangement (a bias), not a hotswap
    assert adapters.hotswaps == 1
    assert torch.equal(gen.generate_video(PROMPT, **SMALL).latents, _lora_video(tiny_wan_dir, [files[2]]))

    _set(gen, [files[0]], fuse=True)  # merged into the offloaded weights
    fused = gen.generate_video(PROMPT, **SMALL).latents
    assert (fused - _lora_video(tiny_wan_dir, [files[0]], fuse=True)).abs().max().item() <= 1e-6

    gen.unset_lora()
    assert offloaded_tensors() == bare
    assert torch.equal(gen.generate_video(PROMPT, **SMALL).latents, plain)


def test_lora_set_under_layerwise_offload_on_a_causal_model_equals_it_without_offload(tiny_causal_dir, files):
    from test_hooks import CAUSAL

    request = {**CAUSAL, "num_frames": 4 * (4 - 1) + 1}
    reference = _gen(tiny_causal_dir, lora_path=[str(files[0])]).generate_video(PROMPT, **request).latents
    gen = _gen(tiny_causal_dir, offload="layerwise")
    offload = next(h for h in gen.pipeline.hooks if h.name == "offload").done["transformer"]
    bare = sum(len(s) for s in offload.slots)
    _set(gen, [files[0]])
    assert sum(len(s) for s in offload.slots) == bare + 2 * len(files_modules(files[0], gen))  # each lora_A, lora_B
    assert torch.equal(gen.generate_video(PROMPT, **request).latents, reference)


def files_modules(path, gen):
    from composer.accel.lora_names import read_lora

    return read_lora(path, gen.pipeline.modules["transformer"]).modules


def test_lora_changes_are_refused_under_disk_offload(tiny_wan_dir, files, plain):
    gen = _gen(tiny_wan_dir, offload="disk")
    with pytest.raises(UnsupportedError, match="offload = disk"):
        gen.pipeline.lora_adapters().set([files[0]])
    assert torch.equal(gen.generate_video(PROMPT, **SMALL).latents, plain)


def test_a_hotswap_equals_a_fresh_set(tiny_wan_dir, files):
    gen = _gen(tiny_wan_dir)
    adapters = gen.pipeline.lora_adapters()
    adapters.set([files[0]], [0.7])
    adapters.set([files[1]], [0.3])
    assert adapters.hotswaps == 1
    swapped = gen.generate_video(PROMPT, **SMALL).latents
    assert torch.equal(swapped, _lora_video(tiny_wan_dir, [files[1]], [0.3]))


# -- compile -----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_compiled_model_keeps_its_graphs_when_an_adapter_is_hotswapped(tiny_wan_dir, files):
    _reset_dynamo()
    gen = _gen(tiny_wan_dir, compile="regional", lora_path=[str(files[0])], offload="layerwise")
    gen.generate_video(PROMPT, **SMALL)
    graphs = _graphs()
    _set(gen, [files[1]])  # same layers, ranks and scale: the weights are copied in place
    swapped = gen.generate_video(PROMPT, **SMALL).latents
    assert _graphs() == graphs, "recompiled after a hotswap"
    assert (swapped - _lora_video(tiny_wan_dir, [files[1]])).abs().max().item() <= 1e-4

    _set(gen, [files[3]])  # another arrangement (a layer of rank 2): new modules; whatever dynamo recompiles
    assert adapters_of(gen).hotswaps == 1  # for them, the video is the eager one
    rearranged = gen.generate_video(PROMPT, **SMALL).latents
    assert (rearranged - _lora_video(tiny_wan_dir, [files[3]])).abs().max().item() <= 1e-4
    gen.pipeline.remove_hooks("compile")  # the eager forward back
    assert "forward" not in gen.pipeline.modules["transformer"].blocks[0].__dict__
