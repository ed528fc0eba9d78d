"""`composer serve` driven by the official `openai` SDK, unchanged (sync and async clients): create (multipart, with
`extra_body` fields and an `input_reference` upload), retrieve / poll, list pages, download_content, delete, remix,
edit and extend, and the error paths, against real servers on 127.0.0.1. Each video the SDK gets is the one
generate_video makes from the same request."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import PIL.Image
import pytest

pytest.importorskip("fastapi", reason="composer serve needs the serve extra (fastapi, uvicorn)")
openai = pytest.importorskip("openai", reason="the OpenAI SDK is the client these tests drive")
from serve_support import Server  # noqa: E402

from composer.generator import VideoGenerator  # noqa: E402
from composer.serve.app import ServeConfig  # noqa: E402
from composer.testing import build_tiny_wan_i2v  # noqa: E402
from composer.video import read_frames, save_video  # noqa: E402

SMALL = {"num_inference_steps": 2, "num_frames": 9, "guidance_scale": 1.0}
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")  # the SDK marks its video API


def client_for(server: Server, cls=openai.OpenAI):
    return cls(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def t2v(composer_gen, tmp_path_factory):
    """A tiny Wan2.1 text-to-video model (it also does video-to-video: remix and edit redraw a video)."""
    srv = Server(lambda: composer_gen, ServeConfig(output_dir=tmp_path_factory.mktemp("serve-t2v")))
    srv.wait_ready()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def causal_gen():
    return VideoGenerator.from_pretrained("shapes-causal", progress=False)


@pytest.fixture(scope="module")
def causal(causal_gen, tmp_path_factory):
    srv = Server(lambda: causal_gen, ServeConfig(output_dir=tmp_path_factory.mktemp("serve-causal")))
    srv.wait_ready()
    yield srv
    srv.stop()


def served_frames(client, video_id: str, tmp_path, name: str) -> np.ndarray:
    path = tmp_path / f"{name}.mp4"
    client.videos.download_content(video_id).write_to_file(path)
    return read_frames(path)


def direct_frames(generator, tmp_path, name: str, **request) -> np.ndarray:
    """generate_video's frames for a request, through the same mp4 writer as the server's."""
    path = tmp_path / f"{name}-direct.mp4"
    generator.generate_video(output_path=str(path), **request)
    return read_frames(path)


def png(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    PIL.Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def test_the_sdk_creates_polls_lists_downloads_and_deletes(t2v, composer_gen, tmp_path):
    client = client_for(t2v)
    video = client.videos.create(prompt="a red fox", size="48x32", extra_body={**SMALL, "seed": 3})
    assert video.status == "queued" and video.object == "video" and video.size == "48x32"
    assert isinstance(video.created_at, int) and isinstance(video.progress, int) and isinstance(video.seconds, str)
    done = client.videos.poll(video.id, poll_interval_ms=20)
    assert done.status == "completed" and done.progress == 100 and isinstance(done.completed_at, int)
    assert done.seconds == "0.56"  # 9 frames at 16 fps
    served = served_frames(client, done.id, tmp_path, "fox")
    np.testing.assert_array_equal(served, direct_frames(composer_gen, tmp_path, "fox", prompt="a red fox", height=32,
                                                        width=48, seed=3, **SMALL))
    thumbnail = client.videos.download_content(done.id, variant="thumbnail").content
    assert PIL.Image.open(io.BytesIO(thumbnail)).size == (48, 32)

    second = client.videos.create_and_poll(prompt="a blue bird", size="48x32", poll_interval_ms=20,
                                           extra_body=SMALL)
    assert second.status == "completed"
    newest_first = [v.id for v in client.videos.list(limit=1)]  # the SDK follows `after` page by page
    assert newest_first[:2] == [second.id, done.id]
    assert [v.id for v in client.videos.list(order="asc")][-2:] == [done.id, second.id]
    page = client.videos.list(limit=1)
    assert page.has_more and len(page.data) == 1 and page.last_id == second.id

    deleted = client.videos.delete(done.id)
    assert deleted.deleted and deleted.object == "video.deleted" and deleted.id == done.id
    with pytest.raises(openai.NotFoundError, match=done.id):
        client.videos.retrieve(done.id)
    assert done.id not in [v.id for v in client.videos.list()]
    client.videos.delete(second.id)


def test_the_async_client_creates_polls_downloads_and_cancels(t2v, tmp_path):
    async def run():
        client = client_for(t2v, openai.AsyncOpenAI)
        first = await client.videos.create(prompt="a green hill", size="48x32",
                                           extra_body={**SMALL, "num_inference_steps": 30})
        second = await client.videos.create(prompt="a grey cat", size="48x32", extra_body=SMALL)
        cancelled = await client.videos.delete(first.id)  # queued or running: cancelled, not deleted
        assert cancelled.id == first.id and cancelled.deleted is False
        done = await client.videos.poll(second.id, poll_interval_ms=20)
        content = await client.videos.download_content(done.id)
        listed = [v.id async for v in client.videos.list(limit=1)]
        first_now = await client.videos.retrieve(first.id)
        await client.close()
        return done, content.content, listed, first_now

    done, data, listed, first_now = asyncio.run(run())
    assert done.status == "completed" and data[4:8] == b"ftyp"
    assert first_now.status == "cancelled" and listed[:2] == [done.id, first_now.id]


def test_form_fields_are_typed_and_checked_as_json_fields_are(t2v):
    import uuid

    def multipart(fields: dict) -> tuple[bytes, str]:
        boundary = uuid.uuid4().hex
        parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n' for k, v in fields.items()]
        return ("".join(parts) + f"--{boundary}--\r\n").encode(), f"multipart/form-data; boundary={boundary}"

    def post(fields: dict):
        body, kind = multipart(fields)
        return t2v.request("POST", "/v1/videos", raw=body, headers={"Content-Type": kind})

    ok = post({"prompt": "a fox", "num_inference_steps": "2", "guidance_scale": "1.5", "seed": "5",
               "negative_prompt": "123", "size": "48x32", "num_frames": "9"})
    assert ok.status == 200, ok.body
    request = ok.json["request"]
    assert (request["num_inference_steps"], request["guidance_scale"], request["seed"]) == (2, 1.5, 5)
    assert request["negative_prompt"] == "123" and (request["width"], request["height"]) == (48, 32)
    t2v.request("DELETE", f"/v1/videos/{ok.json['id']}")
    for field, value in [("num_inference_steps", "2.5"), ("num_inference_steps", "two"), ("seed", "true"),
                         ("guidance_scale", "nan")]:
        as_form = post({"prompt": "a fox", field: value})
        json_value = {"2.5": 2.5, "true": True}.get(value, value)
        as_json = t2v.request("POST", "/v1/videos", {"prompt": "a fox", field: json_value})
        assert as_form.status == as_json.status == 422, (field, value)
        assert as_form.json["error"]["param"] == as_json.json["error"]["param"] == field
        assert as_form.json["error"]["message"] == as_json.json["error"]["message"]


def test_sdk_errors_are_the_sdks_exceptions_and_the_server_goes_on(t2v):
    client = client_for(t2v)
    with pytest.raises(openai.UnprocessableEntityError, match="num_inference_steps") as exc:
        client.videos.create(prompt="a fox", extra_body={"num_inference_steps": "many"})
    assert exc.value.body["param"] == "num_inference_steps"
    with pytest.raises(openai.UnprocessableEntityError, match="size"):
        client.videos.create(prompt="a fox", size="wide")
    with pytest.raises(openai.UnprocessableEntityError, match="this server serves"):
        client.videos.create(prompt="a fox", model="sora-2")
    with pytest.raises(openai.UnprocessableEntityError, match="input_reference: .*image.*video-to-video"):
        client.videos.create(prompt="a fox", input_reference=("start.png", png(np.zeros((8, 8, 3), np.uint8)),
                                                               "image/png"))
    with pytest.raises(openai.NotFoundError, match="video_nope"):
        client.videos.retrieve("video_nope")
    with pytest.raises(openai.NotFoundError):
        client.videos.remix("video_nope", prompt="again")
    with pytest.raises(openai.BadRequestError, match="limit"):
        client.videos.list(limit=1000)
    with pytest.raises(openai.BadRequestError, match="after"):
        client.videos.list(after="video_nope")
    running = client.videos.create(prompt="a slow fox", size="48x32", extra_body={**SMALL, "num_inference_steps": 40})
    with pytest.raises(openai.ConflictError, match="only a completed video can be remixed"):
        client.videos.remix(running.id, prompt="again")
    with pytest.raises(openai.ConflictError, match="content is available once it is completed"):
        client.videos.download_content(running.id)
    client.videos.delete(running.id)
    assert t2v.request("GET", "/health").status == 200


@pytest.mark.slow  # 3 s: four videos and their direct runs
def test_remix_and_edit_redraw_a_video_as_video_to_video_does(t2v, composer_gen, tmp_path):
    client = client_for(t2v)
    source = client.videos.create_and_poll(prompt="a red fox", size="48x32", poll_interval_ms=20,
                                           extra_body={**SMALL, "seed": 1})
    remix = client.videos.remix(source.id, prompt="a watercolor fox", extra_body={"seed": 2, "strength": 0.5})
    assert remix.remixed_from_video_id == source.id and remix.size == "48x32"
    remix = client.videos.poll(remix.id, poll_interval_ms=20)
    assert remix.status == "completed", remix.error
    source_frames = served_frames(client, source.id, tmp_path, "source")
    expected = direct_frames(composer_gen, tmp_path, "remix", prompt="a watercolor fox", video=source_frames,
                             strength=0.5, seed=2, height=32, width=48, **SMALL)
    np.testing.assert_array_equal(served_frames(client, remix.id, tmp_path, "remix"), expected)

    # OpenAI's edit: the same, from an uploaded video (its first 4k + 1 frames) or a completed video's id
    upload = tmp_path / "upload.mp4"
    save_video(np.concatenate([source_frames, source_frames[:3]]), upload, fps=16)  # 12 frames: 9 are used
    edit = client.videos.edit(prompt="a watercolor fox", video=upload.open("rb"),
                              extra_body={"seed": 2, "strength": 0.5, "size": "48x32", **SMALL})
    edit = client.videos.poll(edit.id, poll_interval_ms=20)
    assert edit.status == "completed", edit.error
    uploaded = read_frames(upload)[:9]
    expected = direct_frames(composer_gen, tmp_path, "edit", prompt="a watercolor fox", video=uploaded, strength=0.5,
                             seed=2, height=32, width=48, **SMALL)
    np.testing.assert_array_equal(served_frames(client, edit.id, tmp_path, "edit"), expected)
    # a reference to a completed video (this SDK cannot send one: it takes any `video` for a file, so plain HTTP)
    by_id = t2v.request("POST", "/v1/videos/edits", {"prompt": "a fox at night", "video": {"id": source.id},
                                                     "seed": 4})
    assert by_id.status == 200 and by_id.json["remixed_from_video_id"] == source.id
    assert t2v.wait(by_id.json["id"])["status"] == "completed"
    refused = t2v.request("POST", "/v1/videos/extensions", {"prompt": "more", "seconds": "4",
                                                            "video": {"id": source.id}})
    assert refused.status == 422 and "cannot extend a video: it redraws videos" in refused.json["error"]["message"]


@pytest.mark.slow  # about 5 s: three causal videos and their direct runs
def test_a_causal_model_starts_from_an_uploaded_image_and_continues_a_video(causal, causal_gen, tmp_path):
    client = client_for(causal)
    start = np.zeros((48, 64, 3), np.uint8)
    start[10:30, 20:40] = (255, 0, 0)
    size = {"size": "64x48"}
    first = client.videos.create(prompt="a red square moving right", size="64x48",
                                 input_reference=("start.png", png(start), "image/png"), extra_body={"seed": 5})
    first = client.videos.poll(first.id, poll_interval_ms=20)
    assert first.status == "completed", first.error
    expected = direct_frames(causal_gen, tmp_path, "start", prompt="a red square moving right", height=48, width=64,
                             seed=5, start_image=start)
    first_frames = served_frames(client, first.id, tmp_path, "start")
    np.testing.assert_array_equal(first_frames, expected)

    # a remix continues it: from its last (overlap_frames - 1) x 4 + 1 frames, as long again
    remix = client.videos.poll(client.videos.remix(first.id, prompt="a red square moving down",
                                                   extra_body={"seed": 6}).id, poll_interval_ms=20)
    assert remix.status == "completed", remix.error
    overlap = causal_gen.default_sampling.overlap_frames
    tail = first_frames[-((overlap - 1) * 4 + 1):]
    remixed = served_frames(client, remix.id, tmp_path, "remix")
    assert len(remixed) == len(first_frames)
    np.testing.assert_array_equal(remixed, direct_frames(
        causal_gen, tmp_path, "remix", prompt="a red square moving down", height=48, width=64, seed=6,
        start_video=tail, num_frames=len(first_frames)))

    # an extension: `seconds` more of an uploaded video; the same as a JSON upload of the start video
    upload = tmp_path / "upload.mp4"
    save_video(first_frames, upload, fps=16)
    extended = client.videos.poll(client.videos.extend(prompt="a red square", seconds="1", video=upload.open("rb"),
                                                       extra_body={"seed": 7, **size}).id, poll_interval_ms=20)
    assert extended.status == "completed", extended.error
    got = served_frames(client, extended.id, tmp_path, "extend")
    assert len(got) > len(tail) and 16 - 8 <= len(got) - len(tail) <= 16 + 8  # 1 s at 16 fps, in whole blocks
    with pytest.raises(openai.UnprocessableEntityError, match="cannot edit a video: it continues videos"):
        client.videos.edit(prompt="x", video=upload.open("rb"))


def test_an_image_to_video_model_takes_the_sdks_input_reference(tmp_path_factory, tmp_path):
    folder = build_tiny_wan_i2v(tmp_path_factory.mktemp("models") / "tiny-wan-i2v-sdk")
    generator = VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False)
    srv = Server(lambda: generator, ServeConfig(output_dir=tmp_path / "serve"))
    try:
        srv.wait_ready()
        client = client_for(srv)
        image = np.random.default_rng(0).integers(0, 255, (32, 48, 3)).astype(np.uint8)
        video = client.videos.create_and_poll(prompt="a cat", size="48x32", poll_interval_ms=20,
                                              input_reference=("first.png", png(image), "image/png"),
                                              extra_body={**SMALL, "seed": 9})
        assert video.status == "completed", video.error
        expected = direct_frames(generator, tmp_path, "i2v", prompt="a cat", image=PIL.Image.fromarray(image),
                                 height=32, width=48, seed=9, **SMALL)
        np.testing.assert_array_equal(served_frames(client, video.id, tmp_path, "i2v"), expected)
        # the JSON form of OpenAI's image reference: {"image_url": a data URL}
        import base64

        url = "data:image/png;base64," + base64.b64encode(png(image)).decode()
        reply = srv.request("POST", "/v1/videos", {"prompt": "a cat", "size": "48x32", **SMALL, "seed": 9,
                                                   "input_reference": {"image_url": url}})
        assert reply.status == 200, reply.body
        done = srv.wait(reply.json["id"])
        assert done["status"] == "completed"
        with pytest.raises(openai.UnprocessableEntityError, match="cannot remix a video"):
            client.videos.remix(video.id, prompt="again")
        refused = srv.request("POST", "/v1/videos", {"prompt": "a cat", "input_reference": {"file_id": "file_1"}})
        assert refused.status == 422 and "keeps no uploaded files" in refused.json["error"]["message"]
    finally:
        srv.stop()


def test_cancel_keeps_the_record_and_never_deletes_a_finished_video(t2v):
    """POST /v1/videos/{id}/cancel (the page's cancel button): a second click on a job that just finished must not
    delete it, as DELETE would."""
    running = t2v.request("POST", "/v1/videos", {"prompt": "a slow fox", "size": "48x32", **SMALL,
                                                 "num_inference_steps": 40}).json
    cancelled = t2v.request("POST", f"/v1/videos/{running['id']}/cancel")
    assert cancelled.status == 200 and cancelled.json["id"] == running["id"]
    assert t2v.wait(running["id"])["status"] == "cancelled"
    again = t2v.request("POST", f"/v1/videos/{running['id']}/cancel")
    assert again.status == 409 and "already cancelled" in again.json["error"]["message"]
    assert t2v.request("GET", f"/v1/videos/{running['id']}").status == 200  # still there
    assert t2v.request("POST", "/v1/videos/video_nope/cancel").status == 404


@pytest.mark.slow  # about 5 s: a tiny SkyReels-V2 DF folder, three videos and their direct runs
def test_a_model_that_extends_whole_videos_remixes_and_extends_them(tmp_path_factory, tmp_path):
    """SkyReels-V2 diffusion forcing extends a whole video (`video_use` = "extend"): a remix or an extension is
    generate_video(video=the frames, num_frames=new frames), and an edit is refused by name."""
    from composer.testing.tiny_skyreels import build_tiny_skyreels_df

    folder = build_tiny_skyreels_df(tmp_path_factory.mktemp("models") / "tiny-skyreels-sdk")
    generator = VideoGenerator.from_pretrained(folder, dtype="fp32", progress=False)
    srv = Server(lambda: generator, ServeConfig(output_dir=tmp_path / "serve"))
    knobs = {"num_inference_steps": 2, "guidance_scale": 1.0, "negative_prompt": None}
    try:
        srv.wait_ready()
        client = client_for(srv)
        source = client.videos.create_and_poll(prompt="a boat", size="80x48", poll_interval_ms=20,
                                               extra_body={**knobs, "num_frames": 9, "seed": 1})
        assert source.status == "completed", source.error
        frames = served_frames(client, source.id, tmp_path, "source")
        remix = client.videos.poll(client.videos.remix(source.id, prompt="a boat at dusk", extra_body={
            "seed": 2, "overlap_history": 5}).id, poll_interval_ms=20)
        assert remix.status == "completed", remix.error
        expected = direct_frames(generator, tmp_path, "remix", prompt="a boat at dusk", video=frames, num_frames=9,
                                 overlap_history=5, seed=2, height=48, width=80, **knobs)
        np.testing.assert_array_equal(served_frames(client, remix.id, tmp_path, "remix"), expected)
        upload = tmp_path / "upload.mp4"
        save_video(frames, upload, fps=24)
        extended = client.videos.poll(client.videos.extend(prompt="a boat", seconds="0.5", video=upload.open("rb"),
                                                           extra_body={"seed": 3, "overlap_history": 5,
                                                                       "size": "80x48", **knobs}).id,
                                      poll_interval_ms=20)
        assert extended.status == "completed", extended.error
        assert len(served_frames(client, extended.id, tmp_path, "extend")) == len(frames) + 13  # 0.5 s at 24 fps: 4k+1
        with pytest.raises(openai.UnprocessableEntityError, match="cannot edit a video: it continues videos"):
            client.videos.edit(prompt="x", video=upload.open("rb"))
        without = srv.request("POST", f"/v1/videos/{source.id}/remix", {"prompt": "again"})
        assert without.status == 422 and without.json["error"]["param"] == "overlap_history", without.body
    finally:
        srv.stop()
