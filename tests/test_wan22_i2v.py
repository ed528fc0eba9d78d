"""Wan2.2 image-to-video: the two-expert I2V A14B layout and TI2V-5B's image mode against diffusers'
WanImageToVideoPipeline on tiny folders (frames within 1 uint8 for the same image, prompt and seed, with and without
CFG, non-square), the expert switch step, the first frame's timestep 0 and clean latents, routing of
WanImageToVideoPipeline folders, image errors, and the hooks on two conditioned experts (offload, LoRA)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import max_uint8_diff
from test_wan22 import _record_calls, _write_lora
from test_wan_i2v import make_image, reference_frames, reference_pipe

from composer import VideoGenerator
from composer.errors import ConfigError, InvalidInputError
from composer.generator import resolve_model
from composer.request_check import RequestError
from composer.testing import (
    build_tiny_wan22_a14b,
    build_tiny_wan22_i2v_a14b,
    build_tiny_wan_i2v,
)

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "a red kite over the sea"
# non-square videos from an image of another size and aspect ratio (the resize path). 5 UniPC steps at the tiny
# folders' shift 5.0: [999, 952, 882, 769, 556]; with boundary_ratio 0.9 (t >= 900) the high-noise expert takes 2
I2V_CASES = {
    "cfg-two-scales": dict(negative_prompt="blurry", guidance_scale=4.0, guidance_scale_2=2.5, height=32, width=48,
                           num_frames=5, num_inference_steps=5, seed=11, image_size=(60, 40)),
    "no-cfg": dict(negative_prompt=None, guidance_scale=1.0, height=48, width=32, num_frames=9,
                   num_inference_steps=4, seed=2**40 + 1, image_size=(72, 88)),
}
# TI2V sizes are multiples of 32 (16x VAE x patch 2)
TI2V_CASES = {
    "cfg": dict(negative_prompt="blurry", guidance_scale=5.0, height=64, width=96, num_frames=5,
                num_inference_steps=4, seed=5, image_size=(60, 40)),
    "no-cfg": dict(negative_prompt=None, guidance_scale=1.0, height=96, width=64, num_frames=9,
                   num_inference_steps=3, seed=123, image_size=(50, 90)),
}


@pytest.fixture(scope="module")
def i2v_dir(tmp_path_factory):
    return build_tiny_wan22_i2v_a14b(tmp_path_factory.mktemp("models") / "tiny-wan22-i2v-a14b")


@pytest.fixture(scope="module")
def i2v_gen(i2v_dir):
    return VideoGenerator.from_pretrained(i2v_dir, dtype="fp32", progress=False)


@pytest.fixture(scope="module")
def ti2v_gen(ti2v_dir):
    return VideoGenerator.from_pretrained(ti2v_dir, dtype="fp32", progress=False)


@pytest.fixture(scope="module")
def i2v_ref(i2v_dir):
    return reference_pipe(i2v_dir)


@pytest.fixture(scope="module")
def ti2v_ref(ti2v_dir):
    # diffusers users run TI2V's image mode with WanImageToVideoPipeline on the WanPipeline folder (model card)
    return reference_pipe(ti2v_dir)


def _split(case: dict) -> tuple[int, object, dict]:
    case = dict(case)
    seed, size = case.pop("seed"), case.pop("image_size")
    return seed, make_image(*size, seed=seed % 1000), case


def _run_both(gen, pipe, case):
    seed, image, request = _split(case)
    ours = gen.generate_video(PROMPT, image=image, seed=seed, **request)
    return ours, reference_frames(pipe, seed, image=image, **request)


# -- I2V A14B --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(I2V_CASES))
def test_i2v_a14b_frames_match_diffusers(i2v_gen, i2v_ref, name):
    ours, ref = _run_both(i2v_gen, i2v_ref, I2V_CASES[name])
    case = I2V_CASES[name]
    assert ours.frames.shape == (case["num_frames"], case["height"], case["width"], 3)
    assert ours.frames.std() > 1.0, "degenerate video: the comparison would prove nothing"
    assert max_uint8_diff(ours.frames, ref) <= 1


def test_i2v_a14b_switches_expert_at_the_step_diffusers_does(i2v_gen, i2v_ref):
    seed, image, request = _split(I2V_CASES["cfg-two-scales"])
    ours_log, ref_log = [], []
    handles = _record_calls({n: i2v_gen.pipeline.modules[n] for n in ("transformer", "transformer_2")}, ours_log)
    handles += _record_calls({"transformer": i2v_ref.transformer, "transformer_2": i2v_ref.transformer_2}, ref_log)
    try:
        i2v_gen.generate_video(PROMPT, image=image, seed=seed, **request)
        reference_frames(i2v_ref, seed, image=image, **request)
    finally:
        for handle in handles:
            handle.remove()
    assert ours_log == ref_log[::2]  # composer batches the CFG branches: one call a step, diffusers two
    assert [name for name, _ in ours_log] == ["transformer"] * 2 + ["transformer_2"] * 3
    assert i2v_gen.pipeline.boundary_timestep() == 900.0  # the folder's boundary_ratio 0.9


def test_the_image_conditions_both_experts(i2v_gen):
    seed, image, request = _split(I2V_CASES["cfg-two-scales"])
    first = i2v_gen.generate_video(PROMPT, image=image, seed=seed, **request).frames
    other = i2v_gen.generate_video(PROMPT, image=make_image(60, 40, seed=99), seed=seed, **request).frames
    assert max_uint8_diff(first, other) > 1


def test_i2v_a14b_family_defaults_and_routing(i2v_dir, i2v_gen, tmp_path):
    sp = i2v_gen.default_sampling
    assert i2v_gen.family == "wan2.2-i2v-a14b"
    assert type(i2v_gen.pipeline).__name__ == "Wan22I2VA14BPipeline"
    assert (sp.width, sp.height, sp.num_frames, sp.num_inference_steps, sp.guidance_scale, sp.guidance_scale_2,
            sp.fps) == (1280, 720, 81, 40, 3.5, 3.5, 16)
    assert sp.flow_shift == 5.0  # the tiny folder's scheduler states 5.0 (as the release's does)
    assert "image_encoder" not in i2v_gen.pipeline.modules
    # WanImageToVideoPipeline folders: Wan2.1 I2V stays Wan2.1's; Wan2.2 entries pick the Wan2.2 pipelines
    wan21 = resolve_model(str(build_tiny_wan_i2v(tmp_path / "wan21-i2v")))
    assert (wan21.configs.family.name, wan21.pipeline_cls.__name__) == ("wan2.1-i2v-480p", "WanImageToVideoPipeline")
    resolved = resolve_model(str(i2v_dir))
    assert (resolved.configs.family.name, resolved.configs.matched_by) == ("wan2.2-i2v-a14b", "detector")
    # the released hub id names its family
    from composer.configs.wan22 import Wan22I2VA14BConfig
    from composer.registry.configs import resolve_configs

    by_id = resolve_configs("Wan-AI/Wan2.2-I2V-A14B-Diffusers", "WanImageToVideoPipeline", Wan22I2VA14BConfig)
    assert by_id.family.name == "wan2.2-i2v-a14b"
    # a Wan2.2 I2V family forced on a Wan2.1 I2V folder does not fit its pipeline
    with pytest.raises(ConfigError, match="does not fit"):
        resolve_model(str(tmp_path / "wan21-i2v"), "wan2.2-i2v-a14b")


def test_i2v_a14b_image_errors(i2v_gen):
    request = dict(height=32, width=48, num_frames=5, num_inference_steps=1)
    with pytest.raises(RequestError, match="image: expected an input image, the video's first frame"):
        i2v_gen.generate_video(PROMPT, **request)
    with pytest.raises(InvalidInputError, match="^last_image given, but wan2.2-i2v-a14b conditions on the first "
                       "frame"):
        i2v_gen.generate_video(PROMPT, image=make_image(8, 8), last_image=make_image(8, 8), **request)
    batch = i2v_gen._new_batch(i2v_gen.sampling_param(prompt=PROMPT))
    with pytest.raises(InvalidInputError, match="needs an input image"):  # the pipeline's own check
        i2v_gen.pipeline.prepare(batch, i2v_gen.sampling_param(prompt=PROMPT))


def test_an_image_given_to_wan22_t2v_a14b_is_refused(tmp_path):
    gen = VideoGenerator.from_pretrained(build_tiny_wan22_a14b(tmp_path / "t2v"), dtype="fp32", progress=False)
    with pytest.raises(InvalidInputError, match="^image given, but wan2.2-t2v-a14b is a text-to-video model"):
        gen.generate_video(PROMPT, image=make_image(8, 8), height=32, width=32, num_frames=5)


def test_cli_generates_from_an_image_and_refuses_none(cli, i2v_dir, i2v_gen, tmp_path):
    import numpy as np
    from PIL import Image

    image = make_image(60, 40)
    image.save(tmp_path / "in.png")
    args = ["generate", "--model-path", i2v_dir, "--prompt", PROMPT, "--height", "32", "--width", "48",
            "--num-frames", "5", "--steps", "2", "--seed", "3", "--negative-prompt", "blurry"]
    code, stdout, stderr = cli(*args, "--image", tmp_path / "in.png", "--output", tmp_path / "frames")
    assert code == 0, stderr
    assert "with wan2.2-i2v-a14b" in stdout
    expected = i2v_gen.generate_video(PROMPT, image=image, seed=3, negative_prompt="blurry", height=32, width=48,
                                      num_frames=5, num_inference_steps=2).frames
    written = np.stack([np.asarray(Image.open(p)) for p in sorted((tmp_path / "frames").glob("*.png"))])
    assert (written == expected).all()
    code, _, stderr = cli(*args, "--output", tmp_path / "none.mp4")
    assert code == 1 and "--image: expected an input image, the video's first frame" in stderr
    assert "Traceback" not in stderr


def test_i2v_folder_with_experts_of_the_wrong_width_is_a_config_error(tmp_path, i2v_dir):
    folder = shutil.copytree(i2v_dir, tmp_path / "bad")
    index = json.loads((folder / "model_index.json").read_text())
    del index["transformer_2"]
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="no transformer_2"):
        VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False)


# -- hooks on two conditioned experts --------------------------------------------------------------------------
def test_model_offload_keeps_only_the_running_expert_on_the_device(i2v_dir, i2v_gen):
    seed, image, request = _split(I2V_CASES["cfg-two-scales"])
    expected = i2v_gen.generate_video(PROMPT, image=image, seed=seed, **request).frames
    gen = VideoGenerator.from_pretrained(i2v_dir, dtype="fp32", progress=False, offload="model")
    offload = next(h for h in gen.pipeline.hooks if h.name == "offload").models
    experts = {n: gen.pipeline.modules[n] for n in ("transformer", "transformer_2")}
    seen = []

    def check(name):
        def hook(module, args):
            seen.append((name, {n: offload.is_on_device(m) for n, m in experts.items()}))
        return hook

    handles = [m.register_forward_pre_hook(check(n)) for n, m in experts.items()]
    try:
        frames = gen.generate_video(PROMPT, image=image, seed=seed, **request).frames
    finally:
        for handle in handles:
            handle.remove()
    assert (frames == expected).all()
    assert [n for n, _ in seen] == ["transformer"] * 2 + ["transformer_2"] * 3
    for name, on_device in seen:  # the running expert, and only it
        assert on_device == {n: n == name for n in experts}
    assert not any(offload.is_on_device(m) for m in experts.values())


def test_unfused_lora_applies_to_both_conditioned_experts(tmp_path, i2v_dir, i2v_gen):
    lora = _write_lora(tmp_path / "style.safetensors", i2v_gen.pipeline.modules["transformer"], seed=4)
    gen = VideoGenerator.from_pretrained(i2v_dir, dtype="fp32", progress=False, lora_path=[str(lora)])
    for name in ("transformer", "transformer_2"):
        assert gen.pipeline.lora_adapters(name).active and not gen.pipeline.lora_adapters(name).fused
    seed, image, request = _split(I2V_CASES["cfg-two-scales"])
    ours = gen.generate_video(PROMPT, image=image, seed=seed, **request).frames
    pipe = reference_pipe(i2v_dir)
    pipe.load_lora_weights(str(lora), adapter_name="high")
    pipe.load_lora_weights(str(lora), adapter_name="low", load_into_transformer_2=True)
    assert max_uint8_diff(ours, reference_frames(pipe, seed, image=image, **request)) <= 1
    plain = i2v_gen.generate_video(PROMPT, image=image, seed=seed, **request).frames
    assert max_uint8_diff(ours, plain) > 1  # the LoRA shows


# -- TI2V-5B image mode ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(TI2V_CASES))
def test_ti2v_image_mode_frames_match_diffusers(ti2v_gen, ti2v_ref, name):
    ours, ref = _run_both(ti2v_gen, ti2v_ref, TI2V_CASES[name])
    case = TI2V_CASES[name]
    assert ours.frames.shape == (case["num_frames"], case["height"], case["width"], 3)
    assert ours.frames.std() > 1.0
    assert max_uint8_diff(ours.frames, ref) <= 1


def test_ti2v_image_mode_keeps_the_first_latent_frame_at_timestep_0(ti2v_gen, ti2v_ref):
    """The model sees timestep 0 on the first latent frame and t on the others, and the first latent frame is the
    encoded image, as diffusers' prepare_latents makes it; the per-token layout gives the same video."""
    seed, image, request = _split(TI2V_CASES["cfg"])
    log = []
    model = ti2v_gen.pipeline.modules["transformer"]
    handle = model.register_forward_pre_hook(lambda m, args, kwargs: log.append(args[1].clone()), with_kwargs=True)
    stage = ti2v_gen.pipeline.stage("TokenTimestepDenoisingStage")
    try:
        ours = ti2v_gen.generate_video(PROMPT, image=image, seed=seed, **request)
        stage.exact_layout = False
        per_token = ti2v_gen.generate_video(PROMPT, image=image, seed=seed, **request).frames
    finally:
        stage.exact_layout = True
        handle.remove()
    steps = request["num_inference_steps"]
    for timestep in log[:steps]:  # [2 CFG rows, 2 latent frames]
        assert timestep.shape == (2, 2) and (timestep[:, 0] == 0).all() and (timestep[:, 1] > 0).all()
    assert all(t.shape == (2, 2 * 2 * 3) and (t[:, :6] == 0).all() for t in log[steps:])  # per token
    assert max_uint8_diff(ours.frames, per_token) <= 1
    # the final latents' first frame is the image's latents, diffusers' condition
    pixels = ti2v_ref.video_processor.preprocess(image, height=request["height"], width=request["width"])
    _, condition, mask = ti2v_ref.prepare_latents(pixels, 1, 48, request["height"], request["width"],
                                                  request["num_frames"], torch.float32, torch.device("cpu"),
                                                  torch.Generator("cpu").manual_seed(seed))
    assert mask[0, 0, :, 0, 0].tolist() == [0.0, 1.0]
    assert torch.equal(ours.latents[:, :, :1], condition)


def test_ti2v_takes_text_or_image(ti2v_gen):
    seed, image, request = _split(TI2V_CASES["cfg"])
    text = ti2v_gen.generate_video(PROMPT, seed=seed, **request).frames
    with_image = ti2v_gen.generate_video(PROMPT, image=image, seed=seed, **request).frames
    assert max_uint8_diff(text, with_image) > 1
    again = ti2v_gen.generate_video(PROMPT, seed=seed, **request).frames  # no image state left behind
    assert (again == text).all()
    with pytest.raises(InvalidInputError, match="^last_image given, but wan2.2-ti2v-5b conditions on the first"):
        ti2v_gen.generate_video(PROMPT, image=image, last_image=image, **request)


def test_a_batch_of_image_videos_keeps_each_rows_seed(ti2v_gen, i2v_gen):
    """num_videos_per_prompt = 2: video i is what a single request with seed + i makes (the image, its latents and
    the timestep mask go to every row)."""
    for gen, case in ((ti2v_gen, TI2V_CASES["cfg"]), (i2v_gen, I2V_CASES["cfg-two-scales"])):
        seed, image, request = _split(dict(case, num_inference_steps=2))
        videos = gen.generate_video(PROMPT, image=image, seed=seed, num_videos_per_prompt=2, **request)
        for i, video in enumerate(videos):
            single = gen.generate_video(PROMPT, image=image, seed=seed + i, **request)
            assert video.seed == seed + i and max_uint8_diff(video.frames, single.frames) <= 1
        assert max_uint8_diff(videos[0].frames, videos[1].frames) > 1


def test_ti2v_folder_saved_by_the_i2v_pipeline_routes_to_ti2v(ti2v_ref, ti2v_gen, tmp_path):
    """A TI2V folder written by diffusers' WanImageToVideoPipeline names that class: the same TI2V pipeline."""
    ti2v_ref.save_pretrained(str(tmp_path / "saved"))
    assert json.loads((tmp_path / "saved" / "model_index.json").read_text())["_class_name"] == (
        "WanImageToVideoPipeline")
    resolved = resolve_model(str(tmp_path / "saved"))
    assert (resolved.configs.family.name, resolved.pipeline_cls.__name__) == ("wan2.2-ti2v-5b", "Wan22TI2VPipeline")
    gen = VideoGenerator.from_pretrained(tmp_path / "saved", dtype="fp32", progress=False)
    seed, image, request = _split(TI2V_CASES["no-cfg"])
    expected = ti2v_gen.generate_video(PROMPT, image=image, seed=seed, **request).frames
    assert (gen.generate_video(PROMPT, image=image, seed=seed, **request).frames == expected).all()


@pytest.mark.parametrize("layout", ["i2v-a14b", "ti2v"])
def test_bf16_everywhere_matches_diffusers_bf16(layout, i2v_dir, ti2v_dir):
    """Every component in bf16 against diffusers loaded with torch_dtype=bf16: the image's VAE encode, the condition
    (channel axis or first latent frame) and the model inputs in the model's dtype follow the reference."""
    folder, case = (i2v_dir, I2V_CASES["cfg-two-scales"]) if layout == "i2v-a14b" else (ti2v_dir, TI2V_CASES["cfg"])
    gen = VideoGenerator.from_pretrained(folder, dtype="bf16", text_encoder_dtype="bf16", vae_dtype="bf16",
                                         progress=False)
    assert {m.dtype for n, m in gen.pipeline.modules.items() if n in ("transformer", "vae")} == {torch.bfloat16}
    seed, image, request = _split(dict(case, num_inference_steps=3))
    ours = gen.generate_video(PROMPT, image=image, seed=seed, **request).frames
    ref = reference_frames(reference_pipe(folder, torch.bfloat16), seed, image=image, **request)
    assert max_uint8_diff(ours, ref) <= 1


def test_preset_loads():
    from pathlib import Path

    from composer.presets import load_preset

    preset = load_preset(Path(__file__).parents[1] / "configs" / "wan2.2-i2v-a14b.yaml")
    assert preset.model_path == "Wan-AI/Wan2.2-I2V-A14B-Diffusers"
    s = preset.sampling
    assert (s["height"], s["width"], s["num_frames"], s["num_inference_steps"]) == (720, 1280, 81, 40)
    assert s["guidance_scale"] == s["guidance_scale_2"] == 3.5 and "flow_shift" not in s
