"""InputValidationStage: the model's numbers for the request check, and its invariants asserted before any work.

A user's request is checked once, at submit (composer.request_check.check_request, with these numbers through
ModelLimits.from_pipeline); this stage asserts what that check established (StageInvariantError, naming the stage
and the field), so a request that skipped it cannot reach the weights."""

from __future__ import annotations

from composer.batch import ForwardBatch
from composer.stages.base import Stage
from composer.stages.validators import V, VerificationResult


def _nearest_multiple(value: object, n: int) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return f"nearest valid: {max(n, round(value / n) * n)}"
    return ""


class InputValidationStage(Stage):
    """Holds the model's constraints (read by ModelLimits.from_pipeline for the request check) and asserts a
    request's prompt, size, frame count, steps, guidance and seed meet them.

    `spatial_multiple`: VAE spatial factor x DiT patch size (16 for Wan); `temporal_factor`: the VAE's
    temporal compression (num_frames must be temporal_factor*k + 1). `uses_num_frames` False: the video's length is an
    input video's (Wan Animate's pose video), num_frames is not used and not checked.
    """

    def __init__(
        self,
        spatial_multiple: int,
        temporal_factor: int,
        supports_cfg: bool = True,
        fixed_steps: int | None = None,
        supports_flow_shift: bool = True,
        uses_num_frames: bool = True,
    ):
        self.uses_num_frames = uses_num_frames
        self.spatial_multiple = spatial_multiple
        self.temporal_factor = temporal_factor
        self.supports_cfg = supports_cfg
        self.fixed_steps = fixed_steps
        self.supports_flow_shift = supports_flow_shift

    def verify_input(self, batch: ForwardBatch, result: VerificationResult) -> None:
        n, t = self.spatial_multiple, self.temporal_factor
        result.add_check("prompt", batch.prompt, V.non_empty_strings)
        if batch.negative_prompt is not None:
            negative = batch.negative_prompt
            if not isinstance(negative, list) or len(negative) != batch.batch_size or not all(
                isinstance(s, str) for s in negative
            ):
                result.add_failure("negative_prompt", negative, f"{batch.batch_size} string(s), one per prompt")
        result.add_check("height", batch.height, V.divisible_by(n), hint=_nearest_multiple(batch.height, n))
        result.add_check("width", batch.width, V.divisible_by(n), hint=_nearest_multiple(batch.width, n))
        frames = batch.num_frames
        frames_hint = (
            f"nearest valid: {max(1, round((frames - 1) / t) * t + 1)}"
            if isinstance(frames, int) and not isinstance(frames, bool)
            else ""
        )
        if self.uses_num_frames:
            result.add_check("num_frames", frames, V.congruent(t, 1), hint=frames_hint)
        if self.fixed_steps is None:
            result.add_check("num_inference_steps", batch.num_inference_steps, V.positive_int)
        elif batch.num_inference_steps != self.fixed_steps:
            result.add_failure(
                "num_inference_steps", batch.num_inference_steps,
                f"{self.fixed_steps} (this model is distilled for its own {self.fixed_steps}-step schedule)",
            )
        result.add_check("guidance_scale", batch.guidance_scale, V.non_negative_number)
        if not self.supports_cfg and isinstance(batch.guidance_scale, (int, float)) and batch.guidance_scale > 1:
            result.add_failure(
                "guidance_scale", batch.guidance_scale, "<= 1 (this model makes one forward per step: no CFG)"
            )
        if batch.flow_shift is not None:
            if self.supports_flow_shift:
                result.add_check("flow_shift", batch.flow_shift, V.positive_number)
            else:
                result.add_failure("flow_shift", batch.flow_shift, "unset (the model folder fixes the schedule's shift)")
        # every row's seed (seed + i) must be a valid generator seed (the request check counts the rows)
        result.add_check("seed", batch.seed, V.int_in_range(0, 2**63 - max(1, batch.batch_size)))

    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        return batch
