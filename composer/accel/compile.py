"""torch.compile hook (`compile = regional | full`, `compile_mode`).

- regional: each repeated transformer block's `forward` is compiled. The blocks share one code object and
  dynamo treats their parameters as inputs (torch's default `inline_inbuilt_nn_modules`), so the block is
  compiled once and every block reuses it: compile time does not grow with depth.
- full: the transformer's whole `forward`.

Only `forward` is compiled, never `__call__`, so module hooks (layerwise offload, LoRA layers' own logic is
inside forward and compiles) stay outside the graph. The KV cache's bookkeeping is excluded from graphs (see
composer/cache/kv_cache.py), so causal blocks compile too. Compilation happens on the first video of a size;
later steps and videos of that size reuse it.

The compiled `forward` is an attribute set on the module through `composer.attach`: removing the hook takes
it away (the class's eager `forward` shows again). A LoRA swap that keeps the layers (same layers and ranks:
composer/accel/lora.py's hotswap) writes into the same tensors and keeps the graphs (the same Python scale too:
a layer's scaling is a number the graph is specialised on, so a new scale recompiles once). A change that replaces
modules reuses the graphs where dynamo's guards find the same structure, and recompiles where they do not
(another rank, bias or set of adapted layers; torch's `recompile_limit`, 8 by default, bounds how many
arrangements one block's code keeps before dynamo runs it eagerly, with a warning).
"""

from __future__ import annotations

from typing import Any

import torch

from composer.accel.blocks import repeated_blocks
from composer.attach import Handle, attach
from composer.logging import get_logger

logger = get_logger(__name__)


def compile_module(module: torch.nn.Module, mode: str | None) -> Handle:
    """Compile `module.forward` in place (the module object, its parameters and hooks stay as they are); the
    handle's `remove()` gives the module its eager forward back."""
    options = {} if mode in (None, "default") else {"mode": mode}
    return attach((module, "forward"), torch.compile(module.forward, **options),
                  what=f"compiled {type(module).__name__}.forward")


class CompileHook:
    name = "compile"

    def apply(self, pipeline: Any) -> str:
        runtime = pipeline.runtime
        done = []
        for name, model in pipeline.denoisers().items():
            if runtime.compile == "regional":
                found = repeated_blocks(model)
                if found is None:
                    compile_module(model, runtime.compile_mode)
                    done.append(f"{name} whole (no repeated blocks declared)")
                    continue
                blocks = found[1]
                for block in blocks:
                    compile_module(block, runtime.compile_mode)
                done.append(f"{name}: {len(blocks)} blocks, one compiled graph reused")
            else:
                compile_module(model, runtime.compile_mode)
                done.append(f"{name} whole")
        mode = runtime.compile_mode or "default"
        return f"{runtime.compile}, mode {mode}: " + "; ".join(done) + " (compiles on the first video of each size)"
