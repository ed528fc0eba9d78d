"""A JSON body -> the request a job runs, checked once before it is queued (composer.request_check's check, under
the server's limits): the CheckedRequest generate_video runs as it is, and its record. Every problem is a
RequestProblem naming the field (an HTTP 4xx)."""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from composer import seeds
from composer._fields import field_types, json_value_problem
from composer.errors import ComposerError, InvalidInputError
from composer.images import refuse_image_knobs
from composer.request_check import (
    CheckedRequest,
    ModelLimits,
    RequestError,
    check_request,
    foreign_knob_problem,
    text_length_problems,
)
from composer.runtime import lora_scale_problem
from composer.serve.problems import RequestProblem
from composer.serve.uploads import (
    IMAGE_FIELDS,
    IMAGE_LIST_FIELDS,
    VIDEO_FIELDS,
    UploadLimits,
    decode_image,
    decode_video,
    form_value,
    is_form_value,
    media_kind,
)

# Set by the server, never by a request: where the video goes, and one video per job.
SERVER_FIELDS = ("output_path", "overwrite", "num_videos_per_prompt")
# Image and video inputs (uploads.py's IMAGE_FIELDS, VIDEO_FIELDS): uploads over HTTP (a multipart file, base64 or
# a data URL), never a path on the server's disk; OpenAI's `input_reference` is the model's first image or input video.
INPUT_FIELDS = IMAGE_FIELDS + VIDEO_FIELDS + IMAGE_LIST_FIELDS
SERVER_PATHS: tuple[str, ...] = ()  # no field names a server file any more (kept for the page's hidden fields)
# The server's own request fields (not SamplingParam's): OpenAI's aliases, the adapters, the queue priority.
ALIASES = ("model", "size", "seconds", "lora", "lora_scale", "priority", "input_reference")
ALIAS_TYPES: dict[str, Any] = {"model": str, "size": str, "seconds": str, "lora": str | list[str],
                               "lora_scale": float | list[float], "priority": int, "input_reference": Any}
SIZE = re.compile(r"^\s*(\d{1,6})\s*[xX]\s*(\d{1,6})\s*$")


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
class CheckedBody:
    """What a job runs: JSON-safe SamplingParam fields (the record), decoded input images, and the LoRA adapters
    to apply as [name, scale] pairs (empty: the base model); `request`: the whole request as checked (the one
    check, composer.request_check), which `generate_video(request)` runs without checking it again."""

    params: dict[str, Any]
    inputs: dict[str, Any]
    lora: list[list] = field(default_factory=list)
    priority: int = 0
    warnings: list[str] = field(default_factory=list)  # what the job should know (a prompt the encoder cuts)
    request: CheckedRequest | None = field(default=None, repr=False)


def check_body(body: Any, generator: Any, limits: ServerLimits, loras: Sequence[LoraOption] = (),
               uploads: UploadLimits | None = None, given: dict[str, Any] | None = None) -> CheckedBody:
    """Check a parsed body (JSON, or a multipart form's fields and files) for `generator`; RequestProblem on the
    first class of problem found. Uploaded images and videos are decoded here (call it off the event loop);
    `given`: inputs the server supplies itself, decoded already (a remix's source frames)."""
    if not isinstance(body, dict):
        raise RequestProblem(f"the body must be a JSON object of request fields, not {type(body).__name__}")
    uploads = uploads or UploadLimits()
    defaults = generator.default_sampling
    hints = field_types(type(defaults))
    accepted = [name for name in hints if name not in SERVER_FIELDS and not name.startswith("_")]
    body = {key: form_value(value, hints.get(key, ALIAS_TYPES.get(key, Any))) if is_form_value(value) else value
            for key, value in body.items()}
    unknown = [key for key in body if key not in accepted and key not in ALIASES]
    image_keys = [key for key in unknown if key in INPUT_FIELDS]
    if image_keys:  # composer's own message: a text-to-video model, or a first-frame-only one
        try:
            refuse_image_knobs(image_keys, hints, generator.family)
        except InvalidInputError as exc:
            raise RequestProblem(str(exc), image_keys[0]) from None
    for key in unknown:  # another model's field: say what this one does
        if problem := foreign_knob_problem(key, type(defaults), generator.family):
            raise RequestProblem(f"{key} given, but {problem}", key)
    if unknown:
        raise RequestProblem(f"unknown field {unknown[0]!r}: accepted fields are {', '.join(accepted + list(ALIASES))}",
                             unknown[0])
    if body.get("prompt") is None:
        raise RequestProblem("prompt is required: a non-empty string", "prompt")
    for name, value, rule in text_length_problems(body, sampling_cls=type(defaults)):  # before decoding uploads
        raise RequestProblem(f"{name} = {value}: expected {rule}", name)
    params: dict[str, Any] = {}
    inputs: dict[str, Any] = {}
    for key, value in body.items():
        if key in ALIASES or value is None:
            continue
        if key in INPUT_FIELDS:
            inputs[key] = _decode_input(key, value, uploads)
        else:
            params[key] = _typed(key, value, hints[key])
    for key, value in (given or {}).items():
        if key in inputs:
            raise RequestProblem(f"{key}: this request's {key} is the source video; leave {key} out", key)
        inputs[key] = value
    if body.get("input_reference") is not None:
        key, value = _input_reference(body["input_reference"], hints, generator, uploads)
        if key in inputs:
            raise RequestProblem(f"give input_reference or {key}, not both (both are the {key})", "input_reference")
        inputs[key] = value
    _check_model(body, generator)
    _apply_aliases(body, params, generator)
    lora = select_lora(body, loras, generator)
    priority = _priority(body)
    try:
        sp = defaults.updated(**params, **inputs)
        if sp.seed is None:  # a fixed seed, so the record says how to make the video again
            sp = sp.updated(seed=seeds.draw_seed())
        request = check_request(sp, server_limits(generator, limits))  # the one check, before the job is queued
    except RequestError as exc:
        raise RequestProblem(str(exc), exc.failures[0][0].split("[")[0]) from None
    except ComposerError as exc:
        raise RequestProblem(str(exc)) from None
    record = {k: v for k, v in dataclasses.asdict(sp).items()
              if k not in SERVER_FIELDS and k not in INPUT_FIELDS and _json_safe(v)}
    return CheckedBody(record, inputs, lora, priority, prompt_warnings(generator.pipeline, sp), request)


def prompt_warnings(pipeline: Any, sp: Any) -> list[str]:
    """What the pipeline's text encoding will say of the request's prompts (one longer than the encoder reads
    is cut), known before the job runs, so the job carries it from the start."""
    from composer.stages.text_encoding import PromptLengths

    stage = next((s for s in getattr(pipeline, "stages", []) if isinstance(s, PromptLengths)), None)
    if stage is None:
        return []
    said = stage.truncation_warnings("prompt", [sp.prompt]).get(0, [])
    if sp.negative_prompt:
        said += stage.truncation_warnings("negative_prompt", [sp.negative_prompt]).get(0, [])
    return said


def derive_body(body: dict, source: Any, store: Any, generator: Any, config: Any, mode: str | None) -> CheckedBody:
    """A request made from a video: a remix of the completed job `source` (mode None), OpenAI's edit (video-to-video)
    or extension (a causal continuation) of `source` or of the body's uploaded `video`.

    A causal model starts from the video's last (overlap_frames - 1) x 4 + 1 frames and makes as many new frames as
    the source had (a remix) or `seconds` / `num_frames` say; a model that extends a whole video (`video_use` =
    "extend": SkyReels-V2 DF) takes all of it and makes as many new frames again (or `seconds` / `num_frames`);
    a video-to-video model (`video_use` = "redraw") redraws the video (its first
    4k + 1 frames, at most the server's max_frames) at `strength`. Made from a completed video, it keeps that video's
    other fields (size, steps, guidance, adapters...) unless the body sets them; the seed is drawn anew unless
    given."""
    hints = field_types(type(generator.default_sampling))
    use = getattr(type(generator.default_sampling), "video_use", None) if "video" in hints else None
    # what this model does with a video: continues it from its last frames (a causal model's start_video), extends
    # it whole (SkyReels-V2 DF's video), or redraws it (video-to-video)
    does = "causal" if "start_video" in hints else "extend" if use == "extend" else \
        "video-to-video" if use == "redraw" else None
    allowed = {"edit": ("video-to-video",), "extend": ("causal", "extend")}.get(mode or "", (does,))
    if does is None or does not in allowed:
        what = {None: "remix a video", "edit": "edit a video", "extend": "extend a video"}[mode]
        can = ("it continues videos: use a remix or an extension" if does in ("causal", "extend") else
               "it redraws videos: use a remix or an edit" if does else
               "neither continues a video nor redraws one (video-to-video)")
        raise RequestProblem(f"this model ({generator.family}) cannot {what}: {can}", "video" if mode else "id")
    want = does
    body = dict(body)
    if source is not None:
        from composer.errors import InvalidInputError as _Unreadable
        from composer.video import read_frames

        try:
            frames = read_frames(store.video_path(source.id))
        except _Unreadable as exc:
            raise RequestProblem(f"the source video {source.id} cannot be read: {exc}", "id", 500) from None
        # a video made from a completed one keeps its settings, unless the body sets them
        inherited = {k: v for k, v in source.request.items()
                     if v is not None and k not in ("prompt", "seed", "strength") and k in hints}
        if "size" in body:
            inherited.pop("height", None), inherited.pop("width", None)
        if "seconds" in body or want == "causal":  # a continuation's length counts its new frames
            inherited.pop("num_frames", None)
        body = {**inherited, **body}
        if "lora" not in body:  # the source's adapters, at its scales
            body["lora"] = [name for name, _ in source.lora]
            if source.lora and "lora_scale" not in body:
                body["lora_scale"] = [scale for _, scale in source.lora]
    else:
        frames = decode_video(body.pop("video"), "video", config.uploads)
    body = {key: form_value(value, hints.get(key, ALIAS_TYPES.get(key, Any))) if is_form_value(value) else value
            for key, value in body.items()}
    limits = ModelLimits.from_pipeline(generator.pipeline)
    t = limits.temporal_factor or 1
    fps = body.get("fps") if isinstance(body.get("fps"), int) and body.get("fps") > 0 else generator.default_sampling.fps
    if want == "causal":
        overlap = body.get("overlap_frames", generator.default_sampling.overlap_frames)
        keep = (max(int(overlap) if isinstance(overlap, int) and overlap > 0 else 1, 1) - 1) * t + 1
        usable = (len(frames) - 1) // t * t + 1
        start = frames[len(frames) - min(keep, usable):]
        if "num_frames" not in body:
            new = _seconds_value(body.pop("seconds")) * fps if "seconds" in body else len(frames) - len(start)
            n = limits.frames_per_block or 1
            start_latent = (len(start) - 1) // t + 1
            blocks = max(1, round(new / t / n))
            body["num_frames"] = (start_latent + blocks * n - 1) * t + 1
        body.pop("seconds", None)
        return check_body(body, generator, config.limits, config.loras, config.uploads, {"start_video": start})
    if want == "extend":  # the whole video, continued by num_frames new frames (its family checks the rest)
        if "num_frames" not in body and "seconds" in body:
            new = _seconds_value(body.pop("seconds")) * fps  # the nearest valid length (t k + 1)
            body["num_frames"] = max(0, round((new - 1) / t)) * t + 1
        elif "num_frames" not in body:
            body["num_frames"] = len(frames)  # as many new frames as the video has
        body.pop("seconds", None)
        return check_body(body, generator, config.limits, config.loras, config.uploads, {"video": frames})
    if "num_frames" not in body and "seconds" not in body:
        most = min(len(frames), config.limits.max_frames or len(frames))
        body["num_frames"] = (most - 1) // t * t + 1
    checked_frames = body.get("num_frames")
    if "seconds" in body:  # as POST /v1/videos reads it, to trim the video to that length
        params: dict[str, Any] = {}
        _apply_aliases({"seconds": body["seconds"], **({"fps": fps})}, params, generator)
        checked_frames = params["num_frames"]
    video = frames[:checked_frames] if isinstance(checked_frames, int) and checked_frames > 0 else frames
    return check_body(body, generator, config.limits, config.loras, config.uploads, {"video": video})


def _seconds_value(value: Any) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if isinstance(value, bool) or not math.isfinite(seconds) or not 0 < seconds <= 3600:
        raise RequestProblem(f"seconds = {value!r}: expected a number of seconds > 0", "seconds")
    return seconds


def _decode_input(key: str, value: Any, uploads: UploadLimits, sent_as: str | None = None) -> Any:
    """The decoded input `key`; `sent_as`: the field the client sent it in (input_reference), named in errors."""
    if key in IMAGE_LIST_FIELDS:  # one upload, or several (repeated multipart parts, a JSON list)
        values = value if isinstance(value, list) else [value]
        return [decode_image(v, sent_as or f"{key}[{i}]", uploads) for i, v in enumerate(values)]
    name = sent_as or key
    return decode_video(value, name, uploads) if key in VIDEO_FIELDS else decode_image(value, name, uploads)


def _input_reference(value: Any, hints: dict, generator: Any, uploads: UploadLimits) -> tuple[str, Any]:
    """OpenAI's `input_reference` (an uploaded image or video, or {"image_url": data URL}) as the field it is for
    this model: an image is the first frame (`image`, or a causal model's `start_image`), a video the input of
    video-to-video (`video`) or the video a causal model continues (`start_video`)."""
    from composer.serve.uploads import input_bytes

    if isinstance(value, dict):
        if value.get("file_id") is not None:
            raise RequestProblem("input_reference.file_id: this server keeps no uploaded files; send the image itself "
                                 "(a multipart file, or {\"image_url\": a base64 data URL})", "input_reference")
        if set(value) - {"image_url", "file_id"} or value.get("image_url") is None:
            raise RequestProblem("input_reference: expected a file, base64 data, or {\"image_url\": a data URL}",
                                 "input_reference")
        value = value["image_url"]
    data = input_bytes(value, "input_reference", "file", uploads)
    kind = media_kind(data)
    if kind is None:
        raise RequestProblem("input_reference: the upload is neither an image (PNG, JPEG, WebP, GIF) nor a video "
                             "(mp4, webm, mov, mkv, avi) this server reads", "input_reference")
    from composer.serve.uploads import Upload

    upload = Upload(data)
    wanted = ("image", "start_image", "reference_images") if kind == "image" else ("video", "start_video")
    for key in wanted:
        if key in hints:
            return key, _decode_input(key, upload, uploads, sent_as="input_reference")
    roles = {"image": "an image (the first frame)", "last_image": "a last frame", "start_image": "an image to start "
             "from", "start_video": "a video to continue", "video": "a video to redraw (video-to-video)",
             "mask": "a mask video", "reference_images": "reference images", "pose_video": "a pose video",
             "face_video": "a face video", "background_video": "a background video", "mask_video": "a mask video"}
    other = [roles[key] for key in INPUT_FIELDS if key in hints and key != "last_image"]
    takes = (f"it takes {' or '.join(other)}" if other else "it takes no image or video: a text-to-video model")
    raise RequestProblem(f"input_reference: the upload is {'an' if kind == 'image' else 'a'} {kind}, which this "
                         f"model ({generator.family}) cannot start from; {takes}", "input_reference")


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
    if offload == "disk" and selection != [[o.name, o.scale] for o in loras]:
        raise RequestProblem(f"this server streams its weights from disk (offload = {offload}): its LoRA adapters "
                             "were arranged at load and cannot change per request; leave lora and lora_scale out",
                             "lora")
    return selection


def server_limits(generator: Any, limits: ServerLimits) -> ModelLimits:
    """The model's limits under the server's (--max-size, --max-frames, --max-steps): one set, so a refusal names
    the limit that binds and its nearest valid value keeps them all."""
    return ModelLimits.from_pipeline(generator.pipeline).capped(
        "this server's --{flag}", max_size=limits.max_size, max_frames=limits.max_frames, max_steps=limits.max_steps)


def _json_safe(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool, list))
