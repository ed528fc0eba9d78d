"""TimestepPreparationStage: a fresh scheduler for the request, with its timesteps set."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from composer.batch import ForwardBatch
from composer.errors import UnsupportedError
from composer.loader.components import read_config_file
from composer.stages.base import Stage
from composer.stages.validators import V, VerificationResult


def flow_shift_key(config) -> str | None:
    """The name of a scheduler config's flow-shift setting, or None when it has none.

    diffusers names the shift `flow_shift` (UniPC, DPM-Solver) or `shift` (flow-match Euler).
    """
    return next((key for key in ("flow_shift", "shift") if key in config), None)


def folder_flow_shift(folder: Path, scheduler) -> dict[str, Any]:
    """A pipeline's `sampling_defaults()` entry for the flow shift its folder's scheduler config states:
    {"flow_shift": value}; {} when the file states none (the family's value fills in); {"flow_shift": None} when
    the scheduler has no fixed shift to set (a family value would only be refused later)."""
    key = flow_shift_key(scheduler.config)
    if key is None or scheduler.config.get("use_dynamic_shifting"):
        return {"flow_shift": None}
    # The file, not `scheduler.config`: diffusers fills an unstated shift with its own default (1.0).
    stated = read_config_file(Path(folder) / "scheduler" / scheduler.config_name)
    return {"flow_shift": stated[key]} if stated.get(key) is not None else {}


def scheduler_with_shift(template, flow_shift: float | None):
    """A new scheduler of the template's class and config, with `flow_shift` applied when given.

    Schedulers carry state between steps, so each request gets its own instance.
    """
    overrides = {}
    if flow_shift is not None:
        config = template.config
        key = flow_shift_key(config)
        if key is not None:
            overrides[key] = flow_shift
        else:
            raise UnsupportedError(
                f"{type(template).__name__} has no flow shift setting; leave flow_shift unset for this model"
            )
        if config.get("use_dynamic_shifting"):
            raise UnsupportedError(f"{type(template).__name__} uses dynamic shifting; leave flow_shift unset")
    return type(template).from_config(template.config, **overrides)


class TimestepPreparationStage(Stage):
    """Creates the request's scheduler from the model folder's scheduler config and sets its timesteps.

    `sigmas`: num_inference_steps -> the sigmas to hand the scheduler (which still applies its shift), for a
    family whose reference pipeline passes its own (HunyuanVideo: linspace(1, 0, n + 1)[:-1]); None: the
    scheduler's own spacing for `num_inference_steps`.
    """

    def __init__(self, scheduler, device, sigmas: Callable[[int], Sequence[float]] | None = None):
        self.template = scheduler
        self.device = device
        self.sigmas = sigmas

    def verify_output(self, batch: ForwardBatch, result: VerificationResult) -> None:
        result.add_check("timesteps", batch.timesteps, V.ndim(1))

    def forward(self, batch: ForwardBatch) -> ForwardBatch:
        scheduler = scheduler_with_shift(self.template, batch.flow_shift)
        if self.sigmas is None:
            scheduler.set_timesteps(batch.num_inference_steps, device=self.device)
        else:
            scheduler.set_timesteps(sigmas=list(self.sigmas(batch.num_inference_steps)), device=self.device)
        if hasattr(scheduler, "set_begin_index"):
            scheduler.set_begin_index(0)  # no timestep lookup (a device sync) on the first step
        batch.scheduler = scheduler
        batch.timesteps = scheduler.timesteps
        return batch
