"""One `composer serve` with two models (`--model-path VIDEO --text-model-path TEXT`, `create_app(..., text_load=)`):
the embedded causal shapes model and the embedded tiny-dllm behind one app and one server state. Each route goes
to its modality's model (a video job, a live stream and a chat completion are each the model's own output), what
every server has is installed once (/v1/models lists both, /health says both, /metrics has no name twice), a
`model` naming the other modality's model is refused as a wrong name is, and /ready waits for both."""

from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("fastapi", reason="composer serve needs the serve extra (fastapi, uvicorn, websockets)")
pytest.importorskip("uvicorn", reason="composer serve needs the serve extra (fastapi, uvicorn, websockets)")
pytest.importorskip("websockets", reason="live streams need the serve extra (fastapi, uvicorn, websockets)")
from serve_support import Server  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from composer import TextGenerator  # noqa: E402
from composer.generator import VideoGenerator  # noqa: E402
from composer.serve.app import ServeConfig, create_app  # noqa: E402

FAST = {"guidance_scale": 1.0, "seed": 5}  # the shapes model's CFG off: half the work
PROMPT = "12 + 30 ="  # tiny-dllm's words: digits, +, =


@pytest.fixture(scope="module")
def video():
    return VideoGenerator.from_pretrained("shapes-causal", progress=False)


@pytest.fixture(scope="module")
def text():
    return TextGenerator.from_pretrained(None, progress=False)  # the embedded tiny-dllm


def two_models(video_load, text_load, tmp_path) -> Server:
    return Server(video_load, ServeConfig(output_dir=tmp_path / "serve"),
                  factory=lambda load, cfg: create_app(load, cfg, text_load=text_load))


@pytest.fixture(scope="module")
def server(video, text, tmp_path_factory):
    srv = two_models(lambda: video, lambda: text, tmp_path_factory.mktemp("two"))
    srv.wait_ready()
    yield srv
    srv.stop()


def test_one_server_answers_video_jobs_streams_and_text_each_by_its_model(server, video, text):
    expected = text.generate_text(PROMPT, seed=3, use_chat_template=False)
    reply = server.request("POST", "/v1/completions", {"prompt": PROMPT, "seed": 3, "use_chat_template": False,
                                                       "priority": 1})
    assert reply.status == 200, reply.body
    assert reply.json["choices"][0]["text"] == expected.text and reply.json["model"] == str(text.model_path)
    chat = server.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}],
                                                           "seed": 4})
    assert chat.status == 200 and chat.json["object"] == "chat.completion"

    job = server.request("POST", "/v1/videos", {"prompt": "a red circle", "num_frames": 5, **FAST}).json
    assert job["model"] == str(video.model_path)
    assert server.wait(job["id"])["status"] == "completed"

    with connect(f"ws://127.0.0.1:{server.port}/v1/streams", open_timeout=30) as ws:
        ws.send(json.dumps({"prompt": "a blue square", "num_blocks": 2, "priority": 1, **FAST}))
        kinds = []
        while not kinds or kinds[-1] not in ("done", "error"):
            message = ws.recv(timeout=60)
            if isinstance(message, str):
                kinds.append(json.loads(message)["type"])
    assert kinds == ["started", "chunk", "chunk", "done"]

    metrics = server.request("GET", "/metrics").body.decode()
    assert "composer_text_requests_total 2" in metrics and 'composer_streams{state="completed"} 1' in metrics
    assert "composer_text_queue_length 0" in metrics and "composer_queue_length 0" in metrics


def test_what_every_server_has_is_there_once_and_names_both_models(server, video, text):
    listed = server.request("GET", "/v1/models").json["data"]
    assert [m["id"] for m in listed] == [str(video.model_path), str(text.model_path)]
    for name in (str(video.model_path), video.family, str(text.model_path), text.family):
        assert server.request("GET", f"/v1/models/{name}").status == 200
    assert server.request("GET", "/v1/models/nonesuch").json["error"]["code"] == "model_not_found"

    health = server.request("GET", "/health").json
    assert health["status"] == "ok" and health["modality"] == "video"
    assert [(m["modality"], m["status"], m["family"]) for m in health["models"]] == [
        ("video", "ready", video.family), ("text", "ready", text.family)]
    assert server.request("GET", "/ready").status == 200

    metrics = server.request("GET", "/metrics").body.decode()
    declared = [line.split()[2] for line in metrics.splitlines() if line.startswith("# TYPE ")]
    assert len(declared) == len(set(declared)), sorted(n for n in declared if declared.count(n) > 1)
    assert "composer_ready 1" in metrics and "composer_text_max_concurrent 4" in metrics
    paths = server.request("GET", "/openapi.json").json["paths"]  # (WebSocket /v1/streams is not listed)
    assert {"/v1/videos", "/v1/sessions", "/v1/completions", "/v1/chat/completions", "/health", "/v1/model"} <= \
        set(paths)


def test_a_model_name_of_the_other_modality_is_refused_as_a_wrong_name(server, video, text):
    wrong_text = server.request("POST", "/v1/completions", {"model": "nonesuch", "prompt": PROMPT})
    other_text = server.request("POST", "/v1/completions", {"model": video.family, "prompt": PROMPT})
    assert wrong_text.status == other_text.status == 404
    assert other_text.json["error"]["code"] == wrong_text.json["error"]["code"] == "model_not_found"
    assert other_text.json["error"]["param"] == "model" and "video model" in other_text.json["error"]["message"]

    wrong_video = server.request("POST", "/v1/videos", {"model": "nonesuch", "prompt": "x", **FAST})
    other_video = server.request("POST", "/v1/videos", {"model": text.family, "prompt": "x", **FAST})
    assert wrong_video.status == other_video.status == 422
    assert other_video.json["error"]["param"] == wrong_video.json["error"]["param"] == "model"
    assert "text model" in other_video.json["error"]["message"]
    assert server.request("POST", "/v1/completions", {"model": text.family, "prompt": PROMPT}).status == 200


def test_ready_only_once_both_models_are_loaded(video, text, tmp_path):
    gate = threading.Event()

    def slow_text():
        gate.wait(30)
        return text

    srv = two_models(lambda: video, slow_text, tmp_path)
    try:
        for path in ("/ready", "/health", "/v1/models"):
            reply = srv.request("GET", path)
            assert reply.status == 503 and "the text model is loading" in reply.json["error"]["message"]
        assert "composer_ready 0" in srv.request("GET", "/metrics").body.decode()
        gate.set()
        srv.wait_ready()
        assert srv.request("GET", "/ready").status == 200
    finally:
        gate.set()
        srv.stop()


def test_a_model_that_fails_to_load_is_named_and_the_other_still_loads(video, tmp_path):
    def broken():
        raise OSError("no such text model")

    srv = two_models(lambda: video, broken, tmp_path)
    try:
        for _ in range(600):
            health = srv.request("GET", "/health")
            if "video model is loading" not in health.json["error"]["message"]:
                break
            threading.Event().wait(0.05)
        assert health.status == 503 and health.json["error"]["message"] == \
            "the text model failed to load: OSError: no such text model"
        assert srv.request("POST", "/v1/completions", {"prompt": PROMPT}).status == 503
        job = srv.request("POST", "/v1/videos", {"prompt": "a red circle", "num_frames": 1, **FAST})
        assert job.status == 200 and srv.wait(job.json["id"])["status"] == "completed"  # the video model serves
    finally:
        srv.stop()


def test_composer_serve_takes_a_text_model_beside_the_video_model(monkeypatch, capsys):
    import socket

    import uvicorn

    from composer.cli.main import main

    served = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: served.append(self.config.app))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["serve", "--model-path", "shapes-causal", "--text-model-path", "tiny-dllm", "--port", str(port),
                 "--no-progress", "--max-queue", "3"]) == 0
    state = served[0].state.composer
    assert state.modalities == ("video", "text") and state.two_models
    assert state.slots.max_queue == 3 and state.store is not None
    assert "a text model: /v1/completions" in capsys.readouterr().out
    assert main(["serve", "--model-path", "shapes-causal", "--text-model-path", "shapes-t2v", "--port",
                 str(port)]) == 1
    assert "--text-model-path shapes-t2v: a video model" in capsys.readouterr().err
    assert main(["serve", "--model-path", "tiny-dllm", "--text-model-path", "tiny-dllm", "--port", str(port)]) == 1
    assert "--model-path tiny-dllm: a text model" in capsys.readouterr().err
    assert len(served) == 1  # neither served
