"""DenoisingStage: text-to-video sampling through the denoising engine (CFG, the folder's scheduler)."""

from __future__ import annotations

import torch

from composer.batch import ForwardBatch
from composer.engine import ClassifierFreeGuidance, DenoisingEngine, ModelInputs, SchedulerSteps, StepRule
from composer.stages.base import Stage
from composer.stages.validators import V, VerificationResult


class DenoisingStage(Stage):
    """For each timestep: the engine predicts (with CFG, prompt and negative prompt: one batched call by
    default), combines `uncond + scale * (cond - uncond)`, and the scheduler steps the fp32 latents."""

    def __init__(self, engine: DenoisingEngine, progress: bool = True):
        self.engine = engine
        self.progress = progress

    def verify_input(self, batch: ForwardBatch, result: VerificationResult) -> None:
        result.add_check("latents", batch.latents, V.ndim(5))
        result.add_check("timesteps", batch.timesteps, V.ndim(1))
        result.add_check("scheduler", batch.scheduler, V.not_none)
        result.add_check("prompt_embeds", batch.prompt_embeds, V.ndim(3))
        if batch.do_classifier_free_guidance:
            result.add_check("negative_prompt_embeds", batch.negative_prompt_embeds, V.ndim(3))

    def verify_output(self, batch: ForwardBatch, result: VerificationResult) -> None:
        result.add_check("latents", batch.latents, V.ndim(5), V.all_finite)

    def steps(self, batch: ForwardBatch) -> StepRule:
        """The steps this stage runs: every timestep of the request's scheduler (a subclass may take some, or
        give the transformer its timesteps in another layout)."""
        return SchedulerSteps(batch.scheduler, batch.timesteps)

    def guidance_scale(self, batch: ForwardBatch) -> float:
        """The CFG scale of this stage's steps (used when the request has CFG: guidance_scale > 1)."""
        return batch.guidance_scale

    def branch_inputs(self, batch: ForwardBatch, text: torch.Tensor) -> ModelInputs:
        """One guidance branch's conditioning, from its text embedding (an image-conditioned stage adds the image)."""
        return self.engine.text_inputs(text)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        steps = self.steps(batch)
        if len(steps.timesteps) == 0:  # a stage with none of the request's timesteps (one expert of two)
            return batch
        dtype = self.engine.transformer.dtype
        cond = self.branch_inputs(batch, batch.prompt_embeds.to(dtype))
        uncond, guidance = None, None
        if batch.do_classifier_free_guidance:
            uncond = self.branch_inputs(batch, batch.negative_prompt_embeds.to(dtype))
            guidance = ClassifierFreeGuidance(self.guidance_scale(batch))
        batch.latents = self.engine.run(batch.latents, steps, cond, uncond, guidance, progress=self.progress)
        return batch
