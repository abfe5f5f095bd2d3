"""The playground's video mode (issue 41), in the real headless Chromium of
tests/test_playground.py, against a real server on a tiny Wan folder (/v1/videos).

/v1/models says the model makes videos, so the page offers Video and starts in it, with the
model's default frames, their step and its clips' default size (an image's in Generate), and its
LoRA adapters (one switched on is sent with the job); fields a video job does not take (images, scheduler,
previews, format) are gone. Frames off the step, or a size the server refuses, are named on their
field; a good job shows its progress while the
page polls it, then plays the MP4 in a muted, looping <video> from a blob: URL (the content
fetched as the API serves it, byte for byte), 32×32 and a few frames long, with a download link.
A job seen running shows its percent until Stop stops watching it; a failed one, its error.
An image model's page offers no Video (tests/test_playground.py).

`DIFFSHARD_SCREENSHOT=docs/playground-video.png` saves the README's screenshot of video mode
(`make screenshot`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from tests.support.browser import (
    RECORD_REQUESTS,
    fill,
    open_page,
    until,
)
from tests.support.live import LiveServer, live_server

FRAMES, FPS = 5, 16  # the tiny job: 32×32, 5 frames (a quarter second), 2 steps
# Records, in the page, each text the progress line takes and the type and size of each blob the
# page makes a URL for (the page's CSP keeps a test script from fetching a blob: URL back).
RECORD = """
window.progress = [];
const line = document.getElementById("progress-text");
new MutationObserver(() => window.progress.push(line.textContent))
  .observe(line, {childList: true, characterData: true, subtree: true});
window.blobs = [];
const make = URL.createObjectURL;
URL.createObjectURL = (blob) => {
  const url = make(blob);
  window.blobs.push({url, type: blob.type, size: blob.size});
  return url;
};
"""
# Makes the page see each poll of a job (GET /v1/videos/{id}) as `window.fakeJob` says, once set:
# a job still running or failed on demand (the server's own jobs end in a blink, and well).
FAKE_POLLS = """
window.fakeJob = null;
const send = window.fetch;
window.fetch = async (path, init = {}) => {
  const response = await send(path, init);
  if (!window.fakeJob || !/^\\/v1\\/videos\\/[^/]+$/.test(path)) return response;
  const job = {...(await response.json()), ...window.fakeJob};
  return new Response(JSON.stringify(job), {headers: {"content-type": "application/json"}});
};
"""
MEDIA = """
const v = arguments[0];
return {src: v.src, ready: v.readyState, error: v.error && v.error.code, duration: v.duration,
        width: v.videoWidth, height: v.videoHeight, muted: v.muted, loop: v.loop, controls: v.controls};
"""


@pytest.fixture(scope="module")
def wan_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    from tests.support.lora import random_wan_lora
    from tests.support.tiny_pipelines import build_wan_folder

    # RoPE for 64 positions an axis: 832x480, WanPipeline's default clip size, is the model's too
    folder = build_wan_folder(tmp_path_factory.mktemp("wan") / "t2v", rope_max_seq_len=64)
    style = random_wan_lora(folder, tmp_path_factory.mktemp("lora") / "style.safetensors", 1)
    store = f"sqlite:///{tmp_path_factory.mktemp('jobs') / 'jobs.sqlite'}"
    args = (
        "--model",
        str(folder),
        "--job-store",
        store,
        "--video-fps",
        str(FPS),
        "--drain-timeout-s",
        "0.5",
        "--lora",
        f"style={style}",
    )
    with live_server(*args) as running:
        yield running


def test_a_video_model_is_made_in_video_mode_and_plays_in_the_page(
    browser: WebDriver, wan_server: LiveServer, tmp_path: Path
) -> None:
    browser.get_log("browser")  # drop what earlier pages logged
    open_page(browser, wan_server.url)
    until(browser, lambda b: b.find_element(By.ID, "mode-video").is_selected(), "video mode")
    assert browser.find_element(By.CSS_SELECTOR, 'label[for="mode-video"]').is_displayed()
    assert browser.find_element(By.ID, "go").text == "Make video"
    assert browser.find_element(By.ID, "num_frames").get_attribute("placeholder") == "81"  # Wan's
    for image_only in ("n", "scheduler", "partial_images", "output_format"):
        assert not browser.find_element(By.ID, image_only).is_displayed()
    size = browser.find_element(By.ID, "size")
    assert size.is_displayed() and size.get_attribute("placeholder") == "832x480"  # a clip's default
    browser.find_element(By.CSS_SELECTOR, 'label[for="mode-generate"]').click()
    assert size.get_attribute("placeholder") == "480x480"  # an image's
    browser.find_element(By.CSS_SELECTOR, 'label[for="mode-video"]').click()
    assert "default 832x480" in browser.find_element(By.ID, "size-help").text

    # 1. Frames the model cannot make (the browser knows its step), then a size it cannot (the
    # server says why): each named on its field.
    browser.execute_script(RECORD)
    fill(browser, prompt="a red circle", seed="3", size="33x32", num_frames="6", num_inference_steps="2")
    browser.find_element(By.ID, "go").click()
    error = until(browser, lambda b: (box := b.find_element(By.ID, "error")).is_displayed() and box, "error")
    assert error.text.startswith("Frames: ") and "5 and 9" in error.text, error.text
    assert browser.find_element(By.ID, "num_frames").get_attribute("aria-invalid") == "true"
    fill(browser, num_frames=str(FRAMES))
    browser.find_element(By.ID, "go").click()
    until(browser, lambda b: error.text.startswith("Size: "), "the size refused")
    assert browser.find_element(By.ID, "size").get_attribute("aria-invalid") == "true"
    browser.get_log("browser")  # drop the 400 the console logged

    # 2. A good one, with the server's adapter on: its progress, then the video.
    fill(browser, size="32x32")
    browser.find_element(By.CSS_SELECTOR, "#lora-list input[type=checkbox]").click()
    browser.execute_script(RECORD_REQUESTS)
    browser.find_element(By.ID, "go").click()
    played = browser.find_elements  # the card's <video>, once shown
    video = until(
        browser,
        lambda b: [v for v in played(By.CSS_SELECTOR, ".card video") if v.is_displayed()],
        "the video",
    )[0]

    def metadata(b: WebDriver) -> dict | None:  # HAVE_METADATA, or the reason it never comes
        media = b.execute_script(MEDIA, video)
        return media if media["ready"] >= 1 or media["error"] else None

    media = until(browser, metadata, "the video's metadata")
    assert media["error"] is None, media  # Chromium decodes the H.264
    assert media["src"].startswith("blob:") and media["muted"] and media["loop"] and media["controls"]
    assert (media["width"], media["height"]) == (32, 32)
    assert media["duration"] == pytest.approx(FRAMES / FPS, abs=0.07), media
    assert not error.is_displayed()
    progress = browser.find_element(By.ID, "progress-text")
    until(browser, lambda b: progress.text.startswith("Done: 0.25 s of video in"), "done")
    texts = browser.execute_script("return window.progress")
    assert "Waiting in line." in texts or any(t.startswith("Making the video") for t in texts), texts

    [sent] = browser.execute_script("return window.sent")
    assert sent["lora"] == {"style": 1} and sent["size"] == "32x32", sent  # (test_videos: what it does)
    [job] = httpx.get(f"{wan_server.url}/v1/videos").json()["data"]  # the one the server made
    assert (job["status"], job["size"], job["prompt"]) == ("completed", "32x32", "a red circle")
    mp4 = httpx.get(f"{wan_server.url}/v1/videos/{job['id']}/content").content
    [blob] = [b for b in browser.execute_script("return window.blobs") if b["url"] == media["src"]]
    assert (blob["type"], blob["size"]) == ("video/mp4", len(mp4))
    link = browser.find_element(By.CSS_SELECTOR, ".card .download")
    assert link.get_attribute("href") == media["src"] and link.get_attribute("download") == "diffshard-3.mp4"
    assert browser.find_element(By.CSS_SELECTOR, ".card .seed").text == "seed 3"
    assert not [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]

    wanted = os.environ.get("DIFFSHARD_SCREENSHOT")  # make screenshot: for the README
    browser.execute_script("window.scrollTo(0, 0)")  # switching the adapter on scrolled the form
    browser.save_screenshot(Path(wanted).resolve() if wanted else tmp_path / "playground-video.png")

    # 3. A job still running: its percent on the bar and the badge, until Stop stops watching it.
    browser.execute_script(FAKE_POLLS + "window.fakeJob = {status: 'in_progress', progress: 40};")
    browser.find_element(By.ID, "go").click()
    until(browser, lambda b: progress.text == "Making the video: 40%.", "the job's progress")
    assert browser.find_element(By.CSS_SELECTOR, ".card .badge").text == "40%"
    assert browser.find_element(By.ID, "progress").get_attribute("value") == "0.4"
    browser.find_element(By.ID, "stop").click()
    until(browser, lambda b: progress.text.startswith("Stopped watching: the server still makes"), "stopped")

    # 4. A job that failed: the server's words for it.
    failed = {"status": "failed", "error": {"code": "video_failed", "message": "out of memory on cpu"}}
    browser.execute_script("window.fakeJob = arguments[0];", failed)
    browser.find_element(By.ID, "go").click()
    until(browser, lambda b: error.is_displayed() and error.text == "Out of memory on cpu.", "its error")
    assert progress.text.startswith("Failed after") and browser.find_element(By.ID, "go").is_enabled()
    assert browser.find_element(By.CSS_SELECTOR, ".card .badge").text == "failed"


def test_a_video_with_sound_links_its_track_and_says_to_unmute(browser: WebDriver, tiny_folder) -> None:
    """An LTX-2 server (/v1/models: `sound`): the video plays muted as any (browsers autoplay
    only muted media), its card says it has sound, and the track as generated (the WAV the API
    serves, byte for byte) is linked beside the MP4."""
    store = f"sqlite:///{tiny_folder('ltx-2').parent / 'playground-jobs.sqlite'}"
    with live_server("--model", str(tiny_folder("ltx-2")), "--job-store", store) as server:
        browser.get_log("browser")
        open_page(browser, server.url)
        until(browser, lambda b: b.find_element(By.ID, "mode-video").is_selected(), "video mode")
        browser.execute_script(RECORD)
        fill(browser, prompt="a drum roll", seed="3", size="32x32", num_frames="9", num_inference_steps="2")
        browser.find_element(By.ID, "go").click()
        link = until(
            browser,
            lambda b: [a for a in b.find_elements(By.CSS_SELECTOR, ".card .sound") if a.is_displayed()],
            "the sound's link",
        )[0]
        [job] = httpx.get(f"{server.url}/v1/videos").json()["data"]
        wav = httpx.get(f"{server.url}/v1/videos/{job['id']}/content", params={"variant": "audio"}).content
    href = link.get_attribute("href")
    [blob] = [b for b in browser.execute_script("return window.blobs") if b["url"] == href]
    assert (blob["type"], blob["size"]) == ("audio/wav", len(wav)) and wav.startswith(b"RIFF")
    assert link.get_attribute("download") == "diffshard-3.wav"
    title = browser.find_element(By.CSS_SELECTOR, ".card .title").text
    assert title.endswith("with sound (unmute to hear it)"), title
    assert browser.execute_script("return document.querySelector('.card video').muted")
    assert not [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
