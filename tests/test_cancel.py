"""Cancellation: a CancelToken cancelled mid-video stops the request within one transformer block (text-to-video,
causal whole and streamed, with layerwise offload), the next video equals an uncancelled one, and the CLI exits
130 on Ctrl-C without a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from composer import CancelToken, VideoGenerator
from composer.cli.interrupt import cancel_on_sigint
from composer.errors import Cancelled

PROMPT = "a red ball bouncing"
T2V = dict(negative_prompt="blurry", guidance_scale=4.0, height=32, width=32, num_frames=5, num_inference_steps=3,
           seed=3)
CAUSAL = dict(height=32, width=48, num_frames=4 * (4 - 1) + 1, seed=4, rollout_blocks=2, overlap_frames=2)


def _gen(folder, **runtime):
    return VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False, **runtime)


@pytest.fixture(scope="module")
def t2v_gen(tiny_wan_dir, one_thread):
    return _gen(tiny_wan_dir)


@pytest.fixture(scope="module")
def causal_gen(tiny_causal_dir, one_thread):
    return _gen(tiny_causal_dir)


class CancelAtBlock:
    """Block hooks added after load (so they run after the pipeline's cancel check): cancel `token` when the
    first block starts for the `at`-th time (at=2: the 2nd model call's 1st block), then count the block
    forwards that still run."""

    def __init__(self, gen: VideoGenerator, token: CancelToken, at: int):
        self.token, self.at = token, at
        self.first_block_calls = 0
        self.after_cancel = 0
        blocks = gen.pipeline.modules["transformer"].blocks
        self.handles = [blocks[0].register_forward_pre_hook(self._pre)]
        self.handles += [b.register_forward_pre_hook(self._count) for b in blocks]

    def _pre(self, module, args):
        self.first_block_calls += 1
        if self.first_block_calls == self.at:
            self.token.cancel("test")

    def _count(self, module, args):
        if self.token.cancelled:
            self.after_cancel += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def test_a_token_cancelled_before_the_request_runs_no_block(t2v_gen):
    token = CancelToken()
    token.cancel()
    with CancelAtBlock(t2v_gen, token, at=0) as probe, pytest.raises(Cancelled, match="request cancelled"):
        t2v_gen.generate_video(PROMPT, cancel=token, **T2V)
    assert probe.after_cancel == 0


def test_text_to_video_stops_within_one_block_and_the_next_video_is_unaffected(t2v_gen):
    reference = t2v_gen.generate_video(PROMPT, **T2V).frames
    token = CancelToken()
    with CancelAtBlock(t2v_gen, token, at=2) as probe, pytest.raises(Cancelled):
        t2v_gen.generate_video(PROMPT, cancel=token, **T2V)
    assert probe.first_block_calls == 2 and probe.after_cancel == 1  # the block it was cancelled in, no more
    from composer.engine.scheduler import current_request

    assert current_request() is None  # no request is left as this thread's running one
    np.testing.assert_array_equal(t2v_gen.generate_video(PROMPT, **T2V).frames, reference)


def test_layerwise_offload_is_left_clean_by_a_cancel(tiny_wan_dir, t2v_gen, one_thread):
    reference = t2v_gen.generate_video(PROMPT, **T2V).frames
    gen = _gen(tiny_wan_dir, offload="layerwise")
    token = CancelToken()
    with CancelAtBlock(gen, token, at=2) as probe, pytest.raises(Cancelled):
        gen.generate_video(PROMPT, cancel=token, **T2V)
    assert probe.after_cancel == 1
    np.testing.assert_array_equal(gen.generate_video(PROMPT, **T2V).frames, reference)


# The tiny causal model makes a block in 4 steps and a clean pass that writes the KV cache: cancel in the first
# block's 2nd step, in its clean pass (the cache pass is aborted), in the second block.
@pytest.mark.parametrize("at", [2, 5, 7])
def test_causal_whole_video_stops_within_one_block(causal_gen, at):
    reference = causal_gen.generate_video(PROMPT, **CAUSAL).frames
    token = CancelToken()
    with CancelAtBlock(causal_gen, token, at=at) as probe, pytest.raises(Cancelled):
        causal_gen.generate_video(PROMPT, cancel=token, **CAUSAL)
    assert probe.after_cancel == 1
    np.testing.assert_array_equal(causal_gen.generate_video(PROMPT, **CAUSAL).frames, reference)


def test_causal_stream_stops_within_one_block_and_the_next_stream_is_unaffected(causal_gen):
    reference = causal_gen.generate_video(PROMPT, **CAUSAL).frames
    token = CancelToken()
    stream = causal_gen.stream_video(PROMPT, cancel=token, **CAUSAL)
    got = []
    with CancelAtBlock(causal_gen, token, at=7) as probe, pytest.raises(Cancelled):
        for chunk in stream:
            got.append(chunk)
    assert len(got) == 1 and probe.after_cancel == 1
    # a cancel between chunks (the consumer holding one) stops before the next block starts
    token = CancelToken()
    stream = causal_gen.stream_video(PROMPT, cancel=token, **CAUSAL)
    with CancelAtBlock(causal_gen, token, at=10**6) as probe, pytest.raises(Cancelled):
        for _ in stream:
            token.cancel()
    assert probe.after_cancel == 0
    again = causal_gen.stream_video(PROMPT, **CAUSAL)
    np.testing.assert_array_equal(np.concatenate([c.frames for c in again]), reference)


def test_first_sigint_cancels_the_token_and_a_second_one_interrupts():
    token = CancelToken()
    before = signal.getsignal(signal.SIGINT)  # default_int_handler; SIG_IGN under a shell's background job
    with cancel_on_sigint(token):
        os.kill(os.getpid(), signal.SIGINT)
        assert token.cancelled
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs between bytecodes; never reached
    assert signal.getsignal(signal.SIGINT) is before  # what was there is put back


# Each block announces itself and sleeps, so the request is slow and the test knows when denoising has begun.
SLOW_CLI = """
import sys, time
from composer.models.wan.transformer import WanTransformerBlock
forward = WanTransformerBlock.forward
def slow(self, *args, **kwargs):
    print("BLOCK", file=sys.stderr, flush=True)
    time.sleep(0.2)
    return forward(self, *args, **kwargs)
WanTransformerBlock.forward = slow
from composer.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("stream", [pytest.param(False, marks=pytest.mark.slow), pytest.param(True, marks=pytest.mark.slow)])
def test_cli_exits_130_on_ctrl_c_without_a_traceback(tiny_wan_dir, tiny_causal_dir, tmp_path, stream):
    folder = tiny_causal_dir if stream else tiny_wan_dir
    # far longer than the test uncancelled: 200 steps x 2 layers x 0.2 s, or 20 causal blocks x 5 passes x 2 x 0.2 s
    args = ["generate", "--model-path", folder, "--prompt", "a cat", "--height", "32", "--width", "32", "--seed",
            "0", "--no-progress", "--output", tmp_path / "out.mp4"]
    args += ["--stream", "--num-frames", 4 * (40 - 1) + 1] if stream else ["--num-frames", 9, "--steps", 200]
    proc = subprocess.Popen([sys.executable, "-c", SLOW_CLI, *map(str, args)], stderr=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "COMPOSER_LOG_LEVEL": "WARNING"})
    try:
        lines = []
        for line in proc.stderr:  # wait until a block runs
            lines.append(line)
            if line.startswith("BLOCK"):
                break
        sent = time.perf_counter()
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=60)
        took = time.perf_counter() - sent
    finally:
        proc.kill()
    stderr = "".join(lines) + rest
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1] == "composer: request cancelled (Ctrl-C)"
    assert rest.count("BLOCK") <= 1  # at most the block that was running
    assert took < 10
    assert not (tmp_path / "out.mp4").exists() or stream  # the whole-video path wrote nothing
