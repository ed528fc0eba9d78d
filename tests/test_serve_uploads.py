"""Image and video uploads over HTTP: multipart files and base64 / data URLs in JSON, for every input field a model
takes, decoded off the event loop within the server's limits. Good uploads queue the job with the decoded frames;
each malformed one is a 4xx naming the field, and the server goes on."""

from __future__ import annotations

import base64
import io
import struct
import uuid
import zlib

import numpy as np
import PIL.Image
import pytest

pytest.importorskip("fastapi", reason="composer serve needs the serve extra (fastapi, uvicorn)")
from serve_support import Server

from composer.generator import VideoGenerator
from composer.serve.app import ServeConfig
from composer.serve.uploads import UploadLimits
from composer.video import save_video

LIMITS = UploadLimits(max_bytes=300_000, max_video_frames=40, max_pixels=200 * 200)
OK = {"prompt": "a red square", "seed": 0}


def png(size=(48, 64), value=128) -> bytes:
    buffer = io.BytesIO()
    PIL.Image.fromarray(np.full((*size, 3), value, np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def gif() -> bytes:
    buffer = io.BytesIO()
    PIL.Image.fromarray(np.full((48, 64, 3), 200, np.uint8)).save(buffer, format="GIF")
    return buffer.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    rng = np.random.default_rng(0)

    def mp4(name, frames, size=(48, 64)):
        save_video(rng.integers(0, 255, (frames, *size, 3)).astype(np.uint8), folder / name, fps=16)
        return (folder / name).read_bytes()

    return {"mp4": mp4("ok.mp4", 9), "long": mp4("long.mp4", 50), "wide": mp4("wide.mp4", 2, (240, 320))}


@pytest.fixture(scope="module")
def causal(tmp_path_factory):
    generator = VideoGenerator.from_pretrained("shapes-causal", progress=False)
    srv = Server(lambda: generator, ServeConfig(output_dir=tmp_path_factory.mktemp("serve"), uploads=LIMITS,
                                                max_body_bytes=600_000))
    srv.wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def text_only(tmp_path_factory):
    generator = VideoGenerator.from_pretrained(None, progress=False)
    srv = Server(lambda: generator, ServeConfig(output_dir=tmp_path_factory.mktemp("serve-t2v"), uploads=LIMITS))
    srv.wait_ready()
    yield srv
    srv.stop()


def multipart(fields: dict, files: dict) -> tuple[bytes, dict]:
    boundary = uuid.uuid4().hex
    out = bytearray()
    for key, value in fields.items():
        out += f'--{boundary}\r\nContent-Disposition: form-data; name="{key}"\r\n\r\n{value}\r\n'.encode()
    for key, (name, data, kind) in files.items():
        out += (f'--{boundary}\r\nContent-Disposition: form-data; name="{key}"; filename="{name}"\r\n'
                f"Content-Type: {kind}\r\n\r\n").encode() + data + b"\r\n"
    out += f"--{boundary}--\r\n".encode()
    return bytes(out), {"Content-Type": f"multipart/form-data; boundary={boundary}"}


def post_files(server, files: dict, fields: dict | None = None):
    body, headers = multipart({**OK, **(fields or {})}, files)
    return server.request("POST", "/v1/videos", raw=body, headers=headers)


def test_good_uploads_queue_with_the_decoded_frames(causal, media):
    state = causal.app.state.composer
    replies = {
        "png file": post_files(causal, {"start_image": ("a.png", png(), "image/png")}),
        "gif file": post_files(causal, {"start_image": ("a.gif", gif(), "image/gif")}),
        "mp4 file": post_files(causal, {"start_video": ("a.mp4", media["mp4"], "video/mp4")}),
        "mp4 input_reference": post_files(causal, {"input_reference": ("a.mp4", media["mp4"], "video/mp4")}),
        "base64 png": causal.request("POST", "/v1/videos", {**OK, "start_image": b64(png())}),
        "data URL mp4": causal.request("POST", "/v1/videos", {**OK, "start_video": "data:video/mp4;base64,"
                                                              + b64(media["mp4"])}),
    }
    for name, reply in replies.items():
        assert reply.status == 200, (name, reply.body)
        job = state.store.get(reply.json["id"])
        key = "start_image" if "png" in name or "gif" in name else "start_video"
        value = job.inputs[key]
        shape = np.asarray(value).shape
        assert shape == ((48, 64, 3) if key == "start_image" else (9, 48, 64, 3)), (name, shape)
        assert key not in job.request  # decoded inputs stay off the record
    for reply in replies.values():
        causal.request("DELETE", f"/v1/videos/{reply.json['id']}")


TRUNCATED_PNG = png()[:60]


def declared_png(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height pixels, with a few bytes of data: a decompression bomb's shape."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(bytes(64))) + chunk(b"IEND", b""))


BOMB = declared_png(100_000, 100_000)  # past PIL's own bound (it refuses to open it)
LARGE = declared_png(10_000, 10_000)  # under PIL's bound, over the server's
# (case, how it is sent: "json" or "file", field, value, status, words in the message)
BAD = [
    ("not base64", "json", "start_image", "not base64!!", 422, "does not decode as base64"),
    ("base64 of text", "json", "start_image", b64(b"hello world, not an image"), 422, "not a readable image"),
    ("truncated png", "file", "start_image", TRUNCATED_PNG, 422, "starts as a PNG file but does not decode"),
    ("truncated png base64", "json", "start_image", b64(TRUNCATED_PNG), 422, "starts as a PNG file but does not decode"),
    ("video as an image", "file", "start_image", "mp4", 422, "the upload is a video"),
    ("image as a video", "file", "start_video", png(), 422, "the upload is an image"),
    ("truncated mp4", "file", "start_video", "mp4[:400]", 422, "does not decode"),
    ("ftyp and garbage", "file", "start_video", b"\x00\x00\x00\x18ftypisom" + bytes(200), 422, "does not decode"),
    ("text as a video", "file", "start_video", b"just some text, no video", 422, "not a video this server reads"),
    ("too many frames", "file", "start_video", "long", 413, "over 40 frames"),
    ("too many pixels (image)", "file", "start_image", png((240, 320)), 413, "pixels"),
    ("too many pixels (video)", "file", "start_video", "wide", 413, "pixels"),
    ("oversized file", "file", "start_image", bytes(310_000), 413, "at most 300000"),
    ("oversized base64", "json", "start_video", "A" * 420_000, 413, "over 300000 bytes"),
    ("empty file", "file", "start_image", b"", 422, "empty"),
    ("data URL not base64", "json", "start_image", "data:image/png,abcd", 422, "must be base64"),
    ("an http URL", "json", "start_image", "https://example.com/cat.png", 422, "not a URL or a path"),
    ("a server path", "json", "start_video", "/etc/passwd", 422, "not a URL or a path"),
    ("a number", "json", "start_image", 5, 422, "expected a base64-encoded image"),
    ("a list", "json", "start_video", [1, 2, 3], 422, "expected a base64-encoded video"),
    ("input_reference of text", "file", "input_reference", b"plain text", 422, "neither an image"),
    ("a bomb png", "file", "start_image", BOMB, 413, "this server accepts at most 40000 pixels"),
    ("a bomb png as input_reference", "file", "input_reference", BOMB, 413, "input_reference: the image is "
     "10000000000 pixels; this server accepts at most 40000"),
    ("a bomb png as input_reference base64", "json", "input_reference", b64(BOMB), 413, "at most 40000 pixels"),
    ("a large png as input_reference", "file", "input_reference", LARGE, 413, "the image is 10000x10000"),
    ("a png header and an mp4", "file", "input_reference", "png+mp4", 422, "input_reference: the data starts as a "
     "PNG file but does not decode as one"),
    ("a truncated png as input_reference", "file", "input_reference", TRUNCATED_PNG, 422, "expected a whole PNG, "
     "JPEG, WebP or GIF image"),
    ("input_reference file_id", "json", "input_reference", {"file_id": "file-1"}, 422, "keeps no uploaded files"),
    ("input_reference odd dict", "json", "input_reference", {"url": "x"}, 422, "expected a file"),
]


@pytest.mark.parametrize("case, how, field, value, status, words", BAD, ids=[c[0] for c in BAD])
def test_a_malformed_upload_is_a_4xx_naming_its_field(causal, media, case, how, field, value, status, words):
    if value == "png+mp4":
        value = b"\x89PNG\r\n\x1a\n" + media["mp4"]
    elif isinstance(value, str) and value.split("[")[0] in media:
        data = media[value.split("[")[0]]
        value = data[:400] if value.endswith("[:400]") else data
    if how == "file":
        reply = post_files(causal, {field: ("upload.bin", value, "application/octet-stream")})
    else:
        reply = causal.request("POST", "/v1/videos", {**OK, field: value})
    assert reply.status == status, (case, reply.body)
    error = reply.json["error"]
    assert error["param"] == field and words in error["message"], (case, error)
    assert "<_io." not in error["message"]  # no Python object in a client's message


def test_conflicting_inputs_and_bad_bodies_are_refused(causal, media):
    both = causal.request("POST", "/v1/videos", {**OK, "start_image": b64(png()), "start_video": b64(media["mp4"])})
    assert both.status == 422 and both.json["error"]["param"] == "start_video"
    twice = post_files(causal, {"input_reference": ("a.png", png(), "image/png"),
                                "start_image": ("b.png", png(), "image/png")})
    assert twice.status == 422 and "not both" in twice.json["error"]["message"]
    prompt_file = post_files(causal, {"prompt": ("p.txt", b"a file", "text/plain")}, {"seed": "1"})
    assert prompt_file.status == 422 and prompt_file.json["error"]["param"] == "prompt"
    body, headers = multipart(OK, {"start_image": ("a.png", png(), "image/png")})
    cut = causal.request("POST", "/v1/videos", raw=body[: len(body) // 2], headers=headers)
    assert cut.status == 400 and "multipart" in cut.json["error"]["message"]
    xml = causal.request("POST", "/v1/videos", raw=b"<prompt/>", headers={"Content-Type": "application/xml"})
    assert xml.status == 415
    assert causal.request("GET", "/health").status == 200


def test_an_image_for_a_text_only_model_is_refused_by_name(text_only):
    for body in ({**OK, "image": b64(png())}, {**OK, "input_reference": "data:image/png;base64," + b64(png())}):
        reply = text_only.request("POST", "/v1/videos", body)
        assert reply.status == 422 and "text-to-video" in reply.json["error"]["message"], reply.body
    reply = post_files(text_only, {"start_video": ("a.mp4", b"x", "video/mp4")})
    assert reply.status == 422 and reply.json["error"]["param"] == "start_video"


def test_curls_default_form_type_with_a_json_body_is_read_as_json(text_only):
    """`curl -d '{...}'` sends JSON as application/x-www-form-urlencoded: read as JSON, as the README shows."""
    import json

    reply = text_only.request("POST", "/v1/videos", raw=json.dumps({**OK, "num_inference_steps": 2}).encode(),
                              headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert reply.status == 200 and reply.json["request"]["num_inference_steps"] == 2
    text_only.request("DELETE", f"/v1/videos/{reply.json['id']}")
    form = text_only.request("POST", "/v1/videos", raw=b"prompt=a+red+circle&num_inference_steps=2&seed=1",
                             headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert form.status == 200 and form.json["request"]["num_inference_steps"] == 2, form.body
    text_only.request("DELETE", f"/v1/videos/{form.json['id']}")
