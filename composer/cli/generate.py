"""`composer generate`: one video from a prompt. Precedence: family defaults < --config preset < flags."""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

from composer.cli.flags import add_dataclass_flags, collect
from composer.configs.base import SamplingParam
from composer.runtime import RuntimeArgs


def add_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        allow_abbrev=False,
        help="generate a video",
        description="Generate a video. Without --model-path, uses the embedded default model.",
    )
    p.add_argument("--model-path", default=None, help="diffusers model folder or hub id (default: embedded model)")
    p.add_argument("--config", default=None, help="YAML preset with model_path / runtime / sampling sections")
    sampling = p.add_argument_group("sampling (SamplingParam fields)")
    runtime = p.add_argument_group("runtime (RuntimeArgs fields)")
    p.set_defaults(
        run=run,
        _sampling_names=add_dataclass_flags(sampling, SamplingParam),
        _runtime_names=add_dataclass_flags(runtime, RuntimeArgs),
    )


def default_output_path(prompt: str, seed: int) -> Path:
    slug = re.sub(r"[^a-z0-9]+", "-", prompt.lower()).strip("-")[:48] or "video"
    return Path("outputs") / f"{slug}-{seed}.mp4"


def run(args: argparse.Namespace) -> int:
    from composer.generator import VideoGenerator
    from composer.presets import Preset, load_preset

    preset = load_preset(args.config) if args.config else Preset()
    runtime = {**preset.runtime, **collect(args, args._runtime_names)}
    sampling_overrides = {**preset.sampling, **collect(args, args._sampling_names)}
    RuntimeArgs.from_kwargs(**runtime)  # report bad runtime flags before loading anything
    SamplingParam().updated(**sampling_overrides)  # and bad sampling flags

    generator = VideoGenerator.from_pretrained(args.model_path or preset.model_path, **runtime)
    sp = generator.sampling_param(**sampling_overrides)
    if sp.seed is None:
        import random

        sp = sp.updated(seed=random.SystemRandom().randrange(2**32))
    if sp.output_path is None and sp.prompt:
        sp = sp.updated(output_path=str(default_output_path(sp.prompt, sp.seed)))
    start = time.perf_counter()
    result = generator.generate_video(sampling_param=sp)
    elapsed = time.perf_counter() - start
    t, h, w, _ = result.frames.shape
    print(
        f"wrote {result.output_path} ({t} frames, {w}x{h}, {sp.fps} fps, seed {result.seed}) "
        f"in {elapsed:.1f} s with {generator.family}"
    )
    return 0
