"""SkyReels-V2 diffusion forcing (diffusers' SkyReelsV2DiffusionForcingPipeline folders): the DiT and the frames equal
diffusers' on a tiny folder saved by diffusers' own classes (non-square, with and without CFG, synchronous and
asynchronous, causal blocks, long videos in windows with a re-noised overlap), for text-, image- (with a last frame)
and video-to-video (a folder saved by diffusers' video-to-video class); the schedule equals diffusers'
`generate_timestep_matrix`; the family's knobs and inputs are refused before any work with the field named; LoRA,
layerwise offload, Ulysses on 2 gloo ranks and two requests through the step scheduler equal their references."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from conftest import max_uint8_diff
from helpers import generate_at_once

from composer import VideoGenerator
from composer.errors import InvalidInputError, UnsupportedError
from composer.testing.tiny_skyreels import build_tiny_skyreels_df

pytestmark = pytest.mark.usefixtures("one_thread")

# 48 x 80 pixels: 6 x 10 latents, 3 x 5 = 15 tokens a frame (divides by no Ulysses degree)
REQUEST = dict(prompt="a red ball moves left", negative_prompt="blurry", height=48, width=80, num_inference_steps=4,
               guidance_scale=5.0, seed=3)
CASES = {
    "sync-cfg": dict(num_frames=9, ar_step=0, causal_block_size=1),
    "long-async-addnoise": dict(num_frames=33, base_num_frames=17, overlap_history=5, addnoise_condition=20,
                                ar_step=1, causal_block_size=1),
    "async-no-cfg": dict(num_frames=17, ar_step=2, causal_block_size=1, guidance_scale=1.0, negative_prompt=None),
    "async-causal-blocks": dict(num_frames=17, base_num_frames=17, ar_step=1, causal_block_size=5),
    "long-sync-clean-overlap": dict(num_frames=37, base_num_frames=17, overlap_history=9, ar_step=0,
                                    causal_block_size=1),
    # the overlap (3 latent frames) cut to whole blocks of 2; fps 16: the model's other frame-rate class
    "long-causal-cut-overlap": dict(num_frames=45, base_num_frames=21, overlap_history=9, addnoise_condition=20,
                                    ar_step=2, causal_block_size=2, fps=16),
}
QUICK = {"sync-cfg", "long-async-addnoise"}
# image-to-video (diffusers' SkyReelsV2DiffusionForcingImageToVideoPipeline on the same folder): the image's latent
# frame is the first window's prefix (held with blocks of 1; stepped with its block otherwise, as diffusers does)
IMAGE_CASES = {
    "i2v-sync-cfg": dict(num_frames=9, ar_step=0, causal_block_size=1),
    "i2v-async-causal-addnoise": dict(num_frames=17, base_num_frames=17, ar_step=2, causal_block_size=5,
                                      addnoise_condition=20),
    # (diffusers' image-to-video pipeline fails on a last window shorter than base_num_frames: 29 frames fill two)
    "i2v-long": dict(num_frames=29, base_num_frames=17, overlap_history=5, addnoise_condition=20, ar_step=1,
                     causal_block_size=1),
}
QUICK_IMAGE = {"i2v-sync-cfg"}
# image-to-video with a last frame (diffusers' `last_image`: fed clean after the last window's frames, dropped);
# diffusers runs a long video with one only when the overlap is one latent frame (overlap_history 1 to 4)
LAST_IMAGE_CASES = {
    "last-sync-cfg": dict(num_frames=9, ar_step=0, causal_block_size=1),
    "last-async-addnoise-no-cfg": dict(num_frames=17, ar_step=2, causal_block_size=1, addnoise_condition=20,
                                       guidance_scale=1.0, negative_prompt=None),
    "last-long": dict(num_frames=33, base_num_frames=17, overlap_history=1, addnoise_condition=20, ar_step=1,
                      causal_block_size=1),
}
QUICK_LAST_IMAGE = {"last-sync-cfg"}
# video-to-video (diffusers' SkyReelsV2DiffusionForcingVideoToVideoPipeline): the video's last overlap_history frames
# start the new ones; the video has 11 frames (no 4k + 1 rule)
VIDEO_CASES = {
    "v2v-sync-cfg": dict(num_frames=17, overlap_history=5, ar_step=0, causal_block_size=1),
    "v2v-long-async-addnoise-no-cfg": dict(num_frames=33, base_num_frames=17, overlap_history=5, addnoise_condition=20,
                                           ar_step=1, causal_block_size=1, guidance_scale=1.0, negative_prompt=None),
    # the video's overlap (3 latent frames) and each window's cut to blocks of 2; fps 16
    "v2v-long-causal-cut-overlap": dict(num_frames=37, base_num_frames=21, overlap_history=9, ar_step=2,
                                        causal_block_size=2, fps=16),
}
QUICK_VIDEO = {"v2v-sync-cfg"}


def input_image():
    """A smooth seeded RGB image of another size than the video (the resize path)."""
    import PIL.Image

    small = (np.random.default_rng(0).random((4, 5, 3)) * 255).astype(np.uint8)
    return PIL.Image.fromarray(small).resize((60, 40), PIL.Image.BILINEAR)


def input_video(count: int = 11) -> list:
    """A moving seeded pattern of another size than the video (the resize path)."""
    import PIL.Image

    base = np.random.default_rng(1).integers(0, 255, (40, 70, 3)).astype(np.uint8)
    return [PIL.Image.fromarray(np.roll(base, i * 3, axis=1)) for i in range(count)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_skyreels_df(tmp_path_factory.mktemp("models") / "tiny-skyreels-df")


@pytest.fixture(scope="module")
def v2v_folder(tmp_path_factory):
    """A folder saved by diffusers' video-to-video class (its `_class_name`; the same weights as `folder`)."""
    return build_tiny_skyreels_df(tmp_path_factory.mktemp("models") / "tiny-skyreels-df-v2v",
                                  pipeline="SkyReelsV2DiffusionForcingVideoToVideoPipeline")


@pytest.fixture(scope="module")
def v2v_gen(v2v_folder):
    return VideoGenerator.from_pretrained(v2v_folder, dtype="fp32", progress=False)


@pytest.fixture(scope="module")
def reference_video_pipe(v2v_folder):
    import diffusers.pipelines.skyreels_v2.pipeline_skyreels_v2_diffusion_forcing_v2v as module
    from diffusers import SkyReelsV2DiffusionForcingVideoToVideoPipeline

    _patched_ftfy(module)
    pipe = SkyReelsV2DiffusionForcingVideoToVideoPipeline.from_pretrained(str(v2v_folder))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def gen(folder):
    return VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False)


@pytest.fixture(scope="module")
def reference_pipe(folder):
    import diffusers.pipelines.skyreels_v2.pipeline_skyreels_v2_diffusion_forcing as module
    from diffusers import SkyReelsV2DiffusionForcingPipeline

    _patched_ftfy(module)
    pipe = SkyReelsV2DiffusionForcingPipeline.from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _patched_ftfy(module) -> None:
    if not hasattr(module, "ftfy"):  # diffusers 0.42.1 calls ftfy even when it is absent; composer skips it then
        module.ftfy = types.SimpleNamespace(fix_text=lambda text: text)


@pytest.fixture(scope="module")
def reference_image_pipe(folder):
    import diffusers.pipelines.skyreels_v2.pipeline_skyreels_v2_diffusion_forcing_i2v as module
    from diffusers import SkyReelsV2DiffusionForcingImageToVideoPipeline

    _patched_ftfy(module)
    pipe = SkyReelsV2DiffusionForcingImageToVideoPipeline.from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def reference(pipe, request: dict) -> np.ndarray:
    """diffusers' frames; its re-noised overlap comes from torch's global generator: seeded as composer seeds its
    own (the request's seed). `causal_block_size` is always given: diffusers writes it into the transformer's
    config, where it would stay for the next call."""
    request = dict(request)
    prompt, seed = request.pop("prompt"), request.pop("seed")
    torch.manual_seed(seed)
    out = pipe(prompt=prompt, generator=torch.Generator("cpu").manual_seed(seed), output_type="np", **request).frames[0]
    return (out * 255).round().astype(np.uint8)


def test_dit_matches_diffusers(folder):
    """Per-frame timesteps, the fps embedding and block-causal attention: composer's DiT equals diffusers' in fp32."""
    from diffusers import SkyReelsV2Transformer3DModel

    from composer.loader.components import ComponentLoader
    from composer.loader.model_index import read_model_index
    from composer.models.wan.causal import block_causal_mask

    spec = read_model_index(folder).component("transformer")
    ours = ComponentLoader.for_spec(spec, folder / "transformer").load(folder / "transformer", spec,
                                                                       torch.device("cpu"), torch.float32)
    ref = SkyReelsV2Transformer3DModel.from_pretrained(folder / "transformer").eval()
    g = torch.Generator().manual_seed(0)
    x, text = torch.randn(1, 16, 4, 6, 10, generator=g), torch.randn(1, 512, 32, generator=g)
    t = torch.tensor([[999, 700, 300, 0]])
    with torch.no_grad():
        for fps, block in ((1, 1), (0, 2)):
            ref._set_ar_attention(block)
            mask = None if block == 1 else block_causal_mask([(0, 2), (2, 4)], 15)
            got = ours(x, t, text, fps=torch.tensor([fps]), attn_mask=mask)
            expected = ref(x, t, text, enable_diffusion_forcing=True, fps=[fps], return_dict=False)[0]
            assert (got - expected).abs().max().item() <= 1e-5
    with pytest.raises(InvalidInputError, match="embeds the video's frame rate: pass fps"):
        ours(x, t, text)


@pytest.mark.parametrize("name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def test_pipeline_matches_diffusers(gen, reference_pipe, name):
    request = {**REQUEST, **CASES[name]}
    ours = gen.generate_video(**request)
    assert ours.frames.shape == (request["num_frames"], 48, 80, 3)
    assert max_uint8_diff(ours.frames, reference(reference_pipe, request)) <= 1


@pytest.mark.parametrize("name", [n if n in QUICK_IMAGE else pytest.param(n, marks=pytest.mark.slow)
                                  for n in IMAGE_CASES])
def test_image_to_video_matches_diffusers(gen, reference_image_pipe, name):
    request = {**REQUEST, **IMAGE_CASES[name]}
    ours = gen.generate_video(image=input_image(), **request)
    assert ours.frames.shape == (request["num_frames"], 48, 80, 3)
    assert max_uint8_diff(ours.frames, reference(reference_image_pipe, {**request, "image": input_image()})) <= 1
    # the image matters: text-to-video from the same seed is another video
    assert max_uint8_diff(ours.frames, gen.generate_video(**request).frames) > 1


@pytest.mark.parametrize("name", [n if n in QUICK_VIDEO else pytest.param(n, marks=pytest.mark.slow)
                                  for n in VIDEO_CASES])
def test_video_to_video_matches_diffusers(v2v_gen, reference_video_pipe, name):
    """The result is the input video (resized) followed by num_frames new frames, as diffusers returns it."""
    request = {**REQUEST, **VIDEO_CASES[name]}
    ours = v2v_gen.generate_video(video=input_video(), **request)
    assert ours.frames.shape == (11 + request["num_frames"], 48, 80, 3)
    assert max_uint8_diff(ours.frames, reference(reference_video_pipe, {**request, "video": input_video()})) <= 1
    # the video matters: text-to-video from the same seed is another video
    made = v2v_gen.generate_video(**{**request, "overlap_history": None, "base_num_frames": request["num_frames"]})
    assert max_uint8_diff(ours.frames[11:], made.frames) > 1


@pytest.mark.parametrize("name", [n if n in QUICK_LAST_IMAGE else pytest.param(n, marks=pytest.mark.slow)
                                  for n in LAST_IMAGE_CASES])
def test_last_image_matches_diffusers(gen, reference_image_pipe, name):
    request = {**REQUEST, **LAST_IMAGE_CASES[name]}
    last = input_image().transpose(0)  # (mirrored: another image)
    ours = gen.generate_video(image=input_image(), last_image=last, **request)
    assert ours.frames.shape == (request["num_frames"], 48, 80, 3)
    expected = reference(reference_image_pipe, {**request, "image": input_image(), "last_image": last})
    assert max_uint8_diff(ours.frames, expected) <= 1
    # the last frame matters: the latents differ from image-to-video's without it
    assert (ours.latents - gen.generate_video(image=input_image(), **request).latents).abs().max() > 1e-3


def test_bad_inputs_are_refused_before_any_work(gen, v2v_folder, tmp_path):
    """Video-to-video and the last frame: which inputs go together, and what the video must give the overlap."""
    def refused(match, **knobs):
        with pytest.raises(InvalidInputError, match=match):
            gen.generate_video(**{**REQUEST, "num_frames": 17, "causal_block_size": 1, **knobs})

    video = input_video()
    refused(r"overlap_history: expected a number of frames when a video is given", video=video)
    refused(r"video = '/nonexistent/in.mp4': expected a readable video", video="/nonexistent/in.mp4")
    refused(r"image: expected unset when a video is given", video=video, overlap_history=5, image=input_image())
    refused(r"last_image: expected unset when a video is given", video=video, overlap_history=5,
            last_image=input_image())
    refused(r"last_image: expected an image too", last_image=input_image())
    refused(r"last_image: expected causal_block_size = 1 with a last frame \(it is 5\)", image=input_image(),
            last_image=input_image(), causal_block_size=5)
    refused(r"overlap_history = 17: expected fewer frames than base_num_frames \(17\)", video=video,
            overlap_history=17, num_frames=33, base_num_frames=17)
    refused(r"num_frames = 5: expected more frames than overlap_history \(5\).*\(nearest valid: 9\)", video=video,
            overlap_history=5, num_frames=5)
    refused(r"video frames = 3: expected at least 5 frames: .*causal_block_size = 2.*condition nothing",
            video=input_video(3), overlap_history=9, causal_block_size=2, num_frames=21, base_num_frames=21)
    # before the model loads: the CLI's check reads the folder's JSON and the video
    from composer.request_check import RequestError, check_cli_request
    from composer.video import save_video

    clip = save_video(np.stack([np.asarray(f.resize((80, 48))) for f in video]), tmp_path / "in.mp4", fps=8)
    with pytest.raises(RequestError, match=r"--overlap-history: expected a number of frames when a video is given"):
        check_cli_request(str(v2v_folder), None, {"prompt": "x", "height": 48, "width": 80, "num_frames": 17,
                                                  "video": str(clip)})
    with pytest.raises(RequestError, match=r"--video /nonexistent/in.mp4: expected a readable video"):
        check_cli_request(str(v2v_folder), None, {"prompt": "x", "video": "/nonexistent/in.mp4"})
    # step caches stay refused, on every DF folder
    with pytest.raises(UnsupportedError, match="cache = teacache: .*diffusion forcing"):
        VideoGenerator.from_pretrained(v2v_folder, dtype="fp32", progress=False, cache="teacache")


def test_schedule_equals_diffusers_timestep_matrix():
    from diffusers import SkyReelsV2DiffusionForcingPipeline

    from composer.stages.diffusion_forcing import forcing_schedule

    template = torch.tensor([999, 937, 833, 625, 400, 200])
    for frames, ar_step, pre_ready, block in ((5, 0, 0, 1), (8, 2, 0, 1), (10, 3, 0, 5), (12, 1, 4, 2), (9, 5, 3, 3)):
        ours = forcing_schedule(frames, template, ar_step, pre_ready, block)
        matrix, _, update, _ = SkyReelsV2DiffusionForcingPipeline.generate_timestep_matrix(
            None, frames, template, frames, ar_step, pre_ready, block)
        assert torch.equal(ours.timesteps, matrix) and torch.equal(ours.update, update)
    async_ = forcing_schedule(8, template, 2)  # 6 steps, 8 blocks each 2 behind: 6 + 7 x 2 iterations
    assert async_.timesteps.shape == (20, 8) and bool(async_.update.sum(0).eq(6).all())


def test_long_videos_are_windows_that_add_up():
    from composer.stages.diffusion_forcing import latent_count, plan_windows

    for frames, base, overlap, block in ((33, 17, 5, 1), (45, 21, 9, 2), (97, 17, 9, 1), (257, 97, 17, 5), (9, 17, 5, 1)):
        windows = plan_windows(frames, base, overlap, block, 4)
        made = windows[0].frames + sum(w.frames - w.keep_from for w in windows[1:])
        assert made == latent_count(frames, 4)
        assert all(w.prefix % block == 0 and w.prefix <= w.keep_from for w in windows)


def test_bad_knobs_are_refused_before_any_work(gen, folder, tiny_wan_dir):
    def refused(match, **knobs):
        with pytest.raises(InvalidInputError, match=match):
            gen.generate_video(**{**REQUEST, "num_frames": 9, **knobs})

    refused(r"ar_step = -1: expected an integer >= 0 \(0: every frame at the same noise level", ar_step=-1)
    refused(r"causal_block_size = 0: expected a positive integer", causal_block_size=0)
    refused(r"base_num_frames = 20: expected a positive integer of the form 4k\+1", base_num_frames=20)
    refused(r"addnoise_condition = -5.0: expected a number >= 0", addnoise_condition=-5)
    refused(r"overlap_history: expected a number of frames when num_frames \(33\) exceeds base_num_frames \(17\)",
            num_frames=33, base_num_frames=17)
    refused(r"overlap_history = 17: expected fewer frames than base_num_frames \(17\)", num_frames=33,
            base_num_frames=17, overlap_history=17)
    refused(r"num_frames = 13: expected a length whose windows of latent frames \(4 here\) fill whole causal blocks "
            r"of causal_block_size = 3 \(nearest valid: 9\)", num_frames=13, causal_block_size=3)
    refused(r"num_frames = 41: .*\(5, 5, 3 here\).*causal_block_size = 5 \(nearest valid: 33\)", num_frames=41,
            base_num_frames=17, overlap_history=1, causal_block_size=5)
    # before the model loads: the CLI's check reads the folder's JSON only
    from composer.request_check import RequestError, check_cli_request

    with pytest.raises(RequestError, match=r"--ar-step -2: expected .*; --overlap-history: expected a number"):
        check_cli_request(str(folder), None, {"prompt": "x", "height": 48, "width": 80, "num_frames": 33,
                                              "base_num_frames": 17, "ar_step": -2})
    # another family does not take these knobs
    with pytest.raises(InvalidInputError, match="--ar-step 1: expected unset .wan2.1-t2v takes no --ar-step"):
        check_cli_request(str(tiny_wan_dir), None, {"prompt": "x", "ar_step": 1})
    with pytest.raises(UnsupportedError, match="cache = teacache: .*diffusion forcing"):
        VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False, cache="teacache")


@pytest.mark.slow
def test_hooks_act_on_diffusion_forcing(gen, folder, reference_pipe, tmp_path):
    """Layerwise offload gives the plain run's video; a LoRA (diffusers' naming, written by diffusers) gives
    diffusers' video with the same LoRA loaded by diffusers, and once unset the plain run's again."""
    from test_lora import lora_weights, write_lora

    request = {**REQUEST, **CASES["long-async-addnoise"]}
    plain = gen.generate_video(**request).frames
    offloaded = VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False, offload="layerwise")
    assert max_uint8_diff(offloaded.generate_video(**request).frames, plain) == 0
    lora = write_lora(tmp_path / "style", "diffusers", lora_weights(gen.pipeline.modules["transformer"], 5))
    styled = VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False, lora_path=[str(lora)])
    ours = styled.generate_video(**request)
    assert ours.lora is not None and max_uint8_diff(ours.frames, plain) > 1
    reference_pipe.load_lora_weights(str(lora))
    try:
        assert max_uint8_diff(ours.frames, reference(reference_pipe, request)) <= 1
    finally:
        reference_pipe.unload_lora_weights()
    styled.unset_lora()  # the base model again, bit for bit: the plain run's video
    assert max_uint8_diff(styled.generate_video(**request).frames, plain) == 0


@pytest.mark.slow
def test_layerwise_offload_extends_a_video_as_the_plain_run(v2v_gen, v2v_folder):
    request = {**REQUEST, **VIDEO_CASES["v2v-long-async-addnoise-no-cfg"], "video": input_video()}
    offloaded = VideoGenerator.from_pretrained(v2v_folder, dtype="fp32", progress=False, offload="layerwise")
    assert max_uint8_diff(offloaded.generate_video(**request).frames, v2v_gen.generate_video(**request).frames) == 0


@pytest.mark.slow
def test_two_requests_through_the_scheduler_equal_their_solo_runs(gen):
    """A synchronous and an asynchronous request at once: their iterations share transformer calls while both run
    (same window shapes, per-frame timesteps stacked by rows); each video is its solo video."""
    requests = [{**REQUEST, "num_frames": 17, "seed": 1, "ar_step": 0, "causal_block_size": 1},
                {**REQUEST, "num_frames": 17, "seed": 2, "ar_step": 2, "causal_block_size": 1, "prompt": "a cat"}]
    solo = [gen.generate_video(**r).frames for r in requests]
    scheduler = gen.pipeline.engines[0].scheduler
    shared_before = scheduler.stats.batched_units
    together, _ = generate_at_once(gen, requests)
    for i in range(2):
        assert max_uint8_diff(together[i], solo[i]) <= 1
    assert scheduler.stats.batched_units > shared_before


ULYSSES_REQUEST = {**REQUEST, **CASES["long-causal-cut-overlap"]}


def _ulysses_worker(rank, world, folder, out_dir):
    result = VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False, ulysses_degree=2).generate_video(
        **ULYSSES_REQUEST)
    torch.save({"latents": result.latents, "frames": torch.from_numpy(result.frames)}, f"{out_dir}/rank{rank}.pt")


@pytest.mark.slow
def test_ulysses_on_two_ranks_equals_one_process(gen, folder, tmp_path):
    """Per-frame timesteps, block-causal attention and the fps embedding split over 2 gloo ranks (15 tokens a
    frame: padded parts), a long video in windows with CFG: every rank's video is one process's."""
    from composer.testing.distributed import spawn

    expected = gen.generate_video(**ULYSSES_REQUEST)
    spawn(_ulysses_worker, 2, str(folder), str(tmp_path), timeout_s=300)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(got["latents"], expected.latents, atol=1e-5, rtol=0)
        assert max_uint8_diff(got["frames"].numpy(), expected.frames) <= 1


@pytest.mark.slow
def test_the_cli_generates_and_refuses(cli, folder, tmp_path):
    out = tmp_path / "df.mp4"
    code, _, stderr = cli("generate", "--model-path", folder, "--prompt", "a red ball", "--height", "48", "--width",
                          "80", "--num-frames", "17", "--steps", "2", "--ar-step", "1", "--causal-block-size", "5",
                          "--base-num-frames", "17", "--output", out)
    assert code == 0, stderr
    code, _, stderr = cli("generate", "--model-path", folder, "--prompt", "x", "--num-frames", "33",
                          "--base-num-frames", "17", "--output", tmp_path / "bad.mp4")
    assert code == 1 and "--overlap-history: expected a number of frames" in stderr and "Traceback" not in stderr


@pytest.mark.slow
def test_the_cli_extends_a_video_file(cli, v2v_folder, v2v_gen, tmp_path):
    from composer.video import read_frames, save_video

    source = save_video(np.stack([np.asarray(f.resize((80, 48))) for f in input_video()]), tmp_path / "in.mp4", fps=8)
    out = tmp_path / "out.mp4"
    code, _, stderr = cli("generate", "--model-path", v2v_folder, "--prompt", REQUEST["prompt"], "--video", source,
                          "--overlap-history", "5", "--height", "48", "--width", "80", "--num-frames", "17",
                          "--steps", "2", "--causal-block-size", "1", "--seed", "3", "--output", out)
    assert code == 0, stderr
    assert read_frames(out).shape == (11 + 17, 48, 80, 3)
    code, _, stderr = cli("generate", "--model-path", v2v_folder, "--prompt", "x", "--video", source,
                          "--output", tmp_path / "bad.mp4")
    assert code == 1 and "--overlap-history: expected a number of frames when a video is given" in stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize("name", ["1.3b-540p", "14b-540p", "14b-720p"])
def test_presets_name_a_family_that_takes_their_settings(name):
    from pathlib import Path

    from composer.presets import load_preset
    from composer.registry.configs import registered_families

    preset = load_preset(Path(__file__).parent.parent / "configs" / f"skyreels-v2-df-{name}.yaml")
    family = next(f for f in registered_families() if preset.model_path in f.hf_model_paths)
    assert family.name == ("skyreels-v2-df-720p" if "720p" in name else "skyreels-v2-df")
    sampling = family.sampling_param_cls().updated(**preset.sampling)
    assert sampling.base_num_frames == sampling.num_frames  # one window at the released length
