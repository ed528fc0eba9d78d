"""Wan2.2-Animate (diffusers' WanAnimatePipeline folders): composer's frames equal diffusers' on a tiny folder saved by
diffusers' own classes (non-square, with and without CFG, modes animate and replace, segments of 5 and 13 frames
carrying 1 or 5 frames over, the motion encoder's batch, two videos per prompt) within 1 uint8; the DiT equals
diffusers' forward; the inputs are checked before anything loads, naming the field; LoRA, layerwise offload, Ulysses
and tensor parallel on 2 gloo ranks and two requests batched by the step scheduler give the plain run's video; the
server takes the videos as uploads."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from conftest import max_uint8_diff
from helpers import (
    clip_makers,
    diffusers_wan_pipeline,
    generate_at_once,
    perturb_parameters,
    refuse_loading,
    smooth_image,
    transformer_loader,
)
from safetensors.torch import save_file

from composer import VideoGenerator
from composer.errors import ModelFormatError, UnsupportedError
from composer.request_check import RequestError
from composer.testing.distributed import spawn
from composer.testing.tiny_wan_animate import build_tiny_wan_animate

pytestmark = pytest.mark.usefixtures("one_thread")

HEIGHT, WIDTH, FRAMES = 48, 80, 11  # 6 x 10 latents -> 3 x 5 tokens a frame: divides by no degree
# segments of 5 frames carrying 1 over: 11 frames are 3 segments (the pose video padded to 13)
BASE = dict(prompt="a person dances", height=HEIGHT, width=WIDTH, num_inference_steps=3, segment_frame_length=5)
# the pose, face and background videos (a seeded pattern moving right) and the mask video (keep the left part of
# the background, draw the character on the right)
frames, mask = clip_makers(FRAMES, (WIDTH, HEIGHT))


def character(size: tuple[int, int] = (60, 40), seed: int = 1):
    """A smooth seeded image of another aspect ratio than the video (scaled to fit, on black)."""
    return smooth_image(size, seed)


def driving(count: int = FRAMES, seed: int = 0) -> dict:
    """The character image and a pose and a face video (the face at 20 pixels: resized to the encoder's 16)."""
    return dict(image=character(), pose_video=frames(count, seed=seed), face_video=frames(count, (20, 20), seed + 2))


def replacing(count: int = FRAMES) -> dict:
    return dict(mode="replace", background_video=frames(count, seed=5), mask_video=mask(count))


CASES = {
    "animate": dict(negative_prompt=None, guidance_scale=1.0, seed=3, **driving()),
    "replace-cfg": dict(negative_prompt="blurry", guidance_scale=4.0, seed=7, **driving(), **replacing()),
    # 13-frame segments carrying 5 over (21 frames: 2 segments), the motion encoder 2 frames at a time
    "animate-cfg-carry-5": dict(negative_prompt="blurry", guidance_scale=3.0, seed=11, segment_frame_length=13,
                                prev_segment_conditioning_frames=5, motion_encode_batch_size=2, **driving(21)),
    # a mask video in RGB at twice the size, 9 frames in 2 segments (padded back and forth to 9), two videos
    "replace-two-videos": dict(negative_prompt=None, guidance_scale=1.0, seed=2, num_videos_per_prompt=2,
                               **driving(6), mode="replace", background_video=frames(6, seed=5),
                               mask_video=mask(6, (2 * WIDTH, 2 * HEIGHT), "RGB")),
}
QUICK = {"animate"}  # the case that also checks the face and the poses steer the video


@pytest.fixture(scope="module")
def animate_dir(tmp_path_factory):
    return build_tiny_wan_animate(tmp_path_factory.mktemp("models") / "tiny-wan-animate")


@pytest.fixture(scope="module")
def gen(animate_dir):
    return VideoGenerator.from_pretrained(animate_dir, dtype="fp32", progress=False)


def diffusers_pipe(folder):
    return diffusers_wan_pipeline(folder, "WanAnimatePipeline", "pipeline_wan_animate")


def reference_frames(pipe, request: dict) -> np.ndarray:
    """diffusers' frames [videos, T, H, W, 3] as uint8 (one CPU generator per video, seeded seed + i)."""
    request = dict(request)
    seed, videos = request.pop("seed"), request.get("num_videos_per_prompt", 1)
    generator = [torch.Generator("cpu").manual_seed(seed + i) for i in range(videos)]
    out = pipe(generator=generator if videos > 1 else generator[0], output_type="np", **request).frames
    return (out * 255).round().astype(np.uint8)


@pytest.mark.parametrize("name", [n if n in ("animate", "replace-cfg") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in CASES])  # (about a second each; the quick tier keeps one per mode)
def test_frames_match_diffusers(animate_dir, gen, name):
    request = {**BASE, **CASES[name]}
    ours = gen.generate_video(**request)
    ours = ours if isinstance(ours, list) else [ours]
    expected = reference_frames(diffusers_pipe(animate_dir), request)
    length = len(request["pose_video"])
    assert len(ours) == len(expected)
    for video, reference in zip(ours, expected):
        assert video.frames.shape == (length, HEIGHT, WIDTH, 3) and video.frames.std() > 1.0
        assert max_uint8_diff(video.frames, reference) <= 1
    if name in QUICK:  # the last segment's latents too (diffusers returns them denormalized)
        from composer.stages.decoding import denormalize_latents

        call = {k: v for k, v in request.items() if k != "seed"}
        latents = diffusers_pipe(animate_dir)(generator=torch.Generator("cpu").manual_seed(request["seed"]),
                                              output_type="latent", **call).frames
        vae = gen.pipeline.modules["vae"].config
        assert (denormalize_latents(ours[0].latents, vae) - latents).abs().max() <= 1e-4
        # the face and the poses drive the video: others make another one
        for other in (dict(face_video=frames(FRAMES, (20, 20), seed=9)), dict(pose_video=frames(FRAMES, seed=8))):
            assert max_uint8_diff(gen.generate_video(**{**request, **other}).frames, ours[0].frames) > 5


@pytest.mark.parametrize("length", [10, 15])
def test_num_frames_is_not_used_so_any_value_runs_as_in_diffusers(animate_dir, gen, length):
    """diffusers' WanAnimatePipeline has no num_frames (the pose video's length is the video's): a request giving
    the pose video's length (not 4k + 1) runs and equals diffusers' frames."""
    request = {**BASE, **CASES["animate"], **driving(length)}
    ours = gen.generate_video(**request, num_frames=length)
    assert ours.frames.shape == (length, HEIGHT, WIDTH, 3)
    assert max_uint8_diff(ours.frames, reference_frames(diffusers_pipe(animate_dir), request)[0]) <= 1


def test_a_max_frames_cap_bounds_the_pose_videos_length(gen):
    from composer.request_check import ModelLimits, check_request

    limits = ModelLimits.from_pipeline(gen.pipeline).capped("this server's --{flag}", max_frames=9)
    request = gen.default_sampling.updated(**BASE, **driving(), num_frames=5)
    with pytest.raises(RequestError, match="pose_video frames = 11: expected at most 9 \\(this server.s --max-frames"):
        check_request(request, limits)


# -- the DiT ---------------------------------------------------------------------------------------------------------
def test_dit_matches_diffusers_and_refuses_bad_configs(tmp_path):
    """Every parameter perturbed; the face as frames (encoded in batches of 3 of 10) or as precomputed tokens, the
    text as states or as precomputed k/v; a pose of the wrong length and a config diffusers cannot run refused."""
    from composer.testing.tiny_wan_animate import TinyWanAnimateSpec, tiny_animate_transformer

    ref = tiny_animate_transformer(TinyWanAnimateSpec(), seed=4)
    perturb_parameters(ref)
    folder = tmp_path / "transformer"
    ref.save_pretrained(folder)
    load = transformer_loader(folder, "WanAnimateTransformer3DModel")
    ours = load()
    assert type(ours).__module__ == "composer.models.wan.animate"
    g = torch.Generator().manual_seed(1)
    x, pose = torch.randn(2, 36, 3, 6, 10, generator=g), torch.randn(2, 16, 2, 6, 10, generator=g)
    faces = torch.rand(2, 3, 5, 16, 16, generator=g) * 2 - 1
    text, image = torch.randn(2, 512, 32, generator=g), torch.randn(2, 17, 32, generator=g)
    t = torch.tensor([900.0, 321.5])
    with torch.inference_mode():
        expected = ref(x, t, text, image, pose, faces, return_dict=False)[0]
        assert (ours(x, t, text, image, pose, faces) - expected).abs().max() <= 1e-4
        cached = ours(x, t, cross_kv=ours.cross_attention_kv(text, image), pose_hidden_states=pose,
                      face_motion=ours.encode_face(faces, batch_size=4))
        assert (cached - expected).abs().max() <= 1e-4
        with pytest.raises(Exception, match=re.escape("pose_hidden_states of shape [2, 16, 3, 6, 10]: expected "
                                                      "[2, 16, 2, 6, 10]")):
            ours(x, t, text, image, torch.randn(2, 16, 3, 6, 10), faces)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_layers": 3}))
    with pytest.raises(ModelFormatError, match="num_layers = 3 is not a multiple of inject_face_latents_blocks = 2"):
        load()


# -- inputs checked before any work ----------------------------------------------------------------------------------
def test_bad_inputs_are_refused_naming_the_field(gen):
    given = driving()
    cases = [
        (dict(image=character(), face_video=given["face_video"]), "pose_video: expected a video"),
        (dict(image=character(), pose_video=given["pose_video"]), "face_video: expected a video"),
        (dict(given, face_video=frames(7, (20, 20))), "face_video frames = 7: expected 11, the pose video's length"),
        (dict(given, mode="replace"), "background_video: expected a video .*mask_video: expected a video"),
        (dict(given, mode="replace", background_video=frames(), mask_video=mask(9)),
         "mask_video frames = 9: expected 11"),
        (dict(given, background_video=frames()), "background_video = 11 frames: expected unset in mode animate"),
        (dict(given, mode="dance"), "mode = 'dance': expected one of animate, replace"),
        (dict(given, prev_segment_conditioning_frames=3), "prev_segment_conditioning_frames = 3: expected 1 or 5"),
        (dict(given, segment_frame_length=6), "segment_frame_length = 6: expected 4k \\+ 1 frames, more than twice "
                                              "prev_segment_conditioning_frames = 1 \\(nearest valid: 5\\)"),
        (dict(given, prev_segment_conditioning_frames=5, segment_frame_length=9),
         "segment_frame_length = 9: .*\\(nearest valid: 13\\)"),
        (dict(given, pose_video=frames(1), face_video=frames(1, (20, 20))),
         "pose_video frames = 1: expected more than prev_segment_conditioning_frames = 1"),
        (dict(given, motion_encode_batch_size=0), "motion_encode_batch_size = 0: expected a number of frames >= 1"),
        (dict(given, pose_video="/no/such.mp4"), "pose_video = '/no/such.mp4': expected a readable video"),
        (dict(pose_video=given["pose_video"], face_video=given["face_video"]), "image: expected an input image"),
    ]
    for extra, message in cases:
        with pytest.raises(RequestError, match=message):
            gen.generate_video(**{**BASE, **extra})
    with pytest.raises(RequestError, match="\\(4 problems\\)"):  # every problem at once
        gen.generate_video(**BASE, image=character(), pose_video=given["pose_video"], mode="replace",
                           motion_encode_batch_size=-1)


def test_the_cli_refuses_bad_inputs_before_loading(cli, animate_dir, tmp_path, monkeypatch):
    from composer.video import save_video

    refuse_loading(monkeypatch)
    pose = save_video(np.stack([np.asarray(f) for f in frames()]), tmp_path / "pose.mp4", fps=8)
    face = save_video(np.zeros((7, 32, 32, 3), np.uint8), tmp_path / "face.mp4", fps=8)
    character().save(tmp_path / "me.png")
    code, _, err = cli("generate", "--model-path", animate_dir, "--prompt", "x", "--image", tmp_path / "me.png",
                       "--pose-video", pose, "--face-video", face, "--mode", "replace", "--segment-frame-length", "6",
                       "--height", "48", "--width", "80", "--output", tmp_path / "out.mp4")
    assert code == 1 and err.startswith("composer: error: invalid request (nothing was loaded or generated)"), err
    for words in ("--face-video frames 7", "--background-video", "--mask-video", "--segment-frame-length 6"):
        assert words in err, err
    assert "Traceback" not in err


def test_the_cli_animates_a_character(cli, animate_dir, tmp_path):
    from composer.video import read_frames, save_video

    pose = save_video(np.stack([np.asarray(f) for f in frames()]), tmp_path / "pose.mp4", fps=8)
    face = save_video(np.stack([np.asarray(f) for f in frames(size=(32, 32))]), tmp_path / "face.mp4", fps=8)
    character().save(tmp_path / "me.png")
    out = tmp_path / "out.mp4"
    code, _, err = cli("generate", "--model-path", animate_dir, "--prompt", BASE["prompt"], "--image",
                       tmp_path / "me.png", "--pose-video", pose, "--face-video", face, "--segment-frame-length", "5",
                       "--height", "48", "--width", "80", "--steps", "2", "--seed", "7", "--output", out)
    assert code == 0, err
    assert read_frames(out).shape == (FRAMES, HEIGHT, WIDTH, 3)


# -- family, preset, registry ----------------------------------------------------------------------------------------
def test_the_folder_resolves_to_the_animate_family(animate_dir, cli):
    from pathlib import Path

    from composer.generator import resolve_model
    from composer.presets import load_preset
    from composer.registry.configs import resolve_configs

    resolved = resolve_model(str(animate_dir), None)
    assert resolved.configs.family.name == "wan2.2-animate" and resolved.pipeline_cls.__name__ == "WanAnimatePipeline"
    assert resolve_configs("Wan-AI/Wan2.2-Animate-14B-Diffusers").family.name == "wan2.2-animate"
    preset = load_preset(Path(__file__).resolve().parents[1] / "configs" / "wan2.2-animate-14b.yaml")
    assert preset.model_path == "Wan-AI/Wan2.2-Animate-14B-Diffusers" and preset.sampling["mode"] == "animate"
    code, out, _ = cli("models")
    assert code == 0 and "wan2.2-animate" in out
    assert "WanAnimatePipeline -> composer.pipelines.wan_animate.WanAnimatePipeline" in out
    assert "WanAnimateTransformer3DModel -> composer.models.wan.animate.WanAnimateTransformer3DModel" in out


def test_a_memory_plan_is_refused_by_name(animate_dir):
    with pytest.raises(UnsupportedError, match="memory planner has no stand-in pose and face videos"):
        VideoGenerator.from_pretrained(animate_dir, dtype="fp32", progress=False, offload="auto", memory_budget=8e9)


# -- hooks -----------------------------------------------------------------------------------------------------------
def _write_lora(path, model, seed: int):
    """A rank-4 LoRA in diffusers naming on the blocks' self-attention q and FFN output and the face adapters' q."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    targets = [(f"blocks.{i}.attn1.to_q", f"blocks.{i}.attn1.to_q") for i in range(len(model.blocks))]
    targets += [(f"blocks.{i}.ffn.fc_out", f"blocks.{i}.ffn.net.2") for i in range(len(model.blocks))]
    targets += [(f"face_adapter.{i}.to_q", f"face_adapter.{i}.to_q") for i in range(len(model.face_adapter))]
    for composer_name, diffusers_name in targets:
        linear = model.get_submodule(composer_name)
        tensors[f"transformer.{diffusers_name}.lora_A.weight"] = torch.randn(4, linear.in_features, generator=g) * 0.2
        tensors[f"transformer.{diffusers_name}.lora_B.weight"] = torch.randn(linear.out_features, 4, generator=g) * 0.2
    save_file(tensors, str(path))
    return path


def test_lora_and_layerwise_offload(animate_dir, gen, tmp_path):
    """Layerwise offload gives the plain run's video; a LoRA on the blocks and the face adapters gives diffusers'
    video with the same LoRA."""
    request = {**BASE, **CASES["replace-cfg"]}
    plain = gen.generate_video(**request).frames
    offloaded = VideoGenerator.from_pretrained(animate_dir, dtype="fp32", progress=False, offload="layerwise")
    assert max_uint8_diff(offloaded.generate_video(**request).frames, plain) == 0
    lora = _write_lora(tmp_path / "style.safetensors", gen.pipeline.modules["transformer"], seed=4)
    styled = VideoGenerator.from_pretrained(animate_dir, dtype="fp32", progress=False, lora_path=[str(lora)])
    ours = styled.generate_video(**request).frames
    assert max_uint8_diff(ours, plain) > 1
    pipe = diffusers_pipe(animate_dir)
    pipe.load_lora_weights(str(lora))
    assert max_uint8_diff(ours, reference_frames(pipe, request)[0]) <= 1


def test_two_requests_batched_by_the_scheduler_equal_their_solo_runs(gen):
    """Different seeds, characters, faces and modes (per-row pose latents, conditions and face tokens in one
    transformer call) give their solo videos."""
    common = {**BASE, "num_inference_steps": 12, "negative_prompt": "blurry", "guidance_scale": 4.0}
    requests = [{**common, "seed": 1, **driving(seed=1)},
                {**common, "seed": 2, **driving(seed=3), **replacing(), "image": character(seed=4)}]
    solo = [gen.generate_video(**r).frames for r in requests]
    together, rows = generate_at_once(gen, requests)
    assert max(rows) == 4, f"the two requests never shared a call: {rows}"  # 2 videos x 2 guidance branches
    for i in range(2):
        assert max_uint8_diff(together[i], solo[i]) <= 1


def _parallel_worker(rank, world, folder, request, layout, out_dir):
    gen = VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False, **layout)
    result = gen.generate_video(**request)
    model = gen.pipeline.modules["transformer"]
    split = {"sequence": model.sequence_parallel is not None, "adapter_q": model.face_adapter[0].to_q.weight.shape[0]}
    torch.save({"latents": result.latents, "frames": torch.from_numpy(result.frames), "split": split},
               f"{out_dir}/rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(ulysses_degree=2), dict(ring_degree=2), dict(tp_size=2)],
                         ids=["ulysses2", "ring2", "tp2"])
def test_two_ranks_equal_one_process(animate_dir, gen, tmp_path, layout):
    """Ulysses and ring: each rank's part of every frame (15 tokens a frame: padding on one rank) attends to that
    frame's face tokens, which every rank holds whole. Tensor parallel: the face adapters' heads split as the
    blocks'."""
    request = {**BASE, **CASES["replace-cfg"]}
    expected = gen.generate_video(**request)
    spawn(_parallel_worker, 2, str(animate_dir), request, layout, str(tmp_path), timeout_s=300)
    width = gen.pipeline.modules["transformer"].config.hidden_size
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["split"] == ({"sequence": False, "adapter_q": width // 2} if "tp_size" in layout else
                                {"sequence": True, "adapter_q": width})  # the layout did split the work
        torch.testing.assert_close(got["latents"], expected.latents, atol=1e-4, rtol=0)
        assert max_uint8_diff(got["frames"].numpy(), expected.frames) <= 1


def test_the_server_takes_the_videos_as_uploads(gen, tmp_path):
    """Over HTTP the pose, face, background and mask videos are video uploads, decoded and checked as generate_video
    checks them (a face video of another length: a 4xx naming it)."""
    import base64
    import io

    pytest.importorskip("fastapi", reason="composer serve needs the serve extra")
    from composer.serve.requests import RequestProblem, ServerLimits, check_body
    from composer.video import save_video

    def upload(video: list, name: str) -> str:
        array = np.stack([np.asarray(f.convert("RGB")) for f in video])
        return base64.b64encode(save_video(array, tmp_path / name, fps=8).read_bytes()).decode()

    buffer = io.BytesIO()
    character().save(buffer, format="PNG")
    body = {**BASE, "image": base64.b64encode(buffer.getvalue()).decode(), "pose_video": upload(frames(), "p.mp4"),
            "face_video": upload(frames(size=(32, 32)), "f.mp4"), "mode": "replace",
            "background_video": upload(frames(seed=5), "b.mp4"), "mask_video": upload(mask(), "m.mp4")}
    checked = check_body(body, gen, ServerLimits())
    assert checked.inputs["pose_video"].shape == checked.inputs["mask_video"].shape == (FRAMES, HEIGHT, WIDTH, 3)
    assert checked.inputs["face_video"].shape == (FRAMES, 32, 32, 3)
    with pytest.raises(RequestProblem, match="face_video") as caught:
        check_body({**body, "face_video": upload(frames(7, (32, 32)), "short.mp4")}, gen, ServerLimits())
    assert "face_video" in caught.value.field and "7" in str(caught.value)
