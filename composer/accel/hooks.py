"""The hook phase: `apply_hooks(pipeline)` runs between `load_modules()` and `create_stages()`.

Order (each hook sees what the ones before it made):

    quantize   weight-only int8 / fp8 of the transformer blocks' linear layers (torchao)
    lora       adapters on the transformer(s) (unfused peft layers, or merged into the weights)
    attention  every Attention module on the runtime's backend (`attention_backend`)
    parallel   tensor parallel (the transformer loaded as this rank's slices), sequence parallel (tokens split
               over ranks, attention across them), CFG parallel (guidance branches on two rank groups)
    cache      step caching (teacache, dbcache): steps whose input barely changed reuse the blocks' last residual
    offload    model: components on the device only while their stage runs; layerwise / disk: transformer
               blocks streamed to the device one block ahead
    compile    torch.compile of the transformer(s): each repeated block (regional) or the whole model
    cancel     the running request's CancelToken checked before each repeated block and each step

A hook is a class with `name` and `apply(pipeline) -> str` (what it did, for the log), listed in `HOOKS` with
the condition that turns it on; its position there is its order key. Everything a hook changes is attached with
`composer.attach.attach` (a torch forward hook, an engine hook, a stage scope, an attribute, or a change
with the function that undoes it), inside the hook's own entry of `pipeline.attachments`, so every hook can be
listed and removed (`pipeline.remove_hooks(name)`): the model computes what it computed before the hook
(tests/test_hook_primitive.py). What a hook attaches another way (`engine.add_hook`, a model's `step_cache` slot
set directly) is adopted by `apply_hooks` / `configure_engine` into the hook's entry, so it is removable too;
quantize and tensor parallel change the weights themselves and say so when asked to go ("load again").
Optionally a hook has `from_runtime(runtime)` (its constructor), `load_device(pipeline, module_name,
device) -> device` (where a module loads), `load_module(pipeline, name, folder, spec, dtype)` (load a module
itself, or None for the usual loader) and `configure_engine(engine)` (called for every DenoisingEngine the
pipeline makes). Combinations the hooks cannot serve are refused up front (`check_combination`) with a
ConfigError naming both settings.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from composer.accel.blocks import block_names, repeated_blocks  # noqa: F401 - re-exported
from composer.errors import ConfigError
from composer.logging import get_logger

logger = get_logger(__name__)

__all__ = ["HOOKS", "ORDER", "apply_hooks", "block_names", "enabled_hooks", "repeated_blocks"]


# Application order. A hook's module is imported only when the runtime turns it on (LoRA's pulls in peft).
# (name, module, class, condition); a hook's position is its order key (`ORDER`). `module` may be a function of the
# runtime giving (module, class): the hook a setting picks among a family's (teacache / dbcache, offload / disk).
HOOKS: tuple[tuple[str, Any, str | None, Callable[[Any], bool]], ...] = (
    # first: LoRA's PEFT layers wrap the quantized linears, offload and compile see them
    ("quantize", "composer.accel.quantize", "QuantizeHook", lambda runtime: runtime.quantize != "none"),
    ("lora", "composer.accel.lora", "LoraHook", lambda runtime: bool(runtime.lora_path)),
    # always on: every pipeline resolves its backend here, so the log says which one runs
    ("attention", "composer.accel.attention", "AttentionBackendHook", lambda runtime: True),
    # tensor parallel loads the transformer(s) itself (load_module); sequence / CFG parallel wrap attention and
    # engines: after the backend is chosen, before offload and compile see the modules
    ("parallel", "composer.accel.parallel", "ParallelHook", lambda runtime: _parallel(runtime)),
    # step caching: the model's block loop may reuse a residual; an engine hook plans each loop's skips
    ("cache", lambda runtime: ("composer.accel.dbcache", "DBCacheHook") if runtime.cache == "dbcache"
     else ("composer.accel.step_cache", "StepCacheHook"), None, lambda runtime: runtime.cache != "none"),
    # disk: its own subclass (the transformer loaded with its blocks left on disk)
    ("offload", lambda runtime: ("composer.accel.disk", "DiskOffloadHook") if runtime.offload == "disk"
     else ("composer.accel.offload", "OffloadHook"), None, lambda runtime: runtime.offload != "none"),
    ("compile", "composer.accel.compile", "CompileHook", lambda runtime: runtime.compile != "none"),
    # always on: a request's CancelToken is checked before each block; last, so offload's block hooks run first
    ("cancel", "composer.accel.cancel", "CancelHook", lambda runtime: True),
)

# The order key of each hook: where it is attached among the others on a shared target (a block's forward hooks,
# an engine's hooks, the stage scopes), whatever order they were (re)attached in.
ORDER: dict[str, int] = {name: i for i, (name, *_rest) in enumerate(HOOKS)}

# Hooks that change weights in place with no way back but a reload: removing them is refused with this reason.
IRREVERSIBLE: dict[str, str] = {
    "quantize": "the block linears' weights were replaced by quantized ones (the full-precision weights are gone)",
}


def _parallel(runtime: Any) -> bool:
    return runtime.ulysses_degree * runtime.ring_degree * runtime.tp_size * (2 if runtime.cfg_parallel else 1) > 1


def enabled_hooks(runtime: Any) -> list[Any]:
    """Instances of the hooks the runtime settings turn on, in order."""
    check_combination(runtime)
    hooks = []
    for _, module, name, enabled in HOOKS:
        if enabled(runtime):
            if callable(module):
                module, name = module(runtime)
            cls = getattr(importlib.import_module(module), name)
            hooks.append(cls.from_runtime(runtime) if hasattr(cls, "from_runtime") else cls())
    return hooks


def check_combination(runtime: Any) -> None:
    """Refuse settings that do not work together, before anything loads."""
    if runtime.quantize != "none":
        _check_quantize(runtime)
    if runtime.tp_size > 1 and runtime.offload == "disk":
        raise ConfigError(
            "tp_size > 1 with offload = disk is not supported: tensor parallel reads each rank's slices of the "
            "checkpoint itself; use offload = layerwise (or no offload: each rank holds 1/tp of the weights)"
        )
    if runtime.lora_path and runtime.offload == "disk":
        raise ConfigError(
            "lora_path with offload = disk is not supported: the disk tier streams the transformer's blocks "
            "straight from the checkpoint, so adapters cannot be added to them; use offload = layerwise"
        )


def _check_quantize(runtime: Any) -> None:
    from composer.accel.quantize import check_supported

    q = f"quantize = {runtime.quantize}"
    if runtime.lora_path and runtime.lora_fuse:
        raise ConfigError(f"lora_fuse with {q} is not supported: merging a LoRA into quantized weights would "
                          "re-quantize them (another model); use unfused LoRA (lora_fuse off), which runs beside "
                          "the quantized layers")
    if runtime.offload == "disk":
        raise ConfigError(f"{q} with offload = disk is not supported: the disk tier streams the blocks' full "
                          "weights from the checkpoint; use offload = layerwise")
    if runtime.tp_size > 1:
        raise ConfigError(f"{q} with tp_size > 1 is not supported: tensor parallel slices the linears itself; "
                          "use sequence parallel (ulysses_degree / ring_degree) or no quantization")
    check_supported(runtime)


def order_key(hook: Any) -> float:
    """A hook's order key: its place in HOOKS (a hook not listed there: after them all)."""
    return float(ORDER.get(getattr(hook, "name", None), len(HOOKS)))


def apply_hooks(pipeline: Any, hooks: list[Any]) -> list[str]:
    """Apply `hooks` to a loaded pipeline in order, each inside its own entry of `pipeline.attachments`; returns
    (and logs) one line per hook."""
    from composer.attach import Handle, attaching

    lines = []
    for hook in hooks:
        entry = pipeline.attachments.add(hook.name, order_key(hook), hook)
        slots = _runner_slots(pipeline)
        with attaching(entry):
            line = hook.apply(pipeline)
            _adopt_slots(pipeline, slots)
        if hook.name in IRREVERSIBLE:
            entry.parts.append(Handle(f"{hook.name}: {IRREVERSIBLE[hook.name]}", None, entry.order))
        entry.line = line
        lines.append(f"{hook.name}: {line}")
        logger.info("hook %s: %s", hook.name, line)
    return lines


def configure_engine(pipeline: Any, engine: Any) -> None:
    """Let every attached hook configure a new denoising engine, inside the hook's entry: what it attaches is
    removed with it. Engine hooks it added with `engine.add_hook` (not through `attach`) are adopted: moved to
    their order key's place and recorded."""
    from composer.attach import LAST, attach, attaching, order_of

    for entry in pipeline.attachments:
        hook = entry.hook
        if hook is None or not hasattr(hook, "configure_engine"):
            continue
        before = {id(h) for h in engine.hooks}
        with attaching(entry):
            hook.configure_engine(engine)
            for added in [h for h in engine.hooks if id(h) not in before and order_of(h) == LAST]:
                engine.hooks.remove(added)
                attach(engine, added, what=f"engine hook {type(added).__name__}")


_SLOTS = ("step_cache",)  # a model's block-runner slots a hook may fill directly


def _runner_slots(pipeline: Any) -> dict[tuple[int, str], Any]:
    return {(id(model), slot): (model, getattr(model, slot))
            for model in pipeline.denoisers().values() for slot in _SLOTS if hasattr(type(model), slot)}


def _adopt_slots(pipeline: Any, before: dict[tuple[int, str], Any]) -> None:
    """Record a block-runner slot a hook filled directly (not through `attach`), so removing the hook empties it."""
    from composer.attach import attach

    for (_, slot), (model, old) in before.items():
        if getattr(model, slot) is not old:
            attach(undo=lambda model=model, slot=slot, old=old: setattr(model, slot, old),
                   what=f"{type(model).__name__}.{slot}")
