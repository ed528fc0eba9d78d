"""ComposedPipeline: loads a model folder's modules and runs an ordered list of stages over a ForwardBatch."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from composer.batch import ForwardBatch
from composer.configs.base import PipelineConfig
from composer.errors import UnsupportedError
from composer.loader.components import ComponentLoader
from composer.loader.model_index import ModelIndex
from composer.logging import get_logger
from composer.models.attention import set_attention_backend
from composer.runtime import RuntimeArgs
from composer.stages.base import Stage

logger = get_logger(__name__)


class ComposedPipeline:
    """Subclasses set `class_names` (model_index `_class_name`s served) and `required_modules`, and build
    their stages in `create_stages()` with `add_stage`."""

    class_names: tuple[str, ...] = ()
    required_modules: tuple[str, ...] = ()
    config_class: type[PipelineConfig] = PipelineConfig  # families whose config is not one are never picked

    def __init__(self, index: ModelIndex, config: PipelineConfig, runtime: RuntimeArgs):
        self.index = index
        self.folder: Path = index.folder
        self.config = config.updated_from_folder(index.extra)  # a folder may set its pipeline's settings
        self.runtime = runtime
        self.device = runtime.torch_device
        self.check_supported()
        self.modules: dict[str, Any] = self.load_modules()
        self.stages: list[Stage] = []
        self.create_stages()

    # -- loading -------------------------------------------------------------------------------------
    def check_supported(self) -> None:
        """Refuse folders this pipeline class recognises but cannot run (raise UnsupportedError)."""

    def module_dtype(self, name: str) -> torch.dtype | None:
        """The dtype a module loads in: the text encoder and VAE have their own runtime knobs."""
        if name == "vae":
            return self.runtime.vae_torch_dtype
        if name.startswith("text_encoder"):
            return self.runtime.text_encoder_torch_dtype
        if name.startswith("transformer"):
            return self.runtime.torch_dtype
        return None

    def load_modules(self) -> dict[str, Any]:
        modules = {}
        for name in self.required_modules:
            spec = self.index.component(name)
            folder = self.folder / name
            start = time.perf_counter()
            loader = ComponentLoader.for_spec(spec, folder)
            modules[name] = loader.load(folder, spec, self.device, self.module_dtype(name))
            if isinstance(modules[name], torch.nn.Module):
                set_attention_backend(modules[name], self.runtime.attention_backend)
            logger.info("loaded %s (%s) in %.1f s", name, type(modules[name]).__name__, time.perf_counter() - start)
        return modules

    # -- requests ------------------------------------------------------------------------------------
    def sampling_defaults(self) -> dict[str, Any]:
        """Sampling defaults the model folder itself states, applied over the family's SamplingParam (a None
        clears the family's value: the folder fixes that setting)."""
        return {}

    def prepare(self, batch: ForwardBatch, sampling, segments=None, keep_video: bool = True) -> None:
        """Fill family-specific request state into `batch.extra` before the stages run."""
        if segments is not None:
            raise UnsupportedError(f"{type(self).__name__} does not take prompt segments (a causal model does)")

    def stream(self, batch: ForwardBatch) -> Iterator:
        """Yield frames as they are made. Only pipelines that generate incrementally can."""
        raise UnsupportedError(
            f"{type(self).__name__} makes the whole video at once and cannot stream; causal (block-autoregressive) "
            "models can"
        )

    # -- stages --------------------------------------------------------------------------------------
    def create_stages(self) -> None:
        raise NotImplementedError

    def add_stage(self, stage: Stage) -> None:
        stage.check_values = self.runtime.verify_values
        self.stages.append(stage)

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"no stage {name} in {type(self).__name__} (stages: {[s.name for s in self.stages]})")

    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        for stage in self.stages:
            batch = stage(batch)
        return batch

    def __repr__(self) -> str:
        stages = " -> ".join(s.name for s in self.stages)
        return f"{type(self).__name__}({self.folder}, stages: {stages})"

