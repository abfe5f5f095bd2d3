// The form's modes: Generate, Edit and, when the server serves a video model, Video. A part of
// the page marked data-modes="…" shows only in the modes it lists; in the others its fields are
// switched off, so the browser neither checks them nor does the page send them.

const $ = (id) => document.getElementById(id);
const TITLES = { generate: "Generate", edit: "Edit an image", video: "Make a video" };
const BUTTONS = { generate: "Generate", edit: "Edit", video: "Make video" };

export const mode = () => document.querySelector('#generate [name="mode"]:checked').value;

export function setMode(name) {
  $(`mode-${name}`).checked = true;
  for (const part of document.querySelectorAll("[data-modes]")) {
    const on = part.dataset.modes.split(" ").includes(name);
    part.classList.toggle("off-mode", !on); // a class, not `hidden`: the LoRA section has its own
    const fields = part.matches("fieldset") ? [part] : part.querySelectorAll("input, select, textarea");
    for (const field of fields) field.disabled = !on;
  }
  showSize();
  $("go").textContent = BUTTONS[name];
  $("form-title").textContent = TITLES[name];
}

// A video model's server: the Video mode is offered, and with `take` chosen if the form is still
// in its first mode (a model that makes videos is served to make them; its one-frame images stay
// a click away).
export function offerVideo({ take }) {
  for (const part of [$("mode-video"), document.querySelector('label[for="mode-video"]')]) part.hidden = false;
  $("mode-video").disabled = false;
  if (take && mode() === "generate") setMode("video");
}

export function setupModes() {
  for (const radio of document.querySelectorAll('#generate [name="mode"]')) {
    radio.addEventListener("change", () => setMode(radio.value));
  }
  // A reload may keep the radio's state; Video only once the server says it serves videos.
  setMode($("mode-video").hidden && mode() === "video" ? "generate" : mode());
}

// The size a request that names none gets, per mode: a video model's clips have their own.
const defaultSizes = {};

export function showDefaultSize(forMode, size) {
  defaultSizes[forMode] = size;
  showSize();
}

function showSize() {
  const size = defaultSizes[mode()] ?? defaultSizes.generate;
  if (!size) return;
  $("size").placeholder = size;
  $("size-help").textContent = `width×height; default ${size}`;
}
