"""DenoisingStage: text-to-video sampling through the denoising engine (CFG, the folder's scheduler)."""

from __future__ import annotations

import dataclasses

import torch

from composer.batch import ForwardBatch, GuidanceSettings, PromptExtras
from composer.engine import ClassifierFreeGuidance, DenoisingEngine, ModelInputs, SchedulerSteps, StepRule
from composer.engine.loop import drive
from composer.engine.scheduler import current_request
from composer.stages.base import Stage, drives_task
from composer.stages.validators import V, VerificationResult


class DenoisingStage(Stage):
    """For each timestep: the engine predicts (with CFG, prompt and negative prompt: one batched call by
    default), combines `uncond + scale * (cond - uncond)`, and the scheduler steps the fp32 latents. The CFG
    scale is `batch.cfg_scale` (guidance_scale, or true_cfg_scale where guidance is embedded)."""

    concurrent = True  # transformer calls go through the engine's step scheduler

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
        """The CFG scale of this stage's steps (used when the request has CFG): `batch.cfg_scale`, i.e.
        guidance_scale, or true_cfg_scale for a family whose guidance_scale is embedded."""
        return batch.cfg_scale

    def guidance(self, batch: ForwardBatch) -> ClassifierFreeGuidance:
        """How the branches combine, for a request with CFG: `guidance_scale(batch)`, with the request's
        GuidanceSettings where its family attached them (rescale, a window of steps)."""
        settings = batch.get(GuidanceSettings, None)
        extra = {} if settings is None else dataclasses.asdict(settings)
        return ClassifierFreeGuidance(self.guidance_scale(batch), **extra)

    def branch_inputs(self, batch: ForwardBatch, text: torch.Tensor) -> ModelInputs:
        """One guidance branch's conditioning, from its text embedding (an image-conditioned stage adds the image)."""
        return self.engine.text_inputs(text)

    def _with_extra(self, inputs: ModelInputs, batch: ForwardBatch, negative: bool) -> ModelInputs:
        """A branch's conditioning beyond the text states: the text stage's PromptExtras (mask, pooled vector)
        and the embedded guidance scale, for the families that make them."""
        extra: dict[str, torch.Tensor] = {}
        dtype, device = self.engine.transformer.dtype, batch.latents.device
        found = batch.get(PromptExtras, None)
        if found is not None:
            mask = found.negative_mask if negative else found.mask
            pooled = found.negative_pooled if negative else found.pooled
            text_2 = found.negative_text_2 if negative else found.text_2
            mask_2 = found.negative_mask_2 if negative else found.mask_2
            if mask is not None:
                extra["text_mask"] = mask.to(device)
            if pooled is not None:
                extra["pooled_text"] = pooled.to(device, dtype)
            if text_2 is not None:
                extra["text_2"] = text_2.to(device, dtype)
            if mask_2 is not None:
                extra["text_mask_2"] = mask_2.to(device)
        if batch.embedded_guidance is not None:
            extra["guidance"] = torch.full((batch.batch_size,), float(batch.embedded_guidance), device=device)
        return dataclasses.replace(inputs, **extra) if extra else inputs

    @drives_task
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        return drive(self.forward_task(batch))

    @torch.inference_mode()  # torch enters it around each resumption of the generator
    def forward_task(self, batch: ForwardBatch):
        """`forward` as a task: yields each step's transformer unit (composer/engine/loop.py)."""
        steps = self.steps(batch)
        if len(steps.timesteps) == 0:  # a stage with none of the request's timesteps (one expert of two)
            return batch
        dtype = self.engine.transformer.dtype
        cond = self._with_extra(self.branch_inputs(batch, batch.prompt_embeds.to(dtype)), batch, negative=False)
        uncond, guidance = None, None
        if batch.do_classifier_free_guidance:
            uncond = self._with_extra(self.branch_inputs(batch, batch.negative_prompt_embeds.to(dtype)), batch,
                                      negative=True)
            guidance = self.guidance(batch)
        request = current_request()
        progress = self.progress and not (request is not None and request.background)
        batch.latents = yield from self.engine.run_task(batch.latents, steps, cond, uncond, guidance,
                                                        progress=progress)
        return batch
