"""Writing frames to disk: mp4 / webm / mov / mkv / avi (ffmpeg), gif, or a folder of PNGs.

Writing is atomic: frames go to a hidden temporary file (or folder) next to the target, renamed over it
only when the video is complete, so a failure or Ctrl-C leaves the target as it was and no half-written file.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from composer.errors import InvalidInputError, OutputError
from composer.images import read_image_file

VIDEO_SUFFIXES = (".mp4", ".webm", ".mov", ".mkv", ".avi")
FRAME_FILE_PATTERN = "frame_*.png"
SUPPORTED_OUTPUTS = (
    f"{', '.join(VIDEO_SUFFIXES)}, .gif, or a folder of PNG frames (a path without a suffix, or ending in '/')"
)


def output_kind(path: str | os.PathLike) -> str:
    """'video', 'gif' or 'frames' (a folder of PNGs: a path ending in '/' or without a suffix); an
    InvalidInputError naming the supported outputs for anything else (`x.png`, `x.jpg`: not a folder)."""
    text = os.fspath(path)
    if text.endswith(("/", os.sep)):
        return "frames"
    suffix = Path(text).suffix.lower()
    if suffix in VIDEO_SUFFIXES:
        return "video"
    if suffix == ".gif":
        return "gif"
    if not suffix:
        return "frames"
    raise InvalidInputError(f"cannot write a video to {text}: unknown suffix '{suffix}' (use {SUPPORTED_OUTPUTS})")


class VideoWriter:
    """Writes uint8 frames [t, H, W, 3] as they come, in the format `output_kind` reads from the path: video
    suffixes are encoded progressively by ffmpeg, a folder gets one PNG per frame, a .gif is written on close.

    Frames go to a temporary name next to the target; `close()` renames it over the target (replacing an
    existing file, or a folder of earlier frames), `abort()` deletes it. As a context manager it closes on
    success and aborts on any exception, Ctrl-C included.
    """

    def __init__(self, path: str | os.PathLike, fps: int = 16):
        self.kind = output_kind(path)
        self.path = Path(path)
        if isinstance(fps, bool) or not isinstance(fps, int) or fps <= 0:
            raise InvalidInputError(f"fps = {fps!r}: expected a positive integer")
        self.fps = fps
        self.count = 0
        self._writer = None
        self._gif_frames: list[np.ndarray] = []
        # hidden, unique, with the target's suffix last (ffmpeg picks the container from it)
        self._temp = self.path.parent / f".{self.path.stem}.{uuid.uuid4().hex[:8]}.partial{self.path.suffix}"
        self._done = False
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.kind == "frames":
                self._temp.mkdir()
        except OSError as exc:
            raise OutputError(f"cannot write {self.path}: {exc.strerror or exc}") from exc

    def append(self, frames: np.ndarray) -> None:
        import imageio.v2 as imageio

        frames = np.asarray(frames)
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise InvalidInputError(f"expected uint8 frames [T, H, W, 3], got {frames.dtype} {list(frames.shape)}")
        try:
            if self.kind == "video":
                if self._writer is None:
                    codec = "libvpx-vp9" if self.path.suffix.lower() == ".webm" else "libx264"
                    # macro_block_size=1: never resize; composer's sizes are multiples of 16 already.
                    self._writer = imageio.get_writer(
                        self._temp, fps=self.fps, codec=codec, quality=8, macro_block_size=1,
                        pixelformat="yuv420p", ffmpeg_log_level="error",
                    )
                for frame in frames:
                    self._writer.append_data(frame)
            elif self.kind == "gif":
                self._gif_frames.extend(frames)
            else:
                for i, frame in enumerate(frames):
                    imageio.imwrite(self._temp / f"frame_{self.count + i:05d}.png", frame)
        except OSError as exc:  # disk full, the folder removed underneath us, ffmpeg gone (BrokenPipe)
            self.abort()
            raise OutputError(f"writing {self.path} failed after {self.count} frames: {exc}") from exc
        self.count += len(frames)

    def close(self) -> Path:
        """Finish the file and rename it over the target; returns the target. Nothing is written for a
        video that got no frames."""
        import imageio.v2 as imageio

        if self._done:
            return self.path
        try:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            if self.kind == "gif" and self._gif_frames:
                imageio.mimsave(self._temp, self._gif_frames, duration=1000 / self.fps, loop=0)
            if self.count:
                _replace(self._temp, self.path)
        except OSError as exc:
            self.abort()
            raise OutputError(f"writing {self.path} failed: {exc}") from exc
        self.abort()  # removes the temporary name when nothing was written
        return self.path

    def abort(self) -> None:
        """Drop what was written: the target is left as it was."""
        self._done = True
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except Exception:  # noqa: BLE001 - ffmpeg may already be gone; the file is deleted anyway
                pass
        if self._temp.is_dir():
            shutil.rmtree(self._temp, ignore_errors=True)
        elif self._temp.exists():
            self._temp.unlink(missing_ok=True)

    def __enter__(self) -> VideoWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _replace(temp: Path, target: Path) -> None:
    """Rename `temp` over `target`. A folder target (earlier frames; the request check allows only those or
    an empty folder) is moved aside first, then deleted, since a rename cannot replace a non-empty folder."""
    if target.is_dir() and not target.is_symlink():
        aside = target.parent / f".{target.name}.{uuid.uuid4().hex[:8]}.old"
        target.rename(aside)
        temp.rename(target)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.replace(temp, target)


def save_video(frames: np.ndarray, path: str | os.PathLike, fps: int = 16) -> Path:
    """Write uint8 frames [T, H, W, 3] atomically. The format follows the path (see `output_kind`)."""
    with VideoWriter(path, fps) as writer:
        writer.append(frames)
    return writer.path


IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}


def read_frames(path: str | Path) -> np.ndarray:
    """An image or video file -> uint8 frames [T, H, W, 3] (an image is one frame, read as every input image is:
    `composer.images.to_rgb`)."""
    import imageio.v2 as imageio

    path = Path(path)
    if not path.is_file():
        raise InvalidInputError(f"{path} does not exist")
    if path.suffix.lower() in IMAGE_SUFFIXES:
        return np.array(read_image_file(path))[None]  # a writable copy (torch.from_numpy warns on a read-only one)
    try:
        with imageio.get_reader(path, format="FFMPEG") as reader:  # imageio-ffmpeg: no extra dependency
            frames = np.stack([np.asarray(f) for f in reader])
    except Exception as exc:  # noqa: BLE001 - any decoder failure is a bad input file to the user
        raise InvalidInputError(f"could not read frames from {path}: {exc}") from exc
    if frames.ndim == 3:  # grayscale
        frames = np.repeat(frames[..., None], 3, axis=-1)
    return np.ascontiguousarray(frames[..., :3]).astype(np.uint8)


def read_video_frames(value: Any, name: str = "video") -> list:
    """The request's video as PIL RGB frames: a file path, uint8 frames [T, H, W, 3] (numpy or torch), or a list of
    frames each given as an image is (PIL, array, tensor, file); InvalidInputError naming `name` otherwise."""
    import torch

    from composer.images import load_image

    if isinstance(value, (str, os.PathLike)):
        value = read_frames(Path(value))
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        if value.ndim != 4 or value.shape[-1] not in (3, 4):
            raise InvalidInputError(f"{name}: frames of shape {list(value.shape)}: expected uint8 frames "
                                    "[T, H, W, 3]")
        value = list(value)
    if not isinstance(value, (list, tuple)) or not value:
        raise InvalidInputError(f"{name} = {type(value).__name__}: expected a video file, uint8 frames [T, H, W, 3] "
                                "or a non-empty list of frames")
    return [load_image(frame, f"{name}[{i}]") for i, frame in enumerate(value)]
