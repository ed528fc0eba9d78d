"""Base PipelineConfig (how a family's pipeline is wired) and SamplingParam (what one request asks for)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from composer._fields import coerce, field_types, raise_if_errors, unknown_key_errors


@dataclass
class PipelineConfig:
    """Family-level facts a pipeline needs beyond the model folder. Subclass per family with real defaults."""

    # Prompts are tokenized to this many tokens (padded and truncated), as the family was trained.
    text_encoder_max_length: int = 512
    # Clean prompts like the reference pipeline (ftfy when installed, HTML unescape, collapse whitespace).
    clean_prompts: bool = True
    # Step caching (docs/step-caching.md). TeaCache's polynomial per transformer width (hidden size), fitted per
    # model on its signal, highest power first: a width not listed uses the raw relative change.
    teacache_coefficients: dict[int, tuple[float, ...]] = field(default_factory=dict)
    # What `cache_threshold` defaults to, as measured for the family: teacache per width where coefficients are
    # fitted (the rescaled change), otherwise `teacache_threshold` (the raw change); `dbcache_threshold` for dbcache.
    teacache_thresholds: dict[int, float] = field(default_factory=dict)
    teacache_threshold: float = 0.2
    dbcache_threshold: float = 0.1

    def updated_from_folder(self, values: dict[str, Any]) -> PipelineConfig:
        """A copy with the fields a model folder sets (model_index.json's non-component entries); entries
        that are not fields of this config (diffusers' own, like `boundary_ratio`) are left to the pipeline."""
        known = {f.name: f for f in dataclasses.fields(self)}
        errors: list[str] = []
        hints = field_types(type(self))
        changes = {}
        for key, value in values.items():
            if key in known and value is not None:
                if isinstance(value, list):
                    value = tuple(value)
                changes[key] = coerce(value, hints[key], key, errors) if not isinstance(value, tuple) else value
        raise_if_errors(errors, "pipeline settings in model_index.json")
        return dataclasses.replace(self, **changes)


class SamplingSettings:
    """What every request's settings class does (SamplingParam, composer.text's TextSamplingParam): copies with
    overrides or a folder's defaults, every bad key or value reported in one ConfigError."""

    _what = "sampling parameter"  # how errors name one setting
    _uncoerced = ()  # fields taken as given (a text request's prompt may be a list)

    def updated(self, **overrides: Any):
        """A copy with `overrides` applied (None values ignored); one ConfigError lists every bad key/value."""
        errors = unknown_key_errors(type(self), overrides, self._what)
        hints = field_types(type(self))
        values = {}
        for key, value in overrides.items():
            if key in hints and value is not None:
                values[key] = value if key in self._uncoerced else coerce(value, hints[key], key, errors)
        raise_if_errors(errors, f"{self._what}s")
        return dataclasses.replace(self, **values)

    def with_folder_defaults(self, values: dict[str, Any], source: str = "the model folder"):
        """A copy with the defaults a model folder states (`ComposedPipeline.sampling_defaults()`, or its
        composer.json's `sampling`, named by `source` in errors), over the family's. Unlike `updated`, None is
        applied: the folder fixes that setting, so no family value fits."""
        errors = unknown_key_errors(type(self), values, self._what.replace("parameter", "default"))
        hints = field_types(type(self))
        changes = {key: coerce(value, hints[key], key, errors) for key, value in values.items() if key in hints}
        raise_if_errors(errors, f"sampling defaults of {source}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class SamplingParam(SamplingSettings):
    """One generation request. Same field names as `generate_video` kwargs, CLI flags, YAML and HTTP."""

    prompt: str | None = field(
        default=None,
        metadata={"help": "what the video shows (generate_video also takes a list: one video per prompt)"},
    )
    negative_prompt: str | None = field(
        default=None, metadata={"help": "what to steer away from (used with guidance_scale > 1)"}
    )
    height: int = field(default=480, metadata={"help": "frame height in pixels"})
    width: int = field(default=832, metadata={"help": "frame width in pixels"})
    num_frames: int = field(default=81, metadata={"help": "frames in the video (4k+1 for Wan's VAE)"})
    num_inference_steps: int = field(default=50, metadata={"help": "denoising steps"})
    guidance_scale: float = field(default=5.0, metadata={"help": "classifier-free guidance scale (<= 1 disables CFG)"})
    flow_shift: float | None = field(
        default=None,
        metadata={
            "help": "timestep shift of the flow-matching schedule (default: the model folder's scheduler setting, "
            "`shift` / `flow_shift` in scheduler/scheduler_config.json; the family's value where the folder "
            "states none)"
        },
    )
    num_videos_per_prompt: int = field(
        default=1, metadata={"help": "videos per prompt, with seeds seed, seed + 1, ... (one batch)"}
    )
    seed: int | None = field(default=None, metadata={"help": "random seed (same meaning as in diffusers); default: random"})
    fps: int = field(default=16, metadata={"help": "frames per second of the written video"})
    output_path: str | None = field(
        default=None,
        metadata={"help": "where to write the video: .mp4 / .webm / .mov / .mkv / .avi, .gif, or a folder of PNG "
                  "frames (a path without a suffix, or ending in /)"},
    )
    overwrite: bool = field(
        default=False, metadata={"help": "replace an existing output file (or a folder of earlier frames)"}
    )

    # What this family's `video` knob is, for a server making a video from another one (composer/serve: remix, edit,
    # extend): "redraw" (video-to-video at `strength`), "extend" (the video is continued: SkyReels-V2 DF) or None
    # (no such use: VACE's control video). A causal family continues videos through `start_video` instead.
    video_use: ClassVar[str | None] = None

    def check_inputs(self, result: Any, limits: Any) -> None:
        """This family's own input rules, run by the request check with every other rule before any work (in the
        CLI before the model loads): add each problem to `result` (a VerificationResult) under the knob's name.
        `limits`: the model's request_check.ModelLimits. None here: a family whose knobs have rules of their own
        (VACE's mask and reference_images) overrides it, so the request check needs no line per family."""

