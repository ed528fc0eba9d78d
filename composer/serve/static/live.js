// The live view of a causal model: one WebSocket to /v1/streams per stream (docs/serving.md has the protocol).
// LiveStream speaks the protocol and paces the JPEG frames at the stream's fps; LiveTile shows one stream in its
// own tile (frame, status, frame rates, next prompt, stop); setup() wires the start form to new tiles, so any
// number of streams run side by side.
"use strict";

class LiveStream {
  // request: the first message ({prompt, ...sampling fields, num_blocks}); handlers: onEvent(message) for each
  // JSON message, onFrame(blob, info) for each frame at its time, onQueued(waiting) when a frame arrives that waits
  // for its time, onEnded() when the socket closes (frames may still be due), onClose(info) once, when it is over
  // (the last frame shown).
  constructor(url, request, handlers, WebSocketImpl = window.WebSocket) {
    this.request = request;
    this.handlers = handlers;
    this.fps = 16;
    this.frames = [];         // received, not shown yet: {blob, chunk}
    this.expected = 0;        // binary frames still due for the current chunk
    this.chunk = null;
    this.shown = 0;
    this.finished = false;    // "done", "error" or the socket closed
    this.timer = null;
    this.ws = new WebSocketImpl(url);
    this.ws.binaryType = "blob";
    this.ws.onopen = () => this.ws.send(JSON.stringify(request));
    this.ws.onmessage = (event) => this.receive(event.data);
    this.ws.onerror = () => this.handlers.onEvent({type: "error", error: {message: "the WebSocket failed"}});
    this.ws.onclose = (event) => this.closed(event);
  }

  receive(data) {
    if (typeof data !== "string") {
      this.frames.push({blob: data, chunk: this.chunk});
      this.expected -= 1;
      this.pace();
      if (this.frames.length && this.handlers.onQueued) this.handlers.onQueued(this.frames.length);
      return;
    }
    let message;
    try { message = JSON.parse(data); } catch (e) {
      this.handlers.onEvent({type: "error", error: {message: `not JSON from the server: ${data.slice(0, 80)}`}});
      return;
    }
    if (message.type === "started" && message.fps > 0) this.fps = message.fps;
    if (message.type === "chunk") {
      this.chunk = message;
      this.expected = message.frames;
    }
    if (message.type === "done" || message.type === "error") this.finished = true;
    this.handlers.onEvent(message);
  }

  // One frame every 1/fps s while frames wait; a frame that arrives late is shown as soon as it arrives.
  pace() {
    if (this.timer !== null) return;
    const step = () => {
      const next = this.frames.shift();
      if (!next) {
        this.timer = null;
        this.maybeClose();
        return;
      }
      this.shown += 1;
      this.handlers.onFrame(next.blob, {chunk: next.chunk, shown: this.shown, waiting: this.frames.length});
      this.timer = setTimeout(step, 1000 / this.fps);
    };
    step();
  }

  maybeClose() {
    if (this.socketClosed && this.timer === null && this.frames.length === 0 && !this.reported) {
      this.reported = true;
      this.handlers.onClose({shown: this.shown, finished: this.finished});
    }
  }

  closed(event) {
    this.socketClosed = true;
    if (this.handlers.onEnded) this.handlers.onEnded();
    if (!this.finished) {
      this.finished = true;
      if (event.code !== 1000) {
        this.handlers.onEvent({type: "error", error: {message: `the stream closed (code ${event.code})`}});
      }
    }
    this.maybeClose();
  }

  sendPrompt(prompt, blocks) {
    const message = {type: "prompt", prompt};
    if (blocks) message.blocks = blocks;
    this.ws.send(JSON.stringify(message));
  }

  stop() {
    if (this.ws.readyState === 1) this.ws.send(JSON.stringify({type: "stop"}));
  }
}

function streamUrl() {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const url = `${scheme}//${location.host}/v1/streams`;
  return window.composerWithKey ? window.composerWithKey(url) : url;  // an API key, if the server asked for one
}

// One stream's tile: made from #live-tile-template, it owns its LiveStream. `log` and `frameTimes` are its
// messages and the times its frames were shown (for the browser test and the curious). Its status follows the frame
// shown, not the newest message: frames are paced at the stream's fps, so the server may be many blocks ahead of
// the picture. `generating` turns false when the server is done (or failed): Stop and Send are then disabled while
// the rest plays; `running` when the last frame has been shown, and only then is the whole video offered.
class LiveTile {
  constructor(container, request, model, onChange, LiveStreamImpl = LiveStream) {
    this.request = request;
    this.onChange = onChange;
    this.log = [];
    this.frameTimes = [];
    this.serverFps = null;   // the rate the stream reached, as the server measures it (chunk messages' fps)
    this.targetFps = request.target_fps || null;
    this.running = true;      // frames may still be shown
    this.generating = true;   // the server may still make blocks (Stop and Send act)
    this.done = null;         // the server's "done" message, shown once the last frame has been
    this.switching = null;    // an acknowledged prompt switch whose first block is not shown yet
    this.status = "";
    const node = document.getElementById("live-tile-template").content.firstElementChild.cloneNode(true);
    this.node = node;
    this.part = (name) => node.querySelector(`.tile-${name}`);
    this.part("prompt").textContent = request.prompt;
    this.part("prompt").title = request.prompt;
    const img = this.part("frame");
    img.width = model.defaults.width || 256;
    img.height = model.defaults.height || 256;
    this.part("stop").addEventListener("click", () => this.stop());
    this.part("close").addEventListener("click", () => this.remove());
    this.part("next").addEventListener("submit", (event) => {
      event.preventDefault();
      const input = this.part("next-prompt");
      const next = input.value.trim();
      if (this.generating && next) {
        this.stream.sendPrompt(next);
        input.value = "";
      }
    });
    container.prepend(node);  // the newest first
    this.stream = new LiveStreamImpl(streamUrl(), request, {
      onEvent: (message) => this.event(message),
      onFrame: (blob, info) => this.frame(blob, info),
      onQueued: (waiting) => this.showStatus({waiting}),
      onEnded: () => this.ended(),
      onClose: (info) => this.close(info),
    });
  }

  setState(state) {
    this.node.dataset.state = state;
  }

  // The finished stream: Stop, Send and the next prompt are disabled (the frames may still be playing).
  ended() {
    if (!this.generating) return;
    this.generating = false;
    this.part("stop").disabled = true;
    this.part("send").disabled = true;
    this.part("next-prompt").disabled = true;
    this.onChange();
  }

  event(message) {
    this.log.push(message);
    const status = this.part("status");
    if (message.type === "queued") {
      status.textContent = `queued (position ${message.position})`;
      this.setState("queued");
    } else if (message.type === "started") {
      this.node.dataset.id = message.id;
      status.textContent = `started: seed ${message.seed}, ${message.width}×${message.height} at ${message.fps} fps`
        + (message.num_blocks ? `, ${message.num_blocks} blocks` : "");
      if (message.target_fps) this.targetFps = message.target_fps;
      const img = this.part("frame");
      img.width = message.width;
      img.height = message.height;
      this.setState("running");
    } else if (message.type === "chunk") {  // the status changes when its frames are shown (frame())
      if (typeof message.fps === "number") this.serverFps = message.fps;
      this.showStats();
    } else if (message.type === "prompt") {
      this.switching = message;
      this.showStatus();
    } else if (message.type === "done") {
      this.done = message;
      this.ended();
    } else if (message.type === "error") {
      const box = this.part("error");
      const field = message.error && message.error.param ? `${message.error.param}: ` : "";
      box.textContent = field + (message.error ? message.error.message : "stream error");
      box.hidden = false;  // (a bad message mid-stream is answered with an error too, and the stream goes on)
    }
  }

  // The status of the frame shown: its block and prompt, a switch still to come, the frames received but not shown.
  showStatus(info) {
    if (info && info.chunk) {
      this.status = `block ${info.chunk.block}: "${info.chunk.prompt}"`;
      if (this.switching && info.chunk.block >= this.switching.from_block) this.switching = null;
    }
    if (!this.status) return;
    const next = this.switching ? `; "${this.switching.prompt}" from block ${this.switching.from_block}` : "";
    const waiting = info && info.waiting ? ` (${info.waiting} more frames received)` : "";
    this.part("status").textContent = this.status + next + waiting;
  }

  frame(blob, info) {
    const img = this.part("frame");
    const url = URL.createObjectURL(blob);
    const previous = img.dataset.url;
    img.onload = () => { if (previous) URL.revokeObjectURL(previous); };
    img.dataset.url = url;
    img.dataset.shown = String(info.shown);
    this.frameTimes.push(performance.now());
    img.src = url;
    img.hidden = false;
    this.showStatus(info);
    this.showStats();
  }

  // The frame rates: the server's (what the stream reached), and the frames shown here over the last seconds.
  showStats() {
    const made = this.serverFps === null ? "–" : this.serverFps.toFixed(1);
    const target = this.targetFps ? ` (target ${this.targetFps})` : "";
    this.part("fps").textContent = `${made} fps made${target}`;
    const times = this.frameTimes.slice(-17);
    const shown = times.length > 1 ? ((times.length - 1) * 1000 / (times[times.length - 1] - times[0])) : null;
    this.part("shown").textContent = `${this.frameTimes.length} frames shown`
      + (shown === null ? "" : ` at ${shown.toFixed(1)} fps`);
    this.node.dataset.fps = this.serverFps === null ? "" : String(this.serverFps);
  }

  // The last frame has been shown (or the stream ended without more): now the whole video is offered.
  close(info) {
    this.running = false;
    this.ended();
    if (this.done) {
      const link = this.part("video");
      link.textContent = "";
      const a = document.createElement("a");
      a.href = this.done.video;
      a.textContent = `the whole video (${this.done.frames} frames)`;
      link.append("Done: ", a);
      link.hidden = false;
    }
    this.part("close").hidden = false;
    this.part("status").textContent = `${info.finished ? "finished" : "closed"}: ${info.shown} frames shown`;
    this.setState("finished");
    this.onChange();
  }

  stop() {
    if (this.generating) this.stream.stop();
    this.part("stop").disabled = true;
  }

  remove() {
    if (this.running) return;
    const url = this.part("frame").dataset.url;
    if (url) URL.revokeObjectURL(url);
    this.node.remove();
    this.onChange(this);
  }
}

const live = {tiles: [], LiveStream, LiveTile, streamUrl};  // tiles: every stream started, the newest last

live.running = function () {  // the streams the server may still be making (what Stop all stops)
  return live.tiles.filter((tile) => tile.generating);
};

live.setup = function (model) {
  const $ = (id) => document.getElementById(id);
  $("live").hidden = false;
  const container = $("live-tiles");

  const changed = (removed) => {
    if (removed) live.tiles = live.tiles.filter((tile) => tile !== removed);
    $("live-stop-all").disabled = live.running().length === 0;
    $("live-empty").hidden = container.children.length > 0;
  };

  $("live-prompt").value = "";
  $("live-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const request = {prompt: $("live-prompt").value};
    const blocks = $("live-blocks").value.trim(), seed = $("live-seed").value.trim();
    const target = $("live-target-fps").value.trim();
    if (blocks !== "") request.num_blocks = Number(blocks);
    if (seed !== "") request.seed = Number(seed);
    if (target !== "") request.target_fps = Number(target);
    live.tiles.push(new LiveTile(container, request, model, changed));
    changed();
  });
  $("live-stop-all").addEventListener("click", () => live.running().forEach((tile) => tile.stop()));
};

window.ComposerLive = live;
