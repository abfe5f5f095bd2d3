// The form's LoRA adapters: one row per adapter GET /v1/models lists (the server loads them at
// startup), each with a switch and a scale; a request carries {name: scale} for those switched on.

// The server's bounds (MAX_LORA_SCALE in server/api/schemas.py); a new row starts at 1.
const SCALE = { min: -4, max: 4, step: 0.05, value: 1 };

const $ = (id) => document.getElementById(id);

function row(adapter, index) {
  const item = document.createElement("li");
  item.dataset.adapter = adapter.name;
  item.innerHTML = `
    <input type="checkbox" id="lora-on-${index}">
    <label for="lora-on-${index}"><span class="name"></span> <span class="rank"></span></label>
    <output for="lora-scale-${index}"></output>
    <label for="lora-scale-${index}" class="visually-hidden"></label>
    <input type="range" id="lora-scale-${index}" disabled>`;
  // Names come from the server's command line: text, never markup.
  item.querySelector(".name").textContent = adapter.name;
  item.querySelector(".rank").textContent = `rank ${adapter.rank}`;
  item.querySelector("label.visually-hidden").textContent = `Scale of ${adapter.name}`;
  const [on, scale, shown] = ["[type=checkbox]", "[type=range]", "output"].map((s) => item.querySelector(s));
  Object.assign(scale, SCALE);
  const update = () => {
    scale.disabled = !on.checked; // off: the scale waits, and nothing is sent
    shown.value = scale.valueAsNumber.toFixed(2);
  };
  on.addEventListener("change", update);
  scale.addEventListener("input", update);
  update();
  return item;
}

// Shows the section with a row per adapter; stays hidden when the server has none.
export function showAdapters(adapters) {
  $("lora-list").replaceChildren(...adapters.map(row));
  $("lora").hidden = adapters.length === 0;
}

// {name: scale} of the adapters switched on, or null when none is.
export function chosenAdapters() {
  const chosen = {};
  for (const item of $("lora-list").children) {
    if (item.querySelector("[type=checkbox]").checked) {
      chosen[item.dataset.adapter] = item.querySelector("[type=range]").valueAsNumber;
    }
  }
  return Object.keys(chosen).length ? chosen : null;
}
