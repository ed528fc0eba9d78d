"""Worker processes for `VideoGenerator.from_pretrained(..., num_gpus=N)` outside a torchrun launch.

    with VideoGenerator.from_pretrained(model, num_gpus=2) as gen:    # 2 worker processes, Ulysses 2
        result = gen.generate_video("a cat", seed=0, output_path="cat.mp4")

The calling process starts one worker per rank (torch.multiprocessing, spawn) with torchrun's environment
variables; each worker loads the model through `VideoGenerator.from_pretrained`, which joins the process group.
From then on the ranks follow the one rank protocol of composer (composer/parallel/ranks.py, the same as
`composer serve` under torchrun): rank 0 holds a `RankLeader` and the others `follow` it. The calling process
sends each call to rank 0 over a pipe; rank 0 broadcasts it on the control group, every rank runs it (sync points
before each denoising step, a report at the end), and rank 0's result comes back. Calls from several threads of the
calling process run at once (up to the channel's call slots, 4), their steps batched as on one process. The calling
process never joins the process group; it watches every worker process.

What a failure does ("a rank never hangs its peers; bad input loses nothing"):
- an error raised the same way on every rank (bad input, a bad setting) is raised here as it was there, and the
  workers stay ready for the next request;
- an error on some ranks only, outside a compute collective (before or between steps, in decoding), makes every
  rank leave the call at the same sync point: a WorkerError names the failing ranks and their errors, and the
  workers stay ready;
- a collective that fails or times out (`dist_timeout`) leaves the process groups unreliable: the WorkerError says
  so, every worker is stopped and the generator is closed;
- a worker that dies: every worker is stopped at once and a WorkerError names the rank and how it exited;
- a load failure on any rank stops every worker and raises that rank's error from `start`.

Not across processes: `stream_video` (UnsupportedError: launch with torchrun to stream on several GPUs), a
`cancel=` token (UnsupportedError), lazy segment iterators (a list is sent). Scripts that start workers need
the usual `if __name__ == "__main__":` guard of spawned processes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import socket
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection, wait
from typing import Any

from composer.errors import ComposerError, UnsupportedError, WorkerError
from composer.logging import get_logger

logger = get_logger(__name__)

LOAD = 0  # the request id of loading; calls count from 1
PORT_ATTEMPTS = 3  # starts tried when the chosen MASTER_PORT is taken meanwhile


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------- worker side

def _serve(rank: int, world_size: int, port: int, model_path: Any, runtime_kwargs: dict[str, Any],
           conn: Connection, worker_setup: Callable[[int, int], None] | None) -> None:
    """A worker's life: load the model as rank `rank` of a torchrun-style launch, report, serve calls."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the calling process's to handle; it stops us
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if "OMP_NUM_THREADS" not in os.environ:  # the ranks share the host's cores
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    get_logger(__name__)  # configures the composer logger; then quiet it below rank 0, as init_parallel will
    if rank != 0:
        logging.getLogger("composer").setLevel(logging.WARNING)
    from composer.parallel.ranks import RankLeader, follow, load_on_every_rank

    def load() -> Any:
        if worker_setup is not None:
            worker_setup(rank, world_size)
        from composer.generator import VideoGenerator

        return VideoGenerator.from_pretrained(model_path, **runtime_kwargs)

    try:
        generator, channel = load_on_every_rank(load, _dist_timeout(runtime_kwargs))
    except BaseException as exc:  # noqa: BLE001 - every load failure is reported, then this worker ends
        _reply(conn, LOAD, "error", _pack_error(exc))
        return
    _reply(conn, LOAD, "ok", (generator.default_sampling, generator.family, generator.model_path)
           if rank == 0 else None)
    from composer.parallel import state as parallel_state

    if rank != 0:  # the rank protocol: every call rank 0 broadcasts, until it says stop
        follow(generator, channel)
        parallel_state.shutdown()
        return
    leader = RankLeader(generator, channel)
    sending = threading.Lock()  # the calls' replies, one at a time on the pipe

    def run(request_id: int, method: str, args: tuple, kwargs: dict) -> None:
        try:
            out = getattr(leader, method)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - sent back; "broken": the ranks cannot go on together
            reply = (request_id, "broken" if leader.unhealthy else "error", _pack_error(exc))
        else:
            reply = (request_id, "ok", out)
        with sending:
            _reply(conn, *reply)

    calls: list[threading.Thread] = []
    while True:  # each call on a thread: calls from several threads of the caller run at once on the ranks
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the calling process is gone
            break
        if message is None:
            break
        calls = [t for t in calls if t.is_alive()]
        calls.append(threading.Thread(target=run, args=message, name=f"composer-call-{message[0]}", daemon=True))
        calls[-1].start()
    leader.stop(timeout_s=5.0)
    parallel_state.shutdown()


def _dist_timeout(runtime_kwargs: dict[str, Any]) -> float:
    from composer.runtime import RuntimeArgs

    timeout = runtime_kwargs.get("dist_timeout")
    return float(timeout) if timeout is not None else RuntimeArgs.__dataclass_fields__["dist_timeout"].default


def _reply(conn: Connection, request_id: int, status: str, payload: Any) -> None:
    try:
        data = pickle.dumps((request_id, status, payload))
    except Exception as exc:  # noqa: BLE001 - a result that cannot travel is this rank's failure
        data = pickle.dumps((request_id, "error", _pack_error(exc, f"its {status} reply could not be pickled")))
    try:
        conn.send_bytes(data)
    except OSError:  # the calling process is gone: nobody to tell
        pass


def _pack_error(exc: BaseException, context: str | None = None) -> tuple:
    """The exception as (class, args, attributes, type name, traceback text): rebuilt with its own type in the
    calling process without calling its __init__ (StageVerificationError's takes other arguments)."""
    text = "".join(traceback.format_exception(exc))
    if context:
        text = f"{context}: {text}"
    box = (type(exc), exc.args, dict(getattr(exc, "__dict__", {})), type(exc).__name__, text)
    try:
        pickle.loads(pickle.dumps(box))
        return box
    except Exception:  # noqa: BLE001 - not importable or not picklable: the text still travels
        return (None, (), {}, type(exc).__name__, text)


def _unpack_error(box: tuple, rank: int) -> BaseException:
    cls, args, attributes, type_name, text = box
    if cls is not None:
        try:
            exc = cls.__new__(cls, *args)
            exc.args = args
            exc.__dict__.update(attributes)
            if not isinstance(exc, ComposerError):  # a bug: keep where it happened
                exc.add_note(f"raised on worker rank {rank}:\n{text.rstrip()}")
            return exc
        except Exception:  # noqa: BLE001 - fall back to the text
            pass
    last = text.strip().splitlines()[-1] if text.strip() else type_name
    return WorkerError(f"rank {rank} raised {last}\n{text.rstrip()}", rank=rank)


# ---------------------------------------------------------------------------------------------- caller side

@dataclasses.dataclass
class _Failure:
    rank: int
    cause: str  # "RuntimeError: boom" or "its process exited (killed by SIGKILL)"
    error: BaseException | None = None  # the rank's exception, rebuilt


class _WorkerPool:
    """The worker processes and a pipe to each; knows nothing of videos. Calls may be sent and answered from
    several threads at once (`send` under the caller's lock)."""

    def __init__(self, processes: list, conns: list[Connection]):
        self.processes = processes
        self.conns = conns
        self.closed_reason: str | None = None
        self._cv = threading.Condition()
        self._replies: dict[int, tuple[str, Any]] = {}  # read by one waiting thread for another
        self._reading = False  # a waiting thread reads rank 0's pipe
        self._failure: _Failure | None = None  # a worker exited: every waiting call gets it

    def send(self, request_id: int, method: str, args: tuple, kwargs: dict) -> None:
        """The call to rank 0, which runs it on every rank (a dead rank 0: `answer` reports it)."""
        try:
            self.conns[0].send_bytes(pickle.dumps((request_id, method, args, kwargs)))
        except OSError:
            pass

    def answer(self, request_id: int) -> tuple[str, Any] | _Failure:
        """Rank 0's reply to `request_id` ((status, payload)), or the first worker that exited meanwhile. Calls from
        several threads wait at once: one of them reads rank 0's pipe at a time, keeping the others' replies for
        them."""
        with self._cv:
            while True:
                if request_id in self._replies:
                    return self._replies.pop(request_id)
                if self._failure is not None:
                    return self._failure
                if not self._reading:
                    self._reading = True
                    break
                self._cv.wait()
        try:
            return self._read_until(request_id)
        finally:
            with self._cv:
                self._reading = False
                self._cv.notify_all()

    def _read_until(self, request_id: int) -> tuple[str, Any] | _Failure:
        """(The reading thread) Read rank 0's replies until `request_id`'s comes, or a worker exits."""
        while True:
            try:
                handles = {p.sentinel: rank for rank, p in enumerate(self.processes)}
                handles[self.conns[0]] = 0
                ready = wait(list(handles))
            except (OSError, ValueError):  # stopped meanwhile (another call's failure, or close())
                return self._failed(_Failure(0, f"the workers were stopped ({self.closed_reason})"))
            for handle in sorted(ready, key=lambda h: isinstance(h, Connection)):
                rank = handles[handle]
                if isinstance(handle, Connection):
                    got = self._read_all(0)
                    with self._cv:
                        self._replies.update(got)
                        self._cv.notify_all()
                        if request_id in self._replies:
                            return self._replies.pop(request_id)
                    if got or self.processes[0].is_alive():
                        continue
                return self._failed(_Failure(rank, f"its process exited ({self._exit_status(rank)})"))

    def _failed(self, failure: _Failure) -> _Failure:
        with self._cv:
            if self._failure is None:
                self._failure = failure
            self._cv.notify_all()
            return self._failure

    def _read_all(self, rank: int) -> dict[int, tuple[str, Any]]:
        """Every reply waiting on rank's pipe, by request id (none if the pipe closed)."""
        got: dict[int, tuple[str, Any]] = {}
        conn = self.conns[rank]
        try:
            while conn.poll():
                got_id, status, payload = pickle.loads(conn.recv_bytes())
                got[got_id] = (status, payload)
        except (EOFError, OSError):
            pass
        return got

    def gather(self, request_id: int, grace_s: float) -> tuple[dict[int, Any], list[_Failure], set[int]]:
        """Each rank's reply to `request_id`. After the first failure (an error reply, a process that exited)
        the others get `grace_s`; returns (ok payloads by rank, failures in the order seen, ranks still busy)."""
        pending = set(range(len(self.processes)))
        replies: dict[int, Any] = {}
        failures: list[_Failure] = []
        deadline = None
        while pending:
            by_handle = {}
            for rank in pending:
                by_handle[self.conns[rank]] = rank
                by_handle[self.processes[rank].sentinel] = rank
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait(list(by_handle), timeout)
            if not ready:
                break  # the grace period is over: the ranks left are stuck
            # A rank that exited is seen before the error it caused elsewhere (a peer's broken collective).
            for handle in sorted(ready, key=lambda h: isinstance(h, Connection)):
                rank = by_handle[handle]
                if rank not in pending:
                    continue
                reply = self._read(rank, request_id)
                if reply is None:
                    if isinstance(handle, Connection) and self.processes[rank].is_alive():
                        continue  # a stale reply to an earlier call was dropped
                    pending.discard(rank)
                    failures.append(_Failure(rank, f"its process exited ({self._exit_status(rank)})"))
                    continue
                pending.discard(rank)
                status, payload = reply
                if status == "ok":
                    replies[rank] = payload
                else:
                    error = _unpack_error(payload, rank)
                    failures.append(_Failure(rank, f"{payload[3]}: {_first_line(error)}", error))
            if failures and deadline is None:
                deadline = time.monotonic() + grace_s
        return replies, failures, pending

    def _read(self, rank: int, request_id: int) -> tuple[str, Any] | None:
        """Rank's reply to `request_id` if one is waiting (stale ones dropped); None if none or the pipe closed."""
        conn = self.conns[rank]
        try:
            while conn.poll():
                got_id, status, payload = pickle.loads(conn.recv_bytes())
                if got_id == request_id:
                    return status, payload
        except (EOFError, OSError):
            pass
        return None

    def _exit_status(self, rank: int) -> str:
        process = self.processes[rank]
        process.join(1)
        code = process.exitcode
        if code is None:
            return "still running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    def stop(self, reason: str, graceful_s: float) -> None:
        """Ask every worker to stop, wait up to `graceful_s`, then terminate and kill what is left. Idempotent."""
        if self.closed_reason is None:
            self.closed_reason = reason
        if graceful_s > 0:
            for conn in self.conns:
                try:
                    conn.send_bytes(pickle.dumps(None))
                except OSError:
                    pass
            deadline = time.monotonic() + graceful_s
            for process in self.processes:
                process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(2)
            if process.is_alive():
                process.kill()
                process.join(2)
        for conn in self.conns:
            conn.close()

    @property
    def running(self) -> bool:
        return self.closed_reason is None


def _stop_pool(pool: _WorkerPool, reason: str, graceful_s: float) -> None:
    """The finalizer: at `close()`, when the generator is garbage-collected, and at interpreter exit."""
    pool.stop(reason, graceful_s)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class WorkerVideoGenerator:
    """VideoGenerator's API over `num_gpus` worker processes that run every call together (rank 0 answers).

    Made by `VideoGenerator.from_pretrained(..., num_gpus=N)`; close it (`close()`, or use it as a context
    manager) to stop the workers; they are also stopped when it is garbage-collected and at interpreter exit."""

    failure_grace_s = 5.0  # after one rank failed: how long the others may take to fail too before they are killed
    stop_timeout_s = 10.0  # close(): how long workers may take to leave the process group before being terminated

    def __init__(self, pool: _WorkerPool, runtime: Any, default_sampling: Any, model_path: str, family: str):
        self._pool = pool
        self._lock = threading.Lock()
        self._next_id = LOAD
        self.runtime = runtime
        self.default_sampling = default_sampling
        self.model_path = model_path
        self.family = family
        self._finalizer = weakref.finalize(self, _stop_pool, pool, "the generator was garbage-collected",
                                           self.stop_timeout_s)

    @classmethod
    def start(cls, model_path: Any, runtime: Any, runtime_kwargs: dict[str, Any], *,
              worker_setup: Callable[[int, int], None] | None = None) -> WorkerVideoGenerator:
        """Start `runtime.num_gpus` workers, each loading `model_path` as one rank of the runtime's layout.

        `worker_setup(rank, world_size)`, an importable (module-level) function, runs in each worker before it
        loads. Raises the failing rank's load error (its own type) after stopping every worker."""
        import torch.multiprocessing as mp

        from composer.parallel.state import ParallelLayout

        world_size = runtime.num_gpus
        layout = ParallelLayout.from_runtime(runtime)
        kwargs = {k: v for k, v in runtime_kwargs.items() if k != "num_gpus"}
        kwargs.update(ulysses_degree=layout.ulysses, ring_degree=layout.ring, tp_size=layout.tp,
                      cfg_parallel=layout.cfg > 1)
        path = str(model_path) if model_path is not None else None
        context = mp.get_context("spawn")
        for attempt in range(1, PORT_ATTEMPTS + 1):
            pool = _WorkerPool([], [])
            try:
                port = _free_port()
                for rank in range(world_size):
                    mine, theirs = context.Pipe()
                    process = context.Process(target=_serve, name=f"composer-rank{rank}",
                                              args=(rank, world_size, port, path, kwargs, theirs, worker_setup))
                    process.start()
                    theirs.close()
                    pool.processes.append(process)
                    pool.conns.append(mine)
                logger.info("started %d worker processes (%s); loading %s", world_size, layout.describe(), path)
                replies, failures, stuck = pool.gather(LOAD, cls.failure_grace_s)
            except BaseException:
                pool.stop("loading was interrupted", 0)
                raise
            if not failures and not stuck:
                break
            pool.stop("loading failed", 0)
            # The free port was only free when we looked: another program may have taken it since. Try another.
            if attempt < PORT_ATTEMPTS and any("EADDRINUSE" in f"{f.cause} {f.error}" for f in failures):
                logger.warning("port %d was taken before rank 0 could listen on it; starting the workers again", port)
                continue
            # a rank's own error before the WorkerError its peers raise about it
            first = (next((f for f in failures if f.error is not None and not isinstance(f.error, WorkerError)),
                          next((f for f in failures if f.error is not None), failures[0])) if failures else None)
            if first is None:
                raise WorkerError(f"the workers did not finish loading: ranks {sorted(stuck)} hung", rank=min(stuck))
            if first.error is not None:
                raise first.error
            hint = (" (a script that starts workers needs `if __name__ == \"__main__\":` around its code)"
                    if first.cause.startswith("its process exited") else "")
            raise WorkerError(f"rank {first.rank} of {world_size} failed while loading {path}: {first.cause}{hint}",
                              rank=first.rank)
        default_sampling, family, loaded_path = replies[0]
        return cls(pool, runtime, default_sampling, loaded_path, family)

    # ------------------------------------------------------------------------------------------ the API

    @property
    def worker_pids(self) -> list[int]:
        """The workers' process ids, rank order."""
        return [p.pid for p in self._pool.processes]

    @property
    def num_workers(self) -> int:
        return len(self._pool.processes)

    @property
    def closed(self) -> bool:
        return not self._pool.running

    def sampling_param(self, **overrides: Any) -> Any:
        """The defaults (family < model folder) with `overrides` applied (raises ConfigError for unknown keys)."""
        return self.default_sampling.updated(**overrides)

    def generate_video(self, prompt: str | list[str] | None = None, *, sampling_param: Any = None,
                       segments: Iterable[tuple[str, int]] | None = None, cancel: Any = None,
                       **overrides: Any) -> Any:
        """As VideoGenerator.generate_video, run on every worker; rank 0's result(s). `segments` are sent as a
        list; `cancel` is refused (a token cannot reach the workers together: a rank cancelled alone would
        hang its peers)."""
        if cancel is not None:
            raise UnsupportedError("cancel= does not reach worker processes (num_gpus > 1): a rank stopping alone "
                                   "would hang the others. Launch with torchrun to cancel, or leave cancel unset")
        kwargs = dict(overrides, sampling_param=sampling_param,
                      segments=list(segments) if segments is not None else None)
        return self._call("generate_video", (prompt,), kwargs)

    def stream_video(self, *args: Any, **kwargs: Any) -> Any:
        """Not with worker processes: launch with torchrun and call stream_video on every rank."""
        raise UnsupportedError(
            f"stream_video is not supported with num_gpus = {self.num_workers} worker processes: launch with "
            f"`torchrun --nproc-per-node={self.num_workers} ...` (the degrees as settings, no num_gpus) and call "
            "stream_video on every rank, or use generate_video here"
        )

    def set_lora(self, paths: Any, scales: float | list[float] | None = None) -> str:
        """As VideoGenerator.set_lora, on every rank."""
        paths = [str(paths)] if isinstance(paths, (str, os.PathLike)) else [str(p) for p in paths]
        return self._call("set_lora", (paths, scales), {})

    def unset_lora(self) -> None:
        """As VideoGenerator.unset_lora, on every rank."""
        self._call("unset_lora", (), {})

    def close(self) -> None:
        """Stop the workers (gracefully, then terminated after `stop_timeout_s`). Idempotent."""
        with self._lock:
            self._finalizer.detach()
            self._pool.stop("close() was called", self.stop_timeout_s if self._pool.running else 0)

    def __enter__(self) -> WorkerVideoGenerator:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = f"closed: {self._pool.closed_reason}" if self.closed else f"pids {self.worker_pids}"
        return f"WorkerVideoGenerator({self.model_path!r}, {self.num_workers} workers, {state})"

    # ------------------------------------------------------------------------------------------ one call

    def _call(self, method: str, args: tuple, kwargs: dict) -> Any:
        with self._lock:  # ids and sends in order; the calls then run at once on the workers
            if not self._pool.running:
                raise WorkerError(f"this generator's worker processes are stopped ({self._pool.closed_reason}); "
                                  "load the model again with VideoGenerator.from_pretrained")
            try:
                pickle.dumps((args, kwargs))
            except Exception as exc:  # noqa: BLE001 - nothing sent yet: the workers stay ready
                raise UnsupportedError(f"{method}'s arguments cannot be sent to the worker processes: {exc}") from exc
            self._next_id += 1
            request_id = self._next_id
            self._pool.send(request_id, method, args, kwargs)
        try:
            reply = self._pool.answer(request_id)
        except BaseException:  # Ctrl-C while waiting: the ranks cannot be stopped together, so stop them all
            self._stop_now(f"{method} was interrupted")
            raise
        if isinstance(reply, _Failure):
            self._stop_now(f"rank {reply.rank} died during {method}")
            raise WorkerError(
                f"rank {reply.rank} of {self.num_workers} failed during {method}: {reply.cause}. Its peers "
                "could not go on without it, so every worker was stopped; load the model again with "
                "VideoGenerator.from_pretrained", rank=reply.rank)
        status, payload = reply
        if status == "ok":
            return payload
        error = _unpack_error(payload, 0)  # rank 0's: its own error, or a WorkerError naming the ranks
        if status == "broken":
            self._stop_now(f"the ranks lost contact during {method}")
            raise WorkerError(f"{_first_line(error)}. Every worker was stopped; load the model again with "
                              "VideoGenerator.from_pretrained", rank=getattr(error, "rank", None)) from error
        raise error

    def _stop_now(self, reason: str) -> None:
        self._finalizer.detach()
        self._pool.stop(reason, 0)
