"""torch.compile on each family added for issue 36 (Wan video-to-video, Wan VACE, SkyReels-V2 diffusion forcing,
HunyuanVideo-1.5, Wan2.2-Animate) and on HunyuanVideo: the tiny model with `compile="regional"`, as users run it, gives the eager run's
video (latents <= 1e-4 in fp32, frames <= 1 uint8), each block compiles without a graph break into the graphs named
below, and a second video of the same size compiles nothing. Each family runs its own small request from its test
file, on its tiny builder. (Compiling costs 5-20 s a family on 2 CPU cores: all slow.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import max_uint8_diff

from composer import VideoGenerator

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def wan_v2v() -> tuple[Callable[[Path], Path], dict]:
    from test_wan_v2v import CASES, REQUEST, frames

    from composer.testing import build_tiny_wan

    return build_tiny_wan, {**REQUEST, **CASES["cfg-0.6"], "video": frames()}


def wan_vace() -> tuple[Callable[[Path], Path], dict]:
    from test_wan_vace import BASE, CASES, reference

    from composer.testing.tiny_wan_vace import build_tiny_wan_vace

    # the control video, its mask and a reference image: every input the control blocks read
    return build_tiny_wan_vace, {**BASE, **CASES["cfg-mask"], "reference_images": reference()}


def skyreels_df() -> tuple[Callable[[Path], Path], dict]:
    from test_skyreels_df import REQUEST

    from composer.testing.tiny_skyreels import build_tiny_skyreels_df

    # the smallest asynchronous request with a block-causal mask: 4 latent frames in 2 blocks of 2, a step apart
    # (per-frame timesteps and the mask both reach the compiled blocks), with CFG
    return build_tiny_skyreels_df, {**REQUEST, "num_frames": 13, "ar_step": 1, "causal_block_size": 2}


def hunyuan_video15() -> tuple[Callable[[Path], Path], dict]:
    from test_hunyuan_video15 import CASES, SMALL

    from composer.testing.tiny_hunyuan15 import build_tiny_hunyuan15

    return build_tiny_hunyuan15, {**SMALL, **CASES["cfg"]}


def hunyuan_video() -> tuple[Callable[[Path], Path], dict]:
    from test_hunyuan_video import CASES, SMALL

    from composer.testing.tiny_hunyuan import build_tiny_hunyuan

    # true CFG with a shorter negative prompt: the text key mask reaches both kinds of block
    return build_tiny_hunyuan, {**SMALL, **CASES["true-cfg"]}


def wan_animate() -> tuple[Callable[[Path], Path], dict]:
    from test_wan_animate import BASE, CASES

    from composer.testing.tiny_wan_animate import build_tiny_wan_animate

    # 11 frames: 3 segments of 5, each after the first carrying a frame over
    return build_tiny_wan_animate, {**BASE, **CASES["animate"]}


# family -> (builder and request, the distinct block graphs one video compiles: one per kind of block; VACE's
# are the Wan block, the first control block (with its input projection) and the other control blocks)
FAMILIES = {
    "wan-v2v": (wan_v2v, 1),
    "wan-vace": (wan_vace, 3),
    "skyreels-v2-df": (skyreels_df, 1),
    "hunyuan-video-1.5": (hunyuan_video15, 1),
    "hunyuan-video": (hunyuan_video, 2),  # the dual-stream block and the single-stream block
    "wan-animate": (wan_animate, 1),
}


def _reset_dynamo() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()  # reset() keeps the counters


@pytest.mark.parametrize("family", list(FAMILIES))
def test_regional_compile_gives_the_eager_video(family, tmp_path):
    make, graphs = FAMILIES[family]
    build, request = make()
    folder = build(tmp_path / family)
    eager = VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False).generate_video(**request)

    from torch._dynamo.utils import counters

    _reset_dynamo()
    gen = VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False, compile="regional")
    hook = next(line for line in gen.pipeline.applied_hooks if line.startswith("compile:"))
    assert "blocks, one compiled graph reused" in hook, hook  # the blocks, not the whole model as a fallback
    result = gen.generate_video(**request)
    assert not counters["graph_break"], f"graph breaks: {dict(counters['graph_break'])}"
    assert int(counters["stats"]["unique_graphs"]) == graphs
    assert float((result.latents - eager.latents).abs().max()) <= 1e-4
    assert result.frames.shape == eager.frames.shape and max_uint8_diff(result.frames, eager.frames) <= 1

    other = gen.generate_video(**{**request, "seed": request["seed"] + 1})  # same size: nothing new to compile
    assert int(counters["stats"]["unique_graphs"]) == graphs, "recompiled between videos of the same size"
    assert not torch.equal(other.latents, result.latents)
