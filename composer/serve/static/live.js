// The live view of a causal model: one WebSocket to /v1/streams per stream (docs/serving.md has the protocol).
// LiveStream speaks the protocol and paces the JPEG frames at the stream's fps; setup() wires it to the page.
"use strict";

class LiveStream {
  // request: the first message ({prompt, ...sampling fields, num_blocks}); handlers: onEvent(message) for each
  // JSON message, onFrame(blob, info) for each frame at its time, onClose(info) once, when it is over.
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
  return `${scheme}//${location.host}/v1/streams`;
}

const live = {stream: null, LiveStream, streamUrl, log: [], frameTimes: []};  // log, frameTimes: the last stream's

live.setup = function (model) {
  const $ = (id) => document.getElementById(id);
  $("live").hidden = false;
  const status = $("live-status"), img = $("live-frame"), errorBox = $("live-error");
  img.width = model.defaults.width || 256;
  img.height = model.defaults.height || 256;

  const setRunning = (running) => {
    $("live-start").disabled = running;
    $("live-stop").disabled = !running;
    $("live-next-prompt").disabled = !running;
    $("live-send").disabled = !running;
  };

  const onEvent = (message) => {
    live.log.push(message);
    if (message.type === "queued") status.textContent = `queued (position ${message.position})`;
    else if (message.type === "started") {
      status.textContent = `started: seed ${message.seed}, ${message.width}×${message.height} at ${message.fps} fps`
        + (message.num_blocks ? `, ${message.num_blocks} blocks` : "");
      img.width = message.width;
      img.height = message.height;
    } else if (message.type === "chunk") {
      status.textContent = `block ${message.block}: "${message.prompt}"`;
    } else if (message.type === "prompt") {
      status.textContent = `prompt "${message.prompt}" from block ${message.from_block}`;
    } else if (message.type === "done") {
      const link = $("live-video");
      link.textContent = "";
      const a = document.createElement("a");
      a.href = message.video;
      a.textContent = `the whole video (${message.frames} frames)`;
      link.append("Done: ", a);
      link.hidden = false;
    } else if (message.type === "error") {
      const field = message.error && message.error.param ? `${message.error.param}: ` : "";
      errorBox.textContent = field + (message.error ? message.error.message : "stream error");
      errorBox.hidden = false;
    }
  };

  const onFrame = (blob, info) => {
    const url = URL.createObjectURL(blob);
    const previous = img.dataset.url;
    img.onload = () => { if (previous) URL.revokeObjectURL(previous); };
    img.dataset.url = url;
    img.dataset.shown = String(info.shown);
    live.frameTimes.push(performance.now());
    img.src = url;
    img.hidden = false;
  };

  const onClose = (info) => {
    setRunning(false);
    live.stream = null;
    status.textContent = `${info.finished ? "finished" : "closed"}: ${info.shown} frames shown`;
  };

  $("live-prompt").value = "";
  $("live-form").addEventListener("submit", (event) => {
    event.preventDefault();
    if (live.stream) return;
    errorBox.hidden = true;
    $("live-video").hidden = true;
    live.log = [];
    live.frameTimes = [];
    const request = {prompt: $("live-prompt").value};
    const blocks = $("live-blocks").value.trim(), seed = $("live-seed").value.trim();
    if (blocks !== "") request.num_blocks = Number(blocks);
    if (seed !== "") request.seed = Number(seed);
    status.textContent = "connecting";
    setRunning(true);
    live.stream = new LiveStream(streamUrl(), request, {onEvent, onFrame, onClose});
  });
  $("live-stop").addEventListener("click", () => { if (live.stream) live.stream.stop(); });
  $("live-next").addEventListener("submit", (event) => {
    event.preventDefault();
    const next = $("live-next-prompt").value.trim();
    if (live.stream && next) {
      live.stream.sendPrompt(next);
      $("live-next-prompt").value = "";
    }
  });
};

window.ComposerLive = live;
