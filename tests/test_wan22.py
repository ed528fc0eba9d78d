"""Wan2.2 text-to-video: the two-expert A14B layout and TI2V-5B (text-to-video mode) against diffusers' WanPipeline on
tiny folders of both layouts (frames within 1 uint8, the expert switch step, guidance_scale_2, seeds), per-token
timesteps in composer's DiT, family detection, folder errors, and the hooks on two experts (offload, LoRA)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import diffusers_frames, max_uint8_diff
from safetensors.torch import save_file

from composer import VideoGenerator
from composer.errors import ConfigError
from composer.generator import resolve_model
from composer.stages.expert_denoising import expert_switch_index
from composer.stages.token_timesteps import TimestepMask, TokenTimestepSteps
from composer.testing import build_tiny_wan, build_tiny_wan22_a14b

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "a red fox running through snow"
# non-square; 5 UniPC steps at the tiny folders' shift 5.0: [999, 952, 882, 769, 556], so with the boundary at 875
# the high-noise expert takes 3 steps and the low-noise one 2
A14B_CASES = {
    "cfg-two-scales": dict(negative_prompt="blurry", guidance_scale=4.0, guidance_scale_2=2.5, height=32, width=48,
                           num_frames=5, num_inference_steps=5, seed=11),
    "no-cfg": dict(negative_prompt=None, guidance_scale=1.0, height=48, width=32, num_frames=5,
                   num_inference_steps=4, seed=2**40 + 1),
}
# TI2V sizes are multiples of 32 (16x VAE x patch 2)
TI2V_CASES = {
    "cfg": dict(negative_prompt="blurry", guidance_scale=5.0, height=64, width=96, num_frames=5,
                num_inference_steps=4, seed=5),
    "no-cfg": dict(negative_prompt=None, guidance_scale=1.0, height=96, width=64, num_frames=9,
                   num_inference_steps=3, seed=123),
}


@pytest.fixture(scope="module")
def a14b_dir(tmp_path_factory):
    return build_tiny_wan22_a14b(tmp_path_factory.mktemp("models") / "tiny-wan22-a14b")


@pytest.fixture(scope="module")
def a14b_gen(a14b_dir):
    return VideoGenerator.from_pretrained(a14b_dir, dtype="fp32", progress=False)


@pytest.fixture(scope="module")
def ti2v_gen(ti2v_dir):
    return VideoGenerator.from_pretrained(ti2v_dir, dtype="fp32", progress=False)


def _diffusers(folder):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def a14b_ref(a14b_dir):
    return _diffusers(a14b_dir)


@pytest.fixture(scope="module")
def ti2v_ref(ti2v_dir):
    return _diffusers(ti2v_dir)


def _run_both(gen, pipe, case):
    case = dict(case)
    seed = case.pop("seed")
    ours = gen.generate_video(PROMPT, seed=seed, **case)
    ref = diffusers_frames(pipe, PROMPT, seed, **{k: v for k, v in case.items() if v is not None})
    return ours, ref


def _record_calls(modules: dict[str, torch.nn.Module], log: list):
    """Forward pre-hooks logging (component name, first timestep value) for each call; returns the handles."""
    def hook(name):
        def record(module, args, kwargs):
            timestep = kwargs["timestep"] if "timestep" in kwargs else args[1]
            log.append((name, float(timestep.flatten()[0])))
        return record

    return [m.register_forward_pre_hook(hook(n), with_kwargs=True) for n, m in modules.items()]


# -- the two-expert A14B layout --------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(A14B_CASES))
def test_a14b_frames_match_diffusers(a14b_gen, a14b_ref, name):
    ours, ref = _run_both(a14b_gen, a14b_ref, A14B_CASES[name])
    case = A14B_CASES[name]
    assert ours.frames.shape == (case["num_frames"], case["height"], case["width"], 3)
    assert ours.frames.std() > 1.0, "degenerate video: the comparison would prove nothing"
    assert max_uint8_diff(ours.frames, ref) <= 1


def test_a14b_switches_expert_at_the_step_diffusers_does(a14b_gen, a14b_ref):
    case = dict(A14B_CASES["cfg-two-scales"])
    seed = case.pop("seed")
    ours_log, ref_log = [], []
    handles = _record_calls({n: a14b_gen.pipeline.modules[n] for n in ("transformer", "transformer_2")}, ours_log)
    handles += _record_calls({"transformer": a14b_ref.transformer, "transformer_2": a14b_ref.transformer_2}, ref_log)
    try:
        a14b_gen.generate_video(PROMPT, seed=seed, **case)
        diffusers_frames(a14b_ref, PROMPT, seed, **case)
    finally:
        for handle in handles:
            handle.remove()
    # composer batches the CFG branches (one call a step), diffusers calls twice a step
    ref_steps = ref_log[::2]
    assert ours_log == ref_steps
    experts = [name for name, _ in ours_log]
    assert experts == ["transformer"] * 3 + ["transformer_2"] * 2  # both experts used, switch after step 3
    assert all(t >= 875 for name, t in ours_log if name == "transformer")
    assert all(t < 875 for name, t in ours_log if name == "transformer_2")


def test_expert_switch_index():
    assert expert_switch_index(torch.tensor([999, 952, 882, 769, 556]), 875.0) == 3
    assert expert_switch_index(torch.tensor([999.0, 875.0, 874.9]), 875.0) == 2  # t == boundary: high-noise expert
    assert expert_switch_index(torch.tensor([800, 500]), 875.0) == 0
    assert expert_switch_index(torch.tensor([999, 900]), 875.0) == 2
    with pytest.raises(Exception, match="not decreasing"):
        expert_switch_index(torch.tensor([999, 500, 900]), 875.0)


def test_guidance_scale_2_is_honoured(a14b_gen):
    base = dict(A14B_CASES["cfg-two-scales"])
    seed = base.pop("seed")
    base.pop("guidance_scale_2")
    low_3 = a14b_gen.generate_video(PROMPT, seed=seed, guidance_scale_2=3.0, **base).frames
    low_1 = a14b_gen.generate_video(PROMPT, seed=seed, guidance_scale_2=1.0, **base).frames
    assert max_uint8_diff(low_3, low_1) > 1  # the low-noise expert's scale changes the video
    # the family's default is the released 3.0 (the folder states none)
    assert a14b_gen.default_sampling.guidance_scale_2 == 3.0
    default = a14b_gen.generate_video(PROMPT, seed=seed, **base).frames
    assert (default == low_3).all()


def test_guidance_scale_2_defaults_to_guidance_scale_like_diffusers(a14b_gen, a14b_ref):
    """With guidance_scale_2 unset (None), both experts use guidance_scale, as diffusers does."""
    case = dict(A14B_CASES["cfg-two-scales"])
    seed = case.pop("seed")
    case.pop("guidance_scale_2")
    sp = a14b_gen.sampling_param(**case)
    sp.guidance_scale_2 = None
    ours = a14b_gen.generate_video(PROMPT, seed=seed, sampling_param=sp).frames
    assert max_uint8_diff(ours, diffusers_frames(a14b_ref, PROMPT, seed, **case)) <= 1


def test_a14b_initial_noise_matches_diffusers(a14b_gen, a14b_ref):
    from composer.batch import ForwardBatch

    stage = a14b_gen.pipeline.stage("LatentPreparationStage")
    batch = stage(ForwardBatch(prompt=["x"], height=48, width=80, num_frames=9, seed=77))
    expected = a14b_ref.prepare_latents(1, 16, 48, 80, 9, torch.float32, torch.device("cpu"),
                                        torch.Generator("cpu").manual_seed(77))
    assert torch.equal(batch.latents, expected)


# -- TI2V-5B in text-to-video mode ------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(TI2V_CASES))
def test_ti2v_frames_match_diffusers(ti2v_gen, ti2v_ref, name):
    ours, ref = _run_both(ti2v_gen, ti2v_ref, TI2V_CASES[name])
    case = TI2V_CASES[name]
    assert ours.frames.shape == (case["num_frames"], case["height"], case["width"], 3)
    assert ours.frames.std() > 1.0
    assert max_uint8_diff(ours.frames, ref) <= 1


def test_ti2v_reads_the_wan22_vae_factors(ti2v_gen, ti2v_ref):
    """48 latent channels at 1/16 of the size (from the VAE config), drawn as diffusers draws them."""
    from composer.batch import ForwardBatch

    stage = ti2v_gen.pipeline.stage("LatentPreparationStage")
    batch = stage(ForwardBatch(prompt=["x"], height=64, width=96, num_frames=9, seed=9))
    assert batch.latents.shape == (1, 48, 3, 4, 6)
    expected = ti2v_ref.prepare_latents(1, 48, 64, 96, 9, torch.float32, torch.device("cpu"),
                                        torch.Generator("cpu").manual_seed(9))
    assert torch.equal(batch.latents, expected)
    assert ti2v_gen.pipeline.stage("InputValidationStage").spatial_multiple == 32


def test_ti2v_per_token_timesteps_give_the_same_video(ti2v_gen):
    """The per-token layout diffusers uses ([B, S], every token t) and the coarsest exact one ([B]) agree."""
    case = dict(TI2V_CASES["cfg"])
    seed = case.pop("seed")
    stage = ti2v_gen.pipeline.stage("TokenTimestepDenoisingStage")
    log = []
    handles = _record_shapes(ti2v_gen.pipeline.modules["transformer"], log)
    try:
        coarse = ti2v_gen.generate_video(PROMPT, seed=seed, **case).frames
        stage.exact_layout = False
        per_token = ti2v_gen.generate_video(PROMPT, seed=seed, **case).frames
    finally:
        stage.exact_layout = True
        handles.remove()
    steps = case["num_inference_steps"]
    assert log[:steps] == [(2,)] * steps  # batched CFG rows, one timestep each
    assert log[steps:] == [(2, 2 * 2 * 3)] * steps  # 2 latent frames of 2 x 3 tokens
    assert max_uint8_diff(coarse, per_token) <= 1


def _record_shapes(model, log):
    return model.register_forward_pre_hook(lambda m, args, kwargs: log.append(tuple(args[1].shape)), with_kwargs=True)


def test_timestep_mask_layouts():
    ones = TimestepMask.denoise_all((3, 2, 4))
    assert ones.layout().shape == (1,)
    first_frame = torch.ones(1, 3, 2, 4)
    first_frame[:, 0] = 0  # image-to-video's conditioning frame
    layout = TimestepMask(first_frame).layout()
    assert layout.tolist() == [[0.0, 1.0, 1.0]]
    ragged = torch.ones(2, 3, 2, 4)
    ragged[1, 1, 0, 2] = 0
    assert TimestepMask(ragged).layout().shape == (2, 24)
    from diffusers import UniPCMultistepScheduler

    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True)
    scheduler.set_timesteps(3)
    latents = torch.zeros(2, 4, 3, 4, 8)
    t = scheduler.timesteps[0]
    assert TokenTimestepSteps(scheduler, None, TimestepMask(first_frame)).model_timestep(t, latents).tolist() == [
        [0.0, float(t), float(t)]] * 2
    per_token = TokenTimestepSteps(scheduler, None, TimestepMask(first_frame), exact_layout=False)
    assert per_token.model_timestep(t, latents).shape == (2, 24)


def test_dit_per_token_timesteps_match_diffusers(tmp_path):
    """composer's DiT with a timestep per token ([B, S], all different) == diffusers' WanTransformer3DModel."""
    from diffusers import WanTransformer3DModel as Reference

    from composer.loader.components import ComposerModelLoader
    from composer.loader.model_index import ComponentSpec

    torch.manual_seed(0)
    ref = Reference(num_attention_heads=2, attention_head_dim=32, in_channels=48, out_channels=48, text_dim=32,
                    ffn_dim=128, num_layers=2, freq_dim=64).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    ref.save_pretrained(tmp_path / "transformer")
    spec = ComponentSpec("transformer", "diffusers", "WanTransformer3DModel")
    ours = ComposerModelLoader().load(tmp_path / "transformer", spec, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 48, 3, 6, 10, generator=g)
    text = torch.randn(2, 7, 32, generator=g)
    per_token = torch.rand(2, 3 * 3 * 5, generator=g) * 1000
    per_frame = torch.tensor([[0.0, 700.0, 700.0], [300.0, 300.0, 20.0]])
    with torch.inference_mode():
        diff = (ours(latents, per_token, text) - ref(latents, per_token, text, return_dict=False)[0]).abs().max()
        assert float(diff) <= 1e-4
        # per-frame timesteps == the same values given per token
        expanded = per_frame.repeat_interleave(15, dim=1)
        diff = (ours(latents, per_frame, text) - ref(latents, expanded, text, return_dict=False)[0]).abs().max()
        assert float(diff) <= 1e-4
        with pytest.raises(Exception, match=r"expected \[2\], \[2, 3\] or \[2, 45\]"):
            ours(latents, torch.zeros(2, 7), text)


# -- families, folders ----------------------------------------------------------------------------------------
def test_detectors_tell_the_three_layouts_apart(tmp_path, a14b_dir, ti2v_dir):
    wan21 = build_tiny_wan(tmp_path / "wan21")
    found = {name: resolve_model(str(folder)) for name, folder in
             (("wan21", wan21), ("a14b", a14b_dir), ("ti2v", ti2v_dir))}
    assert {n: r.configs.family.name for n, r in found.items()} == {
        "wan21": "wan2.1-t2v", "a14b": "wan2.2-t2v-a14b", "ti2v": "wan2.2-ti2v-5b"}
    assert {n: r.pipeline_cls.__name__ for n, r in found.items()} == {
        "wan21": "WanPipeline", "a14b": "Wan22A14BPipeline", "ti2v": "Wan22TI2VPipeline"}
    assert {r.configs.matched_by for r in found.values()} == {"detector"}
    # a Wan2.2 family forced on a Wan2.1 folder does not fit its pipeline
    with pytest.raises(ConfigError, match="does not fit"):
        resolve_model(str(wan21), "wan2.2-t2v-a14b")


def test_families_have_the_released_defaults(a14b_gen, ti2v_gen):
    a, t = a14b_gen.default_sampling, ti2v_gen.default_sampling
    assert (a.width, a.height, a.num_frames, a.num_inference_steps, a.guidance_scale, a.guidance_scale_2, a.fps) == (
        1280, 720, 81, 40, 4.0, 3.0, 16)
    assert (t.width, t.height, t.num_frames, t.num_inference_steps, t.guidance_scale, t.fps) == (
        1280, 704, 121, 50, 5.0, 24)
    assert a.flow_shift == t.flow_shift == 5.0  # the tiny folders' scheduler configs state 5.0: the folder wins
    assert not hasattr(t, "guidance_scale_2")


def _edited_copy(src, dst, **changes):
    shutil.copytree(src, dst)
    index = json.loads((dst / "model_index.json").read_text())
    for key, value in changes.items():
        if value is ...:
            index.pop(key)
        else:
            index[key] = value
    (dst / "model_index.json").write_text(json.dumps(index))
    return dst


@pytest.mark.parametrize("changes, message", [
    (dict(boundary_ratio=1.5), r"boundary_ratio = 1\.5: expected a number between 0 and 1"),
    (dict(boundary_ratio=0), r"boundary_ratio = 0: expected a number between 0 and 1"),
    (dict(boundary_ratio="high"), r"boundary_ratio"),
    (dict(boundary_ratio=None), r"boundary_ratio = None: expected a number"),
    (dict(transformer_2=...), r"no transformer_2"),
])
def test_bad_a14b_folder_is_a_clear_config_error(tmp_path, a14b_dir, changes, message):
    folder = _edited_copy(a14b_dir, tmp_path / "bad", **changes)
    with pytest.raises(ConfigError, match=message):
        VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False)


# -- hooks on two experts -------------------------------------------------------------------------------------
def test_model_offload_keeps_only_the_running_expert_on_the_device(a14b_dir, a14b_gen):
    case = dict(A14B_CASES["cfg-two-scales"])
    seed = case.pop("seed")
    expected = a14b_gen.generate_video(PROMPT, seed=seed, **case).frames
    gen = VideoGenerator.from_pretrained(a14b_dir, dtype="fp32", progress=False, offload="model")
    offload = next(h for h in gen.pipeline.hooks if h.name == "offload").models
    experts = {n: gen.pipeline.modules[n] for n in ("transformer", "transformer_2")}
    seen = []

    def check(name):
        def hook(module, args):
            seen.append((name, {n: offload.is_on_device(m) for n, m in experts.items()}))
        return hook

    handles = [m.register_forward_pre_hook(check(n)) for n, m in experts.items()]
    try:
        frames = gen.generate_video(PROMPT, seed=seed, **case).frames
    finally:
        for handle in handles:
            handle.remove()
    assert (frames == expected).all()
    assert [n for n, _ in seen] == ["transformer"] * 3 + ["transformer_2"] * 2
    for name, on_device in seen:  # the running expert, and only it
        assert on_device == {n: n == name for n in experts}
    assert not any(offload.is_on_device(m) for m in experts.values())  # both back on the host afterwards


def test_model_offload_leaves_an_expert_without_steps_on_the_host(a14b_dir, a14b_gen):
    """One step (t = 999): the low-noise expert has nothing to do, and never visits the device."""
    case = dict(A14B_CASES["no-cfg"], num_inference_steps=1)
    seed = case.pop("seed")
    expected = a14b_gen.generate_video(PROMPT, seed=seed, **case).frames
    gen = VideoGenerator.from_pretrained(a14b_dir, dtype="fp32", progress=False, offload="model")
    offload = next(h for h in gen.pipeline.hooks if h.name == "offload").models
    visits = []
    original = offload.prefetch

    def prefetch(modules):  # on_device's first move: every component it brings to the device
        modules = list(modules)
        visits.extend(id(m) for m in modules)
        original(modules)

    offload.prefetch = prefetch
    result = gen.generate_video(PROMPT, seed=seed, **case)
    assert (result.frames == expected).all()
    modules = gen.pipeline.modules
    assert id(modules["transformer"]) in visits and id(modules["transformer_2"]) not in visits
    assert "DenoisingStage(transformer_2)" not in result.timings


@pytest.mark.parametrize("mode", ["layerwise", "disk"])
def test_block_offload_streams_both_experts(a14b_dir, a14b_gen, mode):
    case = dict(A14B_CASES["no-cfg"])
    seed = case.pop("seed")
    expected = a14b_gen.generate_video(PROMPT, seed=seed, **case).frames
    gen = VideoGenerator.from_pretrained(a14b_dir, dtype="fp32", progress=False, offload=mode)
    done = next(h for h in gen.pipeline.hooks if h.name == "offload").done
    assert set(done) == {"transformer", "transformer_2"}
    assert (gen.generate_video(PROMPT, seed=seed, **case).frames == expected).all()
    assert all(o.stats.loads > 0 and o.resident == [] for o in done.values())


def _write_lora(path, model, seed):
    """A rank-4 LoRA in diffusers naming (`transformer.` prefix) on every block's attention q and FFN output."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(len(model.blocks)):
        for composer_name, diffusers_name in (("attn1.to_q", "attn1.to_q"), ("ffn.fc_out", "ffn.net.2")):
            linear = model.get_submodule(f"blocks.{i}.{composer_name}")
            tensors[f"transformer.blocks.{i}.{diffusers_name}.lora_A.weight"] = (
                torch.randn(4, linear.in_features, generator=g) * 0.2)
            tensors[f"transformer.blocks.{i}.{diffusers_name}.lora_B.weight"] = (
                torch.randn(linear.out_features, 4, generator=g) * 0.2)
    save_file(tensors, str(path))
    return path


def test_unfused_lora_applies_to_both_experts(tmp_path, a14b_dir, a14b_gen):
    lora = _write_lora(tmp_path / "style.safetensors", a14b_gen.pipeline.modules["transformer"], seed=4)
    gen = VideoGenerator.from_pretrained(a14b_dir, dtype="fp32", progress=False, lora_path=[str(lora)])
    assert set(gen.pipeline.denoisers()) == {"transformer", "transformer_2"}
    for name in ("transformer", "transformer_2"):
        assert gen.pipeline.lora_adapters(name).active and not gen.pipeline.lora_adapters(name).fused
    case = dict(A14B_CASES["cfg-two-scales"])
    seed = case.pop("seed")
    ours = gen.generate_video(PROMPT, seed=seed, **case).frames
    pipe = _diffusers(a14b_dir)
    pipe.load_lora_weights(str(lora), adapter_name="high")
    pipe.load_lora_weights(str(lora), adapter_name="low", load_into_transformer_2=True)
    ref = diffusers_frames(pipe, PROMPT, seed, **case)
    assert max_uint8_diff(ours, ref) <= 1
    assert max_uint8_diff(ours, a14b_gen.generate_video(PROMPT, seed=seed, **case).frames) > 1  # the LoRA shows


def test_compile_attention_and_cancel_hooks_cover_both_experts(a14b_dir):
    """The hooks act on every denoiser: compile wraps both experts' blocks (compiled on first use, not run here)."""
    gen = VideoGenerator.from_pretrained(a14b_dir, dtype="fp32", progress=False, compile="regional")
    lines = dict(line.split(": ", 1) for line in gen.pipeline.applied_hooks)
    for hook in ("attention", "compile", "cancel"):
        assert "transformer_2" in lines[hook] and "transformer" in lines[hook].replace("transformer_2", ""), hook
    for expert in gen.pipeline.denoisers().values():  # compile_module sets a compiled forward on each block
        assert all("forward" in vars(block) for block in expert.blocks)


def test_step_cache_and_engines_cover_both_experts(a14b_dir):
    gen = VideoGenerator.from_pretrained(a14b_dir, dtype="fp32", progress=False, cache="teacache")
    line = next(line for line in gen.pipeline.applied_hooks if line.startswith("cache:"))
    assert "transformer (" in line and "transformer_2 (" in line
    assert {id(e.transformer) for e in gen.pipeline.engines} == {id(m) for m in gen.pipeline.denoisers().values()}
    frames = gen.generate_video(PROMPT, seed=1, **{k: v for k, v in A14B_CASES["no-cfg"].items() if k != "seed"})
    assert np.isfinite(frames.frames).all()


def test_presets_load_with_the_family_knobs():
    from pathlib import Path

    from composer.presets import load_preset

    configs = Path(__file__).resolve().parents[1] / "configs"
    a14b = load_preset(configs / "wan2.2-t2v-a14b.yaml")
    assert a14b.model_path == "Wan-AI/Wan2.2-T2V-A14B-Diffusers"
    assert a14b.sampling["guidance_scale_2"] == 3.0 and "flow_shift" not in a14b.sampling
    ti2v = load_preset(configs / "wan2.2-ti2v-5b.yaml")
    assert (ti2v.sampling["width"], ti2v.sampling["height"], ti2v.sampling["num_frames"]) == (1280, 704, 121)


def test_bad_guidance_scale_2_is_refused_before_any_work(a14b_gen, ti2v_gen):
    from composer.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match=r"guidance_scale_2 = -1\.0: expected a finite number >= 0"):
        a14b_gen.generate_video(PROMPT, guidance_scale_2=-1.0, height=32, width=32, num_frames=1)
    with pytest.raises(ConfigError, match="guidance_scale_2 given, but wan2.2-ti2v-5b takes no guidance_scale_2"):
        ti2v_gen.generate_video(PROMPT, guidance_scale_2=2.0, height=32, width=32, num_frames=1)


# -- several processes ----------------------------------------------------------------------------------------
# layout -> (runtime degrees, the folders it runs: both experts under Ulysses, CFG parallel and tensor parallel
# (each rank reads its slices of both experts), TI2V under Ulysses); one set of processes per layout
LAYOUTS = {"ulysses2": (dict(ulysses_degree=2), ("a14b", "ti2v")), "cfg2": (dict(cfg_parallel=True), ("a14b",)),
           "tp2": (dict(tp_size=2), ("a14b",))}


def _request(kind: str) -> dict:
    return dict(A14B_CASES["cfg-two-scales"] if kind == "a14b" else TI2V_CASES["cfg"])


def _parallel_worker(rank, world, folders, runtime, out_dir):
    for kind, folder in folders.items():
        gen = VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False, **runtime)
        frames = gen.generate_video(PROMPT, **_request(kind)).frames
        torch.save(torch.from_numpy(frames), f"{out_dir}/{kind}-rank{rank}.pt")


@pytest.mark.slow  # every layout in the full tier (the quick tier's layouts: test_parallel_*.py)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layouts_equal_one_process(layout, a14b_dir, ti2v_dir, a14b_gen, ti2v_gen, tmp_path):
    from composer.testing.distributed import spawn

    runtime, kinds = LAYOUTS[layout]
    folders = {k: str({"a14b": a14b_dir, "ti2v": ti2v_dir}[k]) for k in kinds}
    spawn(_parallel_worker, 2, folders, runtime, str(tmp_path), timeout_s=600)
    for kind in kinds:
        expected = {"a14b": a14b_gen, "ti2v": ti2v_gen}[kind].generate_video(PROMPT, **_request(kind)).frames
        for rank in range(2):
            got = torch.load(tmp_path / f"{kind}-rank{rank}.pt").numpy()
            assert max_uint8_diff(got, expected) <= 1, f"{layout} {kind} rank {rank}"
