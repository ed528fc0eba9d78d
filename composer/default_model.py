"""The embedded default model `composer generate` uses when no --model-path is given.

It is `shapes-t2v`, a tiny Wan2.1-architecture text-to-video model trained on synthetic moving shapes
(scripts/train_demo_model.py, docs/demo-model.md), shipped inside the package so the main job runs on a
fresh CPU-only machine with nothing downloaded. Its causal sibling is `shapes-causal`.
"""

from __future__ import annotations

from pathlib import Path

from composer.demo.packaged import T2V_NAME, packaged_model
from composer.errors import ModelNotFoundError


def default_model_path() -> Path:
    folder = packaged_model(T2V_NAME)
    if folder is None:
        raise ModelNotFoundError(
            f"the embedded default model ({T2V_NAME}) is missing from this install; reinstall composer, pass "
            "--model-path, or train it from a source checkout with `python scripts/train_demo_model.py`"
        )
    return folder
