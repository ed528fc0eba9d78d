"""The memory a request needs, predicted before it runs.

Weights come from the folder's safetensors headers (`composer.memory.weights`). Activations come from running the
request through a *twin* of the pipeline: the same pipeline class and stages, built over fake copies of its modules
(`composer.memory.trace`): the text encoder, the denoiser (one step: every step allocates the same), the VAE decode
(whole video, diffusers' tiling, or one streamed block). What each stage leaves alive for the next (embeddings,
latents, a KV cache) is counted as the twin holds it. So the prediction follows the code that runs, for every
family, instead of a formula per architecture.

On the CPU the trace adds what each convolution's kernel holds while it runs (the native kernel's im2col buffer,
oneDNN's copies padded to its channel blocks: composer/memory/cpu_convolution.py). Not modelled: the allocator's
rounding, the kernels' code loaded on first use and the GPU kernels' private workspaces (cuDNN's for a
convolution, an attention kernel's). docs/memory.md gives the measured gaps (on the CPU 1-5% under over narrow and
wide VAEs; on an H200 10-14% under for the Wan VAE's decode), which the planner's headroom covers.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from composer.batch import ForwardBatch
from composer.logging import get_logger, quiet_this_thread
from composer.memory.trace import LiveBytes, fake_mode
from composer.memory.weights import ComponentWeights, component_weights

logger = get_logger(__name__)

TRACED_STEPS = 2  # denoising steps run in the twin (each step allocates the same)
STREAMED_BLOCKS_TRACED = 2  # a causal stream's first blocks run in the twin (its KV cache is allocated whole at once)


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


@dataclass
class StageMemory:
    """One stage of a request: the components it needs on the device and the peak bytes of the tensors it makes
    above what earlier stages left alive (`carried`)."""

    name: str
    components: tuple[str, ...]
    peak: int
    carried: int
    # its transformer calls go through a step scheduler, where concurrent requests' calls are batched: its peak is
    # one call's (composer.memory.admission counts the calls running, not every request's)
    calls: bool = False


@dataclass
class RequestMemory:
    """A request's activations, stage by stage (weights not included)."""

    stages: list[StageMemory] = field(default_factory=list)
    tiled_decode: bool = False
    seconds: float = 0.0  # how long the prediction took

    @property
    def peak(self) -> int:
        return max((s.carried + s.peak for s in self.stages), default=0)

    def describe(self) -> str:
        return ", ".join(f"{s.name.replace('Stage', '')} {fmt_bytes(s.carried + s.peak)}" for s in self.stages
                         if s.carried + s.peak > 0)


def _fake_component(spec, folder: Path, dtype: torch.dtype | None) -> Any:
    """A module built from its folder's config under the active fake mode (no weights read), in `dtype`; None for
    components that are not modules (tokenizers, schedulers, image processors: the real ones are used)."""
    from composer.loader.components import ComponentLoader, ComposerModelLoader

    loader = ComponentLoader.for_spec(spec, folder)
    if isinstance(loader, ComposerModelLoader):
        cls, config = ComposerModelLoader.model_class_and_config(folder, spec)
        module = cls(config)
    elif spec.library == "diffusers" and type(loader).__name__ == "DiffusersModelLoader":
        import diffusers

        cls = getattr(diffusers, spec.class_name)
        module = cls.from_config(cls.load_config(str(folder)))
    elif spec.library == "transformers" and type(loader).__name__ == "TransformersModelLoader":
        import transformers

        cls = getattr(transformers, spec.class_name)
        module = cls(cls.config_class.from_pretrained(str(folder)))
    else:
        return None
    if not isinstance(module, torch.nn.Module):
        return None
    # parameters in the loading dtype (buffers keep theirs, as loading keeps them). The module is built on its
    # device (the caller's torch.device context): a fake tensor's device cannot be changed through .data, and
    # Module.to would swap fake parameters, which it refuses; a dtype can.
    if dtype is not None:
        for param in module.parameters():
            if param.is_floating_point():
                param.data = param.data.to(dtype)
    return module.eval().requires_grad_(False)


def twin_runtime(runtime):
    """The runtime a twin is built with: the request's device, dtypes and attention backend, without the hooks
    that move or change weights (offload, quantization, compile, caches, LoRA): activations are the same. Under a
    parallel layout the twin is one process running the whole request: an upper bound of a rank's share (sequence
    parallel splits the tokens, tensor parallel the weights and heads)."""
    return dataclasses.replace(runtime, offload="none", quantize="none", compile="none", cache="none", lora_path=None,
                               lora_scale=None, progress=False, kv_cache_offload=False, ulysses_degree=1,
                               ring_degree=1, tp_size=1, cfg_parallel=False, num_gpus=None)


class MemoryPredictor:
    """Predicts a pipeline's weights per component and a request's activations per stage (see the module)."""

    def __init__(self, pipeline_cls: type, index: Any, config: Any, runtime: Any):
        self.pipeline_cls = pipeline_cls
        self.index = index
        self.config = config
        self.runtime = runtime
        self.device = runtime.torch_device
        self._twin = None
        self._mode = None
        self._lock = threading.Lock()
        self._cache: dict[tuple, RequestMemory] = {}
        self.weights: dict[str, ComponentWeights] = {}
        for name in pipeline_cls.required_modules:
            folder = index.folder / name
            if not folder.is_dir() or not any(folder.glob("*.safetensors")) and not any(
                    p.suffix in (".bin", ".pt", ".pth") for p in folder.glob("*")):
                continue
            quantize = runtime.quantize if name.startswith("transformer") else "none"
            self.weights[name] = component_weights(folder, name, self._module_dtype(name), quantize)

    def _module_dtype(self, name: str) -> torch.dtype | None:
        """The pipeline class's own rule (`module_dtype`: it reads only the runtime), on an unbuilt instance."""
        if not hasattr(self, "_dtype_rule"):
            self._dtype_rule = self.pipeline_cls.__new__(self.pipeline_cls)
            self._dtype_rule.runtime = self.runtime
        return self._dtype_rule.module_dtype(name)

    # -- the twin ------------------------------------------------------------------------------------
    def twin(self):
        """The pipeline built over fake modules (made once)."""
        if self._twin is None:
            predictor = self

            class Twin(self.pipeline_cls):
                def load_modules(self) -> dict[str, Any]:
                    from composer.loader.components import ComponentLoader

                    modules = {}
                    for name in self.required_modules:
                        spec = self.index.component(name)
                        folder = self.folder / name
                        # fake parameters, made on the device; the rest of the twin is built for real
                        with predictor._mode, torch.device(self.device):
                            module = _fake_component(spec, folder, predictor._module_dtype(name))
                        if module is None:
                            module = ComponentLoader.for_spec(spec, folder).load(folder, spec, self.device, None)
                        modules[name] = module
                    return modules

            Twin.__name__ = f"Twin{self.pipeline_cls.__name__}"
            self._mode = fake_mode()
            with quiet_this_thread():
                self._twin = Twin(self.index, self.config, twin_runtime(self.runtime))
        return self._twin

    # -- requests ------------------------------------------------------------------------------------
    def request(self, batch: ForwardBatch, sampling: Any, segments: Any = None, key: tuple | None = None,
                tiled_decode: bool = False) -> RequestMemory:
        """The activations of the request whose batch is `batch` (a fresh one, as `VideoGenerator` makes it; the
        twin runs it, so it is used up). `key`: requests with equal keys have equal shapes (cached)."""
        full_key = None if key is None else (*key, tiled_decode)
        with self._lock:
            if full_key is not None and full_key in self._cache:
                return self._cache[full_key]
            start = time.perf_counter()
            twin = self.twin()
            result = RequestMemory(tiled_decode=tiled_decode)
            tracker = LiveBytes(self.device)
            block_frames: list[int] = []
            with torch.inference_mode(), quiet_this_thread():
                twin.prepare(batch, sampling, list(segments) if segments is not None else None)
                for stage in twin.stages:
                    components = tuple(n for n, m in twin.modules.items()
                                       if isinstance(m, torch.nn.Module) and any(m is x for x in stage.modules()))
                    carried = tracker.live
                    if not components:  # timesteps, latents, checks: small tensors whose values later code reads
                        if not stage.skips(batch):
                            batch = stage(batch)
                        continue
                    if stage.name != "DecodingStage" and not stage.streams and stage.skips(batch):
                        continue  # a mode this request does not use (video-to-video, TI2V's image): no memory
                    if batch.num_inference_steps and not stage.streams:  # (after the request's checks) every
                        # step allocates alike: two show a multistep solver's history
                        batch.num_inference_steps = min(batch.num_inference_steps, TRACED_STEPS)
                    with self._mode, tracker, tracker.mark() as peak:
                        if stage.name == "DecodingStage":
                            self._decode(twin, stage, batch, tiled_decode, block_frames)
                        elif stage.streams:
                            batch = self._stream(stage, batch, block_frames)
                        elif not stage.skips(batch):
                            batch = stage(batch)
                    calls = not stage.streams and any(n.startswith("transformer") for n in components)
                    result.stages.append(StageMemory(stage.name, components, peak(), carried, calls))
            result.seconds = time.perf_counter() - start
            if full_key is not None:
                self._cache[full_key] = result
            return result

    @staticmethod
    def _decode(twin, stage, batch: ForwardBatch, tiled: bool, block_frames: list[int]) -> None:
        from composer.stages.decoding import StreamingVideoDecoder, video_to_frames

        latents = batch.latents
        if twin.can_stream:  # a stream decodes block by block: one block's decode, its causal cache included
            per_block = block_frames[0] if block_frames else latents.shape[2]
            StreamingVideoDecoder.decode_frames_together([StreamingVideoDecoder(stage.vae)],
                                                         [latents[:, :, :per_block]])
            return
        from composer.stages.vae_tiling import DEFAULT_TILE

        saved = stage.tile_size
        if tiled:
            stage.tile_size = saved or DEFAULT_TILE
        try:
            video_to_frames(stage.decode(latents))
        finally:
            stage.tile_size = saved

    @staticmethod
    def _stream(stage, batch: ForwardBatch, block_frames: list[int]) -> ForwardBatch:
        """A streaming denoiser's first blocks (their KV cache is allocated whole at the start)."""
        from composer.engine.loop import is_wait
        from composer.engine.scheduler import RequestContext, current_request

        blocks = []
        pieces = stage.stream(batch, None)
        try:
            for piece in pieces:
                if is_wait(piece):  # a transformer unit or blocking work: done here, as `drive` does
                    piece.run_here(current_request() or RequestContext())
                elif hasattr(piece, "latents"):
                    blocks.append(piece.latents)
                    if len(blocks) >= STREAMED_BLOCKS_TRACED:
                        break
        finally:
            pieces.close()
        if blocks:
            batch.latents = torch.cat(blocks, dim=2)
            block_frames.append(blocks[0].shape[2])
        return batch
