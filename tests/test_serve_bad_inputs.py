"""`composer serve` refuses malformed requests with a 4xx naming the problem, and keeps serving.

One server over the embedded text-to-video shapes model (limits: 33 frames, 128 px, 30 steps), one over a tiny
Wan2.1 image-to-video model for the image cases. Nothing here generates a video."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import PIL.Image
import pytest

pytest.importorskip("fastapi", reason="composer serve needs the serve extra (fastapi, uvicorn)")
pytest.importorskip("uvicorn", reason="composer serve needs the serve extra (fastapi, uvicorn)")
from serve_support import Server

from composer.generator import VideoGenerator
from composer.serve.app import ServeConfig
from composer.serve.requests import ServerLimits
from composer.testing import build_tiny_wan_i2v

LIMITS = ServerLimits(max_frames=33, max_size=128, max_steps=30)


def png_base64(size: int = 32) -> str:
    buffer = io.BytesIO()
    PIL.Image.fromarray(np.full((size, size, 3), 128, np.uint8)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


OK = {"prompt": "a red circle"}

# (case, body, expected status, the field the error names (None: the body as a whole), words in the message)
CASES = [
    ("missing prompt", {"height": 64}, 422, "prompt", "required"),
    ("empty prompt", {"prompt": ""}, 422, "prompt", "non-empty"),
    ("blank prompt", {"prompt": "   "}, 422, "prompt", "non-empty"),
    ("prompt a number", {"prompt": 5}, 422, "prompt", "a string"),
    ("prompt a list", {"prompt": ["a", "b"]}, 422, "prompt", "a string"),
    ("height a string", {**OK, "height": "64"}, 422, "height", "an integer"),
    ("width a float", {**OK, "width": 64.5}, 422, "width", "an integer"),
    ("num_frames a bool", {**OK, "num_frames": True}, 422, "num_frames", "an integer"),
    ("negative steps", {**OK, "num_inference_steps": -1}, 422, "num_inference_steps", "expected"),
    ("zero steps", {**OK, "num_inference_steps": 0}, 422, "num_inference_steps", "expected"),
    ("too many steps", {**OK, "num_inference_steps": 1000}, 422, "num_inference_steps", "at most 30"),
    ("huge height", {**OK, "height": 100000}, 422, "height", "at most 128"),
    ("huge width", {**OK, "width": 4096}, 422, "width", "at most 128"),
    ("too many frames", {**OK, "num_frames": 1001}, 422, "num_frames", "at most 33"),
    ("height off the grid", {**OK, "height": 30}, 422, "height", "nearest valid"),
    ("num_frames not 4k+1", {**OK, "num_frames": 6}, 422, "num_frames", "nearest valid"),
    ("negative guidance", {**OK, "guidance_scale": -1}, 422, "guidance_scale", "expected"),
    ("negative seed", {**OK, "seed": -5}, 422, "seed", "expected"),
    ("seed a string", {**OK, "seed": "abc"}, 422, "seed", "an integer"),
    ("fps zero", {**OK, "fps": 0}, 422, "fps", "expected"),
    ("negative flow_shift", {**OK, "flow_shift": -1.0}, 422, "flow_shift", "expected"),
    ("negative_prompt a number", {**OK, "negative_prompt": 3}, 422, "negative_prompt", "a string"),
    ("unknown field", {**OK, "foo": 1}, 422, "foo", "unknown field"),
    ("output_path is the server's", {**OK, "output_path": "/etc/x.mp4"}, 422, "output_path", "unknown field"),
    ("several videos per job", {**OK, "num_videos_per_prompt": 4}, 422, "num_videos_per_prompt", "unknown field"),
    ("unknown LoRA", {**OK, "lora": "style"}, 422, "lora", "loaded adapters"),
    ("lora_scale with no adapter", {**OK, "lora_scale": 0.5}, 422, "lora_scale", "no adapter is selected"),
    ("lora a number", {**OK, "lora": 3}, 422, "lora", "an adapter's name"),
    ("image for a text-only model", {**OK, "image": png_base64()}, 422, "image", "text-to-video"),
    ("bad size string", {**OK, "size": "big"}, 422, "size", "WIDTHxHEIGHT"),
    ("size not a string", {**OK, "size": 64}, 422, "size", "WIDTHxHEIGHT"),
    ("size and height", {**OK, "size": "64x64", "height": 64}, 422, "size", "not both"),
    ("zero size", {**OK, "size": "0x0"}, 422, "height", "expected"),
    ("negative seconds", {**OK, "seconds": -1}, 422, "seconds", "seconds > 0"),
    ("seconds not a number", {**OK, "seconds": "abc"}, 422, "seconds", "seconds > 0"),
    ("seconds and num_frames", {**OK, "seconds": 2, "num_frames": 17}, 422, "seconds", "not both"),
    ("too many seconds", {**OK, "seconds": 60}, 422, "num_frames", "at most 33"),
    ("start_image for a text-only model", {**OK, "start_image": "/etc/passwd"}, 422, "start_image",
     "cannot start a stream from an image"),
    ("another model", {**OK, "model": "sora-2"}, 422, "model", "this server serves"),
    ("model an object", {**OK, "model": {"name": "shapes-t2v"}}, 422, "model", "expected a string"),
    ("model a list", {**OK, "model": ["shapes-t2v"]}, 422, "model", "expected a string"),
    ("model a number", {**OK, "model": 2}, 422, "model", "expected a string"),
    ("guidance_scale a string", {**OK, "guidance_scale": "5"}, 422, "guidance_scale", "a finite number"),
    ("guidance_scale infinite", {**OK, "guidance_scale": float("inf")}, 422, "guidance_scale", "a finite number"),
    ("flow_shift -infinite", {**OK, "flow_shift": float("-inf")}, 422, "flow_shift", "a finite number"),
    ("guidance_scale a bool", {**OK, "guidance_scale": True}, 422, "guidance_scale", "a finite number"),
    ("seed a bool", {**OK, "seed": False}, 422, "seed", "an integer"),
    ("seed a float", {**OK, "seed": 1.0}, 422, "seed", "an integer"),
    ("fps a string", {**OK, "fps": "16"}, 422, "fps", "an integer"),
    ("prompt an object", {"prompt": {"text": "a"}}, 422, "prompt", "a string"),
    ("negative_prompt a list", {**OK, "negative_prompt": ["a"]}, 422, "negative_prompt", "a string"),
    ("lora a list of numbers", {**OK, "lora": [1, 2]}, 422, "lora", "an adapter's name"),
    ("lora_scale a string", {**OK, "lora": [], "lora_scale": "1"}, 422, "lora_scale", "no adapter"),
    ("seconds a bool", {**OK, "seconds": True}, 422, "seconds", "seconds > 0"),
    ("seconds infinite", {**OK, "seconds": "inf"}, 422, "seconds", "seconds > 0"),
    ("size a list", {**OK, "size": [64, 64]}, 422, "size", "WIDTHxHEIGHT"),
    ("priority a bool", {**OK, "priority": True}, 422, "priority", "an integer"),
    ("priority a float", {**OK, "priority": 1.5}, 422, "priority", "an integer"),
    ("priority a string", {**OK, "priority": "high"}, 422, "priority", "an integer"),
    ("priority a list", {**OK, "priority": [1]}, 422, "priority", "an integer"),
    ("a JSON array", [OK], 422, None, "JSON object"),
    ("a JSON string", "a red circle", 422, None, "JSON object"),
]

RAW = [  # bodies that are not JSON at all
    ("non-JSON body", b"prompt=a red circle", 400, "not valid JSON"),
    ("empty body", b"", 400, "empty"),
    ("invalid UTF-8", b'{"prompt": "\xff\xfe"}', 400, "not valid JSON"),
    ("NaN guidance", b'{"prompt": "a", "guidance_scale": NaN}', 422, "guidance_scale"),
    ("Infinity flow_shift", b'{"prompt": "a", "flow_shift": Infinity}', 422, "flow_shift"),
    ("a form body", b"prompt=a+red+circle&seed=0", 400, "not valid JSON"),
    ("truncated JSON", b'{"prompt": "a red', 400, "not valid JSON"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    generator = VideoGenerator.from_pretrained(None, progress=False)
    srv = Server(lambda: generator, ServeConfig(output_dir=tmp_path_factory.mktemp("serve"), limits=LIMITS,
                                                max_body_bytes=2**20))
    srv.wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def i2v_server(tmp_path_factory):
    folder = build_tiny_wan_i2v(tmp_path_factory.mktemp("models") / "tiny-wan-i2v")
    generator = VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False)
    srv = Server(lambda: generator, ServeConfig(output_dir=tmp_path_factory.mktemp("serve-i2v")))
    srv.wait_ready()
    yield srv
    srv.stop()


def refused(reply, status: int, field: str | None, words: str) -> None:
    assert reply.status == status, reply.body
    error = reply.json["error"]
    assert error["param"] == field and words in error["message"], error
    if field is not None:
        assert field in error["message"], error


@pytest.mark.parametrize("case,body,status,field,words", CASES, ids=[c[0] for c in CASES])
def test_a_malformed_request_is_refused_naming_the_field(server, case, body, status, field, words):
    refused(server.request("POST", "/v1/videos", body), status, field, words)


@pytest.mark.parametrize("case,raw,status,words", RAW, ids=[c[0] for c in RAW])
def test_a_body_that_is_not_json_is_refused(server, case, raw, status, words):
    reply = server.request("POST", "/v1/videos", raw=raw)
    assert reply.status == status and words in reply.json["error"]["message"], reply.body


def test_an_oversized_body_is_413(server):
    big = json.dumps({"prompt": "x" * (2**20 + 10)}).encode()
    reply = server.request("POST", "/v1/videos", raw=big)
    assert reply.status == 413 and "at most" in reply.json["error"]["message"]


@pytest.mark.parametrize("method,path", [("GET", "/v1/videos/video_nope"), ("GET", "/v1/videos/video_nope/content"),
                                         ("DELETE", "/v1/videos/video_nope"), ("GET", "/v1/nothing")])
def test_an_unknown_job_or_route_is_404(server, method, path):
    reply = server.request(method, path)
    assert reply.status == 404 and reply.json["error"]["message"], reply.body


def test_the_server_keeps_serving_after_the_catalogue(server):
    assert server.request("GET", "/health").status == 200
    reply = server.request("POST", "/v1/videos", {**OK, "num_inference_steps": 2, "num_frames": 5, "size": "64x64",
                                                  "model": "shapes-t2v"})
    assert reply.status == 200 and reply.json["status"] == "queued"
    assert reply.json["request"]["width"] == 64
    seconds = server.request("POST", "/v1/videos", {**OK, "num_inference_steps": 2, "seconds": "2", "fps": 8}).json
    assert seconds["request"]["num_frames"] == 17  # 2 s at 8 fps: 16 frames, the nearest valid length 17
    server.request("DELETE", f"/v1/videos/{seconds['id']}")
    server.request("DELETE", f"/v1/videos/{reply.json['id']}")
    assert not any(job["status"] == "queued" for job in server.request("GET", "/v1/videos?order=asc").json["data"][:-1])


IMAGE_CASES = [
    ("no image", {**OK}, "image", "input image"),
    ("image not base64", {**OK, "image": "not base64!!"}, "image", "base64"),
    ("base64 of no image", {**OK, "image": base64.b64encode(b"hello world").decode()}, "image", "not a readable image"),
    ("image a number", {**OK, "image": 5}, "image", "base64-encoded image"),
    ("data URL of no image", {**OK, "image": "data:image/png;base64,aGVsbG8="}, "image", "not a readable image"),
    ("last_image for a first-frame model", {**OK, "image": png_base64(), "last_image": png_base64()}, "last_image",
     "first frame"),
]


@pytest.mark.parametrize("case,body,field,words", IMAGE_CASES, ids=[c[0] for c in IMAGE_CASES])
def test_a_bad_image_is_refused_naming_the_field(i2v_server, case, body, field, words):
    refused(i2v_server.request("POST", "/v1/videos", body), 422, field, words)


def test_an_image_model_takes_a_data_url(i2v_server):
    reply = i2v_server.request("POST", "/v1/videos", {**OK, "image": "data:image/png;base64," + png_base64(),
                                                       "num_inference_steps": 2, "num_frames": 5})
    assert reply.status == 200, reply.body
    assert "image" not in reply.json["request"]  # decoded pixels stay out of the record
    i2v_server.request("DELETE", f"/v1/videos/{reply.json['id']}")
    assert i2v_server.request("GET", "/health").status == 200


def test_a_causal_models_start_frames_are_never_read_from_the_servers_disk():
    from types import SimpleNamespace

    from composer.configs.causal_wan import CausalWanSamplingParam
    from composer.serve.requests import RequestProblem, check_body

    causal = SimpleNamespace(default_sampling=CausalWanSamplingParam(), family="causal-wan", pipeline=None)
    for key in ("start_image", "start_video"):
        with pytest.raises(RequestProblem, match="not a URL or a path: this server does not fetch or read files") as exc:
            check_body({**OK, key: "/etc/passwd"}, causal, LIMITS, [])
        assert exc.value.field == key


def test_a_video_to_video_input_is_never_read_from_the_servers_disk():
    from types import SimpleNamespace

    from composer.configs.wan import WanT2V480PSamplingParam
    from composer.serve.requests import RequestProblem, check_body

    t2v = SimpleNamespace(default_sampling=WanT2V480PSamplingParam(), family="wan2.1-t2v", pipeline=None)
    with pytest.raises(RequestProblem, match="video: .*not a URL or a path: this server does not fetch") as exc:
        check_body({**OK, "video": "/etc/passwd"}, t2v, LIMITS, [])
    assert exc.value.field == "video"
