"""The protocol the ranks of a multi-rank server follow on their control groups (composer/parallel/ranks.py).

`ControlChannel` is a gloo group for the messages (calls, keep-alives, the stop), with a group of its own for
each call slot: calls run at once, one per slot, and a call's collectives (pre-flight, sync points, report) use
its slot's group only, so they never interleave with another call's. `Runner` is one slot's side of a call on
one rank: the pre-flight, the sync points (before each of the call's denoising steps, found by `CallHooks`, and
each lazily read stream segment), and the report. A status code is gathered at each sync point: below FINAL the
rank is still in the call; FINAL and above, it has left it (done, failed, cancelled, or aborted because a peer
left).
"""

from __future__ import annotations

import os
import pickle
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from composer.cancel import CancelToken
from composer.engine.engine import EngineHook
from composer.engine.loop import Blocking
from composer.engine.scheduler import current_request
from composer.errors import Cancelled

CALL, PING, STOP = "call", "ping", "stop"
METHODS = ("generate_video", "stream_video", "set_lora", "unset_lora")
EXCLUSIVE = ("set_lora", "unset_lora")  # change the model every call uses: run while no other call runs
SLOTS = 4  # calls that may run at once on the ranks (serve: --max-concurrent)
# Status codes gathered at sync points. Below FINAL: still in the call; FINAL and above: this rank left it.
RUNNING, CANCEL, WAITING = 0, 1, 2
FINAL, DONE, FAILED, CANCELLED, ABORTED, STOPPED = 10, 10, 11, 12, 13, 14


class LazySegments:
    """Stands in, in a broadcast call, for a lazy segments iterator: each rank reads them from rank 0. `live`: the
    source may also end a segment early (its `ends_segment`, a live prompt switch): each answer is sent too."""

    def __init__(self, live: bool = False):
        self.live = live


class ControlChannel:
    """A gloo process group over every rank for the serving protocol (CPU tensors only), and `slots` more, one
    per call that may run at once (`calls`). Every rank makes it at the same point."""

    def __init__(self, timeout_s: float, slots: int = SLOTS):
        self.timeout_s = timeout_s
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.calls = [ControlChannel(timeout_s, slots=0) for _ in range(max(0, int(slots)))]

    def broadcast_bytes(self, data: bytes | None = None) -> bytes:
        """Rank 0's `data` on every rank: its length, then the bytes as a uint8 tensor."""
        size = torch.tensor([len(data) if self.rank == 0 else 0], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.group)
        if self.rank == 0:
            buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buffer = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(buffer, src=0, group=self.group)
        return data if self.rank == 0 else buffer.numpy().tobytes()

    def gather_codes(self, code: int) -> list[int]:
        """Every rank's status code, rank order."""
        mine = torch.tensor([code], dtype=torch.int64)
        out = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(out, mine, group=self.group)
        return [int(t.item()) for t in out]

    def gather_objects(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out


def broke_a_group(exc: BaseException | None) -> bool:
    """Whether an error came from a collective (a peer timed out or died): that group is unreliable after."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("gloo" in text or "nccl" in text)


def describe(exc: BaseException | None) -> str:
    text = str(exc).strip().splitlines()[0] if exc is not None and str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class PeerLeft(Exception):
    """Another rank left the call (it failed): this rank leaves it too, at the same sync point."""


class Call:
    """The call under way on this rank: what its sync points contribute and what they learnt."""

    def __init__(self, cancel: Any = None):
        self.cancel = cancel  # rank 0: the caller's CancelToken; followers: None
        self.cancelled = False
        self.left: list[int] = []  # the ranks whose leaving ended this call here


class CallHooks(EngineHook):
    """Engine hook on every rank (one per generator): a sync point before each denoising step of a call made
    through the protocol. Calls run at once, their steps on their own threads (a parallel layout's requests do);
    each call's requests carry a token of its own (never cancelled: it names the call), by which its step finds
    its Runner. A step of no protocol call has no sync point."""

    def __init__(self, generator: Any, slots: int = SLOTS):
        self._runners: dict[int, Runner] = {}
        self._lock = threading.Lock()
        core = getattr(generator, "core", None)
        if core is not None:  # every call at once may wait at a sync point on a stage thread, and still go on
            core.ensure_stage_threads(slots + 1)
        for engine in getattr(getattr(generator, "pipeline", None), "engines", []):
            engine.add_hook(self)

    def bind(self, runner: Runner, caller: Any = None) -> CancelToken:
        token = CancelToken(on_behalf_of=caller)
        with self._lock:
            self._runners[id(token)] = runner
        return token

    def unbind(self, token: CancelToken | None) -> None:
        if token is not None:
            with self._lock:
                self._runners.pop(id(token), None)

    def before_step(self, info: Any) -> Blocking | None:
        """The call's sync point, as a wait (Blocking: the gather runs on a stage thread of the engine core, whose
        own thread goes on with the other requests' work; driven on a thread, there and then)."""
        request = current_request()
        token = getattr(request, "cancel", None)
        with self._lock:
            runner = self._runners.get(id(token)) if token is not None else None
        return Blocking(runner.sync_point) if runner is not None else None


class Runner:
    """One call slot's side of the protocol on one rank: runs the broadcast calls on its generator, with the
    sync points, on the slot's channel."""

    def __init__(self, generator: Any, channel: ControlChannel, hooks: CallHooks):
        self.generator = generator
        self.channel = channel
        self.hooks = hooks
        self.call: Call | None = None
        self.token: CancelToken | None = None  # names the call's requests (CallHooks)
        self.skipped: list[tuple[int, str]] = []  # the last call's pre-flight problems, by rank

    # -- sync points (every rank, the same number of times in a call)

    def sync_point(self, code: int | None = None) -> list[int]:
        """Gather every rank's code; raise Cancelled if rank 0 asks, PeerLeft if a rank has left the call."""
        call = self.call
        if call is None:  # a call not made through the protocol (nothing to agree with)
            return []
        if code is None:
            code = CANCEL if call.cancel is not None and call.cancel.cancelled else RUNNING
        codes = self.channel.gather_codes(code)
        left = [r for r, c in enumerate(codes) if c >= FINAL]
        if left:
            call.left = left
            raise PeerLeft(f"rank(s) {left} left the call")
        if CANCEL in codes:
            call.cancelled = True
            reason = call.cancel.reason if call.cancel is not None else "cancelled on rank 0"
            raise Cancelled(f"request cancelled ({reason})")
        return codes

    # -- one call

    def decode(self, data: bytes) -> tuple[str, tuple, dict] | None:
        """Unpickle a call and check it can run here; None (on every rank) when some rank cannot."""
        problem, self.skipped = None, []
        try:
            method, args, kwargs = pickle.loads(data)
            self.preflight(method, args, kwargs)
        except Exception as exc:  # noqa: BLE001 - told to every rank, which all skip the call
            problem = describe(exc)
        problems = self.channel.gather_objects(problem)
        self.skipped = [(r, p) for r, p in enumerate(problems) if p]
        return None if self.skipped else (method, args, kwargs)

    def preflight(self, method: str, args: tuple, kwargs: dict) -> None:
        """What this rank checks before any rank starts: the method, and files it must read itself."""
        if method not in METHODS:
            raise ValueError(f"{method!r} is not a call ranks serve (expected one of {', '.join(METHODS)})")
        if method == "set_lora":
            paths = args[0] if args else kwargs.get("paths")
            paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths or [])
            from composer.accel.lora_names import find_lora_file

            for path in paths:  # what set_lora itself reads first: a file, or a folder holding one
                find_lora_file(path)

    def start(self, method: str, args: tuple, kwargs: dict, cancel: Any, segments: Any) -> Any:
        """Begin the call on this rank's generator (a stream is returned unread)."""
        self.call = Call(cancel)
        if method == "stream_video" and args and isinstance(args[0], LazySegments):
            if args[0].live:  # the sampler finds `ends_segment` on the source it is given (generator.stream_video)
                segments.ends_segment = segments.cut
            args = (segments, *args[1:])
        if method in ("generate_video", "stream_video"):  # the call's requests carry its token (CallHooks)
            self.token = self.hooks.bind(self, cancel)
            kwargs = {**kwargs, "cancel": self.token}
        return getattr(self.generator, method)(*args, **kwargs)

    def outcome(self, exc: BaseException | None) -> int:
        call = self.call
        if exc is None:
            return DONE
        if call is not None and call.left and isinstance(exc, PeerLeft):
            return ABORTED
        if call is not None and call.cancelled and isinstance(exc, Cancelled):
            return CANCELLED
        return FAILED

    def finish(self, code: int, exc: BaseException | None) -> list[tuple]:
        """The report: gather codes until every rank has left the call, then every rank's (code, error)."""
        self.call = None  # no more sync points of this call here
        self.hooks.unbind(self.token)
        self.token = None
        while True:
            codes = self.channel.gather_codes(code)
            if all(c >= FINAL for c in codes):
                break
        failed = code == FAILED
        report = (code, describe(exc) if failed else None, failed and broke_a_group(exc))
        return self.channel.gather_objects(report)


class SegmentsFromRank0:
    """A follower's segments: each next one as rank 0 reads it (every rank asks at the same point)."""

    def __init__(self, runner: Runner):
        self.runner = runner

    def __iter__(self) -> Iterator[tuple[str, int]]:
        while True:
            while self.runner.sync_point()[0] == WAITING:  # rank 0 still waits for its source
                pass
            item = pickle.loads(self.runner.channel.broadcast_bytes())
            if item is None:
                return
            yield item

    def cut(self, block_index: int) -> bool:
        """Rank 0's source's answer to ends_segment(block_index) (a sync point, then the answer's byte)."""
        self.runner.sync_point()
        return self.runner.channel.broadcast_bytes() == b"\x01"


class SegmentsToRanks:
    """Rank 0's segments: read from the caller's lazy source (in a thread: it may wait for a client for
    long), keeping every rank informed meanwhile, then broadcast."""

    def __init__(self, runner: Runner, source: Iterator, heartbeat_s: float):
        self.source_cut = getattr(source, "ends_segment", None)
        self.runner, self.source, self.heartbeat_s = runner, iter(source), heartbeat_s

    def cut(self, block_index: int) -> bool:
        """The source's ends_segment(block_index), told to every rank (the sampler asks on every rank at the same
        block, so all of them end the segment there or none does)."""
        answer = bool(self.source_cut(block_index))
        self.runner.sync_point()
        self.runner.channel.broadcast_bytes(b"\x01" if answer else b"\x00")
        return answer

    def __iter__(self) -> Iterator[tuple[str, int]]:
        while True:
            box, ready = _next_in_thread(self.source)
            while True:
                got = ready.wait(self.heartbeat_s)
                if got and "error" in box:
                    raise box["error"]
                call = self.runner.call
                cancel = call is not None and call.cancel is not None and call.cancel.cancelled
                self.runner.sync_point(CANCEL if cancel else RUNNING if got else WAITING)
                if got:
                    break
            self.runner.channel.broadcast_bytes(pickle.dumps(box["item"]))
            if box["item"] is None:
                return
            yield box["item"]


def _next_in_thread(source: Iterator) -> tuple[dict[str, Any], threading.Event]:
    """next(source) on a thread: ({"item": ...} or {"error": ...}, set when there); item None at the end."""
    box: dict[str, Any] = {}
    ready = threading.Event()

    def pull() -> None:
        try:
            box["item"] = next(source)
        except StopIteration:
            box["item"] = None
        except BaseException as exc:  # noqa: BLE001 - raised on the stream's thread
            box["error"] = exc
        ready.set()

    threading.Thread(target=pull, name="composer-serve-segments", daemon=True).start()
    return box, ready


