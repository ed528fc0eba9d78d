"""API keys for `composer serve` (composer/serve/keys.py, auth.py): 401 without a key or with a wrong one, 429 past a key's
limits (jobs queued or running, live streams, requests per minute), /health open, keys never in a log record nor
a job record, /metrics per key, and the key flags and key file. One real server on 127.0.0.1 per module over the
embedded causal shapes model (it makes videos and streams), driven by plain HTTP, the `websockets` client and the
official `openai` SDK; jobs that must stay queued or running use serve_support's scripted "gate" prompts."""

from __future__ import annotations

import json
import logging
import os
import socket
import time

import pytest

pytest.importorskip("fastapi", reason="composer serve needs the serve extra (fastapi, uvicorn, websockets)")
pytest.importorskip("uvicorn", reason="composer serve needs the serve extra (fastapi, uvicorn, websockets)")
pytest.importorskip("websockets", reason="live streams need the serve extra (fastapi, uvicorn, websockets)")
openai = pytest.importorskip("openai", reason="the OpenAI SDK is one of the clients these tests drive")
from serve_support import Scripted, Server  # noqa: E402
from websockets.exceptions import InvalidStatus  # noqa: E402
from websockets.sync.client import connect  # noqa: E402

from composer.generator import VideoGenerator  # noqa: E402
from composer.serve.app import ServeConfig  # noqa: E402
from composer.serve.auth import Guard  # noqa: E402
from composer.serve.keys import ApiKey, KeyFileError, KeyRing, access_note, key_ring  # noqa: E402
from composer.serve.requests import ServerLimits  # noqa: E402

KEYS = {"alice": "sk-alice-5f1c9a7e03b2d48e", "bob": "sk-bob-0a9b8c7d6e5f4a3b21", "carol": "sk-carol-77e1d2c3b4a5f609",
        "dave": "sk-dave-3c2b1a0f9e8d7c6b5a", "erin": "sk-erin-a1b2c3d4e5f60718"}
WRONG = "sk-wrong-00112233445566778899"
RING = KeyRing([ApiKey("alice", KEYS["alice"], max_queued=2, max_streams=1, max_sessions=1),
                ApiKey("bob", KEYS["bob"], rpm=3),
                ApiKey("carol", KEYS["carol"]), ApiKey("dave", KEYS["dave"]), ApiKey("erin", KEYS["erin"])])
SMALL = {"num_frames": 5, "guidance_scale": 1.0, "seed": 3}
CLIENT_LOGGERS = ("openai", "httpx", "httpcore", "websockets.client")  # the tests' own clients: they hold the keys


def bearer(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


@pytest.fixture(scope="module")
def scripted():
    return Scripted(VideoGenerator.from_pretrained("shapes-causal", progress=False), gated_overrides=SMALL)


@pytest.fixture(scope="module")
def server(scripted, tmp_path_factory):
    srv = Server(lambda: scripted, ServeConfig(output_dir=tmp_path_factory.mktemp("keys") / "serve", keys=RING,
                                               limits=ServerLimits(max_frames=200)))
    srv.wait_ready()  # /health: open
    yield srv
    state = srv.app.state.composer
    for job in state.store.all():
        state.worker.cancel(job)
    scripted.gate.set()
    srv.stop()


def sdk(server: Server, key: str):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=key, max_retries=0)


def submit(server: Server, name: str, prompt: str) -> str:
    reply = server.request("POST", "/v1/videos", {"prompt": prompt, **SMALL}, headers=bearer(name))
    assert reply.status == 200, reply.body
    return reply.json["id"]


def wait(server: Server, job_id: str, name: str, states=("completed", "failed", "cancelled")) -> dict:
    deadline = time.time() + 60
    while (job := server.request("GET", f"/v1/videos/{job_id}", headers=bearer(name)).json)["status"] not in states:
        assert time.time() < deadline, f"job {job_id} stayed {job['status']}"
        time.sleep(0.02)
    return job


def ws_url(server: Server, query: str = "") -> str:
    return f"ws://127.0.0.1:{server.port}/v1/streams{query}"


def metric(text: str, line_start: str) -> float:
    return next(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start + " "))


# -- the server ---------------------------------------------------------------------------------------------------
def test_no_key_or_a_wrong_one_gets_401_and_health_stays_open(server):
    for headers in ({}, {"Authorization": f"Bearer {WRONG}"}, {"Authorization": f"Basic {KEYS['carol']}"},
                    {"Authorization": "Bearer "}):
        reply = server.request("GET", "/v1/videos", headers=headers)
        assert reply.status == 401, headers
        assert reply.headers["www-authenticate"].startswith("Bearer")
        error = reply.json["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == 401 and error["param"] is None
        assert "Authorization: Bearer KEY" in error["message"] or "not one of this server's keys" in error["message"]
        assert all(key not in reply.body.decode() for key in (*KEYS.values(), WRONG))
    assert server.request("POST", "/v1/videos", {"prompt": "no key"}).status == 401
    assert server.request("GET", "/metrics").status == 401
    assert server.request("GET", "/health").json["status"] == "ok"
    assert server.request("GET", "/").status == 200  # the page's files; its API calls need the key
    schema = server.request("GET", "/openapi.json").json  # the API description: open, and says how to authenticate
    assert schema["components"]["securitySchemes"]["apiKey"] == {
        "type": "http", "scheme": "bearer", "description": "an API key of this server (--api-key)"}
    assert schema["paths"]["/health"]["get"]["security"] == []
    assert server.request("GET", "/v1/videos", headers=bearer("carol")).status == 200
    assert server.request("GET", f"/v1/videos?api_key={KEYS['carol']}").status == 200  # what a <video src> can do


def test_the_openai_sdk_sends_its_api_key(server):
    with pytest.raises(openai.AuthenticationError, match="not one of this server's keys"):
        sdk(server, WRONG).videos.list()
    assert sdk(server, KEYS["carol"]).videos.list().data is not None


def test_a_keys_queued_jobs_are_limited_and_a_cancel_frees_a_slot(server):
    """alice: queued=2. A third job is 429 (from the SDK: RateLimitError) with Retry-After, naming the limit;
    another key is not held back; cancelling one of alice's jobs lets the next in."""
    held = [submit(server, "alice", "gate alice one"), submit(server, "alice", "gate alice two")]
    try:
        reply = server.request("POST", "/v1/videos", {"prompt": "gate alice three", **SMALL}, headers=bearer("alice"))
        assert reply.status == 429 and int(reply.headers["retry-after"]) >= 1
        assert "API key 'alice' has 2 jobs queued or running, its limit (queued=2)" in reply.json["error"]["message"]
        with pytest.raises(openai.RateLimitError, match="queued=2"):
            sdk(server, KEYS["alice"]).videos.create(prompt="gate alice from the sdk")
        held.append(submit(server, "carol", "gate carol"))  # carol has no limit
        assert server.request("DELETE", f"/v1/videos/{held[0]}", headers=bearer("alice")).status == 200
        wait(server, held[0], "alice")
        held.append(submit(server, "alice", "gate alice three"))
        listed = server.request("GET", "/v1/videos?limit=100", headers=bearer("alice")).json["data"]
        assert {job["id"] for job in listed} == {held[0], held[1], held[3]}  # a key sees its own jobs only
    finally:
        for job_id, name in zip(held, ("alice", "alice", "carol", "alice")):
            server.request("DELETE", f"/v1/videos/{job_id}", headers=bearer(name))


def test_requests_per_minute(server):
    """bob: rpm=3. Every request counts, polls too; the 4th in a minute is 429 with Retry-After up to 60 s."""
    client = sdk(server, KEYS["bob"])
    for _ in range(3):
        client.videos.list()
    with pytest.raises(openai.RateLimitError, match=r"rpm=3") as caught:
        client.videos.list()
    assert 1 <= int(caught.value.response.headers["retry-after"]) <= 60
    reply = server.request("GET", "/v1/videos", headers=bearer("bob"))
    assert reply.status == 429 and "made 3 requests in the last minute" in reply.json["error"]["message"]
    assert server.request("GET", "/v1/videos", headers=bearer("carol")).status == 200  # other keys go on


def test_a_keys_live_streams_are_limited_and_websockets_take_the_key_three_ways(server):
    with pytest.raises(InvalidStatus) as caught:
        connect(ws_url(server), open_timeout=30)
    assert caught.value.response.status_code == 401
    with pytest.raises(InvalidStatus) as caught:
        connect(ws_url(server), subprotocols=["composer", f"bearer.{WRONG}"], open_timeout=30)
    assert caught.value.response.status_code == 401 and WRONG not in caught.value.response.body.decode()
    with connect(ws_url(server), additional_headers=bearer("alice"), open_timeout=30):  # held open: no request yet
        with pytest.raises(InvalidStatus) as caught:
            connect(ws_url(server, f"?api_key={KEYS['alice']}"), open_timeout=30)
        refused = caught.value.response
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
        assert "its limit (streams=1)" in json.loads(refused.body)["error"]["message"]
        metrics = server.request("GET", "/metrics", headers=bearer("dave")).body.decode()
        assert 'composer_api_streams{key="alice"} 1' in metrics
    deadline = time.time() + 20
    while True:  # the server sees the close and frees the slot
        try:
            ws = connect(ws_url(server), subprotocols=["composer", f"bearer.{KEYS['alice']}"], open_timeout=30)
            break
        except InvalidStatus as exc:
            assert exc.response.status_code == 429 and time.time() < deadline
            time.sleep(0.05)
    with ws:
        assert ws.subprotocol == "composer"  # chosen for the client: a browser needs one, the key is never echoed
        ws.send(json.dumps({"prompt": "a red circle moving right", "num_blocks": 2, "guidance_scale": 1.0}))
        types = []
        while True:
            data = ws.recv(timeout=60)
            if isinstance(data, str):
                types.append(json.loads(data))
                if types[-1]["type"] in ("done", "error"):
                    break
    assert types[0]["type"] == "started" and types[-1]["type"] == "done", types
    assert server.app.state.composer.store.get(types[0]["id"]).owner == "alice"


def test_a_session_is_its_keys_alone_and_a_keys_sessions_are_limited(server):
    """A session belongs to the key that opened it: another key gets a 404 for every action and does not list it;
    snapshots go to the key's own folder (another key can neither list nor resume them); sessions=N is per key."""
    opened = server.request("POST", "/v1/sessions", {"seed": 1}, headers=bearer("alice"))
    assert opened.status == 201, opened.body
    sid = opened.json["id"]
    extended = server.request("POST", f"/v1/sessions/{sid}/extend", {"prompt": "a red circle", "num_blocks": 1},
                              headers=bearer("alice"))
    assert extended.status == 200, extended.body
    assert extended.json["video"] == f"/v1/sessions/{sid}/segments/1"
    assert server.request("GET", extended.json["video"], headers=bearer("alice")).status == 200
    for method, path, body in (("GET", "", None), ("POST", "/extend", {"prompt": "mine now", "num_blocks": 1}),
                               ("GET", "/video", None), ("GET", "/segments/1", None), ("POST", "/fork", None),
                               ("POST", "/snapshot", {}), ("DELETE", "", None)):
        reply = server.request(method, f"/v1/sessions/{sid}{path}", body, headers=bearer("carol"))
        assert reply.status == 404, (method, path, reply.body)
        assert sid in reply.json["error"]["message"]  # the same answer as for an id that does not exist
    assert [s["id"] for s in server.request("GET", "/v1/sessions", headers=bearer("alice")).json["data"]] == [sid]
    assert server.request("GET", "/v1/sessions", headers=bearer("carol")).json["data"] == []
    assert sid in [s["id"] for s in server.app.state.composer.sessions.list()["data"]]  # in the process: every one

    second = server.request("POST", "/v1/sessions", {"seed": 2}, headers=bearer("alice"))  # sessions=1
    assert second.status == 429 and "sessions=1" in second.json["error"]["message"], second.body
    fork = server.request("POST", f"/v1/sessions/{sid}/fork", headers=bearer("alice"))
    assert fork.status == 429, fork.body
    theirs = server.request("POST", "/v1/sessions", {"seed": 2}, headers=bearer("carol"))  # no limit of its own
    assert theirs.status == 201, theirs.body

    snap = server.request("POST", f"/v1/sessions/{sid}/snapshot", {"name": "world"}, headers=bearer("alice"))
    assert snap.status == 200, snap.body
    assert (server.app.state.composer.config.output_dir / "sessions" / "alice" / "world.session").is_file()
    assert server.request("GET", "/v1/sessions", headers=bearer("alice")).json["snapshots"] == ["world"]
    assert server.request("GET", "/v1/sessions", headers=bearer("carol")).json["snapshots"] == []
    stolen = server.request("POST", "/v1/sessions/resume", {"snapshot": "world"}, headers=bearer("carol"))
    assert stolen.status == 404, stolen.body
    assert server.request("DELETE", f"/v1/sessions/{sid}", headers=bearer("alice")).status == 200
    resumed = server.request("POST", "/v1/sessions/resume", {"snapshot": "world"}, headers=bearer("alice"))
    assert resumed.status == 201 and resumed.json["frames"] == extended.json["frames"], resumed.body
    metrics = server.request("GET", "/metrics", headers=bearer("carol")).body.decode()
    assert metric(metrics, 'composer_api_sessions{key="alice"}') == 1
    assert metric(metrics, 'composer_api_sessions{key="carol"}') == 1
    assert metric(metrics, 'composer_api_limited_total{key="alice",limit="sessions"}') == 2
    for who, session in (("alice", resumed.json["id"]), ("carol", theirs.json["id"])):
        assert server.request("DELETE", f"/v1/sessions/{session}", headers=bearer(who)).status == 200


def test_keys_never_reach_a_log_record_or_a_job_record(server, caplog):
    """Every logger at DEBUG (uvicorn's access and error logs and the websockets protocol's header lines
    included): no record holds a key, a right one or a wrong one, however it was sent; job records hold the key's
    name."""
    caplog.set_level(logging.DEBUG)
    hooked = [logging.getLogger(name) for name in ("uvicorn", "uvicorn.error", "uvicorn.access", "composer")]
    levels = [target.level for target in hooked]
    for target in hooked:
        target.setLevel(logging.DEBUG)
        if target.name != "uvicorn.error":  # these do not propagate to the root logger; uvicorn.error does to uvicorn
            target.addHandler(caplog.handler)
    try:
        job_id = submit(server, "erin", "a blue square moving left")
        assert server.request("GET", f"/v1/videos?limit=5&api_key={KEYS['erin']}").status == 200
        assert server.request("GET", f"/v1/videos?api_key={WRONG}").status == 401
        assert server.request("GET", "/v1/videos", headers={"Authorization": f"Bearer {WRONG}"}).status == 401
        with connect(ws_url(server), subprotocols=["composer", f"bearer.{KEYS['erin']}"], open_timeout=30):
            pass
        with connect(ws_url(server, f"?api_key={KEYS['erin']}"), open_timeout=30):
            pass
        with pytest.raises(InvalidStatus):
            connect(ws_url(server), additional_headers={"Authorization": f"Bearer {WRONG}"}, open_timeout=30)
        assert wait(server, job_id, "erin")["status"] == "completed"
        time.sleep(0.2)  # the access log line of the last request is written after its answer
    finally:
        for target, level in zip(hooked, levels):
            target.removeHandler(caplog.handler)  # (uvicorn.error never had it: a no-op)
            target.setLevel(level)
    records = [r for r in caplog.records if not r.name.startswith(CLIENT_LOGGERS)]
    messages = [r.getMessage() for r in records]
    assert any(r.name == "uvicorn.access" and "/v1/videos?limit=5 " in m for r, m in zip(records, messages)), \
        "the access log was not captured"  # the key left the query before uvicorn logged it
    assert any(r.name == "uvicorn.error" and "WebSocket /v1/streams" in m for r, m in zip(records, messages))
    assert any("authorization: Bearer [redacted]" in m for m in messages)  # the websockets protocol's header lines
    assert any("sec-websocket-protocol: composer, bearer.[redacted]" in m for m in messages)
    # uvicorn's spurious ERROR after a WebSocket denial response (uvicorn pull request 3138) is dropped
    assert not [m for r, m in zip(records, messages) if r.levelno >= logging.ERROR]
    for secret in (*KEYS.values(), WRONG):
        leaked = [f"{r.name}: {m}" for r, m in zip(records, messages) if secret in m]
        assert not leaked, leaked
    assert server.app.state.composer.store.get(job_id).owner == "erin"
    out = server.app.state.composer.config.output_dir
    for path in out.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert not any(secret.encode() in data for secret in (*KEYS.values(), WRONG)), path


def test_metrics_count_requests_refusals_and_jobs_per_key(server):
    def scrape() -> str:
        reply = server.request("GET", "/metrics", headers=bearer("dave"))
        assert reply.status == 200
        return reply.body.decode()

    before = scrape()
    server.request("GET", "/v1/videos")  # no key
    server.request("GET", "/v1/videos", headers={"Authorization": f"Bearer {WRONG}"})
    job_id = submit(server, "dave", "gate dave")
    try:
        after = scrape()
    finally:
        server.request("DELETE", f"/v1/videos/{job_id}", headers=bearer("dave"))
    assert metric(after, 'composer_api_requests_total{key="dave"}') == \
        metric(before, 'composer_api_requests_total{key="dave"}') + 2  # the job's POST and this scrape
    for reason in ("missing", "wrong"):
        line = f'composer_api_unauthorized_total{{reason="{reason}"}}'
        assert metric(after, line) == metric(before, line) + 1
    assert metric(after, 'composer_api_jobs{key="dave"}') == 1
    assert "# TYPE composer_api_limited_total counter" in after
    assert 'composer_api_limited_total{key="dave",limit="rpm"} 0' in after
    assert all(key not in after for key in KEYS.values())


# -- the limits, without a server ---------------------------------------------------------------------------------
def test_the_rpm_window_slides():
    now = [1000.0]
    guard = Guard(KeyRing([ApiKey("bob", KEYS["bob"], rpm=2)]), clock=lambda: now[0])
    bob = guard.keys.keys[0]
    assert guard.admit(bob, "http", "GET", "/v1/videos")[0] is None
    now[0] += 30
    assert guard.admit(bob, "http", "GET", "/v1/videos")[0] is None
    refusal, _ = guard.admit(bob, "http", "GET", "/v1/videos")
    assert refusal.limit == "rpm" and refusal.retry_after == 30  # the first request leaves the window in 30 s
    now[0] += 30
    assert guard.admit(bob, "http", "GET", "/v1/videos")[0] is None
    assert guard.limited[("bob", "rpm")] == 1 and guard.requests["bob"] == 4


def test_two_job_posts_at_once_cannot_both_take_the_last_slot():
    class NoJobs:
        store = type("Store", (), {"all": staticmethod(list)})()

    guard = Guard(KeyRing([ApiKey("alice", KEYS["alice"], max_queued=1, max_streams=1)]), NoJobs())
    alice = guard.keys.keys[0]
    refusal, release = guard.admit(alice, "http", "POST", "/v1/videos")
    assert refusal is None
    for path in ("/v1/videos", "/v1/videos/edits", "/v1/videos/extensions", "/v1/videos/video_1/remix"):
        assert guard.admit(alice, "http", "POST", path)[0].limit == "queued", path  # the first is still posting
    assert guard.admit(alice, "http", "GET", "/v1/videos")[0] is None  # reads are not jobs
    release()
    release()  # a second release changes nothing
    assert guard.admit(alice, "http", "POST", "/v1/videos/edits")[0] is None
    refusal, release = guard.admit(alice, "websocket", "", "/v1/streams")
    assert refusal is None and guard.admit(alice, "websocket", "", "/v1/streams")[0].limit == "streams"
    release()
    assert guard.open_streams("alice") == 0


# -- the key flags and the key file -------------------------------------------------------------------------------
def test_a_key_file_gives_names_and_limits_and_flag_keys_are_numbered(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text(f"# composer serve keys\n\n{KEYS['alice']}  alice  queued=4 streams=1 sessions=2 rpm=60  # the studio\n"
                    f"   {KEYS['bob']}\tci-bot.2 rpm=600\n")
    ring = key_ring([KEYS["carol"], KEYS["dave"]], path, env_key=KEYS["erin"])
    assert ring.names == ["key1", "key2", "env", "alice", "ci-bot.2"]
    alice = ring.match(KEYS["alice"])
    assert (alice.name, alice.max_queued, alice.max_streams, alice.max_sessions, alice.rpm) == ("alice", 4, 1, 2, 60)
    assert ring.match(KEYS["bob"].encode()).limits_text() == "rpm=600"
    assert ring.match(KEYS["carol"]).name == "key1" and ring.match(KEYS["carol"]).limits_text() == "no limits"
    for near in (KEYS["alice"][:-1], KEYS["alice"] + "x", KEYS["alice"].upper(), "", None):
        assert ring.match(near) is None
    assert KEYS["alice"] not in repr(alice) and KEYS["alice"] not in repr(ring.keys)
    assert key_ring([], None, None) is None  # no keys: no authentication


@pytest.mark.parametrize(("text", "words"), [
    ("{a}\n", "line 1: expected KEY NAME [queued=N] [streams=N] [sessions=N] [rpm=N], got 1 field"),
    ("# keys\n{a} alice rpm=ten\n", "line 2: rpm: expected an integer >= 1"),
    ("{a} alice queued=0\n", "line 1: queued: expected an integer >= 1"),
    ("{a} alice queued=\u00b2\n", "line 1: queued: expected an integer >= 1 in the digits 0-9"),  # isdigit() says yes
    ("{a} alice\n{b} bob rpm=\u0663\n", "line 2: rpm: expected an integer >= 1"),  # an Arabic-Indic 3
    ("{a} alice rpm=+5\n", "line 1: rpm: expected an integer >= 1"),
    ("{a} alice {b}\n", "line 1: field 3 is not a limit"),
    ("{a} alice burst=3\n", "line 1: field 3 is not a limit"),
    ("{a} alice rpm=1 rpm=2\n", "line 1: rpm is given twice"),
    ("{a} alice\n{a} bob\n", "line 2: the same key as --api-keys"),
    ("{a} alice\n{b} alice\n", "line 2: the name 'alice' is taken by --api-keys"),
    ("{a} al/ice\n", "line 1: the name (the 2nd field) must be 1 to 64 letters"),
    ("{a} {b}\n{b} bob\n", "its name is one of the keys"),
    ("short-key alice\n", "line 1: the key is 9 characters; a key must be at least 16"),
    ("# only comments\n\n", "no keys in it"),
])
def test_key_file_errors_name_the_line_and_never_the_key(tmp_path, text, words):
    path = tmp_path / "keys.txt"
    path.write_text(text.format(a=KEYS["alice"], b=KEYS["bob"]), encoding="utf-8")
    with pytest.raises(KeyFileError) as caught:
        key_ring([], path)
    message = str(caught.value)
    assert words in message and str(path) in message
    assert all(secret not in message for secret in (KEYS["alice"], KEYS["bob"], "short-key"))


def test_flag_key_errors_never_show_the_key(tmp_path):
    with pytest.raises(KeyFileError, match=r"--api-key \(the 2nd\): the key is 5 characters"):
        key_ring([KEYS["alice"], "hunter"[:5]])
    with pytest.raises(KeyFileError, match=r"--api-key \(the 2nd\): the same key as --api-key \(the 1st\)"):
        key_ring([KEYS["alice"], KEYS["alice"]])
    with pytest.raises(KeyFileError, match="COMPOSER_API_KEY: a key must be printable ASCII without spaces"):
        key_ring([], None, "sk with spaces in it, 24+")
    with pytest.raises(KeyFileError, match="cannot read it"):
        key_ring([], tmp_path / "missing.txt")


def test_the_start_line_says_who_may_use_the_server():
    assert access_note(RING, "0.0.0.0", 8000) == (
        "API keys: on (5 keys: alice, bob, carol, dave, erin); every request but /health needs Authorization: "
        "Bearer KEY", False)
    line, warn = access_note(None, "127.0.0.1", 8000)
    assert not warn and "anyone who can reach 127.0.0.1:8000 can use this server (this machine only" in line
    assert access_note(None, "localhost", 8000)[1] is False and access_note(None, "::1", 8000)[1] is False
    line, warn = access_note(None, "0.0.0.0", 9000)
    assert warn and "--host 0.0.0.0 is reachable from other machines: anyone who can reach 0.0.0.0:9000" in line


def test_cli_refuses_a_bad_key_file_before_binding_or_loading(monkeypatch, capsys, tmp_path):
    from composer.cli import serve
    from composer.cli.main import main

    touched = []
    monkeypatch.setattr(VideoGenerator, "from_pretrained", lambda *a, **k: touched.append("load"))
    monkeypatch.setattr(serve, "bind_port", lambda *a: touched.append("bind"))
    path = tmp_path / "keys.txt"
    path.write_text(f"{KEYS['alice']} alice\n{KEYS['bob']} bob streams=many\n")
    assert main(["serve", "--api-keys", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--api-keys {path} line 2: streams: expected an integer >= 1" in err, err
    assert main(["serve", "--api-key", "too-short"]) == 1
    assert "--api-key (the 1st): the key is 9 characters" in capsys.readouterr().err
    monkeypatch.setenv("COMPOSER_API_KEY", KEYS["alice"])
    assert main(["serve", "--api-key", KEYS["alice"]]) == 1
    err = capsys.readouterr().err
    assert "COMPOSER_API_KEY: the same key as --api-key (the 1st)" in err and KEYS["alice"] not in err
    assert touched == []


def test_cli_serves_with_keys_and_says_so_by_name(monkeypatch, capsys):
    import uvicorn

    from composer.cli.main import main

    served = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: served.append(self.config.app))
    monkeypatch.delenv("COMPOSER_API_KEY", raising=False)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["serve", "--model-path", "shapes-t2v", "--port", str(port), "--no-progress", "--api-key",
                 KEYS["alice"], "--api-key", KEYS["bob"]]) == 0
    out = capsys.readouterr().out
    assert "API keys: on (2 keys: key1, key2)" in out and KEYS["alice"] not in out
    state = served[0].state.composer
    assert state.config.keys.names == ["key1", "key2"] and state.auth.keys is state.config.keys


def test_cli_without_keys_on_a_public_host_warns(monkeypatch):
    import io

    import uvicorn

    from composer.cli.main import main

    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: None)
    monkeypatch.delenv("COMPOSER_API_KEY", raising=False)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logging.getLogger("composer").addHandler(handler)
    try:
        with socket.socket() as probe:
            probe.bind(("0.0.0.0", 0))
            port = probe.getsockname()[1]
        assert main(["serve", "--model-path", "shapes-t2v", "--host", "0.0.0.0", "--port", str(port),
                     "--no-progress"]) == 0
    finally:
        logging.getLogger("composer").removeHandler(handler)
    assert f"API keys: off and --host 0.0.0.0 is reachable from other machines: anyone who can reach 0.0.0.0:{port}" \
        in stream.getvalue()


def test_jobs_made_before_keys_are_no_keys_until_the_operator_gives_them_one(scripted, tmp_path):
    """docs/serving.md ("Jobs made before keys"): a job made without keys has no owner, so under keys it is every
    key's 404 and in no list; setting `fields.owner` in its record (server stopped) gives it to that key."""
    out = tmp_path / "serve"
    before = Server(lambda: scripted, ServeConfig(output_dir=out))
    before.wait_ready()
    job_id = before.request("POST", "/v1/videos", {"prompt": "a red circle", **SMALL}).json["id"]
    deadline = time.time() + 60
    while before.request("GET", f"/v1/videos/{job_id}").json["status"] != "completed":
        assert time.time() < deadline
        time.sleep(0.02)
    before.stop()

    def served(check) -> None:
        srv = Server(lambda: scripted, ServeConfig(output_dir=out, keys=RING))
        srv.wait_ready()
        try:
            check(srv)
        finally:
            srv.stop()

    def nobodys(srv) -> None:
        for name in ("alice", "carol"):
            assert srv.request("GET", f"/v1/videos/{job_id}", headers=bearer(name)).status == 404
            assert srv.request("GET", "/v1/videos", headers=bearer(name)).json["data"] == []

    served(nobodys)
    record = out / "jobs" / f"{job_id}.json"  # the documented fix: name its owner in the record
    data = json.loads(record.read_text())
    data["fields"]["owner"] = "alice"
    record.write_text(json.dumps(data))

    def alices(srv) -> None:
        assert srv.request("GET", f"/v1/videos/{job_id}", headers=bearer("alice")).json["status"] == "completed"
        assert srv.request("GET", f"/v1/videos/{job_id}/content", headers=bearer("alice")).status == 200
        assert srv.request("GET", f"/v1/videos/{job_id}", headers=bearer("carol")).status == 404

    served(alices)


def test_a_world_readable_key_file_is_warned_about(tmp_path):
    import io

    path = tmp_path / "keys.txt"
    path.write_text(f"{KEYS['alice']} alice\n")
    os.chmod(path, 0o644)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logging.getLogger("composer").addHandler(handler)
    try:
        key_ring([], path)
        os.chmod(path, 0o600)
        key_ring([], path)
    finally:
        logging.getLogger("composer").removeHandler(handler)
    assert stream.getvalue().count("other users of this machine can read it (mode 644)") == 1


def test_a_text_server_takes_the_same_keys(tmp_path):
    """`composer serve` on a language model installs the same middleware on the text app (cli/serve.py)."""
    import threading

    from composer.serve.auth import install_auth
    from composer.serve.text import create_text_app

    never = threading.Event()

    def factory(load, config):
        app = create_text_app(load, config)
        install_auth(app, app.state.composer, RING)
        return app

    srv = Server(lambda: never.wait(30), ServeConfig(output_dir=tmp_path / "serve"), factory=factory)
    try:
        assert srv.request("GET", "/health").status == 503  # open: the model is loading
        assert srv.request("POST", "/v1/chat/completions", {"messages": []}).status == 401
        assert srv.request("GET", "/v1/models", headers=bearer("carol")).status == 503  # past the key: loading
    finally:
        never.set()
        srv.stop()
