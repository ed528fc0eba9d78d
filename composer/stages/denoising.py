"""DenoisingStage: the sampling loop (classifier-free guidance, the folder's flow-matching scheduler)."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from composer.batch import ForwardBatch
from composer.stages.base import Stage
from composer.stages.validators import V, VerificationResult


class DenoisingStage(Stage):
    """For each timestep: predict with the transformer (twice with CFG: prompt and negative prompt),
    combine `uncond + scale * (cond - uncond)`, and let the scheduler step the fp32 latents."""

    def __init__(self, transformer: torch.nn.Module, progress: bool = True):
        self.transformer = transformer
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

    def predict(self, latents: torch.Tensor, t: torch.Tensor, batch: ForwardBatch, cond, uncond) -> torch.Tensor:
        """The guided model prediction for one step."""
        x = latents.to(self.transformer.dtype)
        timestep = t.expand(latents.shape[0])
        pred = self.transformer(x, timestep, cond)
        if batch.do_classifier_free_guidance:
            pred_uncond = self.transformer(x, timestep, uncond)
            pred = pred_uncond + batch.guidance_scale * (pred - pred_uncond)
        return pred

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        dtype = self.transformer.dtype
        cond = batch.prompt_embeds.to(dtype)
        uncond = batch.negative_prompt_embeds.to(dtype) if batch.do_classifier_free_guidance else None
        latents = batch.latents
        steps = tqdm(batch.timesteps, desc="denoising", unit="step", disable=not self.progress, leave=False)
        for t in steps:
            pred = self.predict(latents, t, batch, cond, uncond)
            latents = batch.scheduler.step(pred, t, latents, return_dict=False)[0]
        batch.latents = latents
        return batch
