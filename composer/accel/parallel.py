"""Parallel hook: spread each denoising transformer over the ranks of the runtime's layout
(composer/parallel/state.py made the process groups before the pipeline loaded).

- tensor parallel (`tp_size`): the transformer is loaded by this hook, each rank reading only its slices
  of the checkpoint into column/row-parallel layers (composer/parallel/tensor.py);
- sequence parallel (`ulysses_degree`, `ring_degree`): the model splits its tokens over the ranks and every
  self-attention module computes across them (composer/parallel/sequence.py);
- CFG parallel (`cfg_parallel`): every denoising engine runs its guidance branches on two rank groups
  (composer/parallel/cfg.py).

What it attaches goes through `composer.attach`: removing the hook takes sequence parallelism off (the
runner's split, the gather hook, the attention modules' cross-rank wrapper) and the engines' CFG parallel; a
tensor-parallel model holds only this rank's slices, so removing it is refused (load again without it).
"""

from __future__ import annotations

from typing import Any

from composer.attach import attach
from composer.errors import ConfigError
from composer.logging import get_logger
from composer.parallel import state as parallel_state

logger = get_logger(__name__)


class ParallelHook:
    name = "parallel"

    def __init__(self, state: parallel_state.ParallelState):
        self.state = state

    @classmethod
    def from_runtime(cls, runtime: Any) -> ParallelHook:
        state = parallel_state.current()
        if state is None or state.layout != parallel_state.ParallelLayout.from_runtime(runtime):
            raise ConfigError("the parallel layout is set but this process is not part of it: load through "
                              "VideoGenerator.from_pretrained (which joins the process group) or composer.parallel."
                              "state.init_parallel first")
        return cls(state)

    def load_module(self, pipeline: Any, name: str, folder, spec, dtype):
        """Tensor parallel: this rank's shard of each denoising transformer, read slice by slice."""
        if self.state.layout.tp == 1 or name not in pipeline.denoiser_names():
            return None
        from composer.loader.components import ComposerModelLoader
        from composer.parallel.tensor import load_tensor_parallel

        model_cls, config = ComposerModelLoader().model_class_and_config(folder, spec)
        return load_tensor_parallel(model_cls, config, folder, pipeline.load_device(name), dtype,
                                    self.state.group("tp"))

    def apply(self, pipeline: Any) -> str:
        from composer.parallel.sequence import SequenceParallel, apply_sequence_parallel

        layout = self.state.layout
        lines = []
        for name, model in pipeline.denoisers().items():
            done = []
            if layout.tp > 1:
                done.append(f"tensor parallel {layout.tp}")
                attach(undo=None, what=f"{name}: tensor parallel (this rank's slices of the weights were loaded)")
            if layout.sp > 1:
                sp = SequenceParallel(self.state.group("ulysses"), self.state.group("ring"), self.state.group("sp"))
                attach(undo=lambda model=model: _remove_sequence_parallel(model), what=f"{name}: sequence parallel")
                count = apply_sequence_parallel(model, sp)
                done.append(f"sequence parallel (ulysses {layout.ulysses} x ring {layout.ring}, {count} attention "
                            "modules)")
            if done:
                lines.append(f"{name}: " + ", ".join(done))
        if layout.cfg > 1:
            lines.append("guidance branches on two rank groups (cfg parallel)")
        return f"{layout.describe()} on {layout.world_size} ranks: " + "; ".join(lines)

    def configure_scheduler(self, scheduler, runtime: Any) -> None:
        """Concurrent requests on several ranks: rank 0 plans every transformer call (composer/parallel/plan.py)."""
        from composer.parallel.plan import plan_channel

        plan_channel(runtime.dist_timeout).register(scheduler)

    def configure_stage(self, stage, runtime: Any) -> None:
        """A decoding stage with exact VAE tiling (vae_tile_size) splits its tiles over the sequence-parallel ranks,
        each decode planned by rank 0 (composer/parallel/plan.py)."""
        if self.state.layout.sp > 1 and hasattr(stage, "split_over_ranks"):
            from composer.parallel.plan import plan_channel

            if stage.split_over_ranks(self.state.group("sp"), plan_channel(runtime.dist_timeout)):
                logger.info("%s: tiled VAE decodes split over the %d sequence-parallel ranks", stage.name,
                            self.state.layout.sp)

    def configure_engine(self, engine) -> None:
        if self.state.layout.cfg > 1:
            from composer.parallel.cfg import CfgParallel

            attach((engine, "branch_parallel"), CfgParallel(self.state.group("cfg"), self.state.index("cfg")),
                   what="cfg parallel")


def _remove_sequence_parallel(model: Any) -> None:
    """Undo `apply_sequence_parallel`: the model runs every token on this rank again."""
    from composer.models.attention import Attention
    from composer.models.runner import runner_of

    runner = runner_of(model)
    runner.detach_gather()
    runner.sequence_parallel = None
    for module in model.modules():
        if isinstance(module, Attention):
            module.parallel = None
