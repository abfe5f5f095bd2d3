// The Batches panel: this key's batches (GET /v1/batches) with their progress, refreshed with the
// rest of the page while any is unfinished; a finished one's output and error files downloaded
// with the page's key (a plain link could not send it), an unfinished one cancelled.

const $ = (id) => document.getElementById(id);
const UNFINISHED = new Set(["validating", "in_progress", "finalizing", "cancelling"]);
const SHOWN = 10; // the newest batches listed

let page = null; // what playground.js lends (setupBatches): its requests and error wording
let idle = false; // no batch unfinished at the last look: look again only when asked or seen again

export function setupBatches(helpers) {
  page = helpers;
  $("batches-refresh").addEventListener("click", () => refreshBatches(true));
  refreshBatches(true);
}

// Read the list again; `asked`: even when nothing was running at the last look.
export async function refreshBatches(asked = false) {
  if (!page || (idle && !asked)) return;
  let response;
  try {
    response = await page.api(`/v1/batches?limit=${SHOWN}`);
  } catch {
    return; // the server is away: the status line says so
  }
  const list = $("batch-list");
  if (!response.ok) {
    $("batches-empty").textContent = (await page.problem(response)).text;
    $("batches-empty").hidden = false;
    list.replaceChildren();
    return;
  }
  const batches = (await response.json()).data;
  idle = !batches.some((batch) => UNFINISHED.has(batch.status));
  $("batches-empty").textContent = "No batches yet: send one with the Batch API (docs/api.md).";
  $("batches-empty").hidden = batches.length > 0;
  list.replaceChildren(...batches.map(item));
}

function item(batch) {
  const { total, completed, failed } = batch.request_counts;
  const entry = document.createElement("li");
  const title = document.createElement("p");
  title.className = "batch-title";
  title.textContent = `${batch.id.slice(0, 18)}… ${batch.status}`;
  const bar = document.createElement("progress");
  Object.assign(bar, { max: Math.max(total, 1), value: completed + failed });
  bar.setAttribute("aria-label", `${batch.id}: ${completed + failed} of ${total} requests done`);
  const counts = document.createElement("p");
  counts.className = "help";
  counts.textContent = `${completed} completed, ${failed} failed, of ${total} (${batch.endpoint})`;
  entry.append(title, bar, counts);
  const actions = document.createElement("p");
  if (batch.output_file_id) actions.append(download(batch.output_file_id, "Output"));
  if (batch.error_file_id) actions.append(" ", download(batch.error_file_id, "Errors"));
  if (UNFINISHED.has(batch.status) && batch.status !== "cancelling") actions.append(cancel(batch.id));
  if (actions.childNodes.length) entry.append(actions);
  return entry;
}

function download(fileId, label) {
  const button = document.createElement("button");
  Object.assign(button, { type: "button", textContent: label });
  button.addEventListener("click", async () => {
    const response = await page.api(`/v1/files/${fileId}/content`);
    if (!response.ok) return page.showError(await page.problem(response));
    const link = document.createElement("a");
    Object.assign(link, { href: URL.createObjectURL(await response.blob()), download: `${fileId}.jsonl` });
    link.click();
    setTimeout(() => URL.revokeObjectURL(link.href), 60_000);
  });
  return button;
}

function cancel(batchId) {
  const button = document.createElement("button");
  Object.assign(button, { type: "button", textContent: "Cancel" });
  button.addEventListener("click", async () => {
    const response = await page.api(`/v1/batches/${batchId}/cancel`, { method: "POST" });
    if (!response.ok) page.showError(await page.problem(response));
    refreshBatches(true);
  });
  return button;
}
