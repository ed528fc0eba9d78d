"""HunyuanVideo text-to-video: Llama (chat template) + CLIP text encoders, composer's HunyuanVideo DiT with
embedded guidance, the causal 3D VAE, the folder's flow-matching Euler scheduler."""

from __future__ import annotations

from typing import Any

import numpy as np

from composer.batch import EmbeddedGuidance, ForwardBatch
from composer.configs.hunyuan_video import HunyuanVideoConfig
from composer.errors import InvalidInputError
from composer.logging import get_logger, log_once
from composer.pipelines.base import ComposedPipeline
from composer.stages.decoding import DecodingStage
from composer.stages.denoising import DenoisingStage
from composer.stages.input_validation import InputValidationStage
from composer.stages.latents import LatentPreparationStage
from composer.stages.template_text_encoding import TemplateTextEncodingStage
from composer.stages.timesteps import TimestepPreparationStage, folder_flow_shift
from composer.stages.validators import V

logger = get_logger(__name__)


def linear_sigmas(num_steps: int) -> np.ndarray:
    """The reference pipeline's sigmas before the scheduler's shift: linspace(1, 0, n + 1) without the final 0."""
    return np.linspace(1.0, 0.0, num_steps + 1)[:-1]


class HunyuanVideoPipeline(ComposedPipeline):
    """validate -> encode text (Llama template + CLIP pooled) -> timesteps -> noise -> denoise (embedded guidance;
    true CFG with a negative prompt when true_cfg_scale > 1) -> decode."""

    class_names = ("HunyuanVideoPipeline",)
    config_class = HunyuanVideoConfig
    required_modules = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "vae", "transformer",
                        "scheduler")

    def sampling_defaults(self) -> dict[str, Any]:
        """The folder's scheduler shift is the default flow_shift (the family's 7.0 fills in where it states none)."""
        return folder_flow_shift(self.folder, self.modules["scheduler"])

    def prepare(self, batch: ForwardBatch, sampling, segments=None, keep_video: bool = True) -> None:
        super().prepare(batch, sampling, segments, keep_video)
        scale = sampling.true_cfg_scale
        if not V.non_negative_number(scale):  # check_request says so first; a second line for direct callers
            raise InvalidInputError(f"true_cfg_scale = {scale!r}: expected a finite number >= 0 (> 1 turns on "
                                    "classifier-free guidance with negative_prompt)")
        batch.attach(EmbeddedGuidance(true_cfg_scale=float(scale)))
        if batch.negative_prompt is not None and scale <= 1:
            log_once(logger, "hunyuan-negative-ignored", f"negative_prompt is ignored: true_cfg_scale = {scale} "
                     "(<= 1); HunyuanVideo's guidance_scale is embedded guidance, set true_cfg_scale > 1 for CFG")

    def create_stages(self) -> None:
        vae, transformer = self.modules["vae"], self.modules["transformer"]
        temporal, spatial = vae.temporal_compression_ratio, vae.spatial_compression_ratio
        config = self.config
        self.add_stage(InputValidationStage(spatial_multiple=spatial * transformer.config.patch_size,
                                            temporal_factor=temporal))
        self.add_stage(TemplateTextEncodingStage(
            self.modules["text_encoder"], self.modules["tokenizer"], self.modules["text_encoder_2"],
            self.modules["tokenizer_2"], template=config.prompt_template, max_length=config.text_encoder_max_length,
            crop_start=config.prompt_template_crop_start, hidden_layers_to_skip=config.num_hidden_layers_to_skip,
            max_length_2=config.text_encoder_2_max_length,
        ))
        self.add_stage(TimestepPreparationStage(self.modules["scheduler"], self.device, sigmas=linear_sigmas))
        self.add_stage(LatentPreparationStage(transformer.config.in_channels, temporal, spatial, self.device))
        self.add_stage(DenoisingStage(self.make_engine(transformer), progress=self.runtime.progress))
        self.add_stage(DecodingStage(vae))


EntryClass = HunyuanVideoPipeline
