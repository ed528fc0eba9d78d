"""Prompt lists: one video per prompt (and copy) in one batch, video i with seed `seed + i`, numbered outputs."""

from __future__ import annotations

import imageio.v3 as iio
import numpy as np
import pytest
import torch
from conftest import max_uint8_diff

from composer.errors import ConfigError, InvalidInputError, UnsupportedError
from composer.prompt_lists import numbered_path

SMALL = dict(height=32, width=32, num_frames=5, num_inference_steps=3, guidance_scale=3.0)
PROMPTS = ["a red circle moving left", "a blue square moving up"]


def assert_same_video(batched, single):
    assert batched.seed == single.seed
    assert batched.latents.shape == single.latents.shape
    assert torch.allclose(batched.latents, single.latents, atol=1e-5, rtol=0)  # batched matmuls: last bits only
    assert max_uint8_diff(batched.frames, single.frames) <= 1


def test_a_list_makes_the_videos_single_calls_make_with_derived_seeds(composer_gen):
    results = composer_gen.generate_video(PROMPTS, seed=3, negative_prompt="gray", **SMALL)
    assert isinstance(results, list) and len(results) == 2
    assert [r.seed for r in results] == [3, 4]
    assert [r.sampling.prompt for r in results] == PROMPTS
    for prompt, result in zip(PROMPTS, results):
        assert_same_video(result, composer_gen.generate_video(prompt, seed=result.seed, negative_prompt="gray", **SMALL))
    assert max_uint8_diff(results[0].frames, results[1].frames) > 1
    # a result's sampling is the single request that makes its video
    again = composer_gen.generate_video(sampling_param=results[1].sampling)
    assert_same_video(results[1], again)


def test_a_one_element_list_is_the_string_video(composer_gen):
    (listed,) = composer_gen.generate_video(PROMPTS[:1], seed=9, **SMALL)
    single = composer_gen.generate_video(PROMPTS[0], seed=9, **SMALL)
    assert np.array_equal(listed.frames, single.frames)
    assert torch.equal(listed.latents, single.latents)


def test_a_list_matches_diffusers_with_a_list_of_generators(composer_gen, diffusers_pipe):
    ours = composer_gen.generate_video(PROMPTS, seed=42, negative_prompt=["static", "blurred"], **SMALL)
    out = diffusers_pipe(
        prompt=PROMPTS, negative_prompt=["static", "blurred"], output_type="np",
        generator=[torch.Generator("cpu").manual_seed(42 + i) for i in range(2)], **SMALL,
    ).frames
    for i, result in enumerate(ours):
        assert result.frames.std() > 1.0, "degenerate video: the comparison would prove nothing"
        assert max_uint8_diff(result.frames, (out[i] * 255).round().astype(np.uint8)) <= 1


def test_num_videos_per_prompt_orders_copies_together(composer_gen, diffusers_pipe):
    results = composer_gen.generate_video(PROMPTS, seed=5, num_videos_per_prompt=2, negative_prompt="", **SMALL)
    assert [(r.sampling.prompt, r.seed) for r in results] == [
        (PROMPTS[0], 5), (PROMPTS[0], 6), (PROMPTS[1], 7), (PROMPTS[1], 8),
    ]
    assert all(r.sampling.num_videos_per_prompt == 1 for r in results)
    assert_same_video(results[2], composer_gen.generate_video(PROMPTS[1], seed=7, negative_prompt="", **SMALL))
    # as diffusers orders them: each prompt's copies together, one generator per video
    out = diffusers_pipe(
        prompt=PROMPTS, negative_prompt="", num_videos_per_prompt=2, output_type="np",
        generator=[torch.Generator("cpu").manual_seed(5 + i) for i in range(4)], **SMALL,
    ).frames
    assert max_uint8_diff(results[3].frames, (out[3] * 255).round().astype(np.uint8)) <= 1
    # one string with copies returns a list too
    copies = composer_gen.generate_video(PROMPTS[0], seed=5, num_videos_per_prompt=2, **SMALL)
    assert [r.seed for r in copies] == [5, 6]


def test_several_videos_go_to_numbered_paths(composer_gen, tmp_path):
    results = composer_gen.generate_video(PROMPTS, seed=1, output_path=str(tmp_path / "clip.gif"), **SMALL)
    assert [r.output_path for r in results] == [tmp_path / "clip-0.gif", tmp_path / "clip-1.gif"]
    for result in results:
        assert iio.imread(result.output_path).shape[0] == 5
        assert result.sampling.output_path == str(result.output_path)
    assert not (tmp_path / "clip.gif").exists()
    assert numbered_path("out/frames", 3) == "out/frames-3"  # a folder of PNGs


def test_max_batch_size_splits_a_list_into_batches_of_the_same_videos(composer_gen, tiny_wan_dir, tmp_path):
    """Three videos in batches of at most 2: the same seeds, videos and numbered paths as one batch of 3."""
    from composer import VideoGenerator

    prompts = [*PROMPTS, "a green triangle moving right"]
    whole = composer_gen.generate_video(prompts, seed=5, **SMALL)
    limited = VideoGenerator.from_pretrained(tiny_wan_dir, dtype="fp32", progress=False, max_batch_size=2)
    parts = limited.generate_video(prompts, seed=5, output_path=str(tmp_path / "clip.gif"), **SMALL)
    assert [r.seed for r in parts] == [5, 6, 7] and [r.sampling.prompt for r in parts] == prompts
    assert [r.output_path for r in parts] == [tmp_path / f"clip-{i}.gif" for i in range(3)]
    for a, b in zip(parts, whole):
        assert_same_video(a, b)
    # one prompt with copies across batches: still a list, numbered across the batches
    copies = limited.generate_video(PROMPTS[0], seed=5, num_videos_per_prompt=3, **SMALL)
    assert [r.seed for r in copies] == [5, 6, 7]
    with pytest.raises(ConfigError, match="max_batch_size = 0"):
        VideoGenerator.from_pretrained(tiny_wan_dir, max_batch_size=0)


@pytest.mark.parametrize(
    "prompt, extra, message",
    [
        (5, {}, "prompt must be a non-empty string or a non-empty list of non-empty strings; got int 5"),
        ([], {}, "got an empty list"),
        (["a dog", 3], {}, "prompt[1] is int 3"),
        (["a dog", "  "], {}, "prompt[1] is an empty string"),
        ("", {}, "got an empty string"),
        (None, {}, "got NoneType None"),
        (("a", "b"), {"negative_prompt": ["x"]}, "negative_prompt has 1 strings for 2 prompts"),
        ("a dog", {"negative_prompt": [1]}, "negative_prompt must be one string (for every prompt) or a list"),
        ("a dog", {"num_videos_per_prompt": 0}, "num_videos_per_prompt must be an integer >= 1; got int 0"),
    ],
)
def test_bad_prompts_are_refused_before_any_work(composer_gen, monkeypatch, prompt, extra, message):
    monkeypatch.setattr(composer_gen.pipeline, "forward", lambda batch: pytest.fail("ran the pipeline"))
    with pytest.raises(InvalidInputError) as info:
        composer_gen.generate_video(prompt, **extra, **SMALL)
    assert message in str(info.value)


def test_a_list_in_a_string_field_is_a_type_error(composer_gen):
    with pytest.raises(ConfigError, match=r"prompt = \['a', 'b'\]: expected str"):
        composer_gen.sampling_param(prompt=["a", "b"])


def test_causal_models_refuse_lists(tiny_causal_dir):
    from composer import VideoGenerator

    gen = VideoGenerator.from_pretrained(tiny_causal_dir, dtype="fp32", progress=False)
    with pytest.raises(UnsupportedError, match="makes one video per request; got 2"):
        gen.generate_video(PROMPTS, height=32, width=32, num_frames=9)
    with pytest.raises(UnsupportedError, match="stream_video makes one video"):
        gen.stream_video(PROMPTS[0], num_videos_per_prompt=2)


# -- composer generate --prompt-file ---------------------------------------------------------------------
CLI_SMALL = ["--height", "32", "--width", "32", "--num-frames", "5", "--steps", "3", "--guidance-scale", "3",
             "--seed", "3"]


def run_cli(capsys, *args):
    from composer.cli.main import main

    capsys.readouterr()
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_prompt_file_makes_one_numbered_video_per_line(capsys, composer_gen, tiny_wan_dir, tmp_path, monkeypatch):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"# shapes\n{PROMPTS[0]}\n\n   \n{PROMPTS[1]}\n")
    code, out, err = run_cli(capsys, "generate", "--model-path", tiny_wan_dir, "--prompt-file", prompts,
                             *CLI_SMALL, "--output", tmp_path / "clip")  # a folder of PNG frames per video
    assert code == 0, err
    assert f"wrote {tmp_path / 'clip-0'} (5 frames, seed 3): {PROMPTS[0]}" in out
    assert f"wrote {tmp_path / 'clip-1'} (5 frames, seed 4): {PROMPTS[1]}" in out
    single = composer_gen.generate_video(PROMPTS[1], seed=4, **SMALL)
    written = np.stack([iio.imread(p) for p in sorted((tmp_path / "clip-1").glob("frame_*.png"))])
    assert max_uint8_diff(written, single.frames) <= 1
    # without --output: outputs/<file stem>-<seed>-<i>.mp4
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, "generate", "--model-path", tiny_wan_dir, "--prompt-file", prompts, *CLI_SMALL)
    assert code == 0, err
    assert sorted(p.name for p in (tmp_path / "outputs").iterdir()) == ["prompts-3-0.mp4", "prompts-3-1.mp4"]


@pytest.mark.parametrize(
    "args, contents, message",
    [
        (["--prompt", "x"], "a dog\n", "give --prompt or --prompt-file, not both"),
        ([], "# nothing\n\n", "no prompts in it"),
        (["--stream"], "a dog\n", "does not go with --segment, --stream or --interactive"),
    ],
)
def test_prompt_file_errors(capsys, tiny_wan_dir, tmp_path, args, contents, message):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(contents)
    code, _, err = run_cli(capsys, "generate", "--model-path", tiny_wan_dir, "--prompt-file", prompts, *args)
    assert code == 1 and message in err and "Traceback" not in err
