"""The one check of a whole request: sampling values, output path, fps, segments, start frames.

It runs once, at submit, before any work: in the CLI before the model loads (the model's constraints read from
the folder's JSON configs, `ModelLimits.from_folder`), in the server before a job is queued, in the API before
`generate_video` / `stream_video` do anything (`ModelLimits.from_pipeline`). Every problem is reported at once,
named as the user wrote it (`--height` in the CLI, `height` in Python), with the value given, what is valid and
the nearest valid value. A request that passes is a `CheckedRequest`: what the API, the CLI and the server carry
to the run, which nothing checks again (the pipeline's InputValidationStage asserts what this check established).
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from composer._fields import base_type, coerce, field_types, json_field_problems
from composer.errors import (  # noqa: F401 - RequestError: public here too
    InvalidInputError,
    ModelFormatError,
    RequestError,
    problems_message,
)
from composer.images import describe_image, image_problem, refuse_image_knobs, shown_input
from composer.stages.validators import V, VerificationResult, check_input_length  # noqa: F401 - public here
from composer.video import FRAME_FILE_PATTERN, SUPPORTED_OUTPUTS, output_kind

SEED_MAX = 2**63 - 1
# The most characters of a free-text field (prompt, negative_prompt, a segment's prompt, any other text): far past
# what a text encoder reads (Wan's T5 reads 512 tokens, about 2000 characters; longer is cut, with a warning),
# and short of a body that only costs memory and time (a 20 MB prompt). One limit for the API, CLI and server.
MAX_TEXT_CHARS = 20_000
CLI_FLAG_NAMES = {"num_inference_steps": "--steps", "output_path": "--output", "segments": "--segment"}


@dataclass(frozen=True)
class ModelLimits:
    """What a model allows of a request. None: not known (nothing is checked for it)."""

    spatial_multiple: int | None = None  # height and width: VAE spatial factor x DiT patch size
    temporal_factor: int | None = None  # num_frames = temporal_factor * k + 1
    frames_per_block: int | None = None  # causal models: latent frames per block (None: takes no segments)
    fixed_steps: int | None = None  # a distilled model's own step count
    supports_flow_shift: bool = True
    requires_image: bool = False  # an image-to-video model: `image` (the first frame) is required
    takes_last_image: bool = False  # a first-last-frame model also takes `last_image`
    max_size: int | None = None  # height and width, pixels: the transformer's positions per axis x spatial_multiple
    max_frames: int | None = None  # num_frames (a server's cap; None: the model's own rules only)
    max_steps: int | None = None  # num_inference_steps (a server's cap)
    # why each max_* holds: "the transformer's 1024 RoPE positions per axis", "this server's --max-size"
    reasons: dict[str, str] = dataclasses.field(default_factory=dict, compare=False, hash=False)

    def capped(self, by: str, max_size: int | None = None, max_frames: int | None = None,
               max_steps: int | None = None) -> ModelLimits:
        """These limits under a caller's own caps (a server's --max-size...): the lower of each pair, and why."""
        changes: dict[str, Any] = {}
        reasons = dict(self.reasons)
        for name, cap in (("max_size", max_size), ("max_frames", max_frames), ("max_steps", max_steps)):
            if cap is not None and (getattr(self, name) is None or cap < getattr(self, name)):
                changes[name] = cap
                reasons[name] = by.format(flag=name.replace("_", "-"))
        return dataclasses.replace(self, **changes, reasons=reasons)

    @classmethod
    def from_folder(cls, folder: Path, config: Any) -> ModelLimits:
        """From the folder's JSON configs and its family's PipelineConfig (with the folder's settings), without
        loading weights. Causal configs carry `num_frames_per_block` and `denoising_step_list`."""
        vae = _read_json(folder / "vae" / "config.json", _VAE_KEYS)
        transformer = _read_json(folder / "transformer" / "config.json", _TRANSFORMER_KEYS)
        downsample = vae.get("temperal_downsample") or [False, True, True]  # diffusers' AutoencoderKLWan default
        # AutoencoderKLWan names its factors scale_factor_*, other VAEs (HunyuanVideo's) *_compression_ratio
        spatial = (vae.get("scale_factor_spatial") or vae.get("spatial_compression_ratio")
                   or 2 ** len(downsample))
        temporal = (vae.get("scale_factor_temporal") or vae.get("temporal_compression_ratio")
                    or 2 ** sum(bool(d) for d in downsample))
        patch = transformer.get("patch_size") or [1, 2, 2]  # (t, h, w), or one spatial size (HunyuanVideo)
        spatial_patch = int(patch) if isinstance(patch, int) else max(int(patch[1]), int(patch[2]))
        block = getattr(config, "num_frames_per_block", None)
        steps = getattr(config, "denoising_step_list", None)
        return cls(
            spatial_multiple=int(spatial) * spatial_patch, temporal_factor=int(temporal),
            frames_per_block=block, fixed_steps=len(steps) if steps else None, supports_flow_shift=block is None,
            **_image_inputs(transformer, config), **_position_limits(transformer, int(spatial) * spatial_patch),
        )

    @classmethod
    def from_pipeline(cls, pipeline: Any) -> ModelLimits:
        """From a loaded pipeline: its input validation stage's numbers and its config."""
        stage = next((s for s in pipeline.stages if s.name == "InputValidationStage"), None)
        block = getattr(pipeline.config, "num_frames_per_block", None)
        transformer = getattr(pipeline, "modules", {}).get("transformer")
        transformer_config = getattr(getattr(transformer, "config", None), "__dict__", {})
        images = _image_inputs(transformer_config, getattr(pipeline, "config", None))
        if stage is None:
            return cls(frames_per_block=block, **images)
        return cls(stage.spatial_multiple, stage.temporal_factor, block, stage.fixed_steps, stage.supports_flow_shift,
                   **images, **_position_limits(transformer_config, stage.spatial_multiple))


def _position_limits(transformer_config: dict, spatial_multiple: int | None) -> dict[str, Any]:
    """The largest height and width the transformer has positions for: a Wan DiT's RoPE table holds
    `rope_max_seq_len` rows and columns of tokens (one token per spatial_multiple pixels), as diffusers' does; a
    larger grid is refused (models/wan/transformer.py), so the request check refuses it before anything loads."""
    positions = transformer_config.get("rope_max_seq_len")
    if not isinstance(positions, int) or isinstance(positions, bool) or positions < 1 or not spatial_multiple:
        return {}
    return {"max_size": positions * spatial_multiple,
            "reasons": {"max_size": f"the transformer's rope_max_seq_len = {positions} positions per axis"}}


def _image_inputs(transformer_config: dict, config: Any = None) -> dict[str, bool]:
    """The input images a transformer config implies: image cross-attention (`image_dim`, Wan2.1 I2V) or an image
    condition on the channel axis (more input than output channels: Wan2.1 I2V, Wan2.2 I2V A14B) needs the first
    frame; a position embedding over two images' tokens (`pos_embed_seq_len`, FLF2V) takes the last too. A family
    whose PipelineConfig says `requires_image` or `takes_last_image` is taken at its word (HunyuanVideo-1.5's
    transformer has the condition channels for text-to-video too: zeros; SkyReels-V2 DF's sampler takes a last
    frame with no transformer input for it)."""
    channels_in, channels_out = transformer_config.get("in_channels"), transformer_config.get("out_channels")
    conditioned = channels_in is not None and channels_out is not None and channels_in > channels_out
    stated = getattr(config, "requires_image", None)
    requires = transformer_config.get("image_dim") is not None or conditioned if stated is None else stated
    stated_last = getattr(config, "takes_last_image", None)
    last = bool(transformer_config.get("pos_embed_seq_len")) if stated_last is None else stated_last
    return {"requires_image": requires, "takes_last_image": last}


# The config values read here, before the loaders' own checks: a value of another type is refused naming the file.
_VAE_KEYS = {"temperal_downsample": list[bool] | None, "scale_factor_spatial": int | None,
             "spatial_compression_ratio": int | None, "scale_factor_temporal": int | None,
             "temporal_compression_ratio": int | None}
_TRANSFORMER_KEYS = {"patch_size": int | list[int] | None, "in_channels": int | None, "out_channels": int | None,
                     "image_dim": int | None, "pos_embed_seq_len": int | None, "rope_max_seq_len": int | None}


def _read_json(path: Path, types: dict[str, Any]) -> dict:
    """A config the check reads: a broken one (not UTF-8, not JSON) is the loader's one-line error and a value of
    another type is refused naming the file, both before anything loads; a missing one states nothing here (the
    loader names what the folder lacks)."""
    from composer.loader.components import read_config_file

    if not path.is_file():
        return {}
    raw = read_config_file(path)
    problems = json_field_problems(raw, types)
    if problems:
        raise ModelFormatError(f"{path} (component '{path.parent.name}'): {'; '.join(problems)}")
    return raw


class _Seal:
    """What only check_request passes to CheckedRequest; pickled by name, so a request checked on rank 0 stays
    checked in a worker process."""

    def __reduce__(self) -> str:
        return "_SEAL"


_SEAL = _Seal()


@dataclass(frozen=True, eq=False)
class CheckedRequest:
    """A video request that passed the one request check (`check_request`): the request state the Python API, the
    CLI and the server carry from submit to the run, never checked again. Made only by `check_request`; the
    generator runs one as it is (`VideoGenerator.generate_video(checked)`), and the stages' input checks are then
    assertions of what this check established (composer/stages/input_validation.py)."""

    sampling: Any  # the SamplingParam as checked and as run (a prompt list's rows are `videos`, not its prompt)
    limits: ModelLimits  # what it was checked against (the model's, under a server's caps)
    segments: Any = None  # (prompt, num_blocks) pairs (a list, checked), a lazy source (checked as read), or None
    videos: Any = None  # the rows of a prompt list or of num_videos_per_prompt (prompt_lists.VideoRequests), or None
    stream: bool = False  # checked as a stream (stream_video)
    _seal: object = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self._seal is not _SEAL:
            raise TypeError("a CheckedRequest is made by composer.request_check.check_request, not by hand")

    def holds_for(self, limits: ModelLimits) -> bool:
        """Whether this check covers a run under `limits` (the running model's): the same model rules and no cap
        looser than the one checked against (a server's caps are the model's or tighter)."""
        for f in dataclasses.fields(ModelLimits):
            mine, theirs = getattr(self.limits, f.name), getattr(limits, f.name)
            if f.name == "reasons":
                continue
            if f.name.startswith("max_"):
                if theirs is not None and (mine is None or mine > theirs):
                    return False
            elif mine != theirs:
                return False
        return True

    def updated(self, **changes: Any) -> CheckedRequest:
        """This request with `changes` (SamplingParam fields), for a run after loading (problems named as Python's
        fields). Fields set after the check (`seed`: a drawn one; `output_path`, `overwrite`: a default path) are
        checked alone, with the whole check's messages (RequestError); a change of any other field makes another
        request, checked whole against the same limits."""
        sampling = self.sampling.updated(**changes)
        if set(changes) - _SET_AFTER:
            return check_request(sampling, self.limits, self.segments, stream=self.stream, videos=self.videos)
        result = VerificationResult()
        if "seed" in changes and sampling.seed is not None:
            _check_seed(result, sampling.seed, _rows(sampling, self.videos))
        if ("output_path" in changes or "overwrite" in changes) and sampling.output_path:
            _check_output(result, sampling.output_path, bool(getattr(sampling, "overwrite", False)), False)
        if result.failures:
            raise RequestError([_as_written(f, v, r, False) for f, v, r in result.failures])
        return dataclasses.replace(self, sampling=sampling)


_SET_AFTER = {"seed", "output_path", "overwrite"}


def checked_for(request: CheckedRequest, limits: ModelLimits, *, sampling_param: Any = None, segments: Any = None,
                overrides: dict[str, Any] | None = None) -> CheckedRequest:
    """A CheckedRequest handed to a generator whose model has `limits`: as it is when its check covers them (it
    is not checked again), else checked once more against them (it was checked for another model). It carries
    the whole request: other request arguments beside it are refused."""
    given = [name for name, value in (("sampling_param", sampling_param), ("segments", segments)) if value is not None]
    given += sorted(overrides or {})
    if given:
        raise TypeError(f"{', '.join(given)} given with a CheckedRequest, which carries the whole request: set them "
                        "before checking it (check_request), or pass the request's fields instead of it")
    if request.holds_for(limits):
        return request
    return check_request(request.sampling, limits, request.segments, stream=request.stream, videos=request.videos)


def _rows(sp: Any, videos: Any = None) -> int:
    """The videos a request makes (video i has seed + i): a prompt list's rows, or its copies of one prompt."""
    if videos is not None:
        return max(1, len(videos.prompts))
    if isinstance(sp.prompt, list):
        return max(1, len(sp.prompt))
    copies = getattr(sp, "num_videos_per_prompt", 1)
    return copies if V.positive_int(copies) else 1


def _check_seed(result: VerificationResult, seed: Any, rows: int) -> None:
    """Every row's seed (seed + i) is a valid generator seed."""
    hint = f"video i of {rows} has seed + i" if rows > 1 else ""
    result.add_check("seed", seed, V.int_in_range(0, SEED_MAX - rows + 1), hint=hint)


def check_request(
    sp: Any,
    limits: ModelLimits,
    segments: Iterable | None = None,
    *,
    cli: bool = False,
    stream: bool = False,
    flags: dict[str, str] | None = None,
    videos: Any = None,
) -> CheckedRequest:
    """The one check of a video request, at submit: raise one RequestError listing every problem of the request
    `sp` (a SamplingParam) for this model, else return it as a CheckedRequest, which nothing checks again.

    `segments`: (prompt, num_blocks) pairs (a list is checked here; a lazy source is checked as it is read).
    `flags`: in the CLI, the spelling the user typed per field (problems name the flag as typed).
    `videos`: the rows of a prompt list (composer.prompt_lists.VideoRequests: each is checked as a prompt); for
    one prompt (no segments, not a stream) they are made here, as generate_video makes them.
    """
    checked = sp if videos is None else dataclasses.replace(sp, prompt=videos.prompts)
    _check_fields(checked, limits, segments, cli=cli, stream=stream, flags=flags, rows=_rows(sp, videos))
    if videos is None and segments is None and isinstance(sp.prompt, str) and not stream:
        from composer.prompt_lists import video_requests

        videos = video_requests(sp.prompt, sp.negative_prompt, sp.num_videos_per_prompt)  # as generate_video makes
    return CheckedRequest(sp, limits, segments, videos, stream, _SEAL)


def _check_fields(sp: Any, limits: ModelLimits, segments: Iterable | None, *, cli: bool, stream: bool,
                  flags: dict[str, str] | None, rows: int) -> None:
    """check_request's checks (every problem, then one RequestError): what runs once per request."""
    result = VerificationResult()
    start_latent_frames = _check_start_frames(result, sp, limits.temporal_factor or 4)
    _check_input_images(result, sp, limits)
    if hasattr(sp, "check_inputs"):  # the family's own input rules (its SamplingParam's: SamplingParam.check_inputs)
        sp.check_inputs(result, limits)
    explicit = list(segments) if isinstance(segments, (list, tuple)) else None
    if segments is not None and limits.frames_per_block is None:
        result.add_failure("segments", segments, "none: this model makes the whole video at once (a causal model "
                           "takes prompt segments)")
    elif explicit is not None:
        _check_segments(result, explicit, cli)
    if stream and limits.frames_per_block is None:
        result.add_failure("stream", True, "off: this model makes the whole video at once and cannot stream; "
                           "causal (block-autoregressive) models can")
    if segments is None or (explicit is None and sp.prompt is not None):  # a lazy source: its first prompt, read
        _check_prompt(result, sp.prompt, stream)
    for name, value, rule in text_length_problems(sp, explicit):
        result.failures.append((name, value, rule))
    if sp.negative_prompt is not None and not isinstance(sp.negative_prompt, (str, list)):
        result.add_failure("negative_prompt", sp.negative_prompt, "a string")
    _check_size(result, "height", sp.height, limits)
    _check_size(result, "width", sp.width, limits)
    # with segments, or an input video whose length is the video's (a family's `length_from_input`: its own
    # check_inputs bounds that video), the video's length follows them and num_frames is not used
    if segments is None and not getattr(sp, "length_from_input", None):
        _check_num_frames(result, sp.num_frames, limits, start_latent_frames)
    if limits.fixed_steps is None:
        result.add_check("num_inference_steps", sp.num_inference_steps, V.positive_int)
        _check_at_most(result, "num_inference_steps", sp.num_inference_steps, limits, "max_steps", "a positive integer")
    elif sp.num_inference_steps != limits.fixed_steps:
        result.add_failure("num_inference_steps", sp.num_inference_steps, f"{limits.fixed_steps} (this model is "
                           f"distilled for its own {limits.fixed_steps}-step schedule)")
    _check_numbers(result, sp)
    _check_choices(result, sp, cli)
    if sp.flow_shift is not None:
        if limits.supports_flow_shift:
            result.add_check("flow_shift", sp.flow_shift, V.positive_number)
        else:
            result.add_failure("flow_shift", sp.flow_shift, "unset (the model folder fixes the schedule's shift)")
    if sp.seed is not None:
        _check_seed(result, sp.seed, rows)
    for name, rule in (("rollout_blocks", V.positive_int), ("overlap_frames", V.int_in_range(0, 10**6))):
        if getattr(sp, name, None) is not None:
            result.add_check(name, getattr(sp, name), rule)
    result.add_check("fps", sp.fps, V.positive_int)
    if sp.output_path:
        _check_output(result, sp.output_path, bool(getattr(sp, "overwrite", False)), cli)
    if result.failures:
        raise RequestError([_as_written(f, v, r, cli, flags) for f, v, r in result.failures], cli)


def check_cli_request(
    model_path: str | None,
    model_family: str | None,
    overrides: dict[str, Any],
    segments: list | None = None,
    *,
    stream: bool = False,
    interactive_blocks: int | None = None,
    flags: dict[str, str] | None = None,
    resolved: Any = None,
    prompts: list[str] | None = None,
) -> CheckedRequest:
    """`composer generate`'s check before loading: the flags' types, then the whole request against the
    constraints the model folder's JSON configs state (no weights are read); the request as checked.
    `interactive_blocks`: with --interactive, the first prompt runs for that many blocks (num_frames does not
    apply). `flags`: the spelling
    the user typed for a field (gen_length: --max-new-tokens), as problems name it. `resolved`: the model as
    `composer.generator.resolve_model` found it (the CLI resolves it once); None: resolved here. `prompts`: the
    prompts of a prompt list (--prompt-file, or copies of one prompt): every row is checked, as the batch."""
    if resolved is None:
        from composer.registry.resolve import resolve_model

        resolved = resolve_model(model_path, model_family)
    index = resolved.index
    config = resolved.configs.pipeline_config().updated_from_folder(index.extra)
    limits = ModelLimits.from_folder(index.folder, config)
    defaults = resolved.stated  # the family's defaults with the folder's composer.json over them
    if limits.fixed_steps is not None:  # as the pipeline's sampling_defaults() will say
        defaults = defaults.with_folder_defaults({"num_inference_steps": limits.fixed_steps})
    hints = field_types(type(defaults))
    family = resolved.configs.family.name
    refuse_image_knobs(overrides, hints, family, cli=True)
    flags = flags or {}
    failures: list[tuple[str, str, str]] = []
    typed = {}
    for key, value in overrides.items():
        if key not in hints and (problem := foreign_knob_problem(key, type(defaults), family, _flag(key, flags))):
            shown = " ".join(map(str, value)) if isinstance(value, list) else str(value)
            failures.append((_flag(key, flags), shown, f"unset ({problem})"))
            continue
        errors: list[str] = []
        typed[key] = coerce(value, hints[key], key, errors) if key in hints else value
        if errors:
            kind = {int: "an integer", float: "a number", bool: "true or false"}.get(base_type(hints[key]), "text")
            failures.append(_as_written(key, repr(value), kind, cli=True, flags=flags))
            del typed[key]
    sp = defaults.updated(**typed)  # unknown keys (another family's field): ConfigError
    if interactive_blocks is not None and segments is None and isinstance(sp.prompt, str) and sp.prompt.strip():
        segments = [(sp.prompt, interactive_blocks)]
    checked = None
    try:
        videos = None
        if prompts is not None:  # (a prompt list's own problems are the prompt file's, found as it was read)
            from composer.prompt_lists import video_requests

            videos = video_requests(prompts, sp.negative_prompt, sp.num_videos_per_prompt) \
                if V.positive_int(sp.num_videos_per_prompt) else None
        checked = check_request(sp, limits, segments, cli=True, stream=stream, flags=flags, videos=videos)
    except RequestError as exc:
        failures += exc.failures
    if failures:
        raise RequestError(failures, cli=True)
    return checked


# What a model lacking a knob another family takes cannot do, in the user's words ("cannot do video-to-video").
KNOB_TASKS = {"video": "do video-to-video", "strength": "do video-to-video", "start_video": "continue a video",
              "start_image": "start a stream from an image", "image": "do image-to-video",
              "last_image": "take a last frame (first-last-frame)", "pose_video": "do character animation",
              "face_video": "do character animation", "background_video": "do character replacement",
              "mask_video": "do character replacement", "mask": "do masked editing (VACE)",
              "reference_images": "take reference images (VACE)"}


def model_tasks(sampling_cls: type, family: str) -> str:
    """What a model does, from the knobs its request class takes: "text-to-video and video-to-video"."""
    from composer.configs.base import SamplingParam

    if not issubclass(sampling_cls, SamplingParam):
        return "text generation"
    names = {f.name for f in dataclasses.fields(sampling_cls)}
    use = getattr(sampling_cls, "video_use", None)
    tasks = ["image-to-video" if "pose_video" not in names else "character animation from an image"] \
        if "image" in names else ["text-to-video"]
    tasks += [task for knob, task in (("last_image", "first-last-frame"), ("start_video", "video continuation"),
                                      ("mask", "masked editing (VACE)")) if knob in names]
    if "video" in names and use in ("redraw", "extend"):
        tasks.append("video-to-video" if use == "redraw" else "video extension")
    return " and ".join(tasks)


def foreign_knob_problem(key: str, sampling_cls: type, family: str, shown: str | None = None) -> str | None:
    """Why a knob this model's request class lacks cannot apply, when another registered family takes it: "shapes-t2v
    cannot do video-to-video: it does text-to-video; models that take video: wan2.1-t2v, ..." (None: no family takes
    it: a typo, reported with its nearest knob elsewhere). `shown`: the knob as the user wrote it (--max-new-tokens)."""
    from composer.registry.configs import registered_families

    takers = [f.name for f in registered_families()
              if key in {x.name for x in dataclasses.fields(f.sampling_param_cls)}]
    if not takers or key in {x.name for x in dataclasses.fields(sampling_cls)}:
        return None
    from composer.configs.base import SamplingParam

    text_only = all(not issubclass(f.sampling_param_cls, SamplingParam) for f in registered_families()
                    if f.name in takers)
    task = "generate text" if text_only else KNOB_TASKS.get(key)
    does = model_tasks(sampling_cls, family)
    shown = shown or key
    listed = ", ".join(takers[:4]) + (", ..." if len(takers) > 4 else "")
    head = f"{family} cannot {task}: it does {does}" if task else f"{family} takes no {shown}: it does {does}"
    return f"{head}; models that take {shown}: {listed}"


# The ranges of the float sampling fields; every other float field (a family's own) must be a finite number.
NUMBER_RULES = {"guidance_scale": V.non_negative_number, "guidance_scale_2": V.non_negative_number,
                "true_cfg_scale": V.non_negative_number}


def _check_numbers(result: VerificationResult, sp: Any) -> None:
    """The one rule for every float sampling field (flow_shift aside: checked against the model): a finite number
    (NaN passes every `<` test), in its range."""
    for name, hint in field_types(type(sp)).items():
        value = getattr(sp, name, None)
        if name != "flow_shift" and base_type(hint) is float and value is not None:
            result.add_check(name, value, NUMBER_RULES.get(name, V.finite_number))


def _check_choices(result: VerificationResult, sp: Any, cli: bool) -> None:
    """Every sampling field whose metadata lists the values it takes (prompt_switch) holds one of them; and a
    'keep' prompt switch needs the KV cache (the uncached path has no cached keys/values of the old prompt)."""
    for f in dataclasses.fields(sp):
        choices, value = f.metadata.get("choices"), getattr(sp, f.name, None)
        if choices is None or value is None:
            continue
        allowed = tuple(choices() if callable(choices) else choices)
        if value not in allowed:
            result.add_failure(f.name, value, f"one of {', '.join(allowed)}")
    if getattr(sp, "prompt_switch", None) == "keep" and getattr(sp, "kv_cache", True) is False:
        off = "--no-kv-cache" if cli else "kv_cache=False"
        result.add_failure("prompt_switch", "keep", f"restart or recache with {off} ('keep' carries the old "
                           "prompt's cached keys/values, and the uncached path has none)")


def _flag(field: str, flags: dict[str, str] | None = None) -> str:
    """The flag of a field: as the user typed it (`flags`), else composer's usual spelling."""
    name = field.split("[")[0]
    return (flags or {}).get(name) or CLI_FLAG_NAMES.get(name) or "--" + name.replace("_", "-")


def _as_written(field: str, value: str, rule: str, cli: bool,
                flags: dict[str, str] | None = None) -> tuple[str, str, str]:
    """A failure in the user's words: `--height 30` in the CLI (the value as typed, the flag as typed: `flags`),
    `height = 30` in Python."""
    if field == "stream":
        value = ""  # a switch: its name says it all
    if not cli:
        return field, value, rule
    flag = _flag(field, flags)
    if value.startswith("'") and value.endswith("'") and len(value) > 1:
        value = value[1:-1]
    return flag, value, rule.replace("overwrite=True", "--overwrite")


def text_length_problems(request: Any, segments: list | None = None,
                         sampling_cls: type | None = None) -> list[tuple[str, str, str]]:
    """(field, value shown, rule) for every free-text value longer than MAX_TEXT_CHARS: the request's text fields
    (a SamplingParam's, or those of a server's JSON body by `sampling_cls`), a list of prompts and segments'
    prompts alike."""
    if isinstance(request, dict):
        values, types = request, field_types(sampling_cls) if sampling_cls is not None else {}
    else:
        values, types = {f.name: getattr(request, f.name) for f in dataclasses.fields(request)}, \
            field_types(type(request))
    texts = []
    for name, value in values.items():
        if name not in types or base_type(types[name]) is not str:
            continue  # not a text field (uploads, numbers, a family's lists)
        if isinstance(value, str):
            texts.append((name, value))
        elif isinstance(value, list):
            texts += [(f"{name}[{i}]" if len(value) > 1 else name, v) for i, v in enumerate(value)
                      if isinstance(v, str)]
    texts += [(f"segments[{i}]", item[0]) for i, item in enumerate(segments or [])
              if isinstance(item, (tuple, list)) and item and isinstance(item[0], str)]
    return [(name, _shown_text(text), TEXT_RULE) for name, text in texts if len(text) > MAX_TEXT_CHARS]


TEXT_RULE = f"at most {MAX_TEXT_CHARS} characters (a text encoder reads far fewer: shorten it)"


def _shown_text(text: str) -> str:
    return f"{text[:40]!r}... ({len(text)} characters)"


def text_length_problem(name: str, text: Any) -> str | None:
    """One text field outside a request (a session's next prompt, a live stream's switch) against the same limit:
    the message, or None."""
    if isinstance(text, str) and len(text) > MAX_TEXT_CHARS:
        return f"{name} = {_shown_text(text)}: expected {TEXT_RULE}"
    return None


def _check_prompt(result: VerificationResult, prompt: Any, stream: bool) -> None:
    prompts = prompt if isinstance(prompt, list) else [prompt]
    if not prompts or not all(isinstance(p, str) and p.strip() for p in prompts):
        rule = ("a prompt: streaming needs a first prompt (give --prompt or --segment; then --interactive reads more)"
                if stream else "a non-empty prompt")
        result.add_failure("prompt", prompt, rule)


def _check_segments(result: VerificationResult, segments: list, cli: bool) -> None:
    if not segments:
        result.add_failure("segments", segments, "at least one (prompt, num_blocks) segment")
    for i, item in enumerate(segments):
        name = "segments" if cli else f"segments[{i}]"
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            result.add_failure(name, item, "a (prompt, num_blocks) pair")
            continue
        prompt, blocks = item
        shown = f"{prompt}::{blocks}" if cli else item
        if not isinstance(prompt, str) or not prompt.strip():
            result.add_failure(name, shown, "a non-empty prompt")
        if not V.positive_int(blocks):
            result.add_failure(name, shown, "a number of blocks >= 1 (each segment makes at least one block)")


def _check_size(result: VerificationResult, name: str, value: Any, limits: ModelLimits) -> None:
    """A positive multiple of the model's spatial grid, at most max_size (the model's or the caller's, named when
    passed); the nearest valid value offered is itself valid: on the grid and within the limit."""
    multiple = limits.spatial_multiple or 1
    top = limits.max_size // multiple * multiple if limits.max_size is not None else None
    rule = V.divisible_by(multiple) if limits.spatial_multiple else V.positive_int
    if rule(value) and (top is None or value <= top):
        return
    notes = []
    if top is not None and V.positive_int(value) and value > top:
        notes.append(f"at most {top}: {limits.reasons.get('max_size', 'the limit')}")
    if V.positive_int(value) and (limits.spatial_multiple or notes) and (top is None or top >= multiple):
        near = max(multiple, round(value / multiple) * multiple)
        notes.append(f"nearest valid: {min(near, top) if top is not None else near}")
    result.add_failure(name, value, rule.rule + (f" ({'; '.join(notes)})" if notes else ""))


def _check_at_most(result: VerificationResult, name: str, value: Any, limits: ModelLimits, cap: str,
                   kind: str) -> None:
    """`value` <= the limits' `cap` (max_frames, max_steps), named with its reason."""
    most = getattr(limits, cap)
    if most is not None and V.positive_int(value) and value > most:
        result.add_failure(name, value, f"{kind} (at most {most}: {limits.reasons.get(cap, 'the limit')})")


def _check_num_frames(result: VerificationResult, frames: Any, limits: ModelLimits, start: int) -> None:
    """The model's rule for the length, and at most max_frames; the nearest valid length offered keeps both."""
    t, n, most = limits.temporal_factor, limits.frames_per_block, limits.max_frames
    over = f"at most {most}: {limits.reasons.get('max_frames', 'the limit')}; " \
        if most is not None and V.positive_int(frames) and frames > most else ""
    if t is None:
        result.add_check("num_frames", frames, V.positive_int)
        _check_at_most(result, "num_frames", frames, limits, "max_frames", "a positive integer")
        return
    if n is None:  # a whole-video model: any 4k+1 length
        if V.congruent(t, 1)(frames) and not over:
            return
        near = max(1, round((frames - 1) / t) * t + 1) if V.positive_int(frames) else None
        if near is not None and most is not None and most >= 1:
            near = min(near, (most - 1) // t * t + 1)
        hint = f" ({over}nearest valid: {near})" if near is not None else ""
        result.add_failure("num_frames", frames, V.congruent(t, 1).rule + hint)
        return
    # a causal model: the latent frames after the start frames fill whole blocks
    generated = (frames - 1) // t + 1 - start if V.congruent(t, 1)(frames) else 0
    if generated > 0 and generated % n == 0 and not over:
        return
    count = frames // (n * t) + 3 if V.positive_int(frames) else 3
    valid = [(start + k * n - 1) * t + 1 for k in range(1, count + 1)]
    allowed = [v for v in valid if most is None or v <= most] or valid[:1]
    near = min(allowed, key=lambda v: abs(v - frames)) if V.positive_int(frames) else valid[0]
    after = f" after {start} start latent frame(s)" if start else ""
    result.add_failure("num_frames", frames, f"a length whose latent frames fill whole {n}-frame blocks{after}: "
                       f"{valid[0]}, {valid[1]}, {valid[2]}, ... ({over}nearest valid: {near})")


def _check_start_frames(result: VerificationResult, sp: Any, temporal: int) -> int:
    """Check start_image / start_video can be read (a file, or frames given in Python or uploaded); returns the
    latent frames they give."""
    image, video = getattr(sp, "start_image", None), getattr(sp, "start_video", None)
    given = [v is not None and not (isinstance(v, str) and not v) for v in (image, video)]
    if all(given):
        result.add_failure("start_video", _shown(video), "unset when start_image is given (give one of them)")
        return 0
    if not any(given):
        return 0
    name, value = ("start_image", image) if given[0] else ("start_video", video)
    if isinstance(value, (str, os.PathLike)):
        path = value
        if not Path(path).is_file():
            result.add_failure(name, path, "an existing file" + (" (it is a folder)" if Path(path).is_dir() else ""))
            return 0
        if given[0]:  # read as every input image is read (composer.images)
            if problem := image_problem(path):
                result.add_failure(name, path, problem)
                return 0
            return 1
    elif given[0]:
        if problem := image_problem(value):
            result.add_failure(name, describe_image(value), problem)
            return 0
        return 1
    from composer.stages.start_frames import read_start_frames

    try:
        frames = read_start_frames(None, value, temporal)
    except InvalidInputError as exc:
        reason = str(exc).split(": ", 1)[-1].splitlines()[0]
        what = "a readable video file" if isinstance(value, (str, os.PathLike)) else "readable video frames"
        result.add_failure(name, _shown(value), f"{what} ({reason})")
        return 0
    return (len(frames) - 1) // temporal + 1


def _shown(value: Any) -> Any:
    """A start input as a failure shows it: a path as given, frames by their shape."""
    if isinstance(value, (str, os.PathLike)):
        return value
    shape = getattr(value, "shape", None)
    return f"frames {list(shape)}" if shape is not None else f"{len(value)} frames" if isinstance(value, list) \
        else type(value).__name__


def _check_input_images(result: VerificationResult, sp: Any, limits: ModelLimits) -> None:
    """An image-to-video model has its first frame (and only a first-last-frame model a last one); each given
    image loads (an existing, readable file, or an image-like value)."""
    image, last = getattr(sp, "image", None), getattr(sp, "last_image", None)
    if image is None and limits.requires_image:
        # no value to show: "image: expected ..." (RequestError leaves an empty value out)
        result.failures.append(("image", "", "an input image, the video's first frame (this is an image-to-video "
                                "model)"))
    elif image is not None and (problem := image_problem(image)):
        result.add_failure("image", _shown(image), problem)
    if last is not None and not limits.takes_last_image:
        result.add_failure("last_image", _shown(last), "unset: this model conditions on the first frame only (a "
                           "first-last-frame model, Wan2.1 FLF2V, takes last_image)")
    elif last is not None and (problem := image_problem(last)):
        result.add_failure("last_image", _shown(last), problem)
    elif last is not None and V.positive_int(getattr(sp, "num_frames", None)) and sp.num_frames < 2:
        result.add_failure("num_frames", sp.num_frames, "at least 2 with last_image (its first and last frames are "
                           "two frames)")


def _shown(value: Any) -> Any:
    """An image value as a message shows it: a path as given, arrays and images by type and size (no pixels)."""
    return shown_input(value)


def _check_output(result: VerificationResult, path_text: str, overwrite: bool, cli: bool) -> None:
    """The writer supports the path, its folder exists or can be made, it is writable, nothing is replaced
    unless `overwrite` (and never a folder holding anything but earlier frames)."""
    again = "--overwrite" if cli else "overwrite=True"
    try:
        kind = output_kind(path_text)
    except InvalidInputError:
        stem = Path(path_text).with_suffix("")
        result.add_failure("output_path", path_text, f"{SUPPORTED_OUTPUTS}; the suffix '{Path(path_text).suffix}' is "
                           f"none of them (nearest valid: {stem}.mp4, or {stem} for PNG frames)")
        return
    path = Path(path_text).expanduser()
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        result.add_failure("output_path", path_text, f"a path in a folder ({ancestor} is a file)")
        return
    try:
        fd, probe = tempfile.mkstemp(dir=ancestor, prefix=".composer-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        result.add_failure("output_path", path_text, f"a writable location ({ancestor}: {exc.strerror or exc})")
        return
    if path.is_dir():
        entries = list(path.iterdir())
        if kind != "frames":
            result.add_failure("output_path", path_text, f"a file path ({path} is a folder)")
        elif entries and not all(e.is_file() and e.match(FRAME_FILE_PATTERN) for e in entries):
            result.add_failure("output_path", path_text, f"a new or empty folder ({path} holds other files, e.g. "
                               f"{sorted(e.name for e in entries)[0]}; it is never replaced)")
        elif entries and not overwrite:
            result.add_failure("output_path", path_text, f"a new path ({path} holds frames; pass {again} to "
                               "replace them)")
    elif path.exists() and not overwrite:
        result.add_failure("output_path", path_text, f"a new path ({path} exists; pass {again} to replace it)")


def _checked_priority(priority: Any) -> int:
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidInputError(f"priority = {priority!r}: expected an integer (higher runs first; default 0)")
    return priority


def _checked_target_fps(target_fps: Any) -> float | None:
    """A stream's target frame rate: a finite number > 0, or None (no target)."""
    if target_fps is None:
        return None
    if isinstance(target_fps, bool) or not isinstance(target_fps, (int, float)) or not math.isfinite(target_fps) \
            or target_fps <= 0:
        raise InvalidInputError(f"target_fps = {target_fps!r}: expected a finite number of frames per second > 0 "
                                "(or None: no target)")
    return float(target_fps)
