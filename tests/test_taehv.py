"""The tiny TAEHV preview decoder (composer/models/taehv.py): the released files' key layout loads strictly, a
block-by-block decode equals the whole decode, frame counts and sizes follow the VAE's rule, wrong files are refused
clearly, and a causal stream with `preview_decoder` set streams its previews."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from composer.errors import ConfigError, InvalidInputError, UnsupportedError
from composer.models.taehv import PreviewDecoderConfig, TinyVideoDecoder, infer_config, load_preview_decoder

WAN21 = PreviewDecoderConfig()  # taew2_1.pth: 16 latent channels, patch 1, frames x1 x2 x2
WAN22 = PreviewDecoderConfig(latent_channels=48, patch_size=2)  # taew2_2.pth
WAN22_SUPER = PreviewDecoderConfig(latent_channels=48, patch_size=2, variant="super")  # taew2_2_super.pth

# Key names and shapes of the released files, read off the reference (github.com/madebyollin/taehv, taehv.py:
# TAEHV.decoder, an nn.Sequential): a drift in composer's layer order would stop the released files loading.
RELEASED_WAN21_KEYS = {
    "decoder.1.weight": (256, 16, 3, 3),  # 0 is the parameterless clamp
    "decoder.1.bias": (256,),
    "decoder.3.conv.0.weight": (256, 512, 3, 3),  # a memory block sees [x, previous x]
    "decoder.3.conv.4.bias": (256,),
    "decoder.7.conv.weight": (256, 256, 1, 1),  # the first frame expansion: x1
    "decoder.8.weight": (128, 256, 3, 3),  # no bias
    "decoder.13.conv.weight": (256, 128, 1, 1),  # x2
    "decoder.17.conv.2.weight": (64, 64, 3, 3),
    "decoder.19.conv.weight": (128, 64, 1, 1),  # x2
    "decoder.20.weight": (64, 64, 3, 3),
    "decoder.22.weight": (3, 64, 3, 3),
    "decoder.22.bias": (3,),
}
RELEASED_WAN22_SUPER_KEYS = {
    "decoder.0.weight": (512, 48, 1, 1),
    "decoder.1.conv.0.weight": (1024, 1, 7, 7),
    "decoder.1.conv.1.weight": (2048, 1024, 1, 1),
    "decoder.1.conv.3.weight": (512, 2048, 1, 1),
    "decoder.4.weight": (1024, 512, 3, 3),
    "decoder.7.conv.weight": (256, 256, 1, 1),
    "decoder.14.conv.weight": (256, 128, 1, 1),
    "decoder.21.conv.weight": (128, 64, 1, 1),
    "decoder.22.weight": (12, 64, 3, 3),
}


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny convolutions: one intra-op thread (see conftest)."""


def released_like(config: PreviewDecoderConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """A state dict in a released file's layout (decoder and some encoder tensors), random values scaled so that
    the frames are neither flat nor clamped (convolutions ~ N(0, 1 / fan_in), the output bias 0.5)."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for key, value in TinyVideoDecoder(config).state_dict().items():
        fan_in = value[0].numel() if value.ndim == 4 else 1
        state[key] = torch.randn(value.shape, generator=gen) / fan_in ** 0.5 if value.ndim == 4 else \
            torch.zeros(value.shape)
    state["decoder.22.bias"] = torch.full_like(state["decoder.22.bias"], 0.5)
    state["encoder.0.weight"] = torch.randn(64, 3 * config.patch_size ** 2, 3, 3)  # ignored on load
    state["encoder.0.bias"] = torch.randn(64)
    return state


@pytest.fixture(scope="module")
def wan21_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("taehv") / "taew2_1.pth"
    torch.save(released_like(WAN21), path)
    return path


def latents(channels: int, frames: int, h: int = 4, w: int = 6, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, channels, frames, h, w, generator=torch.Generator().manual_seed(seed))


def test_the_released_key_layout_loads_strictly(wan21_file, tmp_path):
    shapes = {k: tuple(v.shape) for k, v in TinyVideoDecoder(WAN21).state_dict().items()}
    assert {k: shapes.get(k) for k in RELEASED_WAN21_KEYS} == RELEASED_WAN21_KEYS
    assert len(shapes) == 64 and "decoder.8.bias" not in shapes  # 9 memory blocks x 6 + 10
    wide = {k: tuple(v.shape) for k, v in TinyVideoDecoder(WAN22_SUPER).state_dict().items()}
    assert {k: wide.get(k) for k in RELEASED_WAN22_SUPER_KEYS} == RELEASED_WAN22_SUPER_KEYS

    model = load_preview_decoder(wan21_file)
    assert model.config == WAN21 and model.config.frames_to_trim == 3
    saved = torch.load(wan21_file, weights_only=True)
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    from safetensors.torch import save_file

    save_file(released_like(WAN22, seed=1), tmp_path / "taew2_2.safetensors")
    assert load_preview_decoder(tmp_path / "taew2_2.safetensors").config == WAN22
    assert infer_config(released_like(WAN22_SUPER)) == WAN22_SUPER


def test_block_by_block_decode_equals_the_whole_decode(wan21_file):
    model = load_preview_decoder(wan21_file)
    z = latents(16, 7)
    with torch.inference_mode():
        whole, _ = model.decode(z)
        pieces, state = [], None
        for start, end in [(0, 1), (1, 4), (4, 7)]:  # the start frame, then blocks of 3 latent frames
            piece, state = model.decode(z[:, :, start:end], state)
            pieces.append(piece)
    assert [p.shape[2] for p in pieces] == [1, 12, 12]
    assert whole.std() > 0.1 and 0 < whole.mean() < 1  # frames neither flat nor clamped
    assert torch.allclose(torch.cat(pieces, dim=2), whole, atol=1e-5, rtol=0)


@pytest.mark.parametrize("config, scale", [(WAN21, 8), (WAN22, 16)])
def test_frame_count_and_size_follow_the_vae(config, scale):
    model = TinyVideoDecoder(config).eval()
    for k in (0, 2):  # k + 1 latent frames -> 1 + 4k frames, x8 (Wan2.1) / x16 (Wan2.2) pixels
        with torch.inference_mode():
            video = model(latents(config.latent_channels, k + 1, 2, 3))
        assert video.shape == (1, 3, 1 + 4 * k, 2 * scale, 3 * scale)
        assert config.num_frames(k + 1) == 1 + 4 * k
        assert video.min() >= 0 and video.max() <= 1


def test_streamed_previews_are_uint8_frames_of_the_whole_decode(wan21_file):
    from composer.stages.decoding import PreviewStreamDecoder, StreamDecodeState, video_to_frames

    model = load_preview_decoder(wan21_file)
    z = latents(16, 7, seed=1)
    with torch.inference_mode():
        expected = video_to_frames(model(z) * 2 - 1).numpy()
    state = StreamDecodeState(PreviewStreamDecoder(model))
    first = state.decoder.decode(z[:, :, :4])
    twin = state.fork()  # a fork goes on independently from the same point
    rest, twin_rest = state.decoder.decode(z[:, :, 4:]), twin.decoder.decode(z[:, :, 4:])
    assert first.dtype == np.uint8 and first.shape == (1, 13, 32, 48, 3)
    assert np.abs(np.concatenate([first, rest], 1).astype(int) - expected).max() <= 1
    assert np.array_equal(rest, twin_rest)
    # two streams at the same point decode as one batch, each getting its own rows and memory back
    a, b = PreviewStreamDecoder(model), PreviewStreamDecoder(model)
    a.decode(z[:, :, :1])
    b.decode(z[:, :, :1])
    assert a.batch_key(z[:, :, 1:4]) == b.batch_key(z[:, :, 1:4])
    together = PreviewStreamDecoder.decode_together([a, b], [z[:, :, 1:4], z[:, :, 1:4]])
    assert np.array_equal(together[0], together[1])
    assert np.abs(together[0].astype(int) - first[:, 1:]).max() <= 1  # float rounding of other batch shapes
    with pytest.raises(UnsupportedError, match="preview_decoder"):
        state.export()


def test_wrong_files_are_refused_clearly(wan21_file, tmp_path):
    with pytest.raises(InvalidInputError, match="no such file"):
        load_preview_decoder(tmp_path / "missing.pth")
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(InvalidInputError, match="junk.pth.*cannot be read"):
        load_preview_decoder(junk)
    other = tmp_path / "other.safetensors"
    from safetensors.torch import save_file

    save_file({"conv.weight": torch.zeros(2, 2)}, other)
    with pytest.raises(InvalidInputError, match=r"other.safetensors.*no decoder\.\* tensors"):
        load_preview_decoder(other)
    state = released_like(WAN21)
    state["decoder.3.conv.0.weight"] = torch.zeros(256, 256, 3, 3)
    del state["decoder.17.conv.4.bias"]
    state["decoder.30.weight"] = torch.zeros(1)
    bad = tmp_path / "bad.pth"
    torch.save(state, bad)
    with pytest.raises(InvalidInputError, match="bad.pth") as info:
        load_preview_decoder(bad)
    message = str(info.value)
    for part in ("1 missing tensor(s): decoder.17.conv.4.bias", "1 unexpected tensor(s): decoder.30.weight",
                 "decoder.3.conv.0.weight has shape [256, 256, 3, 3], expected [256, 512, 3, 3]"):
        assert part in message
    torch.save({"decoder.1.weight": torch.zeros(256, 16, 3, 3)}, bad)
    with pytest.raises(InvalidInputError, match="decoder.7.conv.weight"):
        load_preview_decoder(bad)
    torch.save([1, 2], bad)
    with pytest.raises(InvalidInputError, match="state dict"):
        load_preview_decoder(bad)
    from composer.runtime import RuntimeArgs

    with pytest.raises(ConfigError, match="preview_decoder = .*no such file"):
        RuntimeArgs.from_kwargs(preview_decoder=str(tmp_path / "missing.pth"))
    assert RuntimeArgs.from_kwargs(preview_decoder=str(wan21_file)).preview_decoder == str(wan21_file)


def test_a_causal_stream_streams_previews(tiny_causal_dir, wan21_file, tmp_path, one_thread):
    from composer import VideoGenerator
    from composer.stages.decoding import video_to_frames

    gen = VideoGenerator.from_pretrained(str(tiny_causal_dir), progress=False, preview_decoder=str(wan21_file))
    stage = gen.pipeline.stage("DecodingStage")
    assert stage.preview_decoder is not None
    kwargs = dict(height=32, width=32, num_frames=4 * 3 + 1, seed=0)  # 4 latent frames: 2 blocks of 2
    said = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("composer.stages.decoding")
    logger.addHandler(handler)
    try:
        stream = gen.stream_video("a red circle", **kwargs)
        chunks = list(stream)
    finally:
        logger.removeHandler(handler)
    assert any("previews from the tiny TAEHV decoder" in m for m in said)
    assert [c.frames.shape for c in chunks] == [(5, 32, 32, 3), (8, 32, 32, 3)]
    with torch.inference_mode():
        previews = video_to_frames(stage.preview_decoder(stream.latents) * 2 - 1).numpy()[0]
    assert np.abs(stream.frames.astype(int) - previews).max() <= 1
    whole = gen.generate_video("a red circle", **kwargs)  # whole videos keep the VAE
    assert np.array_equal(whole.frames, video_to_frames(stage.decode(whole.latents)).numpy()[0])
    with gen.open_session(seed=0, height=32, width=32) as session:
        list(session.extend("a red circle", 1))
        with session.fork() as child:
            assert len(np.concatenate([c.frames for c in child.extend("a red circle", 1)])) == 8
        with pytest.raises(UnsupportedError, match="preview_decoder"):
            session.snapshot()
    wrong = tmp_path / "taew2_2.pth"
    torch.save(released_like(WAN22), wrong)
    with pytest.raises(InvalidInputError, match="latent channels: 48 in the file, 16"):
        VideoGenerator.from_pretrained(str(tiny_causal_dir), progress=False, preview_decoder=str(wrong))
