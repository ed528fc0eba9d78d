"""Two-expert denoising (Wan2.2 A14B): a high-noise expert for the leading timesteps, a low-noise one after.

The boundary timestep is `boundary_ratio * num_train_timesteps`: timesteps t >= boundary go to the high-noise
expert (`transformer`), the others to the low-noise one (`transformer_2`), each with its own CFG scale
(`guidance_scale`, `guidance_scale_2`), as diffusers' WanPipeline does. Each expert is its own stage over its own
denoising engine, so hooks see two plain loops (a step cache per expert) and `offload = model` has only the
running expert on the device; the request's scheduler (in the batch) carries its state from one to the next.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from composer.batch import ForwardBatch
from composer.engine import DenoisingEngine, SchedulerSteps
from composer.errors import InvalidInputError
from composer.stages.denoising import DenoisingStage


@dataclass(frozen=True)
class ExpertGuidance:
    """Request state: the low-noise expert's CFG scale (`guidance_scale_2`; the high-noise one uses
    `guidance_scale`). Used when the request has CFG at all (guidance_scale > 1), as in diffusers."""

    guidance_scale_2: float


def expert_switch_index(timesteps: torch.Tensor, boundary: float) -> int:
    """How many leading timesteps belong to the high-noise expert (t >= boundary). One host read of the
    schedule per request (the step loop reads each timestep anyway)."""
    values = [float(t) for t in timesteps.detach().cpu()]
    switch = next((i for i, t in enumerate(values) if t < boundary), len(values))
    if any(t >= boundary for t in values[switch:]):
        raise InvalidInputError(f"the schedule's timesteps {values} are not decreasing across the experts' "
                                f"boundary {boundary}: the high-noise expert would run after the low-noise one")
    return switch


class ExpertDenoisingStage(DenoisingStage):
    """The steps of one expert: the high-noise expert's (`high_noise=True`: t >= boundary) or the low-noise
    expert's (t < boundary, CFG scale from the request's ExpertGuidance). Named after its component."""

    def __init__(self, engine: DenoisingEngine, expert: str, boundary: float, high_noise: bool,
                 progress: bool = True):
        super().__init__(engine, progress)
        self.expert = expert
        self.boundary = boundary
        self.high_noise = high_noise

    @property
    def name(self) -> str:
        return f"DenoisingStage({self.expert})"

    def steps(self, batch: ForwardBatch) -> SchedulerSteps:
        switch = expert_switch_index(batch.timesteps, self.boundary)
        mine = batch.timesteps[:switch] if self.high_noise else batch.timesteps[switch:]
        return SchedulerSteps(batch.scheduler, mine)

    def skips(self, batch: ForwardBatch) -> bool:
        return len(self.steps(batch).timesteps) == 0

    def guidance_scale(self, batch: ForwardBatch) -> float:
        if self.high_noise:
            return batch.guidance_scale
        return batch.get(ExpertGuidance).guidance_scale_2
