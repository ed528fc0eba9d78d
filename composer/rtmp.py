"""RTMP out: a live stream's frames pushed to an RTMP server (nginx-rtmp, MediaMTX, YouTube Live...) as they are
made, through imageio-ffmpeg's ffmpeg binary (no extra dependency).

`RtmpPusher` starts ffmpeg at the first frames: raw RGB on its stdin, H.264 (yuv420p, `-tune zerolatency`) in FLV
out to the URL. Frames wait in a bounded buffer that a writer thread drains into ffmpeg, so `push` never blocks
(a stream's blocks may be made on the request loop's thread, which other requests share): a receiver that falls
further behind than the buffer, refuses the connection or goes away fails the push with `RtmpError`, at the
next `push` or at `close`, which waits a bounded time and then kills ffmpeg.

An RTMP URL often carries a secret: the stream key (in the path or the query), a password (in the userinfo).
Every message and log line shows `redact_url(url)` instead, and ffmpeg's own lines are scrubbed the same way.
"""

from __future__ import annotations

import functools
import math
import subprocess
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable
from urllib.parse import unquote, urlsplit

import numpy as np

from composer.errors import ComposerError, InvalidInputError, UnsupportedError
from composer.logging import get_logger

logger = get_logger(__name__)

SCHEMES = ("rtmp", "rtmps")
DEFAULT_PORTS = {"rtmp": 1935, "rtmps": 443}
BUFFER_SECONDS = 5.0  # video a receiver may fall behind by before the push fails
CLOSE_TIMEOUT = 10.0  # seconds `close` waits for ffmpeg to send what is buffered and exit
IO_TIMEOUT = 10.0  # seconds ffmpeg waits on a connect, the RTMP handshake or one network write (its -rw_timeout)
STDERR_LINES = 8  # ffmpeg's last lines kept for the error message
HIDDEN = "***"


class RtmpError(ComposerError):
    """Pushing a stream to an RTMP URL failed (refused, unreachable, too slow, ffmpeg failed). The message names
    the URL without its stream key and ends with ffmpeg's last lines."""


# -- URLs -------------------------------------------------------------------------------------------------


def redact_url(url: str) -> str:
    """The URL as messages show it: scheme, host, port and the application (the path's first segment) only.
    The stream key (the rest of the path), the query and any userinfo become '***':
    `rtmp://user:pw@live.example.com/app/KEY?token=T` -> `rtmp://***@live.example.com/app/***`."""
    try:
        parts = urlsplit(str(url))
        port = parts.port
    except ValueError:
        return "<a malformed URL>"
    host = parts.hostname or ""
    if ":" in host:  # IPv6
        host = f"[{host}]"
    user = f"{HIDDEN}@" if "@" in parts.netloc else ""
    shown = f"{parts.scheme}://{user}{host}" + (f":{port}" if port is not None else "")
    segments = parts.path.split("/")[1:]
    if len(segments) > 1 and segments[0]:  # /app/key: the application is not secret
        shown += "/" + segments[0]
        hidden = "/".join(segments[1:])
    else:  # /key alone
        hidden = "/".join(segments)
    if hidden or parts.query or parts.fragment:
        shown += "/" + HIDDEN
    return shown


def _secrets(url: str) -> list[str]:
    """The pieces of `url` that `redact_url` hides, longest first (to scrub them from ffmpeg's output)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return [url]
    segments = parts.path.split("/")[1:]
    hidden = segments[1:] if len(segments) > 1 and segments[0] else segments
    params = [p for p in parts.query.split("&") if p]
    pieces = ["/".join(hidden), *hidden, parts.query, *params, *(p.partition("=")[2] for p in params),
              parts.fragment, parts.password or "", parts.username or ""]
    pieces += [unquote(p) for p in pieces]
    return sorted({p for p in pieces if len(p) >= 3}, key=len, reverse=True)


def scrub(text: str, url: str) -> str:
    """`text` (ffmpeg's output, an OS error) with `url` and its secret pieces replaced by their redacted form."""
    text = text.replace(url, redact_url(url))
    for piece in _secrets(url):
        text = text.replace(piece, HIDDEN)
    return text


def check_rtmp_url(url: object, what: str = "rtmp_url") -> str:
    """`url` if it is an rtmp:// or rtmps:// URL with a host (and the ffmpeg binary speaks its protocol), else an
    InvalidInputError naming `what` (the field, or a flag: `--rtmp-url`) and the URL without its secret parts."""
    if not isinstance(url, str) or not url:
        given = repr(url) if isinstance(url, str) else f"a {type(url).__name__}"
        raise InvalidInputError(f"{what} = {given}: expected an RTMP URL such as "
                                "rtmp://live.example.com/app/STREAM_KEY")
    named = f"{what} {redact_url(url)}" if what.startswith("--") else f"{what} = {redact_url(url)!r}"
    if any(c.isspace() or ord(c) < 32 for c in url):
        raise InvalidInputError(f"{named}: an RTMP URL has no spaces or control characters")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError as exc:
        raise InvalidInputError(f"{named}: not a URL ({scrub(str(exc), url)})") from None
    if parts.scheme.lower() not in SCHEMES:
        raise InvalidInputError(f"{named}: expected an rtmp:// or rtmps:// URL (the scheme is "
                                f"{parts.scheme + '://' if parts.scheme else 'missing'})")
    if not parts.hostname:
        raise InvalidInputError(f"{named}: the URL names no host; expected {parts.scheme}://HOST[:PORT]/APP/STREAM_KEY")
    missing = ffmpeg_lacks(parts.scheme.lower())
    if missing:
        raise UnsupportedError(f"{named}: cannot push there: {missing}")
    return url


def _endpoint(url: str) -> tuple[str, str, int, str]:
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or DEFAULT_PORTS.get(scheme, 0), parts.path


def check_rtmp_prefix(prefix: str) -> str:
    """A server's allowed prefix (`composer serve --rtmp-allow`): an RTMP URL with a host, with or without a path;
    no query and no userinfo (a prefix is compared by its parts, not as text)."""
    try:
        parts = urlsplit(prefix)
        parts.port  # noqa: B018
    except ValueError as exc:
        raise InvalidInputError(f"--rtmp-allow {prefix!r}: not a URL ({exc})") from None
    if parts.scheme.lower() not in SCHEMES or not parts.hostname:
        raise InvalidInputError(f"--rtmp-allow {prefix!r}: expected rtmp://HOST[:PORT][/PATH] or rtmps://...")
    if parts.query or parts.fragment or "@" in parts.netloc:
        raise InvalidInputError(f"--rtmp-allow {redact_url(prefix)!r}: a prefix is a scheme, host, port and path; no "
                                "userinfo, query or fragment")
    return prefix


def url_allowed(url: str, prefixes: Iterable[str]) -> bool:
    """Whether `url` is under one of `prefixes`: the same scheme, host and port (defaults filled in), and a path
    that is the prefix's or goes on below it (`rtmp://h/live` allows `rtmp://h/live/KEY`, not `rtmp://h/liveX`).
    Compared by parts, never as text: `rtmp://127.0.0.1.evil.example/` or `rtmp://127.0.0.1@evil.example/` is not
    under `rtmp://127.0.0.1`."""
    try:
        scheme, host, port, path = _endpoint(url)
    except ValueError:
        return False
    for prefix in prefixes:
        p_scheme, p_host, p_port, p_path = _endpoint(prefix)
        if (scheme, host, port) != (p_scheme, p_host, p_port):
            continue
        base = p_path.rstrip("/")
        if not base or path == base or path.startswith(base + "/"):
            return True
    return False


@functools.cache
def ffmpeg_lacks(scheme: str = "rtmp") -> str | None:
    """Why imageio-ffmpeg's binary cannot push to `scheme` URLs (no binary, no such protocol, no flv muxer or
    libx264 encoder), or None when it can. Asked once per process."""
    try:
        import imageio_ffmpeg

        exe = imageio_ffmpeg.get_ffmpeg_exe()
    except Exception as exc:  # noqa: BLE001 - not installed, or no binary for this platform
        return f"imageio-ffmpeg's ffmpeg binary is not available ({exc})"
    found = {}
    for option in ("-protocols", "-muxers", "-encoders"):
        try:
            run = subprocess.run([exe, "-hide_banner", option], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.SubprocessError) as exc:
            return f"running {exe} failed ({exc})"
        found[option] = run.stdout.split()
    if scheme not in found["-protocols"]:
        return f"this ffmpeg build ({exe}) has no {scheme} protocol"
    if "flv" not in found["-muxers"]:
        return f"this ffmpeg build ({exe}) has no flv muxer"
    if "libx264" not in found["-encoders"]:
        return f"this ffmpeg build ({exe}) has no libx264 encoder"
    return None


# -- the pusher -------------------------------------------------------------------------------------------


class RtmpPusher:
    """Pushes uint8 frames [t, H, W, 3] to an RTMP URL as they come: `push` each chunk, then `close` (waits for
    ffmpeg to send the rest, at most `close_timeout` s) or `abort` (stops at once). `push` never blocks: frames
    wait in a buffer of `buffer_seconds` of video; a receiver further behind fails the push with RtmpError.
    Odd frame sizes are padded by one black row or column (H.264 4:2:0 needs even sizes)."""

    def __init__(self, url: str, fps: float, *, buffer_seconds: float = BUFFER_SECONDS,
                 close_timeout: float = CLOSE_TIMEOUT, io_timeout: float = IO_TIMEOUT):
        self.url = check_rtmp_url(url)
        self.shown = redact_url(url)
        if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not math.isfinite(fps) or fps <= 0:
            raise InvalidInputError(f"fps = {fps!r}: expected a frame rate > 0")
        self.fps = fps
        self.close_timeout = close_timeout
        self.io_timeout = io_timeout
        self.max_buffered = max(1, math.ceil(buffer_seconds * fps))  # frames
        self.size: tuple[int, int] | None = None  # (height, width), from the first frames
        self.frames = 0  # frames accepted by push
        self.sent = 0  # frames written to ffmpeg
        self._pending: deque[np.ndarray | None] = deque()  # chunks to write; None: the end
        self._buffered = 0  # frames in _pending
        self._cond = threading.Condition()
        self._stderr: deque[str] = deque(maxlen=STDERR_LINES)
        self._failure: str | None = None
        self._proc: subprocess.Popen | None = None
        self._threads: list[threading.Thread] = []
        self._finalizer: weakref.finalize | None = None
        self._done = False

    # -- the caller's side
    def push(self, frames: np.ndarray) -> None:
        """Queue frames for the receiver; RtmpError if the push has failed (now or earlier)."""
        frames = np.asarray(frames)
        if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
            raise InvalidInputError(f"expected uint8 frames [T, H, W, 3], got {frames.dtype} {list(frames.shape)}")
        if self._done:
            raise RtmpError(f"the push to {self.shown} is closed")
        if self._proc is None:
            self._start(frames.shape[1], frames.shape[2])
        elif frames.shape[1:3] != self.size:
            raise InvalidInputError(f"frames of {frames.shape[2]}x{frames.shape[1]}: the push to {self.shown} is "
                                    f"{self.size[1]}x{self.size[0]}")
        self._check()
        with self._cond:
            if self._buffered and self._buffered + len(frames) > self.max_buffered:
                behind = f"{self._buffered} frames ({self._buffered / self.fps:.1f} s of video)"
                self._fail_locked(f"the receiver is not keeping up: {behind} still wait to be sent")
            else:
                self._pending.append(np.ascontiguousarray(frames))
                self._buffered += len(frames)
                self.frames += len(frames)
                self._cond.notify_all()
        self._check()

    def close(self) -> None:
        """Send what is buffered and end the stream (ffmpeg flushes and exits), waiting at most `close_timeout`
        s; RtmpError if the push failed or did not finish in time (ffmpeg is then killed)."""
        if self._done:
            self._check()
            return
        self._done = True
        proc = self._proc
        if proc is None:
            return  # no frame came: nothing was started
        deadline = time.monotonic() + self.close_timeout
        with self._cond:
            self._pending.append(None)
            self._cond.notify_all()
        try:
            rc = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._kill()
            with self._cond:
                self._fail_locked(f"the receiver did not take the end of the stream within {self.close_timeout:g} s "
                                  "(ffmpeg was stopped)")
            rc = None
        self._join(deadline)
        if rc not in (None, 0):
            with self._cond:
                self._fail_locked(f"ffmpeg exited with code {rc}")
        self._check()
        logger.info("RTMP: pushed %d frames to %s", self.sent, self.shown)

    def abort(self) -> None:
        """Stop at once (the stream failed or was cancelled): ffmpeg is killed, nothing is raised."""
        self._done = True
        self._stop_writer()
        self._kill()
        self._join(time.monotonic() + 1.0)

    @property
    def running(self) -> bool:
        """Whether ffmpeg has been started and not yet closed or aborted."""
        return self._proc is not None and not self._done

    def __enter__(self) -> RtmpPusher:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # -- ffmpeg
    def _command(self, height: int, width: int) -> list[str]:
        import imageio_ffmpeg

        pad = ["-vf", "pad=ceil(iw/2)*2:ceil(ih/2)*2"] if height % 2 or width % 2 else []
        return [
            imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-nostats", "-loglevel", "warning",
            "-f", "rawvideo", "-pix_fmt", "rgb24", "-s", f"{width}x{height}", "-r", f"{self.fps:g}", "-i", "-",
            *pad, "-c:v", "libx264", "-preset", "veryfast", "-tune", "zerolatency", "-pix_fmt", "yuv420p",
            "-g", str(max(1, round(2 * self.fps))),  # a keyframe every 2 s: a viewer joining waits at most that
            "-rw_timeout", str(int(self.io_timeout * 1e6)),  # a silent server fails ffmpeg rather than hanging it
            "-flvflags", "no_duration_filesize", "-f", "flv", self.url,
        ]

    def _start(self, height: int, width: int) -> None:
        self.size = (height, width)
        if height % 2 or width % 2:
            logger.info("RTMP: %dx%d frames padded to even sizes for H.264 4:2:0", width, height)
        try:
            self._proc = subprocess.Popen(self._command(height, width), stdin=subprocess.PIPE,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        except OSError as exc:
            self._done = True
            raise RtmpError(f"pushing to {self.shown} failed: could not start ffmpeg ({scrub(str(exc), self.url)})") \
                from None
        # the process never outlives this object, even one dropped without close()
        self._finalizer = weakref.finalize(self, _kill, self._proc)
        logger.info("RTMP: pushing %dx%d at %g fps to %s", width, height, self.fps, self.shown)
        self._threads = [threading.Thread(target=self._write, name="composer-rtmp-writer", daemon=True),
                         threading.Thread(target=self._read_stderr, name="composer-rtmp-stderr", daemon=True)]
        for thread in self._threads:
            thread.start()

    def _write(self) -> None:
        """(The writer thread) Hand the buffered chunks to ffmpeg's stdin, in order; close it at the end."""
        proc = self._proc
        while True:
            with self._cond:
                while not self._pending:
                    self._cond.wait()
                chunk = self._pending[0]
            if chunk is None:
                break
            try:
                proc.stdin.write(chunk.reshape(-1).data)  # blocks while ffmpeg (the receiver) is behind: only
                proc.stdin.flush()  # this thread waits
            except (OSError, ValueError):  # ffmpeg exited (BrokenPipe) or was killed
                with self._cond:
                    if not self._done:  # (an abort kills it on purpose)
                        self._fail_locked("ffmpeg stopped taking frames")
                break
            with self._cond:
                if self._pending and self._pending[0] is chunk:
                    self._pending.popleft()
                    self._buffered -= len(chunk)
                self.sent += len(chunk)
        try:
            proc.stdin.close()  # ffmpeg encodes the rest, sends it and exits
        except (OSError, ValueError):  # a broken pipe: the flush of nothing fails
            pass

    def _read_stderr(self) -> None:
        """(The stderr reader) Keep ffmpeg's last lines, scrubbed of the URL's secrets, until it exits."""
        with self._proc.stderr as stderr:
            for raw in iter(stderr.readline, b""):
                line = scrub(raw.decode("utf-8", "replace").rstrip(), self.url)
                if line:
                    self._stderr.append(line)
                    logger.debug("RTMP ffmpeg: %s", line)

    def _check(self) -> None:
        """Raise the push's failure, if any: one seen by the threads, or ffmpeg gone early."""
        proc = self._proc
        if self._failure is None and proc is not None and not self._done and proc.poll() is not None:
            with self._cond:
                self._fail_locked(f"ffmpeg exited with code {proc.returncode}")
        if self._failure is not None:
            self._stop_writer()
            self._kill()
            for thread in self._threads[1:]:  # the stderr reader: ffmpeg's last lines, now that it is gone
                thread.join(timeout=1.0)
            said = " | ".join(self._stderr)
            raise RtmpError(f"pushing to {self.shown} failed ({self.sent} frames handed to ffmpeg): {self._failure}"
                            + (f"; ffmpeg said: {said}" if said else ""))

    def _fail_locked(self, why: str) -> None:
        if self._failure is None:
            self._failure = scrub(why, self.url)
            logger.warning("RTMP: pushing to %s failed: %s", self.shown, self._failure)

    def _stop_writer(self) -> None:
        """Drop the frames not yet written and let the writer thread end."""
        with self._cond:
            self._pending.clear()
            self._buffered = 0
            self._pending.append(None)
            self._cond.notify_all()

    def _kill(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # once: kills ffmpeg if it still runs

    def _join(self, deadline: float) -> None:
        for thread in self._threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


def _kill(proc: subprocess.Popen) -> None:
    """Kill ffmpeg if it still runs (its pipes end with it: the writer and the stderr reader see them close)."""
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover - a process that survives SIGKILL
        pass
