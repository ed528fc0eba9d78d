"""Wan2.1 image-to-video under sequence parallel (Ulysses) and tensor parallel on 2 gloo ranks equals one process:
the same latents (<= 1e-5, fp32) and frames (<= 1) for one CFG request at a size whose tokens per frame divide
by no degree. The image's k/v projections are split over the tensor-parallel ranks like the text's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_wan_i2v import make_image

from composer.testing import build_tiny_wan_i2v
from composer.testing.distributed import spawn

REQUEST = dict(prompt="a red kite over the sea", negative_prompt="blurry", height=48, width=80, num_frames=5,
               num_inference_steps=2, guidance_scale=5.0, seed=21)


@pytest.fixture(scope="module")
def folder_and_image(tmp_path_factory):
    root = tmp_path_factory.mktemp("i2v-parallel")
    make_image(60, 40, seed=3).save(root / "first.png")
    return str(build_tiny_wan_i2v(root / "tiny-wan-i2v", seed=5)), str(root / "first.png")


def _generate(folder, image, **runtime):
    from composer import VideoGenerator

    gen = VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False, **runtime)
    if runtime.get("tp_size", 1) > 1:  # the image k/v projections hold this rank's heads only
        attn = gen.pipeline.modules["transformer"].blocks[0].attn2
        assert attn.add_k_proj.weight.shape[0] == attn.to_q.weight.shape[1] // runtime["tp_size"]
    return gen.generate_video(image=image, **REQUEST)


def _worker(rank, world, folder, image, runtime, out):
    result = _generate(folder, image, **runtime)
    torch.save({"latents": result.latents, "frames": torch.from_numpy(result.frames)}, f"{out}/rank{rank}.pt")


@pytest.mark.parametrize("runtime", [dict(ulysses_degree=2), pytest.param(dict(tp_size=2), marks=pytest.mark.slow)],
                         ids=["ulysses2", "tp2"])
def test_layout_equals_one_process(folder_and_image, runtime, tmp_path, one_thread):
    folder, image = folder_and_image
    expected = _generate(folder, image)
    spawn(_worker, 2, folder, image, runtime, str(tmp_path), timeout_s=300)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(got["latents"], expected.latents, atol=1e-5, rtol=0)
        assert np.abs(got["frames"].numpy().astype(int) - expected.frames.astype(int)).max() <= 1
