"""Prompt lists: the videos one `generate_video` call asks for, their seeds and their output paths.

A request names one prompt or a list of them, and `num_videos_per_prompt` copies of each. The videos are rows
of one batch in diffusers' order (each prompt's copies together: p0, p0, p1, p1 for two copies), and video i
gets seed `seed + i`, so it is the same video as a single call with that seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from composer.errors import ConfigError, InvalidInputError


def _describe(value: Any) -> str:
    """A value as a user would name it: its type and a short repr."""
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def _prompt_strings(value: Any, name: str) -> list[str]:
    """One string -> [it]; a non-empty list/tuple of non-empty strings -> the list; anything else is refused."""
    expected = f"{name} must be a non-empty string or a non-empty list of non-empty strings"
    if isinstance(value, str):
        if not value.strip():
            raise InvalidInputError(f"{expected}; got an empty string")
        return [value]
    if not isinstance(value, (list, tuple)):
        raise InvalidInputError(f"{expected}; got {_describe(value)}")
    if not value:
        raise InvalidInputError(f"{expected}; got an empty list")
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise InvalidInputError(f"{expected}; {name}[{i}] is {_describe(item)}")
        if not item.strip():
            raise InvalidInputError(f"{expected}; {name}[{i}] is an empty string")
    return list(value)


@dataclass(frozen=True)
class VideoRequests:
    """The videos of one call, one entry per batch row: prompt, negative prompt (None: the family's default)."""

    prompts: list[str]
    negative_prompts: list[str] | None
    single: bool  # one string prompt and one copy: the caller gets one GenerationResult, not a list

    @property
    def count(self) -> int:
        return len(self.prompts)


def video_requests(prompt: Any, negative_prompt: Any, num_videos_per_prompt: Any) -> VideoRequests:
    """Check a request's prompts (InvalidInputError naming what was given) and expand them to batch rows.

    `negative_prompt` is None, one string (for every video) or a list with one string per prompt.
    """
    prompts = _prompt_strings(prompt, "prompt")
    copies = num_videos_per_prompt
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise InvalidInputError(f"num_videos_per_prompt must be an integer >= 1; got {_describe(copies)}")
    negatives: list[str] | None = None
    if isinstance(negative_prompt, str):
        negatives = [negative_prompt] * len(prompts)
    elif negative_prompt is not None:
        if not isinstance(negative_prompt, (list, tuple)) or not all(isinstance(s, str) for s in negative_prompt):
            raise InvalidInputError(
                "negative_prompt must be one string (for every prompt) or a list of strings, one per prompt; "
                f"got {_describe(negative_prompt)}"
            )
        if len(negative_prompt) != len(prompts):
            raise InvalidInputError(
                f"negative_prompt has {len(negative_prompt)} strings for {len(prompts)} prompts; give one per "
                "prompt, or one string for all"
            )
        negatives = list(negative_prompt)
    return VideoRequests(
        prompts=[p for p in prompts for _ in range(copies)],
        negative_prompts=None if negatives is None else [n for n in negatives for _ in range(copies)],
        single=isinstance(prompt, str) and copies == 1,
    )


def numbered_path(path: str | Path, index: int) -> str:
    """Video `index`'s path when a call writes several: `clip.mp4` -> `clip-0.mp4`, a PNG folder `frames` ->
    `frames-0`."""
    path = Path(path)
    return str(path.with_name(f"{path.stem}-{index}{path.suffix}"))


def read_prompt_file(path: str | Path) -> list[str]:
    """One prompt per line; blank lines and lines starting with '#' are skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"--prompt-file {path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--prompt-file {path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    prompts = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not prompts:
        raise ConfigError(f"--prompt-file {path}: no prompts in it (one per line; blank and '#' lines are skipped)")
    return prompts
