"""Writing frames to disk: mp4 / webm / mov / mkv (ffmpeg), gif, or a folder of PNGs."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from composer.errors import InvalidInputError

VIDEO_SUFFIXES = {".mp4", ".mov", ".mkv", ".webm", ".avi"}


def save_video(frames: np.ndarray, path: str | Path, fps: int = 16) -> Path:
    """Write uint8 frames [T, H, W, 3]. The format follows the suffix; no suffix means a folder of PNGs."""
    import imageio.v2 as imageio

    path = Path(path)
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise InvalidInputError(f"expected uint8 frames [T, H, W, 3], got {frames.dtype} {list(frames.shape)}")
    suffix = path.suffix.lower()
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix in VIDEO_SUFFIXES:
        codec = "libvpx-vp9" if suffix == ".webm" else "libx264"
        # macro_block_size=1: never resize; composer's sizes are multiples of 16 already.
        with imageio.get_writer(
            path, fps=fps, codec=codec, quality=8, macro_block_size=1, pixelformat="yuv420p",
            ffmpeg_log_level="error",
        ) as writer:
            for frame in frames:
                writer.append_data(frame)
    elif suffix == ".gif":
        imageio.mimsave(path, list(frames), duration=1000 / fps, loop=0)
    elif suffix in ("", ".png"):
        folder = path.with_suffix("") if suffix else path
        folder.mkdir(parents=True, exist_ok=True)
        for i, frame in enumerate(frames):
            imageio.imwrite(folder / f"frame_{i:05d}.png", frame)
        return folder
    else:
        raise InvalidInputError(
            f"cannot write video to {path}: unknown suffix '{suffix}' (use .mp4, .webm, .mov, .mkv, .gif, or a folder)"
        )
    return path
