"""DenoisingStage: text-to-video sampling through the denoising engine (CFG, the folder's scheduler)."""

from __future__ import annotations

import torch

from composer.batch import ForwardBatch, PromptExtras
from composer.engine import ClassifierFreeGuidance, DenoisingEngine, SchedulerSteps
from composer.stages.base import Stage
from composer.stages.validators import V, VerificationResult


class DenoisingStage(Stage):
    """For each timestep: the engine predicts (with CFG, prompt and negative prompt: one batched call by
    default), combines `uncond + scale * (cond - uncond)`, and the scheduler steps the fp32 latents. The CFG
    scale is `batch.cfg_scale` (guidance_scale, or true_cfg_scale where guidance is embedded)."""

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

    def _extra(self, batch: ForwardBatch, negative: bool) -> dict[str, torch.Tensor]:
        """A branch's conditioning beyond the text states: the text stage's PromptExtras (mask, pooled vector)
        and the embedded guidance scale, for the families that make them."""
        extra: dict[str, torch.Tensor] = {}
        dtype, device = self.engine.transformer.dtype, batch.latents.device
        found = batch.get(PromptExtras, None)
        if found is not None:
            mask = found.negative_mask if negative else found.mask
            pooled = found.negative_pooled if negative else found.pooled
            if mask is not None:
                extra["text_mask"] = mask.to(device)
            if pooled is not None:
                extra["pooled_text"] = pooled.to(device, dtype)
        if batch.embedded_guidance is not None:
            extra["guidance"] = torch.full((batch.batch_size,), float(batch.embedded_guidance), device=device)
        return extra

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        dtype = self.engine.transformer.dtype
        cond = self.engine.text_inputs(batch.prompt_embeds.to(dtype), **self._extra(batch, negative=False))
        uncond, guidance = None, None
        if batch.do_classifier_free_guidance:
            uncond = self.engine.text_inputs(batch.negative_prompt_embeds.to(dtype), **self._extra(batch, True))
            guidance = ClassifierFreeGuidance(batch.cfg_scale)
        steps = SchedulerSteps(batch.scheduler, batch.timesteps)
        batch.latents = self.engine.run(batch.latents, steps, cond, uncond, guidance, progress=self.progress)
        return batch
