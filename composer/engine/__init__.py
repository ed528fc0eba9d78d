"""The denoising engine: the one step loop, the one place a pipeline calls its transformer, classifier-free
guidance, and the hook points (before/after a step, around the model call) that step caches, CFG parallel and
profiling attach to. Text-to-video runs it once per video; the causal stage runs it once per block."""

from composer.engine.engine import DenoisingEngine, EngineHook, ModelCall, StepInfo
from composer.engine.guidance import ClassifierFreeGuidance
from composer.engine.inputs import ModelInputs
from composer.engine.steps import FewStepFlow, SchedulerSteps, StepRule

__all__ = [
    "ClassifierFreeGuidance",
    "DenoisingEngine",
    "EngineHook",
    "FewStepFlow",
    "ModelCall",
    "ModelInputs",
    "SchedulerSteps",
    "StepInfo",
    "StepRule",
]
