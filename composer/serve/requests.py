"""A JSON body -> the keyword arguments of generate_video, checked as generate_video checks them, plus the
server's limits. Every problem is a RequestProblem naming the field (an HTTP 4xx)."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from composer._fields import field_types, json_value_problem
from composer.errors import ComposerError, InvalidInputError
from composer.images import refuse_image_knobs, to_rgb
from composer.request_check import ModelLimits, RequestError, check_request
from composer.runtime import lora_scale_problem

# Set by the server, never by a request: where the video goes, and one video per job.
SERVER_FIELDS = ("output_path", "overwrite", "num_videos_per_prompt")
IMAGE_FIELDS = ("image", "last_image")
# Paths on the server's disk (a causal model's start frames, a video-to-video input): a client must not name the
# server's files.
SERVER_PATHS = ("start_image", "start_video", "video")
# The server's own request fields (not SamplingParam's): OpenAI's aliases, the adapters, the queue priority.
ALIASES = ("model", "size", "seconds", "lora", "lora_scale", "priority")
SIZE = re.compile(r"^\s*(\d{1,6})\s*[xX]\s*(\d{1,6})\s*$")


class RequestProblem(Exception):
    """A request the server refuses: `status` (400, 413, 422...), the message, and the field at fault."""

    def __init__(self, message: str, field: str | None = None, status: int = 422):
        super().__init__(message)
        self.field = field
        self.status = status


@dataclass(frozen=True)
class ServerLimits:
    """Per-request limits of `composer serve` (None: no limit beyond the model's)."""

    max_frames: int | None = 81
    max_size: int | None = 1280  # the longer side, in pixels
    max_steps: int | None = 100


@dataclass(frozen=True)
class LoraOption:
    """An adapter the server loaded at start (--lora-path): requests pick among these by `name` (the file stem)."""

    name: str
    path: str
    scale: float = 1.0  # its --lora-scale: the scale a request gets unless it says otherwise


@dataclass
class CheckedRequest:
    """What a job runs: JSON-safe SamplingParam fields (the record), decoded input images, and the LoRA adapters
    to apply as [name, scale] pairs (empty: the base model)."""

    params: dict[str, Any]
    inputs: dict[str, Any]
    lora: list[list] = field(default_factory=list)
    priority: int = 0


def check_body(body: Any, generator: Any, limits: ServerLimits, loras: Sequence[LoraOption] = ()) -> CheckedRequest:
    """Check a parsed JSON body for `generator`; RequestProblem on the first class of problem found."""
    if not isinstance(body, dict):
        raise RequestProblem(f"the body must be a JSON object of request fields, not {type(body).__name__}")
    defaults = generator.default_sampling
    hints = field_types(type(defaults))
    accepted = [name for name in hints
                if name not in SERVER_FIELDS and name not in SERVER_PATHS and not name.startswith("_")]
    unknown = [key for key in body if key not in accepted and key not in ALIASES]
    paths = [key for key in unknown if key in SERVER_PATHS and key in hints]
    if paths:
        raise RequestProblem(f"{paths[0]} names a file on the server and is not accepted over HTTP (not built yet: "
                             "uploaded start frames and videos)", paths[0])
    image_keys = [key for key in unknown if key in IMAGE_FIELDS or key in SERVER_PATHS]
    if image_keys:  # composer's own message: a text-to-video model, or a first-frame-only one
        try:
            refuse_image_knobs(image_keys, hints, generator.family)
        except InvalidInputError as exc:
            raise RequestProblem(str(exc), image_keys[0]) from None
    if unknown:
        raise RequestProblem(f"unknown field {unknown[0]!r}: accepted fields are {', '.join(accepted + list(ALIASES))}",
                             unknown[0])
    if "prompt" not in body:
        raise RequestProblem("prompt is required: a non-empty string", "prompt")
    params: dict[str, Any] = {}
    inputs: dict[str, Any] = {}
    for key, value in body.items():
        if key in ALIASES or value is None:
            continue
        if key in IMAGE_FIELDS:
            inputs[key] = decode_image(value, key)
        else:
            params[key] = _typed(key, value, hints[key])
    _check_model(body, generator)
    _apply_aliases(body, params, generator)
    lora = select_lora(body, loras, generator)
    priority = _priority(body)
    try:
        sp = defaults.updated(**params, **inputs)
        check_request(sp, ModelLimits.from_pipeline(generator.pipeline))
    except RequestError as exc:
        raise RequestProblem(str(exc), exc.failures[0][0].split("[")[0]) from None
    except ComposerError as exc:
        raise RequestProblem(str(exc)) from None
    _check_limits(sp, limits)
    if sp.seed is None:  # a fixed seed, so the record says how to make the video again
        import random

        sp = sp.updated(seed=random.randrange(2**31))
    record = {k: v for k, v in dataclasses.asdict(sp).items()
              if k not in SERVER_FIELDS and k not in IMAGE_FIELDS and _json_safe(v)}
    return CheckedRequest(record, inputs, lora, priority)


def _typed(key: str, value: Any, annotation: Any) -> Any:
    """A JSON value of the field's type (`json_value_problem`, strict: an integer is not true/false nor 1.5, a
    number is finite: Python's JSON reader takes NaN and Infinity), else a RequestProblem naming the field."""
    expected = json_value_problem(value, annotation)
    if expected is not None:
        raise RequestProblem(f"{key} = {value!r}: expected {expected.removesuffix(' or null')}", key)
    return value


def _apply_aliases(body: dict, params: dict[str, Any], generator: Any) -> None:
    """OpenAI's `size` ("WIDTHxHEIGHT") and `seconds` (at the request's fps) as composer's fields."""
    if "size" in body:
        if "height" in body or "width" in body:
            raise RequestProblem("give size or height/width, not both", "size")
        match = SIZE.match(body["size"]) if isinstance(body["size"], str) else None
        if match is None:
            raise RequestProblem(f"size = {body['size']!r}: expected \"WIDTHxHEIGHT\", e.g. \"832x480\"", "size")
        params["width"], params["height"] = int(match.group(1)), int(match.group(2))
    if "seconds" in body:
        if "num_frames" in body:
            raise RequestProblem("give seconds or num_frames, not both", "seconds")
        seconds = body["seconds"]
        if isinstance(seconds, str):  # OpenAI's client sends "4"
            try:
                seconds = float(seconds)
            except ValueError:
                seconds = None
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds <= 3600:
            raise RequestProblem(f"seconds = {body['seconds']!r}: expected a number of seconds > 0", "seconds")
        fps = params.get("fps", generator.default_sampling.fps)
        limits = ModelLimits.from_pipeline(generator.pipeline)
        t = limits.temporal_factor or 1
        params["num_frames"] = max(0, round((seconds * fps - 1) / t)) * t + 1  # the nearest valid length (t k + 1)


def _priority(body: dict) -> int:
    """`priority`: an integer, higher first (default 0): the queue's order, and the order of the waiting steps
    of the jobs that run together."""
    value = body.get("priority")
    if value is None:
        return 0
    return _typed("priority", value, int)


def _check_model(body: dict, generator: Any) -> None:
    """OpenAI clients send `model`: it must name the served model (its family, folder name or path)."""
    if "model" not in body:
        return
    path = str(generator.model_path)
    names = {generator.family, path, path.rstrip("/").rsplit("/", 1)[-1]}
    if not isinstance(body["model"], str):
        raise RequestProblem(f"model = {body['model']!r}: expected a string naming the served model, "
                             f"{generator.family!r} (or leave model out)", "model")
    if body["model"] not in names:
        raise RequestProblem(f"model = {body['model']!r}: this server serves {generator.family} ({path}); leave "
                             "model out or name that one", "model")


def select_lora(body: dict, loras: Sequence[LoraOption], generator: Any = None) -> list[list]:
    """The adapters a request runs with, as [name, scale] pairs.

    `lora`: a loaded adapter's name, a list of names, or [] for the base model; left out, every adapter loaded at
    start applies at its start scale. `lora_scale`: one number (for every selected adapter) or one per name.
    """
    names = [o.name for o in loras]
    have = ", ".join(names) if names else "none (start the server with --lora-path)"
    if body.get("lora") is not None:  # null: as if left out, like every other field
        chosen = body["lora"]
        chosen = [chosen] if isinstance(chosen, str) else chosen
        if not isinstance(chosen, list) or not all(isinstance(n, str) for n in chosen):
            raise RequestProblem(f"lora = {body['lora']!r}: expected an adapter's name, a list of names, or [] for "
                                 f"the base model; loaded adapters: {have}", "lora")
        unknown = [n for n in chosen if n not in names]
        if unknown:
            raise RequestProblem(f"lora = {unknown[0]!r}: expected one of the loaded adapters: {have}", "lora")
        if len(set(chosen)) != len(chosen):
            raise RequestProblem(f"lora = {body['lora']!r}: an adapter is named twice", "lora")
    else:
        chosen = names
    by_name = {o.name: o for o in loras}
    scales = [by_name[n].scale for n in chosen]
    if body.get("lora_scale") is not None:
        given = body["lora_scale"]
        if not chosen:
            raise RequestProblem("lora_scale is set but no adapter is selected (loaded adapters: " + have + ")",
                                 "lora_scale")
        values = given if isinstance(given, list) else [given] * len(chosen)
        ok = len(values) == len(chosen) and all(lora_scale_problem(v) is None for v in values)
        if not ok:
            raise RequestProblem(f"lora_scale = {given!r}: expected {lora_scale_problem(float('nan'))}, or a list "
                                 f"of one per selected adapter ({', '.join(chosen)})", "lora_scale")
        scales = [float(v) for v in values]
    selection = [[n, s] for n, s in zip(chosen, scales)]
    offload = getattr(getattr(getattr(generator, "pipeline", None), "runtime", None), "offload", "none")
    if offload != "none" and selection != [[o.name, o.scale] for o in loras]:
        raise RequestProblem(f"this server offloads weights (offload = {offload}): its LoRA adapters were arranged "
                             "at load and cannot change per request; leave lora and lora_scale out", "lora")
    return selection


def _check_limits(sp: Any, limits: ServerLimits) -> None:
    """The server's limits on what the request would run (defaults included), named by field."""
    for key, limit in (("num_frames", limits.max_frames), ("height", limits.max_size), ("width", limits.max_size),
                       ("num_inference_steps", limits.max_steps)):
        value = getattr(sp, key)
        if limit is not None and value > limit:
            raise RequestProblem(f"{key} = {value}: this server allows at most {limit}", key)


def decode_image(value: Any, key: str) -> Any:
    """A base64 string or a `data:image/...;base64,` URL -> an RGB PIL image."""
    import PIL.Image
    import PIL.ImageOps

    if not isinstance(value, str):
        raise RequestProblem(f"{key}: expected a base64-encoded image (or a data URL), not {type(value).__name__}",
                             key)
    text = value.split(",", 1)[1] if value.startswith("data:") and "," in value else value
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise RequestProblem(f"{key}: expected base64-encoded image data (it does not decode as base64)", key) from None
    try:
        with PIL.Image.open(io.BytesIO(data)) as image:
            image.load()
            image = PIL.ImageOps.exif_transpose(image)
    except (OSError, ValueError, SyntaxError, PIL.Image.DecompressionBombError) as exc:
        raise RequestProblem(f"{key}: the base64 data is not a readable image ({exc})", key) from None
    try:
        return to_rgb(image, key)  # the one rule for every input image: 16-bit, CMYK, palette, alpha
    except InvalidInputError as exc:
        raise RequestProblem(str(exc), key) from None


def _json_safe(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool, list))
