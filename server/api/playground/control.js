// The form's ControlNet: one of those GET /v1/models lists (the server loads them at startup),
// a control image read from a file (edges, a depth map, a pose), and its scale; a generation or
// an edit carries it as `control`, and its cards show the control image beside the result.

const $ = (id) => document.getElementById(id);
let image = null; // the chosen file as a data URL, read once when it is chosen

// Shows the section with the served ControlNets; stays hidden when the server has none.
export function showControlNets(controlnets) {
  const options = controlnets.map((net) => {
    const option = document.createElement("option");
    option.value = option.textContent = net.name; // names come from the command line: text
    return option;
  });
  const off = document.createElement("option");
  off.value = "";
  off.textContent = "off";
  $("control-model").replaceChildren(off, ...options);
  $("control").hidden = controlnets.length === 0;
}

export function setupControl() {
  const scale = $("control-scale");
  const shown = () => ($("control-scale-shown").value = scale.valueAsNumber.toFixed(2));
  scale.addEventListener("input", shown);
  shown();
  $("control-image").addEventListener("change", () => {
    const [file] = $("control-image").files;
    image = null;
    $("control-preview").hidden = true;
    if (!file) return;
    const reader = new FileReader();
    reader.onload = () => {
      image = reader.result;
      $("control-preview").src = image;
      $("control-preview").hidden = false;
    };
    reader.readAsDataURL(file);
  });
}

// A problem to show before sending (a ControlNet chosen without an image), or null.
export function controlProblem() {
  if ($("control").hidden || !$("control-model").value || image) return null;
  return { text: "Choose a control image for the ControlNet, or switch it off.", param: "control" };
}

// The request's `control` list, or null when none is chosen.
export function chosenControl() {
  if ($("control").hidden || !$("control-model").value || !image) return null;
  return [{ model: $("control-model").value, image, scale: $("control-scale").valueAsNumber }];
}

// The control image beside a card's result, when its request carried one.
export function addControlImage(item, body) {
  if (!body.control) return;
  const figure = document.createElement("figure");
  figure.className = "control-image";
  figure.innerHTML = `<img alt=""><figcaption></figcaption>`;
  figure.querySelector("img").src = body.control[0].image;
  figure.querySelector("img").alt = `Control image (${body.control[0].model})`;
  figure.querySelector("figcaption").textContent = `Control: ${body.control[0].model} at ${body.control[0].scale.toFixed(2)}`;
  item.querySelector("figure").after(figure);
}
