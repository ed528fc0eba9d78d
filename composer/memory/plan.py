"""Memory planned before a model loads and before each request runs.

`offload = auto` (with an optional `memory_budget`) picks the cheapest placement whose predicted peak fits the
budget, for the family's default video (or the folder's): no offload, then model offload (each component on the
device only while its stage runs), then layerwise (transformer blocks streamed from host memory), then disk (blocks
streamed from the memory-mapped files, when host memory cannot hold them either); the VAE decodes tiled when its
whole-video decode is what does not fit (exact tiles for the Wan VAE: the same frames). Each request is then checked before it starts: one whose predicted peak
exceeds the budget is refused with the numbers, instead of running out of memory halfway.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from composer.errors import MemoryBudgetError
from composer.logging import get_logger
from composer.memory.predict import MemoryPredictor, RequestMemory, fmt_bytes
from composer.platform import platform_for

logger = get_logger(__name__)

HEADROOM = 0.15  # the prediction leaves out allocator rounding and kernels' scratch: up to 14% on the VAE (docs/memory.md)
DEFAULT_FRACTION = 0.90  # offload = auto without memory_budget: this share of the device's free memory
OFFLOAD_ORDER = ("none", "model", "layerwise", "disk")


def host_available() -> int:
    """Host memory the system can still give (the host platform's free memory: MemAvailable)."""
    return platform_for("cpu").memory_info()[0]


def resolve_memory_budget(budget: float | int | None, device: torch.device) -> int:
    """memory_budget as bytes, by kv_cache_memory's rule (a number > 1: bytes; a fraction in (0, 1] of the device's
    free memory now, host memory for a CPU device); None: DEFAULT_FRACTION of it."""
    from composer.cache.kv_pool import resolve_budget

    return resolve_budget(DEFAULT_FRACTION if budget is None else budget, device)


def _denoisers(predictor: MemoryPredictor) -> list[str]:
    return [n for n in predictor.weights if n.startswith("transformer")]


def device_peak(predictor: MemoryPredictor, offload: str, request: RequestMemory) -> tuple[int, int]:
    """(peak device bytes of `request` under `offload`, weights on the device at that peak)."""
    weights = predictor.weights
    denoisers = _denoisers(predictor)
    if offload == "model":  # only the running stage's components are on the device
        best = (0, 0)
        for stage in request.stages:
            on_device = sum(weights[n].total for n in stage.components if n in weights)
            best = max(best, (on_device + stage.carried + stage.peak, on_device))
        return best
    if offload in ("layerwise", "disk"):
        resident = sum(w.total for n, w in weights.items() if n not in denoisers)
        resident += sum(weights[n].streamed() for n in denoisers)
    else:
        resident = sum(w.total for w in weights.values())
    return resident + request.peak, resident


def host_need(predictor: MemoryPredictor, offload: str) -> int:
    """Host bytes the placement keeps in memory (model: every component; layerwise: the transformer blocks)."""
    weights = predictor.weights
    if offload == "model":
        return sum(w.total for w in weights.values())
    if offload == "layerwise":
        return sum(sum(weights[n].blocks.values()) for n in _denoisers(predictor))
    return 0


@dataclass
class MemoryPlan:
    offload: str
    vae_tiling: bool
    budget: int
    peak: int
    weights_on_device: int
    request: RequestMemory
    video: dict[str, Any]
    considered: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.peak <= self.budget / (1 + HEADROOM)

    def describe(self) -> str:
        return (f"offload {self.offload}{', VAE decode tiled' if self.vae_tiling else ''}: predicted peak "
                f"{fmt_bytes(self.peak)} of a {self.video['num_frames']}x{self.video['height']}x{self.video['width']} "
                f"video (weights on the device {fmt_bytes(self.weights_on_device)}; {self.request.describe()}), "
                f"{'within' if self.fits else 'over'} a budget of {fmt_bytes(self.budget)} ({HEADROOM:.0%} kept free)")


def plan_memory(predictor: MemoryPredictor, make_request, budget: int, video: dict[str, Any],
                offload: str = "auto", streaming: bool = False, no_disk: bool = False) -> MemoryPlan:
    """The cheapest placement (OFFLOAD_ORDER; on a CPU device only none or disk) whose predicted peak fits `budget`
    with HEADROOM for the request `make_request()` gives (a fresh (batch, sampling, key) each call); the VAE
    decode tiled when only that makes it fit. `offload` other than auto: that placement, checked. Raises
    MemoryBudgetError when nothing fits."""
    device = predictor.device
    if offload != "auto":
        modes = (offload,)
    else:
        modes = ("none", "disk") if device.type == "cpu" else OFFLOAD_ORDER
        modes = tuple(m for m in modes if not (no_disk and m == "disk"))
    usable = budget / (1 + HEADROOM)
    host = host_available()
    considered = []
    requests: dict[bool, RequestMemory] = {}

    def request_for(tiled: bool) -> RequestMemory:
        if tiled not in requests:
            batch, sampling, key = make_request()
            requests[tiled] = predictor.request(batch, sampling, key=key, tiled_decode=tiled)
        return requests[tiled]

    tilings = (False,) if streaming or "vae" not in predictor.weights or offload != "auto" else (False, True)
    # (a stream decodes block by block, whole frames: composer/stages/decoding.py)
    best: MemoryPlan | None = None
    for tiled in tilings:
        for mode in modes:
            request = request_for(tiled)
            peak, on_device = device_peak(predictor, mode, request)
            need = host_need(predictor, mode) if device.type != "cpu" else 0
            considered.append(f"{mode}{' + tiled VAE' if tiled else ''}: {fmt_bytes(peak)}"
                              f"{'' if need <= host else f' (host memory {fmt_bytes(need)} > {fmt_bytes(host)} free)'}")
            if need > host:
                continue
            plan = MemoryPlan(mode, tiled, budget, peak, on_device, request, video, considered)
            if peak <= usable:
                return plan
            if best is None or peak < best.peak:
                best = plan
    if best is not None and best.weights_on_device <= usable:
        logger.warning(
            "memory plan: no placement fits a %dx%dx%d video (the defaults) in the budget of %s; the smallest, %s, "
            "is used and requests whose predicted peak does not fit will be refused. Predicted peaks: %s",
            video["num_frames"], video["height"], video["width"], fmt_bytes(budget), best.offload, "; ".join(considered))
        return best
    raise MemoryBudgetError(
        f"the weights alone do not fit the memory budget of {fmt_bytes(budget)} ({fmt_bytes(usable)} after "
        f"{HEADROOM:.0%} headroom): predicted peaks of a {video['num_frames']}x{video['height']}x{video['width']} "
        "video: " + "; ".join(considered) + ". Quantize the transformer (quantize=int8), use offload = layerwise or "
        "disk, or raise memory_budget"
    )


class MemoryGuard:
    """Checks each request against the plan before it runs (composer.generator), and admits concurrent requests
    against the plan's one budget (`admission`: composer.memory.admission)."""

    def __init__(self, predictor: MemoryPredictor, plan: MemoryPlan):
        from composer.memory.admission import MemoryAdmission

        self.predictor = predictor
        self.plan = plan
        usable = int(plan.budget / (1 + HEADROOM))
        # model offload moves each stage's components in and out: its weights travel with each request's stages
        weights = 0 if plan.offload == "model" else plan.weights_on_device
        self.admission = MemoryAdmission(usable - weights, weights)

    def check(self, batch, sampling, key: tuple, segments: Any = None) -> RequestMemory:
        request = self.predictor.request(batch, sampling, segments, key=key, tiled_decode=self.plan.vae_tiling)
        peak, on_device = device_peak(self.predictor, self.plan.offload, request)
        usable = self.plan.budget / (1 + HEADROOM)
        if peak > usable:
            raise MemoryBudgetError(
                f"this request needs about {fmt_bytes(peak)} of {self.predictor.device.type} memory (weights "
                f"{fmt_bytes(on_device)}; {request.describe()}), more than the budget of {fmt_bytes(self.plan.budget)} "
                f"allows ({fmt_bytes(usable)} after {HEADROOM:.0%} headroom, offload {self.plan.offload}): lower "
                "height, width, num_frames or the number of videos, or raise memory_budget"
            )
        return request

    def share(self, request: RequestMemory):
        """The request's share of the budget beside the weights (composer.memory.admission.MemoryShare)."""
        from composer.memory.admission import MemoryShare

        if self.plan.offload == "model":  # requests run one at a time (a serial pipeline): all of it, held
            return MemoryShare(device_peak(self.predictor, "model", request)[0])
        return MemoryShare.of(request)
