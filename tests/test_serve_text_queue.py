"""The text routes' admission (composer/serve/slots.py, composer/serve/text.py): --max-concurrent requests run, the
others wait for a slot, higher `priority` first then by arrival; --max-queue waiting is the most (one more: video's
429); --request-timeout cancels a request that runs past it (504, OpenAI's error shape). Held requests are held by
events (a gated submit_text), and every step waits for a state the server reports, never for time to pass."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future

import pytest

pytest.importorskip("fastapi", reason="composer serve needs the serve extra (fastapi, uvicorn)")
pytest.importorskip("uvicorn", reason="composer serve needs the serve extra (fastapi, uvicorn)")
from serve_support import Server  # noqa: E402

from composer import TextGenerator  # noqa: E402
from composer.errors import Cancelled  # noqa: E402
from composer.serve.app import ServeConfig, create_app  # noqa: E402
from composer.serve.slots import ClientGone, QueueFull, Slots  # noqa: E402

GATED = "9 9 9 ="  # tiny-dllm's words: digits, +, =


# -- the slots alone ----------------------------------------------------------------------------------------------
def test_slots_hand_a_freed_slot_to_the_highest_priority_then_the_earliest():
    async def main() -> list[str]:
        slots, order = Slots(max_concurrent=1, max_queue=3), []
        await slots.acquire()  # the running one

        async def wait(name: str, priority: int) -> None:
            await slots.acquire(priority)
            order.append(name)

        tasks = [asyncio.create_task(wait(name, priority)) for name, priority in
                 (("low", 0), ("high", 5), ("low-later", 0))]
        await asyncio.sleep(0)  # (each task runs to its wait: one loop turn, no time)
        assert slots.waiting == 3 and slots.running == 1
        with pytest.raises(QueueFull):
            await slots.acquire(9)  # a fourth waiting request: refused, whatever its priority
        for _ in tasks:
            slots.release()
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert slots.running == 1 and slots.waiting == 0  # the slot changed hands each time, never freed
        slots.release()
        assert slots.running == 0 and slots.waits == 4
        return order

    assert asyncio.run(main()) == ["high", "low", "low-later"]


def test_a_request_whose_client_leaves_while_waiting_leaves_the_queue():
    async def main() -> None:
        slots = Slots(max_concurrent=1, max_queue=1)
        await slots.acquire()
        gone = asyncio.get_running_loop().create_future()
        waiter = asyncio.create_task(slots.acquire(0, gone))
        await asyncio.sleep(0)
        assert slots.waiting == 1
        gone.set_result(None)  # the client left
        with pytest.raises(ClientGone):
            await waiter
        assert slots.waiting == 0
        cancelled = asyncio.create_task(slots.acquire(0))
        await asyncio.sleep(0)
        cancelled.cancel()  # (the server stopping)
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        slots.release()
        assert slots.running == 0 and slots.waiting == 0

    asyncio.run(main())


# -- a served text model ------------------------------------------------------------------------------------------
class Gated:
    """The real generator, except that a GATED request waits for `gate` (or its cancel: then it raises Cancelled,
    as the pipeline does before its next forward); `order` is the prompts in the order they started running."""

    def __init__(self, generator):
        self._generator = generator
        self.gate, self.entered = threading.Event(), threading.Event()
        self.order: list[str] = []

    def __getattr__(self, name):
        return getattr(self._generator, name)

    def _hold(self, cancel) -> None:
        self.entered.set()
        while not self.gate.wait(0.01):
            if cancel.cancelled:
                raise Cancelled(f"request cancelled ({cancel.reason})")

    def submit_text(self, prompt=None, *, cancel=None, **kwargs):
        self.order.append(prompt)
        if prompt != GATED:
            return self._generator.submit_text(prompt, cancel=cancel, **kwargs)
        future = Future()

        def held() -> None:  # the gated request: held (on a thread of the test's), then run as any other
            try:
                self._hold(cancel)
                future.set_result(self._generator.generate_text(prompt, cancel=cancel, **kwargs))
            except Exception as exc:  # noqa: BLE001 - the request's error
                future.set_exception(exc)

        threading.Thread(target=held, daemon=True).start()
        return future

    def astream_text(self, prompt=None, *, cancel=None, **kwargs):
        pieces = self._generator.astream_text(prompt, cancel=cancel, **kwargs)
        if prompt != GATED:
            return pieces

        async def held():  # (the hold on a worker thread: the server's event loop goes on)
            try:
                await asyncio.to_thread(self._hold, cancel)
                async for piece in pieces:
                    yield piece
            finally:
                await pieces.aclose()

        return held()


@pytest.fixture(scope="module")
def gen():
    return TextGenerator.from_pretrained(None, progress=False)  # the embedded tiny-dllm


def served(generator, tmp_path, **config) -> Server:
    srv = Server(lambda: generator, ServeConfig(output_dir=tmp_path, **config),
                 factory=lambda load, cfg: create_app(load, cfg, modality="text"))
    srv.wait_ready()
    return srv


def gauge(srv: Server, name: str) -> float:
    metrics = srv.request("GET", "/metrics").body.decode()
    return float(next(line.split()[1] for line in metrics.splitlines() if line.startswith(name + " ")))


def until(condition, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def in_background(srv: Server, body: dict, replies: dict, name: str) -> threading.Thread:
    thread = threading.Thread(target=lambda: replies.update({name: srv.request("POST", "/v1/completions", body)}),
                              daemon=True)
    thread.start()
    return thread


def test_waiting_requests_run_by_priority_and_a_full_queue_is_videos_429(gen, tmp_path):
    gated = Gated(gen)
    srv = served(gated, tmp_path, max_concurrent=1, max_queue=2)
    replies: dict = {}
    threads = []
    try:
        assert gauge(srv, "composer_max_concurrent") == 1
        threads.append(in_background(srv, {"prompt": GATED, "max_tokens": 8}, replies, "held"))
        assert gated.entered.wait(30)  # it holds the one slot
        threads.append(in_background(srv, {"prompt": "5 6 =", "max_tokens": 8, "priority": 0}, replies, "low"))
        until(lambda: gauge(srv, "composer_queue_length") == 1, "the low-priority request did not queue")
        threads.append(in_background(srv, {"prompt": "7 8 =", "max_tokens": 8, "priority": 5}, replies, "high"))
        until(lambda: gauge(srv, "composer_queue_length") == 2, "the high-priority request did not queue")
        full = srv.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "1 ="}],
                                                            "priority": 100})
        assert full.status == 429 and full.headers["retry-after"] == "10"
        assert full.json["error"] == {"message": "the queue is full (2 requests waiting); retry later",
                                      "type": "invalid_request_error", "param": None, "code": 429}
        assert gated.order == [GATED]  # nothing else ran while the slot was held
        gated.gate.set()
        for thread in threads:
            thread.join(60)
        assert {name: reply.status for name, reply in replies.items()} == {"held": 200, "low": 200, "high": 200}
        assert gated.order == [GATED, "7 8 =", "5 6 ="]  # queued after the low one, run before it
        assert replies["high"].json["choices"][0]["text"] == gen.generate_text(
            "7 8 =", gen_length=8, seed=replies["high"].json["composer"]["seed"]).text
        assert gauge(srv, "composer_text_requests_running") == 0 and gauge(srv, "composer_queue_length") == 0
        assert gauge(srv, "composer_queue_wait_seconds_count") == 3
    finally:
        gated.gate.set()
        srv.stop()


def test_priority_is_checked_as_a_video_jobs(gen, tmp_path):
    srv = served(gen, tmp_path)
    try:
        for bad in ("high", 1.5, True):
            reply = srv.request("POST", "/v1/completions", {"prompt": "1 =", "priority": bad})
            assert reply.status == 400 and reply.json["error"]["param"] == "priority", reply.body
        assert srv.request("POST", "/v1/completions", {"prompt": "1 =", "max_tokens": 4,
                                                       "priority": -3}).status == 200
    finally:
        srv.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_past_the_request_timeout_is_cancelled_and_fails(gen, tmp_path, stream):
    gated = Gated(gen)  # the gate never opens: only the timeout ends the request
    srv = served(gated, tmp_path, request_timeout=0.2)
    try:
        reply = srv.request("POST", "/v1/completions", {"prompt": GATED, "max_tokens": 8, "stream": stream})
        assert reply.status == 504
        assert reply.json["error"] == {"message": "the request ran past the request timeout (0.2 s) and was "
                                       "cancelled", "type": "server_error", "param": None, "code": 504}
        assert gauge(srv, "composer_text_requests_running") == 0 and gauge(srv, "composer_text_failures_total") == 1
        gated.gate.set()  # the slot is free again: a request runs to its answer
        assert srv.request("POST", "/v1/completions", {"prompt": "1 =", "max_tokens": 4}).status == 200
    finally:
        gated.gate.set()
        srv.stop()


def test_one_app_installs_ready_and_models_for_a_text_model(gen, tmp_path):
    never = threading.Event()
    loading = Server(lambda: never.wait(30), ServeConfig(output_dir=tmp_path / "loading"),
                     factory=lambda load, cfg: create_app(load, cfg, modality="text"))
    try:
        assert loading.request("GET", "/ready").status == 503 and loading.request("GET", "/health").status == 503
    finally:
        never.set()
        loading.stop()
    srv = served(gen, tmp_path / "ready")
    try:
        assert srv.request("GET", "/ready").json == {"status": "ready"}
        health = srv.request("GET", "/health").json
        assert health["modality"] == "text" and health["status"] == "ok"
        assert srv.request("GET", "/v1/models").json["data"][0]["id"] == str(gen.model_path)
        assert srv.request("GET", "/v1/model").status == 404  # the video page's route: not a text server's
    finally:
        srv.stop()


def test_a_text_servers_keys_come_from_its_config_as_a_video_servers(gen, tmp_path):
    from composer.serve.keys import ApiKey, KeyRing

    secret = "text-server-test-key-0123456789abcdef"
    srv = served(gen, tmp_path, keys=KeyRing([ApiKey("alice", secret)]))
    try:
        assert srv.request("GET", "/ready").status == 200 and srv.request("GET", "/health").status == 200  # open
        assert srv.request("POST", "/v1/completions", {"prompt": "1 =", "max_tokens": 4}).status == 401
        assert srv.request("GET", "/metrics").status == 401
        key = {"Authorization": f"Bearer {secret}"}
        assert srv.request("POST", "/v1/completions", {"prompt": "1 =", "max_tokens": 4}, headers=key).status == 200
        metrics = srv.request("GET", "/metrics", headers=key).body.decode()
        assert 'composer_api_requests_total{key="alice"} 2' in metrics  # the completion and this scrape
        assert "composer_text_requests_total 1" in metrics
    finally:
        srv.stop()


def test_composer_serve_gives_a_text_model_its_flags(monkeypatch, capsys):
    """`composer serve` on a text model builds the one app with the queue flags (they were ignored before)."""
    import socket

    import uvicorn

    from composer.cli.main import main

    served = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: served.append(self.config.app))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["serve", "--model-path", "tiny-dllm", "--port", str(port), "--no-progress", "--max-concurrent", "2",
                 "--max-queue", "3", "--request-timeout", "7"]) == 0
    state = served[0].state.composer
    assert state.modality == "text" and state.store is None
    assert (state.slots.max_concurrent, state.slots.max_queue, state.config.request_timeout) == (2, 3, 7.0)
    assert "a text model: /v1/completions" in capsys.readouterr().out


def test_a_stream_whose_client_leaves_midway_stops_and_frees_its_slot(tmp_path):
    """A streamed completion whose client closes its connection after the first event: the request leaves the
    pipeline (no more forwards run for it), its slot is free, and the next request is answered."""
    import json
    import socket

    import torch

    gen = TextGenerator.from_pretrained(None, progress=False)
    forwards = []
    inner = gen.pipeline.batcher.model

    class Slow(torch.nn.Module):  # 50 ms a forward: the stream is still running when its client leaves
        def forward(self, *args, **kwargs):
            forwards.append(time.monotonic())
            time.sleep(0.05)
            return inner(*args, **kwargs)

    gen.pipeline.batcher.model = Slow()
    srv = served(gen, tmp_path, max_concurrent=1)
    try:
        body = json.dumps({"prompt": "what is the sea", "max_tokens": 48, "stream": True, "block_length": 4,
                           "steps": 4, "eos_early_stop": False, "use_chat_template": False}).encode()
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            received = b""
            while b"data: " not in received:  # the first event: the stream is under way
                chunk = sock.recv(65536)
                assert chunk, received
                received += chunk
        deadline = time.monotonic() + 30
        while gen.pipeline.gate.running or gauge(srv, "composer_text_requests_running"):
            assert time.monotonic() < deadline, "the stream did not leave the pipeline"
            time.sleep(0.02)
        ran = len(forwards)
        assert ran < 12 * 4  # it stopped before its 12 blocks of 4 steps
        time.sleep(0.3)
        assert len(forwards) == ran  # and nothing more runs for it
        assert srv.request("POST", "/v1/completions", {"prompt": "1 =", "max_tokens": 4}).status == 200
    finally:
        srv.stop()
