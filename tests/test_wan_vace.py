"""Wan VACE (diffusers' WanVACEPipeline folders): composer's frames equal diffusers' on tiny folders saved by diffusers'
own classes (non-square, with and without CFG, a mask, reference images, conditioning_scale as one value and per
block, the two-expert Wan2.2 layout) within 1 uint8; the DiT's control blocks equal diffusers' forward; the inputs
are checked before anything loads, naming the field; LoRA, layerwise offload, Ulysses on 2 gloo ranks and two
requests batched by the step scheduler give the plain run's video; the server takes the control as uploads and a
memory budget plans the control stage."""

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
from composer.errors import InvalidInputError, ModelFormatError
from composer.request_check import RequestError
from composer.testing.distributed import spawn
from composer.testing.tiny_wan_vace import build_tiny_wan_vace

pytestmark = pytest.mark.usefixtures("one_thread")

HEIGHT, WIDTH, FRAMES = 48, 80, 9  # 6 x 10 latents -> 3 x 5 tokens a frame: divides by no degree
BASE = dict(prompt="a red ball moves left", height=HEIGHT, width=WIDTH, num_inference_steps=3)
# the control video (a seeded pattern moving right) and its mask (keep the left part, redraw the right)
frames, mask = clip_makers(FRAMES, (WIDTH, HEIGHT))


def reference(size: tuple[int, int] = (50, 30), seed: int = 1):
    """A smooth seeded image whose size is no multiple of the VAE's 8 (diffusers cuts it down first)."""
    return smooth_image(size, seed)


# request extras by case; "big": the control video and mask at twice the size (scaled down, as diffusers does)
CASES = {
    "cfg-mask": dict(negative_prompt="blurry", guidance_scale=5.0, seed=7, video=frames(), mask=mask()),
    "no-cfg-reference-big-video": dict(negative_prompt=None, guidance_scale=1.0, seed=3, conditioning_scale=0.5,
                                       video=frames(size=(2 * WIDTH, 2 * HEIGHT)),
                                       mask=mask(size=(2 * WIDTH, 2 * HEIGHT), mode="RGB"),
                                       reference_images=reference()),
    "references-only-per-block-scales": dict(negative_prompt="blurry", guidance_scale=3.0, seed=11, num_frames=FRAMES,
                                             conditioning_scale=[0.3, 1.5],
                                             reference_images=[reference(), reference((40, 64), seed=2)]),
}
QUICK = {"cfg-mask"}


@pytest.fixture(scope="module")
def vace_dir(tmp_path_factory):
    return build_tiny_wan_vace(tmp_path_factory.mktemp("models") / "tiny-wan-vace")


@pytest.fixture(scope="module")
def gen(vace_dir):
    return VideoGenerator.from_pretrained(vace_dir, dtype="fp32", progress=False)


def diffusers_pipe(folder):
    return diffusers_wan_pipeline(folder, "WanVACEPipeline", "pipeline_wan_vace")


def reference_frames(pipe, request: dict) -> np.ndarray:
    request = dict(request)
    seed = request.pop("seed")
    request.setdefault("num_frames", FRAMES)
    out = pipe(generator=torch.Generator("cpu").manual_seed(seed), output_type="np", **request).frames[0]
    return (out * 255).round().astype(np.uint8)


@pytest.mark.parametrize("name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def test_frames_match_diffusers(vace_dir, gen, name):
    request = {**BASE, **CASES[name]}
    ours = gen.generate_video(**request)
    assert ours.frames.shape == (FRAMES, HEIGHT, WIDTH, 3) and ours.frames.std() > 1.0
    assert max_uint8_diff(ours.frames, reference_frames(diffusers_pipe(vace_dir), request)) <= 1
    if name in QUICK:  # the control steers the video: without it (scale 0) the video is another
        assert max_uint8_diff(gen.generate_video(**request, conditioning_scale=0.0).frames, ours.frames) > 10


@pytest.mark.slow
def test_two_expert_folder_matches_diffusers(tmp_path):
    """The Wan2.2 layout (transformer_2, boundary_ratio): the same control, two experts with their own CFG scales."""
    folder = build_tiny_wan_vace(tmp_path / "tiny-wan22-vace", two_experts=True, boundary_ratio=0.9)
    gen = VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False)
    assert gen.family == "wan2.2-vace" and type(gen.pipeline).__name__ == "Wan22VACEPipeline"
    request = {**BASE, "num_inference_steps": 4, "negative_prompt": "blurry", "guidance_scale": 4.0,
               "guidance_scale_2": 2.0, "seed": 5, "video": frames(), "mask": mask(), "reference_images": reference()}
    calls = []
    handles = [gen.pipeline.modules[n].register_forward_pre_hook(lambda m, a, n=n: calls.append(n))
               for n in ("transformer", "transformer_2")]
    ours = gen.generate_video(**request)
    for handle in handles:
        handle.remove()
    assert set(calls) == {"transformer", "transformer_2"}
    assert max_uint8_diff(ours.frames, reference_frames(diffusers_pipe(folder), request)) <= 1


# -- the DiT ---------------------------------------------------------------------------------------------------------
def test_dit_matches_diffusers_and_refuses_bad_vace_configs(tmp_path):
    """Unsorted vace_layers (hints pair with the blocks in ascending order, as in diffusers), every parameter
    perturbed, per-block scales; the text as states or as precomputed k/v; per-row scales equal separate calls."""
    from diffusers import WanVACETransformer3DModel as Reference

    torch.manual_seed(0)
    kwargs = dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, text_dim=6, freq_dim=8,
                  ffn_dim=20, num_layers=4, vace_layers=[3, 0], vace_in_channels=5, cross_attn_norm=True)
    ref = Reference(**kwargs).eval()
    perturb_parameters(ref)
    folder = tmp_path / "transformer"
    ref.save_pretrained(folder)
    load = transformer_loader(folder, "WanVACETransformer3DModel")
    ours = load()
    assert type(ours).__module__ == "composer.models.wan.vace"
    g = torch.Generator().manual_seed(1)
    x, text = torch.randn(2, 4, 3, 4, 6, generator=g), torch.randn(2, 7, 6, generator=g)
    control, t = torch.randn(2, 5, 3, 4, 6, generator=g), torch.tensor([900.0, 321.5])
    scale = torch.tensor([0.7, 1.3])
    with torch.inference_mode():
        expected = ref(x, t, text, control_hidden_states=control, control_hidden_states_scale=scale,
                       return_dict=False)[0]
        assert (ours(x, t, text, control_hidden_states=control, control_hidden_states_scale=scale)
                - expected).abs().max() <= 1e-4
        cached = ours(x, t, cross_kv=ours.cross_attention_kv(text), control_hidden_states=control,
                      control_hidden_states_scale=scale)
        assert (cached - expected).abs().max() <= 1e-4
        rows = torch.tensor([[0.7, 1.3], [0.0, 2.0]])
        both = ours(x, t, text, control_hidden_states=control, control_hidden_states_scale=rows)
        second = ref(x[1:], t[1:], text[1:], control_hidden_states=control[1:],
                     control_hidden_states_scale=rows[1], return_dict=False)[0]
        assert (both[1:] - second).abs().max() <= 1e-4 and (both[:1] - expected[:1]).abs().max() <= 1e-4
        with pytest.raises(InvalidInputError, match="control_hidden_states of shape .*expected \\[2, 5, 3, 4, 6\\]"):
            ours(x, t, text, control_hidden_states=control[:, :, :2])
    config = json.loads((folder / "config.json").read_text())
    for layers, message in (([1, 3], "must include block 0"), ([0, 4], "below num_layers = 4"),
                            ([0, 2, 2], "names a block twice")):
        (folder / "config.json").write_text(json.dumps({**config, "vace_layers": layers}))
        with pytest.raises(ModelFormatError, match=re.escape(f"vace_layers = {layers}: ") + f".*{message}"):
            load()


# -- inputs checked before any work ----------------------------------------------------------------------------------
def test_bad_inputs_are_refused_naming_the_field(gen):
    video = frames()
    cases = [
        (dict(), "video: expected a control video, or reference_images"),
        (dict(mask=mask(), reference_images=reference()), "mask = 9 items: expected unset without a video"),
        (dict(video=video, mask=mask(size=(40, 24))), "mask = 9 items: expected frames of the control video's size, "
                                                      "80x48 \\(width x height\\), not 40x24"),
        (dict(video=video, mask=mask(count=5)), "expected 9 frames, the control video's length \\(it has 5\\)"),
        (dict(video=video, reference_images=5), "reference_images\\[0\\] = 5: expected a PIL image, a numpy array"),
        (dict(video=video, reference_images=[reference(), {"a": 1}]), "reference_images\\[1\\] = {.a.: 1}: expected a PIL"),
        (dict(video=video, reference_images=[reference(), "/no/such.png"]),
         "reference_images\\[1\\] = '/no/such.png': expected an existing image file"),
        (dict(video=video, reference_images=[]), "reference_images = \\[\\]: expected at least one image"),
        (dict(video=video, conditioning_scale=float("nan")), "conditioning_scale = \\[nan\\]: expected finite"),
        (dict(video=video, conditioning_scale=[1.0, float("inf")]), "conditioning_scale = \\[1.0, inf\\]"),
        (dict(video=frames(count=10)), "video frames = 10: expected 4k \\+ 1"),
    ]
    for extra, message in cases:
        with pytest.raises(RequestError, match=message):
            gen.generate_video(**BASE, **extra)
    with pytest.raises(RequestError, match="\\(3 problems\\)"):  # every problem at once
        gen.generate_video(**BASE, mask=mask(), conditioning_scale=float("nan"))
    # the scales' count is the transformer's: checked when the request is prepared, before any stage runs
    with pytest.raises(InvalidInputError, match="conditioning_scale = \\[1.0, 2.0, 3.0\\]: expected one value, or "
                                                "one per control block: this transformer has 2"):
        gen.generate_video(**BASE, video=video, conditioning_scale=[1.0, 2.0, 3.0])


def test_the_cli_refuses_bad_inputs_before_loading(cli, vace_dir, tmp_path, monkeypatch):
    from composer.video import save_video

    refuse_loading(monkeypatch)
    control = save_video(np.stack([np.asarray(f) for f in frames()]), tmp_path / "control.mp4", fps=8)
    small = save_video(np.zeros((FRAMES, 32, 32, 3), np.uint8), tmp_path / "mask.mp4", fps=8)
    code, _, err = cli("generate", "--model-path", vace_dir, "--prompt", "x", "--video", control, "--mask", small,
                       "--reference-image", tmp_path / "none.png", "--conditioning-scale", "inf", "--height", "48",
                       "--width", "80", "--output", tmp_path / "out.mp4")
    assert code == 1 and err.startswith("composer: error: invalid request (nothing was loaded or generated)"), err
    for words in ("--mask", "not 32x32", "--reference-image ", "none.png", "--conditioning-scale"):  # flags as typed
        assert words in err, err
    assert "Traceback" not in err


@pytest.mark.slow
def test_the_cli_takes_a_control_video_mask_and_reference_image(cli, vace_dir, gen, tmp_path):
    from composer.video import read_frames, save_video

    control = save_video(np.stack([np.asarray(f) for f in frames()]), tmp_path / "control.mp4", fps=8)
    masked = save_video(np.stack([np.asarray(m.convert("RGB")) for m in mask()]), tmp_path / "mask.mp4", fps=8)
    reference().save(tmp_path / "ref.png")
    out = tmp_path / "out.mp4"
    code, _, err = cli("generate", "--model-path", vace_dir, "--prompt", BASE["prompt"], "--video", control, "--mask",
                       masked, "--reference-image", tmp_path / "ref.png", "--conditioning-scale", "0.8", "--height",
                       "48", "--width", "80", "--steps", "3", "--seed", "7", "--output", out)
    assert code == 0, err
    assert read_frames(out).shape == (FRAMES, HEIGHT, WIDTH, 3)


# -- families, presets, registry -------------------------------------------------------------------------------------
def test_folders_resolve_to_the_vace_families(vace_dir, tmp_path, cli):
    from composer.generator import resolve_model
    from composer.presets import load_preset
    from composer.registry.configs import resolve_configs

    resolved = resolve_model(str(vace_dir), None)
    assert resolved.configs.family.name == "wan2.1-vace" and resolved.pipeline_cls.__name__ == "WanVACEPipeline"
    two = build_tiny_wan_vace(tmp_path / "two", two_experts=True)
    resolved = resolve_model(str(two), None)
    assert resolved.configs.family.name == "wan2.2-vace" and resolved.pipeline_cls.__name__ == "Wan22VACEPipeline"
    assert resolve_configs("Wan-AI/Wan2.1-VACE-14B-diffusers").family.name == "wan2.1-vace"
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    for name in ("wan2.1-vace-1.3b", "wan2.1-vace-14b"):
        preset = load_preset(repo / "configs" / f"{name}.yaml")
        assert preset.model_path.startswith("Wan-AI/Wan2.1-VACE-")
    code, out, _ = cli("models")
    assert code == 0 and "wan2.1-vace" in out and "wan2.2-vace" in out
    assert "WanVACEPipeline -> composer.pipelines.wan_vace.WanVACEPipeline" in out
    assert "WanVACETransformer3DModel -> composer.models.wan.vace.WanVACETransformer3DModel" in out


# -- hooks -----------------------------------------------------------------------------------------------------------
def _write_lora(path, model, seed: int):
    """A rank-4 LoRA in diffusers naming on the Wan blocks' and the control blocks' attention q and FFN output."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for blocks in ("blocks", "vace_blocks"):
        for i in range(len(getattr(model, blocks))):
            for composer_name, diffusers_name in (("attn1.to_q", "attn1.to_q"), ("ffn.fc_out", "ffn.net.2")):
                linear = model.get_submodule(f"{blocks}.{i}.{composer_name}")
                stem = f"transformer.{blocks}.{i}.{diffusers_name}"
                tensors[f"{stem}.lora_A.weight"] = torch.randn(4, linear.in_features, generator=g) * 0.2
                tensors[f"{stem}.lora_B.weight"] = torch.randn(linear.out_features, 4, generator=g) * 0.2
    save_file(tensors, str(path))
    return path


@pytest.mark.slow
def test_lora_and_layerwise_offload(vace_dir, gen, tmp_path):
    """Layerwise offload (the control blocks streamed too) gives the plain run's video; a LoRA on both kinds of
    blocks gives diffusers' video with the same LoRA."""
    request = {**BASE, **CASES["cfg-mask"], "reference_images": reference()}
    plain = gen.generate_video(**request).frames
    offloaded = VideoGenerator.from_pretrained(vace_dir, dtype="fp32", progress=False, offload="layerwise")
    assert max_uint8_diff(offloaded.generate_video(**request).frames, plain) == 0
    lora = _write_lora(tmp_path / "style.safetensors", gen.pipeline.modules["transformer"], seed=4)
    styled = VideoGenerator.from_pretrained(vace_dir, dtype="fp32", progress=False, lora_path=[str(lora)])
    ours = styled.generate_video(**request).frames
    assert max_uint8_diff(ours, plain) > 1
    pipe = diffusers_pipe(vace_dir)
    pipe.load_lora_weights(str(lora))
    assert max_uint8_diff(ours, reference_frames(pipe, request)) <= 1


@pytest.mark.slow
def test_two_requests_batched_by_the_scheduler_equal_their_solo_runs(gen):
    """Different seeds, masks and scales (per-row control inputs in one transformer call) give their solo videos.
    The VAE encodes one request at a time: 24 steps let the first request's loop outlast the second's encode."""
    common = {**BASE, "num_inference_steps": 24, "negative_prompt": "blurry", "guidance_scale": 4.0}
    requests = [{**common, "seed": 1, "video": frames(seed=1), "mask": mask(), "conditioning_scale": 0.5,
                 "reference_images": reference()},
                {**common, "seed": 2, "video": frames(seed=2), "conditioning_scale": [0.3, 1.2],
                 "reference_images": reference(seed=3)}]
    solo = [gen.generate_video(**r).frames for r in requests]
    together, rows = generate_at_once(gen, requests)
    assert max(rows) == 4, f"the two requests never shared a call: {rows}"  # 2 videos x 2 guidance branches
    for i in range(2):  # batched matmuls may differ in the last bits (docs/architecture.md: within 1 per pixel)
        assert max_uint8_diff(together[i], solo[i]) <= 1


def _parallel_worker(rank, world, folder, request, layout, out_dir):
    gen = VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False, **layout)
    result = gen.generate_video(**request)
    torch.save({"latents": result.latents, "frames": torch.from_numpy(result.frames)}, f"{out_dir}/rank{rank}.pt")


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(ulysses_degree=2), dict(tp_size=2)], ids=["ulysses2", "tp2"])
def test_two_ranks_equal_one_process(vace_dir, gen, tmp_path, layout):
    """Ulysses: the control tokens split over the ranks as the latents' are (15 tokens a frame: padding on one
    rank). Tensor parallel: the control blocks' attention and FFN split as the Wan blocks' (their plan)."""
    request = {**BASE, **CASES["cfg-mask"], "reference_images": reference()}
    expected = gen.generate_video(**request)
    spawn(_parallel_worker, 2, str(vace_dir), request, layout, str(tmp_path), timeout_s=300)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(got["latents"], expected.latents, atol=1e-5, rtol=0)
        assert max_uint8_diff(got["frames"].numpy(), expected.frames) <= 1


def test_the_server_takes_the_control_as_uploads(gen, tmp_path):
    """Over HTTP the control video and the mask are video uploads and the reference images one upload or a list,
    decoded and checked as generate_video checks them (a mask of another size: a 4xx naming `mask`)."""
    import base64
    import io

    pytest.importorskip("fastapi", reason="composer serve needs the serve extra")
    from composer.serve.requests import RequestProblem, ServerLimits, check_body
    from composer.video import save_video

    def upload(array: np.ndarray, name: str) -> str:
        return base64.b64encode(save_video(array, tmp_path / name, fps=8).read_bytes()).decode()

    def png(image) -> str:
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        return base64.b64encode(buffer.getvalue()).decode()

    video = upload(np.stack([np.asarray(f) for f in frames()]), "control.mp4")
    masked = upload(np.stack([np.asarray(m.convert("RGB")) for m in mask()]), "mask.mp4")
    body = {**BASE, "video": video, "mask": masked, "reference_images": [png(reference()), png(reference(seed=2))]}
    checked = check_body(body, gen, ServerLimits())
    assert checked.inputs["video"].shape == checked.inputs["mask"].shape == (FRAMES, HEIGHT, WIDTH, 3)
    assert [image.size for image in checked.inputs["reference_images"]] == [(50, 30), (50, 30)]
    one = check_body({**BASE, "video": video, "reference_images": png(reference())}, gen, ServerLimits())
    assert len(one.inputs["reference_images"]) == 1
    small = upload(np.zeros((FRAMES, 32, 32, 3), np.uint8), "small.mp4")
    with pytest.raises(RequestProblem, match="mask") as caught:
        check_body({**BASE, "video": video, "mask": small}, gen, ServerLimits())
    assert caught.value.field == "mask" and "not 32x32" in str(caught.value)


@pytest.mark.slow
def test_a_memory_budget_plans_the_control_stage(vace_dir, tmp_path, log):
    """offload = auto plans the folder's default request (a blank control stands in for the video) with the control
    stage's memory counted, and the guard then admits a request with reference images."""
    import shutil

    folder = tmp_path / "tiny-wan-vace"
    shutil.copytree(vace_dir, folder)
    (folder / "composer.json").write_text(json.dumps({"family": "wan2.1-vace", "sampling": {
        "height": HEIGHT, "width": WIDTH, "num_frames": FRAMES, "num_inference_steps": 3}}))
    gen = VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False, offload="auto", memory_budget=8e9)
    assert "VaceCondition" in log.getvalue() and gen.pipeline.runtime.offload == "none"
    result = gen.generate_video(**BASE, video=frames(), reference_images=reference(), seed=1)
    assert result.frames.shape == (FRAMES, HEIGHT, WIDTH, 3)
