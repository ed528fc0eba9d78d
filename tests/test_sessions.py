"""Sessions as persistent world state: fork, snapshot and resume continue exactly as the original would."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from composer import VideoGenerator
from composer.errors import ComposerError, InvalidInputError
from composer.session import SnapshotError, pack_snapshot, unpack_snapshot

P0, P1, P2 = "a red circle moving left", "a blue square moving right", "a green circle moving up"


def frames_of(chunks) -> np.ndarray:
    return np.concatenate([c.frames for c in chunks])


@pytest.fixture(scope="module")
def shapes(one_thread):
    return VideoGenerator.from_pretrained("shapes-causal", progress=False)


@pytest.fixture(scope="module")
def windowed(tiny_causal_dir, one_thread):
    """The tiny converted model: 2-frame blocks, a rolling window of 5 frames with a 1-frame sink."""
    return VideoGenerator.from_pretrained(str(tiny_causal_dir), progress=False)


def pool_of(gen):
    return gen.pipeline.stage("CausalDenoisingStage").kv_pool


def small(gen) -> dict:
    return {} if "shapes" in str(gen.pipeline.folder) else {"height": 32, "width": 32, "guidance_scale": 3.0}


@pytest.mark.parametrize("mode", [pytest.param("restart", marks=pytest.mark.slow), "keep",
                                  pytest.param("recache", marks=pytest.mark.slow)])
@pytest.mark.parametrize("model", ["shapes", "windowed"])
def test_a_fork_and_its_parent_each_continue_as_a_linear_stream(model, mode, request):
    gen = request.getfixturevalue(model)
    kw = dict(seed=3, prompt_switch=mode, **small(gen))
    after_p1 = frames_of(gen.stream_video([(P0, 3), (P1, 2)], **kw))
    after_p2 = frames_of(gen.stream_video([(P0, 3), (P2, 1)], **kw))
    pool = pool_of(gen)
    with gen.open_session(**kw) as parent:
        list(parent.extend(P0, 3))
        held = pool.stats().used_bytes
        child = parent.fork()
        if mode == "keep":  # the cache goes on across the switch: the fork shares its pages until it writes
            assert held > 0 and pool.stats().shared_pages > 0
        else:  # the segment's cache was given back when its last block was made
            assert held == 0
        with child:
            assert np.array_equal(frames_of(child.extend(P2, 1)), after_p2[len(parent.frames):])
            assert np.array_equal(child.frames, after_p2) and child.blocks == 4
        list(parent.extend(P1, 2))
        assert np.array_equal(parent.frames, after_p1) and parent.blocks == 5
    assert pool.stats().used_bytes == 0 and pool.stats().sessions == 0


@pytest.mark.parametrize("mode", ["restart", "keep"])
def test_a_snapshot_resumes_in_this_process_exactly(windowed, mode):
    kw = dict(seed=5, prompt_switch=mode, **small(windowed))
    linear = frames_of(windowed.stream_video([(P0, 3), (P1, 2)], **kw))
    with windowed.open_session(**kw) as session:
        list(session.extend(P0, 3))
        data = session.snapshot()
    assert isinstance(data, bytes)
    with windowed.resume_session(data) as resumed:
        so_far = resumed.frames  # the frames made before the snapshot come back with it
        assert resumed.blocks == 3 and 0 < len(so_far) < len(linear) and np.array_equal(so_far, linear[:len(so_far)])
        list(resumed.extend(P1, 2))
        assert np.array_equal(resumed.frames, linear)
        again = resumed.snapshot()
    # a snapshot is a value: resuming it twice gives the same video twice
    with windowed.resume_session(data) as first, windowed.resume_session(data) as second:
        assert np.array_equal(frames_of(first.extend(P2, 1)), frames_of(second.extend(P2, 1)))
    with windowed.resume_session(again) as later:
        assert later.blocks == 5


_CHILD = textwrap.dedent("""
    import sys, numpy as np, torch
    torch.set_num_threads(1)
    from composer import VideoGenerator
    mode, jobs = sys.argv[1], sys.argv[2:]
    for model, path, prompt in zip(jobs[0::3], jobs[1::3], jobs[2::3]):  # (model, snapshot path, prompt) each
        gen = VideoGenerator.from_pretrained(model, progress=False)
        size = {} if model == "shapes-causal" else {"height": 32, "width": 32, "guidance_scale": 3.0}
        if mode == "write":
            session = gen.open_session(seed=9, prompt_switch="keep", **size)
            list(session.extend(prompt, 3))
            open(path, "wb").write(session.snapshot())
        else:
            session = gen.resume_session(open(path, "rb").read())
            list(session.extend(prompt, 2))
            np.save(path + ".npy", session.frames)
""")


@pytest.fixture(scope="module")
def resumed_in_another_process(tiny_causal_dir, tmp_path_factory):
    """Each model's session written to a snapshot by one child process and resumed from it by another: the frames
    the resumed session made, by model. Both models go through the same two children (two interpreter starts, not
    four); each snapshot is its own file, read by a process that never held that session."""
    root = tmp_path_factory.mktemp("snapshots")
    names = {"shapes": "shapes-causal", "windowed": str(tiny_causal_dir)}
    for step, prompt in (("write", P0), ("read", P1)):
        jobs = [arg for model, name in names.items() for arg in (name, str(root / f"{model}.bin"), prompt)]
        done = subprocess.run([sys.executable, "-c", _CHILD, step, *jobs], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    return {model: np.load(str(root / f"{model}.bin") + ".npy") for model in names}


@pytest.mark.slow  # two child processes; the in-process resume is in the quick tier
@pytest.mark.parametrize("model", ["shapes", "windowed"])
def test_a_snapshot_resumes_in_another_process_exactly(model, request, resumed_in_another_process):
    gen = request.getfixturevalue(model)
    linear = frames_of(gen.stream_video([(P0, 3), (P1, 2)], seed=9, prompt_switch="keep", **small(gen)))
    assert np.array_equal(resumed_in_another_process[model], linear)


def test_bad_snapshots_are_refused_clearly(shapes):
    with pytest.raises(SnapshotError, match="not a session snapshot: it does not start with COMPOSER-SESSION"):
        shapes.resume_session(b"definitely not a snapshot")
    with pytest.raises(InvalidInputError, match="bytes"):
        shapes.resume_session("a path?")
    with shapes.open_session(seed=1) as session:
        list(session.extend(P0, 1))
        data = session.snapshot()
    payload = torch.load(io.BytesIO(unpack_snapshot(data)), weights_only=True)
    payload["model"]["transformer"] = payload["model"]["transformer"].replace('"num_layers": ', '"num_layers": 1')
    edited = io.BytesIO()
    torch.save(payload, edited)
    with pytest.raises(InvalidInputError, match="another model.*transformer"):
        shapes.resume_session(pack_snapshot(edited.getvalue()))
    with pytest.raises(SnapshotError, match="no snapshot header"):  # a bare torch.save (format 1, or another file)
        shapes.resume_session(edited.getvalue())


def test_a_damaged_cut_or_foreign_snapshot_is_refused_by_name(shapes):
    with shapes.open_session(seed=1) as session:
        list(session.extend(P0, 1))
        data = session.snapshot()
    with shapes.resume_session(data) as first:
        expected = frames_of(first.extend(P1, 1))

    def flipped(at: int) -> bytes:
        changed = bytearray(data)
        changed[at] ^= 0x01
        return bytes(changed)

    header = len(data) - len(unpack_snapshot(data))
    for bad, words in ((flipped(len(data) // 2), "damaged: its contents do not match its sha256 digest"),
                       (flipped(len(data) - 1), "damaged"),
                       (flipped(header - 1), "damaged"),  # the digest itself
                       (data[:len(data) // 2], f"cut off: {len(data) // 2 - header} of its {len(data) - header} "
                                               "bytes"),
                       (data[:20], "cut off: 20 bytes, shorter than its"),
                       (data + b"\0", "1 bytes after its end"),
                       (flipped(0), "not a session snapshot"),
                       (data[:16] + b"\x00\x07" + data[18:], "format version 7; this composer reads version 2"),
                       (bytes(range(256)) * 8, "not a session snapshot")):
        with pytest.raises(SnapshotError, match=re.escape(words)):
            shapes.resume_session(bad)
    assert pool_of(shapes).stats().sessions == 0
    with shapes.resume_session(data) as intact:  # the intact one still resumes, exactly
        assert np.array_equal(frames_of(intact.extend(P1, 1)), expected)


def test_forks_and_snapshots_wait_for_the_extend_being_read(shapes):
    with shapes.open_session(seed=2) as session:
        chunks = session.extend(P0, 2)
        next(chunks)
        with pytest.raises(InvalidInputError, match="not read to its end"):
            session.fork()
        with pytest.raises(InvalidInputError, match="not read to its end"):
            session.snapshot()
        list(chunks)
        with session.fork() as child:  # now it can
            assert child.blocks == 2
    with pytest.raises(InvalidInputError, match="closed"):
        session.fork()


def test_a_fork_before_the_first_block_is_a_new_session_with_the_same_settings(shapes):
    with shapes.open_session(seed=4) as session:
        with session.fork() as twin:
            assert np.array_equal(frames_of(twin.extend(P0, 1)), frames_of(session.extend(P0, 1)))
        data = session.snapshot()
    with shapes.resume_session(data) as resumed:
        assert resumed.blocks == 1


@pytest.mark.parametrize(("options", "words"), [
    ({"priority": float("nan")}, "priority = nan: expected an integer"),
    ({"priority": "high"}, "priority = 'high': expected an integer"),
    ({"keep_video": "no"}, "keep_video = 'no': expected True or False"),
    ({"cancel": 3}, "cancel = 3: expected a composer.CancelToken"),
    ({"height": 63}, "height = 63: expected a positive multiple of 8"),
    ({"guidance_scale": float("inf")}, "guidance_scale = inf"),
    ({"fps": 0}, "fps = 0: expected a positive integer"),
    ({"seed": -1}, "seed = -1"),
    ({"nonsense": 1}, "unknown sampling parameter 'nonsense'"),
])
def test_open_session_refuses_what_the_first_extend_would(shapes, options, words):
    with pytest.raises(ComposerError, match=re.escape(words)):
        shapes.open_session(**options)
    assert pool_of(shapes).stats().sessions == 0


def test_fork_refuses_a_bad_priority_or_cancel_before_forking(shapes):
    with shapes.open_session(seed=1) as session:
        list(session.extend(P0, 1))
        held = pool_of(shapes).stats().sessions
        for options, words in (({"priority": float("nan")}, "priority = nan: expected an integer"),
                               ({"priority": "high"}, "priority = 'high'"), ({"cancel": "stop"}, "cancel = 'stop'")):
            with pytest.raises(InvalidInputError, match=re.escape(words)):
                session.fork(**options)
        assert pool_of(shapes).stats().sessions == held  # nothing forked


def test_a_session_knows_its_segments_and_frame_rate_through_forks_and_snapshots(shapes):
    with shapes.open_session(seed=6, fps=12) as session:
        list(session.extend(P0, 2))
        list(session.extend(P1, 1))
        made = [(s.prompt, s.blocks) for s in session.segments]
        assert made == [(P0, 2), (P1, 1)] and sum(s.frames for s in session.segments) == len(session.frames)
        assert session.fps == 12
        with session.fork() as child:  # the fork holds the same video: the same segments
            assert [(s.prompt, s.blocks) for s in child.segments] == made
            list(child.extend(P2, 1))
            assert len(child.segments) == 3 and len(session.segments) == 2
        data = session.snapshot()
    with shapes.resume_session(data) as resumed:
        assert [(s.prompt, s.blocks, s.frames) for s in resumed.segments] == \
            [(s.prompt, s.blocks, s.frames) for s in session.segments]
        assert resumed.fps == 12
    with shapes.open_session(seed=6) as plain:
        assert plain.fps == shapes.default_sampling.fps
