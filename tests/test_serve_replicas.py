"""Several `composer serve` replicas behind nginx (docs/deploy.md), end to end on 127.0.0.1: the nginx.conf that
`python -m composer.serve.deploy` writes, the distribution's nginx, and four replicas over the causal shapes model:
`a` and `b` ready, `c` still loading (it answers 503) and `d` down (nothing listens on its port).

New jobs, streams and sessions must land on a or b only, and every request naming a job or session must reach the
replica its id names. Every replica has the same API key, which passes through the proxy."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

pytest.importorskip("fastapi", reason="composer serve needs the serve extra (fastapi, uvicorn, websockets)")
pytest.importorskip("uvicorn", reason="composer serve needs the serve extra (fastapi, uvicorn, websockets)")
pytest.importorskip("websockets", reason="live streams need the serve extra (fastapi, uvicorn, websockets)")
from serve_support import Scripted, Server
from websockets.exceptions import ConnectionClosedError
from websockets.sync.client import connect

from composer.errors import ConfigError
from composer.generator import VideoGenerator
from composer.serve.app import ServeConfig
from composer.serve.auth import ApiKey, KeyRing
from composer.serve.deploy import Replica, main, nginx_config
from composer.serve.jobs import check_replica, new_job_id
from composer.serve.sessions import SessionStore
from composer.serve.worker import QueueFull
from composer.video import read_frames

NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/sbin/nginx") if os.access(p, os.X_OK)), None)
NO_NGINX = "nginx is not installed: apt-get install nginx-light (.ci/run installs it)"

RED, BLUE = "a red circle moving right", "a blue square moving left"
FAST = {"guidance_scale": 1.0, "seed": 5}
SMALL = {**FAST, "num_frames": 5}
READY = ("a", "b")
KEY = "replica-test-key-0123456789"
BEARER = {"Authorization": f"Bearer {KEY}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proxy:
    """nginx in the foreground (`nginx -p DIR -c nginx.conf -g 'daemon off;'`), its files in DIR; the same small
    client as the replicas'."""

    wait = Server.wait

    def __init__(self, folder: Path, config: str, port: int):
        self.port = port
        folder.mkdir()
        (folder / "nginx.conf").write_text(config)
        self.folder = folder
        with open(folder / "stderr.log", "wb") as stderr:  # what nginx says before it reads the config
            self.process = subprocess.Popen([NGINX, "-p", str(folder), "-c", "nginx.conf", "-g", "daemon off;"],
                                            stdout=stderr, stderr=stderr)
        deadline = time.time() + 30
        while True:
            assert self.process.poll() is None, f"nginx exited: {self.log()}"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                assert time.time() < deadline, f"nginx did not listen: {self.log()}"
                time.sleep(0.05)

    def request(self, method: str, path: str, body=None, raw: bytes | None = None, headers: dict | None = None,
                key: str | None = KEY):
        """Server.request through the proxy, with the key (key=None: without)."""
        auth = {"Authorization": f"Bearer {key}"} if key else {}
        return Server.request(self, method, path, body, raw, {**auth, **(headers or {})})

    def log(self) -> str:
        logs = [self.folder / "stderr.log", self.folder / "error.log"]
        return "".join(log.read_text(errors="replace") for log in logs if log.is_file())[-3000:]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture(scope="module")
def fleet(one_thread, tmp_path_factory):
    """({name: Server} for a and b (Scripted causal shapes generators) and c (loading until the module ends), the
    proxy over them and d (down))."""
    if NGINX is None:
        pytest.skip(NO_NGINX)
    root = tmp_path_factory.mktemp("replicas")
    servers, scripted, loading = {}, [], threading.Event()

    def config(name: str) -> ServeConfig:
        return ServeConfig(output_dir=root / name, replica=name, keys=KeyRing([ApiKey("team", KEY)]))

    for name in READY:
        generator = Scripted(VideoGenerator.from_pretrained("shapes-causal", progress=False), gated_overrides=SMALL)
        scripted.append(generator)
        servers[name] = Server(lambda g=generator: g, config(name))
        servers[name].wait_ready()

    def never_ready():
        loading.wait()
        raise RuntimeError("the test is over")

    servers["c"] = Server(never_ready, config("c"))
    replicas = [Replica(name, f"127.0.0.1:{servers[name].port}") for name in ("a", "b", "c")]
    replicas.append(Replica("d", f"127.0.0.1:{free_port()}"))  # nothing listens there
    port = free_port()
    conf = nginx_config(replicas, f"127.0.0.1:{port}", workers="1", user="root" if os.geteuid() == 0 else None,
                        max_fails=2, fail_timeout=30)  # root: pytest's folders are private to it
    proxy = Proxy(root / "nginx", conf, port)
    yield servers, proxy
    proxy.stop()
    loading.set()
    for generator in scripted:
        generator.gate.set()
    for server in servers.values():
        server.stop()


def replica_of(id_: str) -> str:
    return id_.split("_", 1)[1].split("-", 1)[0]


def holder(servers, job_id: str) -> list[str]:
    """The replicas whose job store holds `job_id`."""
    return [name for name, srv in servers.items() if srv.app.state.composer.store.get(job_id) is not None]


def test_ids_name_their_replica_and_a_bad_name_is_refused(tmp_path, cli):
    assert re.fullmatch(r"video_[0-9a-f]{24}", new_job_id())  # no --replica: as before
    assert re.fullmatch(r"video_gpu0-[0-9a-f]{24}", new_job_id("gpu0"))
    assert re.fullmatch(r"sess_a-[0-9a-f]{16}", SessionStore(None, tmp_path, replica="a")._new_id())
    for bad in ("A", "gpu_0", "a-b", "", "x" * 17):
        with pytest.raises(ConfigError, match="1 to 16 lowercase letters or digits"):
            check_replica(bad)
    code, _, err = cli("serve", "--replica", "GPU_0", "--port", free_port())  # before anything loads
    assert code == 1 and "--replica: replica name 'GPU_0': expected 1 to 16 lowercase letters or digits" in err


def test_the_deploy_module_refuses_bad_replicas_and_writes_a_config_nginx_accepts(tmp_path, capsys):
    for bad, words in ((["--replica", "A=127.0.0.1:1"], "lowercase letters or digits"),
                       (["--replica", "a=nowhere"], "HOST:PORT"),
                       (["--replica", "a=127.0.0.1:1", "--replica", "a=127.0.0.1:2"], "given twice"),
                       ([], "no --replica given"), (["--replica", "a=127.0.0.1:1", "--listen", "x"], "--listen")):
        assert main(bad) == 1
        assert words in capsys.readouterr().err
    assert main(["--replica", "a=127.0.0.1:8001", "--replica", "b=127.0.0.1:8002", "--listen", "127.0.0.1:8000",
                 "--workers", "1"]) == 0
    (tmp_path / "nginx.conf").write_text(capsys.readouterr().out)
    if NGINX is None:
        pytest.skip(NO_NGINX)
    checked = subprocess.run([NGINX, "-t", "-p", str(tmp_path), "-c", "nginx.conf"], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr


INJECTED = "include /etc/passwd"


@pytest.mark.parametrize(("flags", "words"), [
    (["--replica", f"a=127.0.0.1;{INJECTED};#:8001"], "--replica 'a=127.0.0.1;include /etc/passwd;#:8001': the host"),
    (["--replica", "a=127.0.0.1:8001;x"], "the port '8001;x' is not a number"),
    (["--replica", "a=127.0.0.1:\u00b2"], "the port '\u00b2' is not a number"),  # str.isdigit says yes
    (["--replica", "a=::1:8001"], "an IPv6 address in brackets"),
    (["--max-body-size", f"1g; {INJECTED}"], "--max-body-size '1g; include /etc/passwd': expected a size"),
    (["--max-body-size", "1t"], "--max-body-size '1t'"),
    (["--listen", f"8000; {INJECTED}"], "--listen"),
    (["--listen", "127.0.0.1:8000 ssl"], "--listen"),
    (["--workers", f"1; {INJECTED}"], "--workers"),
    (["--user", f"root; {INJECTED}"], "--user"),
    (["--max-fails", "2;"], "--max-fails '2;'"),
    (["--fail-timeout", "0"], "--fail-timeout 0: expected a whole number in [1, 86400]"),
    (["--fail-timeout", "10s\n}"], "--fail-timeout '10s\\n}'"),  # a newline stays escaped: one line
])
def test_every_value_the_deploy_module_writes_is_parsed_into_its_type(flags, words, capsys):
    given = flags if flags[0] == "--replica" else ["--replica", "a=127.0.0.1:8001", *flags]
    assert main([*given, "--snippet"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and words in err, err
    with pytest.raises(ConfigError):  # the library functions are held to the same types
        if flags[0] == "--replica":
            Replica("a", flags[1].partition("=")[2])
        else:
            nginx_config([Replica("a", "127.0.0.1:8001")], **{
                "--listen": {"listen": flags[1]}, "--workers": {"listen": "8000", "workers": flags[1]},
                "--user": {"listen": "8000", "user": flags[1]}}.get(flags[0], {"listen": "8000",
                                                                              flags[0][2:].replace("-", "_"): flags[1]}))


def test_the_deploy_module_writes_hosts_sizes_and_counts_as_nginx_reads_them(capsys):
    assert main(["--replica", "a=[::1]:8001", "--replica", "b=GPU-Host.example:8002", "--listen", "[::]:8000",
                 "--max-body-size", "512M", "--max-fails", "0", "--workers", "4", "--user", "www-data"]) == 0
    conf = capsys.readouterr().out
    for line in ("server [::1]:8001;", "server gpu-host.example:8002;", "listen [::]:8000;",
                 "client_max_body_size 512m;", "max_fails=0 fail_timeout=10s;", "worker_processes 4;",
                 "user www-data;"):
        assert line in conf


@pytest.mark.slow
def test_new_jobs_go_to_the_ready_replicas_and_each_id_reaches_its_own(fleet, tmp_path):
    servers, proxy = fleet
    ids = []
    while len(ids) < 4 or {replica_of(i) for i in ids} != set(READY):  # in turns: both ready ones get some
        assert len(ids) < 12, f"the jobs went to {[replica_of(i) for i in ids]}"
        reply = proxy.request("POST", "/v1/videos", {"prompt": RED, **SMALL, "seed": len(ids)})
        assert reply.status == 200, reply.body
        assert replica_of(reply.json["id"]) in READY  # never c (loading: 503) nor d (down)
        ids.append(reply.json["id"])
    assert all(holder(servers, i) == [replica_of(i)] for i in ids)
    assert servers["c"].app.state.composer.store.all() == []  # its 503s created nothing

    for job_id in ids:  # every poll, download and cancel reaches the replica that holds the job
        assert proxy.wait(job_id)["status"] == "completed"
        video = proxy.request("GET", f"/v1/videos/{job_id}/content")
        assert video.status == 200 and video.headers["content-type"] == "video/mp4"
        (tmp_path / f"{job_id}.mp4").write_bytes(video.body)
        assert read_frames(tmp_path / f"{job_id}.mp4").shape == (5, 64, 64, 3)
        assert video.body == servers[replica_of(job_id)].request("GET", f"/v1/videos/{job_id}/content",
                                                                 headers=BEARER).body
    for job_id in ids[:2]:  # a finished video deleted on its replica
        deleted = proxy.request("DELETE", f"/v1/videos/{job_id}")
        assert deleted.status == 200 and deleted.json["deleted"], deleted.body
        assert holder(servers, job_id) == [] and proxy.request("GET", f"/v1/videos/{job_id}").status == 404

    gated = [proxy.request("POST", "/v1/videos", {"prompt": f"gate {i}", **SMALL}).json["id"] for i in range(2)]
    assert {replica_of(i) for i in gated} <= set(READY)
    for job_id in gated:
        assert proxy.request("DELETE", f"/v1/videos/{job_id}").status == 200
        assert proxy.wait(job_id)["status"] == "cancelled"


@pytest.mark.slow
def test_a_full_replica_is_passed_over_and_not_left_out(fleet, monkeypatch):
    servers, proxy = fleet

    def full(*args, **kwargs):
        raise QueueFull("full")

    stored = {name: len(servers[name].app.state.composer.store.all()) for name in READY}
    monkeypatch.setattr(servers["b"].app.state.composer.worker, "submit", full)
    ids = [proxy.request("POST", "/v1/videos", {"prompt": RED, **SMALL}).json["id"] for _ in range(4)]
    assert [replica_of(i) for i in ids] == ["a"] * 4  # b's 429s passed over
    monkeypatch.setattr(servers["a"].app.state.composer.worker, "submit", full)
    refused = proxy.request("POST", "/v1/videos", {"prompt": RED, **SMALL})
    # no replica took it: the last one's answer, 429 (full) or 503 (c loading, d down), both with Retry-After
    assert refused.status in (429, 503) and refused.headers["retry-after"] in ("10", "5"), refused.body
    assert {name: len(servers[name].app.state.composer.store.all()) for name in READY} == {
        "a": stored["a"] + 4, "b": stored["b"]}  # a 429 keeps nothing
    monkeypatch.undo()
    more = [proxy.request("POST", "/v1/videos", {"prompt": RED, **SMALL}).json["id"] for _ in range(4)]
    assert {replica_of(i) for i in more} == set(READY)  # a busy replica is not left out afterwards
    for job_id in ids + more:
        assert proxy.wait(job_id)["status"] == "completed"


@pytest.mark.slow
def test_an_id_naming_no_replica_or_an_unknown_one_is_a_clear_404(fleet):
    servers, proxy = fleet
    unknown = proxy.request("GET", "/v1/videos/video_zz-0123456789abcdef")
    assert unknown.status == 404, unknown.body
    assert unknown.json["error"]["message"] == "no replica named zz behind this proxy (its replicas: a, b, c, d)"
    assert proxy.request("POST", "/v1/sessions/sess_zz-0123/extend", {"prompt": RED}).status == 404
    bare = proxy.request("GET", "/v1/videos/video_0123456789abcdef")
    assert bare.status == 404 and "names no replica" in bare.json["error"]["message"]
    missing = proxy.request("GET", "/v1/videos/video_a-0123456789abcdef")  # a's own answer
    assert missing.status == 404 and missing.headers["x-composer-upstream"] == f"127.0.0.1:{servers['a'].port}"
    assert "'video_a-0123456789abcdef'" in missing.json["error"]["message"]


@pytest.mark.slow
def test_health_through_the_proxy_and_of_each_replica(fleet):
    servers, proxy = fleet
    for _ in range(4):  # whichever replica answers, a ready one does
        health = proxy.request("GET", "/health")
        assert health.status == 200 and health.json["replica"] in READY
    assert proxy.request("GET", "/replicas/b/health").json["replica"] == "b"
    assert proxy.request("GET", "/replicas/c/health").status == 503
    down = proxy.request("GET", "/replicas/d/health")
    assert down.status == 503 and down.headers["retry-after"] == "5" and "retry later" in down.json["error"]["message"]
    assert proxy.request("GET", "/replicas/zz/health").status == 404
    assert proxy.request("GET", "/replicas/a/v1/videos").json["object"] == "list"


def watch(proxy: Proxy, request: dict, tries: int = 4) -> tuple[list[dict], int]:
    """A stream through the proxy read to its end: (its JSON messages, the close code). A replica still loading
    closes with 1013 (try again later): the client opens a new one, which the proxy sends to the next replica."""
    for _ in range(tries):
        with connect(f"ws://127.0.0.1:{proxy.port}/v1/streams", additional_headers=BEARER, open_timeout=30) as ws:
            messages = []
            try:  # a refused stream may be closed before the request is sent
                ws.send(json.dumps(request))
                for message in ws:
                    if isinstance(message, str):
                        messages.append(json.loads(message))
            except ConnectionClosedError:
                pass
            code = ws.close_code
        if code != 1013:
            return messages, code
    raise AssertionError(f"{tries} streams were told to try again later")


@pytest.mark.slow
def test_a_stream_through_the_proxy_stays_on_its_replica(fleet, tmp_path):
    servers, proxy = fleet
    seen = set()
    for _ in range(2):
        messages, code = watch(proxy, {"prompt": RED, "num_blocks": 3, **FAST})
        assert code == 1000 and [m["type"] for m in messages] == ["started", "chunk", "chunk", "chunk", "done"]
        job_id = messages[0]["id"]
        seen.add(replica_of(job_id))
        assert holder(servers, job_id) == [replica_of(job_id)]
        assert proxy.request("GET", f"/v1/videos/{job_id}").json["kind"] == "stream"
        video = proxy.request("GET", messages[-1]["video"])
        (tmp_path / "stream.mp4").write_bytes(video.body)
        assert read_frames(tmp_path / "stream.mp4").shape == (9, 64, 64, 3)
    assert seen <= set(READY)


@pytest.mark.slow
def test_a_session_through_the_proxy_stays_on_its_replica(fleet, tmp_path):
    servers, proxy = fleet
    opened = [proxy.request("POST", "/v1/sessions", FAST) for _ in range(2)]
    assert all(o.status == 201 for o in opened), [o.body for o in opened]
    sids = [o.json["id"] for o in opened]
    assert {replica_of(s) for s in sids} <= set(READY), sids
    sid = sids[0]
    extended = proxy.request("POST", f"/v1/sessions/{sid}/extend", {"prompt": RED, "num_blocks": 2})
    assert extended.status == 200 and extended.json["blocks"] == 2
    segment = proxy.request("GET", extended.json["video"])  # the segment's URL reaches the session's replica
    assert segment.status == 200 and segment.headers["content-type"] == "video/mp4"
    forked = proxy.request("POST", f"/v1/sessions/{sid}/fork")
    assert forked.status == 201 and replica_of(forked.json["id"]) == replica_of(sid)  # its KV cache lives there
    fid = forked.json["id"]
    assert proxy.request("POST", f"/v1/sessions/{fid}/extend", {"prompt": BLUE, "num_blocks": 1}).json["blocks"] == 3
    video = proxy.request("GET", f"/v1/sessions/{fid}/video")
    assert video.status == 200 and video.headers["content-type"] == "video/mp4"
    for s in (sid, fid, sids[1]):
        assert proxy.request("DELETE", f"/v1/sessions/{s}").json["closed"]
    assert all(srv.app.state.composer.sessions.list()["data"] == [] for name, srv in servers.items() if name in READY)


@pytest.mark.slow
def test_the_key_and_an_upload_pass_through_the_proxy(fleet, tmp_path):
    servers, proxy = fleet
    refused = proxy.request("GET", "/v1/videos", key=None)
    assert refused.status == 401 and refused.headers["x-composer-upstream"]  # a replica's answer, not nginx's
    assert proxy.request("GET", "/v1/videos", key="not-the-key-0123456789").status == 401
    assert proxy.request("GET", "/health", key=None).status == 200

    noise = np.random.default_rng(0).integers(0, 256, (256, 256, 3), dtype=np.uint8)
    png = io.BytesIO()
    PIL.Image.fromarray(noise).save(png, format="PNG")  # ~200 KB: nginx buffers it to a file, and sends it again
    ids = []
    for i in range(3):  # the same body passed over c (503) and d (down) to a ready replica
        fields = {"prompt": RED, "num_frames": "5", "guidance_scale": "1.0", "seed": str(i)}
        body, content_type = multipart(fields, {"input_reference": ("start.png", "image/png", png.getvalue())})
        reply = proxy.request("POST", "/v1/videos", raw=body, headers={"Content-Type": content_type})
        assert reply.status == 200, reply.body
        ids.append(reply.json["id"])
    assert all(proxy.wait(i)["status"] == "completed" for i in ids)
    assert all(holder(servers, i) == [replica_of(i)] for i in ids)


@pytest.mark.slow
def test_an_extension_naming_a_video_in_its_body_reaches_that_videos_replica(fleet):
    """nginx routes by the path: a body's {"id": ...} may land on another replica, which sends the client on with a
    307 to /replicas/NAME/... (the same method and body); a client that follows redirects (the openai SDK does)
    gets its video made on the replica that holds the source."""
    openai = pytest.importorskip("openai", reason="the OpenAI SDK is the client this test drives")
    from openai.types import Video

    servers, proxy = fleet
    source = proxy.request("POST", "/v1/videos", {"prompt": RED, **SMALL}).json["id"]
    assert proxy.wait(source)["status"] == "completed"
    home = replica_of(source)
    other = next(name for name in READY if name != home)
    body = {"video": {"id": source}, "prompt": BLUE, "seed": 6}
    direct = servers[other].request("POST", "/v1/videos/extensions", body, headers=BEARER)
    assert direct.status == 307 and direct.headers["location"] == f"/replicas/{home}/v1/videos/extensions"
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{proxy.port}/v1", api_key=KEY, max_retries=0)
    # (the SDK's videos.extend takes only a file for `video`: its generic post sends the JSON body)
    made = [client.post("/videos/extensions", body=body, cast_to=Video) for _ in range(2)]  # one lands elsewhere
    for video in made:
        assert replica_of(video.id) == home and proxy.wait(video.id)["status"] == "completed"


def multipart(fields: dict[str, str], files: dict[str, tuple[str, str, bytes]]) -> tuple[bytes, str]:
    """A multipart/form-data body (what the openai SDK sends with a file) and its Content-Type."""
    boundary = "composer-test-boundary"
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode()
             for k, v in fields.items()]
    for name, (filename, kind, data) in files.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; filename="{filename}"\r\n'
                     f"Content-Type: {kind}\r\n\r\n".encode() + data + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


@pytest.mark.slow
def test_the_soak_through_the_proxy_loses_nothing(fleet):
    servers, proxy = fleet
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "benchmarks" / "serve_soak.py"), "--base-url",
                          f"http://127.0.0.1:{proxy.port}", "--api-key", KEY, "--requests", "10", "--clients", "3",
                          "--malformed", "2", "--cancel", "2", "--uploads", "3", "--upload-image", "--bad-uploads", "2",
                          "--steps", "0", "--timeout", "120"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)}, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "server crashes: 0; lost jobs: 0; failed checks: 0" in run.stdout
    assert "(1 videos, 3 multipart with an image, 2 malformed, 2 broken uploads, 2 cancelled)" in run.stdout
    assert "malformed refused with a 4xx: 4" in run.stdout  # the malformed bodies and the broken uploads
