"""Exact tiled decoding for the HunyuanVideo VAEs (composer/stages/vae_tiling_hunyuan.py): HunyuanVideo's GroupNorms
take the whole video's statistics from the tiles' sums; HunyuanVideo-1.5's head is local."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from composer.stages.vae_tiling_hunyuan import decode_tiled_hunyuan, head_radius, supports_hunyuan_tiling


def hunyuan_vae(seed: int = 0):
    from diffusers import AutoencoderKLHunyuanVideo

    torch.manual_seed(seed)
    vae = AutoencoderKLHunyuanVideo(
        latent_channels=4, block_out_channels=(16, 32, 32, 32), layers_per_block=1, norm_num_groups=4,
        down_block_types=("HunyuanVideoDownBlock3D",) * 4, up_block_types=("HunyuanVideoUpBlock3D",) * 4).eval()
    with torch.no_grad():  # GroupNorm's affine starts at (1, 0): give it values, so the statistics matter everywhere
        for name, param in vae.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
    return vae


def hunyuan15_vae(seed: int = 0):
    from diffusers import AutoencoderKLHunyuanVideo15

    torch.manual_seed(seed)
    return AutoencoderKLHunyuanVideo15(latent_channels=8, block_out_channels=(16, 16, 32, 32, 32),
                                       layers_per_block=1, spatial_compression_ratio=16).eval()


def uint8_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    to_u8 = lambda v: ((v.clamp(-1, 1) + 1) * 127.5).round().to(torch.int16)  # noqa: E731
    return int((to_u8(a) - to_u8(b)).abs().max())


@pytest.mark.parametrize("frames, size", [(2, (12, 20)), pytest.param(6, (8, 12), marks=pytest.mark.slow)])  # 6 latent frames: HunyuanVideo's own
def test_hunyuan_tiled_decode_equals_the_whole_decode(frames, size):  # decode splits them in time (4 + 1, by 3)
    vae = hunyuan_vae()
    z = torch.randn(1, 4, frames, *size, generator=torch.Generator().manual_seed(frames))
    with torch.inference_mode():
        whole = vae.decode(z).sample
        tiled = decode_tiled_hunyuan(vae, z, tile=4)
        vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=24,
                          tile_sample_stride_width=24)
        theirs = vae.decode(z).sample
    assert tiled.shape == whole.shape
    torch.testing.assert_close(tiled, whole, atol=5e-5, rtol=0)
    assert uint8_diff(tiled, whole) <= 1
    assert uint8_diff(theirs, whole) > 2  # diffusers' tiles normalise by their own statistics: not the whole decode


@pytest.mark.slow
def test_hunyuan_tiles_need_the_whole_videos_statistics(monkeypatch):
    """With each tile's own GroupNorm statistics (what a tile decoded alone gets) the frames are far off: the sums
    over every tile are what makes the tiles exact; and without the halo the seams show."""
    import composer.stages.vae_tiling_hunyuan as tiling

    vae = hunyuan_vae()
    z = torch.randn(1, 4, 2, 12, 20, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        whole = vae.decode(z).sample
        real_add = tiling._GroupSums.add
        seen: list[int] = []

        def own_statistics_only(self, x, groups):  # every tile normalised by the last tile's sums only
            seen.append(1)
            self.count, self.s1, self.s2 = 0, None, None
            real_add(self, x, groups)

        monkeypatch.setattr(tiling._GroupSums, "add", own_statistics_only)
        local = decode_tiled_hunyuan(vae, z, tile=4)
        monkeypatch.undo()
        monkeypatch.setattr(tiling, "head_radius", lambda *a: 0.0)
        no_halo = decode_tiled_hunyuan(vae, z, tile=4)
    assert seen and uint8_diff(local, whole) > 2 and uint8_diff(no_halo, whole) > 2


@pytest.mark.slow
def test_hunyuan15_tiled_decode_equals_the_whole_decode():
    vae = hunyuan15_vae()
    z = torch.randn(1, 8, 3, 6, 10, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        whole = vae.decode(z).sample
        tiled = decode_tiled_hunyuan(vae, z, tile=2)
    torch.testing.assert_close(tiled, whole, atol=5e-5, rtol=0)


def test_the_head_radius_is_measured_from_its_convolutions():
    vae = hunyuan_vae()  # trunk at 4x: 4 convs there (reach 1 each), the upsampler's conv and 4 more at 8x, conv_out
    assert head_radius(vae, 2, torch.zeros(1, 32, 1, 4, 4)) == pytest.approx(4 + 0.5 + 2 + 0.5)
    assert supports_hunyuan_tiling(vae) and supports_hunyuan_tiling(hunyuan15_vae())
    from diffusers import AutoencoderKLWan

    assert not supports_hunyuan_tiling(AutoencoderKLWan(base_dim=8, z_dim=4, num_res_blocks=1))


def test_bad_tiles_are_refused():
    with pytest.raises(ValueError, match="positive"):
        decode_tiled_hunyuan(hunyuan_vae(), torch.zeros(1, 4, 1, 4, 4), tile=0)
    from diffusers import AutoencoderKLWan

    with pytest.raises(TypeError, match="HunyuanVideo VAE"):
        decode_tiled_hunyuan(AutoencoderKLWan(base_dim=8, z_dim=4, num_res_blocks=1), torch.zeros(1, 4, 1, 4, 4))


@pytest.mark.parametrize("family", ["hunyuan", "hunyuan15"])
def test_vae_tile_size_gives_the_same_video(tmp_path, family):
    from composer import VideoGenerator

    if family == "hunyuan":
        from composer.testing.tiny_hunyuan import build_tiny_hunyuan as build
    else:
        from composer.testing.tiny_hunyuan15 import build_tiny_hunyuan15 as build
    folder = build(tmp_path / family)
    request = dict(prompt="a fox", num_frames=9, height=64, width=96, num_inference_steps=2, seed=4)
    whole = VideoGenerator.from_pretrained(str(folder), progress=False).generate_video(**request)
    gen = VideoGenerator.from_pretrained(str(folder), vae_tile_size=2, progress=False)
    tiled = gen.generate_video(**request)
    assert int(np.abs(tiled.frames.astype(int) - whole.frames.astype(int)).max()) <= 1


@pytest.mark.parametrize("shape", [(1, 3, 1, 96, 160), (1, 3, 5, 64, 96)])  # an image (I2V's encode) and a video
def test_hunyuan15_tiled_encode_equals_the_whole_encode(shape, monkeypatch):
    import composer.stages.vae_tiling_hunyuan as tiling
    from composer.stages.vae_tiling import encode_mode

    vae = hunyuan15_vae()
    video = torch.rand(shape, generator=torch.Generator().manual_seed(4)) * 2 - 1
    with torch.inference_mode():
        whole = vae.encode(video).latent_dist.mode()
        tiled = encode_mode(vae, video, tile_size=2)  # 32-pixel tiles: several a side
        monkeypatch.setattr(tiling, "_encoder_head_geometry", lambda *a: (2, 0.0))
        no_halo = tiling.encode_tiled_hunyuan15(vae, video, tile=2)
    assert tiled.shape == whole.shape
    torch.testing.assert_close(tiled, whole, atol=1e-5, rtol=0)
    assert float((no_halo - whole).abs().max()) > 1e-3  # the halo is what makes it exact


def test_hunyuan15_image_to_video_with_tiles_gives_the_same_video(tmp_path):
    from test_hunyuan_video15 import make_image

    from composer import VideoGenerator
    from composer.testing.tiny_hunyuan15 import build_tiny_hunyuan15_i2v

    folder = build_tiny_hunyuan15_i2v(tmp_path / "i2v")
    request = dict(prompt="a sign in the wind", image=make_image(96, 64, seed=2), height=64, width=96,
                   num_frames=5, num_inference_steps=2, seed=3)
    whole = VideoGenerator.from_pretrained(str(folder), progress=False).generate_video(**request)
    gen = VideoGenerator.from_pretrained(str(folder), vae_tile_size=2, progress=False)
    assert gen.pipeline.stage("FirstFrameConditionStage").tile_size == 2
    tiled = gen.generate_video(**request)
    torch.testing.assert_close(tiled.latents, whole.latents, atol=1e-4, rtol=0)
    assert int(np.abs(tiled.frames.astype(int) - whole.frames.astype(int)).max()) <= 1


def _split_worker(rank: int, world: int, out_dir: str) -> None:
    import torch.distributed as dist

    vae = hunyuan_vae()  # the same seeded weights on every rank
    z = torch.randn(1, 4, 2, 12, 20, generator=torch.Generator().manual_seed(1))
    torch.save(decode_tiled_hunyuan(vae, z, tile=4, group=dist.group.WORLD), f"{out_dir}/rank{rank}.pt")


@pytest.mark.slow  # (process launches: the full tier)
@pytest.mark.parametrize("world", [2, 4])
def test_a_hunyuan_decode_split_over_ranks_equals_one_rank(tmp_path, world):
    """Each rank decodes its share of the tiles, the GroupNorm sums all-reduced at every norm: one process's video
    on every rank."""
    from composer.testing.distributed import spawn

    spawn(_split_worker, world, str(tmp_path), timeout_s=240, collective_timeout_s=60)
    vae = hunyuan_vae()
    z = torch.randn(1, 4, 2, 12, 20, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        one = decode_tiled_hunyuan(vae, z, tile=4)
    for rank in range(world):
        torch.testing.assert_close(torch.load(tmp_path / f"rank{rank}.pt"), one, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_the_memory_predictor_traces_the_tiled_decode():
    """The planner's fake trace runs the same code: a tiled HunyuanVideo decode predicts less than the whole one."""
    from composer.memory.trace import LiveBytes, fake_mode

    vae = hunyuan_vae()
    # 384x640 pixels: at 192x320 the peak is a trunk convolution's im2col buffer on whole frames (the CPU's native
    # kernel), which tiles do not change (8-pixel tiles: traced 229.7 vs 230.6 MiB, measured 229.5 vs 230.5)
    z = torch.randn(1, 4, 2, 48, 80)
    peaks = {}
    for way in ("whole", "tiled"):
        with fake_mode() as fake:
            zf = fake.from_tensor(z)
            with LiveBytes() as live, torch.inference_mode():
                vae.decode(zf) if way == "whole" else decode_tiled_hunyuan(vae, zf, tile=16)
        peaks[way] = live.peak
    # on the CPU the waiting tiles stay where they are (on an accelerator they wait on the host): the saving here is
    # the working set of one tile instead of the whole frame's (traced 496.5 vs 918.7 MiB; measured 496.5 vs
    # 918.6)
    assert 0 < peaks["tiled"] < 0.75 * peaks["whole"]
