"""The web page of `composer serve` (composer/serve/page.py, composer/serve/static/): served files and
GET /v1/model without a browser; then the page itself in a real headless Chromium driven by playwright, against a
real server with the embedded shapes models (2 steps, 5 frames).

The browser tests need playwright (`pip install playwright`) and a Chromium (`apt-get install chromium`, or
COMPOSER_CHROMIUM=/path/to/chrome); they skip with that message when either is missing. With COMPOSER_SCREENSHOT=1
the page test rewrites docs/images/serve-page.png."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import shutil
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="composer serve needs the serve extra (fastapi, uvicorn)")
pytest.importorskip("uvicorn", reason="composer serve needs the serve extra (fastapi, uvicorn)")
from serve_support import Server

from composer.generator import VideoGenerator
from composer.serve.app import ServeConfig
from composer.serve.page import STATIC_DIR

ROOT = Path(__file__).resolve().parents[1]
SCREENSHOT = ROOT / "docs" / "images" / "serve-page.png"


@pytest.fixture(scope="module")
def t2v():
    return VideoGenerator.from_pretrained(None, progress=False)


@pytest.fixture(scope="module")
def causal():
    return VideoGenerator.from_pretrained("shapes-causal", progress=False)


@pytest.fixture
def server(t2v, tmp_path):
    srv = Server(lambda: t2v, ServeConfig(output_dir=tmp_path / "serve"))
    srv.wait_ready()
    yield srv
    srv.stop()


# ---- without a browser ---------------------------------------------------------------------------------------

def test_the_page_is_served_at_root_with_its_script_and_style(server):
    page = server.request("GET", "/")
    assert page.status == 200 and page.headers["content-type"].startswith("text/html")
    html = page.body.decode()
    for name in ("app.js", "live.js", "style.css"):
        assert f'/static/{name}"' in html
    assert '<form id="request-form"' in html
    types = {"app.js": "text/javascript", "live.js": "text/javascript", "style.css": "text/css"}
    for name, kind in types.items():
        reply = server.request("GET", f"/static/{name}")
        assert reply.status == 200 and reply.headers["content-type"].split(";")[0] == kind, (name, reply.headers)
        assert reply.body == (STATIC_DIR / name).read_bytes()
    assert server.request("GET", "/static/nothing.js").status == 404
    assert server.request("GET", "/static/../app.py").status == 404


def test_the_page_loads_nothing_from_outside():
    """It must work offline: no CDN, no web font, no absolute URL to anywhere."""
    for path in STATIC_DIR.iterdir():
        text = path.read_text()
        assert not re.search(r"https?://|//cdn|@import", text), path.name


def test_every_input_of_the_page_has_a_label():
    html = (STATIC_DIR / "index.html").read_text()
    ids = re.findall(r"<(?:input|textarea)[^>]*\bid=\"([^\"]+)\"", html)
    labelled = set(re.findall(r"<label for=\"([^\"]+)\"", html))
    assert ids and set(ids) <= labelled, set(ids) - labelled


def test_the_static_files_are_package_data():
    """A pip install ships the page: pyproject's package-data globs cover every file in static/."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = globs["composer.serve"]
    package = STATIC_DIR.parent
    for path in STATIC_DIR.iterdir():
        assert any(path.relative_to(package).match(p) for p in patterns), path.name


def test_the_live_view_has_a_tile_per_stream_with_its_own_stop_and_stats(server):
    """Several live streams at once: the start form makes a tile per stream from a template (its frame, status,
    frame rates, next prompt, Stop and Close), and Stop all ends every running one."""
    html = server.request("GET", "/").body.decode()
    for element in ('id="live-form"', 'id="live-start"', 'id="live-stop-all"', 'id="live-target-fps"',
                    'id="live-tiles"', '<template id="live-tile-template">', 'class="tile-frame"',
                    'class="tile-stop quiet"', 'class="tile-close quiet"', 'class="tile-fps"', 'class="tile-shown"',
                    'class="tile-next-prompt"', 'class="tile-send"', 'class="tile-status"'):
        assert element in html, element
    script = server.request("GET", "/static/live.js").body.decode()
    for code in ("class LiveTile", "live.tiles.push(new LiveTile(", 'getElementById("live-tile-template")',
                 "message.fps", "this.stream.stop()", "live.running().forEach((tile) => tile.stop())"):
        assert code in script, code
    assert "live.stream = " not in script  # no single stream slot: the start form never waits for one to end


def test_model_gives_the_family_defaults_limits_and_whether_it_streams(server):
    info = server.request("GET", "/v1/model").json
    assert info["status"] == "ready" and info["family"] == "shapes-t2v" and info["causal"] is False
    assert info["defaults"] == {"prompt": None, "negative_prompt": "", "height": 64, "width": 64, "num_frames": 17,
                                "num_inference_steps": 24, "guidance_scale": 5.0, "flow_shift": 3.0, "seed": None,
                                "fps": 8}
    assert info["multiples"] == {"spatial": 8, "temporal": 4, "frames_per_block": None}
    assert info["fixed_steps"] is None
    assert info["limits"] == {"max_frames": 81, "max_size": 1280, "max_steps": 100}


def test_model_says_a_causal_model_streams_and_its_fixed_steps(causal, tmp_path):
    srv = Server(lambda: causal, ServeConfig(output_dir=tmp_path))
    try:
        srv.wait_ready()
        info = srv.request("GET", "/v1/model").json
    finally:
        srv.stop()
    assert info["causal"] is True and info["family"] == "shapes-causal" and info["fixed_steps"] == 8
    assert "start_image" not in info["defaults"] and info["defaults"]["rollout_blocks"] == 6


def test_model_is_503_while_loading_and_says_when_loading_failed(t2v, tmp_path):
    gate = threading.Event()

    def slow():
        gate.wait(30)
        return t2v

    srv = Server(slow, ServeConfig(output_dir=tmp_path / "a"))
    try:
        reply = srv.request("GET", "/v1/model")
        assert reply.status == 503 and reply.json["status"] == "loading" and reply.headers["retry-after"] == "5"
        gate.set()
        srv.wait_ready()
        assert srv.request("GET", "/v1/model").status == 200
    finally:
        gate.set()
        srv.stop()

    def broken():
        raise OSError("no such folder")

    srv = Server(broken, ServeConfig(output_dir=tmp_path / "b"))
    try:
        deadline = time.time() + 10
        while (reply := srv.request("GET", "/v1/model")).json["status"] == "loading":
            assert time.time() < deadline
            time.sleep(0.02)
        assert reply.status == 503 and reply.json["status"] == "failed"
        assert "no such folder" in reply.json["error"]["message"]
    finally:
        srv.stop()


# ---- in a headless Chromium ----------------------------------------------------------------------------------

def chromium_path() -> str | None:
    named = os.environ.get("COMPOSER_CHROMIUM")
    if named:
        return named
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if found := shutil.which(name):
            return found
    return None


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip(
        "playwright.sync_api",
        reason="the browser tests need playwright: pip install playwright (and a Chromium: apt-get install chromium)")
    executable = chromium_path()
    if executable is None:
        pytest.skip("the browser tests need a Chromium: apt-get install chromium (or set COMPOSER_CHROMIUM to a "
                    "Chrome/Chromium binary; playwright's own download lacks the H.264 codec the videos use)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable)
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1200, "height": 900})
    page = context.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda exc: problems.append(f"page error: {exc}"))
    # the browser logs each 4xx answer as an error; those the tests provoke are checked where they do
    page.on("console", lambda msg: problems.append(f"console: {msg.text}")
            if msg.type == "error" and "responded with a status of 4" not in msg.text else None)
    page.problems = problems
    yield page
    context.close()


def wait_for(page, script: str, arg=None, timeout: float = 30):
    """Poll `script` (a JS function of arg) in the page until it is truthy; its value."""
    return page.wait_for_function(script, arg=arg, timeout=timeout * 1000, polling=50).json_value()


def fill_form(page, **fields) -> None:
    for name, value in fields.items():
        page.fill(f"#{name}", str(value))


PLAYS = """async (id) => {
  const video = document.querySelector(`figure[data-id="${id}"] video`);
  if (video.readyState < 2) await new Promise((ok, bad) => {
    video.addEventListener('loadeddata', ok, {once: true});
    video.addEventListener('error', () => bad(new Error('video error ' + video.error.code)), {once: true});
  });
  await video.play();
  const start = video.currentTime;
  await new Promise(ok => setTimeout(ok, 400));
  return {readyState: video.readyState, advanced: video.currentTime - start, error: video.error && video.error.code,
          width: video.videoWidth, duration: video.duration};
}"""


@pytest.mark.slow
@pytest.mark.browser
def test_the_page_queues_a_video_plays_it_and_shows_the_servers_errors(server, page):
    base = f"http://127.0.0.1:{server.port}"
    page.goto(base + "/")
    wait_for(page, "() => document.querySelector('#health').classList.contains('ready')")
    assert page.input_value("#height") == "64" and page.input_value("#num_inference_steps") == "24"
    assert page.is_hidden("#live")  # not a causal model
    assert page.is_hidden("#codec-note"), (
        "this Chromium cannot play H.264 mp4 (a build without the proprietary codecs, such as playwright's own "
        "download): use Debian's chromium or Chrome (COMPOSER_CHROMIUM=/path/to/chrome)")

    fill_form(page, prompt="a red circle moving down and right", num_inference_steps=2, num_frames=5, seed=3)
    page.click("#submit")
    job_id = wait_for(page, "() => document.querySelector('#gallery-list figure')?.dataset.id")
    job = server.request("GET", f"/v1/videos/{job_id}").json
    assert job["status"] == "completed" and job["seed"] == 3 and job["request"]["num_inference_steps"] == 2
    assert page.get_attribute(f'figure[data-id="{job_id}"] video', "src") == f"/v1/videos/{job_id}/content"
    played = page.evaluate(PLAYS, job_id)
    assert played["error"] is None and played["readyState"] >= 2 and played["advanced"] > 0.1, played
    assert played["width"] == 64 and abs(played["duration"] - 5 / 8) < 0.05, played
    assert page.is_visible("#queue-empty")  # nothing left waiting

    # the server's check, shown next to the form and on the field
    page.fill("#height", "30")
    page.click("#submit")
    wait_for(page, "() => !document.querySelector('#form-error').hidden")
    message = page.inner_text("#form-error")
    assert "height" in message and "multiple of 8" in message, message
    assert page.get_attribute("#height", "aria-invalid") == "true"
    assert "multiple of 8" in page.inner_text("#height-error")
    assert len(server.request("GET", "/v1/videos").json["data"]) == 1  # nothing queued

    shoot = os.environ.get("COMPOSER_SCREENSHOT") == "1"
    if shoot:  # the docs' picture: videos at the model's defaults in the gallery too
        for prompt, seed in (("a green triangle moving up on a black background", 1),
                             ("a red circle moving down and right on a black background", 0)):
            page.click("#reset-defaults")
            fill_form(page, prompt=prompt, seed=seed)
            page.click("#submit")
        wait_for(page, "() => document.querySelectorAll('#gallery-list figure').length === 3", timeout=60)

    # a long job and one behind it: progress bars, then both cancelled from the page
    page.fill("#height", "64")
    fill_form(page, num_inference_steps=100, num_frames=17, prompt="a blue square moving left")
    page.click("#submit")
    assert page.is_hidden("#form-error") and page.get_attribute("#height", "aria-invalid") is None
    fill_form(page, prompt="a green triangle moving up")
    page.click("#submit")
    wait_for(page, "() => document.querySelectorAll('#queue-list li').length === 2")
    wait_for(page, "() => document.querySelector('#queue-list li[data-status=in_progress] progress')?.value > 0.05")
    if shoot:
        # every video loaded, so none shows the loading spinner
        wait_for(page, "() => [...document.querySelectorAll('#gallery-list video')]"
                       ".every(v => v.readyState === 4 && v.networkState !== 2)")
        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOT), full_page=True)
    for _ in range(2):
        page.click("#queue-list li[data-status=in_progress] .cancel, #queue-list li[data-status=queued] .cancel")
        time.sleep(0.1)
    wait_for(page, "() => [...document.querySelectorAll('#queue-list li')].every(li => li.dataset.status === "
                   "'cancelled')")
    assert {job["status"] for job in server.request("GET", "/v1/videos").json["data"]} == {"completed", "cancelled"}

    # tidy at a phone's width: nothing wider than the screen
    page.set_viewport_size({"width": 360, "height": 800})
    assert page.evaluate("() => document.documentElement.scrollWidth") <= 360
    assert page.problems == []


# ---- the live view (causal models) ---------------------------------------------------------------------------

def jpeg(color: tuple[int, int, int], size: int = 64) -> bytes:
    import PIL.Image

    out = io.BytesIO()
    PIL.Image.new("RGB", (size, size), color).save(out, format="JPEG")
    return out.getvalue()


class ScriptedStream:
    """/v1/streams as the protocol in docs/serving.md states it, with plain-colour frames: what the page's live view
    is checked against until the real endpoint is here (and beside it after). Records what the client sent."""

    FPS, FRAMES_PER_BLOCK = 8, 4

    def __init__(self, gap: float = 0.3):
        self.received: list[dict] = []
        self.gap = gap  # seconds the stream listens for the client's messages after each block

    async def serve(self, websocket) -> None:
        from starlette.websockets import WebSocketDisconnect

        try:
            await self._play(websocket)
        except WebSocketDisconnect:  # the page went away mid-stream
            pass

    async def _play(self, websocket) -> None:
        await websocket.accept()
        request = json.loads(await websocket.receive_text())
        self.received.append(request)
        blocks, prompt = request.get("num_blocks", 3), request["prompt"]
        stream_id = f"video_live{len(self.received)}"
        await websocket.send_json({"type": "queued", "id": stream_id, "position": 0})
        await websocket.send_json({"type": "started", "id": stream_id, "seed": request.get("seed", 1),
                                   "fps": self.FPS, "height": 64, "width": 64, "num_blocks": blocks})
        sent = 0
        for block in range(blocks):
            await websocket.send_json({"type": "chunk", "index": block, "block": block,
                                       "frames": self.FRAMES_PER_BLOCK, "first_frame": sent, "prompt": prompt,
                                       "fps": 12.5})
            for i in range(self.FRAMES_PER_BLOCK):
                await websocket.send_bytes(jpeg((40 * block % 256, 20 * i, 200)))
            sent += self.FRAMES_PER_BLOCK
            try:  # the client's messages between blocks
                message = json.loads(await asyncio.wait_for(websocket.receive_text(), self.gap))
            except asyncio.TimeoutError:
                continue
            self.received.append(message)
            if message["type"] == "prompt":
                prompt = message["prompt"]
                await websocket.send_json({"type": "prompt", "prompt": prompt, "from_block": block + 1})
            elif message["type"] == "stop":
                break
        await websocket.send_json({"type": "done", "id": stream_id, "frames": sent,
                                   "video": f"/v1/videos/{stream_id}/content"})
        await websocket.close()


def open_live_page(page, base: str) -> None:
    page.goto(base + "/")
    wait_for(page, "() => document.querySelector('#health').classList.contains('ready')")
    assert page.is_visible("#live") and page.is_visible("#live-empty")


def start_live_stream(page, prompt: str, blocks: int, seed: int = 5) -> None:
    """Start one more stream from the live form (its tile goes first in #live-tiles)."""
    page.fill("#live-prompt", prompt)
    page.fill("#live-blocks", str(blocks))
    page.fill("#live-seed", str(seed))
    page.click("#live-start")


def tile(n: int) -> str:
    """The selector of the n-th stream started on the page (0: the first; tiles go newest first)."""
    return f"#live-tiles .live-tile:nth-last-child({n + 1})"


@pytest.mark.slow
@pytest.mark.browser
def test_the_live_view_shows_a_streams_frames_at_its_fps_and_sends_the_next_prompt(causal, page, tmp_path):
    from starlette.routing import WebSocketRoute

    stream = ScriptedStream()
    srv = Server(lambda: causal, ServeConfig(output_dir=tmp_path))
    srv.app.router.routes.insert(0, WebSocketRoute("/v1/streams", stream.serve))  # ahead of the real one, if any
    try:
        srv.wait_ready()
        open_live_page(page, f"http://127.0.0.1:{srv.port}")
        start_live_stream(page, "a red circle moving right", blocks=3)
        wait_for(page, f"() => document.querySelector('{tile(0)} .tile-frame').dataset.shown >= 2")
        page.fill(f"{tile(0)} .tile-next-prompt", "a blue square moving left")
        page.click(f"{tile(0)} .tile-send")
        wait_for(page, f"() => !document.querySelector('{tile(0)} .tile-video').hidden")
        wait_for(page, f"() => document.querySelector('{tile(0)} .tile-status').textContent.startsWith('finished')")
        log = page.evaluate("() => window.ComposerLive.tiles[0].log")
        shown = int(page.get_attribute(f"{tile(0)} .tile-frame", "data-shown"))
        times = page.evaluate("() => window.ComposerLive.tiles[0].frameTimes")
        stats = page.inner_text(f"{tile(0)} .tile-stats")
        problems = list(page.problems)  # before the server stops under the page's polling
    finally:
        srv.stop()
    assert stream.received[0] == {"prompt": "a red circle moving right", "num_blocks": 3, "seed": 5}
    assert stream.received[1] == {"type": "prompt", "prompt": "a blue square moving left"}
    assert [m["type"] for m in log][:2] == ["queued", "started"] and log[-1]["type"] == "done"
    assert any(m["type"] == "prompt" for m in log)
    assert shown == 3 * ScriptedStream.FRAMES_PER_BLOCK == log[-1]["frames"]
    assert page.inner_text(f"{tile(0)} .tile-status") == f"finished: {shown} frames shown"
    assert "12.5 fps made" in stats and f"{shown} frames shown at" in stats, stats  # the server's rate, and ours
    # paced at the stream's 8 fps, though the frames came faster (timers fire late, never early)
    assert (times[-1] - times[0]) / 1000 >= (shown - 1) / ScriptedStream.FPS * 0.95, times
    assert page.get_attribute(f"{tile(0)} .tile-video a", "href") == log[-1]["video"]
    assert page.is_visible(f"{tile(0)} .tile-close") and page.is_disabled(f"{tile(0)} .tile-stop")
    assert problems == []


@pytest.mark.slow
@pytest.mark.browser
def test_a_live_tiles_status_follows_the_frame_shown_and_a_finished_stream_disables_stop_and_send(
        causal, page, tmp_path):
    """The server sends the whole stream at once, and the page plays it at 8 fps: while it plays, the status names
    the block of the frame shown (not the newest one), the whole video is not offered yet, and Stop and Send are
    disabled once the server said done."""
    from starlette.routing import WebSocketRoute

    stream = ScriptedStream(gap=0.01)
    srv = Server(lambda: causal, ServeConfig(output_dir=tmp_path))
    srv.app.router.routes.insert(0, WebSocketRoute("/v1/streams", stream.serve))
    blocks, per_block = 8, ScriptedStream.FRAMES_PER_BLOCK
    try:
        srv.wait_ready()
        open_live_page(page, f"http://127.0.0.1:{srv.port}")
        start_live_stream(page, "a red circle moving right", blocks=blocks)
        wait_for(page, "() => window.ComposerLive.tiles[0].log.some(m => m.type === 'done')")
        seen = page.evaluate(f"""() => {{
          const tile = document.querySelector('{tile(0)}'), part = (name) => tile.querySelector('.tile-' + name);
          return {{shown: Number(part('frame').dataset.shown), status: part('status').textContent,
                   linkHidden: part('video').hidden, stop: part('stop').disabled, send: part('send').disabled,
                   next: part('next-prompt').disabled, state: tile.dataset.state,
                   stopAll: document.querySelector('#live-stop-all').disabled}};
        }}""")
        wait_for(page, f"() => document.querySelector('{tile(0)}').dataset.state === 'finished'")
        link_hidden = page.is_hidden(f"{tile(0)} .tile-video")
        problems = list(page.problems)
    finally:
        srv.stop()
    assert 1 <= seen["shown"] < blocks * per_block and seen["state"] == "running", seen  # still playing
    block = (seen["shown"] - 1) // per_block  # the block of the frame shown: far behind the server's last
    assert seen["status"].startswith(f'block {block}: "a red circle moving right"'), seen
    assert "more frames received" in seen["status"], seen
    assert seen["linkHidden"] and seen["stop"] and seen["send"] and seen["next"] and seen["stopAll"], seen
    assert not link_hidden  # offered once the last frame was shown
    assert problems == []


@pytest.mark.slow
@pytest.mark.browser
def test_the_live_view_runs_several_streams_each_in_its_tile_with_its_own_stop(causal, page, tmp_path):
    """Three streams at once from one page: each in its own tile with its frames and stats; one tile's Stop ends
    that stream only; Close removes a finished tile; Stop all ends the rest."""
    from starlette.routing import WebSocketRoute

    stream = ScriptedStream()
    srv = Server(lambda: causal, ServeConfig(output_dir=tmp_path))
    srv.app.router.routes.insert(0, WebSocketRoute("/v1/streams", stream.serve))
    try:
        srv.wait_ready()
        open_live_page(page, f"http://127.0.0.1:{srv.port}")
        start_live_stream(page, "a red circle moving right", blocks=40, seed=1)
        start_live_stream(page, "a blue square moving left", blocks=40, seed=2)
        start_live_stream(page, "a green triangle moving up", blocks=3, seed=3)
        assert page.locator("#live-tiles .live-tile").count() == 3 and page.is_hidden("#live-empty")
        for n in range(3):  # every tile shows its own stream's frames
            wait_for(page, f"() => document.querySelector('{tile(n)} .tile-frame').dataset.shown >= 2")
        assert [page.inner_text(f"{tile(n)} .tile-prompt") for n in range(3)] == [
            "a red circle moving right", "a blue square moving left", "a green triangle moving up"]
        ids = [page.get_attribute(tile(n), "data-id") for n in range(3)]
        assert len(set(ids)) == 3
        page.click(f"{tile(0)} .tile-stop")  # the first stream only
        wait_for(page, f"() => document.querySelector('{tile(0)}').dataset.state === 'finished'")
        second = int(page.get_attribute(f"{tile(1)} .tile-frame", "data-shown"))
        wait_for(page, f"() => document.querySelector('{tile(1)} .tile-frame').dataset.shown > {second}")
        assert page.get_attribute(tile(1), "data-state") == "running"  # the second goes on
        wait_for(page, f"() => document.querySelector('{tile(2)}').dataset.state === 'finished'")  # 3 blocks: done
        assert page.get_attribute(tile(2), "data-fps") == "12.5"
        page.click(f"{tile(2)} .tile-close")
        assert page.locator("#live-tiles .live-tile").count() == 2
        page.click("#live-stop-all")
        wait_for(page, "() => [...document.querySelectorAll('#live-tiles .live-tile')].every(t => "
                       "t.dataset.state === 'finished')")
        assert page.is_disabled("#live-stop-all")
        logs = page.evaluate("() => window.ComposerLive.tiles.map(t => t.log.map(m => m.type))")
        problems = list(page.problems)
    finally:
        srv.stop()
    assert [r for r in stream.received if r.get("type") == "stop"] == [{"type": "stop"}] * 2
    assert all(types[-1] == "done" for types in logs) and len(logs) == 2  # the closed tile is forgotten
    page.set_viewport_size({"width": 360, "height": 800})  # tiles stack on a phone
    assert page.evaluate("() => document.documentElement.scrollWidth") <= 360
    assert problems == []


@pytest.mark.slow
@pytest.mark.browser
def test_the_live_view_streams_the_causal_model(causal, page, tmp_path):
    """Against the server's own /v1/streams: two streams at once, each to its end."""
    srv = Server(lambda: causal, ServeConfig(output_dir=tmp_path))
    try:
        srv.wait_ready()
        open_live_page(page, f"http://127.0.0.1:{srv.port}")
        start_live_stream(page, "a red circle moving right", blocks=2, seed=1)
        start_live_stream(page, "a blue square moving left", blocks=2, seed=2)
        for n in range(2):
            wait_for(page, f"() => document.querySelector('{tile(n)} .tile-status').textContent"
                           ".startsWith('finished')", timeout=60)
        for n in range(2):
            log = page.evaluate(f"() => window.ComposerLive.tiles[{n}].log")
            shown = int(page.get_attribute(f"{tile(n)} .tile-frame", "data-shown"))
            done = log[-1]
            assert done["type"] == "done" and shown == done["frames"] > 0, log
            assert all(m["fps"] > 0 for m in log if m["type"] == "chunk")
            assert float(page.get_attribute(tile(n), "data-fps")) > 0
            assert srv.request("GET", done["video"]).status == 200
            assert page.is_hidden(f"{tile(n)} .tile-error")
        assert page.problems == []
    finally:
        srv.stop()


@pytest.mark.slow
@pytest.mark.browser
def test_the_form_picks_a_loaded_lora_and_its_scale(t2v, page, tmp_path):
    """A server with adapters loaded shows them; the chosen one (or none) and a scale reach the job's record."""
    from composer.serve.requests import LoraOption

    loras = [LoraOption("style", str(tmp_path / "style.safetensors"), 0.8),
             LoraOption("motion", str(tmp_path / "motion.safetensors"), 1.0)]
    srv = Server(lambda: t2v, ServeConfig(output_dir=tmp_path / "serve", loras=loras))
    try:
        srv.wait_ready()
        assert srv.request("GET", "/v1/model").json["loras"] == [{"name": "style", "scale": 0.8},
                                                                 {"name": "motion", "scale": 1.0}]
        page.goto(f"http://127.0.0.1:{srv.port}/")
        wait_for(page, "() => document.querySelector('#health').classList.contains('ready')")
        assert page.is_visible("#lora") and page.is_visible("#lora_scale")
        fill_form(page, prompt="a red circle", num_inference_steps=1, num_frames=1, seed=1)
        page.select_option("#lora", "(none)")  # the base model: "lora": [] (t2v has no adapters to take off)
        page.click("#submit")
        wait_for(page, "() => document.querySelectorAll('#gallery-list figure').length === 1")
        page.select_option("#lora", "motion")
        page.fill("#lora_scale", "0.25")
        page.click("#submit")
        wait_for(page, "() => document.querySelector('#queue-list li[data-status=failed]')")  # no such file here
        jobs = srv.request("GET", "/v1/videos?order=asc").json["data"]
    finally:
        srv.stop()
    assert [job["lora"] for job in jobs] == [[], [["motion", 0.25]]]
    assert "motion.safetensors" in jobs[1]["error"]["message"]


def test_model_lists_no_loras_when_none_are_loaded(server):
    assert server.request("GET", "/v1/model").json["loras"] == []


def test_on_a_server_with_keys_the_page_asks_for_one_and_plays_its_video(page, t2v, tmp_path):
    """With API keys on, the page's first call gets 401: it asks for the key once (a prompt), sends it as a bearer
    token from then on, and its video element (a plain URL) carries it too, so the video plays."""
    from composer.serve.keys import key_ring

    key = "page-test-key-0123456789"
    srv = Server(lambda: t2v, ServeConfig(output_dir=tmp_path / "serve", keys=key_ring([key])))
    asked: list[str] = []

    def answer(dialog):
        asked.append(dialog.message)
        dialog.accept(key)

    page.on("dialog", answer)
    try:
        srv.wait_ready()
        page.goto(f"http://127.0.0.1:{srv.port}/")
        wait_for(page, "() => window.composerPage.model !== null")
        fill_form(page, prompt="a red circle moving down", num_inference_steps=2, num_frames=5, seed=1)
        page.click("#submit")
        job_id = wait_for(page, "() => document.querySelector('#gallery-list figure')?.dataset.id")
        src = page.get_attribute(f'figure[data-id="{job_id}"] video', "src")
        assert src.startswith(f"/v1/videos/{job_id}/content?api_key=")
        played = page.evaluate(PLAYS, job_id)
        assert played["error"] is None and played["readyState"] >= 2, played
        assert len(asked) == 1 and "API key" in asked[0]
        assert srv.request("GET", "/v1/videos").status == 401  # the server still wants the key
    finally:
        srv.stop()
