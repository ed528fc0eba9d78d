"""torchrun launches on 2 gloo CPU processes: `torchrun -m composer generate --ulysses-degree 2` and a user's own
script give one process's video, rank 0 alone writes and reports, every rank exits cleanly; a rank that fails
(an exception in a stage, or bad input reaching one rank) makes every rank exit with an error in bounded time;
degrees that do not match the launch are refused before loading."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest
import torch

import composer
from composer.testing import build_tiny_wan
from composer.testing.distributed import free_port

pytestmark = pytest.mark.slow
SCRIPT = Path(__file__).parent / "scripts" / "parallel_user_script.py"
LAUNCH_TIMEOUT_S = 240
FLAGS = ["--prompt", "a red ball moves left", "--height", "48", "--width", "80", "--num-frames", "9", "--steps", "2",
         "--guidance-scale", "5", "--seed", "7", "--dtype", "fp32", "--no-progress"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_wan(tmp_path_factory.mktemp("models") / "tiny-wan-4h", num_heads=4, head_dim=16, seed=3)


def _torchrun(*args, nproc=2, timeout=LAUNCH_TIMEOUT_S) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def _one_process(folder):
    from composer import VideoGenerator

    gen = VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False)
    return gen.generate_video("a red ball moves left", height=48, width=80, num_frames=9, num_inference_steps=2,
                              guidance_scale=5.0, seed=7)


def test_torchrun_composer_generate_equals_one_process(folder, tmp_path):
    out = tmp_path / "video.mp4"
    proc = _torchrun("-m", "composer", "generate", "--model-path", str(folder), *FLAGS, "--ulysses-degree", "2",
                     "-o", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("wrote ") == 1, proc.stdout  # rank 0 reports, once
    single = tmp_path / "single.mp4"
    from composer.cli.main import main

    assert main(["generate", "--model-path", str(folder), *FLAGS, "-o", str(single)]) == 0
    ours, ref = iio.imread(out), iio.imread(single)
    assert ours.shape == ref.shape
    assert np.abs(ours.astype(int) - ref.astype(int)).max() <= 1


@pytest.fixture(scope="module")
def causal_folder(folder, tmp_path_factory):
    from helpers import write_self_forcing_checkpoint

    from composer.convert.self_forcing import CausalSettings, convert_self_forcing

    root = tmp_path_factory.mktemp("causal-4h")
    write_self_forcing_checkpoint(folder, root / "sf.pt")
    return convert_self_forcing(root / "sf.pt", folder, root / "causal",
                                settings=CausalSettings(num_frames_per_block=2, local_attn_size=5, sink_size=1))


def test_torchrun_streams_a_causal_video_written_by_rank_0(causal_folder, tmp_path):
    """--stream on 2 ranks (ring): every rank makes the chunks together, rank 0 writes them as they come; the
    video equals one process's stream."""
    flags = ["--height", "48", "--width", "80", "--num-frames", "13", "--seed", "3", "--dtype", "fp32",
             "--no-progress", "--stream", "--segment", "a red ball::2", "--segment", "a blue square::1"]
    out = tmp_path / "stream.mp4"
    proc = _torchrun("-m", "composer", "generate", "--model-path", str(causal_folder), *flags, "--ring-degree",
                     "2", "-o", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("block 0 (segment 0)") == 1 and proc.stdout.count("wrote ") == 1, proc.stdout
    from composer.cli.main import main

    single = tmp_path / "single.mp4"
    assert main(["generate", "--model-path", str(causal_folder), *flags, "-o", str(single)]) == 0
    ours, ref = iio.imread(out).astype(float), iio.imread(single).astype(float)
    assert ours.shape == ref.shape
    # The frames themselves equal one process's within 1 (tests/test_parallel_pipeline.py, causal); through the
    # lossy mp4 encoder a one-level difference can move a few levels, so the decoded files are compared by PSNR.
    psnr = 10 * np.log10(255**2 / max(np.mean((ours - ref) ** 2), 1e-12))
    assert psnr > 45, f"PSNR {psnr:.1f} dB"


def test_user_script_under_torchrun_gets_the_whole_video_on_every_rank(folder, tmp_path):
    proc = _torchrun(str(SCRIPT), str(folder), str(tmp_path), "ok")
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = _one_process(folder)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(got["latents"], expected.latents, atol=1e-5, rtol=0)
        assert np.abs(got["frames"].numpy().astype(int) - expected.frames.astype(int)).max() <= 1
    assert (tmp_path / "video.mp4").is_file()


@pytest.mark.parametrize("mode", ["fail-rank1", "bad-input-rank1"])
def test_a_failing_rank_ends_every_rank_with_an_error(folder, tmp_path, mode):
    start = time.monotonic()
    proc = _torchrun(str(SCRIPT), str(folder), str(tmp_path), mode)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert elapsed < 120, f"ranks took {elapsed:.0f} s to stop"
    assert not (tmp_path / "rank0.pt").exists() and not (tmp_path / "rank1.pt").exists()
    if mode == "fail-rank1":
        assert "injected failure in the denoising stage on rank 1" in proc.stderr


def test_degrees_that_do_not_match_the_launch_are_refused_before_loading(folder, tmp_path):
    proc = _torchrun("-m", "composer", "generate", "--model-path", str(folder), *FLAGS, "--ulysses-degree", "4",
                     "-o", str(tmp_path / "x.mp4"), timeout=120)
    assert proc.returncode != 0
    assert "WORLD_SIZE" in proc.stderr and "multiply to 4" in proc.stderr
    assert "composer: error: " in proc.stderr  # the ranks' one-line error (torchrun adds its own summary)
    # no traceback through composer's own code (torchrun prints its own, through wherever the environment lives)
    package = str(Path(composer.__file__).parent) + os.sep
    assert package not in "".join(line for line in proc.stderr.splitlines() if line.lstrip().startswith("File"))
    assert "loaded transformer" not in proc.stderr


CONCURRENT = Path(__file__).parent / "scripts" / "concurrent_ranks_script.py"


def test_concurrent_requests_on_two_ranks_equal_their_single_process_runs(folder, causal_folder, tmp_path):
    """Two text-to-video jobs and two causal streams from four threads on each of 2 Ulysses ranks (started in
    another order on rank 1): each request is a task of its rank's engine core (each stream's chunk one), rank 0
    plans every transformer call, every rank makes the same calls, and each request's frames equal its run alone
    in one process; the steps were batched (fewer calls than units)."""
    proc = _torchrun(str(CONCURRENT), str(folder), str(causal_folder), str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    from composer import VideoGenerator

    gen = VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False)
    causal = VideoGenerator.from_pretrained(causal_folder, dtype="fp32", progress=False)
    expected = {}
    for seed in (1, 2):
        expected[f"t2v{seed}"] = gen.generate_video("a red ball moves left", height=48, width=80, num_frames=9,
                                                    num_inference_steps=3, guidance_scale=5.0, seed=seed).frames
    for seed in (3, 4):
        chunks = causal.stream_video([("a red ball moves left", 2), ("a blue cube", 1)], seed=seed, height=32,
                                     width=32, guidance_scale=3.0)
        expected[f"stream{seed}"] = np.concatenate([c.frames for c in chunks])
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name, frames in expected.items():
            diff = np.abs(got["frames"][name].numpy().astype(int) - frames.astype(int)).max()
            assert diff <= 1, f"rank {rank} {name}: {diff}"
        assert got["calls"] == torch.load(tmp_path / "rank0.pt")["calls"]  # the same calls on every rank
        assert got["tasks"][0] >= 2 and got["tasks"][1] >= 2 * 3, got["tasks"]  # 2 jobs; 2 streams of 3 chunks
    calls, units = got["calls"], got["units"]
    assert calls[0] < units[0] and calls[1] < units[1], (calls, units)
