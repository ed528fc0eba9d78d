"""Wan2.1 image-to-video: composer's frames == diffusers' WanImageToVideoPipeline frames on the same tiny folder,
image, prompt and seed (within 1 per pixel), with and without CFG, for an input image of another size and aspect
than the video, for first-last-frame folders, with offload and with LoRA; input images of every accepted type;
and clear errors for bad or missing images, through the API and the CLI."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from conftest import max_uint8_diff
from PIL import Image
from safetensors.torch import save_file

from composer import VideoGenerator
from composer.errors import InvalidInputError
from composer.request_check import RequestError
from composer.testing import build_tiny_wan_i2v

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "a red kite over the sea"
# non-square output; an input image of another size and aspect ratio (the resize path)
REQUEST = dict(negative_prompt="blurry, static", height=48, width=80, num_frames=5, num_inference_steps=3,
               guidance_scale=5.0)
CASES = {
    "cfg-nonsquare-resized": dict(REQUEST, seed=42, image_size=(60, 40)),
    "no-cfg-9-frames-larger-image": dict(REQUEST, negative_prompt=None, guidance_scale=1.0, num_frames=9, seed=7,
                                         height=32, width=32, image_size=(72, 88)),
}


def make_image(width: int, height: int, seed: int = 0) -> Image.Image:
    """A smooth random RGB image (structure that survives resizing), deterministic."""
    g = np.random.default_rng(seed)
    small = (g.random((4, 5, 3)) * 255).astype(np.uint8)
    return Image.fromarray(small).resize((width, height), Image.BILINEAR)




@pytest.fixture(scope="module")
def i2v_dir(tmp_path_factory):
    return build_tiny_wan_i2v(tmp_path_factory.mktemp("models") / "tiny-wan-i2v")


@pytest.fixture(scope="module")
def flf2v_dir(tmp_path_factory):
    return build_tiny_wan_i2v(tmp_path_factory.mktemp("models") / "tiny-wan-flf2v", first_last_frame=True, seed=3)


@pytest.fixture(scope="module")
def gen(i2v_dir):
    return VideoGenerator.from_pretrained(i2v_dir, dtype="fp32", progress=False)


def reference_pipe(folder, dtype=None):
    import diffusers.pipelines.wan.pipeline_wan_i2v as module
    from diffusers import WanImageToVideoPipeline

    if not hasattr(module, "ftfy"):  # diffusers 0.42.1's I2V prompt cleaning calls ftfy even when it is absent;
        module.ftfy = types.SimpleNamespace(fix_text=lambda text: text)  # composer skips it then (ASCII: same)
    # from_pretrained(dtype=) keeps the modules diffusers keeps in fp32 (`.to(dtype)` would not)
    pipe = WanImageToVideoPipeline.from_pretrained(str(folder), **({"dtype": dtype} if dtype else {}))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def ref_pipe(i2v_dir):
    return reference_pipe(i2v_dir)


def reference_frames(pipe, seed, **kwargs) -> np.ndarray:
    kwargs = {k: v for k, v in kwargs.items() if not (k == "negative_prompt" and v is None)}
    out = pipe(prompt=PROMPT, generator=torch.Generator("cpu").manual_seed(seed), output_type="np", **kwargs)
    return (out.frames[0] * 255).round().astype(np.uint8)


@pytest.mark.parametrize("name", list(CASES))
def test_frames_match_diffusers(gen, ref_pipe, name):
    case = dict(CASES[name])
    image = make_image(*case.pop("image_size"))
    seed = case.pop("seed")
    ours = gen.generate_video(PROMPT, image=image, seed=seed, **case)
    ref = reference_frames(ref_pipe, seed, image=image, **case)
    assert ours.frames.shape == (case["num_frames"], case["height"], case["width"], 3)
    assert ours.frames.std() > 1.0, "degenerate video: the comparison would prove nothing"
    assert max_uint8_diff(ours.frames, ref) <= 1


def test_the_image_conditions_the_video(gen):
    """Another input image (same prompt, seed) gives another video: the image reaches the model."""
    request = dict(REQUEST, num_inference_steps=2, seed=1)
    a = gen.generate_video(PROMPT, image=make_image(80, 48, seed=1), **request)
    b = gen.generate_video(PROMPT, image=make_image(80, 48, seed=2), **request)
    assert max_uint8_diff(a.frames, b.frames) > 1


def test_every_image_type_gives_the_same_video(gen, tmp_path):
    """A PIL image, its file, a uint8 numpy array, uint8 [3, H, W] and float [H, W, 3] tensors, RGBA: one video."""
    image = make_image(60, 40)
    array = np.array(image)
    path = tmp_path / "first.png"
    image.save(path)
    request = dict(REQUEST, num_inference_steps=1, guidance_scale=1.0, seed=4)
    expected = gen.generate_video(PROMPT, image=image, **request).frames
    for value in (str(path), path, array, torch.from_numpy(array).permute(2, 0, 1).contiguous(),
                  torch.from_numpy(array).float() / 255.0, image.convert("RGBA")):
        frames = gen.generate_video(PROMPT, image=value, **request).frames
        assert (frames == expected).all(), type(value)


def test_first_last_frame_matches_diffusers(flf2v_dir):
    gen = VideoGenerator.from_pretrained(flf2v_dir, dtype="fp32", progress=False)
    assert gen.family == "wan2.1-i2v-480p"  # the tiny folder's name names no family: the detector's defaults
    first, last = make_image(80, 48, seed=5), make_image(64, 64, seed=6)
    request = dict(REQUEST, num_frames=9)
    ours = gen.generate_video(PROMPT, image=first, last_image=last, seed=3, **request)
    ref = reference_frames(reference_pipe(flf2v_dir), 3, image=first, last_image=last, **request)
    assert max_uint8_diff(ours.frames, ref) <= 1
    # the last image matters
    other = gen.generate_video(PROMPT, image=first, last_image=make_image(64, 64, seed=7), seed=3, **request)
    assert max_uint8_diff(other.frames, ours.frames) > 1


@pytest.mark.parametrize("offload", ["model", "layerwise"])
def test_offload_gives_the_same_video(i2v_dir, gen, offload):
    request = dict(REQUEST, num_inference_steps=2, seed=8)
    image = make_image(60, 40)
    expected = gen.generate_video(PROMPT, image=image, **request).frames
    offloaded = VideoGenerator.from_pretrained(i2v_dir, dtype="fp32", progress=False, offload=offload)
    assert (offloaded.generate_video(PROMPT, image=image, **request).frames == expected).all()


def write_lora(path, transformer, seed=1, rank=4):
    """A LoRA in diffusers / PEFT naming over every attention projection, the FFN and the image k/v projections."""
    g = torch.Generator().manual_seed(seed)
    layers = ["attn1.to_q", "attn1.to_v", "attn2.to_q", "attn2.to_k", "attn2.add_k_proj", "attn2.add_v_proj",
              "ffn.net.0.proj"]
    tensors = {}
    for i, block in enumerate(transformer.blocks):
        for layer in layers:
            linear = block.get_submodule(layer.replace("ffn.net.0.proj", "ffn.fc_in"))
            stem = f"transformer.blocks.{i}.{layer}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, linear.in_features, generator=g) * 0.2
            tensors[f"{stem}.lora_B.weight"] = torch.randn(linear.out_features, rank, generator=g) * 0.2
    save_file(tensors, str(path))
    return path


def test_unfused_lora_matches_diffusers(i2v_dir, gen, ref_pipe, tmp_path):
    lora = write_lora(tmp_path / "lora.safetensors", gen.pipeline.modules["transformer"])
    image = make_image(60, 40)
    request = dict(REQUEST)
    with_lora = VideoGenerator.from_pretrained(i2v_dir, dtype="fp32", progress=False, lora_path=[str(lora)],
                                               lora_fuse=False)
    ours = with_lora.generate_video(PROMPT, image=image, seed=9, **request).frames
    try:
        ref_pipe.load_lora_weights(str(lora), adapter_name="a")
        ref = reference_frames(ref_pipe, 9, image=image, **request)
    finally:
        ref_pipe.unload_lora_weights()
    assert max_uint8_diff(ours, ref) <= 1
    assert max_uint8_diff(ours, gen.generate_video(PROMPT, image=image, seed=9, **request).frames) > 1


# -- errors --------------------------------------------------------------------------------------------------
def test_bad_images_are_clear_errors_before_any_work(gen, tmp_path):
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    (tmp_path / "folder.png").mkdir()
    cases = [
        (str(tmp_path / "missing.png"), "an existing image file (no such file)"),
        (str(corrupt), "a readable image file"),
        (str(tmp_path / "folder.png"), "an image file (this is a folder)"),
        (5, "a PIL image, a numpy array [H, W, 3]"),
        (np.zeros((8, 8), dtype=np.uint8), "an RGB image of shape [H, W, 3]"),
        (np.full((8, 8, 3), 2.0, dtype=np.float32), "float pixels in [0, 1]"),
        (torch.zeros(4, 8, 8), "an RGB image of shape [3, H, W] or [H, W, 3]"),
    ]
    for value, message in cases:
        with pytest.raises(RequestError, match="image") as info:
            gen.generate_video(PROMPT, image=value, **REQUEST)
        assert message in str(info.value), str(info.value)
        assert "\n" not in str(info.value)


def test_missing_image_and_last_image_on_an_i2v_model(gen):
    with pytest.raises(RequestError, match="image: expected an input image, the video's first frame"):
        gen.generate_video(PROMPT, **REQUEST)
    with pytest.raises(RequestError, match="last_image = .*: expected unset: this model conditions on the first"):
        gen.generate_video(PROMPT, image=make_image(8, 8), last_image=make_image(8, 8), **REQUEST)
    # the pipeline's own check, for a request that skips the up-front one
    batch = gen._new_batch(gen.sampling_param(prompt=PROMPT))
    with pytest.raises(InvalidInputError, match="needs an input image"):
        gen.pipeline.prepare(batch, gen.sampling_param(prompt=PROMPT))


def test_an_image_given_to_a_text_to_video_model(composer_gen):
    with pytest.raises(InvalidInputError, match="^image given, but wan2.1-t2v is a text-to-video model and takes no "
                       "input image"):
        composer_gen.generate_video(PROMPT, image=make_image(8, 8), height=32, width=32, num_frames=5)


def test_cli_generates_from_an_image(cli, i2v_dir, gen, tmp_path):
    image = make_image(60, 40)
    image.save(tmp_path / "in.png")
    out = tmp_path / "frames"
    code, stdout, stderr = cli("generate", "--model-path", i2v_dir, "--prompt", PROMPT, "--image", tmp_path / "in.png",
                               "--height", "48", "--width", "80", "--num-frames", "5", "--steps", "2", "--seed", "3",
                               "--negative-prompt", "blurry", "--output", out)
    assert code == 0, stderr
    assert "with wan2.1-i2v-480p" in stdout
    expected = gen.generate_video(PROMPT, image=image, seed=3, negative_prompt="blurry", height=48, width=80,
                                  num_frames=5, num_inference_steps=2).frames
    written = np.stack([np.asarray(Image.open(p)) for p in sorted(out.glob("*.png"))])
    assert (written == expected).all()


def test_cli_image_errors_are_one_line_exit_1(cli, i2v_dir, tiny_wan_dir, tmp_path):
    corrupt = tmp_path / "bad.png"
    corrupt.write_bytes(b"not a png")
    base = ["generate", "--prompt", "x", "--height", "32", "--width", "32", "--num-frames", "5", "--steps", "1"]
    cases = [
        ([*base, "--model-path", i2v_dir], "--image: expected an input image, the video's first frame"),
        ([*base, "--model-path", i2v_dir, "--image", tmp_path / "no.png"],
         f"--image {tmp_path / 'no.png'}: expected an existing image file (no such file)"),
        ([*base, "--model-path", i2v_dir, "--image", corrupt], f"--image {corrupt}: expected a readable image file"),
        ([*base, "--model-path", i2v_dir, "--image", corrupt, "--last-image", corrupt],
         "--last-image"),
        ([*base, "--model-path", tiny_wan_dir, "--image", corrupt],
         "--image given, but wan2.1-t2v is a text-to-video model and takes no input image"),
    ]
    for args, message in cases:
        code, _, stderr = cli(*args)
        assert code == 1, stderr
        assert message in stderr, stderr
        assert "Traceback" not in stderr
        assert len(stderr.strip().splitlines()) == 1 or "invalid request" in stderr, stderr


# -- families, preset, refused folders -------------------------------------------------------------------------
@pytest.mark.parametrize("hub_id, family, size_and_shift", [
    ("Wan-AI/Wan2.1-I2V-14B-480P-Diffusers", "wan2.1-i2v-480p", (480, 832, 3.0)),
    ("Wan-AI/Wan2.1-I2V-14B-720P-Diffusers", "wan2.1-i2v-720p", (720, 1280, 5.0)),
    ("Wan-AI/Wan2.1-FLF2V-14B-720P-Diffusers", "wan2.1-flf2v-720p", (720, 1280, 16.0)),
])
def test_released_ids_get_their_families(hub_id, family, size_and_shift):
    from composer.configs.wan_i2v import WanI2VConfig
    from composer.registry.configs import resolve_configs

    resolved = resolve_configs(hub_id, "WanImageToVideoPipeline", WanI2VConfig)
    sp = resolved.sampling_param()
    assert resolved.family.name == family
    assert (sp.height, sp.width, sp.flow_shift) == size_and_shift
    assert (sp.num_frames, sp.num_inference_steps, sp.guidance_scale, sp.fps) == (81, 50, 5.0, 16)


def test_preset_loads():
    from pathlib import Path

    from composer.presets import load_preset

    preset = load_preset(Path(__file__).parents[1] / "configs" / "wan2.1-i2v-14b-480p.yaml")
    assert preset.model_path == "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers"
    assert (preset.sampling["height"], preset.sampling["width"], preset.sampling["num_frames"]) == (480, 832, 81)


def test_wan22_and_incomplete_i2v_folders_are_refused_before_loading(i2v_dir, tmp_path):
    """boundary_ratio makes a folder Wan2.2 I2V A14B (composer/pipelines/wan22_i2v.py), which needs transformer_2;
    a Wan2.1 I2V folder without its CLIP image encoder is refused."""
    import json
    import shutil

    from composer.errors import ConfigError, UnsupportedError

    for name, change, error, message in (
        ("wan22", {"boundary_ratio": 0.9}, ConfigError, "no transformer_2"),
        ("no-clip", {"image_encoder": [None, None]}, UnsupportedError, "image_encoder"),
    ):
        folder = shutil.copytree(i2v_dir, tmp_path / name)
        index = json.loads((folder / "model_index.json").read_text())
        index.update(change)
        if name == "no-clip":
            del index["image_encoder"]
        (folder / "model_index.json").write_text(json.dumps(index))
        with pytest.raises(error, match=message):
            VideoGenerator.from_pretrained(folder, progress=False)


@pytest.mark.slow  # a cold compile (tests/test_family_compile.py has every family in the full tier)
def test_regional_compile_equals_eager(i2v_dir, gen):
    request = dict(REQUEST, num_inference_steps=2, seed=12)
    image = make_image(60, 40)
    eager = gen.generate_video(PROMPT, image=image, **request)
    compiled = VideoGenerator.from_pretrained(i2v_dir, dtype="fp32", progress=False, compile="regional")
    result = compiled.generate_video(PROMPT, image=image, **request)
    assert float((result.latents - eager.latents).abs().max()) <= 1e-4
    assert max_uint8_diff(result.frames, eager.frames) <= 1


def test_bf16_everywhere_matches_diffusers_bf16(i2v_dir):
    """Every component in bf16 (transformer, UMT5 and CLIP encoders, VAE) against diffusers loaded with
    torch_dtype=bf16: the dtype plumbing (CLIP pixels, image states, the condition concatenated in the model's
    dtype, the VAE encode) follows the reference."""
    gen = VideoGenerator.from_pretrained(i2v_dir, dtype="bf16", text_encoder_dtype="bf16", vae_dtype="bf16",
                                         progress=False)
    modules = gen.pipeline.modules
    assert {modules[n].dtype for n in ("transformer", "text_encoder", "image_encoder", "vae")} == {torch.bfloat16}
    image = make_image(60, 40)
    request = dict(REQUEST, num_inference_steps=2)
    ours = gen.generate_video(PROMPT, image=image, seed=13, **request)
    pipe = reference_pipe(i2v_dir, torch.bfloat16)
    assert max_uint8_diff(ours.frames, reference_frames(pipe, 13, image=image, **request)) <= 1


def test_a_batch_of_videos_shares_the_image_and_keeps_each_rows_seed(gen):
    """num_videos_per_prompt = 2: video i is the video a single request with seed + i makes (the image and its
    condition go to every row)."""
    image = make_image(60, 40)
    request = dict(REQUEST, num_inference_steps=2)
    videos = gen.generate_video(PROMPT, image=image, seed=5, num_videos_per_prompt=2, **request)
    for i, video in enumerate(videos):
        single = gen.generate_video(PROMPT, image=image, seed=5 + i, **request)
        assert video.seed == 5 + i and max_uint8_diff(video.frames, single.frames) <= 1
    assert max_uint8_diff(videos[0].frames, videos[1].frames) > 1
