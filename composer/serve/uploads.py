"""Request bodies and the files in them: JSON or multipart/form-data (what the official `openai` SDK sends), and the
images and videos a request uploads, decoded and checked off the event loop.

A request's image or video input (`image`, `last_image`, `start_image`, `start_video`, `video`, OpenAI's
`input_reference`) arrives as a multipart file part, or as a base64 string / `data:` URL in JSON or in a form field.
Every problem is a `RequestProblem` naming the field: a 4xx, never a crash, and nothing written to disk outlives
the decode.
"""

from __future__ import annotations

import base64
import binascii
import functools
import io
import json
import operator
import os
import re
import tempfile
import types
import typing
from dataclasses import dataclass
from typing import Any

from composer.errors import InvalidInputError
from composer.images import to_rgb
from composer.serve.problems import RequestProblem

# Inputs that are one image, those that are a video (a causal model's video to continue, video-to-video's input, VACE's
# control video and mask, Wan Animate's driving videos), and those that are a list of images (VACE's reference images:
# repeated parts, or a list).
IMAGE_FIELDS = ("image", "last_image", "start_image")
VIDEO_FIELDS = ("start_video", "video", "mask", "pose_video", "face_video", "background_video", "mask_video")
IMAGE_LIST_FIELDS = ("reference_images",)
UPLOAD_FIELDS = IMAGE_FIELDS + VIDEO_FIELDS + IMAGE_LIST_FIELDS + ("input_reference",)

# The containers and codecs a video upload may be, by their first bytes (anything else is refused before ffmpeg
# sees it): ISO BMFF (mp4, mov: "ftyp" at byte 4), Matroska / WebM (EBML), AVI (RIFF....AVI ), GIF.
_VIDEO_MAGIC = (("ftyp", 4, ".mp4"), ("\x1a\x45\xdf\xa3", 0, ".mkv"), ("AVI ", 8, ".avi"), ("GIF8", 0, ".gif"))
# And the images (PIL reads more, but these are the ones a client sends).
_IMAGE_MAGIC = ((b"\x89PNG\r\n\x1a\n", 0), (b"\xff\xd8\xff", 0), (b"GIF8", 0), (b"RIFF", 0), (b"BM", 0),
                (b"II*\x00", 0), (b"MM\x00*", 0))


@dataclass(frozen=True)
class UploadLimits:
    """What an uploaded input may be: bytes per file, frames and pixels of a video (decoded frames are held in
    memory until the job runs: 200 frames of 1280x720 are 550 MB)."""

    max_bytes: int = 64 * 2**20
    max_video_frames: int = 241
    max_pixels: int = 1920 * 1088  # per frame, of an image or a video


@dataclass
class Upload:
    """A file part of a multipart body: its bytes, and what the client called it."""

    data: bytes
    filename: str | None = None
    content_type: str | None = None


def _problem(message: str, field: str | None, status: int = 422) -> RequestProblem:
    return RequestProblem(message, field, status)


# -- bodies --------------------------------------------------------------------------------------------------------

async def read_body(request: Any, limit: int, max_files: int = 8, max_fields: int = 256) -> dict[str, Any]:
    """The body as a dict of fields: JSON (an object), or multipart/form-data (form fields as strings, lists for
    `name[]` / repeated names, dicts for `name[key]`; files as `Upload`). 413 past `limit` bytes, 400 when it
    does not parse, 415 for another content type."""
    content_type = request.headers.get("content-type", "")
    data = await _read_limited(request, limit)
    if content_type.startswith("multipart/form-data"):
        return await _parse_multipart(request.headers, data, max_files, max_fields)
    if content_type.startswith("application/x-www-form-urlencoded") and not data.lstrip().startswith(b"{"):
        return await _parse_form(request.headers, data, max_fields)  # (`curl -d '{...}'` sends JSON as this type)
    if content_type and not content_type.startswith(("application/json", "text/", "application/x-www-form")):
        raise _problem(f"Content-Type {content_type.split(';')[0]!r}: send application/json or multipart/form-data",
                       None, 415)
    if not data:
        raise _problem("the body is empty: send a JSON object with at least a prompt", None, 400)
    try:
        return json.loads(bytes(data))
    except (ValueError, UnicodeDecodeError) as exc:
        raise _problem(f"the body is not valid JSON ({exc})", None, 400) from None


async def read_json(request: Any, limit: int) -> Any:
    """The body as JSON: 413 past `limit` bytes (by Content-Length or as read), 400 when it is not JSON."""
    data = await _read_limited(request, limit)
    if not data:
        raise _problem("the body is empty: send a JSON object with at least a prompt", None, 400)
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _problem(f"the body is not valid JSON ({exc})", None, 400) from None


async def _read_limited(request: Any, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise _problem(f"the body is {int(declared)} bytes; this server accepts at most {limit}", None, 413)
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise _problem(f"the body is over {limit} bytes, the most this server accepts", None, 413)
    return bytes(data)


async def _bytes_stream(data: bytes):
    yield data
    yield b""


async def _parse_multipart(headers: Any, data: bytes, max_files: int, max_fields: int) -> dict[str, Any]:
    from starlette.datastructures import UploadFile
    from starlette.formparsers import MultiPartException, MultiPartParser

    boundary = _boundary(headers.get("content-type", ""))
    if boundary is None:
        raise _problem("the multipart body has no boundary in its Content-Type", None, 400)
    if b"--" + boundary + b"--" not in data:  # the parser would keep the parts before the cut, silently
        raise _problem("the multipart body is incomplete (it has no closing boundary): was the upload cut off?", None,
                       400)
    try:
        form = await MultiPartParser(headers, _bytes_stream(data), max_files=max_files, max_fields=max_fields,
                                     max_part_size=len(data) + 1).parse()
    except MultiPartException as exc:
        raise _problem(f"the multipart body does not parse: {exc.message}", None, 400) from None
    except (ValueError, KeyError, AssertionError) as exc:
        raise _problem(f"the multipart body does not parse ({type(exc).__name__}: {exc})", None, 400) from None
    items = []
    try:
        for key, value in form.multi_items():
            if isinstance(value, UploadFile):
                value.file.seek(0)
                value = Upload(value.file.read(), value.filename, value.content_type)
            items.append((key, value))
    finally:
        await form.close()
    return form_fields(items)


def _boundary(content_type: str) -> bytes | None:
    for part in content_type.split(";")[1:]:
        name, _, value = part.strip().partition("=")
        if name.lower() == "boundary" and value:
            return value.strip('"').encode("latin-1", "replace")
    return None


async def _parse_form(headers: Any, data: bytes, max_fields: int) -> dict[str, Any]:
    from starlette.formparsers import FormParser

    form = await FormParser(headers, _bytes_stream(data), max_fields=max_fields).parse()
    return form_fields(list(form.multi_items()))


def form_fields(items: list[tuple[str, Any]]) -> dict[str, Any]:
    """Form items -> a body dict, as the OpenAI SDK flattens one: `a[]` (repeated) is a list, `a[k]` a dict entry, a
    name given twice a list. Values stay strings (or `Upload`s); `form_value` types them per field."""
    body: dict[str, Any] = {}
    for key, value in items:
        if key.endswith("[]"):
            body.setdefault(key[:-2], _FormList()).append(value)
        elif "[" in key and key.endswith("]"):
            name, sub = key[:-1].split("[", 1)
            entry = body.setdefault(name, {})
            if not isinstance(entry, dict):
                raise _problem(f"{name}: given both as a value and as {key}", name, 400)
            entry[sub] = value
        elif key in body:
            previous = body[key]
            body[key] = previous if isinstance(previous, _FormList) else _FormList([previous])
            body[key].append(value)
        else:
            body[key] = _FormString(value) if isinstance(value, str) else value
    return body


class _FormString(str):
    """A form field's text: typed by `form_value` for the field it is given to (JSON bodies are typed already)."""


class _FormList(list):
    """The values of a repeated form field."""


def is_form_value(value: Any) -> bool:
    return isinstance(value, (_FormString, _FormList))


def form_value(value: Any, annotation: Any) -> Any:
    """A form field's string as the field's JSON value: a field that takes text keeps it; others read it as JSON
    ("12" -> 12, "true" -> True, "[1, 2]" -> [1, 2]); text that is not JSON stays text, for the field's own check
    to refuse with the message a JSON body gets. Lists type each element."""
    if isinstance(value, _FormList):
        inner = typing.get_args(_no_none(annotation))
        item = inner[0] if typing.get_origin(_no_none(annotation)) is list and inner else Any
        return [form_value(_FormString(v) if isinstance(v, str) else v, item) for v in value]
    if not isinstance(value, _FormString):
        return value
    text = str(value)
    if _takes_text(annotation):
        return text
    if text == "":
        return None  # the SDK sends None as an empty field
    try:
        return json.loads(text)
    except ValueError:
        return text


def _no_none(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return functools.reduce(operator.or_, args)
    return annotation


def _takes_text(annotation: Any) -> bool:
    if annotation is str:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return str in typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return all(isinstance(a, str) for a in typing.get_args(annotation))
    return False


# -- inputs --------------------------------------------------------------------------------------------------------

def input_bytes(value: Any, key: str, kind: str, limits: UploadLimits) -> bytes:
    """The bytes of an uploaded input: a multipart file, a base64 string or a `data:` URL."""
    if isinstance(value, Upload):
        data = value.data
    elif isinstance(value, str):
        text = value.strip()
        if text.startswith("data:"):
            header, sep, text = text.partition(",")
            if not sep or ";base64" not in header:
                raise _problem(f"{key}: a data URL must be base64 (data:{kind}/...;base64,...)", key)
        # a URL or a path on the server's disk is never fetched or read; base64 can start with "/" ("/9j/" is JPEG)
        location = text.startswith(("http://", "https://", "file:", "s3://", "gs://", "ftp://")) or (
            len(text) < 4096 and text[:1] in ("/", "~", ".") and "\n" not in text)
        where = (f"{key}: expected the {kind}'s data (a file in a multipart body, or base64 / a data URL in JSON), "
                 "not a URL or a path: this server does not fetch or read files")
        if len(text) > limits.max_bytes * 4 // 3 + 4:
            raise _problem(f"{key}: the {kind} is over {limits.max_bytes} bytes, the most this server accepts", key,
                           413)
        try:
            data = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise _problem(where if location else f"{key}: expected base64-encoded {kind} data (it does not decode "
                           "as base64)", key) from None
        if location and media_kind(data) is None:
            raise _problem(where, key)
    else:
        raise _problem(f"{key}: expected a base64-encoded {kind} (or a data URL, or a file in a multipart body), "
                       f"not {type(value).__name__}", key)
    if not data:
        raise _problem(f"{key}: the uploaded {kind} is empty", key)
    if len(data) > limits.max_bytes:
        raise _problem(f"{key}: the {kind} is {len(data)} bytes; this server accepts at most {limits.max_bytes}",
                       key, 413)
    return data


def media_kind(data: bytes) -> str | None:
    """'image' or 'video' by the data's first bytes (GIF counts as an image), else None."""
    if any(data[at:at + len(magic)] == magic for magic, at in _IMAGE_MAGIC):
        if data[:4] == b"RIFF" and data[8:12] != b"WEBP":
            return "video" if data[8:12] == b"AVI " else None
        return "image"
    if any(data[at:at + len(magic)] == magic.encode("latin-1") for magic, at, _ in _VIDEO_MAGIC):
        return "video"
    return None


# What an image's first bytes say it is (for messages: "the data starts as a PNG but ...").
_IMAGE_NAMES = ((b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF8", "GIF"), (b"RIFF", "WebP"),
                (b"BM", "BMP"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"))


def decode_image(value: Any, key: str, limits: UploadLimits = UploadLimits()) -> Any:
    """An uploaded image (multipart file, base64, data URL) -> an RGB PIL image. `key`: the field the client sent
    it in, named in every message."""
    import warnings

    import PIL.Image
    import PIL.ImageOps

    data = input_bytes(value, key, "image", limits)
    if media_kind(data) == "video" and data[:4] != b"GIF8":
        raise _problem(f"{key}: the upload is a video; {key} takes an image (PNG, JPEG, WebP)", key)
    too_big = (f"{key}: the image is {{}}; this server accepts at most {limits.max_pixels} pixels (an image whose "
               "header declares more is refused before it is decoded)")
    try:
        with warnings.catch_warnings():  # PIL's bomb warning: the pixel limit below is this server's rule
            warnings.simplefilter("ignore", PIL.Image.DecompressionBombWarning)
            with PIL.Image.open(io.BytesIO(data)) as image:
                if image.width * image.height > limits.max_pixels:
                    raise _problem(too_big.format(f"{image.width}x{image.height}"), key, 413)
                image.load()
                image = PIL.ImageOps.exif_transpose(image)
    except PIL.Image.DecompressionBombError as exc:  # PIL refuses to open past 2x its own bound: size unknown
        declared = re.search(r"\((\d+) pixels\)", str(exc))
        raise _problem(too_big.format(f"{int(declared[1])} pixels" if declared else "too large"), key, 413) from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        claimed = next((name for magic, name in _IMAGE_NAMES if data.startswith(magic)), None)
        reason = re.sub(r" ?<_io\.BytesIO object at 0x[0-9a-fA-F]+>", "", str(exc)).strip() or type(exc).__name__
        what = f"the data starts as a {claimed} file but does not decode as one" if claimed else \
            "the data is not a readable image"
        raise _problem(f"{key}: {what} ({reason[:200]}); expected a whole PNG, JPEG, WebP or GIF image", key) from None
    try:
        return to_rgb(image, key)  # the one rule for every input image: 16-bit, CMYK, palette, alpha
    except InvalidInputError as exc:
        raise _problem(str(exc), key) from None


def decode_video(value: Any, key: str, limits: UploadLimits = UploadLimits()) -> Any:
    """An uploaded video (mp4, webm, mkv, mov, avi, gif; multipart file, base64, data URL) -> uint8 frames
    [T, H, W, 3]. Its size is checked from the stream's header before any frame is decoded."""
    import numpy as np

    data = input_bytes(value, key, "video", limits)
    kind = media_kind(data)
    if kind == "image" and data[:4] != b"GIF8":
        raise _problem(f"{key}: the upload is an image; {key} takes a video (mp4, webm, mov, mkv, avi, gif)", key)
    suffix = next((s for magic, at, s in _VIDEO_MAGIC if data[at:at + len(magic)] == magic.encode("latin-1")), None)
    if suffix is None:
        raise _problem(f"{key}: the upload is not a video this server reads (mp4, webm, mov, mkv, avi, gif)", key)
    with tempfile.TemporaryDirectory(prefix="composer-upload-") as folder:
        path = os.path.join(folder, "input" + suffix)
        with open(path, "wb") as f:
            f.write(data)
        frames = _read_video(path, key, limits)
    return np.ascontiguousarray(frames)


def _read_video(path: str, key: str, limits: UploadLimits) -> Any:
    import imageio.v2 as imageio
    import numpy as np

    frames = []
    try:
        with imageio.get_reader(path, format="GIF" if path.endswith(".gif") else "FFMPEG") as reader:
            meta = reader.get_meta_data()
            size = meta.get("size") or meta.get("shape")
            if size and int(size[0]) * int(size[1]) > limits.max_pixels:
                raise _problem(f"{key}: the video is {size[0]}x{size[1]}; this server accepts at most "
                               f"{limits.max_pixels} pixels a frame", key, 413)
            for frame in reader:
                if len(frames) == limits.max_video_frames:
                    raise _problem(f"{key}: the video has over {limits.max_video_frames} frames, the most this server "
                                   "accepts", key, 413)
                frame = np.asarray(frame)
                if frame.shape[0] * frame.shape[1] > limits.max_pixels:
                    raise _problem(f"{key}: the video is {frame.shape[1]}x{frame.shape[0]}; this server accepts at "
                                   f"most {limits.max_pixels} pixels a frame", key, 413)
                frames.append(frame)
    except Exception as exc:  # noqa: BLE001 - any decoder failure is a bad upload
        if isinstance(exc, RequestProblem):
            raise
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise _problem(f"{key}: the video does not decode ({reason[:200]})", key) from None
    if not frames:
        raise _problem(f"{key}: the video has no frames", key)
    if len({f.shape for f in frames}) != 1:
        raise _problem(f"{key}: the video's frames change size", key)
    stacked = np.stack(frames)
    if stacked.ndim == 3:  # grayscale
        stacked = np.repeat(stacked[..., None], 3, axis=-1)
    return stacked[..., :3].astype(np.uint8)
