"""HunyuanVideo-1.5 text- and image-to-video: Qwen2.5-VL (chat template) + ByT5 (quoted text) text encoders,
composer's HunyuanVideo-1.5 DiT, the 16x VAE, the folder's flow-matching Euler scheduler and its guider's CFG
settings; image-to-video adds the first frame's SigLIP states and its latents as the condition."""

from __future__ import annotations

from typing import Any

from composer._fields import json_field_problems
from composer.batch import ForwardBatch, GuidanceSettings
from composer.configs.hunyuan_video15 import HunyuanVideo15Config, HunyuanVideo15I2VConfig
from composer.errors import InvalidInputError, ModelFormatError, UnsupportedError
from composer.loader.components import read_config_file
from composer.pipelines.base import ComposedPipeline
from composer.pipelines.hunyuan_video import linear_sigmas
from composer.stages.chat_text_encoding import ChatTextEncodingStage
from composer.stages.denoising import DenoisingStage
from composer.stages.first_frame_condition import FirstFrameConditionStage, FirstFrameStatesStage
from composer.stages.image_denoising import ImageToVideoDenoisingStage
from composer.stages.image_encoding import ImageCondition
from composer.stages.input_validation import InputValidationStage
from composer.stages.latents import LatentPreparationStage
from composer.stages.row_decoding import RowDecodingStage
from composer.stages.timesteps import TimestepPreparationStage, folder_flow_shift

# The guider settings composer applies, with their types (diffusers' ClassifierFreeGuidance's arguments).
GUIDER_FIELDS = {"guidance_scale": float, "guidance_rescale": float, "use_original_formulation": bool,
                 "start": float, "stop": float, "enabled": bool}


def default_size(target_size: int, spatial: int, aspect: tuple[int, int] = (9, 16)) -> tuple[int, int]:
    """(height, width) the reference pipeline makes without a size: of the buckets of about target_size^2 pixels in
    multiples of `spatial` (aspect ratios up to 4:1), the closest to `aspect` (height, width) on its side of square."""
    patches = round((target_size / spatial) ** 2)
    buckets, wide, high = [], patches, 1
    while wide > 0:
        if max(wide, high) / min(wide, high) <= 4.0:
            buckets.append((wide * spatial, high * spatial))
        if (high + 1) * wide <= patches:
            high += 1
        else:
            wide -= 1
    wanted = aspect[0] / aspect[1]
    ratios = [round(h / w, 5) - wanted for h, w in buckets]
    candidates = [i for i, r in enumerate(ratios) if (r <= 0 if wanted >= 1 else r >= 0)]
    return buckets[min(candidates, key=lambda i: abs(ratios[i]))]


class HunyuanVideo15Pipeline(ComposedPipeline):
    """validate -> encode text (Qwen2.5-VL chat template + ByT5 glyphs) -> timesteps -> noise -> denoise (CFG with the
    guider's settings) -> decode."""

    class_names = ("HunyuanVideo15Pipeline",)
    config_class = HunyuanVideo15Config
    required_modules = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2", "vae", "transformer",
                        "scheduler")

    def check_supported(self) -> None:
        self.guider = self.read_guider()

    def read_guider(self) -> dict[str, Any]:
        """The folder's guider settings (`guider/guider_config.json`: diffusers' ClassifierFreeGuidance), {} without
        one; a guider composer does not run is refused before anything loads."""
        if "guider" not in self.index.components:
            return {}
        spec = self.index.component("guider")
        if spec.class_name != "ClassifierFreeGuidance":
            raise UnsupportedError(f"{self.folder}: guider {spec.class_name}: composer runs HunyuanVideo-1.5 with "
                                   "diffusers' ClassifierFreeGuidance only")
        path = self.folder / "guider" / "guider_config.json"
        raw = read_config_file(path) if path.is_file() else {}
        problems = json_field_problems(raw, GUIDER_FIELDS)
        if problems:
            raise ModelFormatError(f"{path}: {'; '.join(problems)}")
        if raw.get("use_original_formulation"):
            raise UnsupportedError(f"{path}: use_original_formulation = true: composer's guidance is uncond + "
                                   "scale x (cond - uncond) (diffusers' default formulation)")
        return {k: v for k, v in raw.items() if k in GUIDER_FIELDS}

    def sampling_defaults(self) -> dict[str, Any]:
        """What the folder states: the scheduler's shift, the guider's scale (1: CFG off, for a disabled guider) and
        rescale, and the size the reference makes from the transformer's target_size."""
        defaults = folder_flow_shift(self.folder, self.modules["scheduler"])
        if not self.guider.get("enabled", True):
            defaults["guidance_scale"] = 1.0
        elif self.guider.get("guidance_scale") is not None:
            defaults["guidance_scale"] = self.guider["guidance_scale"]
        if self.guider.get("guidance_rescale") is not None:
            defaults["guidance_rescale"] = self.guider["guidance_rescale"]
        stated = read_config_file(self.folder / "transformer" / "config.json")
        if stated.get("target_size"):
            spatial = self.modules["vae"].spatial_compression_ratio
            defaults["height"], defaults["width"] = default_size(int(stated["target_size"]), spatial)
        return defaults

    def prepare(self, batch: ForwardBatch, sampling, segments=None, keep_video: bool = True) -> None:
        super().prepare(batch, sampling, segments, keep_video)
        rescale = sampling.guidance_rescale
        if not (isinstance(rescale, (int, float)) and 0 <= rescale <= 1):  # check_request says so first
            raise InvalidInputError(f"guidance_rescale = {rescale!r}: expected a number in [0, 1]")
        batch.attach(GuidanceSettings(rescale=float(rescale), start=float(self.guider.get("start", 0.0)),
                                      stop=float(self.guider.get("stop", 1.0))))

    def create_stages(self) -> None:
        self.add_preparation_stages()
        transformer = self.modules["transformer"]
        self.add_stage(DenoisingStage(self.make_engine(transformer), progress=self.runtime.progress))
        self.add_stage(RowDecodingStage(self.modules["vae"]))  # its VAE decodes one video at a time

    def add_preparation_stages(self) -> None:
        """validate -> encode text -> timesteps -> noise."""
        vae, transformer = self.modules["vae"], self.modules["transformer"]
        temporal, spatial = vae.temporal_compression_ratio, vae.spatial_compression_ratio
        config = self.config
        self.add_stage(InputValidationStage(spatial_multiple=spatial * transformer.config.patch_size,
                                            temporal_factor=temporal))
        self.add_stage(ChatTextEncodingStage(
            self.modules["text_encoder"], self.modules["tokenizer"], self.modules["text_encoder_2"],
            self.modules["tokenizer_2"], system_message=config.system_message,
            max_length=config.text_encoder_max_length, crop_start=config.prompt_template_crop_start,
            hidden_layers_to_skip=config.num_hidden_layers_to_skip, glyph_max_length=config.glyph_max_length,
        ))
        self.add_stage(TimestepPreparationStage(self.modules["scheduler"], self.device, sigmas=linear_sigmas))
        # the noisy latents only: the transformer adds text-to-video's zero condition channels
        self.add_stage(LatentPreparationStage(transformer.config.out_channels, temporal, spatial, self.device))


class HunyuanVideo15ImageToVideoPipeline(HunyuanVideo15Pipeline):
    """validate -> encode text -> timesteps -> noise -> the first frame's SigLIP states and latents -> denoise (CFG
    with the guider's settings; the image states and the condition in both branches) -> decode."""

    class_names = ("HunyuanVideo15ImageToVideoPipeline",)
    config_class = HunyuanVideo15I2VConfig
    required_modules = (*HunyuanVideo15Pipeline.required_modules, "image_encoder", "feature_extractor")

    def check_supported(self) -> None:
        super().check_supported()
        stated = read_config_file(self.folder / "transformer" / "config.json")
        if stated.get("use_meanflow"):
            raise UnsupportedError(f"{self.folder}: use_meanflow = true (a MeanFlow step-distilled checkpoint): its "
                                   "image-to-video steps also take the next step's timestep, which composer's engine "
                                   "does not pass yet")

    def prepare(self, batch: ForwardBatch, sampling, segments=None, keep_video: bool = True) -> None:
        super().prepare(batch, sampling, segments, keep_video)
        batch.attach(ImageCondition.from_request(sampling, takes_last_image=False))

    def create_stages(self) -> None:
        self.add_preparation_stages()
        vae, transformer = self.modules["vae"], self.modules["transformer"]
        temporal, spatial = vae.temporal_compression_ratio, vae.spatial_compression_ratio
        self.add_stage(FirstFrameStatesStage(self.modules["image_encoder"], self.modules["feature_extractor"]))
        self.add_stage(FirstFrameConditionStage(vae, temporal, spatial, self.device))
        self.add_stage(ImageToVideoDenoisingStage(self.make_engine(transformer), progress=self.runtime.progress))
        self.add_stage(RowDecodingStage(vae))


EntryClass = [HunyuanVideo15Pipeline, HunyuanVideo15ImageToVideoPipeline]
