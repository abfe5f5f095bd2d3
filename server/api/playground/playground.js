// The diffshard playground: a form that streams OpenAI image events from this server
// (POST /v1/images/generations, or /v1/images/edits in edit mode, with stream: true), or on a
// video model's server makes videos (video.js), and a panel of the devices' memory.
// Plain JavaScript, no build step, nothing fetched from elsewhere: it works offline.

import { refreshBatches, setupBatches } from "./batches.js";
import { addControlImage, chosenControl, controlProblem, setupControl, showControlNets } from "./control.js";
import { addSource, editByReference, editForm, editSource, editing, readEditFields, setupEdit } from "./edit.js";
import { chosenAdapters, showAdapters } from "./lora.js";
import { mode, offerVideo, setupModes, showDefaultSize } from "./mode.js";
import { makeVideo, setupVideo, showVideoDefaults } from "./video.js";

const $ = (id) => document.getElementById(id);
const KEY = "diffshard.apiKey"; // session storage only: gone when the tab closes
const REFRESH_MS = 5000;
// Sent only when filled in, and switched on in the form's mode (mode.js).
const OPTIONAL = ["negative_prompt", "size", "scheduler", "step_cache"];
const NUMBERS = ["num_inference_steps", "guidance_scale", "seed", "num_frames"]; // likewise
// The step-caching policies in words; the OpenAPI document lists those the served model takes.
const STEP_CACHES = {
  off: "off (every step in full)",
  deep: "deep (reuses deep features: faster)",
  first_block: "first_block (skips blocks: faster)",
};

let running = null; // the AbortController of the generation in flight
let urls = []; // object URLs of the shown images or video, revoked when the next ones come
let modelRead = false; // the server loads its model and adapters at startup: read once, they stay
let guidanceAs = "guidance_scale"; // what the Guidance field sends: Qwen-Image guides by true_cfg_scale

// Talking to the server.

function authorization() {
  const key = sessionStorage.getItem(KEY);
  return key ? { Authorization: `Bearer ${key}` } : {};
}

async function api(path, init = {}) {
  const response = await fetch(path, { ...init, headers: { ...authorization(), ...init.headers } });
  if (response.status === 401) $("key-field").hidden = false;
  return response;
}

// What to do, where the server's message (which names the field, the limit or the setting,
// and says when to retry) leaves it unsaid.
const HINTS = {
  401: "Enter a valid API key above.",
  504: "Try fewer steps, images or pixels.",
};

// An error answer in plain words: the envelope's message, a full sentence, and the hint.
function explain(status, error = {}) {
  let text = error.message || (status ? `The server answered ${status}.` : "The generation failed.");
  text = text.charAt(0).toUpperCase() + text.slice(1) + (/[.!?]$/.test(text) ? "" : ".");
  const hint = HINTS[status];
  return { text: hint ? `${text} ${hint}` : text, param: error.param };
}

async function problem(response) {
  let error = {};
  try {
    error = (await response.json()).error || {};
  } catch {
    // not an envelope (a proxy's page): the status says enough
  }
  return explain(response.status, error);
}

// Seeds go up to 2^63 - 1, past what a JavaScript number holds exactly: keep the digits sent.
function exactSeed(key, value, context) {
  return key === "seed" && context?.source ? context.source : value;
}

// Server-sent events of a fetch response: {event, data} as they arrive.
async function* serverEvents(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let scanned = 0; // where the search for an event's end goes on (an image event is large)
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replaceAll("\r\n", "\n");
    let end;
    while ((end = buffer.indexOf("\n\n", scanned)) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      scanned = 0;
      let event = "message";
      const data = [];
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) event = line.slice(6).trim();
        else if (line.startsWith("data:")) data.push(line.slice(5).trimStart());
      }
      if (data.length) yield { event, data: JSON.parse(data.join("\n"), exactSeed) };
    }
    scanned = Math.max(0, buffer.length - 1); // a "\n" may end this chunk, its pair start the next
  }
}

// The form.

function showError(problem) {
  const box = $("error");
  box.textContent = problem.text;
  box.hidden = false;
  const name = problem.param?.split(".")[0]; // step_cache.interval: the step_cache field
  const field = name && document.querySelector(`#generate [name="${CSS.escape(name)}"]`);
  if (field) {
    field.setAttribute("aria-invalid", "true");
    (field.matches("fieldset") ? field.querySelector("input") : field).focus(); // lora: its first switch
  }
}

function clearError() {
  $("error").hidden = true;
  $("error").textContent = "";
  for (const field of document.querySelectorAll("#generate [aria-invalid]")) {
    field.removeAttribute("aria-invalid");
  }
}

// The first field the browser finds wrong (a number out of range, a size not WxH), in words.
function invalidField() {
  for (const field of $("generate").elements) {
    if (field.willValidate && !field.checkValidity()) {
      const label = document.querySelector(`label[for="${field.id}"]`).textContent;
      return { text: `${label}: ${field.validationMessage}`, param: field.name };
    }
  }
  if (!$("prompt").value.trim()) return { text: "Write a prompt first.", param: "prompt" };
  return mode() === "video" ? null : controlProblem();
}

function requestBody() {
  const form = $("generate").elements;
  const body = { prompt: form.prompt.value };
  const sent = (name) => !form[name].disabled;
  for (const name of OPTIONAL.filter(sent)) if (form[name].value.trim()) body[name] = form[name].value.trim();
  for (const name of NUMBERS.filter(sent)) if (form[name].value !== "") body[name] = form[name].valueAsNumber;
  if (guidanceAs !== "guidance_scale" && "guidance_scale" in body) {
    body[guidanceAs] = body.guidance_scale;
    delete body.guidance_scale;
  }
  body.seed ??= randomSeed(); // chosen here, so every seed shown can be typed back in
  const lora = chosenAdapters();
  if (lora) body.lora = lora;
  if (mode() === "video") return body; // a video job (POST /v1/videos) takes no more
  const control = chosenControl(); // generations and edits (an edit's form sends it as JSON text)
  if (control) body.control = control;
  Object.assign(body, {
    n: form.n.valueAsNumber,
    stream: true,
    stream_progress: true,
    partial_images: Number(form.partial_images.value),
    output_format: form.output_format.value,
  });
  return body;
}

function randomSeed() {
  const [draw] = crypto.getRandomValues(new Uint32Array(1));
  return draw * 2 ** 21 + Math.floor(Math.random() * 2 ** 21); // below 2^53
}

// The bar and its words change every step; screen readers hear only changes of state
// (waiting, generating, done), not every step.
function setProgress(text, fraction = null, { announce = true } = {}) {
  const bar = $("progress");
  if (fraction === null) bar.removeAttribute("value"); // indeterminate: waiting in line
  else bar.value = fraction;
  $("progress-text").textContent = text;
  if (announce) $("announce").textContent = text;
}

// The images: one card per image, showing its latest preview and then the image itself,
// with the previews kept in a strip beneath.

function card(index, body) {
  const item = document.createElement("li");
  item.className = "card";
  item.dataset.image = index;
  item.innerHTML = `
    <figure>
      <div class="frame"><img alt="" hidden><span class="badge" hidden></span></div>
      <figcaption>
        <span class="title"></span> <span class="seed"></span>
        <button class="reuse" type="button" hidden>Use seed</button> <button class="edit-this" type="button"
          hidden>Edit</button> <a class="download" hidden>Download</a>
      </figcaption>
    </figure>
    <ol class="strip" aria-label="Previews"></ol>`;
  item.querySelector(".title").textContent = `Image ${index + 1}`;
  const prompt = body.prompt.trim();
  item.querySelector("img").dataset.prompt = prompt.length > 100 ? `${prompt.slice(0, 99)}…` : prompt;
  addControlImage(item, body);
  return item;
}

function imageBlob(b64, format = "png") {
  const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
  return new Blob([bytes], { type: `image/${format}` });
}

function imageURL(blob) {
  const url = URL.createObjectURL(blob);
  urls.push(url);
  return url;
}

// The results of a new generation (or video) in place of the last one's, whose URLs go.
function clearResults(...items) {
  for (const url of urls) URL.revokeObjectURL(url);
  urls = [];
  $("images").replaceChildren(...items);
  $("results-empty").hidden = true;
}

function show(img, url, alt) {
  img.onload = () => img.classList.toggle("pixelated", img.naturalWidth < 256);
  img.src = url;
  img.alt = alt;
  img.hidden = false;
}

function cardOf(data) {
  return document.querySelector(`.card[data-image="${Number(data.image_index ?? 0)}"]`);
}

function onPartial(data) {
  const item = cardOf(data);
  if (!item) return;
  const number = data.partial_image_index + 1;
  const url = imageURL(imageBlob(data.b64_json, data.output_format));
  const img = item.querySelector(".frame img");
  if (img.dataset.kind !== "final") {
    show(img, url, `Preview ${number} of image ${Number(item.dataset.image) + 1}`);
    img.dataset.kind = "partial";
    const badge = item.querySelector(".badge");
    badge.textContent = `preview ${number}`;
    badge.hidden = false;
  }
  const thumb = document.createElement("li");
  const small = document.createElement("img");
  show(small, url, `Preview ${number}`);
  small.dataset.kind = "partial";
  thumb.append(small);
  item.querySelector(".strip").append(thumb);
}

// Shows a finished image; 1 if it had a card, else 0.
function onCompleted(data) {
  const item = cardOf(data);
  if (!item) return 0;
  const img = item.querySelector(".frame img");
  const blob = imageBlob(data.b64_json, data.output_format);
  const url = imageURL(blob);
  const number = Number(item.dataset.image) + 1;
  show(img, url, `${img.dataset.prompt}, image ${number}, seed ${data.seed}`);
  img.dataset.kind = "final";
  item.querySelector(".badge").hidden = true;
  item.querySelector(".seed").textContent = `seed ${data.seed}`;
  const link = item.querySelector(".download");
  link.href = url;
  link.download = `diffshard-${data.seed}.${data.output_format === "jpeg" ? "jpg" : data.output_format}`;
  link.hidden = false;
  const reuse = item.querySelector(".reuse");
  reuse.setAttribute("aria-label", `Use seed ${data.seed} in the form`);
  reuse.onclick = () => {
    $("seed").value = data.seed;
    $("n").value = 1;
    $("seed").focus();
  };
  reuse.hidden = false;
  const source = addSource(blob, `${img.dataset.prompt}, seed ${data.seed}`); // listed to edit
  const edit = item.querySelector(".edit-this");
  edit.setAttribute("aria-label", `Edit image ${number}`);
  edit.onclick = () => editSource(source);
  edit.hidden = false;
  return 1;
}

function onProgress(data) {
  if (data.status === "queued") {
    setProgress(`Waiting: ${data.queue_position} in line.`);
  } else {
    const first = !$("announce").textContent.startsWith("Generating");
    if (first) $("announce").textContent = `Generating: ${data.steps} steps.`;
    setProgress(`Step ${data.step} of ${data.steps}.`, data.steps ? data.step / data.steps : 0, {
      announce: false,
    });
  }
}

// While a generation runs, Generate is off and Stop on; focus follows, so a keyboard user who
// pressed one is not dropped to the top of the page.
function setRunning(on) {
  const [from, to] = on ? [$("go"), $("stop")] : [$("stop"), $("go")];
  const focused = document.activeElement === from;
  to.disabled = false;
  from.disabled = true;
  if (focused) to.focus();
}

// What to send: a generation's JSON, or in edit mode an edit's multipart form (its image, its
// mask, the same fields); the events of either are read alike, named by `kind`.
async function request(body) {
  if (!editing()) {
    const init = { headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) };
    return { path: "/v1/images/generations", kind: "image_generation", init };
  }
  const { form, problem } = await editForm(body);
  return problem ? { problem } : { path: "/v1/images/edits", kind: "image_edit", init: { body: form } };
}

// A request the server refused before it began: its reasons, in words.
async function refused(response) {
  showError(await problem(response));
  if (response.status === 401) $("api-key").focus();
  setProgress("Not started.", 0);
}

// A request cut off by the network (or by a bug in this page), not answered with an error.
function lostServer(err, reached) {
  const text = reached
    ? "The connection to the server broke off. Try again."
    : "Cannot reach the server: is it running? Check the address and try again.";
  showError({ text });
  setProgress("Not finished.", 0);
  if (!(err instanceof TypeError)) console.error(err); // a bug in this page, not the network
}

// A video is a job on the server, watched until it ends (video.js); Stop only stops watching.
async function generateVideo(body) {
  running = new AbortController();
  setRunning(true);
  try {
    await makeVideo(body, running.signal);
  } finally {
    running = null;
    setRunning(false);
  }
}

async function generate() {
  clearError();
  const invalid = invalidField();
  if (invalid) return showError(invalid);
  const body = requestBody();
  if (mode() === "video") return generateVideo(body);
  running = new AbortController(); // taken while the request is built: one at a time
  const { path, kind, init, problem: unsendable } = await request(body).catch(() => ({
    problem: { text: "The image to edit could not be read: choose it again.", param: "image" },
  }));
  if (unsendable) {
    running = null;
    return showError(unsendable);
  }
  setRunning(true);
  setProgress("Sending…", 0, { announce: false });
  const started = performance.now();
  let completed = 0;
  let reached = false; // whether the server answered at all
  try {
    const response = await api(path, { method: "POST", ...init, signal: running.signal });
    reached = true;
    if (!response.ok) return await refused(response);
    clearResults(...Array.from({ length: body.n }, (_, i) => card(i, body))); // the last ones go now
    for await (const { event, data } of serverEvents(response)) {
      if (event === "diffshard.progress") onProgress(data);
      else if (event === `${kind}.partial_image`) onPartial(data);
      else if (event === `${kind}.completed`) completed += onCompleted(data);
      else if (event === "error") showError(explain(null, data.error)); // its message says why
    }
    const seconds = ((performance.now() - started) / 1000).toFixed(1);
    if (completed === body.n) {
      setProgress(`Done: ${completed} image${completed === 1 ? "" : "s"} in ${seconds} s.`, 1);
    } else {
      if ($("error").hidden) showError({ text: "The server ended the stream early. Try again." });
      setProgress(`Failed after ${seconds} s: ${completed} of ${body.n} images done.`, 0);
    }
  } catch (err) {
    if (err.name === "AbortError") setProgress("Stopped: the server drops the request.", 0);
    else lostServer(err, reached);
  } finally {
    running = null;
    setRunning(false);
  }
}

// The devices panel: the shard plan and each device's memory, from /v1/shards.

function bytes(count) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let unit = 0;
  while (count >= 1024 && unit < units.length - 1) {
    count /= 1024;
    unit += 1;
  }
  return `${count.toFixed(unit ? 1 : 0)} ${units[unit]}`;
}

function deviceItem(name, { blocks, memory }, pool) {
  const item = document.createElement("li");
  item.dataset.device = name;
  const onGPU = memory.allocated !== null;
  const used = onGPU ? memory.allocated : memory.total - memory.free;
  const what = onGPU ? "allocated" : "host RAM in use";
  const rows = [
    ["weights", bytes(memory.shard_bytes)],
    [what, memory.total ? `${bytes(used)} of ${bytes(memory.total)}` : "unknown"],
  ];
  if (!onGPU && memory.resident !== null) rows.push(["this process", bytes(memory.resident)]);
  if (pool) rows.push(["pool in use", bytes(pool.bytes_in_use)]);
  item.innerHTML = `<h3></h3><meter min="0" max="1"></meter><dl></dl>
    <details><summary></summary><p class="blocks"></p></details>`;
  item.querySelector("h3").textContent = name;
  const meter = item.querySelector("meter");
  meter.value = memory.total ? used / memory.total : 0;
  meter.setAttribute("aria-label", `${name}: ${what}`);
  meter.textContent = `${Math.round(meter.value * 100)}%`;
  for (const [term, value] of rows) {
    const dt = document.createElement("dt");
    const dd = document.createElement("dd");
    dt.textContent = term;
    dd.textContent = value;
    item.querySelector("dl").append(dt, dd);
  }
  item.querySelector("summary").textContent = `${blocks.length} blocks`;
  item.querySelector(".blocks").textContent = blocks.join(", ");
  return item;
}

let lastBusy = null; // {at, seconds: {worker: busy seconds}} at the previous refresh

// Each worker (a stage or replica) and how busy it was since the previous refresh.
function workerItems(busySeconds) {
  const at = performance.now();
  const previous = lastBusy;
  lastBusy = { at, seconds: busySeconds };
  return Object.entries(busySeconds).map(([worker, seconds]) => {
    const item = document.createElement("li");
    const name = document.createElement("span");
    const meter = document.createElement("meter");
    const words = document.createElement("span");
    name.textContent = worker;
    const since = previous && worker in previous.seconds ? seconds - previous.seconds[worker] : null;
    const share = since === null ? null : Math.min(1, since / ((at - previous.at) / 1000));
    meter.min = 0;
    meter.max = 1;
    meter.value = share ?? 0;
    meter.setAttribute("aria-label", `${worker} busy`);
    words.textContent = share === null ? "busy —" : `busy ${Math.round(share * 100)}%`;
    item.append(name, meter, words);
    return item;
  });
}

async function refreshDevices() {
  if (document.hidden) return;
  let response;
  try {
    response = await api("/v1/shards");
  } catch {
    $("plan").textContent = "Cannot reach the server.";
    return;
  }
  if (!response.ok) {
    $("plan").textContent = (await problem(response)).text;
    return;
  }
  const shards = await response.json();
  const { replicas, stages, lanes } = shards.parallel;
  const plural = (count, word) => `${count} ${word}${count === 1 ? "" : "s"}`;
  $("plan").textContent =
    `${plural(replicas, "replica")} × ${plural(stages, "stage")}, ` +
    `${plural(lanes, "lane")}, ${shards.plan.dtype}` +
    (shards.quantization === "off" ? "." : `, quantized: ${shards.quantization}.`);
  $("worker-list").replaceChildren(...workerItems(shards.parallel.busy_seconds));
  const open = new Set([...document.querySelectorAll("#device-list details[open]")].map(
    (d) => d.closest("li").dataset.device));
  $("device-list").replaceChildren(
    ...Object.entries(shards.devices).map(([name, device]) => {
      const item = deviceItem(name, device, shards.pool[name]);
      item.querySelector("details").open = open.has(name);
      return item;
    }),
  );
}

// Start: the limits from the OpenAPI document, the model, the server's state, the devices.

// An optional field's schema in the OpenAPI document: its branch that is not null.
const branch = (field) => (field.anyOf || [field]).find((b) => b.type !== "null");

async function readLimits() {
  const response = await fetch("/openapi.json");
  if (!response.ok) return;
  const openapi = await response.json();
  readEditFields(openapi);
  const fields = openapi.components.schemas.ImageGenerationRequest.properties;
  const form = $("generate").elements;
  form.n.max = fields.n.maximum;
  form.prompt.maxLength = fields.prompt.maxLength;
  form.num_inference_steps.max = branch(fields.num_inference_steps).maximum;
  form.seed.max = Math.min(branch(fields.seed).maximum, Number.MAX_SAFE_INTEGER); // typed: a number
  const size = branch(fields.size).examples?.[0];
  if (size) showDefaultSize("generate", size);
  for (const name of branch(fields.scheduler).enum || []) {
    if (name !== "default") form.scheduler.add(new Option(name, name));
  }
  readStepCaches(fields.step_cache, form.step_cache);
}

// The step-caching policies the model takes, and the server's default (sent: nothing). A model
// that takes none but off shows no choice.
function readStepCaches(field, select) {
  const policies = (field && branch(field).enum) || [];
  if (!policies.some((name) => name !== "off")) return;
  const fallback = field.default;
  if (fallback) {
    const { policy, ...parameters } = typeof fallback === "string" ? { policy: fallback } : fallback;
    const words = Object.entries(parameters).map(([name, value]) => `${name} ${value}`);
    select.options[0].text = `server default: ${policy}${words.length ? ` (${words.join(", ")})` : ""}`;
  }
  for (const name of policies) select.add(new Option(STEP_CACHES[name] || name, name));
  $("step-cache-field").hidden = false;
}

// The model: its adapters, its words, and whether it makes videos (then Video is offered).
async function readModel() {
  let response;
  try {
    response = await api("/v1/models");
  } catch {
    return; // the status line says the server is unreachable
  }
  if (!response.ok) return; // 401 until a key is entered: read again on the next refresh
  const model = (await response.json()).data[0];
  showAdapters(model.adapters ?? []);
  showControlNets(model.controlnets ?? []);
  showVocabulary(model.vocabulary, model.adapters ?? []);
  showGuidance(model.family);
  if (model.family?.supports.edits === "by reference") editByReference();
  if (model.video) {
    showVideoDefaults(model.video);
    offerVideo({ take: !running && !$("results-empty").hidden }); // only while nothing was made yet
  }
  modelRead = true;
}

// A model guided only by true CFG (Qwen-Image: no guidance input) takes the field as true_cfg_scale,
// which works with a negative prompt.
function showGuidance(family) {
  if (!family || family.supports.guidance_scale || !family.supports.true_cfg_scale) return;
  guidanceAs = "true_cfg_scale";
  document.querySelector('label[for="guidance_scale"]').textContent = "True CFG";
  $("guidance_scale").placeholder = `${family.defaults.true_cfg_scale} with a negative prompt`;
}

// A model with a closed vocabulary (the built-in one) knows only its words: say which.
function showVocabulary(words, adapters) {
  const line = $("vocabulary");
  line.hidden = !words?.length;
  if (line.hidden) return;
  const taught = adapters.length ? `; adapters teach more (${adapters.map((a) => a.name).join(", ")})` : "";
  line.textContent = `This model knows only these words: ${words.join(", ")}${taught}.`;
}

async function readStatus() {
  let text;
  try {
    const response = await fetch("/readyz");
    const answer = await response.json();
    text = response.ok ? `Serving ${answer.model}.` : explain(null, answer.error).text;
  } catch {
    text = "Cannot reach the server.";
  }
  if ($("server-status").textContent !== text) $("server-status").textContent = text; // no re-announcing
}

function start() {
  const key = $("api-key");
  key.value = sessionStorage.getItem(KEY) || "";
  if (key.value) $("key-field").hidden = false;
  key.addEventListener("input", () => {
    if (key.value) sessionStorage.setItem(KEY, key.value);
    else sessionStorage.removeItem(KEY);
  });
  $("generate").addEventListener("submit", (event) => {
    event.preventDefault();
    if (!running) generate();
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) $("generate").requestSubmit();
  });
  $("stop").addEventListener("click", () => running?.abort());
  setupModes();
  setupControl();
  setupEdit({
    problem: (problem) => {
      clearError();
      showError(problem);
    },
  });
  setupVideo({ api, problem, explain, showError, setProgress, refused, lostServer, clearResults, keepURL: imageURL });
  setupBatches({ api, problem, showError });
  document.addEventListener("visibilitychange", refreshDevices);
  readLimits();
  readModel();
  readStatus();
  refreshDevices();
  setInterval(() => {
    if (document.hidden) return;
    if (!modelRead) readModel();
    readStatus();
    refreshDevices();
    refreshBatches();
  }, REFRESH_MS);
}

start();
