"""Wan video-to-video (diffusers' WanVideoToVideoPipeline on a text-to-video folder): `video=` and `strength` on
composer's WanPipeline give diffusers' frames on the tiny folder; bad inputs are refused before any work; concurrent
requests and the CLI's --video / --strength."""

from __future__ import annotations

import types

import numpy as np
import PIL.Image
import pytest
import torch
from conftest import max_uint8_diff
from helpers import generate_at_once

from composer.errors import InvalidInputError

REQUEST = dict(prompt="a red ball moves left", height=48, width=80, num_inference_steps=4, seed=7)
CASES = {
    "cfg-0.6": dict(negative_prompt="blurry", guidance_scale=5.0, strength=0.6),
    "no-cfg-1.0": dict(negative_prompt=None, guidance_scale=1.0, strength=1.0),
    "cfg-0.3": dict(negative_prompt="blurry", guidance_scale=3.0, strength=0.3),
}
QUICK = {"cfg-0.6"}


def frames(count: int = 9, seed: int = 0) -> list:
    """A moving pattern (40 x 70: resized to the request's size, as diffusers does)."""
    base = np.random.default_rng(seed).integers(0, 255, (40, 70, 3)).astype(np.uint8)
    return [PIL.Image.fromarray(np.roll(base, i * 3, axis=1)) for i in range(count)]


def reference(folder, video, seed, **kwargs) -> np.ndarray:
    import diffusers.pipelines.wan.pipeline_wan_video2video as module
    from diffusers import WanVideoToVideoPipeline

    if not hasattr(module, "ftfy"):  # diffusers 0.42.1 calls ftfy even when it is absent; composer skips it then
        module.ftfy = types.SimpleNamespace(fix_text=lambda text: text)
    pipe = WanVideoToVideoPipeline.from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)
    out = pipe(video=video, generator=torch.Generator("cpu").manual_seed(seed), output_type="np", **kwargs).frames[0]
    return (out * 255).round().astype(np.uint8)


@pytest.mark.parametrize("name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def test_video_to_video_matches_diffusers(tiny_wan_dir, composer_gen, name):
    case = CASES[name]
    request = {**REQUEST, **case}
    ours = composer_gen.generate_video(video=frames(), **request)
    assert ours.frames.shape == (9, 48, 80, 3) and ours.sampling.strength == case["strength"]
    seed = request.pop("seed")
    assert max_uint8_diff(ours.frames, reference(tiny_wan_dir, frames(), seed, **request)) <= 1
    # below strength 1 the video matters (text-to-video from the same seed is another video); at 1 the first
    # timestep's noise level is 1, so the video weighs nothing: text-to-video's frames, as in diffusers
    t2v = composer_gen.generate_video(**{**REQUEST, **{k: v for k, v in case.items() if k != "strength"}},
                                      num_frames=9)
    if case["strength"] < 1:
        assert max_uint8_diff(ours.frames, t2v.frames) > 1
    else:
        assert max_uint8_diff(ours.frames, t2v.frames) <= 1


def test_bad_video_inputs_are_refused_clearly(composer_gen):
    for strength, expected in ((0.0, "in \\(0, 1\\]"), (1.5, "in \\(0, 1\\]"), (float("nan"), "a finite number"),
                               (0.1, "keep one step")):
        with pytest.raises(InvalidInputError, match=f"strength = .*expected .*{expected}"):
            composer_gen.generate_video(video=frames(), **{**REQUEST, "strength": strength})
    with pytest.raises(InvalidInputError, match="video frames = 10: expected 4k \\+ 1 .*give 9 frames"):
        composer_gen.generate_video(video=frames(10), **REQUEST)
    # the pipeline's own check, past the request check
    from composer.stages.video_latents import VideoCondition

    with pytest.raises(InvalidInputError, match="10 frames; video-to-video takes 4k \\+ 1 frames.*give 9 or 13"):
        VideoCondition.from_request(types.SimpleNamespace(video=frames(10), strength=0.5, num_inference_steps=4), 4)
    with pytest.raises(InvalidInputError, match="expected uint8 frames \\[T, H, W, 3\\]"):
        composer_gen.generate_video(video=np.zeros((9, 8, 8), np.uint8), **REQUEST)
    with pytest.raises(InvalidInputError, match="does not exist"):
        composer_gen.generate_video(video="/nonexistent/in.mp4", **REQUEST)
    with pytest.raises(InvalidInputError, match="strength = 0.5: expected unset \\(0.8\\) without a video"):
        composer_gen.generate_video(**{**REQUEST, "strength": 0.5})
    with pytest.raises(InvalidInputError, match="video\\[1\\]"):
        composer_gen.generate_video(video=[frames(1)[0], "not an image"], **REQUEST)


def test_num_frames_is_not_used_with_a_video_and_max_frames_bounds_the_video(composer_gen):
    """diffusers' WanVideoToVideoPipeline has no num_frames: the video's length is the video's, whatever num_frames
    says; a cap on frames (a server's --max-frames) bounds the video instead."""
    from composer.request_check import ModelLimits, RequestError, check_request

    request = {**REQUEST, "strength": 0.6}
    ours = composer_gen.generate_video(video=frames(), num_frames=10, **request)
    assert max_uint8_diff(ours.frames, composer_gen.generate_video(video=frames(), **request).frames) <= 1
    limits = ModelLimits.from_pipeline(composer_gen.pipeline).capped("this server's --{flag}", max_frames=5)
    with pytest.raises(RequestError, match="video frames = 9: expected at most 5 \\(this server's --max-frames"):
        check_request(composer_gen.default_sampling.updated(video=frames(), num_frames=5, **request), limits)


def test_the_video_rule_is_wans_and_every_caller_sees_it(tiny_wan_dir, composer_gen):
    """The rule lives in Wan's SamplingParam (`check_inputs`), not in the shared request check: the CLI's check
    before loading and the server's body check see it; a family whose `video` means another thing has its own."""
    from composer.configs.skyreels_v2 import SkyReelsV2DF540PSamplingParam
    from composer.configs.wan import WanT2V480PSamplingParam
    from composer.request_check import ModelLimits, RequestError, check_cli_request, check_request
    from composer.serve.requests import RequestProblem, ServerLimits, check_body

    with pytest.raises(RequestError, match=r"--strength 0.5: expected unset \(0.8\) without a video"):
        check_cli_request(str(tiny_wan_dir), None, {"prompt": "x", "strength": "0.5"})
    with pytest.raises(RequestError, match=r"--video /nonexistent/in.mp4: expected a readable video"):
        check_cli_request(str(tiny_wan_dir), None, {"prompt": "x", "video": "/nonexistent/in.mp4"})
    with pytest.raises(RequestProblem, match=r"strength = 0.5: expected unset \(0.8\) without a video") as exc:
        check_body({"prompt": "x", "strength": 0.5}, composer_gen, ServerLimits(), [])
    assert exc.value.field == "strength"
    limits = ModelLimits(spatial_multiple=16, temporal_factor=4)
    ten = WanT2V480PSamplingParam(prompt="x", height=48, width=80, num_frames=9, video=frames(10))
    with pytest.raises(RequestError, match=r"video frames = 10: expected 4k \+ 1"):
        check_request(ten, limits)
    # SkyReels-V2 DF extends a video of any length: no 4k + 1 rule for it
    check_request(SkyReelsV2DF540PSamplingParam(prompt="x", height=48, width=80, num_frames=17, overlap_history=5,
                                                causal_block_size=1, video=frames(10)), limits)


@pytest.mark.slow
def test_concurrent_video_to_video_requests_equal_their_solo_runs(composer_gen):
    """Two requests at once (their steps batched by the scheduler) give their solo videos; the
    video given as uint8 frames is the same video as the PIL frames."""
    requests = [dict(REQUEST, seed=s, strength=st, video=np.stack([np.asarray(f) for f in frames(seed=s)]))
                for s, st in ((1, 0.5), (2, 0.75))]
    solo = [composer_gen.generate_video(**r).frames for r in requests]
    assert max_uint8_diff(solo[0], composer_gen.generate_video(**{**requests[0], "video": frames(seed=1)}).frames) == 0
    together, rows = generate_at_once(composer_gen, requests)
    assert max(rows) == 4, rows  # their steps shared a call: 2 videos x 2 guidance branches
    for i in range(2):  # a batched call may move a value by one level (docs/scheduling.md, "What is exact")
        assert max_uint8_diff(together[i], solo[i]) <= 1


@pytest.mark.slow
def test_the_cli_takes_a_video_file(cli, tiny_wan_dir, composer_gen, tmp_path):
    from composer.video import read_frames, save_video

    source = save_video(np.stack([np.asarray(f.resize((80, 48))) for f in frames()]), tmp_path / "in.mp4", fps=8)
    out = tmp_path / "out.mp4"
    code, stdout, stderr = cli("generate", "--model-path", tiny_wan_dir, "--prompt", REQUEST["prompt"], "--video",
                               source, "--strength", "0.6", "--height", "48", "--width", "80",
                               "--num-inference-steps", "4", "--seed", "7", "--output", out)
    assert code == 0, stderr
    expected = composer_gen.generate_video(video=str(source), strength=0.6, **REQUEST,
                                           negative_prompt=composer_gen.sampling_param().negative_prompt)
    assert read_frames(out).shape == (9, 48, 80, 3)
    assert expected.frames.shape == (9, 48, 80, 3)
    code, _, stderr = cli("generate", "--model-path", tiny_wan_dir, "--prompt", "x", "--video", source,
                          "--strength", "2", "--output", out)
    assert code != 0 and "strength" in stderr


@pytest.mark.slow
def test_hooks_act_on_video_to_video(tiny_wan_dir, composer_gen, tmp_path):
    """Layerwise offload gives the same video; an unfused LoRA changes it as on text-to-video (the same adapters)."""
    from test_lora import lora_weights, write_lora

    from composer import VideoGenerator

    request = {**REQUEST, "video": frames(), "strength": 0.6}
    expected = composer_gen.generate_video(**request).frames
    offloaded = VideoGenerator.from_pretrained(tiny_wan_dir, dtype="fp32", progress=False, offload="layerwise")
    assert max_uint8_diff(offloaded.generate_video(**request).frames, expected) == 0
    lora = write_lora(tmp_path / "style.safetensors", "diffusers",
                      lora_weights(composer_gen.pipeline.modules["transformer"], 5))
    styled = VideoGenerator.from_pretrained(tiny_wan_dir, dtype="fp32", progress=False, lora_path=[str(lora)])
    result = styled.generate_video(**request)
    assert result.lora is not None and max_uint8_diff(result.frames, expected) > 1


def test_a_folder_saved_by_diffusers_video_to_video_pipeline_serves_both_tasks(tiny_wan_dir, composer_gen, tmp_path):
    """WanVideoToVideoPipeline.save_pretrained names its own class in model_index.json, on a text-to-video
    folder's components: composer serves it as that folder, text-to-video and video-to-video alike."""
    from diffusers import WanVideoToVideoPipeline

    from composer import VideoGenerator

    folder = tmp_path / "saved-by-v2v"
    WanVideoToVideoPipeline.from_pretrained(str(tiny_wan_dir)).save_pretrained(str(folder))
    assert '"WanVideoToVideoPipeline"' in (folder / "model_index.json").read_text()
    gen = VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False)
    assert gen.family == composer_gen.family
    for request in ({"num_frames": 9}, {"video": frames(), "strength": 0.6}):
        ours, theirs = gen.generate_video(**REQUEST, **request), composer_gen.generate_video(**REQUEST, **request)
        assert max_uint8_diff(ours.frames, theirs.frames) <= 1
