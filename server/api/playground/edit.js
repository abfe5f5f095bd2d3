// The form's edit mode (POST /v1/images/edits): a source image, from this session's images or
// uploaded, and a mask painted over it on a canvas at the image's own pixel size. Painted pixels
// are sent transparent (alpha 0: repaint them), all others opaque; nothing painted sends no mask,
// so the whole image is reworked as far as the strength says (img2img). A model that edits by
// reference gets the image alone (`editByReference`).

import { mode, setMode } from "./mode.js";

const $ = (id) => document.getElementById(id);
const KEEP = 12; // sources listed at most; the oldest one not chosen goes first
const TINT = [255, 0, 170, 255]; // painted pixels on the canvas (drawn at partial opacity by CSS)
const CLEAR = [0, 0, 0, 0];
// The fields /v1/images/edits takes, until its OpenAPI document says (readEditFields).
let fields = new Set([
  "image", "mask", "prompt", "n", "size", "stream", "partial_images", "strength", "seed",
  "num_inference_steps", "guidance_scale", "negative_prompt", "scheduler", "lora", "step_cache",
]);

const sources = new Map(); // id → {blob, url, description}
let nextId = 0;
let chosen = null; // {id, width, height, painted: Uint8Array (1 = repaint), pixels: ImageData}
let stroke = null; // the pointer's last point while painting
let onProblem = () => {};
let byReference = false; // the model edits by reference (FLUX.1 Kontext, FLUX.3, Qwen-Image 2.1): no mask

export const editing = () => mode() === "edit";

// A model that edits by reference takes the image beside the prompt: no mask to paint, no
// strength, and its own output size (the Size field, empty: the model's rule), not the image's.
export function editByReference() {
  if (byReference) return;
  byReference = true;
  for (const part of [$("mask"), document.querySelector("#edit .brush"), $("strength").closest(".field")]) {
    part.hidden = true;
  }
  $("edit-help").textContent =
    "This model edits by reference: it reads the image beside your prompt (say what to change); no mask.";
  const size = $("size").closest(".field");
  size.dataset.modes = `${size.dataset.modes} edit`;
  setMode(mode());
}

// The fields the server's OpenAPI document lists for /v1/images/edits' multipart body.
export function readEditFields(openapi) {
  let schema = openapi.paths?.["/v1/images/edits"]?.post?.requestBody?.content?.["multipart/form-data"]?.schema;
  if (schema?.$ref) schema = openapi.components.schemas[schema.$ref.split("/").pop()];
  if (schema?.properties) fields = new Set(Object.keys(schema.properties));
}

// Lists an image as a source to edit; its id, for editSource.
export function addSource(blob, description) {
  const id = String(nextId++);
  sources.set(id, { blob, url: URL.createObjectURL(blob), description });
  const item = document.createElement("li");
  item.dataset.source = id;
  item.innerHTML = `<input type="radio" name="source" class="visually-hidden" id="source-${id}" value="${id}">
    <label for="source-${id}"><img alt=""></label>`;
  const img = item.querySelector("img");
  img.onload = () => img.classList.toggle("pixelated", img.naturalWidth < 256);
  img.src = sources.get(id).url;
  img.alt = description; // the prompt and seed, or the file's name: text, never markup
  item.querySelector("input").addEventListener("change", () => choose(id));
  $("source-list").prepend(item);
  $("sources-empty").hidden = true;
  const listed = [...$("source-list").children];
  for (const old of listed.slice(KEEP).filter((li) => li.dataset.source !== chosen?.id)) {
    URL.revokeObjectURL(sources.get(old.dataset.source).url);
    sources.delete(old.dataset.source);
    old.remove();
  }
  return id;
}

// "Edit" on an image: edit mode, with that image as the source.
export function editSource(id) {
  if (!sources.has(id)) return;
  setMode("edit");
  $(`source-${id}`).checked = true;
  $(`source-${id}`).focus();
  choose(id);
}

async function choose(id) {
  const { url } = sources.get(id);
  const img = $("edit-source");
  img.src = url;
  try {
    await img.decode();
  } catch {
    return; // another source was chosen meanwhile
  }
  if (img.src !== url) return;
  const [width, height] = [img.naturalWidth, img.naturalHeight];
  img.classList.toggle("pixelated", width < 256);
  const canvas = $("mask");
  [canvas.width, canvas.height] = [width, height];
  const pixels = canvas.getContext("2d").createImageData(width, height);
  chosen = { id, width, height, painted: new Uint8Array(width * height), pixels };
  const brush = $("brush");
  brush.max = Math.max(8, Math.round(Math.max(width, height) / 4));
  brush.value = Math.max(1, Math.round(Math.max(width, height) / 8));
  showBrush();
  $("canvas-frame").hidden = false;
  $("edit-size").textContent = `${width}×${height} pixels.`;
  draw();
}

async function upload(file) {
  const url = URL.createObjectURL(file);
  try {
    await Object.assign(new Image(), { src: url }).decode();
  } catch {
    return onProblem({
      text: `${file.name} is not an image this browser can read: choose a PNG, JPEG or WebP file.`,
      param: "image",
    });
  } finally {
    URL.revokeObjectURL(url);
  }
  editSource(addSource(file, `Uploaded: ${file.name}`));
}

// Painting: each pointer move paints the pixels whose centres lie within the brush's radius of
// the segment from the last point, in image pixels, however large the canvas is shown.

function point(event) {
  const box = $("mask").getBoundingClientRect();
  return {
    x: ((event.clientX - box.left) / box.width) * chosen.width,
    y: ((event.clientY - box.top) / box.height) * chosen.height,
  };
}

function paint(a, b) {
  const { width, height, painted } = chosen;
  const radius = Math.max($("brush").valueAsNumber / 2, Math.SQRT1_2);
  const [dx, dy] = [b.x - a.x, b.y - a.y];
  const length2 = dx * dx + dy * dy;
  const x0 = Math.max(0, Math.floor(Math.min(a.x, b.x) - radius));
  const x1 = Math.min(width - 1, Math.ceil(Math.max(a.x, b.x) + radius));
  const y0 = Math.max(0, Math.floor(Math.min(a.y, b.y) - radius));
  const y1 = Math.min(height - 1, Math.ceil(Math.max(a.y, b.y) + radius));
  for (let y = y0; y <= y1; y++) {
    for (let x = x0; x <= x1; x++) {
      const [px, py] = [x + 0.5 - a.x, y + 0.5 - a.y];
      const t = length2 ? Math.min(1, Math.max(0, (px * dx + py * dy) / length2)) : 0;
      if ((px - t * dx) ** 2 + (py - t * dy) ** 2 <= radius * radius) painted[y * width + x] = 1;
    }
  }
  if (x1 >= x0 && y1 >= y0) draw(x0, y0, x1 - x0 + 1, y1 - y0 + 1);
}

function draw(x = 0, y = 0, w = chosen.width, h = chosen.height) {
  const { width, painted, pixels } = chosen;
  for (let row = y; row < y + h; row++) {
    for (let i = row * width + x; i < row * width + x + w; i++) {
      pixels.data.set(painted[i] ? TINT : CLEAR, 4 * i);
    }
  }
  $("mask").getContext("2d").putImageData(pixels, 0, 0, x, y, w, h);
  if (!stroke) describeMask();
}

function describeMask() {
  if (byReference) return;
  const count = chosen.painted.reduce((sum, p) => sum + p, 0);
  const share = (100 * count) / chosen.painted.length;
  $("mask-status").textContent = count
    ? `${share < 1 ? "under 1" : Math.round(share)}% painted: only that region is repainted.`
    : "Nothing painted: the whole image is reworked, as far as the strength says.";
}

function showBrush() {
  $("brush-value").value = `${$("brush").value} px`;
}

function maskBlob() {
  const { width, height, painted } = chosen;
  const canvas = Object.assign(document.createElement("canvas"), { width, height });
  const context = canvas.getContext("2d");
  const mask = context.createImageData(width, height); // transparent black
  painted.forEach((p, i) => {
    if (!p) mask.data[4 * i + 3] = 255; // kept: opaque
  });
  context.putImageData(mask, 0, 0);
  return new Promise((resolve) => canvas.toBlob(resolve, "image/png"));
}

// The multipart body of an edit from the form's fields (those /v1/images/edits takes): {form},
// or {problem} when there is no image to edit.
export async function editForm(body) {
  if (!chosen) return { problem: { text: "Choose an image to edit: make one here, or upload one.", param: "image" } };
  const { blob } = sources.get(chosen.id);
  const form = new FormData();
  form.append("image", blob, blob.name || `image.${blob.type.split("/")[1] || "png"}`);
  if (!byReference && chosen.painted.includes(1)) form.append("mask", await maskBlob(), "mask.png");
  // the image's own size and the strength; by reference, the Size field's (in body), if any
  const more = byReference
    ? {}
    : { size: `${chosen.width}x${chosen.height}`, strength: $("strength").valueAsNumber };
  for (const [name, value] of Object.entries({ ...body, ...more })) {
    if (fields.has(name)) form.append(name, typeof value === "object" ? JSON.stringify(value) : String(value));
  }
  return { form };
}

export function setupEdit({ problem }) {
  onProblem = problem;
  $("upload").addEventListener("change", (event) => {
    const [file] = event.target.files;
    event.target.value = ""; // the same file again is a new upload
    if (file) upload(file);
  });
  const canvas = $("mask");
  canvas.addEventListener("pointerdown", (event) => {
    if (!chosen || event.button !== 0) return;
    canvas.setPointerCapture(event.pointerId);
    stroke = point(event);
    paint(stroke, stroke);
  });
  canvas.addEventListener("pointermove", (event) => {
    if (!stroke) return;
    const next = point(event);
    paint(stroke, next);
    stroke = next;
  });
  for (const end of ["pointerup", "pointercancel"]) {
    canvas.addEventListener(end, () => {
      stroke = null;
      if (chosen) describeMask();
    });
  }
  $("clear-mask").addEventListener("click", () => {
    if (!chosen) return;
    chosen.painted.fill(0);
    draw();
  });
  $("invert-mask").addEventListener("click", () => {
    if (!chosen) return;
    chosen.painted.forEach((p, i) => (chosen.painted[i] = 1 - p));
    draw();
  });
  $("brush").addEventListener("input", showBrush);
  const strength = () => ($("strength-value").value = $("strength").valueAsNumber.toFixed(2));
  $("strength").addEventListener("input", strength);
  strength();
}
