"""Logging helpers: one logger namespace (`composer.*`) and messages said once per process."""

from __future__ import annotations

import logging
import os
import threading

_configured = False
_said: set[str] = set()
_lock = threading.Lock()


def get_logger(name: str) -> logging.Logger:
    """The logger for a composer module; the first call gives `composer` a stderr handler."""
    global _configured
    if not _configured:
        _configured = True
        root = logging.getLogger("composer")
        if not root.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(logging.Formatter("[composer] %(levelname)s %(message)s"))
            root.addHandler(handler)
            root.setLevel(os.environ.get("COMPOSER_LOG_LEVEL", "INFO").upper())
            root.propagate = False
    return logging.getLogger(name if name.startswith("composer") else f"composer.{name}")


def log_once(logger: logging.Logger, key: str, message: str, level: int = logging.INFO) -> None:
    """Log `message` the first time `key` is seen in this process (fallback notices and the like)."""
    with _lock:
        if key in _said:
            return
        _said.add(key)
    logger.log(level, message)
