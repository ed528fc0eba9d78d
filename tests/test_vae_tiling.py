"""Exact tiled decoding of the Wan VAE (composer/stages/vae_tiling.py): the trunk (mid block and first up blocks) on
whole frames, the last two up blocks in tiles with a halo as wide as their receptive field: the frames equal the
whole decode, where diffusers' blended tiles differ."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from composer import VideoGenerator
from composer.stages.decoding import video_to_frames
from composer.stages.vae_tiling import decode_tiled, default_trunk_blocks, head_radius
from composer.testing import build_tiny_wan


def wan_vae(**kwargs):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan(**kwargs).eval()


def uint8_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((video_to_frames(a).int() - video_to_frames(b).int()).abs().max())


@pytest.mark.parametrize("kwargs, tile", [
    pytest.param(dict(base_dim=16, num_res_blocks=1), 4, marks=pytest.mark.slow),  # Wan2.1's layout; tiles of 4
    pytest.param(dict(base_dim=16, num_res_blocks=1, z_dim=48, is_residual=True, in_channels=12, out_channels=12,
                      patch_size=2, scale_factor_spatial=16, dim_mult=[1, 2, 4, 4],
                      temperal_downsample=[False, True, True], latents_mean=[0.0] * 48, latents_std=[1.0] * 48), 3,
                 marks=pytest.mark.slow),  # Wan2.2 TI2V's: residual up blocks, patchified
])
def test_tiled_decode_equals_the_whole_decode(kwargs, tile):
    vae = wan_vae(**kwargs)
    z = torch.randn(1, vae.config.z_dim, 3, 10, 14, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        whole = vae.decode(z, return_dict=False)[0]
    tiled = decode_tiled(vae, z, tile=tile)
    assert tiled.shape == whole.shape
    assert float((tiled - whole).abs().max()) < 1e-4 and uint8_diff(tiled, whole) <= 1
    # a tile as large as the frame is the whole decode's arithmetic
    assert float((decode_tiled(vae, z, tile=64) - whole).abs().max()) < 1e-5


@pytest.mark.parametrize("kwargs, tile", [
    (dict(base_dim=16, num_res_blocks=1), 3),  # Wan2.1's encoder: the full-resolution layers and a stride-2 conv
    (dict(base_dim=16, num_res_blocks=1, z_dim=48, is_residual=True, in_channels=12, out_channels=12, patch_size=2,
          scale_factor_spatial=16, dim_mult=[1, 2, 4, 4], temperal_downsample=[False, True, True],
          latents_mean=[0.0] * 48, latents_std=[1.0] * 48), 2),  # Wan2.2's: patchified, residual down blocks
])
def test_tiled_encode_equals_the_whole_encode(kwargs, tile):
    """The encoder's full-resolution head in tiles (halo, causal cache per tile), the rest on whole frames: the
    posterior mean equals the whole encode's, over the first frame alone and two 4-frame chunks."""
    from composer.stages.vae_tiling import encode_mode, encode_tiled

    vae = wan_vae(**kwargs)
    x = torch.rand(1, 3, 9, 80, 112, generator=torch.Generator().manual_seed(1)) * 2 - 1
    with torch.inference_mode():
        whole = vae.encode(x).latent_dist.mode()
        tiled = encode_tiled(vae, x, tile=tile)  # 10 x 14 (or 5 x 7) latents: several tiles each way
        assert tiled.shape == whole.shape
        assert float((tiled - whole).abs().max()) < 1e-5
        assert torch.equal(encode_mode(vae, x, None), whole)  # no tile size: the plain encode


@pytest.mark.slow
def test_the_halo_is_needed_and_diffusers_tiling_is_not_exact():
    vae = wan_vae(base_dim=16, num_res_blocks=1)
    blocks = default_trunk_blocks(vae)
    assert blocks == 2 and head_radius(vae.decoder, blocks) > 2  # the last two up blocks' receptive field
    z = torch.randn(1, 16, 2, 24, 24, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        whole = vae.decode(z, return_dict=False)[0]
        vae.enable_tiling(tile_sample_min_height=96, tile_sample_min_width=96, tile_sample_stride_height=64,
                          tile_sample_stride_width=64)
        theirs = vae.decode(z, return_dict=False)[0]
        vae.disable_tiling()
    ours = decode_tiled(vae, z, tile=8)
    assert uint8_diff(ours, whole) <= 1
    assert uint8_diff(theirs, whole) > 1  # blended independent tiles: not the whole decode


def test_vae_tile_size_gives_the_same_video(tmp_path):
    folder = build_tiny_wan(tmp_path / "wan")
    video = dict(num_frames=9, height=96, width=128, num_inference_steps=2, seed=4)
    whole = VideoGenerator.from_pretrained(str(folder), device="cpu", progress=False).generate_video("a fox", **video)
    tiled_gen = VideoGenerator.from_pretrained(str(folder), device="cpu", vae_tile_size=4, progress=False)
    assert tiled_gen.pipeline.stage("DecodingStage").tile_size == 4
    tiled = tiled_gen.generate_video("a fox", **video)
    assert int(np.abs(tiled.frames.astype(int) - whole.frames.astype(int)).max()) <= 1


@pytest.mark.slow
def test_vae_tile_size_tiles_an_image_to_videos_encode_too(ti2v_dir):
    """Wan2.2 TI2V's image mode encodes its first frame through the tiled encoder: the same video."""
    from test_wan_i2v import make_image

    request = dict(prompt="a fox", image=make_image(96, 64, seed=5), height=64, width=96, num_frames=5,
                   num_inference_steps=2, seed=3, guidance_scale=1.0)
    whole = VideoGenerator.from_pretrained(ti2v_dir, dtype="fp32", progress=False).generate_video(**request)
    gen = VideoGenerator.from_pretrained(ti2v_dir, dtype="fp32", vae_tile_size=2, progress=False)
    assert gen.pipeline.stage("FirstFrameLatentStage").tile_size == 2
    tiled = gen.generate_video(**request)
    torch.testing.assert_close(tiled.latents, whole.latents, atol=1e-4, rtol=0)
    assert int(np.abs(tiled.frames.astype(int) - whole.frames.astype(int)).max()) <= 1


@pytest.mark.slow
def test_the_vae_benchmark_runs(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "vae.py"
    out = tmp_path / "vae.json"
    run = subprocess.run([sys.executable, str(script), "--families", "wan2.1", "--ways", "exact-tiled,streamed", "--size",
                          "5x64x64", "--tile", "4", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = {r["way"]: r for r in json.loads(out.read_text())}
    assert rows["exact-tiled"]["max_uint8_diff"] <= 1 and rows["streamed"]["max_uint8_diff"] == 0
    assert all(r["peak"] > 0 and r["traced"] > 0 for r in rows.values())


def _split_worker(rank: int, world: int, out_dir: str) -> None:
    """One rank of composer.testing.distributed.spawn (gloo initialised, one thread)."""
    import torch.distributed as dist

    vae = wan_vae(base_dim=16, num_res_blocks=1)  # the same seeded weights on every rank
    z = torch.randn(1, 16, 3, 10, 14, generator=torch.Generator().manual_seed(1))
    torch.save(decode_tiled(vae, z, tile=4, group=dist.group.WORLD), f"{out_dir}/rank{rank}.pt")


@pytest.mark.slow  # (process launches: the full tier)
@pytest.mark.parametrize("world", [2, 4])
def test_a_decode_split_over_ranks_equals_one_rank(tmp_path, world):
    """Each rank decodes its share of the tiles (the trunk on all), the tiles summed into every rank's video: the
    video one process decodes, on every rank."""
    from composer.testing.distributed import spawn

    # ranks forked from the preloaded forkserver (torch.multiprocessing.spawn re-imported torch and diffusers in
    # every rank: 12 s for 4 ranks on 2 cores)
    spawn(_split_worker, world, str(tmp_path), timeout_s=240, collective_timeout_s=60)
    vae = wan_vae(base_dim=16, num_res_blocks=1)
    z = torch.randn(1, 16, 3, 10, 14, generator=torch.Generator().manual_seed(1))
    one = decode_tiled(vae, z, tile=4)
    for rank in range(world):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert torch.equal(got, one), rank  # the same tiles, computed on another rank: the same bits


@pytest.mark.slow
def test_a_stream_decodes_its_blocks_in_tiles(tiny_causal_dir):
    """A causal stream with vae_tile_size decodes each block in exact tiles, the tiles' causal caches carried from
    block to block: the frames of a whole-video tiled decode (the same video as untiled, <= 1 level)."""
    from composer.stages.decoding import StreamDecodeState

    request = dict(height=48, width=80, num_frames=21, seed=3)  # 6 x 10 latents, 6 latent frames: 3 blocks
    whole = VideoGenerator.from_pretrained(tiny_causal_dir, progress=False).generate_video("waves", **request)
    gen = VideoGenerator.from_pretrained(tiny_causal_dir, progress=False, vae_tile_size=4)
    stream = gen.stream_video("waves", **request)
    chunks = [chunk.frames for chunk in stream]
    assert len(chunks) == 3
    assert int(np.abs(stream.frames.astype(int) - whole.frames.astype(int)).max()) <= 1
    tiled = gen.generate_video("waves", **request)  # the whole-video tiled decode, the same arithmetic
    assert np.array_equal(stream.frames, tiled.frames)
    state = stream._batch.get(StreamDecodeState)  # the stream decoder this stream used
    assert state.decoder.tiled is not None and state.fork().decoder.tiled is not state.decoder.tiled
