"""RTMP out (composer/rtmp.py): live streams pushed to a local RTMP receiver - imageio-ffmpeg's own ffmpeg listening on
127.0.0.1 (`ffmpeg -listen 1 -i rtmp://127.0.0.1:PORT/live/KEY -c copy received.flv`) - then decoded and compared
with the frames the stream yielded; through `stream_video(rtmp_url=...)`, `composer generate --rtmp-url` and a
WebSocket stream's `rtmp_url` field. Receivers that refuse or never answer give a clear error in bounded time, and
the stream key shows in no message and no log line.

H.264 4:2:0 is lossy: the received frames are held to a PSNR > 30 dB against the yielded ones, every frame (the
embedded shapes-causal model measured 36.9 dB at worst, 39.4 dB over a 37-frame video)."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest

from composer.errors import InvalidInputError
from composer.rtmp import (
    RtmpError,
    RtmpPusher,
    check_rtmp_prefix,
    check_rtmp_url,
    ffmpeg_lacks,
    redact_url,
    scrub,
    url_allowed,
)

pytestmark = pytest.mark.skipif(ffmpeg_lacks("rtmp") is not None,
                                reason=f"RTMP out needs imageio-ffmpeg's ffmpeg with rtmp: {ffmpeg_lacks('rtmp')}")

KEY = "sEcReT-kEy-4242"
PSNR_BOUND = 30.0  # dB, every frame: H.264 (yuv420p, crf 23) of the stream's frames
RED = "a red circle moving right"
FAST = {"guidance_scale": 1.0, "seed": 5}  # the shapes model's CFG off: half the work


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port: int) -> bool:
    """Whether something listens on 127.0.0.1:port, read from /proc (a probe connection would be the one connection
    `ffmpeg -listen 1` takes)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = [line.split() for line in Path(table).read_text().splitlines()[1:]]
        except OSError:
            continue
        if any(row[1].endswith(f":{port:04X}") and row[3] == "0A" for row in rows):  # 0A: LISTEN
            return True
    return False


class Receiver:
    """A local RTMP server: ffmpeg in listen mode, copying the one stream it receives to an FLV file."""

    def __init__(self, folder: Path, app: str = "live"):
        import imageio_ffmpeg

        self.port = free_port()
        self.prefix = f"rtmp://127.0.0.1:{self.port}/{app}"
        self.url = f"{self.prefix}/{KEY}"
        self.out = folder / f"received-{self.port}.flv"
        self.log = folder / f"receiver-{self.port}.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([imageio_ffmpeg.get_ffmpeg_exe(), "-hide_banner", "-loglevel", "warning",
                                          "-listen", "1", "-i", self.url, "-c", "copy", "-y", str(self.out)],
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 10
        while not listening(self.port):
            assert self.proc.poll() is None, self.log.read_text()
            if time.monotonic() > deadline:  # no /proc: give it a moment
                break
            time.sleep(0.02)

    def frames(self, timeout: float = 30) -> np.ndarray:
        """The frames received, once the sender has ended the stream."""
        self.proc.wait(timeout=timeout)
        assert self.out.is_file(), f"nothing received: {self.log.read_text()}"
        return iio.imread(self.out, plugin="pyav")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def receiver(tmp_path):
    rec = Receiver(tmp_path)
    yield rec
    rec.stop()


@pytest.fixture
def logged():
    """Every line composer logs meanwhile (its logger does not propagate to pytest's caplog), ffmpeg's too."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler, rtmp_logger = Keep(logging.DEBUG), logging.getLogger("composer.rtmp")
    level = rtmp_logger.level
    logging.getLogger("composer").addHandler(handler)
    rtmp_logger.setLevel(logging.DEBUG)
    yield lines
    logging.getLogger("composer").removeHandler(handler)
    rtmp_logger.setLevel(level)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


def assert_close(received: np.ndarray, sent: np.ndarray) -> None:
    assert received.shape == sent.shape
    worst = min(psnr(r, s) for r, s in zip(received, sent))
    assert worst > PSNR_BOUND, f"a frame came back at {worst:.1f} dB"


def moving_square(count: int, height: int = 64, width: int = 64) -> np.ndarray:
    frames = np.zeros((count, height, width, 3), np.uint8)
    for i in range(count):
        frames[i, 10:30, 2 * i:2 * i + 20] = (230, 40, 20)
        frames[i, 40:, :, 2] = 120
    return frames


# -- URLs ------------------------------------------------------------------------------------------------


def test_a_url_shows_without_its_stream_key():
    assert redact_url(f"rtmp://127.0.0.1:1935/live/{KEY}") == "rtmp://127.0.0.1:1935/live/***"
    assert redact_url(f"rtmps://user:pw@live.example.com/app/{KEY}?token=t0ken") == \
        "rtmps://***@live.example.com/app/***"
    assert redact_url(f"rtmp://live.example.com/{KEY}") == "rtmp://live.example.com/***"
    assert redact_url("rtmp://live.example.com/app") == "rtmp://live.example.com/***"  # one segment may be the key
    assert redact_url("rtmp://live.example.com") == "rtmp://live.example.com"
    url = f"rtmp://u:pass-word@h/app/{KEY}?token=t0ken"
    said = scrub(f"Error opening output {url}: refused; stream {KEY}; auth pass-word t0ken", url)
    assert KEY not in said and "pass-word" not in said and "t0ken" not in said and "rtmp://***@h/app/***" in said

    for bad, why in [(f"http://h/live/{KEY}", "expected an rtmp:// or rtmps:// URL"),
                     (f"rtmp:///live/{KEY}", "names no host"), (f"rtmp://h/live/{KEY} x", "no spaces"),
                     (f"rtmp://h:99999/live/{KEY}", "not a URL"), (42, "expected an RTMP URL")]:
        with pytest.raises(InvalidInputError, match=why) as caught:
            check_rtmp_url(bad)
        assert KEY not in str(caught.value) and str(caught.value).startswith("rtmp_url = ")
    with pytest.raises(InvalidInputError, match="^--rtmp-url http://h/live/\\*\\*\\*: expected"):
        check_rtmp_url(f"http://h/live/{KEY}", "--rtmp-url")


def test_a_server_allows_urls_under_its_prefixes_by_their_parts():
    allowed = ["rtmp://127.0.0.1:1935/live", "rtmps://cdn.example.com/app/"]
    assert url_allowed(f"rtmp://127.0.0.1:1935/live/{KEY}", allowed)
    assert url_allowed(f"rtmp://127.0.0.1/live/{KEY}", allowed)  # 1935: rtmp's port
    assert url_allowed(f"rtmps://CDN.example.com:443/app/{KEY}?t=1", allowed)
    for url in [f"rtmp://127.0.0.1:1936/live/{KEY}", f"rtmp://127.0.0.1:1935/liveX/{KEY}",
                f"rtmp://127.0.0.1.evil.example/live/{KEY}", f"rtmp://127.0.0.1@evil.example/live/{KEY}",
                f"rtmps://127.0.0.1:1935/live/{KEY}", f"rtmp://cdn.example.com/app/{KEY}", "rtmp://[::1/x"]:
        assert not url_allowed(url, allowed), url
    assert not url_allowed(f"rtmp://127.0.0.1/live/{KEY}", [])
    for bad in ["http://h/live", "rtmp://", "rtmp://h/live?key=1", "rtmp://u:p@h/live"]:
        with pytest.raises(InvalidInputError, match="--rtmp-allow"):
            check_rtmp_prefix(bad)


# -- the pusher ------------------------------------------------------------------------------------------


def test_the_pusher_sends_frames_that_a_receiver_decodes(receiver, logged):
    sent = moving_square(20)
    with RtmpPusher(receiver.url, 8) as pusher:
        for i in range(0, 20, 4):  # as a stream's chunks come
            pusher.push(sent[i:i + 4])
    assert pusher.sent == 20 and not pusher.running
    assert_close(receiver.frames(), sent)
    assert logged and not any(KEY in line for line in logged)
    assert f"RTMP: pushed 20 frames to {receiver.prefix}/***" in logged


def test_odd_sizes_are_padded_to_even_ones(receiver):
    sent = moving_square(6, 33, 47)
    with RtmpPusher(receiver.url, 8) as pusher:
        pusher.push(sent)
    received = receiver.frames()
    assert received.shape == (6, 34, 48, 3)  # one black row and column added
    assert_close(received[:, :33, :47], sent)


def test_a_refused_connection_fails_fast_without_the_key(logged):
    url = f"rtmp://127.0.0.1:{free_port()}/live/{KEY}"  # nothing listens there
    start = time.monotonic()
    pusher = RtmpPusher(url, 8)
    with pytest.raises(RtmpError) as caught:
        for _ in range(50):
            pusher.push(moving_square(4))
            time.sleep(0.05)
        pusher.close()
    message = str(caught.value)
    assert time.monotonic() - start < 10
    assert message.startswith(f"pushing to {redact_url(url)} failed") and "Connection refused" in message
    assert KEY not in message and not any(KEY in line for line in logged)
    assert pusher._proc.poll() is not None  # ffmpeg is gone


def test_a_silent_receiver_never_blocks_a_push_and_fails_in_bounded_time():
    """A server that accepts the connection and never answers the RTMP handshake: each push returns at once; the
    frames back up, and the push fails (buffer full, or ffmpeg's own I/O timeout) within seconds."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        url = f"rtmp://127.0.0.1:{silent.getsockname()[1]}/live/{KEY}"
        pusher = RtmpPusher(url, 8, buffer_seconds=1.0, io_timeout=2.0, close_timeout=2.0)
        start, slowest = time.monotonic(), 0.0
        with pytest.raises(RtmpError) as caught:
            while time.monotonic() - start < 20:
                began = time.monotonic()
                pusher.push(np.random.default_rng(0).integers(0, 256, (4, 64, 64, 3), dtype=np.uint8))
                slowest = max(slowest, time.monotonic() - began)
                time.sleep(0.05)
        assert time.monotonic() - start < 6 and slowest < 0.5
        assert KEY not in str(caught.value) and redact_url(url) in str(caught.value)
        assert pusher._proc.poll() is not None

        pusher = RtmpPusher(url, 8, io_timeout=60.0, close_timeout=1.0)  # ffmpeg would wait for a minute: close won't
        pusher.push(moving_square(2))
        start = time.monotonic()
        with pytest.raises(RtmpError, match="did not take the end of the stream within 1 s"):
            pusher.close()
        assert time.monotonic() - start < 3 and pusher._proc.poll() is not None


# -- stream_video --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def generator():
    from composer.generator import VideoGenerator

    return VideoGenerator.from_pretrained("shapes-causal", progress=False)


@pytest.mark.slow  # loads the embedded causal model (~5 s); the pusher tests above are the quick ones
def test_stream_video_pushes_what_it_yields(generator, receiver, logged):
    stream = generator.stream_video(RED, num_frames=37, rtmp_url=receiver.url, **FAST)
    chunks = [chunk.frames for chunk in stream]
    assert len(chunks) == 10  # the chunks were yielded as they came, as without RTMP
    sent = np.concatenate(chunks)
    received = receiver.frames()
    assert received.shape == (37, 64, 64, 3)
    assert_close(received, sent)
    assert not any(KEY in line for line in logged)

    with pytest.raises(InvalidInputError, match=r"rtmp_url = 'http://127.0.0.1/live/\*\*\*': expected an rtmp://"):
        generator.stream_video(RED, num_frames=9, rtmp_url=f"http://127.0.0.1/live/{KEY}", **FAST)


@pytest.mark.slow
def test_an_unreachable_url_ends_the_stream_with_a_clear_error(generator, logged):
    url = f"rtmp://127.0.0.1:{free_port()}/live/{KEY}"
    start = time.monotonic()
    stream = generator.stream_video(RED, num_frames=37, rtmp_url=url, **FAST)
    with pytest.raises(RtmpError, match="Connection refused") as caught:
        for _ in stream:
            pass
    assert time.monotonic() - start < 30
    assert str(caught.value).startswith(f"pushing to {redact_url(url)} failed") and KEY not in str(caught.value)
    assert not any(KEY in line for line in logged)
    assert not stream.rtmp.running and stream.rtmp._proc.poll() is not None


# -- the CLI -----------------------------------------------------------------------------------------------


def cli(*args):
    return subprocess.run([sys.executable, "-m", "composer.cli.main", *map(str, args)], capture_output=True,
                          text=True, env=os.environ.copy(), timeout=600)


@pytest.mark.slow
def test_generate_pushes_a_causal_models_stream(receiver, tmp_path):
    out = tmp_path / "pushed.mp4"
    run = cli("generate", "--model-path", "shapes-causal", "--prompt", RED, "--num-frames", "9", "--seed", "5",
              "--guidance-scale", "1", "--rtmp-url", receiver.url, "--output", out)
    assert run.returncode == 0, run.stderr
    assert f"pushing to {receiver.prefix}/*** as each block is made" in run.stdout
    assert "block 2 (segment 0)" in run.stdout  # --rtmp-url streams
    assert KEY not in run.stdout + run.stderr
    written = iio.imread(out, plugin="pyav")
    received = receiver.frames()
    assert received.shape == written.shape == (9, 64, 64, 3)
    assert_close(received, written)  # two lossy encodings of the same frames


@pytest.mark.slow
def test_generate_refuses_rtmp_for_a_model_that_does_not_stream_and_a_bad_url(tmp_path):
    run = cli("generate", "--model-path", "shapes-t2v", "--prompt", RED, "--rtmp-url",
              f"rtmp://127.0.0.1/live/{KEY}", "--output", tmp_path / "x.mp4")
    assert run.returncode == 1 and "--rtmp-url: " in run.stderr and "cannot stream it live" in run.stderr
    run = cli("generate", "--model-path", "shapes-causal", "--prompt", RED, "--rtmp-url", f"http://h/live/{KEY}",
              "--output", tmp_path / "x.mp4")
    assert run.returncode == 1 and "--rtmp-url http://h/live/***: expected an rtmp:// or rtmps:// URL" in run.stderr
    for text in (run.stdout, run.stderr):
        assert "Traceback" not in text and KEY not in text


# -- the WebSocket stream ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_websocket_stream_pushes_only_where_the_server_allows(generator, tmp_path, logged):
    pytest.importorskip("websockets", reason="live streams need the serve extra")
    from serve_support import Server
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect

    from composer.serve.app import ServeConfig
    from composer.serve.requests import ServerLimits

    def stream(srv, body):
        """The server's text messages to a stream's first message, and its close code."""
        messages = []
        with connect(f"ws://127.0.0.1:{srv.port}/v1/streams", open_timeout=30) as ws:
            ws.send(json.dumps(body))
            while True:
                try:
                    data = ws.recv(timeout=60)
                except ConnectionClosed as exc:
                    return messages, exc.rcvd.code if exc.rcvd else None
                if isinstance(data, str):
                    messages.append(json.loads(data))

    received_by = Receiver(tmp_path)
    refused_port = free_port()
    allowed = [received_by.prefix, f"rtmp://127.0.0.1:{refused_port}/live"]
    limits = ServerLimits(max_frames=200)
    srv = Server(lambda: generator, ServeConfig(output_dir=tmp_path / "serve", limits=limits, rtmp_allow=allowed))
    closed = Server(lambda: generator, ServeConfig(output_dir=tmp_path / "closed", limits=limits))
    try:
        srv.wait_ready()
        closed.wait_ready()
        body = {"prompt": RED, "num_blocks": 3, **FAST}
        # allowed: pushed while sent to the client, the whole video kept; the key in no record
        messages, code = stream(srv, {**body, "rtmp_url": received_by.url})
        assert code == 1000 and [m["type"] for m in messages] == ["started", "chunk", "chunk", "chunk", "done"]
        reference = np.concatenate([c.frames for c in generator.stream_video(RED, num_frames=9, **FAST)])
        assert_close(received_by.frames(), reference)
        job_id = messages[0]["id"]
        record = srv.request("GET", f"/v1/videos/{job_id}")
        assert record.json["status"] == "completed" and "rtmp_url" not in record.json["request"]
        assert KEY not in record.body.decode() and KEY not in srv.request("GET", "/v1/videos").body.decode()
        assert not any(KEY in p.read_text() for p in (tmp_path / "serve" / "jobs").glob("*.json"))

        # not under an allowed prefix, or a server that allows none: refused, naming the field
        for server, url, why in [(srv, f"rtmp://127.0.0.1:{received_by.port + 1}/live/{KEY}", "not under a prefix"),
                                 (srv, f"rtmp://127.0.0.1.evil.example:{received_by.port}/live/{KEY}", "not under"),
                                 (srv, f"http://127.0.0.1/live/{KEY}", "expected an rtmp://"),
                                 (closed, received_by.url, "start it with --rtmp-allow")]:
            messages, code = stream(server, {**body, "rtmp_url": url})
            assert code == 1008 and messages[-1]["type"] == "error", (url, messages)
            assert messages[-1]["error"]["param"] == "rtmp_url" and why in messages[-1]["error"]["message"]
            assert KEY not in json.dumps(messages)

        # allowed but nobody listens: the stream ends with the push's error; the server goes on
        messages, code = stream(srv, {**body, "rtmp_url": f"{allowed[1]}/{KEY}"})
        assert code == 1011 and messages[-1]["type"] == "error", messages
        said = messages[-1]["error"]["message"]
        assert "RtmpError: pushing to " in said and "Connection refused" in said and KEY not in said
        assert srv.request("GET", "/health").status == 200
        messages, code = stream(srv, body)
        assert code == 1000 and messages[-1]["type"] == "done"
        assert not any(KEY in line for line in logged)
        assert not any(KEY in p.read_text() for p in (tmp_path / "serve" / "jobs").glob("*.json"))
    finally:
        srv.stop()
        closed.stop()
        received_by.stop()


def failing_push(good: int):
    """An RtmpPusher.push that takes `good` chunks, then fails as a receiver that went away does (no ffmpeg)."""
    calls = []

    def push(pusher, frames):
        calls.append(len(frames))
        if len(calls) > good:
            raise RtmpError(f"pushing to {pusher.shown} failed ({sum(calls[:good])} frames handed to ffmpeg): Broken "
                            "pipe")
    return push


def test_a_push_that_fails_mid_stream_still_yields_the_chunk_it_failed_on(generator, monkeypatch):
    monkeypatch.setattr(RtmpPusher, "push", failing_push(good=1))
    stream = generator.stream_video(RED, num_frames=9, rtmp_url=f"rtmp://127.0.0.1/live/{KEY}", **FAST)
    got = []
    with pytest.raises(RtmpError, match="Broken pipe"):
        for chunk in stream:
            got.append(chunk.frames)
    assert [len(frames) for frames in got] == [1, 4]  # the second chunk was made: the caller has it too
    assert stream.stats.frames == 5


def test_generate_keeps_the_local_output_when_the_push_fails_mid_stream(tmp_path, monkeypatch, capsys):
    from composer.cli.main import main

    monkeypatch.setattr(RtmpPusher, "push", failing_push(good=1))
    out = tmp_path / "kept.mp4"
    code = main(["generate", "--model-path", "shapes-causal", "--prompt", RED, "--num-frames", "9", "--seed", "5",
                 "--guidance-scale", "1", "--rtmp-url", f"rtmp://127.0.0.1/live/{KEY}", "--output", str(out)])
    err = capsys.readouterr().err
    assert code == 1 and "failed" in err and "Broken pipe" in err and KEY not in err
    assert f"the local copy {out} was kept (5 frames)" in err
    assert iio.imread(out, plugin="pyav").shape == (5, 64, 64, 3)  # finished and closed: a whole, playable file
    assert list(tmp_path.iterdir()) == [out]  # no partial file left beside it
