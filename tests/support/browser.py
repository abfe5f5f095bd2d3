"""The playground in a real headless Chromium, offline, and what the tests read off its pages. One
Chromium serves the session: conftest.py's `browser` (selenium is imported only when a test asks
for it: the GPU check's bundle carries no browser)."""

from __future__ import annotations

import base64
import contextlib
import io
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from tests.support.live import LiveServer

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


DEADLINE_S = 60


# Quiet and offline: no background fetches, updates, sync or first-run pages.
FLAGS = (
    "--headless=new",
    "--no-sandbox",  # the tests may run as root
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--window-size=1400,1000",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",  # no network: only the server here
)


# Records, in the page, each kind ("partial", "final") the main image of each card takes, in order.
RECORD_KINDS = """
window.kinds = [];
new MutationObserver((changes) => {
  for (const change of changes) {
    if (change.target.matches(".frame img")) {
      window.kinds.push([change.target.closest(".card").dataset.image, change.target.dataset.kind]);
    }
  }
}).observe(document.getElementById("images"), {subtree: true, attributeFilter: ["data-kind"]});
"""


# Records, in the page, the body of each request it POSTs, as sent: a generation's JSON, or an
# edit's text fields.
RECORD_REQUESTS = """
window.sent = [];
const send = window.fetch;
window.fetch = (path, init = {}) => {
  if (init.method === "POST") {
    window.sent.push(init.body instanceof FormData
      ? Object.fromEntries([...init.body].filter(([, value]) => typeof value === "string"))
      : JSON.parse(init.body));
  }
  return send(path, init);
};
"""


# The pixels an <img> shows, as RGBA bytes row by row (the page's CSP keeps scripts from fetching
# its blob: URLs, so they are read off a canvas).
IMAGE_PIXELS = """
const image = arguments[0];
const canvas = document.createElement("canvas");
[canvas.width, canvas.height] = [image.naturalWidth, image.naturalHeight];
const context = canvas.getContext("2d");
context.drawImage(image, 0, 0);
const pixels = context.getImageData(0, 0, canvas.width, canvas.height).data;
return [canvas.width, canvas.height, Array.from(pixels)];
"""


@contextlib.contextmanager
def chromium(profile: Path) -> Iterator[WebDriver]:
    """Headless Chromium, offline, with its profile in `profile`."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not shutil.which(path)]
    if missing:
        pytest.fail(f"Chromium is not installed: run `make test`, which installs it ({missing} missing)")
    os.environ["SE_OFFLINE"] = "true"  # selenium must not look for a driver or browser online
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console, CSP refusals too
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def until(browser: WebDriver, condition, what: str):
    """Wait for `condition(browser)`, polled every 100 ms, up to the deadline."""
    return WebDriverWait(browser, DEADLINE_S, poll_frequency=0.1).until(condition, f"waiting for {what}")


def open_page(browser: WebDriver, url: str) -> None:
    browser.get(f"{url}/")
    until(browser, lambda b: b.find_elements(By.CSS_SELECTOR, "#device-list li"), "the devices panel")


def fill(browser: WebDriver, **fields: str) -> None:
    for name, value in fields.items():
        field = browser.find_element(By.ID, name)
        field.clear()
        field.send_keys(value)


def final_images(browser: WebDriver, count: int) -> list:
    return until(
        browser,
        lambda b: (
            len(found := b.find_elements(By.CSS_SELECTOR, '.frame img[data-kind="final"]')) == count and found
        ),
        f"{count} final images",
    )


def shown_pixels(browser: WebDriver, image) -> np.ndarray:
    width, height, rgba = browser.execute_script(IMAGE_PIXELS, image)
    return np.array(rgba, dtype=np.uint8).reshape(height, width, 4)[..., :3]


def api_pixels(server: LiveServer, **body) -> np.ndarray:
    answer = httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=60)
    image = Image.open(io.BytesIO(base64.b64decode(answer.json()["data"][0]["b64_json"])))
    return np.asarray(image.convert("RGB"))


# Records, in the page, what each POST sends: a generation's JSON, or an edit's form with its
# files as base64 (read with SENT).
RECORD_SENT = """
window.sent = [];
const send = window.fetch;
const file = async (blob) => {
  let text = "";
  for (const byte of new Uint8Array(await blob.arrayBuffer())) text += String.fromCharCode(byte);
  return {name: blob.name, type: blob.type, b64: btoa(text)};
};
const entries = (form) => Promise.all(
  [...form.entries()].map(async ([k, v]) => [k, typeof v === "string" ? v : await file(v)]));
window.fetch = (path, init = {}) => {
  if (init.method === "POST") {
    window.sent.push(init.body instanceof FormData
      ? entries(init.body).then((form) => ({path, form}))
      : Promise.resolve({path, json: JSON.parse(init.body)}));
  }
  return send(path, init);
};
"""


SENT = "const done = arguments[arguments.length - 1]; Promise.all(window.sent).then(done);"


def sent(browser: WebDriver) -> list[dict]:
    return browser.execute_async_script(SENT)


def form_files(request: dict) -> dict[str, bytes]:
    return {k: base64.b64decode(v["b64"]) for k, v in request["form"] if isinstance(v, dict)}


def form_fields(request: dict) -> dict[str, str]:
    return {k: v for k, v in request["form"] if isinstance(v, str)}


def api_edit(server: LiveServer, request: dict) -> np.ndarray:
    """The image /v1/images/edits answers, not streamed, for the form the page sent."""
    fields = {
        k: v
        for k, v in form_fields(request).items()
        if k not in ("stream", "stream_progress", "partial_images")
    }
    files = {k: (k + ".png", data, "image/png") for k, data in form_files(request).items()}
    answer = httpx.post(f"{server.url}/v1/images/edits", data=fields, files=files, timeout=60)
    assert answer.status_code == 200, answer.text
    image = Image.open(io.BytesIO(base64.b64decode(answer.json()["data"][0]["b64_json"])))
    return np.asarray(image.convert("RGB"))
