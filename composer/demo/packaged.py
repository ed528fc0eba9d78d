"""Where the embedded demo models live inside the package, and their names (no heavy imports: the model
resolver asks here for every path that is not a folder)."""

from __future__ import annotations

from pathlib import Path

PACKAGED = Path(__file__).parent / "models"
T2V_NAME = "shapes-t2v"
CAUSAL_NAME = "shapes-causal"
TEXT_NAME = "tiny-dllm"  # the embedded diffusion language model (scored on addition: composer/text/tasks.py)
EMBEDDED_NAMES = (T2V_NAME, CAUSAL_NAME, TEXT_NAME)


def packaged_model(name: str) -> Path | None:
    """A model folder shipped inside the package, if present."""
    folder = PACKAGED / name
    return folder if (folder / "model_index.json").is_file() else None


def embedded_model(name: str) -> Path | None:
    """The packaged folder that `name` ("shapes-t2v", or the id "composer/shapes-t2v"; likewise shapes-causal and
    tiny-dllm) names, if it is one of them and installed."""
    short = name.removeprefix("composer/")
    return packaged_model(short) if short in EMBEDDED_NAMES else None
