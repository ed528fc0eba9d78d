"""Serving on several ranks under torchrun: rank 0 serves HTTP, every rank runs every call together.

    torchrun --nproc-per-node 2 -m composer serve --model-path ... --ulysses-degree 2

Every rank loads the model (joining the process group). Rank 0 runs the server with a `RankLeader` as its
generator; the other ranks run `follow`. For each call the worker makes (generate_video, stream_video,
set_lora, unset_lora) the leader pickles the call once and broadcasts the bytes on a gloo control group (CPU
tensors, so it sits beside NCCL on GPUs); every rank, rank 0 included, unpickles those bytes and runs the call
on its own generator. Calls run at once: each takes one of the channel's call slots (`slots`, serve's
--max-concurrent), runs on a thread of its own on every rank, and talks on its slot's own gloo group, so the
collectives of different calls never interleave; the model's transformer calls are planned by rank 0's step
scheduler (composer/parallel/plan.py), so every rank batches the same steps into the same calls. The protocol:

    message      on the message group: rank 0 broadcasts CALL (slot, method, args, kwargs), PING (an idle
                 keep-alive, also while calls run) or STOP (once no call runs)
    pre-flight   on the slot's group, as every step below: every rank says whether it could decode the call and
                 has what it needs (a LoRA file); any problem: every rank skips the call, rank 0 raises naming
                 the rank
    sync points  before each of the call's denoising steps (an engine hook that finds the call by the token its
                 requests carry) and before each lazily read stream segment, every rank gathers one status code:
                 rank 0's says "cancel" once its caller's token is cancelled, so every rank raises Cancelled at
                 the same step; a code saying a rank has left the call (it failed) makes the others leave it
                 too, at the same point
    report       every rank gathers its final code until all have one, then each rank's outcome; rank 0
                 raises an error naming the failing ranks (or the caller's Cancelled), and the slot is free

set_lora / unset_lora change the model every call uses: rank 0 sends them once no call runs (no call starts
while one waits), and the followers run them once their calls' threads have ended. A call whose seed is left to
chance gets rank 0's draw before it is sent.

A rank that fails outside a compute collective (before the first step, in a step's hook, in decoding) is thus
recovered from. A rank that fails alone inside one (an all-to-all in a transformer block) leaves its peers in
it until `dist_timeout`; the calls then fail on every rank, and since a collective group that timed out is
not reliable afterwards, the leader marks itself broken (`unhealthy`: /health answers 503) and every later
call fails at once: restart the server. A rank that dies breaks the control groups the same way (and under
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

from composer import seeds
from composer.errors import WorkerError
from composer.logging import get_logger
from composer.parallel.rank_protocol import (
    CALL,
    DONE,
    EXCLUSIVE,
    FAILED,
    PING,
    SLOTS,
    STOP,
    STOPPED,
    CallHooks,
    ControlChannel,
    LazySegments,
    Runner,
    SegmentsFromRank0,
    SegmentsToRanks,
    describe,
)

logger = get_logger(__name__)

_LOCAL_ONLY = ("submit_video", "agenerate_video", "astream_video", "open_session")
HEARTBEAT_S = 5.0  # an idle leader pings this often, so followers waiting for work never reach the timeout


def join_ranks(load_error: BaseException | None, timeout_s: float, slots: int = SLOTS) -> ControlChannel:
    """After every rank tried to load: make the control groups (`slots`: calls that may run at once) and agree
    that all loaded. Raises WorkerError naming the ranks that failed (on every rank)."""
    if not dist.is_initialized():
        if load_error is not None:  # it failed before joining: the others learn it from torchrun
            raise load_error
        raise WorkerError("the process group is not initialised: serving on several ranks needs torchrun and "
                          "parallel degrees (--ulysses-degree, --ring-degree, --tp-size, --cfg-parallel)")
    channel = ControlChannel(timeout_s, slots)
    errors = channel.gather_objects(describe(load_error) if load_error else None)
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e]
    if failed and load_error is not None and len(failed) == len(errors) and len(set(errors)) == 1:
        raise load_error  # every rank failed alike (a bad setting): its own error, as one process raises it
    if failed:
        raise WorkerError(f"loading failed on {len(failed)} of {channel.world_size} ranks "
                          f"({'; '.join(failed)})", rank=next(r for r, e in enumerate(errors) if e))
    return channel


def load_on_every_rank(load: Callable[[], Any], timeout_s: float,
                       slots: int = SLOTS) -> tuple[Any, ControlChannel]:
    """Every rank calls this together: `load()` (which joins the process group), then `join_ranks`. Returns
    (this rank's generator, the control channel); raises this rank's own load error, or a WorkerError naming
    the ranks that failed."""
    generator, error = None, None
    try:
        generator = load()
    except Exception as exc:  # noqa: BLE001 - told to the other ranks first
        error = exc
    channel = join_ranks(error, timeout_s, slots)  # raises on every rank when any failed
    return generator, channel


class NotRun(WorkerError):
    """A call no rank ran: some rank could not take it at the pre-flight."""


class RankLeader:
    """Rank 0's generator for the server: VideoGenerator's API (generate_video, stream_video, set_lora,
    unset_lora; other attributes are rank 0's generator's), each call run on every rank together. Calls from
    several threads run at once, up to one per slot of the channel (`slots`; more wait for a free one): rank 0's
    step scheduler plans every transformer call (composer/parallel/plan.py), so their steps batch as on one
    process. set_lora / unset_lora wait until no call runs, and no call starts while they wait or run."""

    def __init__(self, generator: Any, channel: ControlChannel, heartbeat_s: float = HEARTBEAT_S):
        self._generator = generator
        self._channel = channel
        self._hooks = CallHooks(generator, len(channel.calls))
        self._runners = [Runner(generator, c, self._hooks) for c in channel.calls]
        if not self._runners:
            raise ValueError("the control channel has no call slots (ControlChannel(slots=...) >= 1)")
        self._send = threading.Lock()  # one protocol message at a time: a call, a ping, the stop
        self._slots = threading.Condition()
        self._free = list(range(len(self._runners)))  # the slots no call holds
        self._exclusive = 0  # set_lora / unset_lora (or the stop) waiting for every slot: no call starts
        self._heartbeat_s = min(heartbeat_s, channel.timeout_s / 4)
        self._stopping = threading.Event()
        self._last_message = time.monotonic()
        self.unhealthy: str | None = None  # why the ranks can no longer serve (the server answers 503)
        self._pinger = threading.Thread(target=self._ping, name="composer-serve-ping", daemon=True)
        self._pinger.start()

    def __getattr__(self, name: str) -> Any:
        if name in _LOCAL_ONLY:  # rank 0's own request API: a call there would run on rank 0 alone
            raise AttributeError(f"{name} is not a call the ranks run together (use generate_video / stream_video)")
        return getattr(self._generator, name)

    @property
    def world_size(self) -> int:
        return self._channel.world_size

    @property
    def slots(self) -> int:
        """How many calls may run on the ranks at once."""
        return len(self._runners)

    # -- the API

    def generate_video(self, *args: Any, cancel: Any = None, **kwargs: Any) -> Any:
        """As VideoGenerator.generate_video, on every rank; rank 0's result. `cancel` stops every rank at the
        same denoising step."""
        args = self._seeded_args(args)
        return self._call("generate_video", args, self._seeded(kwargs, args), cancel)

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
            if self.unhealthy is not None or isinstance(exc, NotRun):  # broken, or ran nowhere: nothing to undo
                raise
            self._call("unset_lora", (), {})
            raise WorkerError(f"{exc}; every rank's LoRA adapters were then removed", rank=exc.rank) from exc

    def unset_lora(self) -> None:
        """As VideoGenerator.unset_lora, on every rank."""
        self._call("unset_lora", (), {})

    def stream_video(self, prompts: Any = None, *, cancel: Any = None, **kwargs: Any) -> _LeaderStream:
        """As VideoGenerator.stream_video, on every rank (each makes every chunk; rank 0's are yielded). A
        lazy segments iterator is read here, on rank 0, and each segment sent to the others as their pipelines
        ask. Iterate the stream to its end, or close it: until then it holds its call slot."""
        lazy = prompts is not None and not isinstance(prompts, (str, list, tuple))
        args = (LazySegments(live=callable(getattr(prompts, "ends_segment", None))),) if lazy else (prompts,)
        slots = self._take("stream_video")
        runner = self._runners[slots[0]]
        try:
            args = self._seeded_args(args)
            payload = self._send_call(slots[0], "stream_video", args, self._seeded(kwargs, args))
            call = self._decode_own(runner, "stream_video", payload)
            segments = SegmentsToRanks(runner, prompts, self._heartbeat_s) if lazy else None
            try:
                stream = runner.start(*call, cancel, segments)
            except BaseException as exc:
                self._raise_outcome("stream_video", self._report(runner, runner.outcome(exc), exc), exc)
                raise  # (_raise_outcome raises for any error: this is not reached)
            return _LeaderStream(self, stream, runner, slots)
        except BaseException:
            self._give(slots)
            raise

    def stop(self, timeout_s: float = 60.0) -> None:
        """Tell every other rank to leave (after the calls under way, waited for up to `timeout_s`)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        slots = self._take("the stop", timeout_s=timeout_s)
        if slots is None:
            logger.warning("calls still run after %.0f s; the other ranks are not told to stop", timeout_s)
            return
        try:
            with self._send:
                if self.unhealthy is None:
                    self._channel.broadcast_bytes(pickle.dumps((STOP, None)))
        except Exception as exc:  # noqa: BLE001 - nobody left to tell
            logger.warning("could not tell the other ranks to stop: %s", exc)
        finally:
            self._give(slots)
        self._pinger.join(timeout=2 * self._heartbeat_s)

    # -- the protocol

    @staticmethod
    def _seeded_args(args: tuple) -> tuple:
        """A CheckedRequest without a seed gets rank 0's draw (checked on its own: CheckedRequest.updated)."""
        from composer.request_check import CheckedRequest

        if args and isinstance(args[0], CheckedRequest) and args[0].sampling.seed is None:
            return (args[0].updated(seed=seeds.draw_seed()), *args[1:])
        return args

    def _seeded(self, kwargs: dict, args: tuple = ()) -> dict:
        """A call that leaves its seed to chance gets rank 0's draw here: every rank must draw the same noise, and
        calls running at once cannot agree on a seed collectively (their collectives would interleave). A request
        checked at submit (a CheckedRequest, the server's) carries its seed (the server draws a missing one)."""
        from composer.request_check import CheckedRequest

        if args and isinstance(args[0], CheckedRequest):
            return kwargs  # (_seeded_args gave it rank 0's draw when it had no seed)
        if kwargs.get("seed") is not None:
            return kwargs
        sampling = kwargs.get("sampling_param") or getattr(self._generator, "default_sampling", None)
        if getattr(sampling, "seed", None) is not None:
            return kwargs
        return {**kwargs, "seed": seeds.draw_seed()}

    def _take(self, method: str, timeout_s: float | None = None) -> list[int] | None:
        """A free slot for `method` (every slot for set_lora / unset_lora / the stop, once no call runs); None if
        `timeout_s` passed first."""
        exclusive = method in EXCLUSIVE or method == "the stop"
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._slots:
            if exclusive:
                self._exclusive += 1
            try:
                while len(self._free) < (len(self._runners) if exclusive else 1) or (self._exclusive and not exclusive):
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return None
                    self._slots.wait(left)
                taken = list(self._free) if exclusive else [min(self._free)]
                self._free = [s for s in self._free if s not in taken]
                return taken
            finally:
                if exclusive:
                    self._exclusive -= 1

    def _give(self, slots: list[int]) -> None:
        with self._slots:
            self._free += slots
            self._slots.notify_all()

    def _call(self, method: str, args: tuple, kwargs: dict, cancel: Any = None) -> Any:
        slots = self._take(method)
        runner = self._runners[slots[0]]
        try:
            payload = self._send_call(slots[0], method, args, kwargs)
            call = self._decode_own(runner, method, payload)
            exc = result = None
            try:
                result = runner.start(*call, cancel, None)
            except BaseException as error:  # noqa: BLE001 - reported, then raised below
                exc = error
            reports = self._report(runner, runner.outcome(exc), exc)
            self._raise_outcome(method, reports, exc)
            return result
        finally:
            self._give(slots)

    def _send_call(self, slot: int, method: str, args: tuple, kwargs: dict) -> bytes:
        """Broadcast the call, naming its slot (or raise, having sent nothing); returns its bytes."""
        try:
            payload = pickle.dumps((method, args, kwargs))
        except Exception as exc:  # noqa: BLE001 - nothing sent: the ranks stay ready
            raise WorkerError(f"{method}'s arguments cannot be sent to the other ranks: {exc}") from exc
        with self._send:
            if self.unhealthy is not None:
                raise WorkerError(f"{method} cannot run: {self.unhealthy}")
            if self._stopping.is_set():
                raise WorkerError(f"{method} cannot run: the server is stopping")
            message = pickle.dumps((CALL, (slot, method in EXCLUSIVE, payload)))
            self._talk(method, self._channel.broadcast_bytes, message)
            self._last_message = time.monotonic()
        return payload

    def _decode_own(self, runner: Runner, method: str, payload: bytes) -> tuple[str, tuple, dict]:
        """The pre-flight: rank 0 decodes the bytes it sent, as every rank does; all skip if any cannot."""
        call = self._talk(method, runner.decode, payload)
        if call is None:
            first, problem = runner.skipped[0]
            names = "; ".join(f"rank {r}: {p}" for r, p in runner.skipped)
            raise NotRun(f"{method} was not run on any of the {self.world_size} ranks: rank {first} could "
                         f"not take it ({names}); every rank is ready for the next request", rank=first)
        return call

    def _report(self, runner: Runner, code: int, exc: BaseException | None) -> list[tuple]:
        return self._talk("the report", runner.finish, code, exc)

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
        """A collective step on a control group; a failure there (a rank died or timed out) is final."""
        try:
            return step(*args)
        except (RuntimeError, dist.DistBackendError) as exc:
            if isinstance(exc, WorkerError):
                raise
            self.unhealthy = (f"the ranks lost contact during {what} ({describe(exc)}); this server cannot "
                              "run more jobs: restart it")
            logger.error("%s", self.unhealthy)
            raise WorkerError(self.unhealthy) from exc

    def _ping(self) -> None:
        """Keep-alives on the message group while no call is sent (the followers wait there for the next one,
        also while calls run: those talk on their slots' groups)."""
        while not self._stopping.wait(self._heartbeat_s / 2):
            if time.monotonic() - self._last_message < self._heartbeat_s or not self._send.acquire(blocking=False):
                continue
            try:
                if self.unhealthy is None and not self._stopping.is_set():
                    self._talk("a keep-alive", self._channel.broadcast_bytes, pickle.dumps((PING, None)))
                    self._last_message = time.monotonic()
            except WorkerError:
                return
            finally:
                self._send.release()


class _LeaderStream:
    """Rank 0's VideoStream under several ranks: its chunks while every rank makes them, then the report. Read
    it to the end or close it: its call slot is held until then."""

    def __init__(self, leader: RankLeader, stream: Any, runner: Runner, slots: list[int]):
        self._leader = leader
        self._stream = stream
        self._runner = runner
        self._slots = slots
        self._started = False
        self._finished = False
        self._chunks = self._run()

    def __getattr__(self, name: str) -> Any:
        if name == "next_task":  # rank 0's own stream's: its chunks are read through the protocol (iterate this)
            raise AttributeError("a stream on several ranks is read by iterating it")
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
            exc, code = error, self._runner.outcome(error)
        finally:
            reports = self._end(code, exc)
        self._leader._raise_outcome("stream_video", reports, exc)

    def _end(self, code: int, exc: BaseException | None) -> list[tuple]:
        self._finished = True
        try:
            return self._leader._report(self._runner, code, exc)
        finally:
            self._leader._give(self._slots)

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
    """A rank other than 0: run every call rank 0 broadcasts, until it says stop. Each call runs on a thread of
    its own, as on rank 0 (set_lora / unset_lora once the calls before them have ended). Returns the process's
    exit code (1 when a control group failed: rank 0 died, or a collective timed out)."""
    hooks = CallHooks(generator, len(channel.calls))
    runners = [Runner(generator, c, hooks) for c in channel.calls]
    threads: dict[int, threading.Thread] = {}  # slot -> the thread of its latest call
    broken = threading.Event()
    calls = 0
    try:
        while True:
            kind, payload = pickle.loads(channel.broadcast_bytes())
            if kind == STOP:
                _join(threads.values(), channel.timeout_s)
                logger.debug("rank %d: stopped after %d calls", channel.rank, calls)
                return 1 if broken.is_set() else 0
            if kind == PING:
                continue
            calls += 1
            slot, exclusive, data = payload
            if exclusive:  # rank 0 sent it once no call ran; the threads here end with their reports
                _join(threads.values(), channel.timeout_s)
                threads.clear()
                _run_call(runners[slot], data, broken)
                continue
            previous = threads.pop(slot, None)
            if previous is not None:  # past its report already (rank 0 freed the slot after it)
                previous.join(channel.timeout_s)
            thread = threading.Thread(target=_run_call, args=(runners[slot], data, broken), daemon=True,
                                      name=f"composer-rank-call-{slot}")
            thread.start()
            threads[slot] = thread
    except RuntimeError as exc:  # the control group broke: nothing more can be served together
        logger.error("rank %d lost contact with the other ranks (%s); leaving", channel.rank, describe(exc))
        return 1


def _join(threads: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for thread in list(threads):
        thread.join(max(0.0, deadline - time.monotonic()))


def _run_call(runner: Runner, data: bytes, broken: threading.Event) -> None:
    """A follower's side of one call on its slot: the pre-flight, the call (a stream read to its end: its
    chunks are rank 0's to use), the report."""
    try:
        call = runner.decode(data)
        if call is None:
            return
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
    except RuntimeError as exc:  # the call's group broke (a peer died or timed out): rank 0 knows it too
        broken.set()
        logger.error("rank %d lost contact with the other ranks during a call (%s)", runner.channel.rank,
                     describe(exc))
