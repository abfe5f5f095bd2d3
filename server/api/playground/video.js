// The form's video mode, for a video model's server (OpenAI's Videos API): POST /v1/videos makes
// a job, GET /v1/videos/{id} is polled until it ends (its progress on the form's bar and the
// card's badge), then the MP4 from /v1/videos/{id}/content plays in a <video>, with a download
// link (and, for a model that makes sound, its track: muted until the viewer unmutes it, as
// browsers autoplay only muted media, and the WAV linked). The job runs on the server whatever this page does: Stop (or leaving) only stops watching.

import { showDefaultSize } from "./mode.js";

const $ = (id) => document.getElementById(id);
// Polls back off gently: a short job is seen soon after it ends, a long one costs a poll a second.
const POLL_MS = { first: 250, growth: 1.5, most: 1000 };

let page = null; // what playground.js lends (setupVideo): its requests, errors, progress and results
let sound = false; // whether the model's videos have a sound track (GET /v1/models)

export function setupVideo(helpers) {
  page = helpers;
}

// The frames the model makes by default, the step they take (the browser checks it), and at how
// many a second the MP4 plays them.
export function showVideoDefaults({ num_frames: frames, frame_multiple: every, fps, size, sound: voiced }) {
  sound = Boolean(voiced);
  if (size) showDefaultSize("video", size);
  Object.assign($("num_frames"), { placeholder: String(frames), step: String(every) }); // min 1: 1, 1 + every…
  const seconds = (frames - 1) / fps;
  $("frames-help").textContent = `1 + a multiple of ${every}; default ${frames} (${seconds} s at ${fps} frames a second)`;
}

// Waits `ms`, or until `signal` aborts (then throws its AbortError).
function pause(ms, signal) {
  signal.throwIfAborted();
  return new Promise((resolve, reject) => {
    const stop = () => {
      clearTimeout(timer);
      reject(signal.reason);
    };
    const timer = setTimeout(() => {
      signal.removeEventListener("abort", stop);
      resolve();
    }, ms);
    signal.addEventListener("abort", stop, { once: true });
  });
}

function card(body) {
  const item = document.createElement("li");
  item.className = "card";
  item.innerHTML = `
    <figure>
      <div class="frame"><video controls loop autoplay muted playsinline hidden></video><span
        class="badge"></span></div>
      <figcaption>
        <span class="title">Video</span> <span class="seed"></span> <a class="download" hidden>Download</a>
        <a class="sound" hidden>Sound (WAV)</a>
      </figcaption>
    </figure>`;
  item.querySelector(".seed").textContent = `seed ${body.seed}`;
  return item;
}

// The job's state on the bar and the badge; screen readers hear its changes, not every percent.
function showJob(job, item) {
  const badge = item.querySelector(".badge");
  if (job.status === "queued") {
    badge.textContent = "queued";
    announce("Waiting in line.", "Waiting");
  } else if (job.status === "in_progress") {
    badge.textContent = `${job.progress}%`;
    announce(`Making the video: ${job.progress}%.`, "Making", job.progress / 100);
  }
}

function announce(text, state, fraction = null) {
  page.setProgress(text, fraction, { announce: !$("announce").textContent.startsWith(state) });
}

// Polls the job until it is completed or failed; its last state.
async function watch(job, item, signal) {
  let wait = POLL_MS.first;
  while (job.status === "queued" || job.status === "in_progress") {
    showJob(job, item);
    await pause(wait, signal);
    wait = Math.min(POLL_MS.most, wait * POLL_MS.growth);
    const response = await page.api(`/v1/videos/${encodeURIComponent(job.id)}`, { signal });
    if (!response.ok) throw await page.problem(response); // expired, or the server went away
    job = await response.json();
  }
  return job;
}

// The track as generated (a WAV), linked beside the MP4 whose player plays it once unmuted.
function showSound(job, blob, item, body) {
  const link = item.querySelector(".sound");
  link.href = page.keepURL(blob);
  link.download = `diffshard-${body.seed}.wav`;
  link.hidden = false;
  item.querySelector(".title").textContent += ", with sound (unmute to hear it)";
}

function show(job, blob, item, body) {
  const url = page.keepURL(blob); // revoked with the other results when the next ones come
  const video = item.querySelector("video");
  video.muted = true; // browsers autoplay muted videos only
  video.addEventListener("loadedmetadata", () => video.classList.toggle("pixelated", video.videoWidth < 256), {
    once: true,
  });
  video.src = url;
  const prompt = body.prompt.trim();
  video.setAttribute("aria-label", `${prompt.length > 100 ? `${prompt.slice(0, 99)}…` : prompt}, seed ${body.seed}`);
  video.hidden = false;
  item.querySelector(".badge").hidden = true;
  item.querySelector(".title").textContent = `Video, ${job.size}, ${job.seconds} s`;
  const link = item.querySelector(".download");
  link.href = url;
  link.download = `diffshard-${body.seed}.mp4`;
  link.hidden = false;
}

// Makes a video of the form's `body`; ends when it is shown, has failed, or Stop was pressed.
export async function makeVideo(body, signal) {
  const started = performance.now();
  const took = () => `${((performance.now() - started) / 1000).toFixed(1)} s`;
  page.setProgress("Sending…", 0, { announce: false });
  let reached = false; // whether the server answered at all
  let job = null;
  const init = { headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) };
  try {
    // 1. The job: queued, or refused (a 400 names the field).
    const response = await page.api("/v1/videos", { method: "POST", ...init, signal });
    reached = true;
    if (!response.ok) return await page.refused(response);
    job = await response.json();
    const item = card(body);
    page.clearResults(item);
    // 2. Its progress, until it ends.
    job = await watch(job, item, signal);
    if (job.status === "failed") {
      item.querySelector(".badge").textContent = "failed";
      page.showError(page.explain(null, job.error)); // its message says why
      page.setProgress(`Failed after ${took()}.`, 0);
      return;
    }
    // 3. Its MP4, with this page's key like every request.
    const content = await page.api(`/v1/videos/${encodeURIComponent(job.id)}/content`, { signal });
    if (!content.ok) throw await page.problem(content);
    show(job, await content.blob(), item, body);
    if (sound) {
      const audio = await page.api(`/v1/videos/${encodeURIComponent(job.id)}/content?variant=audio`, { signal });
      if (!audio.ok) throw await page.problem(audio);
      showSound(job, await audio.blob(), item, body);
    }
    page.setProgress(`Done: ${job.seconds} s of video in ${took()}.`, 1);
  } catch (err) {
    if (err.name === "AbortError") {
      page.setProgress(job ? `Stopped watching: the server still makes video ${job.id}.` : "Stopped.", 0);
    } else if (err.text) {
      page.showError(err); // an answer in words (page.problem)
      page.setProgress(`Not finished after ${took()}.`, 0);
    } else {
      page.lostServer(err, reached);
    }
  }
}
