"""Prompt switches of causal streams: prompt_switch = restart | keep | recache (composer/stages/causal_denoising.py).

At a switch between segments, 'restart' starts a fresh KV cache from the last overlap_frames under the new prompt
(positions from 0), 'keep' carries the old cache on (its frames keep the old prompt's cross-attention, positions go
on), 'recache' prefills a fresh cache under the new prompt with every frame the old cache attended to.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from helpers import write_self_forcing_checkpoint

from composer import VideoGenerator
from composer.cancel import CancelToken
from composer.convert.self_forcing import CausalSettings, convert_self_forcing
from composer.errors import InvalidInputError

H, W = 32, 48
MODES = ("restart", "keep", "recache")
P0, P1 = "a red circle moving left", "a blue square moving right"


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_thread):
    """Tiny models: one intra-op thread is faster on a busy machine (conftest's `one_thread`)."""


@pytest.fixture(scope="module")
def global_gen(tiny_wan_dir, tmp_path_factory):
    """Blocks of 3 latent frames, global attention."""
    root = tmp_path_factory.mktemp("switch-global")
    write_self_forcing_checkpoint(tiny_wan_dir, root / "sf.pt")
    folder = convert_self_forcing(root / "sf.pt", tiny_wan_dir, root / "causal", settings=CausalSettings())
    return VideoGenerator.from_pretrained(folder, progress=False)


@pytest.fixture(scope="module")
def window_gen(tiny_causal_dir):
    """Blocks of 2 latent frames, a rolling window of 5 frames with a 1-frame sink."""
    return VideoGenerator.from_pretrained(tiny_causal_dir, progress=False)


@pytest.fixture(params=["global", "window"])
def gen(request, global_gen, window_gen):
    return global_gen if request.param == "global" else window_gen


def n_of(gen) -> int:
    return gen.pipeline.config.num_frames_per_block


def stream(gen, segments, **kwargs):
    s = gen.stream_video(segments, height=H, width=W, seed=kwargs.pop("seed", 5), **kwargs)
    chunks = [c.frames for c in s]
    return s, chunks


# -- each mode through stream_video and sessions ---------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_a_session_extended_twice_is_the_stream_of_both_segments(gen, mode):
    s, chunks = stream(gen, [(P0, 3), (P1, 2)], prompt_switch=mode)
    with gen.open_session(seed=5, height=H, width=W, prompt_switch=mode) as session:
        first = [c.frames for c in session.extend(P0, 3)]
        second = [c.frames for c in session.extend(P1, 2)]
    assert len(first) == 3 and len(second) == 2
    assert all(np.array_equal(a, b) for a, b in zip(first + second, chunks))
    assert np.array_equal(session.frames, s.frames)


def test_one_segment_is_the_same_video_in_every_mode(gen):
    videos = {m: stream(gen, [(P0, 4)], prompt_switch=m)[0] for m in MODES}
    for mode in ("keep", "recache"):
        assert np.array_equal(videos[mode].frames, videos["restart"].frames)
        assert torch.equal(videos[mode].latents, videos["restart"].latents)


def test_the_modes_differ_only_after_the_switch(gen):
    n = n_of(gen)
    videos = {m: stream(gen, [(P0, 3), (P1, 2)], prompt_switch=m)[0] for m in MODES}
    latents = {m: v.latents for m, v in videos.items()}
    for mode in ("keep", "recache"):
        assert torch.equal(latents[mode][:, :, :3 * n], latents["restart"][:, :, :3 * n])  # blocks before it
        assert videos[mode].stats.rollouts == 2
    # after it, each mode makes another video (the first segment's 3 blocks are more than the overlap's 3 frames);
    # keep and recache differ only in the cached frames' cross-attention, which the tiny random model barely
    # reads: far less than two prompts differ (1e-3), far more than cache and recompute may (1e-5)
    for a, b, least in (("keep", "restart", 1e-3), ("recache", "restart", 1e-3), ("keep", "recache", 1e-4)):
        assert (latents[a][:, :, 3 * n:] - latents[b][:, :, 3 * n:]).abs().max() > least, (a, b)
    k = 4 * (3 * n - 1) + 1  # frames decoded from the blocks before the switch
    assert all(np.array_equal(v.frames[:k], videos["restart"].frames[:k]) for v in videos.values())


def test_with_one_prompt_recache_and_keep_give_the_unswitched_cache(global_gen):
    """Under global attention, a 'recache' to the same prompt recomputes exactly the keys/values the cache held
    (the same chunks, positions and context): it equals 'keep', and 'restart' with an overlap of every frame."""
    segments = [(P0, 3), (P0, 2)]
    keep = stream(global_gen, segments, prompt_switch="keep")[0].latents
    recache = stream(global_gen, segments, prompt_switch="recache")[0].latents
    restart_all = stream(global_gen, segments, prompt_switch="restart", overlap_frames=9)[0].latents
    restart = stream(global_gen, segments, prompt_switch="restart")[0].latents
    assert (keep - recache).abs().max().item() <= 1e-5
    assert torch.equal(recache, restart_all)
    assert (recache[:, :, 9:] - restart[:, :, 9:]).abs().max() > 1e-3  # the default overlap (3) is another video


def test_keep_carries_the_cache_and_its_positions(global_gen):
    """'keep' and 'recache' cache every earlier frame of the rollout (9 + the new segment's 6 frames); 'restart'
    only the overlap (3 + 6)."""
    sizes = {m: stream(global_gen, [(P0, 3), (P1, 2)], prompt_switch=m)[0].stats.kv_cache_bytes for m in MODES}
    assert sizes["keep"] == sizes["recache"] == sizes["restart"] * 15 // 9


# -- keep_video=False --------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rollout_blocks", [None, pytest.param(2, marks=pytest.mark.slow)])
def test_keep_video_off_streams_the_same_frames(gen, mode, rollout_blocks):
    segments = [(P0, 4), (P1, 3), (P0, 2)]
    kept, kept_chunks = stream(gen, segments, prompt_switch=mode, rollout_blocks=rollout_blocks)
    lean, lean_chunks = stream(gen, segments, prompt_switch=mode, rollout_blocks=rollout_blocks, keep_video=False)
    assert len(lean_chunks) == len(kept_chunks) == 9
    assert all(np.array_equal(a, b) for a, b in zip(kept_chunks, lean_chunks))
    assert lean.chunks == [] and lean.frames.shape[0] == 0
    assert torch.equal(lean.latents, kept.latents[:, :, -lean.latents.shape[2]:])
    # a global-attention 'recache' without rollouts may recompute every frame so far: it keeps them all
    whole = mode == "recache" and gen.pipeline.config.local_attn_size == -1 and rollout_blocks is None
    assert lean.latents.shape[2] == kept.latents.shape[2] if whole else lean.latents.shape[2] < kept.latents.shape[2]


# -- the uncached reference ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["restart", "recache"])
@pytest.mark.parametrize("rollout_blocks", [None, 2])
def test_recompute_matches_the_cache(gen, mode, rollout_blocks):
    """kv_cache=False recomputes every frame of the rollout (a recache's prefill included) through the
    block-causal mask: the cached video within 1e-5, as tests/test_causal.py asks of one prompt."""
    segments = [(P0, 3), (P1, 3)]
    cached = stream(gen, segments, prompt_switch=mode, rollout_blocks=rollout_blocks)[0]
    recomputed = stream(gen, segments, prompt_switch=mode, rollout_blocks=rollout_blocks, kv_cache=False)[0]
    assert cached.stats.rollouts == recomputed.stats.rollouts
    assert (cached.latents - recomputed.latents).abs().max().item() <= 1e-5


def test_recompute_matches_the_cache_under_guidance(window_gen):
    kwargs = dict(prompt_switch="recache", guidance_scale=3.0, negative_prompt="a green triangle")
    cached = stream(window_gen, [(P0, 3), (P1, 2)], **kwargs)[0]
    recomputed = stream(window_gen, [(P0, 3), (P1, 2)], kv_cache=False, **kwargs)[0]
    assert (cached.latents - recomputed.latents).abs().max().item() <= 1e-5


@pytest.mark.parametrize("mode", ["keep", "recache"])
def test_guidance_branches_in_one_call_or_two_switch_alike(tiny_causal_dir, window_gen, mode):
    """Batched CFG keeps one cache of both branches' rows, sequential CFG one cache per branch: a switch carries
    (keep) or recomputes (recache) each the same way."""
    kwargs = dict(prompt_switch=mode, guidance_scale=3.0, negative_prompt="a green triangle")
    batched = stream(window_gen, [(P0, 3), (P1, 2)], **kwargs)[0]
    sequential_gen = VideoGenerator.from_pretrained(tiny_causal_dir, progress=False, cfg_mode="sequential")
    sequential = stream(sequential_gen, [(P0, 3), (P1, 2)], **kwargs)[0]
    assert (batched.latents - sequential.latents).abs().max().item() <= 1e-5


def test_keep_without_the_kv_cache_is_refused_before_any_work(window_gen):
    """The uncached path recomputes every frame under the prompt in use: it has no old-prompt keys to keep."""
    for call in (lambda: window_gen.stream_video([(P0, 1), (P1, 1)], height=H, width=W, prompt_switch="keep",
                                                 kv_cache=False),
                 lambda: window_gen.generate_video(P0, height=H, width=W, num_frames=9, prompt_switch="keep",
                                                   kv_cache=False)):
        with pytest.raises(InvalidInputError, match=r"prompt_switch = 'keep': expected restart or recache with "
                                                    r"kv_cache=False"):
            call()


# -- rollouts and switches -------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_rollouts_and_switches(gen, mode):
    """Segments of 5 and 4 blocks in rollouts of 2: 3 + 2 rollouts in every mode (a switch always starts one);
    the blocks before the switch are those of the restart video; 'keep' and 'recache' change the ones after."""
    n = n_of(gen)
    segments = [(P0, 5), (P1, 4)]
    video = stream(gen, segments, prompt_switch=mode, rollout_blocks=2)[0]
    restart = stream(gen, segments, prompt_switch="restart", rollout_blocks=2)[0]
    assert video.stats.rollouts == 5 and len(video.stats.block_seconds) == 9
    assert torch.equal(video.latents[:, :, :5 * n], restart.latents[:, :, :5 * n])
    differs = (video.latents[:, :, 5 * n:] - restart.latents[:, :, 5 * n:]).abs().max() > 1e-3
    assert differs == (mode != "restart")


class LiveSource:
    """A live segment source (composer serve's streams): `ends_segment(block)` ends the running segment there."""

    def __init__(self, segments, cut_at):
        self.segments, self.cut_at = segments, cut_at

    def __iter__(self):
        return iter(self.segments)

    def ends_segment(self, block_index):
        return block_index == self.cut_at


@pytest.mark.parametrize("mode", MODES)
def test_a_live_cut_where_a_rollout_ends_switches_in_the_mode_asked(global_gen, mode):
    """A cut at a rollout boundary is the explicit switch there. (It used to close the rollout before asking, so
    'keep' and 'recache' fell back to a restart.)"""
    live = stream(global_gen, LiveSource([(P0, 4), (P1, 2)], cut_at=2), prompt_switch=mode, rollout_blocks=2)[0]
    explicit = stream(global_gen, [(P0, 2), (P1, 2)], prompt_switch=mode, rollout_blocks=2)[0]
    assert live.stats.rollouts == explicit.stats.rollouts == 2
    assert torch.equal(live.latents, explicit.latents)


@pytest.mark.parametrize("mode", ["keep", "recache"])
def test_a_switch_fits_a_pool_that_holds_one_cache(tiny_causal_dir, mode):
    """The old cache is given back before the new one is taken: with kv_cache_memory for one window's cache,
    taking the new one first waited for ever for the stream's own pages."""
    probe = VideoGenerator.from_pretrained(tiny_causal_dir, progress=False)
    one = stream(probe, [(P0, 1)])[0].stats.kv_cache_bytes
    gen = VideoGenerator.from_pretrained(tiny_causal_dir, progress=False, kv_cache_memory=one)
    token = CancelToken()  # a regression waits for ever: end it
    timer = threading.Timer(60, token.cancel, kwargs={"reason": "waited 60 s for KV pages"})
    timer.start()
    try:
        video = stream(gen, [(P0, 3), (P1, 2)], prompt_switch=mode, cancel=token)[0]
    finally:
        timer.cancel()
    assert torch.equal(video.latents, stream(probe, [(P0, 3), (P1, 2)], prompt_switch=mode)[0].latents)
    assert gen.pipeline.stage("CausalDenoisingStage").kv_pool.stats().waits == 0


# -- bad values ------------------------------------------------------------------------------------------
def test_a_bad_prompt_switch_is_refused_before_any_work(window_gen):
    calls = []
    transformer = window_gen.pipeline.modules["transformer"]
    hook = transformer.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        for bad in ("recompute", "", "Keep"):
            with pytest.raises(InvalidInputError, match=f"prompt_switch = {bad!r}: expected one of restart, keep, "
                                                        "recache"):
                window_gen.stream_video([(P0, 1), (P1, 1)], height=H, width=W, prompt_switch=bad)
        with pytest.raises(InvalidInputError, match="prompt_switch = 'recompute': expected one of restart, keep"):
            window_gen.generate_video(P0, height=H, width=W, num_frames=9, prompt_switch="recompute")
        with pytest.raises(InvalidInputError, match="prompt_switch"):  # at open, not at the first extend
            window_gen.open_session(seed=0, height=H, width=W, prompt_switch="recompute")
    finally:
        hook.remove()
    assert calls == []


def test_the_cli_flag(cli, capsys, tiny_causal_dir, tmp_path):
    from composer.cli.main import main

    with pytest.raises(SystemExit):
        main(["generate", "--model-path", str(tiny_causal_dir), "--help-all"])  # defaults: the causal model's
    help_text = " ".join(capsys.readouterr().out.split())
    flag_help = help_text.rsplit("--prompt-switch STR", 1)[1].split(" --", 1)[0]
    assert "(one of: restart, keep, recache) (default: restart)" in flag_help and "causal-streaming.md" in flag_help
    size = ["--height", H, "--width", W, "--seed", 1]
    code, _, err = cli("generate", "--model-path", tiny_causal_dir, "--segment", "a red circle::1", "--segment",
                       "a cat::1", *size, "--prompt-switch", "recompute", "--output", tmp_path / "a.mp4")
    assert code == 1 and "nothing was loaded" in err
    assert "--prompt-switch recompute: expected one of restart, keep, recache" in err
    code, _, err = cli("generate", "--model-path", tiny_causal_dir, "--segment", "a red circle::1", "--segment",
                       "a cat::1", *size, "--prompt-switch", "keep", "--no-kv-cache", "--output", tmp_path / "b.mp4")
    assert code == 1 and "--prompt-switch keep: expected restart or recache with --no-kv-cache" in err
    code, out, err = cli("generate", "--model-path", tiny_causal_dir, "--segment", "a red circle::3", "--segment",
                         "a cat::1", *size, "--prompt-switch", "recache", "--output", tmp_path / "c.mp4")
    assert code == 0, err
    assert "2 rollouts" in out and (tmp_path / "c.mp4").is_file()


# -- benchmarks/prompt_switch.py -------------------------------------------------------------------------
def _benchmark():
    import importlib.util
    import sys
    from pathlib import Path

    name = "prompt_switch_benchmark"
    if name not in sys.modules:
        path = Path(__file__).resolve().parents[1] / "benchmarks" / "prompt_switch.py"
        spec = importlib.util.spec_from_file_location(name, path)
        module = sys.modules[name] = importlib.util.module_from_spec(spec)  # (its dataclasses look it up)
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_the_benchmark_reads_the_colour_and_smoothness_of_rendered_clips():
    """On drawn clips (the demo's renderer): a red circle whose colour turns blue at frame 9 is blue from the
    switch on; one that keeps red never turns; a clip that keeps its object's path moves as much across the
    switch as within, one that jumps does not."""
    from demo.shapes import ClipSpec, ShapeSpec, render

    bench = _benchmark()

    def clip(color, x=32.0, direction="right"):
        return render(ClipSpec((ShapeSpec("circle", color, direction, 8.0, x, 32.0, 1.5),)), num_frames=9)

    red, blue = clip("red"), clip("blue", x=32.0 + 9 * 1.5)  # blue continues red's path
    switched = np.concatenate([red, blue])
    shares = bench.new_colour_shares(switched, "red", "blue")
    assert (shares[:9] == 0).all() and (shares[9:] == 1).all()
    assert bench.frames_until_dominant(shares, 9) == 0
    assert bench.frames_until_dominant(bench.new_colour_shares(np.concatenate([red, clip("red", 45.5)]), "red",
                                                               "blue"), 9) is None
    moved, within = bench.motion_smoothness(switched, 9)
    assert moved == pytest.approx(within, abs=0.3)
    cut = np.concatenate([red, clip("blue", x=10.0)])  # the object jumps back 35 px
    assert bench.motion_smoothness(cut, 9)[0] > 10 * within
    assert bench.latent_boundaries(13) == [1, 5, 9]


@pytest.mark.slow
def test_the_benchmark_prints_a_row_per_mode(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "prompt_switch.py"), "--seeds", "1", "--pairs", "1",
                          "--before", "4", "--after", "1", "--threads", "1", "--json", str(tmp_path / "switch.json")],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)}, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert all(f"  {mode} " in run.stdout for mode in MODES) and "jump/within" in run.stdout
    summaries = json.loads((tmp_path / "switch.json").read_text())
    assert [s["mode"] for s in summaries] == list(MODES) and all(s["runs"] == 1 for s in summaries)
    assert summaries[1]["prefill_s"] < summaries[2]["prefill_s"]  # keep copies the cache; recache runs 4 passes
