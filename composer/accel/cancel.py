"""Cancel points: where a running request's CancelToken is checked (composer/cancel.py).

The pipeline checks the token before each stage; this hook adds the checks inside the denoising loop, so
a cancel stops the request within one transformer block instead of at the end of a step (a 14B step can
take minutes):

    before every repeated block     a forward pre-hook on each block named by `repeated_blocks`
    before every denoising step     an engine hook (`before_step`), also between a causal model's blocks

It is registered last, after offload's block hooks: offload's pre-hook has made the block resident when
the check raises, and offload's always-called post-hook evicts it again, so nothing is left half-applied.
With `compile = full` the blocks run inside one compiled graph, where a Python check cannot sit; the check
then runs before each transformer call instead (said in the hook's log line).

Both are attached with `composer.attach` at cancel's order key (the last), so they run after offload's
block hooks even when offloading re-attaches its hooks later (a LoRA change), and removing the hook takes them off.
"""

from __future__ import annotations

from typing import Any

from composer.accel.blocks import repeated_blocks
from composer.attach import Handle, attach


class _CheckBeforeStep:
    """Engine hook: check the running request's token before each step."""

    def __init__(self, pipeline: Any):
        self.pipeline = pipeline

    def before_step(self, info: Any) -> None:
        self.pipeline.check_cancelled()


class CancelHook:
    """Checks the running request's cancel token before every transformer block and every step."""

    name = "cancel"

    def __init__(self) -> None:
        self.pipeline: Any = None
        self.handles: list[Handle] = []

    def apply(self, pipeline: Any) -> str:
        self.pipeline = pipeline

        def check(module, args) -> None:
            pipeline.check_cancelled()

        done = []
        for name, model in pipeline.denoisers().items():
            found = repeated_blocks(model)
            if found is None or pipeline.runtime.compile == "full":
                self.handles.append(attach(model, check, kind="forward_pre", what=f"cancel check before {name}"))
                done.append(f"{name}: before each call")
            else:
                blocks = found[1]
                self.handles += [attach(block, check, kind="forward_pre", what=f"cancel check before {name} block")
                                 for block in blocks]
                done.append(f"{name}: before each of {len(blocks)} blocks")
        return "; ".join(done) + " and each step"

    def configure_engine(self, engine: Any) -> None:
        attach(engine, _CheckBeforeStep(self.pipeline), what="cancel check before each step")
