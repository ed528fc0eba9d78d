"""Logging helpers: one logger namespace (`composer.*`), messages said once per process, and progress bars
that neither mix with log lines nor show when progress is off."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_configured = False
_said: set[str] = set()
_lock = threading.Lock()


class _TqdmHandler(logging.StreamHandler):
    """A stderr handler that writes through `tqdm.write`: a live progress bar is cleared for the log line and
    redrawn under it, so a bar and the next log line never run together on one terminal line."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream)
            self.flush()
        except Exception:  # as logging.StreamHandler does: a broken log stream must not break generation
            self.handleError(record)


# Warnings the libraries log at import when torchao (composer's `quant` extra) is installed, about features composer
# does not use: torchao's optional CUDA/C++ kernels that do not load on this machine, diffusers' torchao-serialized
# checkpoint types, and torch's pytree notice about torchao's enums. Dropped by exact logger and message, so a
# user's first run is quiet; anything else those loggers say still shows.
_LIBRARY_NOISE: dict[str, tuple[str, ...]] = {
    "torchao": ("Failed to load ",),
    "diffusers.quantizers.torchao.torchao_quantizer": ("Unable to import `torchao` Tensor objects",),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported by torch.compile",),
}


class _DropKnownNoise(logging.Filter):
    def __init__(self, fragments: tuple[str, ...]):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        message = record.getMessage()
        return not any(fragment in message for fragment in self.fragments)


def quiet_library_noise() -> None:
    """Drop the known, harmless import-time warnings of torchao and its users (see `_LIBRARY_NOISE`)."""
    for name, fragments in _LIBRARY_NOISE.items():
        lib_logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnownNoise) for f in lib_logger.filters):
            lib_logger.addFilter(_DropKnownNoise(fragments))


def get_logger(name: str) -> logging.Logger:
    """The logger for a composer module; the first call gives `composer` a stderr handler."""
    global _configured
    if not _configured:
        _configured = True
        quiet_library_noise()
        root = logging.getLogger("composer")
        if not root.handlers:
            handler = _TqdmHandler()
            handler.setFormatter(logging.Formatter("[composer] %(levelname)s %(message)s"))
            root.addHandler(handler)
            root.setLevel(os.environ.get("COMPOSER_LOG_LEVEL", "INFO").upper())
            root.propagate = False
    return logging.getLogger(name if name.startswith("composer") else f"composer.{name}")


def set_rank(rank: int, world_size: int) -> None:
    """One of several ranks: rank 0 logs as usual; the others log warnings and errors only, as
    `[composer rank N]`, so a failing rank is named and INFO lines are not repeated N times."""
    root = get_logger("composer")
    if rank == 0:
        return
    if root.level < logging.WARNING:
        root.setLevel(logging.WARNING)
    for handler in root.handlers:
        if isinstance(handler, _TqdmHandler):
            handler.setFormatter(logging.Formatter(f"[composer rank {rank}/{world_size}] %(levelname)s %(message)s"))


def log_once(logger: logging.Logger, key: str, message: str, level: int = logging.INFO) -> None:
    """Log `message` the first time `key` is seen in this process (fallback notices and the like)."""
    with _lock:
        if key in _said:
            return
        _said.add(key)
    logger.log(level, message)


def silence_library_progress_bars() -> None:
    """Turn off the loading / download / saving bars of transformers ("Loading weights", "Writing model
    shards"), diffusers and huggingface_hub for the rest of the process (the CLI's --no-progress)."""
    for enabled in _library_bars():
        enabled(False)


@contextmanager
def library_progress_bars(enabled: bool) -> Iterator[None]:
    """Within the block, the libraries' bars are off unless `enabled`; afterwards as they were."""
    if enabled:
        yield
        return
    switches = _library_bars()
    before = [switch(None) for switch in switches]
    for switch in switches:
        switch(False)
    try:
        yield
    finally:
        for switch, was in reversed(list(zip(switches, before))):
            switch(was)


def _library_bars() -> list:
    """A switch per installed library: `switch(None)` reads whether its bars are on, `switch(bool)` sets it.
    huggingface_hub's comes first: transformers' switch flips the hub's too, so the hub is restored last."""
    import importlib

    switches = []
    try:
        hub = importlib.import_module("huggingface_hub.utils")
    except ImportError:
        pass
    else:
        switches.append(_switch(lambda: not hub.are_progress_bars_disabled(), hub.enable_progress_bars,
                                hub.disable_progress_bars))
    for name in ("transformers", "diffusers"):
        try:
            lib = importlib.import_module(f"{name}.utils.logging")
        except ImportError:
            continue
        switches.append(_switch(lib.is_progress_bar_enabled, lib.enable_progress_bar, lib.disable_progress_bar))
    return switches


def _switch(is_on, turn_on, turn_off):
    def switch(value: bool | None):
        if value is None:
            return is_on()
        (turn_on if value else turn_off)()
        return value

    return switch


_muted = threading.local()


class _MutedThread(logging.Filter):
    """Drops records below WARNING logged by a thread inside `quiet_this_thread()`; other threads log as before."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not getattr(_muted, "on", False)


_MUTED_FILTER = _MutedThread()


@contextmanager
def quiet_this_thread() -> Iterator[None]:
    """composer's INFO lines from this thread kept out while inside (work that repeats what was logged once, e.g.
    the memory predictor building a twin of the pipeline); warnings still show, and no other thread is touched."""
    get_logger(__name__)  # (composer's handler installed)
    top = logging.getLogger("composer")
    handlers = list(top.handlers) + (list(logging.getLogger().handlers) if top.propagate else [])
    for handler in handlers:
        if _MUTED_FILTER not in handler.filters:
            handler.addFilter(_MUTED_FILTER)
    previous = getattr(_muted, "on", False)
    _muted.on = True
    try:
        yield
    finally:
        _muted.on = previous


_bars: dict[tuple[str, str], dict] = {}
_bars_lock = threading.Lock()


@contextmanager
def progress_bar(total: int | None, desc: str, unit: str, enabled: bool = True) -> Iterator[Callable[[int], None]]:
    """A progress bar for one run's `total` steps; yields `advance(n=1)`.

    Runs at once in one process (generate_video from several threads, a server's concurrent jobs) share one bar
    per description ("denoising (3 runs)", its total the sum of theirs) instead of each drawing its own on one
    terminal line, which garbled them (tqdm's moving bars write cursor movements that only a live terminal
    undoes). A run that ends early takes its unfinished steps off the total; the bar closes with the last run."""
    if not enabled:
        yield lambda n=1: None
        return
    from tqdm.auto import tqdm  # a notebook's widget in Jupyter, text elsewhere

    key = (desc, unit)
    with _bars_lock:
        shared = _bars.get(key)
        if shared is None:
            shared = _bars[key] = {"bar": tqdm(total=total, desc=desc, unit=unit, leave=False), "runs": 0}
        elif shared["bar"].total is not None:
            shared["bar"].total = None if total is None else shared["bar"].total + total
        shared["runs"] += 1
        _describe(shared, desc)
    done = 0

    def advance(n: int = 1) -> None:
        nonlocal done
        done += n
        with _bars_lock:
            shared["bar"].update(n)

    try:
        yield advance
    finally:
        with _bars_lock:
            shared["runs"] -= 1
            if shared["runs"] == 0:
                shared["bar"].close()
                del _bars[key]
            else:
                if total is not None and shared["bar"].total is not None:
                    shared["bar"].total -= max(total - done, 0)
                _describe(shared, desc)


def _describe(shared: dict, desc: str) -> None:
    runs = shared["runs"]
    shared["bar"].set_description(desc if runs == 1 else f"{desc} ({runs} runs)", refresh=True)
