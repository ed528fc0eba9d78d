"""Live WebSocket streams (`/v1/streams`) end to end: a real server on 127.0.0.1 over the embedded causal shapes
model (64x64, one latent frame per block, CFG off for speed) and the `websockets` sync client.

A scripted wrapper of the loaded generator makes some streams deterministic or heavy: with `hold` set, a stream
waits after its first chunk until the client's prompt switch or stop has arrived (so the block it takes effect
from is known); prompts starting "noise" stream random 4-frame chunks at once, without the model (big,
incompressible JPEGs, to fill socket buffers)."""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import socket
import struct
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="composer serve needs the serve extra (fastapi, uvicorn, websockets)")
pytest.importorskip("uvicorn", reason="composer serve needs the serve extra (fastapi, uvicorn, websockets)")
pytest.importorskip("websockets", reason="live streams need the serve extra (fastapi, uvicorn, websockets)")
import PIL.Image
from serve_support import Server
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from composer.errors import Cancelled
from composer.generator import VideoGenerator
from composer.serve.app import ServeConfig
from composer.serve.requests import ServerLimits
from composer.video import read_frames

RED, BLUE = "a red circle moving right", "a blue square moving left"
FAST = {"guidance_scale": 1.0, "seed": 5}  # the shapes model's CFG off: half the work
FRAMES_OF_3_BLOCKS = [1, 4, 4]  # one latent frame per block: 1 frame, then 4 per block


class Scripted:
    """The real causal generator, plus `hold` (wait after the first chunk for a switch or stop) and "noise"."""

    def __init__(self, generator: VideoGenerator):
        self._generator = generator
        self.hold = False
        self.produced = 0  # chunks the noise streams made
        self.gate = threading.Event()

    def __getattr__(self, name):
        return getattr(self._generator, name)

    def generate_video(self, prompt=None, *, cancel=None, **kwargs):
        if prompt.startswith("gate"):  # a job that runs until the test cancels it
            while not self.gate.wait(0.01):
                cancel.check()
        return self._generator.generate_video(prompt, cancel=cancel, **kwargs)

    def stream_video(self, prompts, *, keep_video=True, cancel=None, **kwargs):
        if prompts.prompt.startswith("noise"):
            return self._noise(prompts, cancel, kwargs["height"], kwargs["width"])
        stream = self._generator.stream_video(prompts, keep_video=keep_video, cancel=cancel, **kwargs)
        return self._held(stream, prompts, cancel) if self.hold else stream

    def _held(self, stream, prompts, cancel):
        for i, chunk in enumerate(stream):
            yield chunk
            if i == 0:
                deadline = time.time() + 30
                while not (prompts.pending or prompts.stopped):
                    cancel.check()
                    assert time.time() < deadline, "the client's message never arrived"
                    time.sleep(0.005)

    def _noise(self, prompts, cancel, height, width):
        rng = np.random.default_rng(0)
        for i in range(prompts.num_blocks):
            if cancel.cancelled:
                raise Cancelled("request cancelled")
            frames = rng.integers(0, 256, (4, height, width, 3), dtype=np.uint8)
            self.produced += 1
            yield SimpleNamespace(frames=frames, block_index=i, start_frame=4 * i, prompt=prompts.prompt)


class SwitchAt:
    """A live segment source for stream_video: `first` until block `at`, then `then` (what a client's switch is)."""

    def __init__(self, first: str, then: str, at: int, total: int):
        self._segments = iter([(first, total), (then, total - at)])
        self.at = at

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._segments)

    def ends_segment(self, block_index: int) -> bool:
        return block_index == self.at


@pytest.fixture(scope="module")
def generator():
    return VideoGenerator.from_pretrained("shapes-causal", progress=False)


@pytest.fixture(scope="module")
def reference(generator):
    """The 3-block red video stream_video makes, chunk by chunk."""
    return [c.frames for c in generator.stream_video(RED, num_frames=9, **FAST)]


@pytest.fixture
def scripted(generator):
    return Scripted(generator)


def start(scripted, tmp_path, ws_ping_interval: float = 20.0, ws_ping_timeout: float = 20.0, **config) -> Server:
    srv = Server(lambda: scripted, ServeConfig(output_dir=tmp_path / "serve", limits=ServerLimits(max_frames=200),
                                               **config), ws_ping_interval=ws_ping_interval,
                 ws_ping_timeout=ws_ping_timeout)  # uvicorn's keepalive (its defaults unless given)
    srv.wait_ready()
    return srv


@pytest.fixture
def server(scripted, tmp_path):
    srv = start(scripted, tmp_path)
    yield srv
    scripted.gate.set()
    srv.stop()


def open_stream(srv: Server, small_buffer: bool = False):
    sock = None
    if small_buffer:  # a small receive window: a client that does not read fills the server's buffers soon
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 * 1024)
        sock.connect(("127.0.0.1", srv.port))
    return connect(f"ws://127.0.0.1:{srv.port}/v1/streams", sock=sock, max_queue=2 if small_buffer else 16,
                   open_timeout=30)


def read(ws, until: str | None = None, timeout: float = 60) -> tuple[list[dict], int | None]:
    """Messages until one of type `until` (its frames too, for a chunk) or the close; chunks carry their decoded
    JPEGs as "images" and every message its arrival time as "at". Returns (messages, close code or None)."""
    messages: list[dict] = []
    while True:
        if until and messages and messages[-1]["type"] == until and \
                (until != "chunk" or len(messages[-1]["images"]) == messages[-1]["frames"]):
            return messages, None
        try:
            data = ws.recv(timeout=timeout)
        except ConnectionClosed as exc:
            return messages, exc.rcvd.code if exc.rcvd else None
        if isinstance(data, bytes):
            assert messages and messages[-1]["type"] == "chunk", "a frame outside a chunk"
            messages[-1]["images"].append(np.asarray(PIL.Image.open(io.BytesIO(data)).convert("RGB")))
            continue
        message = json.loads(data)
        message["at"] = time.time()
        if message["type"] == "chunk":
            message["images"] = []
        messages.append(message)


def chunks_of(messages: list[dict]) -> list[dict]:
    return [m for m in messages if m["type"] == "chunk"]


def metric(text: str, name: str) -> float:
    """The value of the /metrics line `name value`."""
    return next(float(line.split()[1]) for line in text.splitlines() if line.split(" ")[0] == name)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * np.log10(255**2 / mse)


def test_a_stream_sends_each_block_as_it_is_decoded_and_saves_the_whole_video(server, reference, tmp_path):
    with open_stream(server) as ws:
        ws.send(json.dumps({"prompt": RED, "num_blocks": 3, **FAST}))
        messages, code = read(ws)
    assert code == 1000
    assert [m["type"] for m in messages] == ["started", "chunk", "chunk", "chunk", "done"]
    started, chunks, done = messages[0], messages[1:4], messages[4]
    job_id = started["id"]
    assert started == {"type": "started", "id": job_id, "seed": 5, "fps": 8, "height": 64, "width": 64,
                       "num_blocks": 3, "at": started["at"]}
    assert [(c["index"], c["block"], c["frames"], c["first_frame"], c["prompt"]) for c in chunks] == [
        (0, 0, 1, 0, RED), (1, 1, 4, 1, RED), (2, 2, 4, 5, RED)]
    assert [len(c["images"]) for c in chunks] == FRAMES_OF_3_BLOCKS
    assert all(c["fps"] > 0 for c in chunks)  # the rate the stream reached (its stats' fps) at each chunk
    assert all(image.shape == (64, 64, 3) for c in chunks for image in c["images"])
    for chunk, expected in zip(chunks, reference):  # stream_video's frames, through JPEG
        assert psnr(np.stack(chunk["images"]), expected) > 30
    assert done == {"type": "done", "id": job_id, "frames": 9, "video": f"/v1/videos/{job_id}/content",
                    "at": done["at"]}

    job = server.request("GET", f"/v1/videos/{job_id}").json
    assert job["kind"] == "stream" and job["status"] == "completed" and job["progress"] == 100
    assert chunks[0]["at"] < job["times"]["completed_at"]  # the first block arrived before the video was finished
    assert [j["kind"] for j in server.request("GET", "/v1/videos").json["data"]] == ["stream"]
    reply = server.request("GET", done["video"])
    assert reply.status == 200 and reply.headers["content-type"] == "video/mp4"
    (tmp_path / "stream.mp4").write_bytes(reply.body)
    saved = read_frames(tmp_path / "stream.mp4")
    assert saved.shape == (9, 64, 64, 3) and psnr(saved, np.concatenate(reference)) > 25

    metrics = server.request("GET", "/metrics").body.decode()
    assert "composer_stream_first_chunk_seconds_count 1" in metrics
    first = metric(metrics, "composer_stream_first_chunk_seconds_sum")
    assert 0 < first < job["times"]["completed_at"] - job["started_at"]
    assert 'composer_streams{state="completed"} 1' in metrics and "composer_streams_open 0" in metrics
    assert 'composer_jobs{state="completed"} 1' in metrics


def test_a_stream_with_a_target_frame_rate_states_it_and_gives_the_same_frames(server, reference):
    with open_stream(server) as ws:
        ws.send(json.dumps({"prompt": RED, "num_blocks": 3, "target_fps": 1000, **FAST}))
        messages, code = read(ws)
    assert code == 1000 and messages[0]["type"] == "started" and messages[0]["target_fps"] == 1000.0
    for chunk, expected in zip(chunks_of(messages), reference):  # the stream's steps went first; same frames
        assert psnr(np.stack(chunk["images"]), expected) > 30
    job = server.request("GET", f"/v1/videos/{messages[0]['id']}").json
    assert job["status"] == "completed" and job["request"]["target_fps"] == 1000.0


def labelled(text: str, name: str) -> dict[str, float]:
    """The /metrics lines `name{stream="id"} value` as {id: value}."""
    prefix = name + '{stream="'
    return {line[len(prefix):line.index('"}')]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith(prefix)}


def test_metrics_show_a_running_streams_fps_and_the_kv_pool(server, scripted):
    """While a stream runs: its frame rate (and target) by id, its KV pages in use; once it ends its series are
    gone (only running streams are labelled) and the pool's peak stays."""
    text = server.request("GET", "/metrics").body.decode()
    for name in ("budget_bytes", "used_bytes", "allocated_bytes", "peak_used_bytes", "sessions", "waiting",
                 "shared_pages"):
        assert f"# TYPE composer_kv_pool_{name} gauge" in text, name
    assert "composer_kv_pool_budget_bytes +Inf" in text and "# TYPE composer_kv_pool_waits_total counter" in text
    assert "# TYPE composer_stream_fps gauge" in text and labelled(text, "composer_stream_fps") == {}
    scripted.hold = True  # the stream waits after its first chunk until the client stops it
    with open_stream(server) as ws:
        ws.send(json.dumps({"prompt": RED, "num_blocks": 3, "target_fps": 50, **FAST}))
        messages, _ = read(ws, until="chunk")
        stream_id = messages[0]["id"]
        assert messages[-1]["fps"] > 0  # the chunk message says the rate reached so far
        text = server.request("GET", "/metrics").body.decode()
        assert labelled(text, "composer_stream_fps")[stream_id] > 0
        assert labelled(text, "composer_stream_target_fps") == {stream_id: 50.0}
        assert metric(text, "composer_kv_pool_sessions") == 1 and metric(text, "composer_kv_pool_used_bytes") > 0
        ws.send(json.dumps({"type": "stop"}))
        read(ws)
    server.wait(stream_id)
    text = server.request("GET", "/metrics").body.decode()
    assert labelled(text, "composer_stream_fps") == {} and labelled(text, "composer_stream_target_fps") == {}
    assert metric(text, "composer_kv_pool_sessions") == 0 and metric(text, "composer_kv_pool_used_bytes") == 0
    assert metric(text, "composer_kv_pool_peak_used_bytes") > 0


def test_a_whole_video_model_has_no_kv_pool_metrics(tmp_path):
    t2v = VideoGenerator.from_pretrained(None, progress=False)
    srv = Server(lambda: t2v, ServeConfig(output_dir=tmp_path / "serve"))
    try:
        srv.wait_ready()
        text = srv.request("GET", "/metrics").body.decode()
    finally:
        srv.stop()
    assert "composer_kv_pool" not in text and "# TYPE composer_stream_fps gauge" in text


def test_a_prompt_switch_takes_effect_from_the_next_block(server, scripted, generator, reference):
    scripted.hold = True  # block 1 starts only once the switch is in
    with open_stream(server) as ws:
        ws.send(json.dumps({"prompt": RED, "num_blocks": 3, **FAST}))
        first, _ = read(ws, until="chunk")
        ws.send(json.dumps({"type": "prompt", "prompt": BLUE}))
        rest, code = read(ws)
    assert code == 1000
    messages = first + rest
    assert [m["type"] for m in messages] == ["started", "chunk", "prompt", "chunk", "chunk", "done"]
    assert {k: messages[2][k] for k in ("prompt", "from_block")} == {"prompt": BLUE, "from_block": 1}
    chunks = chunks_of(messages)
    assert [(c["block"], c["prompt"]) for c in chunks] == [(0, RED), (1, BLUE), (2, BLUE)]
    # what was shown before the switch is the unswitched video's; after it, stream_video with the same switch
    assert psnr(chunks[0]["images"][0], reference[0][0]) > 30
    switched = generator.stream_video(SwitchAt(RED, BLUE, at=1, total=3), **FAST)
    expected = [c.frames for c in switched]
    assert [c.prompt for c in switched.chunks] == [RED, BLUE, BLUE]
    for chunk, frames in zip(chunks, expected):
        assert psnr(np.stack(chunk["images"]), frames) > 30
    assert psnr(np.concatenate(expected[1:]), np.concatenate(reference[1:])) < 25  # the switch changed them


def test_a_cut_segment_gives_the_explicit_segments_when_rollouts_are_one_block(generator):
    """The sampler's cut (ends_segment) against an explicit segment list: with one-block rollouts both draw the
    same noise, so a switch at block 1 of a 2-block red segment is [(red, 1), (blue, 1)] exactly."""
    kwargs = {**FAST, "rollout_blocks": 1}
    live = generator.stream_video(SwitchAt(RED, BLUE, at=1, total=2), **kwargs)
    live_frames = np.concatenate([c.frames for c in live])
    explicit = generator.stream_video([(RED, 1), (BLUE, 1)], **kwargs)
    np.testing.assert_array_equal(live_frames, np.concatenate([c.frames for c in explicit]))
    assert [(c.block_index, c.segment, c.prompt) for c in live.chunks] == [(0, 0, RED), (1, 1, BLUE)]


def test_stop_ends_the_stream_after_the_current_block_and_keeps_the_video(server, scripted, tmp_path):
    scripted.hold = True
    with open_stream(server) as ws:
        ws.send(json.dumps({"prompt": RED, "num_blocks": 4, **FAST}))
        read(ws, until="chunk")
        ws.send(json.dumps({"type": "stop"}))
        rest, code = read(ws)
    assert code == 1000 and [m["type"] for m in rest] == ["done"] and rest[0]["frames"] == 1
    job = server.request("GET", f"/v1/videos/{rest[0]['id']}").json
    assert job["status"] == "completed"
    (tmp_path / "stopped.mp4").write_bytes(server.request("GET", rest[0]["video"]).body)
    assert read_frames(tmp_path / "stopped.mp4").shape == (1, 64, 64, 3)


def test_a_client_that_disconnects_cancels_its_stream_within_a_block(server):
    with open_stream(server) as ws:
        ws.send(json.dumps({"prompt": RED, "num_blocks": 20, **FAST}))
        messages, _ = read(ws, until="chunk")
    job_id = messages[0]["id"]
    job = server.wait(job_id)
    assert job["status"] == "cancelled" and job["progress_fraction"] < 0.5  # stopped early, not run to the end
    assert server.request("GET", f"/v1/videos/{job_id}/content").status == 409
    assert "composer_streams_open 0" in server.request("GET", "/metrics").body.decode()


def test_a_slow_reader_gets_every_chunk_in_order_while_generation_waits(server, scripted):
    with open_stream(server, small_buffer=True) as ws:
        ws.send(json.dumps({"prompt": "noise", "num_blocks": 30, "height": 256, "width": 256}))
        head, _ = read(ws, until="chunk")
        time.sleep(1.0)  # not reading: the socket's buffers fill, then the worker waits for a free slot
        paused_at = scripted.produced
        time.sleep(0.5)
        assert scripted.produced == paused_at < 30  # generation paused while the client read nothing
        metrics = server.request("GET", "/metrics").body.decode()
        assert metric(metrics, "composer_stream_buffered_chunks") <= 2
        messages, code = head, None
        while code is None:  # a chunk at a time, slowly, to the close
            more, code = read(ws, until="chunk")
            messages += more
            time.sleep(0.01)
    chunks = chunks_of(messages)
    assert [c["index"] for c in chunks] == list(range(30)) and [c["block"] for c in chunks] == list(range(30))
    assert all(len(c["images"]) == c["frames"] == 4 for c in chunks)
    assert messages[-1]["type"] == "done" and messages[-1]["frames"] == 120 and code == 1000
    assert server.app.state.streams.max_buffered <= 2


def test_a_client_that_stops_reading_has_its_stream_failed_after_the_stall_timeout(server):
    server.app.state.streams.stall_timeout = 0.5
    with open_stream(server, small_buffer=True) as ws:
        ws.send(json.dumps({"prompt": "noise", "num_blocks": 30, "height": 256, "width": 256}))
        messages, _ = read(ws, until="started")
        job = server.wait(messages[0]["id"], timeout=30)
        assert job["status"] == "failed" and "read nothing for 0.5 s" in job["error"]["message"]
        rest, code = read(ws)
    assert rest[-1]["type"] == "error" and "read nothing" in rest[-1]["error"]["message"] and code == 1011


class NotReading:
    """A WebSocket client that does the handshake, sends its request and then never reads: what a stalled viewer
    is to the server (default socket buffers, as any client's)."""

    def __init__(self, srv: Server, request: dict, receive_buffer: int | None = None):
        self.sock = socket.socket()
        if receive_buffer is not None:  # a small window: the server's side sees the backlog after fewer chunks
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        self.sock.settimeout(30)
        self.sock.connect(("127.0.0.1", srv.port))
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(f"GET /v1/streams HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade"
                          f"\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += self.sock.recv(1)  # the handshake's answer, byte by byte: nothing of the stream is read
        assert answer.startswith(b"HTTP/1.1 101"), answer
        payload, mask = json.dumps(request).encode(), os.urandom(4)
        size = bytes([0x80 | len(payload)]) if len(payload) < 126 else bytes([0x80 | 126]) + len(payload).to_bytes(2)
        self.sock.sendall(b"\x81" + size + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def drop(self) -> None:
        """Lose the connection without a close (a reset): what uvicorn's keepalive does to a client that answers
        no ping."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()


def stream_id(srv: Server) -> str:
    deadline = time.time() + 30
    while not srv.app.state.streams.open:
        assert time.time() < deadline, "the stream never opened"
        time.sleep(0.01)
    return next(iter(srv.app.state.streams.open))


class Logged(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def warnings_logged():
    handler, logger = Logged(), logging.getLogger("composer.serve.stream")
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)


def test_a_client_that_takes_nothing_parks_its_stream_and_is_failed_after_the_stall_timeout(
        server, scripted, warnings_logged):
    """The server's socket buffers would take the whole of this stream (small, quickly made chunks): the chunks
    count as sent only once the client took them, so the stream waits, and the stall rule ends it, logged."""
    server.app.state.streams.stall_timeout = 0.5
    client = NotReading(server, {"prompt": "noise", "num_blocks": 50, "height": 64, "width": 64})
    try:
        job = server.wait(stream_id(server), timeout=30)
    finally:
        client.drop()
    assert job["status"] == "failed" and "read nothing for" in job["error"]["message"], job
    assert scripted.produced < 50  # generation stopped while the client was behind
    assert any("read nothing for" in line and job["id"] in line for line in warnings_logged)


def test_a_model_stream_whose_client_takes_nothing_waits_and_is_failed(server, warnings_logged):
    """The same with the causal model's own chunks (small JPEGs, each a task on the request loop: the chunk waits
    in `offer`, no thread held)."""
    routes = server.app.state.streams
    routes.stall_timeout, routes.behind_bytes = 1.0, 1024
    client = NotReading(server, {"prompt": RED, "num_blocks": 40, **FAST}, receive_buffer=4096)
    try:
        job = server.wait(stream_id(server), timeout=60)
    finally:
        client.drop()
    assert job["status"] == "failed" and "read nothing for 1 s" in job["error"]["message"], job
    assert job["progress_fraction"] < 0.5
    assert any("read nothing for" in line and job["id"] in line for line in warnings_logged)


def test_uvicorns_keepalive_dropping_a_client_that_reads_nothing_fails_its_stream_logged(scripted, tmp_path,
                                                                                         warnings_logged):
    """What the issue saw at 40 s (uvicorn pings every 20 s, drops a client that has not answered 20 s later), in
    4 s: the stream waits for its client, the keepalive drops the connection, and the job fails as stalled with a
    WARNING, not `cancelled` without a word. (2 s + 2 s: the stream fills the client's buffers well before the drop
    even on a loaded machine; at 0.5 s + 0.5 s a slow start let the drop come first.)"""
    srv = start(scripted, tmp_path, ws_ping_interval=2.0, ws_ping_timeout=2.0)
    try:
        srv.app.state.streams.behind_bytes = 1024  # (the stall timeout stays 60 s: the keepalive comes first)
        client = NotReading(srv, {"prompt": RED, "num_blocks": 40, **FAST}, receive_buffer=4096)
        try:
            job = srv.wait(stream_id(srv), timeout=60)
        finally:
            client.drop()
    finally:
        srv.stop()
    assert job["status"] == "failed" and "stopped reading" in job["error"]["message"], job
    assert "connection closed" in job["error"]["message"] and job["progress_fraction"] < 0.5
    assert any("stopped reading" in line and job["id"] in line for line in warnings_logged)


def test_a_stalled_clients_dropped_connection_fails_its_stream_logged_instead_of_a_silent_cancel(
        server, scripted, warnings_logged):
    client = NotReading(server, {"prompt": "noise", "num_blocks": 50, "height": 64, "width": 64})
    job_id, deadline = stream_id(server), time.time() + 30
    while True:  # the client is behind, and the stream waits for it (the buffer full)
        metrics = server.request("GET", "/metrics").body.decode()
        if metric(metrics, "composer_streams_waiting_for_client") == 1 and \
                metric(metrics, "composer_stream_buffered_chunks") == 2:
            break
        assert time.time() < deadline, "the stream never waited for its client"
        time.sleep(0.02)
    assert metric(metrics, "composer_stream_client_backlog_bytes") > server.app.state.streams.behind_bytes
    produced = scripted.produced
    client.drop()
    job = server.wait(job_id, timeout=30)
    assert job["status"] == "failed" and "stopped reading" in job["error"]["message"], job
    assert scripted.produced <= produced + 1 < 50  # the chunk being made, at most
    assert any("stopped reading" in line and job_id in line for line in warnings_logged)


def test_delete_cancels_a_running_stream(server):
    with open_stream(server, small_buffer=True) as ws:
        ws.send(json.dumps({"prompt": "noise", "num_blocks": 30, "height": 256, "width": 256}))
        messages, _ = read(ws, until="chunk")
        job_id = messages[0]["id"]
        assert server.request("DELETE", f"/v1/videos/{job_id}").status == 200
        assert server.wait(job_id)["status"] == "cancelled"
        rest, code = read(ws)
    assert rest[-1]["type"] == "error" and "cancelled" in rest[-1]["error"]["message"] and code == 1000
    assert len(chunks_of(messages + rest)) < 30


@pytest.mark.parametrize(("first", "param", "words"), [
    ("not json", None, "not valid JSON"),
    (b"\x00binary", None, "JSON text message"),
    ("[1, 2]", None, "JSON object"),
    ({"seed": 1}, "prompt", "prompt is required"),
    ({"prompt": RED, "height": 30}, "height", "multiple"),
    ({"prompt": RED, "num_blocks": 0}, "num_blocks", "integer >= 1"),
    ({"prompt": RED, "num_blocks": 100}, "num_blocks", "at most 200"),
    ({"prompt": RED, "num_blocks": 2, "num_frames": 5}, "num_blocks", "not both"),
    ({"prompt": RED, "colour": "red"}, "colour", "unknown field"),
    ({"prompt": RED, "priority": False}, "priority", "an integer"),
    ({"prompt": RED, "priority": "1"}, "priority", "an integer"),
    ({"prompt": RED, "target_fps": 0}, "target_fps", "frames per second > 0"),
    ({"prompt": RED, "target_fps": "30"}, "target_fps", "frames per second > 0"),
    ({"prompt": RED, "target_fps": True}, "target_fps", "frames per second > 0"),
    ({"prompt": RED, "target_fps": float("nan")}, "target_fps", "frames per second > 0"),
])
def test_a_bad_first_message_gets_an_error_naming_the_field_and_a_1008_close(server, first, param, words):
    with open_stream(server) as ws:
        ws.send(first if isinstance(first, (str, bytes)) else json.dumps(first))
        messages, code = read(ws)
    assert code == 1008 and [m["type"] for m in messages] == ["error"]
    assert messages[0]["error"]["param"] == param and words in messages[0]["error"]["message"]
    assert server.request("GET", "/v1/videos").json["data"] == []  # nothing was queued


def test_bad_messages_mid_stream_get_errors_and_the_stream_goes_on(server, scripted):
    scripted.hold = True  # the stream waits after its first chunk until a good switch arrives
    bad = [("nonsense", None), (b"\x01", None), ('["prompt"]', "type"), ('{"type": "pause"}', "type"),
           ('{"type": "prompt", "prompt": ""}', "prompt"), ('{"type": "prompt", "prompt": "x", "blocks": 0}', "blocks"),
           ('{"type": "prompt", "prompt": "x", "colour": 1}', "colour"), ('{"type": "stop", "now": true}', "now")]
    with open_stream(server) as ws:
        ws.send(json.dumps({"prompt": RED, "num_blocks": 2, **FAST}))
        read(ws, until="chunk")
        for message, _ in bad:
            ws.send(message)
        errors = [read(ws, until="error")[0][-1] for _ in bad]
        ws.send(json.dumps({"type": "prompt", "prompt": BLUE, "blocks": 1}))
        rest, code = read(ws)
    assert [e["error"]["param"] for e in errors] == [param for _, param in bad]
    assert [m["type"] for m in rest] == ["prompt", "chunk", "done"] and code == 1000
    assert rest[1]["prompt"] == BLUE and rest[2]["frames"] == 5


def test_a_stream_waits_behind_a_running_job_with_one_slot(scripted, tmp_path):
    server = start(scripted, tmp_path, max_concurrent=1)
    try:
        reply = server.request("POST", "/v1/videos", {"prompt": "gate job", "num_frames": 5, **FAST})
        job = server.wait(reply.json["id"], ("in_progress",))
        with open_stream(server) as ws:
            ws.send(json.dumps({"prompt": "noise", "num_blocks": 2, "height": 64, "width": 64}))
            queued, _ = read(ws, until="queued")
            assert queued[0]["position"] == 1
            assert server.request("GET", f"/v1/videos/{queued[0]['id']}").json["status"] == "queued"
            assert scripted.produced == 0
            server.request("DELETE", f"/v1/videos/{job['id']}")
            messages, code = read(ws)
        assert [m["type"] for m in messages] == ["started", "chunk", "chunk", "done"] and code == 1000
        assert messages[0]["id"] == queued[0]["id"]
    finally:
        scripted.gate.set()
        server.stop()


def test_a_whole_video_model_refuses_streams(tmp_path):
    t2v = VideoGenerator.from_pretrained(None, progress=False)  # the shapes text-to-video model
    srv = Server(lambda: t2v, ServeConfig(output_dir=tmp_path / "serve"))
    try:
        srv.wait_ready()
        with open_stream(srv) as ws:
            messages, code = read(ws)
        assert code == 1008 and messages[0]["type"] == "error" and "causal" in messages[0]["error"]["message"]
    finally:
        srv.stop()
