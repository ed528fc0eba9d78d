"""Causal streaming video: KV cache == recompute, parity with a Self-Forcing reference, streaming, prompt
switching, start frames, rollouts, converter."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import write_self_forcing_checkpoint
from reference import self_forcing as sf

from composer import VideoGenerator
from composer.convert.self_forcing import CausalSettings, convert_self_forcing
from composer.errors import CheckpointError, InvalidInputError, ModelFormatError

H, W = 32, 48  # latent 4x6, 6 tokens per frame: nothing like Self-Forcing's hard-coded 480x832


def frames_for(latent_frames: int) -> int:
    return 4 * (latent_frames - 1) + 1


@pytest.fixture(scope="module")
def sf_checkpoint(tiny_wan_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("sf") / "self_forcing.pt"
    raw = write_self_forcing_checkpoint(tiny_wan_dir, path, fsdp=True)
    return path, raw


def _convert(tiny_wan_dir, sf_checkpoint, tmp_path_factory, name, **settings):
    out = tmp_path_factory.mktemp("causal") / name
    return convert_self_forcing(sf_checkpoint[0], tiny_wan_dir, out, settings=CausalSettings(**settings))


@pytest.fixture(scope="module")
def global_dir(tiny_wan_dir, sf_checkpoint, tmp_path_factory):
    return _convert(tiny_wan_dir, sf_checkpoint, tmp_path_factory, "global")


@pytest.fixture(scope="module")
def window_dir(tiny_wan_dir, sf_checkpoint, tmp_path_factory):
    return _convert(tiny_wan_dir, sf_checkpoint, tmp_path_factory, "window", num_frames_per_block=2,
                    local_attn_size=5, sink_size=1)


@pytest.fixture(scope="module")
def global_gen(global_dir):
    return VideoGenerator.from_pretrained(global_dir, progress=False)


@pytest.fixture(scope="module")
def window_gen(window_dir):
    return VideoGenerator.from_pretrained(window_dir, progress=False)


# -- KV cache == uncached block-causal recompute --------------------------------------------------------
@pytest.mark.parametrize("which", ["global", "window"])
@pytest.mark.parametrize("size", [(H, W), (48, 32)])
def test_kv_cache_matches_recompute(which, size, global_gen, window_gen):
    gen = global_gen if which == "global" else window_gen
    n = gen.pipeline.config.num_frames_per_block
    kwargs = dict(height=size[0], width=size[1], num_frames=frames_for(5 * n), seed=11)
    cached = gen.generate_video("a red circle moving left", **kwargs)
    recomputed = gen.generate_video("a red circle moving left", kv_cache=False, **kwargs)
    assert cached.latents.shape == (1, 16, 5 * n, size[0] // 8, size[1] // 8)
    assert (cached.latents - recomputed.latents).abs().max().item() <= 1e-5
    assert cached.latents.std() > 0.1


# -- classifier-free guidance -------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["global", "window"])
def test_cfg_kv_cache_matches_recompute(which, global_gen, window_gen):
    """With CFG the doubled batch (cond and uncond halves of one cache) == the uncached recompute of both."""
    gen = global_gen if which == "global" else window_gen
    n = gen.pipeline.config.num_frames_per_block
    kwargs = dict(height=H, width=W, num_frames=frames_for(5 * n), seed=3, guidance_scale=4.0,
                  negative_prompt="a blue square")
    cached = gen.generate_video("a red circle moving left", **kwargs)
    recomputed = gen.generate_video("a red circle moving left", kv_cache=False, **kwargs)
    assert (cached.latents - recomputed.latents).abs().max().item() <= 1e-5
    plain = gen.generate_video("a red circle moving left", **{**kwargs, "guidance_scale": 1.0})
    assert (cached.latents - plain.latents).abs().max().item() > 1e-2  # guidance changes the video


def test_cfg_with_the_prompt_as_negative_is_the_unguided_video(window_gen):
    """cond == uncond makes u + g (c - u) = c at any g: the guided rollout (doubled cache, prefill of the
    overlap in both halves, noise drawn at the unguided batch size) must be the unguided one."""
    prompt = "a green triangle moving up"
    kwargs = dict(height=H, width=W, num_frames=frames_for(8), seed=5, rollout_blocks=2, overlap_frames=2)
    guided = window_gen.generate_video(prompt, guidance_scale=6.0, negative_prompt=prompt, **kwargs)
    plain = window_gen.generate_video(prompt, guidance_scale=1.0, **kwargs)
    assert guided.stats.rollouts == 2
    assert (guided.latents - plain.latents).abs().max().item() <= 1e-5


def test_cfg_guides_every_segment_of_a_prompt_switch(global_gen):
    """A prompt switch under CFG: the earlier segment is unchanged by what follows, the negative prompt is
    kept, and the cached path equals the recompute path."""
    kwargs = dict(height=H, width=W, seed=9, guidance_scale=3.0, negative_prompt="")
    one = global_gen.generate_video(segments=[("a red circle", 2)], **kwargs)
    two = global_gen.generate_video(segments=[("a red circle", 2), ("a blue square", 2)], **kwargs)
    two_recomputed = global_gen.generate_video(segments=[("a red circle", 2), ("a blue square", 2)],
                                               kv_cache=False, **kwargs)
    assert torch.equal(two.latents[:, :, :6], one.latents)
    assert (two.latents - two_recomputed.latents).abs().max().item() <= 1e-5


def test_a_4x_spatial_vae_sets_the_latent_size(tmp_path):
    """Latent height/width come from the folder's VAE (4x here, not Wan2.1's 8x), for the cached and the
    recompute paths, and the decoded video has the requested size."""
    from composer.testing.tiny_wan import build_tiny_wan

    base = build_tiny_wan(tmp_path / "base4x", vae_spatial=4)
    write_self_forcing_checkpoint(base, tmp_path / "sf.pt")
    gen = VideoGenerator.from_pretrained(convert_self_forcing(tmp_path / "sf.pt", base, tmp_path / "causal4x"),
                                         progress=False)
    kwargs = dict(height=H, width=W, num_frames=frames_for(6), seed=2)
    cached = gen.generate_video("a red circle", **kwargs)
    recomputed = gen.generate_video("a red circle", kv_cache=False, **kwargs)
    assert cached.latents.shape == (1, 16, 6, H // 4, W // 4) and cached.frames.shape == (21, H, W, 3)
    assert (cached.latents - recomputed.latents).abs().max().item() <= 1e-5


# -- parity with Self-Forcing's own semantics ----------------------------------------------------------
def _reference_latents(gen, checkpoint_state, prompt, seed, latent_frames, settings, height=H, width=W,
                       initial_latent=None):
    cfg = gen.pipeline.modules["transformer"].config
    model = sf.CausalWanModel(
        dim=cfg.hidden_size, ffn_dim=cfg.ffn_dim, freq_dim=cfg.freq_dim, text_dim=cfg.text_dim,
        num_heads=cfg.num_attention_heads, num_layers=cfg.num_layers,
        local_attn_size=settings.get("local_attn_size", -1), sink_size=settings.get("sink_size", 0),
    ).eval()
    state = {k.replace("model.", "", 1).replace("_fsdp_wrapped_module.", ""): v for k, v in checkpoint_state.items()}
    model.load_state_dict(state, strict=True)
    tok, enc = gen.pipeline.modules["tokenizer"], gen.pipeline.modules["text_encoder"]
    ids = tok([prompt], padding="max_length", max_length=512, truncation=True, return_tensors="pt")
    with torch.no_grad():
        context = enc(ids.input_ids, ids.attention_mask).last_hidden_state
        for u, v in zip(context, ids.attention_mask.sum(1)):
            u[v:] = 0.0
        torch.manual_seed(seed)  # Self-Forcing draws everything from one generator
        noise = torch.randn(1, latent_frames, 16, height // 8, width // 8)
        out = sf.inference(
            model, context, noise, num_frame_per_block=settings.get("num_frames_per_block", 3),
            initial_latent=initial_latent,
        )
    return out.permute(0, 2, 1, 3, 4)  # [B, C, F, h, w]


@pytest.mark.parametrize(
    "which, settings",
    [("global", {}), ("window", dict(num_frames_per_block=2, local_attn_size=5, sink_size=1))],
)
def test_matches_self_forcing_reference(which, settings, global_gen, window_gen, sf_checkpoint):
    gen = global_gen if which == "global" else window_gen
    n = settings.get("num_frames_per_block", 3)
    latent_frames = 4 * n
    prompt, seed = "a blue square moving up", 1234
    ours = gen.generate_video(prompt, height=H, width=W, num_frames=frames_for(latent_frames), seed=seed)
    ref = _reference_latents(gen, sf_checkpoint[1]["generator"], prompt, seed, latent_frames, settings)
    assert (ours.latents - ref).abs().max().item() <= 1e-4
    # frames: the reference latents through the same VAE decode as Self-Forcing (clamp, (x + 1) / 2)
    vae = gen.pipeline.modules["vae"]
    from composer.stages.decoding import denormalize_latents

    with torch.no_grad():
        video = vae.decode(denormalize_latents(ref, vae.config), return_dict=False)[0]
    ref_frames = ((video * 0.5 + 0.5).clamp(0, 1)[0].permute(1, 2, 3, 0) * 255).round().to(torch.uint8).numpy()
    assert np.abs(ours.frames.astype(int) - ref_frames.astype(int)).max() <= 1


def test_start_video_matches_reference_initial_latent(global_gen, sf_checkpoint, tmp_path):
    """Video extension: the start video's latents are prefilled like Self-Forcing's initial_latent."""
    from composer.video import save_video

    rng = np.random.default_rng(0)
    clip = rng.integers(0, 255, size=(13, H, W, 3), dtype=np.uint8)  # 13 frames -> 4 latent frames
    save_video(clip, tmp_path / "start", fps=8)  # a folder of PNGs, lossless
    clip_path = tmp_path / "start.mp4"
    save_video(clip, clip_path, fps=8)
    ours = global_gen.generate_video("a cat", start_video=str(clip_path), height=H, width=W,
                                     num_frames=frames_for(4 + 6), seed=5)
    start = ours.latents[:, :, :4]
    ref = _reference_latents(global_gen, sf_checkpoint[1]["generator"], "a cat", 5, 6, {},
                             initial_latent=start.permute(0, 2, 1, 3, 4))
    assert ours.latents.shape[2] == 10
    assert (ours.latents - ref).abs().max().item() <= 1e-4


def test_start_image_is_prefilled_and_included(global_gen, tmp_path):
    import imageio.v2 as imageio

    image = np.zeros((64, 96, 3), dtype=np.uint8)
    image[:, :48] = 255  # resized to 32x48 on the way in
    imageio.imwrite(tmp_path / "start.png", image)
    result = global_gen.generate_video("a dog", start_image=str(tmp_path / "start.png"), height=H, width=W,
                                       num_frames=frames_for(1 + 3), seed=0)
    assert result.frames.shape == (frames_for(4), H, W, 3)
    with pytest.raises(InvalidInputError, match="fill whole 3-frame blocks after 1 start latent frame"):
        global_gen.generate_video("a dog", start_image=str(tmp_path / "start.png"), height=H, width=W,
                                  num_frames=frames_for(3), seed=0)


# -- streaming -----------------------------------------------------------------------------------------
def test_streamed_chunks_equal_the_whole_video(window_gen):
    kwargs = dict(height=H, width=W, num_frames=frames_for(8), seed=3)
    whole = window_gen.generate_video("waves on a beach", **kwargs)
    stream = window_gen.stream_video("waves on a beach", **kwargs)
    sizes = [len(chunk.frames) for chunk in stream]
    assert sizes == [1 + 4, 8, 8, 8]  # first latent frame decodes to 1 frame, later ones to 4
    assert np.array_equal(stream.frames, whole.frames)
    assert torch.equal(stream.latents.cpu(), whole.latents)


def test_streaming_vae_decode_equals_whole_decode(global_gen):
    from composer.stages.decoding import DecodingStage, StreamingVideoDecoder

    vae = global_gen.pipeline.modules["vae"]
    latents = torch.randn(1, 16, 7, 4, 6, generator=torch.Generator().manual_seed(0))
    whole = DecodingStage(vae)
    from composer.stages.decoding import video_to_frames

    expected = video_to_frames(whole.decode(latents)).numpy()
    decoder = StreamingVideoDecoder(vae)
    pieces = [decoder.decode(latents[:, :, s:e]) for s, e in [(0, 1), (1, 3), (3, 4), (4, 7)]]
    assert np.array_equal(np.concatenate(pieces, axis=1), expected)


def test_prompt_switch_leaves_earlier_frames_unchanged(global_gen):
    kwargs = dict(height=H, width=W, seed=9)
    a = global_gen.generate_video(segments=[("a red circle", 2), ("a blue square", 2)], **kwargs)
    b = global_gen.generate_video(segments=[("a red circle", 2), ("a green star", 1)], **kwargs)
    c = global_gen.generate_video(segments=[("a red circle", 2)], **kwargs)
    k = frames_for(2 * 3)  # frames decoded from the first two blocks
    assert a.frames.shape[0] == frames_for(12) and b.frames.shape[0] == frames_for(9)
    assert np.array_equal(a.frames[:k], b.frames[:k]) and np.array_equal(a.frames[:k], c.frames)
    assert torch.equal(a.latents[:, :, :6], c.latents)
    assert (a.latents[:, :, 6:9] - b.latents[:, :, 6:9]).abs().max() > 1e-3  # the new prompt matters


def test_stream_prompts_are_read_lazily(global_gen):
    asked = []

    def prompts():
        for prompt in ["a red circle", "a blue square"]:
            asked.append(prompt)
            yield prompt, 1

    stream = global_gen.stream_video(prompts(), height=H, width=W, seed=1)
    it = iter(stream)
    next(it)
    assert asked == ["a red circle"]  # the second prompt is not needed yet
    rest = list(it)
    assert asked == ["a red circle", "a blue square"] and [c.segment for c in rest] == [1]


def test_rollouts_restart_the_cache_from_the_overlap(global_gen, sf_checkpoint):
    """4 blocks in rollouts of 2 with an overlap of 3 latent frames == a 2-block rollout, then a rollout
    prefilled with its last 3 frames (Self-Forcing's initial_latent), the RNG carrying on."""
    prompt, seed = "a yellow ball bouncing", 77
    ours = global_gen.generate_video(prompt, height=H, width=W, num_frames=frames_for(12), seed=seed,
                                     rollout_blocks=2, overlap_frames=3)
    assert ours.stats.rollouts == 2
    gen_state = sf_checkpoint[1]["generator"]
    cfg = global_gen.pipeline.modules["transformer"].config
    model = sf.CausalWanModel(dim=cfg.hidden_size, ffn_dim=cfg.ffn_dim, freq_dim=cfg.freq_dim, text_dim=cfg.text_dim,
                              num_heads=cfg.num_attention_heads, num_layers=cfg.num_layers).eval()
    model.load_state_dict({k.replace("model._fsdp_wrapped_module.", ""): v for k, v in gen_state.items()})
    tok, enc = global_gen.pipeline.modules["tokenizer"], global_gen.pipeline.modules["text_encoder"]
    ids = tok([prompt], padding="max_length", max_length=512, truncation=True, return_tensors="pt")
    with torch.no_grad():
        context = enc(ids.input_ids, ids.attention_mask).last_hidden_state
        context[0, ids.attention_mask.sum():] = 0
        torch.manual_seed(seed)
        first = sf.inference(model, context, torch.randn(1, 6, 16, 4, 6))
        second = sf.inference(model, context, torch.randn(1, 6, 16, 4, 6), initial_latent=first[:, -3:])
    ref = torch.cat([first, second[:, 3:]], dim=1).permute(0, 2, 1, 3, 4)
    assert (ours.latents - ref).abs().max().item() <= 1e-4


def test_stats_profile_the_generation(window_gen):
    stream = window_gen.stream_video("a cat", height=H, width=W, num_frames=frames_for(6), seed=0)
    chunks = list(stream)
    stats = stream.stats
    assert len(stats.block_seconds) == 3 and all(s > 0 for s in stats.block_seconds)
    assert 0 < stats.time_to_first_frame <= stats.total_seconds
    assert stats.frames == len(stream.frames) == sum(len(c.frames) for c in chunks)
    assert stats.frames_per_second > 0
    cfg = window_gen.pipeline.modules["transformer"].config
    # window of 5 frames of 6 tokens, keys + values, fp32, every layer
    assert stats.kv_cache_bytes == 2 * cfg.num_layers * 5 * 6 * cfg.num_attention_heads * cfg.attention_head_dim * 4
    assert "time to first frame" in stats.summary()


def test_causal_input_errors(global_gen):
    with pytest.raises(InvalidInputError, match="guidance_scale = -1.0"):
        global_gen.generate_video("x", height=H, width=W, num_frames=frames_for(3), guidance_scale=-1.0)
    with pytest.raises(InvalidInputError, match="num_inference_steps = 8: expected 4"):
        global_gen.generate_video("x", height=H, width=W, num_frames=frames_for(3), num_inference_steps=8)
    with pytest.raises(InvalidInputError, match="nearest valid: 9"):
        global_gen.generate_video("x", height=H, width=W, num_frames=frames_for(4))
    with pytest.raises(InvalidInputError, match=r"segments\[0\] = \('x', -1\): expected a number of blocks >= 1"):
        global_gen.generate_video(segments=[("x", -1)], height=H, width=W)


def test_bidirectional_models_do_not_stream(composer_gen):
    from composer.errors import UnsupportedError

    with pytest.raises(UnsupportedError, match="cannot stream"):
        composer_gen.stream_video("x", height=32, width=32, num_frames=5)


# -- converter -----------------------------------------------------------------------------------------
def test_converter_writes_a_causal_folder(global_dir):
    index = json.loads((global_dir / "model_index.json").read_text())
    assert index["_class_name"] == "CausalWanPipeline"
    assert index["transformer"] == ["composer", "CausalWanTransformer3DModel"]
    assert index["denoising_step_list"] == [1000, 750, 500, 250] and index["timestep_shift"] == 5.0
    config = json.loads((global_dir / "transformer" / "config.json").read_text())
    assert config["_class_name"] == "CausalWanTransformer3DModel"
    from safetensors import safe_open

    with safe_open(global_dir / "transformer" / "diffusion_pytorch_model.safetensors", "pt") as f:
        assert "blocks.0.attn1.to_out.0.weight" in f.keys()  # diffusers naming


def test_converter_use_ema_takes_the_ema_weights(tiny_wan_dir, sf_checkpoint, tmp_path, global_gen):
    out = convert_self_forcing(sf_checkpoint[0], tiny_wan_dir, tmp_path / "ema", use_ema=True)
    ema = VideoGenerator.from_pretrained(out, progress=False).pipeline.modules["transformer"]
    plain = global_gen.pipeline.modules["transformer"]
    expected = sf_checkpoint[1]["generator_ema"]["model._fsdp_wrapped_module.blocks.0.self_attn.q.weight"]
    assert torch.equal(ema.blocks[0].attn1.to_q.weight, expected)
    assert not torch.equal(plain.blocks[0].attn1.to_q.weight, expected)


def test_converter_errors(tiny_wan_dir, tmp_path):
    torch.save({"critic": {}}, tmp_path / "no_generator.pt")
    with pytest.raises(CheckpointError, match="no 'generator' entry.*it has: critic"):
        convert_self_forcing(tmp_path / "no_generator.pt", tiny_wan_dir, tmp_path / "a")
    write_self_forcing_checkpoint(tiny_wan_dir, tmp_path / "sf.pt", ema=False)
    with pytest.raises(CheckpointError, match="no 'generator_ema' entry"):
        convert_self_forcing(tmp_path / "sf.pt", tiny_wan_dir, tmp_path / "b", use_ema=True)
    raw = torch.load(tmp_path / "sf.pt", weights_only=True)
    raw["generator"]["model.blocks.0.ffn.0.weight"] = torch.zeros(3, 3)
    torch.save(raw, tmp_path / "bad_shape.pt")
    with pytest.raises(CheckpointError, match="shape differs from the base model"):
        convert_self_forcing(tmp_path / "bad_shape.pt", tiny_wan_dir, tmp_path / "c")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    with pytest.raises(ModelFormatError, match="not empty"):
        convert_self_forcing(tmp_path / "sf.pt", tiny_wan_dir, tmp_path / "taken")
    with pytest.raises(ModelFormatError, match="must be >= num_frames_per_block"):
        convert_self_forcing(tmp_path / "sf.pt", tiny_wan_dir, tmp_path / "d",
                             settings=CausalSettings(local_attn_size=3, sink_size=1))
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="not a readable torch checkpoint"):
        convert_self_forcing(tmp_path / "garbage.pt", tiny_wan_dir, tmp_path / "e")


def test_endless_stream_mode_keeps_only_what_the_next_rollout_needs(global_gen):
    """keep_video=False (the CLI's streams) gives the same chunks while holding only the overlap frames."""
    kwargs = dict(height=H, width=W, seed=4, rollout_blocks=1, overlap_frames=2)
    segments = [("a red circle", 2), ("a blue square", 2)]
    kept = global_gen.stream_video(segments, **kwargs)
    kept_chunks = [c.frames for c in kept]
    lean = global_gen.stream_video(segments, keep_video=False, **kwargs)
    lean_chunks = [c.frames for c in lean]
    assert all(np.array_equal(a, b) for a, b in zip(kept_chunks, lean_chunks)) and len(lean_chunks) == 4
    assert lean.chunks == [] and lean.frames.shape[0] == 0
    assert lean.latents.shape[2] == 2 and torch.equal(lean.latents, kept.latents[:, :, -2:])


def test_kv_cache_offload_gives_the_same_video(global_dir):
    offloaded = VideoGenerator.from_pretrained(global_dir, progress=False, kv_cache_offload=True)
    plain = VideoGenerator.from_pretrained(global_dir, progress=False)
    kwargs = dict(height=H, width=W, num_frames=frames_for(6), seed=2)
    a = offloaded.generate_video("a cat", **kwargs)
    b = plain.generate_video("a cat", **kwargs)
    assert torch.equal(a.latents, b.latents)


def test_causal_folder_named_like_a_released_model_gets_the_causal_family(global_dir, tmp_path):
    import shutil

    renamed = tmp_path / "Wan2.1-T2V-1.3B-Diffusers"
    shutil.copytree(global_dir, renamed)
    gen = VideoGenerator.from_pretrained(renamed, progress=False)
    assert gen.family == "causal-wan2.1-t2v"
    result = gen.generate_video(segments=iter([("a cat", 1)]), height=H, width=W, seed=0)
    assert result.frames.shape[0] == frames_for(3)


def test_converter_refuses_a_sink_without_a_window(tiny_wan_dir, sf_checkpoint, tmp_path):
    with pytest.raises(ModelFormatError, match="sink_size needs a rolling window"):
        convert_self_forcing(sf_checkpoint[0], tiny_wan_dir, tmp_path / "x", settings=CausalSettings(sink_size=2))
