// The page of `composer serve`: a request form (defaults from GET /v1/model), the queue (GET /v1/videos,
// polled), the gallery of finished videos, and, for causal models, the live stream view (live.js).
"use strict";

const FIELDS = ["prompt", "negative_prompt", "width", "height", "num_frames", "num_inference_steps",
  "guidance_scale", "seed", "lora", "lora_scale"];
const LABELS = {prompt: "Prompt", negative_prompt: "Negative prompt", width: "Width", height: "Height",
  num_frames: "Frames", num_inference_steps: "Steps", guidance_scale: "Guidance", seed: "Seed", lora: "LoRA",
  lora_scale: "LoRA scale"};
const NO_LORA = "(none)";  // the select's value for the base model: "lora": []
const ACTIVE = ["queued", "in_progress"];
const POLL_ACTIVE_MS = 500, POLL_IDLE_MS = 2000, HEALTH_MS = 5000, MODEL_RETRY_MS = 1000;
const SHOWN_FINISHED_PROBLEMS = 10;  // failed / cancelled jobs kept in the queue list

const page = {model: null, jobs: new Map(), pollTimer: null, health: "connecting"};
window.composerPage = page;  // for the browser test and the curious

const $ = (id) => document.getElementById(id);

// A server started with API keys answers 401: the page asks for a key once and keeps it for this tab
// (sessionStorage), sending it as `Authorization: Bearer` (and as ?api_key= where a URL is all there is: the
// video elements, downloads and the live streams' WebSockets; the server keeps it out of its logs).
function apiKey() { return sessionStorage.getItem("composer-api-key") || ""; }

function withKey(url) {
  const key = apiKey();
  return key ? `${url}${url.includes("?") ? "&" : "?"}api_key=${encodeURIComponent(key)}` : url;
}
window.composerWithKey = withKey;  // live.js: the WebSocket's URL

async function api(method, path, body, asked = false) {
  const init = {method, headers: {}};
  if (body !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const sent = apiKey();
  if (sent) init.headers["Authorization"] = `Bearer ${sent}`;
  const response = await fetch(path, init);
  if (response.status === 401 && !asked) {
    if (apiKey() && apiKey() !== sent) return api(method, path, body, true);  // another call asked meanwhile
    const key = window.prompt("This server needs an API key (it stays in this tab only):");
    if (key && key.trim()) {
      sessionStorage.setItem("composer-api-key", key.trim());
      return api(method, path, body, true);
    }
  }
  let json = null;
  try { json = await response.json(); } catch (e) { /* a body that is not JSON (none expected) */ }
  return {status: response.status, ok: response.ok, json};
}

function errorMessage(reply) {
  const error = reply.json && reply.json.error;
  return error && error.message ? error.message : `HTTP ${reply.status}`;
}

// ---- health and model --------------------------------------------------------------------------------------

function setHealth(state, detail) {
  page.health = state;
  const badge = $("health");
  badge.className = `badge ${state}`;
  badge.textContent = {ready: "ready", loading: "loading the model", failed: "model failed to load",
    unreachable: "server unreachable", connecting: "connecting"}[state] || state;
  badge.title = detail || "";
  $("submit").disabled = state !== "ready";
}

async function loadModel() {
  let reply;
  try {
    reply = await api("GET", "/v1/model");
  } catch (e) {
    setHealth("unreachable", String(e));
    setTimeout(loadModel, MODEL_RETRY_MS);
    return;
  }
  if (reply.status !== 200) {
    const state = reply.json && reply.json.status === "failed" ? "failed" : "loading";
    setHealth(state, errorMessage(reply));
    if (state === "failed") $("model-name").textContent = errorMessage(reply);
    else setTimeout(loadModel, MODEL_RETRY_MS);
    return;
  }
  page.model = reply.json;
  const folder = page.model.model.replace(/\/+$/, "").split("/").pop();
  $("model-name").textContent = folder === page.model.family ? folder : `${page.model.family} · ${folder}`;
  $("model-name").title = page.model.model;
  fillDefaults();
  showHints();
  showLoras();
  setHealth("ready");
  if (page.model.causal && window.ComposerLive) window.ComposerLive.setup(page.model);
  setTimeout(checkHealth, HEALTH_MS);
}

async function checkHealth() {
  try {
    const reply = await api("GET", "/health");
    if (reply.status === 200) setHealth("ready");
    else setHealth(/failed/.test(errorMessage(reply)) ? "failed" : "loading", errorMessage(reply));
  } catch (e) {
    setHealth("unreachable", String(e));
  }
  setTimeout(checkHealth, HEALTH_MS);
}

function fillDefaults() {
  const defaults = page.model.defaults;
  for (const name of FIELDS) {
    if (name === "prompt" || name === "lora") continue;  // the user's, never reset; the LoRA list: showLoras
    const value = defaults[name];
    $(name).value = value === null || value === undefined ? "" : value;
  }
  const steps = $("num_inference_steps");
  steps.readOnly = page.model.fixed_steps !== null;
}

function showLoras() {
  // the adapters the server loaded (--lora-path): the default runs them all at their start scales
  const loras = page.model.loras || [];
  $("lora-fields").hidden = loras.length === 0;
  const select = $("lora");
  select.replaceChildren();
  const options = [["", `all loaded (${loras.map((l) => `${l.name} ×${l.scale}`).join(", ")})`],
    [NO_LORA, "none: the base model"], ...loras.map((l) => [l.name, `${l.name} (start scale ${l.scale})`])];
  for (const [value, text] of options) select.append(new Option(text, value));
}

function showHints() {
  const {multiples, limits, fixed_steps: fixedSteps} = page.model;
  const sizeHint = [multiples.spatial ? `×${multiples.spatial}` : "", limits.max_size ? `≤ ${limits.max_size}` : ""];
  $("width-hint").textContent = $("height-hint").textContent = sizeHint.filter(Boolean).join(", ");
  const t = multiples.temporal;
  $("num_frames-hint").textContent = [t && t > 1 ? `${t}k+1` : "",
    limits.max_frames ? `≤ ${limits.max_frames}` : ""].filter(Boolean).join(", ");
  $("num_inference_steps-hint").textContent = fixedSteps !== null ? `fixed: ${fixedSteps}`
    : (limits.max_steps ? `≤ ${limits.max_steps}` : "");
}

// ---- the form ----------------------------------------------------------------------------------------------

function requestBody() {
  const body = {};
  for (const name of FIELDS) {
    const input = $(name);
    const text = input.value.trim();
    if (input.dataset.kind) {
      if (text === "") continue;  // blank: the model's default (a random seed)
      const number = Number(text);
      body[name] = Number.isNaN(number) ? text : number;  // the server names a non-number
    } else if (name === "lora") {
      if (text === NO_LORA) body.lora = [];
      else if (text !== "") body.lora = text;
    } else if (name === "prompt" || text !== "") {
      body[name] = input.value;
    }
  }
  return body;
}

function clearErrors() {
  $("form-error").hidden = true;
  $("form-error").textContent = "";
  for (const name of FIELDS) {
    $(name).removeAttribute("aria-invalid");
    $(name).removeAttribute("aria-describedby");
    const p = $(`${name}-error`);
    p.hidden = true;
    p.textContent = "";
  }
}

function showError(message, field) {
  const box = $("form-error");
  box.textContent = "";
  if (field) {
    const name = document.createElement("strong");
    name.className = "error-field";
    name.textContent = `${LABELS[field] || field} (${field}): `;
    box.append(name);
  }
  box.append(document.createTextNode(message));
  box.hidden = false;
  if (field && FIELDS.includes(field)) {
    const input = $(field);
    const p = $(`${field}-error`);
    p.textContent = message;
    p.hidden = false;
    input.setAttribute("aria-invalid", "true");
    input.setAttribute("aria-describedby", p.id);
    input.focus();
  }
}

async function submitRequest(event) {
  event.preventDefault();
  clearErrors();
  const button = $("submit");
  button.disabled = true;
  try {
    const reply = await api("POST", "/v1/videos", requestBody());
    if (reply.ok) {
      upsertJob(reply.json);
      schedulePoll(0);
    } else {
      showError(errorMessage(reply), reply.json && reply.json.error ? reply.json.error.param : null);
    }
  } catch (e) {
    showError(`the server did not answer (${e})`, null);
  } finally {
    button.disabled = page.health !== "ready";
  }
}

// ---- the queue and the gallery -----------------------------------------------------------------------------

function schedulePoll(delay) {
  clearTimeout(page.pollTimer);
  page.pollTimer = setTimeout(pollJobs, delay);
}

async function pollJobs() {
  let active = false;
  try {
    const reply = await api("GET", "/v1/videos?order=desc&limit=100");  // the newest 100
    if (reply.ok) {
      for (const job of [...reply.json.data].reverse()) upsertJob(job);
      active = reply.json.data.some((job) => ACTIVE.includes(job.status));
      if (page.health === "unreachable") setHealth(page.model ? "ready" : "loading");
    }
  } catch (e) {
    setHealth("unreachable", String(e));
  }
  schedulePoll(active ? POLL_ACTIVE_MS : POLL_IDLE_MS);
}

function upsertJob(job) {
  page.jobs.set(job.id, job);
  renderQueue();
  if (job.status === "completed") addToGallery(job);
}

function describe(job) {
  const r = job.request || {};
  const parts = [job.size, r.num_frames !== undefined ? `${r.num_frames} frames` : "",
    r.num_inference_steps !== undefined ? `${r.num_inference_steps} steps` : "", `seed ${job.seed}`];
  return parts.filter(Boolean).join(" · ");
}

function renderQueue() {
  const list = $("queue-list");
  const jobs = [...page.jobs.values()];
  const shown = jobs.filter((job) => ACTIVE.includes(job.status));
  const problems = jobs.filter((job) => job.status === "failed" || job.status === "cancelled");
  shown.push(...problems.slice(-SHOWN_FINISHED_PROBLEMS));
  const keep = new Set(shown.map((job) => job.id));
  for (const li of [...list.children]) if (!keep.has(li.dataset.id)) li.remove();
  for (const job of shown) {
    let li = list.querySelector(`li[data-id="${job.id}"]`);
    if (!li) {
      li = $("job-template").content.firstElementChild.cloneNode(true);
      li.dataset.id = job.id;
      li.querySelector(".cancel").addEventListener("click", () => cancelJob(job.id));
      list.append(li);
    }
    li.dataset.status = job.status;
    const status = li.querySelector(".job-status");
    status.textContent = job.status.replace("_", " ");
    status.className = `job-status ${job.status}`;
    li.querySelector(".job-prompt").textContent = job.prompt;
    li.querySelector(".job-prompt").title = describe(job);
    const bar = li.querySelector("progress");
    bar.value = job.progress_fraction || 0;
    bar.hidden = !ACTIVE.includes(job.status);
    bar.setAttribute("aria-label", `progress of "${job.prompt}": ${job.progress || 0}%`);
    const cancel = li.querySelector(".cancel");
    cancel.hidden = !ACTIVE.includes(job.status);
    cancel.setAttribute("aria-label", `cancel "${job.prompt}"`);
    const error = li.querySelector(".job-error");
    error.textContent = job.error ? job.error.message : "";
    error.hidden = !job.error;
  }
  $("queue-empty").hidden = shown.length > 0;
}

async function cancelJob(id) {
  try {
    const reply = await api("POST", `/v1/videos/${id}/cancel`);  // never deletes a finished one
    if (reply.ok) upsertJob(reply.json);
  } finally {
    schedulePoll(0);
  }
}

function addToGallery(job) {
  const gallery = $("gallery-list");
  if (gallery.querySelector(`figure[data-id="${job.id}"]`)) return;
  const figure = $("video-template").content.firstElementChild.cloneNode(true);
  figure.dataset.id = job.id;
  const url = `/v1/videos/${job.id}/content`;
  const video = figure.querySelector("video");
  video.addEventListener("error", () => {
    figure.classList.add("unplayable");
    figure.querySelector(".video-meta").textContent =
      `${describe(job)} · this browser cannot play it (H.264 mp4): download it`;
  });
  video.src = withKey(url);
  video.setAttribute("aria-label", `video: ${job.prompt}`);
  // the size as attributes: the box keeps the video's aspect ratio before its first frame loads
  video.width = (job.request && job.request.width) || 256;
  video.height = (job.request && job.request.height) || 256;
  figure.querySelector(".video-prompt").textContent = job.prompt;
  figure.querySelector(".video-meta").textContent = describe(job);
  const link = figure.querySelector(".video-download");
  link.href = withKey(url);
  link.download = `${job.id}.mp4`;
  // newest first: the page lists jobs oldest first, so each new video goes to the front
  gallery.prepend(figure);
  $("gallery-empty").hidden = true;
}

function init() {
  const probe = document.createElement("video");
  $("codec-note").hidden = probe.canPlayType('video/mp4; codecs="avc1.640028"') !== "";
  $("request-form").addEventListener("submit", submitRequest);
  $("reset-defaults").addEventListener("click", () => { if (page.model) { clearErrors(); fillDefaults(); } });
  setHealth("connecting");
  loadModel();
  pollJobs();
}

document.addEventListener("DOMContentLoaded", init);
