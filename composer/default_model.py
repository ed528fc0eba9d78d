"""The embedded default model `composer generate` uses when no --model-path is given.

For now this is a tiny Wan2.1 T2V model with random weights, built locally on first use (a few seconds,
nothing downloaded): it exercises the real loading and generation path but does not draw what the prompt
says. It lives under $COMPOSER_CACHE (default ~/.cache/composer).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from composer.logging import get_logger

logger = get_logger(__name__)

DEFAULT_MODEL_NAME = "tiny-wan2.1-t2v-random"


def cache_dir() -> Path:
    base = os.environ.get("COMPOSER_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "composer"
    return Path(base)


def default_model_path() -> Path:
    """The default model folder, built (atomically) if it is not there yet."""
    from composer.testing.tiny_wan import build_tiny_wan

    target = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if (target / "model_index.json").is_file():
        return target
    logger.info("building the embedded default model (tiny Wan2.1, random weights) at %s", target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        build_tiny_wan(staging / "model")
        try:
            (staging / "model").rename(target)
        except OSError:  # another process finished first
            if not (target / "model_index.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
