"""Sessions over HTTP (`/v1/sessions`): open, extend, fork, snapshot to the output folder, resume after a restart,
close; each continuation equals the same video made by one `stream_video` call."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="composer serve needs the serve extra (fastapi, uvicorn)")
pytest.importorskip("uvicorn", reason="composer serve needs the serve extra (fastapi, uvicorn)")
from serve_support import Server

from composer.generator import VideoGenerator
from composer.serve.app import ServeConfig
from composer.video import read_frames

RED, BLUE, GREEN = "a red circle moving right", "a blue square moving left", "a green circle moving up"
FAST = {"guidance_scale": 1.0, "seed": 5}


@pytest.fixture(scope="module")
def causal(one_thread):
    return VideoGenerator.from_pretrained("shapes-causal", progress=False)


@pytest.fixture()
def server(causal, tmp_path):
    server = Server(lambda: causal, ServeConfig(output_dir=tmp_path / "out"))
    server.wait_ready()
    yield server
    server.stop()


def linear(gen, segments, **kw) -> np.ndarray:
    return np.concatenate([c.frames for c in gen.stream_video(segments, **FAST, **kw)])


def test_a_session_is_opened_extended_forked_and_closed(server, causal, tmp_path):
    opened = server.request("POST", "/v1/sessions", {**FAST, "prompt_switch": "keep"})
    assert opened.status == 201, opened.body
    sid = opened.json["id"]
    done = server.request("POST", f"/v1/sessions/{sid}/extend", {"prompt": RED, "num_blocks": 2})
    assert done.status == 200, done.body
    assert done.json["blocks"] == 2 and done.json["new_frames"] == done.json["frames"] > 0
    segment = read_frames(tmp_path / "out" / sid / done.json["video"])
    assert len(segment) == done.json["new_frames"]

    forked = server.request("POST", f"/v1/sessions/{sid}/fork")
    assert forked.status == 201 and forked.json["blocks"] == 2
    fid = forked.json["id"]
    assert server.request("POST", f"/v1/sessions/{sid}/extend", {"prompt": BLUE, "num_blocks": 1}).status == 200
    assert server.request("POST", f"/v1/sessions/{fid}/extend", {"prompt": GREEN, "num_blocks": 2}).status == 200

    listed = server.request("GET", "/v1/sessions").json
    assert {s["id"] for s in listed["data"]} == {sid, fid}
    video = server.request("GET", f"/v1/sessions/{fid}/video")
    assert video.status == 200 and video.headers["content-type"] == "video/mp4"
    # the frames themselves (mp4 is lossy): the sessions' equal one stream_video call each
    store = server.app.state.composer.sessions
    assert np.array_equal(store.get(sid).session.frames, linear(causal, [(RED, 2), (BLUE, 1)], prompt_switch="keep"))
    assert np.array_equal(store.get(fid).session.frames, linear(causal, [(RED, 2), (GREEN, 2)], prompt_switch="keep"))

    closed = server.request("DELETE", f"/v1/sessions/{sid}")
    assert closed.status == 200 and closed.json["closed"]
    assert server.request("GET", f"/v1/sessions/{sid}").status == 404
    assert server.request("DELETE", f"/v1/sessions/{fid}").status == 200
    assert causal.pipeline.stage("CausalDenoisingStage").kv_pool.stats().used_bytes == 0


def test_a_snapshot_in_the_output_folder_resumes_after_a_restart(causal, tmp_path):
    out = tmp_path / "out"
    first = Server(lambda: causal, ServeConfig(output_dir=out))
    first.wait_ready()
    sid = first.request("POST", "/v1/sessions", FAST).json["id"]
    assert first.request("POST", f"/v1/sessions/{sid}/extend", {"prompt": RED, "num_blocks": 2}).status == 200
    snap = first.request("POST", f"/v1/sessions/{sid}/snapshot", {"name": "my-world"})
    assert snap.status == 200 and snap.json["name"] == "my-world" and snap.json["bytes"] > 0
    assert (out / "sessions" / "my-world.session").is_file()
    first.stop()

    second = Server(lambda: causal, ServeConfig(output_dir=out))  # a new server over the same folder
    second.wait_ready()
    try:
        assert second.request("GET", "/v1/sessions").json["snapshots"] == ["my-world"]
        resumed = second.request("POST", "/v1/sessions/resume", {"snapshot": "my-world"})
        assert resumed.status == 201 and resumed.json["blocks"] == 2
        rid = resumed.json["id"]
        assert second.request("POST", f"/v1/sessions/{rid}/extend", {"prompt": BLUE, "num_blocks": 1}).status == 200
        got = second.app.state.composer.sessions.get(rid).session.frames
        assert np.array_equal(got, linear(causal, [(RED, 2), (BLUE, 1)]))
    finally:
        second.stop()


def test_bad_session_requests_get_clear_errors_and_lose_nothing(server):
    assert server.request("POST", "/v1/sessions", {"height": "tall"}).status == 400
    assert server.request("POST", "/v1/sessions", {"nonsense": 1}).json["error"]["param"] == "nonsense"
    assert server.request("POST", "/v1/sessions/sess_nope/extend", {"prompt": RED}).status == 404
    sid = server.request("POST", "/v1/sessions", FAST).json["id"]
    bad = server.request("POST", f"/v1/sessions/{sid}/extend", {"prompt": "", "num_blocks": 1})
    assert bad.status == 400 and bad.json["error"]["param"] == "prompt"
    assert server.request("POST", f"/v1/sessions/{sid}/extend", {"prompt": RED, "num_blocks": 0}).status == 400
    assert server.request("POST", f"/v1/sessions/{sid}/extend", {"prompt": RED, "extra": 1}).status == 400
    assert server.request("GET", f"/v1/sessions/{sid}/video").status == 409  # nothing made yet
    for name in ("../escape", "a/b", "", "x" * 80):
        assert server.request("POST", f"/v1/sessions/{sid}/snapshot", {"name": name}).status == 400
    assert server.request("POST", "/v1/sessions/resume", {"snapshot": "../../etc/passwd"}).status == 400
    assert server.request("POST", "/v1/sessions/resume", {"snapshot": "missing"}).status == 404
    # the session is still usable after every refusal
    assert server.request("POST", f"/v1/sessions/{sid}/extend", {"prompt": RED, "num_blocks": 1}).status == 200


def test_sessions_are_limited_and_idle_ones_expire(causal, tmp_path):
    server = Server(lambda: causal, ServeConfig(output_dir=tmp_path / "out", max_sessions=2, session_ttl=0.2))
    server.wait_ready()
    try:
        a = server.request("POST", "/v1/sessions", FAST).json["id"]
        server.request("POST", "/v1/sessions", FAST)
        full = server.request("POST", "/v1/sessions", FAST)
        assert full.status == 429
        import time

        time.sleep(0.4)
        assert server.request("POST", "/v1/sessions", FAST).status == 201  # the idle two expired
        assert server.request("GET", f"/v1/sessions/{a}").status == 404
    finally:
        server.stop()


def test_a_server_of_a_whole_video_model_says_sessions_need_a_causal_one(tmp_path, one_thread):
    t2v = VideoGenerator.from_pretrained("shapes-t2v", progress=False)
    server = Server(lambda: t2v, ServeConfig(output_dir=tmp_path / "out"))
    server.wait_ready()
    try:
        reply = server.request("POST", "/v1/sessions", FAST)
        assert reply.status == 400 and "causal" in reply.json["error"]["message"]
    finally:
        server.stop()
