"""Test helpers shared by several test modules."""

from __future__ import annotations

import threading
import time
import types
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np
import PIL.Image
import torch
from safetensors.torch import load_file

# diffusers names -> the original Wan release's names, written out independently of composer's mapping table.
DIFFUSERS_TO_ORIGINAL = [
    ("condition_embedder.time_embedder.linear_1.", "time_embedding.0."),
    ("condition_embedder.time_embedder.linear_2.", "time_embedding.2."),
    ("condition_embedder.text_embedder.linear_1.", "text_embedding.0."),
    ("condition_embedder.text_embedder.linear_2.", "text_embedding.2."),
    ("condition_embedder.time_proj.", "time_projection.1."),
    (".attn1.to_out.0.", ".self_attn.o."),
    (".attn2.to_out.0.", ".cross_attn.o."),
    (".attn1.to_", ".self_attn."),
    (".attn2.to_", ".cross_attn."),
    (".attn1.norm_", ".self_attn.norm_"),
    (".attn2.norm_", ".cross_attn.norm_"),
    (".norm2.", ".norm3."),
    (".ffn.net.0.proj.", ".ffn.0."),
    (".ffn.net.2.", ".ffn.2."),
    ("proj_out.", "head.head."),
]


def to_original_name(name: str) -> str:
    if name == "scale_shift_table":
        return "head.modulation"
    if name.endswith(".scale_shift_table"):
        return name.replace(".scale_shift_table", ".modulation")
    for old, new in DIFFUSERS_TO_ORIGINAL:
        name = name.replace(old, new)
    return name


def write_self_forcing_checkpoint(base: Path, path: Path, seed: int = 0, scale: float = 0.05, fsdp: bool = False,
                                  ema: bool = True) -> dict[str, dict[str, torch.Tensor]]:
    """A Self-Forcing-format checkpoint from a tiny Wan folder's transformer, its weights perturbed (so it is
    not the base model), with a critic and, optionally, an EMA copy perturbed differently."""
    base_state = load_file(base / "transformer" / "diffusion_pytorch_model.safetensors")
    g = torch.Generator().manual_seed(seed)
    prefix = "model._fsdp_wrapped_module." if fsdp else "model."

    def perturbed(s: float) -> dict[str, torch.Tensor]:
        return {prefix + to_original_name(k): v + s * torch.randn(v.shape, generator=g) for k, v in base_state.items()}

    raw = {"generator": perturbed(scale), "critic": {"model.dummy": torch.zeros(2)}}
    if ema:
        raw["generator_ema"] = perturbed(scale * 2)
    torch.save(raw, path)
    return raw


# -- tiny Wan-variant families (tests/test_wan_vace.py, tests/test_wan_animate.py) -----------------------------------
def clip_makers(count: int, size: tuple[int, int]) -> tuple[Callable[..., list], Callable[..., list]]:
    """`frames` and `mask` for a test module whose videos are `count` frames of `size` (width, height) unless a call
    says otherwise."""

    def frames(count: int = count, size: tuple[int, int] = size, seed: int = 0) -> list:
        """A seeded pattern moving right, `count` PIL frames of `size` (width, height)."""
        base = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3)).astype(np.uint8)
        return [PIL.Image.fromarray(np.roll(base, 3 * i, axis=1)) for i in range(count)]

    def mask(count: int = count, size: tuple[int, int] = size, mode: str = "L") -> list:
        """Keep the left part, white on the right; a soft edge (grey pixels: not binary before the VAE's 0.5)."""
        column = np.clip((np.arange(size[0]) - size[0] * 0.45) * 255 / (size[0] * 0.1), 0, 255).astype(np.uint8)
        return [PIL.Image.fromarray(np.tile(column, (size[1], 1))).convert(mode) for _ in range(count)]

    return frames, mask


def smooth_image(size: tuple[int, int], seed: int) -> PIL.Image.Image:
    """A smooth seeded image of `size` (width, height): 3 x 4 random pixels scaled up."""
    small = (np.random.default_rng(seed).random((3, 4, 3)) * 255).astype(np.uint8)
    return PIL.Image.fromarray(small).resize(size, PIL.Image.BILINEAR)


def diffusers_wan_pipeline(folder: Path, class_name: str, module_name: str):
    """diffusers' pipeline `class_name` (defined in diffusers.pipelines.wan.`module_name`) from `folder`, progress
    bars off. diffusers calls ftfy even when it is absent (0.42.1); composer skips it then, so a stand-in does too."""
    import importlib

    import diffusers

    module = importlib.import_module(f"diffusers.pipelines.wan.{module_name}")
    if not hasattr(module, "ftfy"):
        module.ftfy = types.SimpleNamespace(fix_text=lambda text: text)
    pipe = getattr(diffusers, class_name).from_pretrained(str(folder))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def perturb_parameters(model: torch.nn.Module, scale: float = 0.05) -> None:
    """Add noise to every parameter (zero-initialised tables and unit norms count too), from torch's global RNG."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)


def transformer_loader(folder: Path, class_name: str) -> Callable[[], torch.nn.Module]:
    """A function loading composer's transformer for diffusers' `class_name` from a saved transformer folder (fp32,
    CPU), reading the folder again on each call (a test edits its config.json between calls)."""
    from composer.loader.components import ComponentLoader
    from composer.loader.model_index import ComponentSpec

    spec = ComponentSpec("transformer", "diffusers", class_name)

    def load() -> torch.nn.Module:
        return ComponentLoader.for_spec(spec, folder).load(folder, spec, torch.device("cpu"), torch.float32)

    return load


def refuse_loading(monkeypatch) -> None:
    """Make building any pipeline fail the test: for requests the up-front check must refuse before loading."""
    from composer.pipelines.base import ComposedPipeline

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded for a request the up-front check should have refused")

    monkeypatch.setattr(ComposedPipeline, "__init__", refuse)


@contextmanager
def held(gen, requests: int, timeout: float = 120.0) -> Iterator[None]:
    """Hold `gen`'s batching (every step scheduler of its pipeline, or a text pipeline's forward batcher) while the
    block starts `requests` requests; at its end wait until a unit of each is queued, then release: their first call
    is shared whatever the threads' timing (a test must not depend on two threads overlapping in time)."""
    pipeline = gen.pipeline
    holders = ([pipeline.batcher] if getattr(pipeline, "batcher", None) is not None
               else [e.scheduler for e in pipeline.engines if e.scheduler is not None])
    with ExitStack() as stack:
        for holder in holders:
            stack.enter_context(holder.held())
        yield
        assert holders[0].wait_for_units(requests, timeout), f"{requests} requests never queued a unit together"


def generate_at_once(gen, requests: list[dict]) -> tuple[dict[int, np.ndarray], list[int]]:
    """Each request's frames, the requests generated at the same time (one thread each, the scheduler held until
    every one has its first step queued, so their first call is shared), and the rows of every transformer call."""
    rows: list[int] = []
    handle = gen.pipeline.modules["transformer"].register_forward_pre_hook(lambda m, a: rows.append(a[0].shape[0]))
    together: dict[int, np.ndarray] = {}
    threads = [threading.Thread(target=lambda i=i: together.update({i: gen.generate_video(**requests[i]).frames}))
               for i in range(len(requests))]
    try:
        with held(gen, len(requests)):
            for t in threads:
                t.start()
        for t in threads:
            t.join()
    finally:
        handle.remove()
    return together, rows


def until(condition: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Wait (up to `timeout`) for a state another thread reaches (an engine core's, a server's); False on timeout."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
