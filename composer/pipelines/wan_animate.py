"""Wan2.2-Animate (diffusers' `WanAnimatePipeline` folders): a character image animated by a pose video and a face
video (mode animate), or put into a background video where a mask video is white (mode replace), through composer's
Wan Animate DiT (composer/models/wan/animate.py). docs/animate.md.

    validate -> encode text -> encode the character image (CLIP) -> timesteps -> the character's latents and the
    videos' pixels -> every segment: condition (VAE), denoise (CFG), decode (VAE) -> the kept frames

    gen.generate_video("a dancer", image="me.png", pose_video="pose.mp4", face_video="face.mp4")
    composer generate --model-path Wan-AI/Wan2.2-Animate-14B-Diffusers --image me.png --pose-video pose.mp4 ...
"""

from __future__ import annotations

from composer.batch import ForwardBatch
from composer.configs.wan_animate import WanAnimateConfig
from composer.errors import UnsupportedError
from composer.pipelines.wan_i2v import WanImageToVideoPipeline
from composer.stages.animate import AnimateDenoisingStage, AnimateInputs, AnimateReferenceStage
from composer.stages.image_encoding import ImageEncodingStage
from composer.stages.input_validation import InputValidationStage
from composer.stages.text_encoding import TextEncodingStage
from composer.stages.timesteps import TimestepPreparationStage


class WanAnimatePipeline(WanImageToVideoPipeline):
    """The folder of WanImageToVideoPipeline (CLIP image encoder and processor, UMT5, the Wan2.1 VAE, UniPC) with the
    Animate transformer; the flow shift is the folder's scheduler's, the CLIP encoder loads in the text encoder's
    dtype (both as Wan2.1 I2V)."""

    class_names = ("WanAnimatePipeline",)
    config_class = WanAnimateConfig

    def check_supported(self) -> None:
        missing = [name for name in self.required_modules if name not in self.index.components]
        if missing:
            raise UnsupportedError(f"{self.folder} has no {' / '.join(missing)} in model_index.json: a Wan Animate "
                                   "folder has them all (diffusers' WanAnimatePipeline)")
        if self.runtime.cache != "none":
            raise UnsupportedError(f"cache = {self.runtime.cache}: step caching was not fitted nor checked for Wan "
                                   "Animate's segments; run it with cache = none")

    def prepare(self, batch: ForwardBatch, sampling, segments=None, keep_video: bool = True) -> None:
        """The character image as an ImageCondition (Wan2.1 I2V's), the videos and knobs as AnimateInputs."""
        if sampling.pose_video is None and sampling.face_video is None:  # only a memory plan's stand-in request
            raise UnsupportedError("offload = auto / memory_budget: the memory planner has no stand-in pose and face "
                                   "videos for Wan Animate; choose offload = none, model or layerwise")
        super().prepare(batch, sampling, segments, keep_video)
        batch.attach(AnimateInputs.from_request(sampling, self.modules["vae"].config.scale_factor_temporal))

    def create_stages(self) -> None:
        vae, transformer = self.modules["vae"], self.modules["transformer"]
        temporal, spatial = vae.config.scale_factor_temporal, vae.config.scale_factor_spatial
        patch = transformer.config.patch_size
        # num_frames is not used (the pose video's length is the video's, as in diffusers, which has none): any value
        self.add_stage(InputValidationStage(spatial_multiple=spatial * max(patch[1], patch[2]),
                                            temporal_factor=temporal, uses_num_frames=False))
        self.add_stage(TextEncodingStage(self.modules["text_encoder"], self.modules["tokenizer"],
                                         max_length=self.config.text_encoder_max_length,
                                         clean=self.config.clean_prompts))
        self.add_stage(ImageEncodingStage(self.modules["image_encoder"], self.modules["image_processor"]))
        self.add_stage(TimestepPreparationStage(self.modules["scheduler"], self.device))
        self.add_stage(AnimateReferenceStage(vae, transformer.config.motion_encoder_size, self.device))
        self.add_stage(AnimateDenoisingStage(self.make_engine(transformer), vae, progress=self.runtime.progress))


EntryClass = WanAnimatePipeline
