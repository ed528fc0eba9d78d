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


def video_fps(path) -> float:
    import av  # the container's stated rate, read without decoding a frame

    with av.open(str(path)) as container:
        return float(container.streams.video[0].average_rate)


def linear(gen, segments, **kw) -> np.ndarray:
    return np.concatenate([c.frames for c in gen.stream_video(segments, **FAST, **kw)])


def test_a_session_is_opened_extended_forked_and_closed(server, causal, tmp_path):
    opened = server.request("POST", "/v1/sessions", {**FAST, "prompt_switch": "keep"})
    assert opened.status == 201, opened.body
    sid = opened.json["id"]
    done = server.request("POST", f"/v1/sessions/{sid}/extend", {"prompt": RED, "num_blocks": 2})
    assert done.status == 200, done.body
    assert done.json["blocks"] == 2 and done.json["new_frames"] == done.json["frames"] > 0
    assert done.json["video"] == f"/v1/sessions/{sid}/segments/1" and done.json["segments"] == 1
    fetched = server.request("GET", done.json["video"])  # the URL of a route that serves it
    assert fetched.status == 200 and fetched.headers["content-type"] == "video/mp4"
    (tmp_path / "segment.mp4").write_bytes(fetched.body)
    assert len(read_frames(tmp_path / "segment.mp4")) == done.json["new_frames"]

    forked = server.request("POST", f"/v1/sessions/{sid}/fork")
    assert forked.status == 201 and forked.json["blocks"] == 2
    fid = forked.json["id"]
    assert forked.json["segments"] == 1 and forked.json["frames"] == done.json["frames"]  # what it holds
    inherited = server.request("GET", f"/v1/sessions/{fid}/segments/1")  # its source's segment, written from frames
    assert inherited.status == 200 and inherited.headers["content-type"] == "video/mp4"
    for missing in ("2", "0", "x", "%C2%B9"):  # (%C2%B9: a superscript 1, which str.isdigit takes)
        gone = server.request("GET", f"/v1/sessions/{fid}/segments/{missing}")
        assert gone.status == 404 and gone.json["error"]["param"] == "segment"
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
        assert resumed.json["segments"] == 1 and resumed.json["frames"] > 0  # what it holds
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


def test_a_damaged_or_cut_snapshot_on_disk_is_refused_by_name(server, tmp_path):
    sid = server.request("POST", "/v1/sessions", FAST).json["id"]
    assert server.request("POST", f"/v1/sessions/{sid}/extend", {"prompt": RED, "num_blocks": 1}).status == 200
    assert server.request("POST", f"/v1/sessions/{sid}/snapshot", {"name": "world"}).status == 200
    folder = tmp_path / "out" / "sessions"
    data = (folder / "world.session").read_bytes()
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x01
    for name, bad, words in (("flipped", bytes(flipped), "damaged"), ("cut", data[:len(data) // 2], "cut off"),
                             ("garbage", b"\x00" * 4096, "not a session snapshot")):
        (folder / f"{name}.session").write_bytes(bad)
        reply = server.request("POST", "/v1/sessions/resume", {"snapshot": name})
        assert reply.status == 400 and reply.json["error"]["param"] == "snapshot", reply.body
        assert f"snapshot {name!r}: " in reply.json["error"]["message"] and words in reply.json["error"]["message"]
    assert server.request("POST", "/v1/sessions/resume", {"snapshot": "world"}).status == 201


def test_a_sessions_fps_is_the_frame_rate_of_its_videos(server, causal, tmp_path):
    assert server.request("POST", "/v1/sessions", {**FAST, "fps": 0}).status == 400
    for fps, expected in ((12, 12), (None, causal.default_sampling.fps)):
        opened = server.request("POST", "/v1/sessions", {**FAST, **({"fps": fps} if fps else {})})
        assert opened.status == 201 and opened.json["fps"] == expected
        sid = opened.json["id"]
        done = server.request("POST", f"/v1/sessions/{sid}/extend", {"prompt": RED, "num_blocks": 1}).json
        for url in (done["video"], f"/v1/sessions/{sid}/video"):
            (tmp_path / "got.mp4").write_bytes(server.request("GET", url).body)
            assert video_fps(tmp_path / "got.mp4") == expected


def test_a_sessions_options_are_checked_at_open(server):
    for body, param in (({"priority": "high"}, "priority"), ({"priority": 1.5}, "priority"),
                        ({"guidance_scale": "nan"}, "guidance_scale")):
        reply = server.request("POST", "/v1/sessions", {**FAST, **body})
        assert reply.status == 400 and reply.json["error"]["param"] == param, reply.body
    nan = server.request("POST", "/v1/sessions", raw=b'{"priority": NaN}', headers={"Content-Type": "application/json"})
    assert nan.status == 400 and nan.json["error"]["param"] == "priority", nan.body
