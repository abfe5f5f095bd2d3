"""The playground at `/` and the API reference at `/docs`, in a real browser: Debian's Chromium,
headless, driven by selenium through Debian's chromedriver (`make test` installs both; nothing is
downloaded at test time), which resolves no host name: only this server can answer it.

Type "a red circle", press Generate: a partial preview appears, then the image, which the
built-in model's own judge (server/demo/evaluate.py) calls a red circle and which is the very
image the API returns for that seed; the devices panel lists /v1/shards' devices and workers (and
no Video mode: that is a video model's, tests/test_playground_video.py). The
step caches the OpenAPI document lists for the model are offered, the one chosen sent with a
generation and an edit. Also: the key field and errors in plain words on a server with keys, Stop
cancelling the request, and a server's LoRA adapters listed with a scale slider each, the one
switched on sent with the request.

The API reference is Swagger UI, offline and under the playground's policy: it lists the
operations of /openapi.json with no error in the browser's console.

`DIFFSHARD_SCREENSHOT=docs/playground.png` saves the README's screenshot (`make screenshot`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.expected_conditions import staleness_of
from selenium.webdriver.support.ui import Select

from server.api import docs
from server.api.playground import FILES, HEADERS
from server.demo import MODEL_DIR
from server.demo.evaluate import Verdict, classify
from tests.support.browser import (
    RECORD_KINDS,
    RECORD_REQUESTS,
    api_pixels,
    fill,
    final_images,
    open_page,
    shown_pixels,
    until,
)
from tests.support.live import LiveServer, live_server
from tests.support.lora import RANK, random_lora


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The built-in model with one random adapter, `style`."""
    path = random_lora(MODEL_DIR, tmp_path_factory.mktemp("lora") / "style.safetensors", 7, "sd15")
    with live_server("--lora", f"style={path}") as running:
        yield running


def test_the_page_and_its_files_come_from_this_server_alone(server: LiveServer) -> None:
    page = httpx.get(f"{server.url}/")
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    policy = page.headers["content-security-policy"]
    assert {"default-src 'none'", "script-src 'self'", "connect-src 'self'"} <= set(policy.split("; "))
    texts = [page.text]
    for name, kind in FILES.items():
        asset = httpx.get(f"{server.url}/playground/{name}")
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind)
        texts.append(asset.text)
    assert not [t for t in texts if "http://" in t or "https://" in t]  # no CDN: it works offline
    for other in ("index.html", "playground.py", ".env"):  # only the files it names
        missing = httpx.get(f"{server.url}/playground/{other}")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_a_red_circle_streams_its_previews_then_the_image(
    browser: WebDriver, server: LiveServer, tmp_path: Path
) -> None:
    open_page(browser, server.url)
    browser.execute_script(RECORD_KINDS)
    fill(browser, prompt="a red circle", seed="7")
    browser.find_element(By.ID, "go").click()
    [image] = final_images(browser, 1)

    kinds = browser.execute_script("return window.kinds")
    assert kinds[0] == ["0", "partial"] and kinds[-1] == ["0", "final"], kinds  # a preview came first
    assert len(browser.find_elements(By.CSS_SELECTOR, ".strip img")) == 3  # the default: 3 previews
    progress = browser.find_element(By.ID, "progress-text")
    until(browser, lambda b: progress.text.startswith("Done: 1 image in"), "the stream's end")
    assert browser.find_element(By.CSS_SELECTOR, ".card .seed").text == "seed 7"
    assert browser.find_element(By.CSS_SELECTOR, ".card .download").get_attribute("download") == (
        "diffshard-7.png"
    )

    shown = shown_pixels(browser, image)
    assert classify(shown) == Verdict("red", "circle")
    plain = api_pixels(server, prompt="a red circle", seed=7)
    np.testing.assert_array_equal(shown, plain)  # the API's image, as is
    adapters = browser.find_elements(By.CSS_SELECTOR, "#lora-list li")  # make run's: the diamond
    assert browser.find_element(By.ID, "lora").is_displayed() and len(adapters) == 1
    assert "diamond" in adapters[0].text
    vocabulary = browser.find_element(By.ID, "vocabulary").text  # the built-in model's words
    assert "red, green, blue" in vocabulary and "circle, square, triangle" in vocabulary
    assert not browser.find_element(By.CSS_SELECTOR, 'label[for="mode-video"]').is_displayed()  # images only

    shards = httpx.get(f"{server.url}/v1/shards").json()
    listed = browser.find_elements(By.CSS_SELECTOR, "#device-list li")
    assert [item.get_attribute("data-device") for item in listed] == list(shards["devices"])
    assert all("weights" in item.text for item in listed)
    workers = browser.find_elements(By.CSS_SELECTOR, "#worker-list li span:first-child")
    assert [worker.text for worker in workers] == list(shards["parallel"]["busy_seconds"])

    wanted = os.environ.get("DIFFSHARD_SCREENSHOT")  # make screenshot: for the README
    browser.save_screenshot(Path(wanted).resolve() if wanted else tmp_path / "playground.png")

    # The step caches the OpenAPI document lists for the model; one chosen is sent, generating
    # and editing alike, and the server reuses deep features for it.
    step_cache = Select(browser.find_element(By.ID, "step_cache"))
    assert [o.get_attribute("value") for o in step_cache.options] == ["", "off", "deep"]
    assert step_cache.first_selected_option.text == "server default: off"  # sends nothing
    browser.execute_script(RECORD_REQUESTS)
    step_cache.select_by_value("deep")
    fill(browser, num_inference_steps="4")
    for press in ("#go", ".card .edit-this"):  # generate, then edit that image (in edit mode)
        reused = server.stats()["engine"]["step_cache_rows"]["reused"]
        browser.find_element(By.CSS_SELECTOR, press).click()
        if press != "#go":
            browser.find_element(By.ID, "go").click()  # Edit
        until(browser, staleness_of(image), "the next card")
        [image] = final_images(browser, 1)
        server.wait_for(lambda s, before=reused: s["engine"]["step_cache_rows"]["reused"] > before)
    generated, edited = browser.execute_script("return window.sent")
    assert generated["step_cache"] == "deep" and generated["num_inference_steps"] == 4
    assert edited["step_cache"] == "deep" and "strength" in edited  # a form field, as text


def test_stop_cancels_the_request_on_the_server(browser: WebDriver, server: LiveServer) -> None:
    open_page(browser, server.url)
    before = server.stats()["engine"]["rejected"].get("cancelled", 0)
    fill(browser, prompt="a blue square", num_inference_steps="100", n="4")
    browser.find_element(By.ID, "go").click()
    until(browser, lambda b: b.find_elements(By.CSS_SELECTOR, ".strip img"), "a first preview")
    browser.find_element(By.ID, "stop").click()
    until(browser, lambda b: b.find_element(By.ID, "progress-text").text.startswith("Stopped"), "stopped")
    server.wait_for(lambda s: s["engine"]["rejected"].get("cancelled", 0) == before + 1)
    assert browser.find_element(By.ID, "go").is_enabled()


def test_keys_and_errors_in_plain_words(browser: WebDriver, keyed_server: LiveServer) -> None:
    assert httpx.get(f"{keyed_server.url}/").status_code == 200  # the page holds nothing to guard
    assert httpx.get(f"{keyed_server.url}/v1/shards").status_code == 401
    browser.get(f"{keyed_server.url}/")  # the page is public; /v1 asks for the key
    key = browser.find_element(By.ID, "api-key")
    until(browser, lambda b: key.is_displayed(), "the key field")
    fill(browser, prompt="a red circle", seed="1")
    browser.find_element(By.ID, "go").click()
    error = until(browser, lambda b: (box := b.find_element(By.ID, "error")).is_displayed() and box, "error")
    assert error.text == (
        "Missing API key: send the header Authorization: Bearer <key>. Enter a valid API key above."
    )

    key.send_keys("sk-first")
    fill(browser, size="4096x4096")  # the form's pattern allows it; the server's pixel limit does not
    browser.find_element(By.ID, "go").click()
    until(browser, lambda b: error.text.startswith("Size: 4096x4096 is"), "the size refused")
    assert error.text.endswith("the limit is 16384 (DIFFSHARD_MAX_PIXELS).")
    assert browser.find_element(By.ID, "size").get_attribute("aria-invalid") == "true"
    assert browser.switch_to.active_element == browser.find_element(By.ID, "size")

    fill(browser, size="64x64", num_inference_steps="1000")  # over the maximum the OpenAPI document states
    browser.find_element(By.ID, "go").click()
    until(browser, lambda b: error.text.startswith("Steps: "), "the steps refused")

    fill(browser, num_inference_steps="10")
    browser.find_element(By.ID, "go").click()
    final_images(browser, 1)
    assert not browser.find_element(By.ID, "error").is_displayed()
    assert browser.execute_script("return sessionStorage.getItem('diffshard.apiKey')") == "sk-first"
    assert browser.execute_script("return localStorage.length") == 0  # the key stays in this tab


def test_adapters_are_listed_with_a_scale_each_and_those_switched_on_are_sent(
    browser: WebDriver, lora_server: LiveServer
) -> None:
    browser.get_log("browser")  # drop what earlier pages logged
    open_page(browser, lora_server.url)
    section = until(browser, lambda b: (s := b.find_element(By.ID, "lora")).is_displayed() and s, "adapters")
    [row] = section.find_elements(By.CSS_SELECTOR, "#lora-list li")
    switch = row.find_element(By.CSS_SELECTOR, "input[type=checkbox]")
    slider = row.find_element(By.CSS_SELECTOR, "input[type=range]")
    scale = row.find_element(By.TAG_NAME, "output")
    assert row.find_element(By.CSS_SELECTOR, f'label[for="{switch.get_attribute("id")}"]').text == (
        f"style rank {RANK}"
    )
    label = row.find_element(By.CSS_SELECTOR, f'label[for="{slider.get_attribute("id")}"]')
    assert label.get_attribute("textContent") == "Scale of style"  # for screen readers
    assert [slider.get_attribute(a) for a in ("min", "max", "step", "value")] == ["-4", "4", "0.05", "1"]
    assert not switch.is_selected() and not slider.is_enabled() and scale.text == "1.00"  # off at first

    browser.execute_script(RECORD_REQUESTS)
    fill(browser, prompt="a red circle", seed="5", num_inference_steps="6")
    browser.find_element(By.ID, "go").click()
    [plain] = final_images(browser, 1)
    plain_pixels = shown_pixels(browser, plain)

    switch.click()
    assert slider.is_enabled()
    slider.send_keys(Keys.ARROW_RIGHT * 10)  # ten steps of 0.05
    assert scale.text == "1.50"
    browser.find_element(By.ID, "go").click()
    until(browser, staleness_of(plain), "the next generation's cards")
    [styled] = final_images(browser, 1)
    styled_pixels = shown_pixels(browser, styled)

    first, second = browser.execute_script("return window.sent")
    assert "lora" not in first and second["lora"] == {"style": 1.5}  # nothing when none is on
    assert {k: v for k, v in second.items() if k != "lora"} == first
    assert not np.array_equal(styled_pixels, plain_pixels)  # the adapter changed the image
    body = {"prompt": "a red circle", "seed": 5, "num_inference_steps": 6}
    np.testing.assert_array_equal(styled_pixels, api_pixels(lora_server, **body, lora={"style": 1.5}))
    np.testing.assert_array_equal(plain_pixels, api_pixels(lora_server, **body))
    assert not [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]


def test_the_api_reference_and_its_files_come_from_this_server_alone(server: LiveServer) -> None:
    page = httpx.get(f"{server.url}/docs")
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert page.headers["content-security-policy"] == HEADERS["content-security-policy"]
    assert "http://" not in page.text and "https://" not in page.text
    for name, kind in {**docs.OURS, **docs.VENDORED}.items():
        asset = httpx.get(f"{server.url}/docs/{name}")
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind)
        assert asset.headers["content-security-policy"] == HEADERS["content-security-policy"]
    for other in ("index.html", "redoc.standalone.js", "favicon.png", "docs.py"):  # only the files it names
        missing = httpx.get(f"{server.url}/docs/{other}")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert httpx.get(f"{server.url}/redoc").status_code == 404  # ReDoc cannot run under the policy


def test_the_api_reference_renders_offline(browser: WebDriver, server: LiveServer) -> None:
    browser.get_log("browser")  # drop what earlier pages logged
    browser.get(f"{server.url}/docs")
    found = until(
        browser, lambda b: b.find_elements(By.CSS_SELECTOR, ".opblock-summary-path"), "the operations"
    )
    paths = {element.get_attribute("data-path") for element in found}
    assert {"/v1/images/generations", "/v1/models", "/v1/shards", "/v1/stats", "/livez", "/readyz"} <= paths

    generate = browser.find_element(By.CSS_SELECTOR, '.opblock-post [data-path="/v1/images/generations"]')
    generate.click()  # Swagger UI is live, not a picture: the operation opens, with its body's schema
    until(browser, lambda b: b.find_elements(By.CSS_SELECTOR, ".opblock-post .try-out"), "the operation")
    assert "num_inference_steps" in browser.find_element(By.CSS_SELECTOR, ".opblock-post .opblock-body").text

    errors = [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
    assert not errors  # a CSP refusal or a missing file would be here
    loaded = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert loaded and all(url.startswith(f"{server.url}/") for url in loaded), loaded


def test_a_flux_model_streams_in_the_page_as_the_others_do(browser: WebDriver, flux_folder: Path) -> None:
    """FLUX.1 (issue 25): the page needs nothing family-specific; a tiny dev-shaped folder."""
    folder = flux_folder
    with live_server("--model", str(folder)) as flux:
        open_page(browser, flux.url)
        fill(browser, prompt="a red circle", seed="7", size="32x32", num_inference_steps="4")
        browser.find_element(By.ID, "go").click()
        [image] = final_images(browser, 1)
        assert len(browser.find_elements(By.CSS_SELECTOR, ".strip img")) == 3  # its previews
        cache = browser.find_element(By.ID, "step_cache")  # FLUX.1 takes first_block (issue 38)
        assert cache.is_displayed()
        assert "first_block" in [o.get_attribute("value") for o in cache.find_elements(By.TAG_NAME, "option")]
        shown = shown_pixels(browser, image)
        plain = api_pixels(flux, prompt="a red circle", seed=7, size="32x32", num_inference_steps=4)
    np.testing.assert_array_equal(shown, plain)
