"""Input images of image-to-video requests: whatever the user gives -> one RGB PIL image, or a clear error.

Accepted, under diffusers' knob names (`image`, `last_image`): a PIL image, a numpy array [H, W, 3] (uint8, or
float in [0, 1]), a torch tensor [3, H, W] or [H, W, 3] (same value ranges), or an image file path (str or
Path). Everything becomes a PIL RGB image first, so every input type is resized and encoded exactly as diffusers
treats a PIL image.

`to_rgb` is the one rule for turning a PIL image of any mode into 8-bit RGB, and `read_image_file` the one
reader of image files: the I2V images, a causal model's start image and the server's base64 images all go
through them. 16-bit and 32-bit grey are scaled to 8 bits (Pillow's own conversion clips them to white), float
grey is read as [0, 1], CMYK and YCbCr are converted, a palette is expanded, and alpha is dropped (the colour
stored under a transparent pixel is kept, as Pillow's and diffusers' RGB conversion do).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from composer.errors import InvalidInputError

# The request knobs that carry input images, in the order a video uses them.
IMAGE_KNOBS = ("image", "last_image")
ACCEPTED = ("a PIL image, a numpy array [H, W, 3] (uint8, or float in [0, 1]), a torch tensor [3, H, W] or "
            "[H, W, 3], or an image file path")


def describe_image(value: Any) -> str:
    """A short description of an input image value for messages (no pixel data)."""
    if isinstance(value, (str, os.PathLike)):
        return repr(str(value))
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"{type(value).__name__}(shape={list(shape)}, dtype={getattr(value, 'dtype', '?')})"
    size = getattr(value, "size", None)
    if type(value).__module__.startswith("PIL") and size is not None:
        return f"PIL image {size[0]}x{size[1]} ({getattr(value, 'mode', '?')})"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def shown_input(value: Any) -> Any:
    """An input image or video as a request failure shows it: a path as given, arrays and images by type and size
    (no pixels), anything else as it is."""
    if isinstance(value, (str, os.PathLike)):
        return str(value)
    return describe_image(value) if hasattr(value, "size") or hasattr(value, "shape") else value


class _Unusable(Exception):
    """Why a value is not an image: the rule it breaks, as "expected ..." text."""


def load_image(value: Any, name: str = "image"):
    """`value` as a PIL RGB image; InvalidInputError naming `name` when it is missing, unreadable or of a wrong
    type or shape."""
    try:
        return _to_pil(value)
    except _Unusable as exc:
        raise InvalidInputError(f"{name} = {describe_image(value)}: expected {exc}") from None


def image_problem(value: Any) -> str | None:
    """What is wrong with `value` as an input image ("expected ..." text), or None when it loads."""
    try:
        _to_pil(value)
    except _Unusable as exc:
        return str(exc)
    return None


def _to_pil(value: Any):
    import PIL.Image

    if isinstance(value, PIL.Image.Image):
        return _rgb(value)
    if isinstance(value, (str, os.PathLike)):
        return _read_file(Path(value))
    if isinstance(value, np.ndarray):
        return PIL.Image.fromarray(_as_uint8(value, channels_first=False, layout="[H, W, 3]"))
    import torch

    if isinstance(value, torch.Tensor):
        array = value.detach().cpu()
        array = array.float().numpy() if array.is_floating_point() else array.numpy()
        channels_first = array.ndim == 3 and array.shape[0] == 3 and array.shape[-1] != 3
        return PIL.Image.fromarray(_as_uint8(array, channels_first, layout="[3, H, W] or [H, W, 3]"))
    raise _Unusable(ACCEPTED)


def _read_file(path: Path):
    import PIL.Image
    import PIL.ImageOps

    if not path.exists():
        raise _Unusable("an existing image file (no such file)")
    if not path.is_file():
        raise _Unusable("an image file (this is a folder)")
    try:
        with PIL.Image.open(path) as opened:
            opened.load()  # decode now: a truncated file fails here, not later in the pipeline
            # as diffusers' load_image: a photo's EXIF orientation is applied (else a phone picture lies sideways)
            return _rgb(PIL.ImageOps.exif_transpose(opened))
    except (OSError, ValueError, SyntaxError, PIL.Image.DecompressionBombError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise _Unusable(f"a readable image file ({reason})") from None


def read_image_file(path: str | os.PathLike):
    """An image file as a PIL RGB image (see `to_rgb`); InvalidInputError naming the file when it is missing or
    unreadable."""
    try:
        return _read_file(Path(path))
    except _Unusable as exc:
        raise InvalidInputError(f"could not read the image {path}: expected {exc}") from None


def to_rgb(image: Any, name: str = "image"):
    """A PIL image of any mode as 8-bit RGB: 16/32-bit grey (I;16*, I) scaled by 1/257, float grey (F) read as
    [0, 1], 1 / L / P / CMYK / YCbCr / LAB / HSV converted, alpha (LA, PA, RGBA, P with transparency) dropped.
    InvalidInputError naming `name` for a mode or value range that has no such reading."""
    try:
        return _rgb(image)
    except _Unusable as exc:
        raise InvalidInputError(f"{name} = {describe_image(image)}: expected {exc}") from None


def _rgb(image: Any):
    mode = image.mode
    if mode == "RGB":
        return image
    if mode.startswith("I"):  # I;16, I;16B, I;16L, I;16N (16-bit grey), I (32-bit int, how some PNGs open)
        grey = np.asarray(image).astype(np.int64)
        if grey.min() < 0 or grey.max() > 65535:
            raise _Unusable(f"16-bit grey pixels (0-65535), not {grey.min()}..{grey.max()} in mode {mode}")
        return _grey_rgb(((grey + 128) // 257).astype(np.uint8))  # round(v / 257): 65535 -> 255, 0xC000 -> 191
    if mode == "F":
        grey = np.asarray(image, dtype=np.float64)
        if not np.isfinite(grey).all() or grey.min() < 0.0 or grey.max() > 1.0:
            raise _Unusable("float grey pixels (mode F) in [0, 1]")
        return _grey_rgb((grey * 255.0).round().astype(np.uint8))
    if mode in ("P", "PA"):  # via RGBA: Pillow warns when a palette's transparency is converted straight to RGB
        image = image.convert("RGBA")
    try:
        return image.convert("RGB")
    except ValueError as exc:  # a mode Pillow cannot convert (LAB without a colour profile, multi-band raw...)
        raise _Unusable(f"an image in a colour mode composer reads, not {mode} ({exc})") from None


def _grey_rgb(grey: np.ndarray):
    import PIL.Image

    return PIL.Image.fromarray(np.ascontiguousarray(np.repeat(grey[..., None], 3, axis=-1)))


def _as_uint8(array: np.ndarray, channels_first: bool, layout: str) -> np.ndarray:
    """An [H, W, 3] uint8 array from [H, W, 3] / [3, H, W] uint8 or [0, 1] float data."""
    if channels_first:
        array = np.moveaxis(array, 0, -1)
    if array.ndim != 3 or array.shape[-1] != 3 or min(array.shape[:2]) < 1:
        raise _Unusable(f"an RGB image of shape {layout}")
    if array.dtype == np.uint8:
        return np.ascontiguousarray(array)
    if np.issubdtype(array.dtype, np.floating):
        if not np.isfinite(array).all() or array.min() < 0.0 or array.max() > 1.0:
            raise _Unusable("float pixels in [0, 1] (or uint8 pixels 0-255)")
        return np.ascontiguousarray((array * 255.0).round().astype(np.uint8))
    raise _Unusable(f"uint8 (0-255) or float ([0, 1]) pixels, not {array.dtype}")


def refuse_image_knobs(given: Iterable[str], takes: Iterable[str], family: str, cli: bool = False) -> None:
    """A request giving an input image to a model that takes none: one clear InvalidInputError (instead of an
    'unknown sampling parameter'). `takes`: the knob names the model's family accepts."""
    takes = set(takes)
    extra = [knob for knob in IMAGE_KNOBS if knob in set(given) and knob not in takes]
    if not extra:
        return
    named = ", ".join("--" + k.replace("_", "-") if cli else k for k in extra)
    if "image" in takes:  # an image-to-video model conditioning on the first frame only
        raise InvalidInputError(f"{named} given, but {family} conditions on the first frame (image) only; a "
                                "first-last-frame model (Wan2.1 FLF2V) takes a last frame")
    hint = " (a causal model starts from an image with start_image)" if "start_image" in takes else ""
    raise InvalidInputError(f"{named} given, but {family} is a text-to-video model and takes no input image{hint}; "
                            "use an image-to-video model (composer models lists them), or leave it out")
