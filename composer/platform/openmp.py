"""Host threads and OpenMP: an idle thread gives its OpenMP workers back.

torch's CPU operators run on OpenMP (GNU libgomp in torch's wheels). libgomp gives every thread that starts a
parallel region its own team of workers, kept for the thread's lifetime, and it counts every worker of every team:
while the process holds more of them than it has CPUs, *every* team's workers stop spinning between parallel regions
and sleep on a futex instead (libgomp's "throttled" spin), so each of an operator's regions pays for waking them.
One loaded model touched by several threads (the caller that loaded it, the engine core's thread that runs the
steps, its stage threads and its decode lane) holds several teams, and one request alone then ran 1.7x as long on 2
cores as it did on one thread (5 shapes videos: 7.8 s against 4.5 s; ~490 context switches per transformer call).

`release_workers()` frees the calling thread's team (OpenMP 5's `omp_pause_resource_all(omp_pause_soft)`, which
in libgomp releases only the calling thread's pool). The engine core calls it where a thread goes idle or only waits:
its executor before it sleeps, its stage and side threads after each piece of work, a caller before it waits on
the core. A thread that computes again gets a new team (one thread started, tens of microseconds). It does nothing
where torch's OpenMP is not libgomp (Intel's or LLVM's runtime, which have no such throttle) or libgomp is too old
to have the call.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any

from composer.logging import get_logger

logger = get_logger(__name__)

OMP_PAUSE_SOFT = 1

_lib: Any = None
_looked = False
_guard = threading.Lock()


def _libgomp_path() -> str | None:
    """The libgomp torch loaded, from the process's memory map: the copy inside torch's own installation first
    (other wheels bring copies of their own, sentencepiece's among them, whose teams are not torch's)."""
    import torch

    home = os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))  # site-packages: torch/lib, torch.libs
    found: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if path.startswith("/") and "libgomp" in os.path.basename(path) and path not in found:
                    found.append(path)
    except OSError:
        return None
    ours = [p for p in found if os.path.relpath(p, home).split(os.sep)[0] in ("torch", "torch.libs")]
    if ours:
        return ours[0]
    return found[0] if len(found) == 1 else None  # a system libgomp torch links to; several: not ours to guess


def _pause_call() -> Any:
    global _lib, _looked
    if _looked:
        return _lib
    with _guard:
        if not _looked:
            path = _libgomp_path()
            if path is not None:
                try:
                    lib = ctypes.CDLL(path)
                    call = lib.omp_pause_resource_all
                    call.argtypes, call.restype = [ctypes.c_int], ctypes.c_int
                    _lib = call
                except (OSError, AttributeError) as exc:
                    logger.debug("libgomp at %s has no omp_pause_resource_all (%s): threads keep their teams", path,
                                 exc)
            _looked = True
    return _lib


def release_workers() -> bool:
    """Free the calling thread's OpenMP workers (see the module docstring); whether there was a runtime to ask."""
    call = _pause_call()
    if call is None:
        return False
    call(OMP_PAUSE_SOFT)  # -1 inside a parallel region (nothing freed): harmless
    return True


def runtime_name() -> str | None:
    """The OpenMP runtime whose teams `release_workers` frees (its file), or None."""
    return _libgomp_path() if _pause_call() is not None else None
