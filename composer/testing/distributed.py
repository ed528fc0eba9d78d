"""Run a function on N gloo processes on 127.0.0.1 (tests and benchmarks of the parallel code on CPU).

    spawn(worker, 4, arg)          # worker(rank, world_size, arg) on 4 ranks, torch.distributed initialised

A rank's exception fails the whole run (the others are terminated); a run past `timeout_s` is killed rather
than left hanging, and a collective whose peer died fails after `collective_timeout_s` instead of waiting.
The ranks are forked from a forkserver that has imported torch, diffusers and composer once (PRELOAD).
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class SpawnTimeout(RuntimeError):
    """The ranks did not finish in time (some rank is stuck in a collective)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(worker, world_size: int, *args, timeout_s: float = 120, collective_timeout_s: float = 30,
          threads: int = 1) -> None:
    """Run `worker(rank, world_size, *args)` in `world_size` processes with a gloo process group; raises the
    first failing rank's error (mp.ProcessRaisedException) or SpawnTimeout. `worker` must be importable
    (a module-level function)."""
    for attempt in range(PORT_ATTEMPTS):
        try:
            return _spawn_once(worker, world_size, args, timeout_s, collective_timeout_s, threads)
        except mp.ProcessRaisedException as exc:
            # The port was free when picked, but another process on this machine took it before rank 0
            # listened on it: start again on another one.
            if attempt + 1 == PORT_ATTEMPTS or not any(s in str(exc) for s in _PORT_TAKEN):
                raise


PORT_ATTEMPTS = 3
_PORT_TAKEN = ("EADDRINUSE", "Address already in use")
# Ranks are forked from one forkserver that imported these once: a spawned rank re-imported torch, diffusers and
# composer (2-3 s a rank on 2 cores), a forked one starts in ~0.1 s. The forkserver is a clean process (no
# process group, no thread pools started), started at the first spawn and shared by every later one.
PRELOAD = ["torch", "torch.distributed", "numpy", "safetensors.torch", "transformers", "diffusers",
           "composer.generator", "composer.testing", "composer.testing.distributed", "composer.models.wan.transformer",
           "composer.models.wan.causal", "composer.parallel.state"]


def _spawn_once(worker, world_size: int, args: tuple, timeout_s: float, collective_timeout_s: float,
                threads: int) -> None:
    port = free_port()
    done = tempfile.mkdtemp(prefix="composer-spawn-")
    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the forkserver starts (the first spawn)
    # the forkserver's environment is the one it started with: each rank takes the caller's as it is now
    ctx = mp.start_processes(_init_and_run, args=(world_size, port, worker, args, collective_timeout_s, threads, done,
                                                  dict(os.environ)),
                             nprocs=world_size, join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                raise SpawnTimeout(f"{world_size} gloo ranks did not finish within {timeout_s} s")
    finally:
        for process in ctx.processes:
            if process.is_alive():
                process.kill()
        shutil.rmtree(done, ignore_errors=True)


def _init_and_run(rank: int, world_size: int, port: int, worker, args, collective_timeout_s: float,
                  threads: int, done: str, environ: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(threads)  # shared cores: P processes with few threads each
    # what torchrun sets: composer's own initialisation (composer.parallel.state) reads the same variables
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=collective_timeout_s))
    try:
        worker(rank, world_size, *args)
        # Every rank done with its collectives before any tears its gloo context down: a rank leaving while a
        # peer still talks to it once aborted the peer at exit ("terminate called without an active exception").
        dist.barrier()
    finally:
        _leave(rank, world_size, Path(done))


def _leave(rank: int, world_size: int, done: Path, wait_s: float = 10.0) -> None:
    """Destroy the process group, rank 0 last: rank 0 hosts the TCP store the others' groups hold on to, and a
    rank still tearing down when the store went away aborted (SIGABRT, "terminate called without an active
    exception"), seen in CI even after the barrier above. The others say they are done with a file; rank 0 waits
    for them (bounded: a rank that died does not hold rank 0 forever)."""
    if rank != 0:
        dist.destroy_process_group()
        (done / str(rank)).touch()
        return
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not all((done / str(r)).exists() for r in range(1, world_size)):
        time.sleep(0.02)
    dist.destroy_process_group()
