"""Session: a causal video that lives across calls (persistent world state, in this process).

    session = gen.open_session(seed=0)
    for chunk in session.extend("a red circle moving left", 3): ...     # 3 blocks
    for chunk in session.extend("now moving up", 2): ...                # 2 more, continuing the same video
    session.close()

`open_session(seed=s)` + `extend(p0, a)` + `extend(p1, b)` gives the frames of
`stream_video([(p0, a), (p1, b)], seed=s)`: a session is that stream, its segments handed in one `extend` at a time,
suspended between calls with its latents, KV cache and random generator as they were.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from composer.batch import VideoChunk
from composer.errors import InvalidInputError
from composer.request_check import text_length_problem


class _SegmentFeed:
    """The stream's segment source: the segments `extend` has handed in and the stream has not read yet."""

    def __init__(self) -> None:
        self.waiting: deque[tuple[str, int]] = deque()

    def __iter__(self) -> _SegmentFeed:
        return self

    def __next__(self) -> tuple[str, int]:
        if not self.waiting:
            raise StopIteration
        return self.waiting.popleft()


# A snapshot is a header and a payload (torch.save of plain values and tensors, read back with weights_only):
# SNAPSHOT_MAGIC, the format version (2 bytes), the payload's length (8 bytes) and its sha256 (32 bytes), so a
# damaged, cut or foreign file is refused by name before torch reads a byte of it. The digest finds damage; it is no
# signature (whoever can write the file can write a digest): keep snapshots where only the server writes.
SNAPSHOT_MAGIC = b"COMPOSER-SESSION"
SNAPSHOT_VERSION = 2  # 1: a bare torch.save, no header (before digests)
SNAPSHOT_FORMAT = f"composer-session/{SNAPSHOT_VERSION}"
_HEADER = struct.Struct(f">{len(SNAPSHOT_MAGIC)}sHQ32s")
# Sampling values a snapshot keeps as they are (a start image or video is not kept: the state holds its latents).
_NOT_KEPT = ("cancel", "start_image", "start_video")


class SnapshotError(InvalidInputError):
    """Bytes `VideoGenerator.resume_session` cannot resume: not a snapshot, another version, cut off, or damaged."""


def pack_snapshot(payload: bytes) -> bytes:
    """A snapshot's bytes: the header (magic, version, length, sha256) and the payload."""
    return _HEADER.pack(SNAPSHOT_MAGIC, SNAPSHOT_VERSION, len(payload), hashlib.sha256(payload).digest()) + payload


def unpack_snapshot(data: bytes) -> bytes:
    """The payload of a snapshot `pack_snapshot` wrote, once its header, length and digest check out; else a
    SnapshotError saying which."""
    data = bytes(data)
    if not data.startswith(SNAPSHOT_MAGIC):
        if data.startswith(b"PK\x03\x04"):  # a bare torch.save: a snapshot of format 1, or some other tensor file
            raise SnapshotError("this is not a session snapshot of this composer: it has no snapshot header (a "
                                "snapshot written before snapshots carried a digest, or another torch file); "
                                "resume the session where it was made and snapshot it again")
        raise SnapshotError(f"not a session snapshot: it does not start with {SNAPSHOT_MAGIC.decode()} (pass the "
                            "bytes Session.snapshot() returned, or a .session file the server wrote)")
    if len(data) < _HEADER.size:
        raise SnapshotError(f"the session snapshot is cut off: {len(data)} bytes, shorter than its {_HEADER.size}-byte "
                            "header")
    _, version, length, digest = _HEADER.unpack_from(data)
    if version != SNAPSHOT_VERSION:
        raise SnapshotError(f"the session snapshot is of format version {version}; this composer reads version "
                            f"{SNAPSHOT_VERSION} (resume it with the composer that made it)")
    payload = data[_HEADER.size:]
    if len(payload) < length:
        raise SnapshotError(f"the session snapshot is cut off: {len(payload)} of its {length} bytes after the header "
                            "(was the file copied or uploaded whole?)")
    if len(payload) > length:
        raise SnapshotError(f"the session snapshot has {len(payload) - length} bytes after its end ({length} bytes "
                            "after the header): two files joined, or a damaged one")
    if not hmac.compare_digest(hashlib.sha256(payload).digest(), digest):
        raise SnapshotError("the session snapshot is damaged: its contents do not match its sha256 digest (changed "
                            "after it was written); resume an intact copy")
    return payload


@dataclass
class Segment:
    """One `extend` of a session: its prompt, and the blocks and frames it made (the start frames count in the
    first)."""

    prompt: str
    blocks: int = 0
    frames: int = 0


class Session:
    """A causal stream extended segment by segment (`VideoGenerator.open_session`); `fork` branches it,
    `snapshot` writes it out, `VideoGenerator.resume_session` reads it back."""

    def __init__(self, generator: Any, sampling: dict[str, Any], restore: tuple[Any, Any] | None = None):
        self._generator = generator
        self._sampling = sampling
        self._feed = _SegmentFeed()
        self._stream: Any = None
        self._chunks: Iterator[VideoChunk] | None = None
        self._closed = False
        self._reading = False
        self._restore = restore  # (CausalState, StreamDecodeState) to go on from, until the stream starts
        self._earlier: np.ndarray | None = None  # frames made before a resume (keep_video)
        self.chunks: list[VideoChunk] = []  # every chunk so far (empty with keep_video=False)
        self.blocks = 0  # blocks made so far
        self.segments: list[Segment] = []  # every extend so far that made frames, before a fork or resume too
        self._segment: Segment | None = None  # the extend being read, until its first chunk

    def extend(self, prompt: str, num_blocks: int) -> Iterator[VideoChunk]:
        """Continue the video with `num_blocks` blocks of `prompt`, yielding each block's frames as it is decoded
        (the start frames first, on the first call of a session with a start image or video). Read it to the end
        before the next `extend`."""
        self._queue_segment(prompt, num_blocks)
        return self._blocks(num_blocks)

    def extend_task(self, prompt: str, num_blocks: int):
        """`extend` as a task for the generator's request loop (composer/engine/loop.py): every chunk made with no
        thread waiting between the passes; returns the list of chunks. Checks raise at once, before the task.

            chunks = gen.core.submit(session.extend_task("a cat", 2), session.context).result()"""
        self._queue_segment(prompt, num_blocks)
        return self._chunks_task(num_blocks)

    @property
    def context(self) -> Any:
        """The session's request (its priority) as the scheduler sees it: what a task of it runs as."""
        self._ensure_stream()
        return self._stream.context

    def _queue_segment(self, prompt: str, num_blocks: int) -> None:
        self._check_usable()
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidInputError(f"prompt = {prompt!r}: expected a non-empty string")
        if problem := text_length_problem("prompt", prompt):  # the limit every request's text has
            raise InvalidInputError(problem)
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise InvalidInputError(f"num_blocks = {num_blocks!r}: expected an integer >= 1")
        self._feed.waiting.append((prompt, num_blocks))
        self._segment = Segment(prompt)  # one of `segments` once it makes a frame

    def _ensure_stream(self) -> None:
        if self._stream is None:
            self._stream = self._generator.stream_video(self._feed, **self._sampling)
            if self._restore is not None:  # a fork or a resumed snapshot: the stream goes on from its state
                for state in self._restore:
                    self._stream._batch.attach(state)
                self._restore = None

    def _chunks_task(self, num_blocks: int):
        self._reading = True
        try:
            self._ensure_stream()
            chunks, made = [], 0
            while made < num_blocks:
                chunk = yield from self._stream.next_task()
                if chunk is None:
                    self.close()
                    raise InvalidInputError("the session's stream ended early")
                made += self._took(chunk)
                chunks.append(chunk)
            self._stream.pace.pause()  # the time until the next extend is not the stream's
            return chunks
        finally:
            self._reading = False
            self._extend_ended()

    def _took(self, chunk: VideoChunk) -> int:
        """Count a chunk the session made; 1 for a block's chunk (0 for the start frames)."""
        if self._sampling.get("keep_video", True):
            self.chunks.append(chunk)
        if self._segment is not None:
            self.segments.append(self._segment)
            self._segment = None
        self.segments[-1].frames += len(chunk.frames)
        if chunk.block_index is None:
            return 0
        self.blocks += 1
        self.segments[-1].blocks += 1
        return 1

    def _extend_ended(self) -> None:
        """After an extend, read whole or not."""
        self._segment = None
        if self._feed.waiting:  # closed before the stream read the segment: it was never started
            self._feed.waiting.clear()

    @property
    def fps(self) -> int:
        """The frame rate of the session's video: its `fps`, or its sampling_param's, or the model's."""
        sampling = self._sampling.get("sampling_param") or self._generator.default_sampling
        return int(self._sampling.get("fps") or sampling.fps)

    def _check_usable(self) -> None:
        if self._closed:
            raise InvalidInputError("this session is closed; open another")
        if self._feed.waiting or self._reading:
            raise InvalidInputError("the previous extend was not read to its end; read it (or close it) first")

    def _blocks(self, num_blocks: int) -> Iterator[VideoChunk]:
        self._reading = True
        try:
            self._ensure_stream()
            if self._chunks is None:
                self._chunks = iter(self._stream)
            made = 0
            while made < num_blocks:
                try:
                    chunk = next(self._chunks)
                except StopIteration:
                    self.close()
                    raise InvalidInputError("the session's stream ended early") from None
                made += self._took(chunk)
                yield chunk
            self._stream.pace.pause()  # the time until the next extend is not the stream's: its frame rate skips it
        finally:
            self._reading = False
            self._extend_ended()

    # -- branches and snapshots ------------------------------------------------------------------------
    def _states(self) -> tuple[Any, Any] | None:
        """(CausalState, StreamDecodeState) where the session stands (None before its first block)."""
        from composer.stages.causal_denoising import CausalState
        from composer.stages.decoding import StreamDecodeState

        if self._restore is not None:
            return self._restore
        if self._stream is None:
            return None
        batch = self._stream._batch
        causal, decode = batch.get(CausalState, None), batch.get(StreamDecodeState, None)
        return None if causal is None or decode is None else (causal, decode)

    def fork(self, *, priority: int | None = None, cancel: Any = None) -> Session:
        """A second session that continues this video independently: everything so far is shared (KV pages
        copy-on-write), and either one's next `extend` gives what this session's would. Waits, like a new stream,
        until the KV pool has room for the fork's own pages. `priority` / `cancel`: the fork's (default: this
        session's priority, no cancel token)."""
        from composer.cancel import CancelToken
        from composer.request_check import _checked_priority

        self._check_usable()
        if cancel is not None and not isinstance(cancel, CancelToken):
            raise InvalidInputError(f"cancel = {cancel!r}: expected a composer.CancelToken (or None)")
        states = self._states()
        sampling = {k: v for k, v in self._sampling.items() if k != "cancel" and (states is None or k not in _NOT_KEPT)}
        if priority is not None:
            sampling["priority"] = _checked_priority(priority)
        if cancel is not None:
            sampling["cancel"] = cancel
        child = Session(self._generator, sampling)
        if states is not None:
            causal, decode = states
            child._restore = (causal.fork(priority=int(sampling.get("priority", 0)), cancel=cancel), decode.fork())
        child._earlier = self._earlier
        child.chunks = list(self.chunks)
        child.blocks = self.blocks
        child.segments = [Segment(s.prompt, s.blocks, s.frames) for s in self.segments]
        return child

    def snapshot(self) -> bytes:
        """Everything needed to continue this session, in another process too (`VideoGenerator.resume_session`):
        latents, KV cache, random generator, decoder state, the plan, and (keep_video) the frames so far."""
        import io

        import torch

        self._check_usable()
        sampling = {k: v for k, v in self._sampling.items() if k not in _NOT_KEPT}
        for key, value in sampling.items():
            if not _plain(value):
                raise InvalidInputError(f"a session snapshot keeps plain values only; {key} = {value!r} is not one")
        states = self._states()
        frames = self.frames if self._sampling.get("keep_video", True) else None
        payload = {
            "format": SNAPSHOT_FORMAT,
            "model": model_fingerprint(self._generator),
            "sampling": sampling,
            "blocks": self.blocks,
            "segments": [[s.prompt, s.blocks, s.frames] for s in self.segments],
            "state": None if states is None else states[0].export(),
            "decoder": None if states is None else states[1].export(),
            "frames": None if frames is None or not len(frames) else torch.from_numpy(frames),
        }
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        return pack_snapshot(buffer.getvalue())

    @classmethod
    def resume(cls, generator: Any, data: bytes) -> Session:
        """The session `snapshot` wrote, on `generator` (the same model)."""
        import io
        import pickle

        import torch

        from composer.stages.decoding import StreamDecodeState

        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidInputError(f"resume_session takes the bytes Session.snapshot() returned, got "
                                    f"{type(data).__name__}")
        packed = unpack_snapshot(data)  # header, length and digest: nothing unchecked reaches torch.load
        try:
            payload = torch.load(io.BytesIO(packed), map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as exc:
            reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            raise SnapshotError(f"the session snapshot's contents do not load ({reason})") from None
        if not isinstance(payload, dict) or payload.get("format") != SNAPSHOT_FORMAT:
            raise SnapshotError(f"not a session snapshot of this composer (expected format {SNAPSHOT_FORMAT})")
        mine = model_fingerprint(generator)
        if payload["model"] != mine:
            differ = sorted(k for k in mine if payload["model"].get(k) != mine[k])
            raise InvalidInputError(f"this snapshot was made with another model (its {', '.join(differ)} differ "
                                    "from this generator's); resume it on the model that made it")
        session = cls(generator, dict(payload["sampling"]))
        if payload["state"] is not None:
            pipeline = generator.pipeline
            causal = pipeline.stage("CausalDenoisingStage").restore(payload["state"])
            decode = StreamDecodeState.load(pipeline.modules["vae"], payload["decoder"])
            session._restore = (causal, decode)
        if payload["frames"] is not None:
            session._earlier = payload["frames"].numpy()
        session.blocks = int(payload["blocks"])
        session.segments = [Segment(str(prompt), int(blocks), int(frames)) for prompt, blocks, frames in
                            payload["segments"]]
        return session

    @property
    def frames(self) -> np.ndarray:
        """Every frame so far, uint8 [T, H, W, 3] (with keep_video)."""
        parts = ([] if self._earlier is None else [self._earlier]) + [c.frames for c in self.chunks]
        if not parts:
            return np.zeros((0, 0, 0, 3), dtype=np.uint8)
        return np.concatenate(parts)

    @property
    def stats(self):
        return None if self._stream is None else self._stream.stats

    def close(self) -> None:
        """End the session: its stream lets go of the model and its KV pages go back to the pool."""
        if self._closed:
            return
        self._closed = True
        close = getattr(getattr(self._stream, "_chunks", None), "close", None)
        if close is not None:
            close()
        if self._restore is not None:  # a fork or resumed session that never ran: its caches are released
            self._restore[0].close_rollout()
            self._restore = None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False


def model_fingerprint(generator: Any) -> dict[str, str]:
    """What a snapshot must be resumed on: the pipeline, the transformer's config and dtype, the VAE's."""
    import dataclasses
    import json

    pipeline = generator.pipeline
    transformer, vae = pipeline.modules["transformer"], pipeline.modules["vae"]
    config = transformer.config
    config = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    return {
        "pipeline": type(pipeline).__name__,
        "transformer": json.dumps(config, sort_keys=True, default=str),
        "dtype": str(transformer.dtype),
        "vae": json.dumps(dict(vae.config), sort_keys=True, default=str),
    }
