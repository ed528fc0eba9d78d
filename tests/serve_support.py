"""A real `composer serve` app on 127.0.0.1 (uvicorn in a thread, a free port) for the serve tests, and a
small stdlib HTTP client (no httpx)."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import uvicorn

from composer.serve.app import ServeConfig, create_app


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body)


class Server:
    """A running server; `request` talks to it, `stop` shuts it down (the worker too)."""

    def __init__(self, load: Callable[[], Any], config: ServeConfig, factory: Callable[..., Any] = create_app,
                 **uvicorn_options: Any):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.app = factory(load, config)
        self._server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                     lifespan="on", **uvicorn_options))
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.time() + 60
        while not self._server.started:
            assert time.time() < deadline, "the server did not start"
            time.sleep(0.02)

    def request(self, method: str, path: str, body: Any = None, raw: bytes | None = None,
                headers: dict | None = None) -> Reply:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        try:
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
        finally:
            conn.close()

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while self.request("GET", "/health").status != 200:
            assert time.time() < deadline, "the model did not load"
            time.sleep(0.05)

    def wait(self, job_id: str, states: tuple[str, ...] = ("completed", "failed", "cancelled"),
             timeout: float = 60) -> dict:
        deadline = time.time() + timeout
        while True:
            job = self.request("GET", f"/v1/videos/{job_id}").json
            if job["status"] in states:
                return job
            assert time.time() < deadline, f"job {job_id} stayed {job['status']}"
            time.sleep(0.02)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)


class Scripted:
    """The real generator, except for prompts starting "gate" (wait for `gate`, cancellable; run with
    `gated_overrides` over the request's fields) and "boom" (raise)."""

    def __init__(self, generator: Any, gated_overrides: dict | None = None):
        self._generator = generator
        self.gate = threading.Event()
        self.gated_overrides = gated_overrides or {}

    def __getattr__(self, name):
        return getattr(self._generator, name)

    def generate_video(self, prompt=None, *, cancel=None, **kwargs):
        from composer.errors import Cancelled

        text = _prompt_text(prompt)
        if text.startswith("boom"):
            raise RuntimeError("boom: the transformer exploded")
        if text.startswith("gate"):
            while not self.gate.wait(0.01):
                if cancel is not None and cancel.cancelled:
                    raise Cancelled("request cancelled")
            if not isinstance(prompt, str) and self.gated_overrides:  # a checked request: changed, checked again
                return self._generator.generate_video(prompt.updated(**self.gated_overrides), cancel=cancel, **kwargs)
            return self._generator.generate_video(prompt, cancel=cancel, **{**kwargs, **self.gated_overrides})
        return self._generator.generate_video(prompt, cancel=cancel, **kwargs)

    def submit_video(self, prompt=None, *, cancel=None, **kwargs):
        """The real generator's tasks, except for the scripted prompts (run as `generate_video` on a thread)."""
        text = _prompt_text(prompt)
        if not (text.startswith("boom") or text.startswith("gate")):
            return self._generator.submit_video(prompt, cancel=cancel, **kwargs)
        from concurrent.futures import Future

        future = Future()

        def run():
            try:
                future.set_result(self.generate_video(prompt, cancel=cancel, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - through the future
                future.set_exception(exc)

        threading.Thread(target=run, daemon=True).start()
        return future


def _prompt_text(prompt: Any) -> str:
    """A job's prompt: given as text, or in the request the server checked before queueing it (a CheckedRequest)."""
    return prompt if isinstance(prompt, str) else prompt.sampling.prompt
