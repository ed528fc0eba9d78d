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

from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np

from composer.batch import VideoChunk
from composer.errors import InvalidInputError


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


class Session:
    """A causal stream extended segment by segment (`VideoGenerator.open_session`)."""

    def __init__(self, generator: Any, sampling: dict[str, Any]):
        self._generator = generator
        self._sampling = sampling
        self._feed = _SegmentFeed()
        self._stream: Any = None
        self._chunks: Iterator[VideoChunk] | None = None
        self._closed = False
        self.chunks: list[VideoChunk] = []  # every chunk so far (empty with keep_video=False)
        self.blocks = 0  # blocks made so far

    def extend(self, prompt: str, num_blocks: int) -> Iterator[VideoChunk]:
        """Continue the video with `num_blocks` blocks of `prompt`, yielding each block's frames as it is decoded
        (the start frames first, on the first call of a session with a start image or video). Read it to the end
        before the next `extend`."""
        if self._closed:
            raise InvalidInputError("this session is closed; open another")
        if not isinstance(prompt, str) or not prompt:
            raise InvalidInputError(f"prompt = {prompt!r}: expected a non-empty string")
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise InvalidInputError(f"num_blocks = {num_blocks!r}: expected an integer >= 1")
        if self._feed.waiting:
            raise InvalidInputError("the previous extend was not read to its end; read it before extending again")
        self._feed.waiting.append((prompt, num_blocks))
        return self._blocks(num_blocks)

    def _blocks(self, num_blocks: int) -> Iterator[VideoChunk]:
        if self._stream is None:
            self._stream = self._generator.stream_video(self._feed, **self._sampling)
            self._chunks = iter(self._stream)
        made = 0
        while made < num_blocks:
            try:
                chunk = next(self._chunks)
            except StopIteration:
                self.close()
                raise InvalidInputError("the session's stream ended early") from None
            if chunk.block_index is not None:
                made += 1
                self.blocks += 1
            if self._sampling.get("keep_video", True):
                self.chunks.append(chunk)
            yield chunk
        self._stream.pace.pause()  # the time until the next extend is not the stream's: its frame rate skips it

    @property
    def frames(self) -> np.ndarray:
        """Every frame so far, uint8 [T, H, W, 3]."""
        if not self.chunks:
            return np.zeros((0, 0, 0, 3), dtype=np.uint8)
        return np.concatenate([c.frames for c in self.chunks])

    @property
    def stats(self):
        return None if self._stream is None else self._stream.stats

    def close(self) -> None:
        """End the session: its stream lets go of the model (and of its KV cache)."""
        if self._closed:
            return
        self._closed = True
        close = getattr(getattr(self._stream, "_chunks", None), "close", None)
        if close is not None:
            close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
