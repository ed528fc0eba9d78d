"""DiffusionGemma text generation: diffusers' DiffusionGemmaPipeline folders (model, processor, scheduler) as
composer's text pipeline: chat template -> canvas denoising (composer/text/canvas.py) -> detokenize."""

from __future__ import annotations

from typing import Any

from composer.configs.diffusion_gemma import DiffusionGemmaConfig
from composer.text.canvas import CanvasDenoisingStage, ChatTokenizationStage
from composer.text.pipeline import DetokenizeStage, TextPipeline


class DiffusionGemmaTextPipeline(TextPipeline):
    """The folder's `model` is transformers' DiffusionGemmaForBlockDiffusion; its `processor` (or a tokenizer) applies
    the chat template; its scheduler commits and renoises each step."""

    class_names = ("DiffusionGemmaPipeline",)
    config_class = DiffusionGemmaConfig
    required_modules = ("model", "processor", "scheduler")
    strategies = ("exact",)  # the canvas loop takes no decoding strategy

    @staticmethod
    def check_runtime(index: Any, runtime: Any) -> None:
        """As every text pipeline's, and a transformers that has DiffusionGemma (checked before anything loads)."""
        TextPipeline.check_runtime(index, runtime)
        import transformers

        if getattr(transformers, "DiffusionGemmaForBlockDiffusion", None) is None:
            from composer.errors import UnsupportedError

            raise UnsupportedError(f"DiffusionGemma needs a transformers that has DiffusionGemmaForBlockDiffusion "
                                   f"(5.23 and 5.24 tested); this one is {transformers.__version__}: "
                                   "pip install -U transformers")

    @property
    def tokenizer(self) -> Any:
        processor = self.modules["processor"]
        return getattr(processor, "tokenizer", processor)

    def create_stages(self) -> None:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self.batcher = None
        self.add_stage(ChatTokenizationStage(self.modules["processor"], self.limits))
        self.add_stage(CanvasDenoisingStage(self.modules["model"], self.modules["scheduler"], eos, self.device))
        self.add_stage(DetokenizeStage(self.tokenizer, eos))


EntryClass = DiffusionGemmaTextPipeline
