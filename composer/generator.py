"""VideoGenerator: the Python entry point. A model folder or hub id in, videos out.

    gen = VideoGenerator.from_pretrained("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", dtype="bf16")
    result = gen.generate_video("a cat surfing a wave", seed=0, output_path="cat.mp4")
    result.frames  # uint8 [T, H, W, 3]
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from composer.batch import ForwardBatch, RequestStats, VideoChunk
from composer.cancel import CancelToken
from composer.configs.base import SamplingParam
from composer.engine.core import EngineCore, unit_queues
from composer.engine.loop import Blocking, admitted, drive, wait_for
from composer.engine.scheduler import RequestContext, request_key
from composer.errors import ConfigError, InvalidInputError, UnsupportedError
from composer.images import refuse_image_knobs
from composer.loader.folder_settings import FolderSettings
from composer.logging import get_logger, log_once
from composer.parallel import state as parallel_state
from composer.pipelines.base import ComposedPipeline
from composer.prompt_lists import VideoRequests, numbered_path, video_requests
from composer.registry.resolve import (  # noqa: F401 - resolve_model and ResolvedModel: public here too
    ResolvedModel,
    _folder_sampling,
    check_model_configs,
    resolve_model,
)
from composer.request_check import (
    CheckedRequest,
    ModelLimits,
    _checked_priority,
    _checked_target_fps,
    check_request,
    checked_for,
    foreign_knob_problem,
)
from composer.runtime import RuntimeArgs, apply_threads
from composer.stages.text_encoding import PromptWarnings
from composer.video import save_video

if TYPE_CHECKING:
    from composer.session import Session

logger = get_logger(__name__)


@dataclass
class GenerationResult:
    """One generated video and how it was made."""

    frames: np.ndarray  # uint8 [T, H, W, 3]
    seed: int
    sampling: SamplingParam
    timings: dict[str, float] = field(default_factory=dict)  # seconds per stage, plus "total"
    output_path: Path | None = None
    stats: RequestStats | None = None  # causal models: CausalStats (block latency, time to first frame, fps, KV)
    latents: torch.Tensor | None = None  # the final latents [B, C, F, h, w] on the CPU (before decoding)
    # the LoRA adapters it was made with: each denoiser's description (files, layers touched, kinds left out)
    lora: dict[str, str] | None = None
    warnings: list[str] = field(default_factory=list)  # what the run said of this request (a truncated prompt)

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])


def _with_folder_quantization(runtime: RuntimeArgs, settings: FolderSettings) -> RuntimeArgs:
    """A folder written by `composer convert quantize` turns the quantize hook on with its mode."""
    if not settings.quantization:
        return runtime
    mode = settings.quantization["mode"]
    if runtime.quantize not in ("none", mode):
        raise ConfigError(f"quantize = {runtime.quantize} but {settings.path} says the folder holds {mode} weights: "
                          f"leave quantize unset (or {mode}), or quantize the original folder")
    return dataclasses.replace(runtime, quantize=mode)


class VideoGenerator:
    """A loaded pipeline plus its sampling defaults: the family's, with what the model folder states over them."""

    def __init__(self, pipeline: ComposedPipeline, default_sampling: SamplingParam, model_path: str, family: str):
        self.pipeline = pipeline
        self.default_sampling = default_sampling
        self.model_path = model_path
        self.family = family
        # the executor of the model's work: every request's transformer steps and decodes, and the tasks
        runtime = getattr(pipeline, "runtime", None)
        self.core = EngineCore(lambda: unit_queues(pipeline), stage_threads=getattr(runtime, "stage_threads", 4),
                               name="composer-core", device=getattr(runtime, "torch_device", None))
        self.memory_guard = None  # offload = auto / memory_budget: each request checked first (composer/memory/)

    @classmethod
    def from_pretrained(cls, model_path: str | os.PathLike | None = None, **runtime_kwargs: Any) -> VideoGenerator:
        """Load a diffusers-format folder or hub id (None: the embedded default model).

        `runtime_kwargs` are RuntimeArgs fields (device, dtype, attention_backend, ...); every bad one is
        reported in a single ConfigError before anything loads.

        Several GPUs: under `torchrun`, every rank calls this (and then generate_video) with the same parallel
        degrees (ulysses_degree, ring_degree, tp_size, cfg_parallel); composer joins the process group from
        torchrun's environment. Outside a launcher, `num_gpus=N` starts N worker processes itself and returns
        a `composer.parallel.workers.WorkerVideoGenerator` with this class's generate_video / set_lora API
        (close it, or use it as a context manager, to stop them). Every rank returns the whole video; only
        rank 0 writes files.
        """
        runtime = RuntimeArgs.from_kwargs(**runtime_kwargs)
        # a ResolvedModel: what the caller resolved already (the CLI resolves once, before its request check)
        resolved = model_path if isinstance(model_path, ResolvedModel) else resolve_model(model_path,
                                                                                          runtime.model_family)
        model_path = resolved.model_path
        if getattr(resolved.pipeline_cls, "modality", "video") == "text":
            raise UnsupportedError(f"{resolved.model_path} is a diffusion language model ({resolved.index.class_name}):"
                                   " load it with composer.TextGenerator")
        check_model_configs(resolved)
        runtime = _with_folder_quantization(runtime, resolved.settings)
        if runtime.num_gpus and runtime.num_gpus > 1 and not parallel_state.under_launcher():
            from composer.parallel.workers import WorkerVideoGenerator

            return WorkerVideoGenerator.start(model_path, runtime, runtime_kwargs)
        state = parallel_state.init_parallel(runtime)  # joins torchrun's process group; None for one process
        if state is not None:  # this rank's device; rank 0 alone shows progress
            runtime = dataclasses.replace(runtime, device=str(state.device),
                                          progress=runtime.progress and state.is_main)
        # torch's CPU threads: this machine's cores shared by the ranks torchrun started on it
        apply_threads(runtime, int(os.environ.get("LOCAL_WORLD_SIZE") or 1) if state is not None else 1)
        model_path, index, pipeline_cls, configs = (
            resolved.model_path, resolved.index, resolved.pipeline_cls, resolved.configs
        )
        settings, stated = resolved.settings, resolved.stated
        logger.info(
            "loading %s as family %s (matched by %s) with %s",
            model_path, configs.family.name, configs.matched_by, pipeline_cls.__name__,
        )
        if configs.matched_by == "detector":
            logger.info("sampling defaults are %s's; if this folder is another family's model, name it with "
                        "model_family (--model-family) or in a composer.json next to its model_index.json "
                        "(docs/adding-a-model-family.md)", configs.family.name)
        guard = None
        if runtime.offload == "auto" or runtime.memory_budget is not None:
            from composer.memory import planned_runtime

            runtime, guard = planned_runtime(resolved, runtime, state, new_batch)
        start = time.perf_counter()
        pipeline = pipeline_cls(index, configs.pipeline_config(), runtime)
        logger.info("model ready in %.1f s on %s", time.perf_counter() - start, runtime.torch_device)
        defaults = configs.sampling_param().with_folder_defaults(pipeline.sampling_defaults())
        if settings.sampling:  # the folder's composer.json over what its scheduler implies
            defaults = dataclasses.replace(defaults, **{k: getattr(stated, k) for k in settings.sampling})
        generator = cls(pipeline, defaults, model_path, configs.family.name)
        generator.memory_guard = guard
        if guard is not None:  # concurrent requests share the budget: each step scheduler asks it about its calls
            for engine in pipeline.engines:
                if engine.scheduler is not None:
                    engine.scheduler.call_memory = guard.admission
        return generator

    def set_lora(self, paths: str | os.PathLike | list, scales: float | list[float] | None = None,
                 experts: str | list[str] | None = None) -> str:
        """Replace the transformer's LoRA adapters with `paths` (one or more .safetensors files; scale 1.0 each
        unless `scales` gives one per file), fused or not as the runtime's `lora_fuse` says. `experts` (two-expert
        models: one per file, 'both' by default, or 'transformer' / 'transformer_2') picks the denoiser(s) each file
        goes to. Takes effect from the next video; returns the adapters' description."""
        from composer.accel.lora import files_for

        paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
        scales = [scales] if isinstance(scales, (int, float)) else scales
        experts = [experts] * len(paths) if isinstance(experts, str) else experts
        names = self.pipeline.denoiser_names()
        chosen = {name: files_for(name, names, paths, scales, experts) for name in names}  # checked before changing
        lines = []
        with self.pipeline.gate.exclusive("set_lora"):  # after the running requests; new ones wait meanwhile
            for name in names:
                adapters = self.pipeline.lora_adapters(name)
                adapters.set(*chosen[name], fuse=self.pipeline.runtime.lora_fuse)
                lines.append(adapters.describe() if len(names) == 1 else f"{name}: {adapters.describe()}")
        return "; ".join(lines)

    def lora_report(self) -> dict[str, str] | None:
        """Each denoiser's LoRA description (files, layers touched, the kinds left out), or None without LoRA."""
        names = self.pipeline.denoiser_names()
        if not any(self.pipeline.lora_adapters(n).active for n in names):
            return None
        return {name: self.pipeline.lora_adapters(name).describe() for name in names}

    def unset_lora(self) -> None:
        """Remove every LoRA adapter: the next video is the base model's, bit for bit."""
        with self.pipeline.gate.exclusive("unset_lora"):
            for name in self.pipeline.denoiser_names():
                self.pipeline.lora_adapters(name).unset()

    def sampling_param(self, **overrides: Any) -> SamplingParam:
        """The defaults (family < model folder) with `overrides` applied (raises ConfigError for unknown keys)."""
        return self.default_sampling.updated(**overrides)

    def generate_video(
        self,
        prompt: str | list[str] | None = None,
        *,
        sampling_param: SamplingParam | None = None,
        segments: Iterable[tuple[str, int]] | None = None,
        cancel: CancelToken | None = None,
        priority: int = 0,
        **overrides: Any,
    ) -> GenerationResult | list[GenerationResult]:
        """Generate one video, or one per prompt of a list. Keyword arguments are SamplingParam fields
        (negative_prompt, height, width, num_frames, num_inference_steps, guidance_scale, flow_shift, seed,
        num_videos_per_prompt, fps, output_path, and a family's own). Causal models also take `segments`:
        (prompt, num_blocks) pairs with a prompt switch between.

        A string prompt returns one GenerationResult. A list of prompts, or num_videos_per_prompt > 1, makes
        the videos in one batch and returns a list of GenerationResult in order (each prompt's copies
        together): video i has seed `seed + i` (so it is the video a single call with that seed makes) and,
        when output_path is set, is written to a numbered path (`clip.mp4` -> `clip-0.mp4`, `clip-1.mp4`).
        `negative_prompt` is then one string for all, or a list with one per prompt.
        `cancel`: a CancelToken; `cancel.cancel()` (from another thread or a signal handler) makes this call
        raise `Cancelled` within one transformer block, and the generator stays ready for the next video.

        Several threads may call this (and `stream_video`) on one generator at once: their denoising steps are
        scheduled together, compatible steps sharing one transformer call (docs/scheduling.md); each video equals
        the one a lone call makes. `priority` (an int, higher first) orders the waiting steps.
        """
        request, priority, share = self._checked(prompt, sampling_param, segments, overrides, priority)
        sp, videos, segments = request.sampling, request.videos, request.segments
        if self.pipeline.runs_tasks:  # a task on the engine core; this thread waits for its result
            context = RequestContext(priority=priority, cancel=cancel)
            return self.core.run(self._generate_task(sp, videos, segments, cancel, priority, context, share), context)
        return drive(self._generate_task(sp, videos, segments, cancel, priority, share=share))

    def _checked(self, prompt: Any, sampling_param: SamplingParam | None, segments: Any, overrides: dict[str, Any],
                 priority: Any) -> tuple[CheckedRequest, int, Any]:
        """A request's checks, before any work: the request (checked once: a CheckedRequest given as `prompt`, the
        CLI's or the server's, is not checked again), its priority and, under a memory budget, its share of it
        (composer.memory.MemoryShare; None without a budget)."""
        priority = _checked_priority(priority)
        limits = ModelLimits.from_pipeline(self.pipeline)
        if isinstance(prompt, CheckedRequest):
            request = checked_for(prompt, limits, sampling_param=sampling_param, segments=segments, overrides=overrides)
            self._check_batching(request.videos)
            if request.segments is not None and request.sampling.num_videos_per_prompt != 1:
                raise UnsupportedError("prompt segments make one video; leave num_videos_per_prompt at 1")
        else:
            sp, videos = self._request(prompt, sampling_param, segments, overrides)
            request = check_request(sp, limits, segments, videos=videos)
        memory = self._check_memory(request.sampling, request.videos, request.segments)
        return request, priority, None if memory is None else self.memory_guard.share(memory)

    def _check_memory(self, sp: SamplingParam, videos: VideoRequests | None, segments: Any) -> Any:
        """With a memory budget: refuse a request whose predicted peak does not fit (MemoryBudgetError), before it
        starts; its predicted activations (composer.memory.RequestMemory), or None without a budget."""
        if self.memory_guard is None:
            return None
        from composer.memory import request_key as memory_key

        segments = list(segments) if segments is not None else None
        shaped = sp if sp.seed is not None else sp.updated(seed=0)  # (the twin's batch: no seed drawn for it)
        return self.memory_guard.check(new_batch(shaped, videos), shaped, memory_key(sp, videos, segments), segments)

    def submit_video(
        self,
        prompt: str | list[str] | None = None,
        *,
        sampling_param: SamplingParam | None = None,
        segments: Iterable[tuple[str, int]] | None = None,
        cancel: CancelToken | None = None,
        priority: int = 0,
        **overrides: Any,
    ) -> Future:
        """Start `generate_video(prompt, ...)` and return at once: a `concurrent.futures.Future` of its result.
        Bad input raises here, before anything starts.

        On one process (`pipeline.runs_tasks`) the request is a task on the generator's engine core
        (composer/engine/loop.py): no thread waits for it between its steps, its steps are batched with every other
        request's (under model offload, requests run one at a time, the others waiting in the gate's queue), and its
        stages other than denoising run on the core's stage threads (`RuntimeArgs.stage_threads`) only while they
        work (under a parallel layout too: rank 0's core plans every batch). The future's result is `generate_video`'s; a `Cancelled` (its
        `cancel` token) or any error of the request is the future's exception."""
        request, priority, share = self._checked(prompt, sampling_param, segments, overrides, priority)
        sp, videos, segments = request.sampling, request.videos, request.segments
        if not self.pipeline.runs_tasks:
            future: Future = Future()
            future.set_running_or_notify_cancel()

            def run() -> None:
                try:
                    future.set_result(self.generate_video(request, cancel=cancel, priority=priority))
                except BaseException as exc:  # noqa: BLE001 - the caller's, through the future
                    future.set_exception(exc)

            threading.Thread(target=run, name="composer-request", daemon=True).start()
            return future
        context = RequestContext(priority=priority, cancel=cancel, background=True)
        return self.core.submit(self._generate_task(sp, videos, segments, cancel, priority, context, share), context)

    def _generate_task(self, sp: SamplingParam, videos: VideoRequests | None, segments: Any,
                       cancel: CancelToken | None, priority: int, context: RequestContext | None = None,
                       share: Any = None):
        """`generate_video`'s work (after its checks) as a task: each batch through `pipeline.forward_task`, its
        results made (and files written) as blocking work. `context`: a task's RequestContext, shared by its
        batches (None: each batch gets its own, as a call on a thread does). `share`: under a memory budget, the
        request first waits until it fits beside the running requests (composer.memory.admission), and holds its
        reservation to its end."""
        reservation = None
        if share is not None:
            # others hold the memory: the core holds its ticket meanwhile (no thread waits)
            reservation = yield from admitted(self.memory_guard.admission, share, priority, cancel)
        try:
            return (yield from self._reserved_task(sp, videos, segments, cancel, priority, context, reservation))
        finally:
            if reservation is not None:
                reservation.release()

    def _reserved_task(self, sp: SamplingParam, videos: VideoRequests | None, segments: Any,
                       cancel: CancelToken | None, priority: int, context: RequestContext | None, reservation: Any):
        """`_generate_task` once the request holds its memory (`reservation`, or None without a budget)."""
        limit = self.pipeline.runtime.max_batch_size
        if videos is None or not limit or videos.count <= limit:
            results = yield from self._batch_task(sp, videos, segments, cancel, priority, context,
                                                  reservation=reservation)
            return results if videos is not None and not videos.single else results[0]
        # More videos than one batch may hold: consecutive batches, each row keeping its seed and number.
        seed = sp.seed if sp.seed is not None else parallel_state.random_seed()
        results = []
        for first in range(0, videos.count, limit):
            rows = slice(first, first + limit)
            part = dataclasses.replace(videos, prompts=videos.prompts[rows], single=False,
                                       negative_prompts=videos.negative_prompts[rows] if videos.negative_prompts else None)
            results += yield from self._batch_task(sp.updated(seed=seed + first), part, segments, cancel, priority,
                                                   context, row_offset=first, several=True, reservation=reservation)
        return results

    def _batch_task(self, sp: SamplingParam, videos: VideoRequests | None, segments: Any,
                    cancel: CancelToken | None, priority: int, context: RequestContext | None,
                    row_offset: int = 0, several: bool | None = None, reservation: Any = None):
        """One batch through the pipeline, as a task; a result per row (rows numbered from `row_offset`)."""
        batch = self._new_batch(sp, videos, cancel, priority)
        if context is not None:
            context.key = batch.get(RequestContext).key  # (its name on every rank of a parallel layout)
            batch.attach(context)  # the task's: what its units and cancel checks name
        batch.get(RequestContext).memory = reservation  # what the step scheduler's memory rule reads
        start = time.perf_counter()
        self.pipeline.prepare(batch, sp, list(segments) if segments is not None else None)
        batch = yield from self.pipeline.forward_task(batch)
        timings = dict(batch.timings)
        timings["total"] = time.perf_counter() - start
        stats = batch.stats
        if stats is not None:
            stats.total_seconds, stats.frames = timings["total"], int(batch.frames.shape[1])
            stats.time_to_first_frame = timings["total"]  # nothing is shown before the whole video is decoded
        return (yield from wait_for(Blocking(lambda: self._results(batch, sp, videos, timings, stats, row_offset,
                                                                   several))))

    def _request(
        self, prompt: Any, sampling_param: SamplingParam | None, segments: Any, overrides: dict[str, Any]
    ) -> tuple[SamplingParam, VideoRequests | None]:
        """The request's SamplingParam and its videos (None: causal segments without a prompt name them).
        Prompt types are checked here, before any work; lists never enter the SamplingParam, whose
        prompt fields hold one string."""
        overrides = dict(overrides)
        refuse_image_knobs(overrides, [f.name for f in dataclasses.fields(self.default_sampling)], self.family)
        for key in overrides:  # another family's knob: say what this model does (a typo: updated's did-you-mean)
            if problem := foreign_knob_problem(key, type(self.default_sampling), self.family):
                raise ConfigError(f"{key} given, but {problem}")
        negative = overrides.pop("negative_prompt", None)
        sp = (sampling_param or self.default_sampling).updated(
            prompt=prompt if isinstance(prompt, str) else None,
            negative_prompt=negative if isinstance(negative, str) else None,
            **overrides,
        )
        if prompt is None:
            prompt = sp.prompt
        if prompt is None and segments is not None:  # the segments name the prompts: one video
            if sp.num_videos_per_prompt != 1:
                raise UnsupportedError("prompt segments make one video; leave num_videos_per_prompt at 1")
            return sp, None
        videos = video_requests(prompt, sp.negative_prompt if negative is None else negative, sp.num_videos_per_prompt)
        self._check_batching(videos)
        return sp, videos

    def _check_batching(self, videos: VideoRequests | None) -> None:
        """Several videos in one request only where the pipeline batches them."""
        if videos is not None and videos.count > 1 and not self.pipeline.batches_videos:
            raise UnsupportedError(
                f"{type(self.pipeline).__name__} makes one video per request; got {videos.count} (a prompt list or "
                "num_videos_per_prompt > 1). Call generate_video once per prompt instead"
            )

    def _results(
        self, batch: ForwardBatch, sp: SamplingParam, videos: VideoRequests | None, timings: dict[str, float],
        stats: RequestStats | None, row_offset: int = 0, several: bool | None = None,
    ) -> list[GenerationResult]:
        """One GenerationResult per batch row, each written to its own file when output_path is set."""
        if several is None:
            several = videos is not None and videos.count > 1
        results = []
        lora = self.lora_report()
        said = batch.get(PromptWarnings, PromptWarnings()).rows
        for i, seed in enumerate(batch.seeds):
            sampling = sp.updated(seed=seed)
            if several:  # the row's own request: what a single call making this video would be given
                sampling = sampling.updated(
                    prompt=videos.prompts[i],
                    negative_prompt=videos.negative_prompts[i] if videos.negative_prompts else None,
                    num_videos_per_prompt=1,
                    output_path=numbered_path(sp.output_path, row_offset + i) if sp.output_path else None,
                )
            result = GenerationResult(
                frames=batch.frames[i], seed=seed, sampling=sampling, timings=timings, stats=stats,
                latents=batch.latents[i:i + 1].detach().cpu(), lora=lora,
                warnings=[m.replace(f"[{i}]", "") for m in said.get(i, [])] if several else said.get(i, []),
            )
            if sampling.output_path and parallel_state.is_main_process():  # rank 0 writes; the others don't
                result.output_path = save_video(result.frames, sampling.output_path, fps=sp.fps)
            logger.info(
                "generated %dx%dx%d (seed %d) in %.2f s%s%s",
                result.num_frames, sp.height, sp.width, seed, timings["total"],
                f" (video {row_offset + i + 1}, batch of {len(batch.seeds)})" if several else "",
                f" -> {result.output_path}" if result.output_path else "",
            )
            results.append(result)
        return results

    def stream_video(
        self,
        prompts: str | Iterable[tuple[str, int]] | None = None,
        *,
        sampling_param: SamplingParam | None = None,
        keep_video: bool = True,
        cancel: CancelToken | None = None,
        priority: int = 0,
        target_fps: float | None = None,
        rtmp_url: str | None = None,
        **overrides: Any,
    ) -> VideoStream:
        """Generate block by block (causal models), yielding frames as each block is decoded.

        `prompts`: one prompt (for as many blocks as num_frames asks), or (prompt, num_blocks) segments - a
        prompt switch after each segment. Segments are read lazily, so an iterator can supply the next prompt
        while earlier blocks stream (interactive use); a source with an `ends_segment(block_index) -> bool` method
        is also asked before each block of a segment after its first, and True ends that segment there (a live
        prompt switch: the next segment is read and starts at that block). Iterate the returned VideoStream for
        VideoChunk objects; afterwards it holds the whole video (`frames`, `latents`) and the profile (`stats`). For endless streams
        consumed as they go (written to disk), `keep_video=False` keeps neither frames nor old latents.
        `cancel`: a CancelToken; once cancelled, iteration raises `Cancelled` within one transformer block.
        `priority`: as for `generate_video`; streams read from several threads are scheduled together.
        `target_fps`: the frame rate a realtime viewer of this stream needs (None: no target). Whenever the stream
        has delivered fewer frames than `target_fps` x the seconds since it was first read, its next steps go
        before the waiting steps of other requests of the same priority (docs/scheduling.md, "Realtime
        streams"); `stats.fps` and `stats.target_fps` tell the rate reached and the one asked for.
        `rtmp_url`: also push the frames, as each chunk is made, to this rtmp:// or rtmps:// URL (H.264 in FLV through
        ffmpeg; composer/rtmp.py, docs/causal-streaming.md "RTMP out"); a push that fails ends the stream with
        RtmpError, whose message never shows the URL's stream key. Only rank 0 pushes.
        """
        priority = _checked_priority(priority)
        target_fps = _checked_target_fps(target_fps)
        if rtmp_url is not None:
            from composer.rtmp import check_rtmp_url

            rtmp_url = check_rtmp_url(rtmp_url)  # before any work
        segments = None
        prompt = None
        checked = prompts if isinstance(prompts, CheckedRequest) else None  # checked at submit: not again
        if checked is not None:
            checked = checked_for(checked, ModelLimits.from_pipeline(self.pipeline), sampling_param=sampling_param,
                                  overrides=overrides)
            prompts = checked.segments if checked.segments is not None else checked.sampling.prompt
        ends_segment = getattr(prompts, "ends_segment", None)
        if checked is not None:
            segments = checked.segments
        elif isinstance(prompts, str) or prompts is None:
            prompt = prompts
        else:
            iterator = iter(prompts)
            try:
                first = next(iterator)
            except StopIteration:
                raise InvalidInputError("stream_video needs at least one (prompt, num_blocks) segment") from None
            prompt = first[0] if isinstance(first, (tuple, list)) and first else None
            segments = [first, *iterator] if isinstance(prompts, (list, tuple)) else itertools.chain([first], iterator)
        if checked is not None:
            sp = checked.sampling
        else:
            sp = (sampling_param or self.default_sampling).updated(prompt=prompt, **overrides)
        if sp.num_videos_per_prompt != 1:
            raise UnsupportedError("stream_video makes one video; leave num_videos_per_prompt at 1")
        if checked is None:
            check_request(sp, ModelLimits.from_pipeline(self.pipeline), segments)  # before any work
        self._check_memory(sp, None, segments if isinstance(segments, list) else None)  # (a live source: unread)
        batch = self._new_batch(sp, None, cancel, priority)
        context = batch.get(RequestContext)
        context.target_fps = target_fps
        if isinstance(segments, list):  # the same on every rank (a lazy source is read as the stream goes)
            context.key = request_key(sp, segments, priority) if self._planned else ""
        self.pipeline.prepare(batch, sp, segments, keep_video=keep_video)
        if callable(ends_segment):  # a live source: it may end the running segment before its last block
            from composer.stages.causal_denoising import CausalPlan

            batch.get(CausalPlan).ends_segment = ends_segment
        pusher = None
        if rtmp_url is not None and parallel_state.is_main_process():  # every rank makes the frames; one pushes
            from composer.rtmp import RtmpPusher

            pusher = RtmpPusher(rtmp_url, sp.fps)
        # a thread reading the stream waits for each chunk made as a task on the engine core, as an async reader
        # does (where the pipeline's streams can be tasks; not with an RTMP push, whose failure hands the chunk
        # over before raising)
        core = self.core if self.pipeline.streams_as_tasks and pusher is None else None
        return VideoStream(self.pipeline.stream(batch), batch, sp, keep_video, rtmp=pusher, core=core)

    def open_session(self, *, seed: int | None = None, **kwargs: Any) -> Session:
        """A causal video that lives across calls: `session.extend(prompt, num_blocks)` yields the next blocks'
        chunks, continuing the same video (`composer/session.py`). `kwargs`: stream_video's (sampling fields,
        keep_video, cancel, priority, target_fps). open_session(seed=s) + extend(p0, a) + extend(p1, b) gives the
        frames of stream_video([(p0, a), (p1, b)], seed=s)."""
        from composer.session import Session

        if not self.pipeline.can_stream:
            raise UnsupportedError(f"{type(self.pipeline).__name__} makes whole videos; sessions need a causal model")
        if seed is None:
            seed = parallel_state.random_seed()
        self._check_session_options(seed=seed, **kwargs)  # refused now, not at the first extend
        return Session(self, {"seed": seed, **kwargs})

    def _check_session_options(self, *, sampling_param: SamplingParam | None = None, keep_video: Any = True,
                               cancel: Any = None, priority: Any = 0, target_fps: Any = None, rtmp_url: Any = None,
                               **overrides: Any) -> None:
        """Everything `stream_video` refuses before its first block, for a session whose segments (and so its
        prompts and length) come with each extend."""
        _checked_priority(priority)
        _checked_target_fps(target_fps)
        if not isinstance(keep_video, bool):
            raise InvalidInputError(f"keep_video = {keep_video!r}: expected True or False")
        if cancel is not None and not isinstance(cancel, CancelToken):
            raise InvalidInputError(f"cancel = {cancel!r}: expected a composer.CancelToken (or None)")
        if rtmp_url is not None:
            from composer.rtmp import check_rtmp_url

            check_rtmp_url(rtmp_url)
        if sampling_param is not None and not isinstance(sampling_param, SamplingParam):
            raise InvalidInputError(f"sampling_param = {sampling_param!r}: expected a SamplingParam (or None)")
        sp = (sampling_param or self.default_sampling).updated(**overrides)
        if sp.num_videos_per_prompt != 1:
            raise UnsupportedError("a session makes one video; leave num_videos_per_prompt at 1")
        check_request(sp, ModelLimits.from_pipeline(self.pipeline), iter(()))  # segments: one per extend, unread

    def resume_session(self, data: bytes) -> Session:
        """The session `Session.snapshot()` wrote (in this process or another), on this generator: it must load
        the same model. Its next `extend` gives exactly what the snapshotted session's would have. Bytes that are
        not an intact snapshot of this format (damaged, cut off, foreign, another version: the header's digest
        and length say) are a `composer.session.SnapshotError` naming which, before anything is loaded."""
        from composer.session import Session

        if not self.pipeline.can_stream:
            raise UnsupportedError(f"{type(self.pipeline).__name__} makes whole videos; sessions need a causal model")
        return Session.resume(self, data)

    async def agenerate_video(self, prompt: str | list[str] | None = None, **kwargs: Any
                              ) -> GenerationResult | list[GenerationResult]:
        """`generate_video` for asyncio code (a server's handlers): awaits `submit_video`'s future, so the event loop
        stays free, no thread waits for the request between its steps, and concurrent awaits are scheduled
        together like concurrent calls."""
        import asyncio

        return await asyncio.wrap_future(self.submit_video(prompt, **kwargs))

    async def astream_video(self, prompts: str | Iterable[tuple[str, int]] | None = None, **kwargs: Any):
        """`stream_video` for asyncio code: an async iterator of VideoChunk. Where the pipeline allows
        (`pipeline.streams_as_tasks`) each chunk is a task on the request loop, so no thread waits for the stream,
        between its blocks or between its passes; elsewhere each block is made on a worker thread."""
        import asyncio

        stream = await asyncio.to_thread(self.stream_video, prompts, **kwargs)
        if self.pipeline.streams_as_tasks:
            try:
                while (chunk := await asyncio.wrap_future(
                        self.core.submit(stream.next_task(), stream.context))) is not None:
                    yield chunk
            finally:
                stream.close()
            return
        chunks = iter(stream)
        done = object()
        try:
            while (chunk := await asyncio.to_thread(next, chunks, done)) is not done:
                yield chunk
        finally:
            close = getattr(stream._chunks, "close", None)
            if close is not None:
                await asyncio.to_thread(close)

    @property
    def _planned(self) -> bool:
        """Whether rank 0 plans this pipeline's calls (a parallel layout): requests then need their key."""
        return any(getattr(e.scheduler, "planner", None) is not None for e in getattr(self.pipeline, "engines", []))

    def _new_batch(self, sp: SamplingParam, videos: VideoRequests | None = None,
                   cancel: CancelToken | None = None, priority: int = 0) -> ForwardBatch:
        self._warn_ignored_settings(sp)
        batch = new_batch(sp, videos, cancel, priority)
        if self._planned:  # (hashes images: only where it is used)
            batch.get(RequestContext).key = request_key(sp, videos, priority)
        return batch

    def _warn_ignored_settings(self, sp: SamplingParam) -> None:
        # Only a negative prompt the user chose: a family's default one (Wan's) is not worth a warning.
        given = sp.negative_prompt and sp.negative_prompt != self.default_sampling.negative_prompt
        embedded = hasattr(sp, "true_cfg_scale")  # guidance-distilled: CFG is true_cfg_scale (its pipeline warns)
        if given and not embedded and sp.guidance_scale is not None and sp.guidance_scale <= 1:
            log_once(logger, "negative-prompt-ignored", f"negative_prompt is ignored: guidance_scale = "
                     f"{sp.guidance_scale} (<= 1) turns classifier-free guidance off; set guidance_scale > 1 to "
                     "use it", logging.WARNING)


def new_batch(sp: SamplingParam, videos: VideoRequests | None = None, cancel: CancelToken | None = None,
              priority: int = 0) -> ForwardBatch:
    """The ForwardBatch of a request: its prompts (one row per video), size, steps, guidance and seed (a seed left
    to chance drawn here), and its RequestContext."""
    seed = sp.seed if sp.seed is not None else parallel_state.random_seed()
    if videos is not None:  # one row per video
        prompt, negative = videos.prompts, videos.negative_prompts
    else:
        prompt = [sp.prompt] if isinstance(sp.prompt, str) else sp.prompt  # None fails input validation
        negative = [sp.negative_prompt] if isinstance(sp.negative_prompt, str) else sp.negative_prompt
    batch = ForwardBatch(
        prompt=prompt,
        negative_prompt=negative,
        height=sp.height,
        width=sp.width,
        num_frames=sp.num_frames,
        num_inference_steps=sp.num_inference_steps,
        guidance_scale=sp.guidance_scale,
        flow_shift=sp.flow_shift,
        seed=seed,
    )
    if isinstance(seed, int) and 0 <= seed < 2**63:
        batch.generator = torch.Generator("cpu").manual_seed(seed)
    if cancel is not None:
        batch.attach(cancel)
    batch.attach(RequestContext(priority=priority, cancel=cancel, key=""))
    return batch


class StreamPace:
    """A stream's frames against the clock: the frame rate it reached, and (with a target) when its next frames
    are due, kept on its RequestContext for the scheduler.

    The clock runs from the stream's first read to its latest chunk; a session's `extend` starts a new stretch
    (the time the session sat between extends is not counted). Within a stretch that began at `t0` with `n`
    frames delivered since, the next frames are due at `t0 + n / target_fps`: at once when the stretch begins,
    and whenever the stream has delivered fewer frames than a viewer playing at target_fps since `t0` has shown.
    """

    def __init__(self, context: RequestContext | None, clock: Any = time.monotonic):
        self.context = context
        self.clock = clock
        self.frames = 0  # frames delivered in all
        self.seconds = 0.0  # the stretches before the running one, each to its last chunk
        self._start: float | None = None  # when the running stretch began (None: between stretches)
        self._stretch_frames = 0
        self._last: float | None = None  # the running stretch's latest chunk

    @property
    def target_fps(self) -> float | None:
        return None if self.context is None else self.context.target_fps

    def reading(self) -> None:
        """The consumer asks for the next chunk: start a stretch unless one runs."""
        if self._start is None:
            self._start, self._stretch_frames, self._last = self.clock(), 0, None
            self._set_deadline()

    def delivered(self, frames: int) -> None:
        """A chunk of `frames` frames was made."""
        self.frames += frames
        self._stretch_frames += frames
        self._last = self.clock()
        self._set_deadline()

    def pause(self) -> None:
        """End the running stretch (at its last chunk); the next read starts another."""
        if self._start is not None and self._last is not None:
            self.seconds += self._last - self._start
        self._start, self._last = None, None
        if self.context is not None:
            self.context.deadline = None

    @property
    def fps(self) -> float | None:
        """Frames delivered per second of the stretches (None before the first chunk)."""
        seconds = self.seconds
        if self._start is not None and self._last is not None:
            seconds += self._last - self._start
        return self.frames / seconds if self.frames and seconds > 0 else None

    def _set_deadline(self) -> None:
        target = self.target_fps
        if target is not None and self._start is not None:
            self.context.deadline = self._start + self._stretch_frames / target


class VideoStream:
    """Chunks of a video as they are made. Iterate it once; then `frames`, `stats`, `seed` describe it all."""

    def __init__(self, chunks: Iterator, batch: ForwardBatch, sampling: SamplingParam, keep_video: bool = True,
                 rtmp: Any = None, core: Any = None):
        self._chunks = chunks
        self._core = core  # an EngineCore: iterating waits for each chunk made as a task there (`next_task`)
        self.rtmp = rtmp  # a composer.rtmp.RtmpPusher the frames also go to (None: none)
        self._batch = batch
        self.sampling = sampling
        self.keep_video = keep_video
        self.chunks: list = []  # every chunk so far (empty when keep_video is off)
        self.pace = StreamPace(batch.get(RequestContext, None))
        self._frames = 0

    @property
    def seed(self) -> int:
        return self._batch.seed

    def __iter__(self) -> Iterator[VideoChunk]:
        if self._core is not None:
            yield from self._iter_on_core()
            return
        pace = self.pace
        try:
            while True:
                pace.reading()
                try:
                    chunk = next(self._chunks)
                except StopIteration:
                    if self.rtmp is not None:
                        self.rtmp.close()  # the last frames sent (RtmpError if the push failed)
                    return
                try:
                    self._delivered(chunk)
                except BaseException as exc:  # the push failed: the pipeline lets go of the request now. The chunk
                    self.close()  # was made, so the caller still gets it (a network fault must not cost a local
                    yield chunk  # copy), then the push's error
                    raise exc
                yield chunk
        finally:
            pace.pause()  # ended, failed or closed: no frames are due any more
            if self.rtmp is not None and self.rtmp.running:  # failed or closed early: stop pushing now
                self.rtmp.abort()

    def _iter_on_core(self) -> Iterator[VideoChunk]:
        """Each chunk a task on the engine core, this thread waiting for it: the chunks (and how their passes share
        calls with other requests') are those of `next_task` on an async reader."""
        try:
            while (chunk := self._core.run(self.next_task(), self.context)) is not None:
                yield chunk
        finally:
            self.pace.pause()

    def next_task(self):
        """The next chunk as a task for the generator's engine core (`gen.core.submit(stream.next_task(),
        stream.context)`): no thread waits for it between its passes. Returns the chunk, or None at the end (the
        stream is then over, as at the end of iteration)."""
        self.pace.reading()
        try:
            chunk = yield from self._chunks.next_task()
            if chunk is None:
                self.pace.pause()
                if self.rtmp is not None:  # ffmpeg's flush may wait on the network: off the loop's thread
                    yield from wait_for(Blocking(self.rtmp.close))
                return None
            self._delivered(chunk)
        except BaseException:
            self.pace.pause()
            if self.rtmp is not None:
                self.rtmp.abort()
            raise
        return chunk

    @property
    def context(self) -> RequestContext:
        """The stream's request (priority, cancel token, frame-rate deadline) as the scheduler sees it."""
        return self._chunks.context

    def _delivered(self, chunk: VideoChunk) -> None:
        """Count the chunk as made, then push it (last: a failed push has the chunk counted and kept all the same)."""
        self._frames += len(chunk.frames)
        self.pace.delivered(len(chunk.frames))
        stats = self._batch.stats
        if stats is not None:
            if stats.time_to_first_frame is None:
                stats.time_to_first_frame = chunk.since_start
            stats.frames, stats.total_seconds = self._frames, time.perf_counter() - self._batch.started
            stats.fps, stats.target_fps = self.pace.fps, self.pace.target_fps
        if self.keep_video:
            self.chunks.append(chunk)
        if self.rtmp is not None:
            self.rtmp.push(chunk.frames)  # never blocks: RtmpError once the receiver is too far behind or gone

    def close(self) -> None:
        """End the stream now (read to its end or not): the pipeline lets go of the request, its place and its KV
        cache, at once rather than when the stream is collected."""
        close = getattr(self._chunks, "close", None)
        try:
            if close is not None:
                close()
        finally:
            self.pace.pause()
            if self.rtmp is not None and self.rtmp.running:
                self.rtmp.abort()

    @property
    def frames(self) -> np.ndarray:
        """Every frame streamed so far, uint8 [T, H, W, 3]."""
        if not self.chunks:
            return np.zeros((0, self.sampling.height, self.sampling.width, 3), dtype=np.uint8)
        return np.concatenate([c.frames for c in self.chunks])

    @property
    def stats(self) -> RequestStats | None:
        return self._batch.stats

    @property
    def latents(self):
        return self._batch.latents
