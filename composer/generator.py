"""VideoGenerator: the Python entry point. A model folder or hub id in, videos out.

    gen = VideoGenerator.from_pretrained("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", dtype="bf16")
    result = gen.generate_video("a cat surfing a wave", seed=0, output_path="cat.mp4")
    result.frames  # uint8 [T, H, W, 3]
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from composer.batch import ForwardBatch
from composer.configs.base import SamplingParam
from composer.loader.model_index import read_model_index
from composer.loader.resolve import resolve_model_path
from composer.logging import get_logger
from composer.pipelines.base import ComposedPipeline
from composer.registry.configs import resolve_configs
from composer.registry.pipelines import get_pipeline_class
from composer.runtime import RuntimeArgs
from composer.video import save_video

logger = get_logger(__name__)


@dataclass
class GenerationResult:
    """One generated video and how it was made."""

    frames: np.ndarray  # uint8 [T, H, W, 3]
    seed: int
    sampling: SamplingParam
    timings: dict[str, float] = field(default_factory=dict)  # seconds per stage, plus "total"
    output_path: Path | None = None

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])


class VideoGenerator:
    """A loaded pipeline plus its family's sampling defaults."""

    def __init__(self, pipeline: ComposedPipeline, default_sampling: SamplingParam, model_path: str, family: str):
        self.pipeline = pipeline
        self.default_sampling = default_sampling
        self.model_path = model_path
        self.family = family

    @classmethod
    def from_pretrained(cls, model_path: str | os.PathLike | None = None, **runtime_kwargs: Any) -> VideoGenerator:
        """Load a diffusers-format folder or hub id (None: the embedded default model).

        `runtime_kwargs` are RuntimeArgs fields (device, dtype, attention_backend, ...); every bad one is
        reported in a single ConfigError before anything loads.
        """
        runtime = RuntimeArgs.from_kwargs(**runtime_kwargs)
        if model_path is None:
            from composer.default_model import default_model_path

            model_path = default_model_path()
        model_path = str(model_path)
        folder = resolve_model_path(model_path)
        index = read_model_index(folder)
        pipeline_cls = get_pipeline_class(index.class_name)
        configs = resolve_configs(model_path if not Path(model_path).is_dir() else str(folder), index.class_name)
        logger.info(
            "loading %s as family %s (matched by %s) with %s",
            model_path, configs.family.name, configs.matched_by, pipeline_cls.__name__,
        )
        start = time.perf_counter()
        pipeline = pipeline_cls(index, configs.pipeline_config(), runtime)
        logger.info("model ready in %.1f s on %s", time.perf_counter() - start, runtime.torch_device)
        return cls(pipeline, configs.sampling_param(), model_path, configs.family.name)

    def sampling_param(self, **overrides: Any) -> SamplingParam:
        """The family defaults with `overrides` applied (raises ConfigError for unknown keys)."""
        return self.default_sampling.updated(**overrides)

    def generate_video(
        self, prompt: str | None = None, *, sampling_param: SamplingParam | None = None, **overrides: Any
    ) -> GenerationResult:
        """Generate one video. Keyword arguments are SamplingParam fields (negative_prompt, height, width,
        num_frames, num_inference_steps, guidance_scale, flow_shift, seed, fps, output_path)."""
        sp = (sampling_param or self.default_sampling).updated(prompt=prompt, **overrides)
        seed = sp.seed if sp.seed is not None else random.SystemRandom().randrange(2**32)
        batch = ForwardBatch(
            prompt=[sp.prompt] if isinstance(sp.prompt, str) else sp.prompt,  # None fails input validation
            negative_prompt=[sp.negative_prompt] if isinstance(sp.negative_prompt, str) else sp.negative_prompt,
            height=sp.height,
            width=sp.width,
            num_frames=sp.num_frames,
            num_inference_steps=sp.num_inference_steps,
            guidance_scale=sp.guidance_scale,
            flow_shift=sp.flow_shift,
            seed=seed,
        )
        start = time.perf_counter()
        batch = self.pipeline.forward(batch)
        timings = dict(batch.timings)
        timings["total"] = time.perf_counter() - start
        result = GenerationResult(frames=batch.frames[0], seed=seed, sampling=sp.updated(seed=seed), timings=timings)
        if sp.output_path:
            result.output_path = save_video(result.frames, sp.output_path, fps=sp.fps)
        logger.info(
            "generated %dx%dx%d (%d steps, seed %d) in %.2f s%s",
            sp.num_frames, sp.height, sp.width, sp.num_inference_steps, seed, timings["total"],
            f" -> {result.output_path}" if result.output_path else "",
        )
        return result
