"""Memory planning: predict what a request needs before it runs (`predict`), pick the placement that fits a budget
(`plan`; under torchrun one plan for every rank: `ranks`), admit concurrent requests against it (`admission`). See
docs/memory.md."""

from __future__ import annotations

import dataclasses
from typing import Any

from composer.logging import get_logger
from composer.memory.admission import AdmissionStats, MemoryAdmission, MemoryShare, Reservation
from composer.memory.plan import (
    HEADROOM,
    MemoryGuard,
    MemoryPlan,
    device_peak,
    plan_memory,
    resolve_memory_budget,
)
from composer.memory.predict import MemoryPredictor, RequestMemory, fmt_bytes
from composer.memory.trace import LiveBytes, fake_mode, traced_peak
from composer.memory.weights import ComponentWeights, component_weights

logger = get_logger(__name__)

__all__ = ["HEADROOM", "AdmissionStats", "ComponentWeights", "LiveBytes", "MemoryAdmission", "MemoryGuard",
           "MemoryPlan", "MemoryPredictor", "MemoryShare", "RequestMemory", "Reservation", "component_weights",
           "device_peak", "fake_mode", "fmt_bytes", "plan_memory", "planned_runtime", "request_key",
           "resolve_memory_budget", "traced_peak"]

_IMAGE_FIELDS = ("image", "last_image", "reference_images", "video", "mask")


def request_key(sampling: Any, videos: Any, segments: Any) -> tuple:
    """What decides a request's shapes (requests with equal keys need the same memory)."""
    rows = videos.count if videos is not None else 1
    images = tuple(sorted(name for name in _IMAGE_FIELDS if getattr(sampling, name, None) is not None))
    return (sampling.height, sampling.width, sampling.num_frames, rows, float(sampling.guidance_scale or 0.0),
            sampling.negative_prompt is not None, len(segments) if segments else 0, images)


def planned_runtime(resolved: Any, runtime: Any, parallel_state: Any, new_batch: Any) -> tuple[Any, MemoryGuard]:
    """offload = auto / memory_budget, before the model loads: the plan (logged) for the folder's default video,
    the runtime with its offload mode, and the guard that checks each request. `new_batch(sampling, videos)`: the
    generator's ForwardBatch maker (the stand-in request is made as a real one is)."""
    from composer.prompt_lists import video_requests

    index, configs = resolved.index, resolved.configs
    predictor = MemoryPredictor(resolved.pipeline_cls, index, configs.pipeline_config().updated_from_folder(index.extra),
                                runtime)
    sampling = configs.sampling_param().with_folder_defaults(predictor.twin().sampling_defaults())
    if resolved.settings.sampling:  # as VideoGenerator.from_pretrained makes its defaults
        sampling = dataclasses.replace(sampling, **{k: getattr(resolved.stated, k) for k in resolved.settings.sampling})
    sampling = sampling.updated(prompt="a memory plan", seed=0)
    if hasattr(sampling, "image") and sampling.image is None:  # an image model's request: a stand-in first frame of
        from PIL import Image  # the video's size (only shapes count)

        sampling = sampling.updated(image=Image.new("RGB", (sampling.width, sampling.height), (128, 128, 128)))
    video = dict(num_frames=sampling.num_frames, height=sampling.height, width=sampling.width)
    budget = resolve_memory_budget(runtime.memory_budget, runtime.torch_device)

    def make_request():
        videos = video_requests(sampling.prompt, sampling.negative_prompt, 1)
        return new_batch(sampling, videos), sampling, request_key(sampling, videos, None)

    offload = runtime.offload
    # (hooks.py refuses disk with each of these)
    no_disk = offload == "auto" and bool(runtime.lora_path or runtime.quantize != "none" or runtime.tp_size > 1)

    def plan_here() -> MemoryPlan:
        return plan_memory(predictor, make_request, budget, video, offload=offload,
                           streaming=predictor.twin().can_stream, no_disk=no_disk)

    offload_modes_note = (" (disk left out: LoRA, quantization and tensor parallel need the blocks in memory)"
                          if no_disk else "")
    if parallel_state is None:
        plan = plan_here()
        logger.info("memory plan: %s%s; considered %s", plan.describe(), offload_modes_note,
                    "; ".join(plan.considered))
    else:  # torchrun: every rank plans on its own device, all take the most conservative plan (logged by rank 0)
        from composer.memory.ranks import agree_plan

        plan = agree_plan(parallel_state, predictor, plan_here, make_request, video)
    if offload == "auto":
        runtime = dataclasses.replace(runtime, offload=plan.offload)
    if plan.vae_tiling and runtime.vae_tile_size is None:
        from composer.stages.vae_tiling import DEFAULT_TILE

        runtime = dataclasses.replace(runtime, vae_tile_size=DEFAULT_TILE)
    return runtime, MemoryGuard(predictor, plan)

