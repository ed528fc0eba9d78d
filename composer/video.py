"""Writing frames to disk: mp4 / webm / mov / mkv (ffmpeg), gif, or a folder of PNGs."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from composer.errors import InvalidInputError

VIDEO_SUFFIXES = {".mp4", ".mov", ".mkv", ".webm", ".avi"}


class VideoWriter:
    """Writes uint8 frames [t, H, W, 3] as they come. The format follows the suffix: .mp4/.webm/.mov/.mkv/.avi
    are encoded progressively by ffmpeg, a path without suffix (or .png) becomes a folder of PNGs written frame
    by frame, and .gif is written on close."""

    def __init__(self, path: str | Path, fps: int = 16):
        self.path = Path(path)
        self.fps = fps
        self.count = 0
        self._suffix = self.path.suffix.lower()
        self._writer = None
        self._gif_frames: list[np.ndarray] = []
        if self._suffix not in VIDEO_SUFFIXES | {".gif", ".png", ""}:
            raise InvalidInputError(
                f"cannot write video to {self.path}: unknown suffix '{self._suffix}' "
                "(use .mp4, .webm, .mov, .mkv, .avi, .gif, or a folder)"
            )
        if self._suffix in ("", ".png"):
            self.path = self.path.with_suffix("")
            self.path.mkdir(parents=True, exist_ok=True)
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, frames: np.ndarray) -> None:
        import imageio.v2 as imageio

        frames = np.asarray(frames)
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise InvalidInputError(f"expected uint8 frames [T, H, W, 3], got {frames.dtype} {list(frames.shape)}")
        if self._suffix in VIDEO_SUFFIXES:
            if self._writer is None:
                codec = "libvpx-vp9" if self._suffix == ".webm" else "libx264"
                # macro_block_size=1: never resize; composer's sizes are multiples of 16 already.
                self._writer = imageio.get_writer(
                    self.path, fps=self.fps, codec=codec, quality=8, macro_block_size=1, pixelformat="yuv420p",
                    ffmpeg_log_level="error",
                )
            for frame in frames:
                self._writer.append_data(frame)
        elif self._suffix == ".gif":
            self._gif_frames.extend(frames)
        else:
            for i, frame in enumerate(frames):
                imageio.imwrite(self.path / f"frame_{self.count + i:05d}.png", frame)
        self.count += len(frames)

    def close(self) -> Path:
        import imageio.v2 as imageio

        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._suffix == ".gif" and self._gif_frames:
            imageio.mimsave(self.path, self._gif_frames, duration=1000 / self.fps, loop=0)
        return self.path

    def __enter__(self) -> VideoWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def save_video(frames: np.ndarray, path: str | Path, fps: int = 16) -> Path:
    """Write uint8 frames [T, H, W, 3]. The format follows the suffix; no suffix means a folder of PNGs."""
    with VideoWriter(path, fps) as writer:
        writer.append(frames)
    return writer.path


IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}


def read_frames(path: str | Path) -> np.ndarray:
    """An image or video file -> uint8 frames [T, H, W, 3] (an image is one frame)."""
    import imageio.v2 as imageio

    path = Path(path)
    if not path.is_file():
        raise InvalidInputError(f"{path} does not exist")
    try:
        if path.suffix.lower() in IMAGE_SUFFIXES:
            frames = np.asarray(imageio.imread(path))[None]
        else:
            with imageio.get_reader(path, format="FFMPEG") as reader:  # imageio-ffmpeg: no extra dependency
                frames = np.stack([np.asarray(f) for f in reader])
    except Exception as exc:  # noqa: BLE001 - any decoder failure is a bad input file to the user
        raise InvalidInputError(f"could not read frames from {path}: {exc}") from exc
    if frames.ndim == 3:  # grayscale
        frames = np.repeat(frames[..., None], 3, axis=-1)
    return np.ascontiguousarray(frames[..., :3]).astype(np.uint8)
