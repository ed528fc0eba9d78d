"""Shared fixtures: tiny Wan2.1 folders in exact diffusers layout, loaded once per session."""

from __future__ import annotations

import os
import tempfile

# Tests never touch the network or the user's caches.
_SESSION_TMP = tempfile.mkdtemp(prefix="composer-tests-")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HOME", os.path.join(_SESSION_TMP, "hf-home"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One intra-op thread, here and in every process a test starts (CLI runs, scripts, benchmarks, torchrun ranks):
# the models are tiny, a second thread made not even a 2048x2048 matmul faster on this project's 2-core
# machine, and on a busy one its spinning OpenMP workers made forwards 10-100x slower (tests/test_causal.py:
# 13 s alone; beside two busy processes 137 s with 2 threads, 26 s with 1). No result depends on the count.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from composer.testing import build_tiny_wan  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def tiny_wan_dir(tmp_path_factory):
    """Tiny Wan2.1 T2V folder with the released UniPC scheduler config."""
    return build_tiny_wan(tmp_path_factory.mktemp("models") / "tiny-wan")


@pytest.fixture(scope="session")
def tiny_wan_euler_dir(tmp_path_factory):
    """A second tiny model: other sizes, other seed, flow-match Euler scheduler."""
    return build_tiny_wan(
        tmp_path_factory.mktemp("models") / "tiny-wan-euler",
        num_layers=3, num_heads=3, head_dim=24, ffn_dim=96, text_dim=48, scheduler="euler",
        flow_shift=5.0, seed=7,
    )


@pytest.fixture(scope="session")
def tiny_causal_dir(tiny_wan_dir, tmp_path_factory):
    """A causal folder converted from a Self-Forcing-format checkpoint of the tiny model: blocks of 2 latent
    frames, a rolling window of 5 frames with a 1-frame sink."""
    from helpers import write_self_forcing_checkpoint

    from composer.convert.self_forcing import CausalSettings, convert_self_forcing

    root = tmp_path_factory.mktemp("tiny-causal")
    write_self_forcing_checkpoint(tiny_wan_dir, root / "sf.pt")
    return convert_self_forcing(root / "sf.pt", tiny_wan_dir, root / "causal",
                                settings=CausalSettings(num_frames_per_block=2, local_attn_size=5, sink_size=1))


@pytest.fixture(scope="session")
def ti2v_dir(tmp_path_factory):
    """A tiny Wan2.2 TI2V-5B folder (read only: tests/test_wan22.py and tests/test_wan22_i2v.py share it)."""
    from composer.testing import build_tiny_wan22_ti2v

    return build_tiny_wan22_ti2v(tmp_path_factory.mktemp("models") / "tiny-wan22-ti2v")


@pytest.fixture()
def cli(capsys):
    """Run `composer ARGS...` in this process: (exit code, stdout, stderr) of that call alone."""
    from composer.cli.main import main

    def run(*args):
        capsys.readouterr()
        code = main([str(a) for a in args])
        return code, *capsys.readouterr()

    return run


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module (the session's default too, unless OMP_NUM_THREADS says otherwise): its
    models are tiny, and on a busy 2-core machine a second thread made each forward 50-100x slower (spinning
    workers), not faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def composer_gen(tiny_wan_dir):
    from composer import VideoGenerator

    return VideoGenerator.from_pretrained(tiny_wan_dir, dtype="fp32", progress=False)


@pytest.fixture(scope="session")
def diffusers_pipe(tiny_wan_dir):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(tiny_wan_dir))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def diffusers_frames(pipe, prompt, seed, **kwargs) -> np.ndarray:
    """diffusers' frames for one prompt as uint8 [T, H, W, 3] (same rounding as composer)."""
    out = pipe(prompt, generator=torch.Generator("cpu").manual_seed(seed), output_type="np", **kwargs).frames[0]
    return (out * 255).round().astype(np.uint8)


def max_uint8_diff(a: np.ndarray, b: np.ndarray) -> int:
    assert a.shape == b.shape, (a.shape, b.shape)
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())


@pytest.fixture()
def log(monkeypatch):
    """What composer logs, as the user's terminal shows it ("LEVEL message" lines), with log_once's memory cleared
    for this test."""
    import io
    import logging

    import composer.logging as clog

    monkeypatch.setattr(clog, "_said", set())
    stream = io.StringIO()
    handler = clog._TqdmHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    root = logging.getLogger("composer")
    root.addHandler(handler)
    yield stream
    root.removeHandler(handler)


# -- the quick tier's budget ------------------------------------------------------------------------------------
# `make test` runs the tests not marked slow and must stay under 5 minutes on 2 cores. The summary lists the quick
# tests that took longer than QUICK_TEST_S here (setup included), so a long case is seen the day it lands and is
# marked slow or made shorter; it is a report, not a failure (timings depend on the machine and its load).
QUICK_TEST_S = float(os.environ.get("COMPOSER_QUICK_TEST_S", "8"))
_quick_durations: dict[str, float] = {}


def pytest_runtest_logreport(report):
    if "slow" not in report.keywords and report.when in ("setup", "call"):
        _quick_durations[report.nodeid] = _quick_durations.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    long = sorted(((s, n) for n, s in _quick_durations.items() if s > QUICK_TEST_S), reverse=True)
    if long and "not slow" in (config.getoption("markexpr") or ""):
        terminalreporter.write_sep("-", f"quick-tier tests over {QUICK_TEST_S:g} s here: mark them slow or shorten "
                                        "them (tests/conftest.py)")
        for seconds, nodeid in long:
            terminalreporter.write_line(f"{seconds:6.1f} s  {nodeid}")


# -- the order test files are handed out in --------------------------------------------------------------------
# `make test-all` gives whole files to 3 processes (pytest-xdist --dist loadfile) in collection order. Collected
# alphabetically, the files heavy with slow tests (subprocess launches, torchrun, the scripts' own runs) came last
# and one process ran them alone for minutes while the others sat idle. The heaviest files go first (longest work
# first): a file weighs its slow tests (each counted as SLOW_WEIGHT quick ones) plus its quick tests; the order
# inside a file, and so its fixtures' life, is unchanged.
SLOW_WEIGHT = 10


def pytest_collection_modifyitems(config, items):
    weight: dict[str, int] = {}
    for item in items:
        path = str(item.path)
        weight[path] = weight.get(path, 0) + (SLOW_WEIGHT if item.get_closest_marker("slow") else 1)
    first_seen = {path: i for i, path in reversed(list(enumerate(str(item.path) for item in items)))}
    items.sort(key=lambda item: (-weight[str(item.path)], first_seen[str(item.path)]))
