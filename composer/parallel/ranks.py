"""Serving on several ranks under torchrun: rank 0 serves HTTP, every rank runs every call together.

    torchrun --nproc-per-node 2 -m composer serve --model-path ... --ulysses-degree 2

Every rank loads the model (joining the process group). Rank 0 runs the server with a `RankLeader` as its
generator; the other ranks run `follow`. For each call the worker makes (generate_video, stream_video,
set_lora, unset_lora) the leader pickles the call once and broadcasts the bytes on a gloo control group (CPU
tensors, so it sits beside NCCL on GPUs); every rank, rank 0 included, unpickles those bytes and runs the call
on its own generator. The protocol on the control group, in the order every rank takes part:

    message      rank 0 broadcasts CALL (method, args, kwargs), PING (idle keep-alive) or STOP
    pre-flight   every rank says whether it could decode the call and has what it needs (a LoRA file);
                 any problem: every rank skips the call, rank 0 raises naming the rank
    sync points  before each denoising step (an engine hook) and before each lazily read stream segment,
                 every rank gathers one status code: rank 0's says "cancel" once its caller's token is
                 cancelled, so every rank raises Cancelled at the same step; a code saying a rank has left
                 the call (it failed) makes the others leave it too, at the same point
    report       every rank gathers its final code until all have one, then each rank's outcome; rank 0
                 raises an error naming the failing ranks (or the caller's Cancelled), and every rank
                 waits for the next message

A rank that fails outside a compute collective (before the first step, in a step's hook, in decoding) is thus
recovered from. A rank that fails alone inside one (an all-to-all in a transformer block) leaves its peers in
it until `dist_timeout`; the call then fails on every rank, and since a collective group that timed out is
not reliable afterwards, the leader marks itself broken (`unhealthy`: /health answers 503) and every later
call fails at once: restart the server. A rank that dies breaks the control group the same way (and under
torchrun, the launcher stops the other ranks).
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from composer.errors import WorkerError
from composer.logging import get_logger
from composer.parallel.rank_protocol import (
    CALL,
    DONE,
    FAILED,
    PING,
    STOP,
    STOPPED,
    ControlChannel,
    LazySegments,
    Runner,
    SegmentsFromRank0,
    SegmentsToRanks,
    describe,
)

logger = get_logger(__name__)

HEARTBEAT_S = 5.0  # an idle leader pings this often, so followers waiting for work never reach the timeout


def join_ranks(load_error: BaseException | None, timeout_s: float) -> ControlChannel:
    """After every rank tried to load: make the control group and agree that all loaded. Raises WorkerError
    naming the ranks that failed (on every rank)."""
    if not dist.is_initialized():
        if load_error is not None:  # it failed before joining: the others learn it from torchrun
            raise load_error
        raise WorkerError("the process group is not initialised: serving on several ranks needs torchrun and "
                          "parallel degrees (--ulysses-degree, --ring-degree, --tp-size, --cfg-parallel)")
    channel = ControlChannel(timeout_s)
    errors = channel.gather_objects(describe(load_error) if load_error else None)
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    if failed and load_error is not None and len(failed) == len(errors) and len(set(errors)) == 1:
        raise load_error  # every rank failed alike (a bad setting): its own error, as one process raises it
    if failed:
        raise WorkerError(f"loading failed on {len(failed)} of {channel.world_size} ranks "
                          f"({'; '.join(failed)})", rank=next(r for r, e in enumerate(errors) if e))
    return channel


def load_on_every_rank(load: Callable[[], Any], timeout_s: float) -> tuple[Any, ControlChannel]:
    """Every rank calls this together: `load()` (which joins the process group), then `join_ranks`. Returns
    (this rank's generator, the control channel); raises this rank's own load error, or a WorkerError naming
    the ranks that failed."""
    generator, error = None, None
    try:
        generator = load()
    except Exception as exc:  # noqa: BLE001 - told to the other ranks first
        error = exc
    channel = join_ranks(error, timeout_s)  # raises on every rank when any failed
    return generator, channel


class RankLeader:
    """Rank 0's generator for the server: VideoGenerator's API (generate_video, stream_video, set_lora,
    unset_lora; other attributes are rank 0's generator's), each call run on every rank together."""

    def __init__(self, generator: Any, channel: ControlChannel, heartbeat_s: float = HEARTBEAT_S):
        self._generator = generator
        self._runner = Runner(generator, channel)
        self._channel = channel
        self._lock = threading.Lock()  # one protocol message at a time: a call, a ping, the stop
        self._heartbeat_s = min(heartbeat_s, channel.timeout_s / 4)
        self._stopping = threading.Event()
        self._last_message = time.monotonic()
        self.unhealthy: str | None = None  # why the ranks can no longer serve (the server answers 503)
        self._pinger = threading.Thread(target=self._ping, name="composer-serve-ping", daemon=True)
        self._pinger.start()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._generator, name)

    @property
    def world_size(self) -> int:
        return self._channel.world_size

    # -- the API

    def generate_video(self, *args: Any, cancel: Any = None, **kwargs: Any) -> Any:
        """As VideoGenerator.generate_video, on every rank; rank 0's result. `cancel` stops every rank at the
        same denoising step."""
        return self._call("generate_video", args, kwargs, cancel)

    def set_lora(self, paths: Any, scales: Any = None) -> str:
        """As VideoGenerator.set_lora, on every rank. Where it ran but failed on some ranks only, the adapters
        are then removed on every rank (no rank runs with adapters its peers lack) and the error says so. A path
        rank 0 cannot read raises what one process raises, before any rank is asked."""
        from composer.accel.lora_names import find_lora_file

        for path in [paths] if isinstance(paths, (str, os.PathLike)) else list(paths or []):
            find_lora_file(path)
        try:
            return self._call("set_lora", (paths, scales), {})
        except WorkerError as exc:
            if self.unhealthy is not None or self._runner.skipped:  # broken, or ran nowhere: nothing to undo
                raise
            self._call("unset_lora", (), {})
            raise WorkerError(f"{exc}; every rank's LoRA adapters were then removed", rank=exc.rank) from exc

    def unset_lora(self) -> None:
        """As VideoGenerator.unset_lora, on every rank."""
        self._call("unset_lora", (), {})

    def stream_video(self, prompts: Any = None, *, cancel: Any = None, **kwargs: Any) -> _LeaderStream:
        """As VideoGenerator.stream_video, on every rank (each makes every chunk; rank 0's are yielded). A
        lazy segments iterator is read here, on rank 0, and each segment sent to the others as their pipelines
        ask. Iterate the stream to its end, or close it: until then no other call can start."""
        lazy = prompts is not None and not isinstance(prompts, (str, list, tuple))
        args = (LazySegments(live=callable(getattr(prompts, "ends_segment", None))),) if lazy else (prompts,)
        self._send_call("stream_video", args, kwargs)
        try:
            call = self._decode_own("stream_video")
            segments = SegmentsToRanks(self._runner, prompts, self._heartbeat_s) if lazy else None
            try:
                stream = self._runner.start(*call, cancel, segments)
            except BaseException as exc:
                self._raise_outcome("stream_video", self._report(self._runner.outcome(exc), exc), exc)
                raise  # (_raise_outcome raises for any error: this is not reached)
            return _LeaderStream(self, stream)
        except BaseException:
            self._release()
            raise

    def stop(self, timeout_s: float = 60.0) -> None:
        """Tell every other rank to leave (after the call under way, waited for up to `timeout_s`)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        if not self._lock.acquire(timeout=timeout_s):
            logger.warning("a call still runs after %.0f s; the other ranks are not told to stop", timeout_s)
            return
        try:
            if self.unhealthy is None:
                self._channel.broadcast_bytes(pickle.dumps((STOP, None)))
        except Exception as exc:  # noqa: BLE001 - nobody left to tell
            logger.warning("could not tell the other ranks to stop: %s", exc)
        finally:
            self._lock.release()
        self._pinger.join(timeout=2 * self._heartbeat_s)

    # -- the protocol

    def _call(self, method: str, args: tuple, kwargs: dict, cancel: Any = None) -> Any:
        self._send_call(method, args, kwargs)
        try:
            call = self._decode_own(method)
            exc = result = None
            try:
                result = self._runner.start(*call, cancel, None)
            except BaseException as error:  # noqa: BLE001 - reported, then raised below
                exc = error
            reports = self._report(self._runner.outcome(exc), exc)
            self._raise_outcome(method, reports, exc)
            return result
        finally:
            self._release()

    def _send_call(self, method: str, args: tuple, kwargs: dict) -> None:
        """Take the channel and broadcast the call (or raise, having sent nothing)."""
        try:
            payload = pickle.dumps((method, args, kwargs))
        except Exception as exc:  # noqa: BLE001 - nothing sent: the ranks stay ready
            raise WorkerError(f"{method}'s arguments cannot be sent to the other ranks: {exc}") from exc
        self._lock.acquire()
        self._payload = payload  # what every rank decodes, rank 0 included (_decode_own)
        try:
            if self.unhealthy is not None:
                raise WorkerError(f"{method} cannot run: {self.unhealthy}")
            if self._stopping.is_set():
                raise WorkerError(f"{method} cannot run: the server is stopping")
            self._talk(method, self._channel.broadcast_bytes, pickle.dumps((CALL, self._payload)))
        except BaseException:
            self._lock.release()
            raise

    def _decode_own(self, method: str) -> tuple[str, tuple, dict]:
        """The pre-flight: rank 0 decodes the bytes it sent, as every rank does; all skip if any cannot."""
        call = self._talk(method, self._runner.decode, self._payload)
        if call is None:
            first, problem = self._runner.skipped[0]
            names = "; ".join(f"rank {r}: {p}" for r, p in self._runner.skipped)
            raise WorkerError(f"{method} was not run on any of the {self.world_size} ranks: rank {first} could "
                              f"not take it ({names}); every rank is ready for the next request", rank=first)
        return call

    def _report(self, code: int, exc: BaseException | None) -> list[tuple]:
        return self._talk("the report", self._runner.finish, code, exc)

    def _raise_outcome(self, method: str, reports: list[tuple], exc: BaseException | None) -> None:
        """Rank 0's error, if any rank did not finish the call: the caller's Cancelled, rank 0's own error
        (also when every rank failed alike: bad input), or a WorkerError naming the failing ranks. A collective
        that failed on some rank (timed out, or a peer died) breaks the leader: every later call fails at once."""
        failed = [(r, e) for r, (c, e, _) in enumerate(reports) if c == FAILED]
        broken = [r for r, (_, _, b) in enumerate(reports) if b]
        if broken and self.unhealthy is None:
            self.unhealthy = (f"a collective failed on rank(s) {broken} during {method} ({failed[0][1]}); the "
                              "process groups cannot be trusted after that: restart the server")
            logger.error("%s", self.unhealthy)
        if not failed:
            if exc is not None:
                raise exc  # Cancelled on every rank (or a stream rank 0's reader closed)
            return
        if failed[0][0] == 0 and exc is not None and (len(failed) == 1 or len({e for _, e in failed}) == 1):
            raise exc  # rank 0's own error (alone, or the same on every rank that failed: bad input)
        names = "; ".join(f"rank {r}: {e}" for r, e in failed)
        after = ("this server cannot run more jobs: restart it" if self.unhealthy else
                 "the other ranks stopped with them and every rank is ready for the next request")
        raise WorkerError(f"{method} failed on {len(failed)} of {self.world_size} ranks ({names}); {after}",
                          rank=failed[0][0]) from exc

    def _talk(self, what: str, step: Any, *args: Any) -> Any:
        """A collective step on the control group; a failure there (a rank died or timed out) is final."""
        try:
            return step(*args)
        except (RuntimeError, dist.DistBackendError) as exc:
            if isinstance(exc, WorkerError):
                raise
            self.unhealthy = (f"the ranks lost contact during {what} ({describe(exc)}); this server cannot "
                              "run more jobs: restart it")
            logger.error("%s", self.unhealthy)
            raise WorkerError(self.unhealthy) from exc

    def _release(self) -> None:
        self._last_message = time.monotonic()
        self._lock.release()

    def _ping(self) -> None:
        while not self._stopping.wait(self._heartbeat_s / 2):
            recent = time.monotonic() - self._last_message < self._heartbeat_s
            if recent or not self._lock.acquire(blocking=False):  # a call under way talks to the ranks itself
                continue
            try:
                if self.unhealthy is None and not self._stopping.is_set():
                    self._talk("a keep-alive", self._channel.broadcast_bytes, pickle.dumps((PING, None)))
            except WorkerError:
                return
            finally:
                self._release()


class _LeaderStream:
    """Rank 0's VideoStream under several ranks: its chunks while every rank makes them, then the report. Read
    it to the end or close it: the control group is held until then."""

    def __init__(self, leader: RankLeader, stream: Any):
        self._leader = leader
        self._stream = stream
        self._started = False
        self._finished = False
        self._chunks = self._run()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def __iter__(self) -> Iterator[Any]:
        return self._chunks

    def _run(self) -> Iterator[Any]:
        self._started = True
        exc, code = None, STOPPED  # STOPPED: the reader stopped early; the others leave at their next step
        try:
            yield from self._stream
            code = DONE
        except GeneratorExit:
            raise
        except BaseException as error:  # noqa: BLE001 - reported, then raised
            exc, code = error, self._leader._runner.outcome(error)
        finally:
            reports = self._end(code, exc)
        self._leader._raise_outcome("stream_video", reports, exc)

    def _end(self, code: int, exc: BaseException | None) -> list[tuple]:
        self._finished = True
        try:
            return self._leader._report(code, exc)
        finally:
            self._leader._release()

    def close(self) -> None:
        """Stop reading (every rank stops with rank 0). Idempotent."""
        if self._finished:
            return
        started = self._started
        self._chunks.close()  # a started one reports as it closes; one never started has not
        if not started:
            self._end(STOPPED, None)

    def __del__(self) -> None:  # a stream dropped unread must not hold the ranks forever
        try:
            self.close()
        except Exception:  # noqa: BLE001 - nothing to tell at collection time
            pass


def follow(generator: Any, channel: ControlChannel) -> int:
    """A rank other than 0: run every call rank 0 broadcasts, until it says stop. Returns the process's exit
    code (1 when the control group failed: rank 0 died, or a collective timed out)."""
    runner = Runner(generator, channel)
    calls = 0
    try:
        while True:
            kind, payload = pickle.loads(channel.broadcast_bytes())
            if kind == STOP:
                logger.debug("rank %d: stopped after %d calls", channel.rank, calls)
                return 0
            if kind == PING:
                continue
            calls += 1
            call = runner.decode(payload)
            if call is None:
                continue
            exc = None
            try:
                result = runner.start(*call, None, SegmentsFromRank0(runner))
                if call[0] == "stream_video":
                    for _ in result:  # every chunk, as rank 0 makes it; rank 0's are the ones used
                        pass
            except Exception as error:  # noqa: BLE001 - reported to rank 0; this rank goes on
                exc = error
                if runner.outcome(error) == FAILED:
                    logger.warning("%s failed on this rank: %s", call[0], describe(error))
            runner.finish(runner.outcome(exc), exc)
    except RuntimeError as exc:  # the control group broke: nothing more can be served together
        logger.error("rank %d lost contact with the other ranks (%s); leaving", channel.rank, describe(exc))
        return 1
