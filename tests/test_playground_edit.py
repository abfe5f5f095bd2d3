"""The playground's edit mode (POST /v1/images/edits), in the real headless Chromium of
tests/test_playground.py, against a real server on the built-in model.

Generate "a red circle", press Edit on it: edit mode lists it as the image to edit and shows it
under a canvas. A stroke painted there is sent as the mask, a PNG of the image's own size
(64×64, however large the canvas is shown) transparent exactly where the page painted; the edit
streams its previews, then the image the API returns for that very form. Invert sends the
other pixels, Clear sends no mask at all (img2img); an uploaded file is an image to edit too,
and an upload the browser cannot read, or the server refuses, is explained in words.

`DIFFSHARD_SCREENSHOT=docs/playground-edit.png` saves the README's screenshot of edit mode
(`make screenshot`).
"""

from __future__ import annotations

import base64
import io
import os
from itertools import pairwise
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.expected_conditions import staleness_of

from tests.support.browser import (
    RECORD_KINDS,
    RECORD_SENT,
    api_edit,
    fill,
    final_images,
    form_fields,
    form_files,
    open_page,
    sent,
    shown_pixels,
    until,
)
from tests.support.live import LiveServer, live_server

SIDE = 64  # the built-in model's images
BRUSH = 8  # the page's first brush for them: an eighth of the side, in image pixels
# The painted pixels the mask canvas holds, 1 where painted, row by row.
PAINTED = """
const canvas = arguments[0];
const pixels = canvas.getContext("2d").getImageData(0, 0, canvas.width, canvas.height).data;
return [canvas.width, canvas.height, Array.from(pixels.filter((_, i) => i % 4 === 3), (a) => a ? 1 : 0)];
"""


def painted(browser: WebDriver) -> np.ndarray:
    width, height, flags = browser.execute_script(PAINTED, browser.find_element(By.ID, "mask"))
    return np.array(flags, dtype=bool).reshape(height, width)


def stroke(browser: WebDriver, points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Drag the mouse over the mask canvas through `points`, in image pixels; the points the
    page was given, in image pixels (the pointer moves by whole CSS pixels)."""
    canvas = browser.find_element(By.ID, "mask")
    rect = canvas.rect
    scale = rect["width"] / SIDE
    centre = (int(rect["x"] + rect["width"] / 2), int(rect["y"] + rect["height"] / 2))  # WebDriver's
    offsets = [
        (round(x * scale + rect["x"] - centre[0]), round(y * scale + rect["y"] - centre[1]))
        for x, y in points
    ]
    chain = ActionChains(browser)
    chain.move_to_element_with_offset(canvas, *offsets[0]).click_and_hold()
    for offset in offsets[1:]:
        chain.move_to_element_with_offset(canvas, *offset)
    chain.release().perform()
    return [
        ((centre[0] + dx - rect["x"]) / scale, (centre[1] + dy - rect["y"]) / scale) for dx, dy in offsets
    ]


def distances(points: list[tuple[float, float]]) -> np.ndarray:
    """Each pixel centre's distance to the line through `points`, in image pixels."""
    y, x = np.mgrid[0:SIDE, 0:SIDE] + 0.5
    nearest = np.full((SIDE, SIDE), np.inf)
    for (ax, ay), (bx, by) in pairwise(points):
        dx, dy = bx - ax, by - ay
        t = np.clip(((x - ax) * dx + (y - ay) * dy) / max(dx * dx + dy * dy, 1e-9), 0, 1)
        nearest = np.minimum(nearest, np.hypot(x - ax - t * dx, y - ay - t * dy))
    return nearest


def png(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    assert image.format == "PNG"
    return image


def error_box(browser: WebDriver) -> WebElement:
    return until(
        browser, lambda b: (box := b.find_element(By.ID, "error")).is_displayed() and box, "an error"
    )


@pytest.fixture(scope="module", autouse=True)
def edits_served(server: LiveServer) -> None:
    routes = httpx.get(f"{server.url}/openapi.json").json()["paths"]
    if "/v1/images/edits" not in routes:
        pytest.skip("this server has no POST /v1/images/edits yet (issue 24's API)")


def test_an_image_made_here_is_edited_with_the_mask_painted_on_it(
    browser: WebDriver, server: LiveServer, tmp_path: Path
) -> None:
    browser.get_log("browser")  # drop what earlier pages logged
    open_page(browser, server.url)
    browser.execute_script(RECORD_KINDS + RECORD_SENT)
    fill(browser, prompt="a red circle", seed="7", num_inference_steps="12")
    browser.find_element(By.ID, "go").click()
    [made] = final_images(browser, 1)
    source_pixels = shown_pixels(browser, made)
    assert not browser.find_element(By.ID, "edit").is_displayed()  # generate mode: no editor

    browser.find_element(By.CSS_SELECTOR, ".card .edit-this").click()
    until(browser, lambda b: b.find_element(By.ID, "canvas-frame").is_displayed(), "the editor")
    assert browser.find_element(By.ID, "mode-edit").is_selected()
    assert browser.find_element(By.ID, "go").text == "Edit"
    assert not browser.find_element(By.ID, "size").is_displayed()  # an edit keeps its image's size
    [listed] = browser.find_elements(By.CSS_SELECTOR, "#source-list li")
    assert listed.find_element(By.TAG_NAME, "img").get_attribute("alt") == "a red circle, seed 7"
    assert listed.find_element(By.TAG_NAME, "input").is_selected()
    canvas = browser.find_element(By.ID, "mask")
    assert (canvas.get_attribute("width"), canvas.get_attribute("height")) == (str(SIDE), str(SIDE))
    assert canvas.rect["width"] >= 4 * SIDE  # shown larger than the image: painted in image pixels
    assert browser.find_element(By.ID, "edit-source").get_attribute("class") == "pixelated"
    status = browser.find_element(By.ID, "mask-status")
    assert status.text.startswith("Nothing painted")
    assert browser.find_element(By.ID, "brush-value").text == f"{BRUSH} px"
    assert browser.find_element(By.ID, "strength-value").text == "0.80"

    browser.find_element(By.ID, "brush").send_keys(Keys.END)  # the largest brush: a quarter of the side
    assert browser.find_element(By.ID, "brush-value").text == f"{2 * BRUSH} px"
    near = distances(stroke(browser, [(8, 2), (8, 62), (24, 62), (24, 2)]))  # the left half, roughly
    mask = painted(browser)
    assert mask[near <= BRUSH - 1].all() and not mask[near > BRUSH + 1].any()
    until(browser, lambda b: status.text.endswith("painted: only that region is repainted."), "the share")

    fill(browser, prompt="a yellow triangle")
    browser.find_element(By.ID, "go").click()
    until(browser, staleness_of(made), "the edit's cards")
    [edited] = final_images(browser, 1)
    kinds = browser.execute_script("return window.kinds")
    assert kinds[-4:] == [["0", "partial"]] * 3 + [["0", "final"]], kinds  # 3 previews, then the image
    until(browser, lambda b: b.find_element(By.ID, "progress-text").text.startswith("Done: 1 image"), "done")

    generation, edit = sent(browser)
    assert generation["path"] == "/v1/images/generations" and edit["path"] == "/v1/images/edits"
    fields = form_fields(edit)
    assert (
        fields["prompt"] == "a yellow triangle" and fields["size"] == "64x64" and fields["strength"] == "0.8"
    )
    assert fields["seed"] == "7" and fields["stream"] == "true" and fields["partial_images"] == "3"
    files = form_files(edit)
    np.testing.assert_array_equal(np.asarray(png(files["image"]).convert("RGB")), source_pixels)
    sent_mask = png(files["mask"])
    assert sent_mask.size == (SIDE, SIDE) and sent_mask.mode == "RGBA"
    alpha = np.asarray(sent_mask)[..., 3]
    assert set(np.unique(alpha)) == {0, 255}
    np.testing.assert_array_equal(alpha == 0, mask)  # transparent where painted, opaque elsewhere

    edited_pixels = shown_pixels(browser, edited)
    np.testing.assert_array_equal(edited_pixels, api_edit(server, edit))  # the API's image, as is
    sources = browser.find_elements(By.CSS_SELECTOR, "#source-list img")
    assert [s.get_attribute("alt") for s in sources] == ["a yellow triangle, seed 7", "a red circle, seed 7"]
    assert not [entry["message"] for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]

    change = np.abs(edited_pixels.astype(int) - source_pixels).mean(axis=2)
    assert change[mask].mean() > 2 * change[:, 40:].mean()  # the painted half moved, the far side less
    wanted = os.environ.get("DIFFSHARD_SCREENSHOT")  # make screenshot: for the README
    browser.set_window_size(1400, 1200)  # the editor and its sliders, then the page as it was
    browser.execute_script("window.scrollTo(0, 0)")
    browser.save_screenshot(Path(wanted).resolve() if wanted else tmp_path / "playground-edit.png")
    browser.set_window_size(1400, 1000)


def test_invert_paints_the_other_pixels_and_clear_sends_no_mask(
    browser: WebDriver, server: LiveServer, tmp_path: Path
) -> None:
    made = httpx.post(
        f"{server.url}/v1/images/generations",
        json={"prompt": "a green square", "seed": 3, "num_inference_steps": 8},
        timeout=60,
    ).json()["data"][0]["b64_json"]
    upload = tmp_path / "green-square.png"
    upload.write_bytes(base64.b64decode(made))
    open_page(browser, server.url)
    browser.execute_script(RECORD_SENT)
    browser.find_element(By.CSS_SELECTOR, 'label[for="mode-edit"]').click()
    assert browser.find_element(By.ID, "sources-empty").is_displayed()
    browser.find_element(By.ID, "upload").send_keys(str(upload))
    until(browser, lambda b: b.find_element(By.ID, "canvas-frame").is_displayed(), "the upload in the editor")
    [listed] = browser.find_elements(By.CSS_SELECTOR, "#source-list img")
    assert listed.get_attribute("alt") == "Uploaded: green-square.png"

    stroke(browser, [(48, 48), (50, 50)])
    mask = painted(browser)
    assert 0 < mask.sum() < SIDE * SIDE / 10
    browser.find_element(By.ID, "invert-mask").click()
    np.testing.assert_array_equal(painted(browser), ~mask)
    status = browser.find_element(By.ID, "mask-status")
    assert status.text.endswith("painted: only that region is repainted.")
    fill(browser, prompt="a green square", seed="4", num_inference_steps="8")
    browser.find_element(By.ID, "partial_images").send_keys("0")
    browser.find_element(By.ID, "go").click()
    [inverted] = final_images(browser, 1)

    browser.find_element(By.ID, "clear-mask").click()
    assert not painted(browser).any() and status.text.startswith("Nothing painted")
    browser.find_element(By.ID, "go").click()
    until(browser, staleness_of(inverted), "the second edit's cards")
    [whole] = final_images(browser, 1)

    first, second = sent(browser)
    assert form_files(first)["image"] == upload.read_bytes() == form_files(second)["image"]  # as uploaded
    alpha = np.asarray(png(form_files(first)["mask"]))[..., 3]
    np.testing.assert_array_equal(alpha == 0, ~mask)  # the stroke kept, everything else repainted
    assert "mask" not in form_files(second)  # nothing painted: img2img
    np.testing.assert_array_equal(shown_pixels(browser, whole), api_edit(server, second))

    browser.find_element(By.CSS_SELECTOR, 'label[for="mode-generate"]').click()
    assert (
        browser.find_element(By.ID, "size").is_displayed()
        and not browser.find_element(By.ID, "edit").is_displayed()
    )
    browser.find_element(By.ID, "go").click()
    until(browser, lambda b: len(b.execute_script("return window.sent")) == 3, "a generation")
    assert sent(browser)[2]["path"] == "/v1/images/generations"  # back to generating


def test_an_unreadable_upload_and_a_refused_one_are_explained(
    browser: WebDriver, server: LiveServer, tmp_path: Path
) -> None:
    open_page(browser, server.url)
    browser.find_element(By.CSS_SELECTOR, 'label[for="mode-edit"]').click()
    fill(browser, prompt="a red square")
    browser.find_element(By.ID, "go").click()
    error = error_box(browser)
    assert error.text == "Choose an image to edit: make one here, or upload one."
    assert browser.switch_to.active_element == browser.find_element(By.ID, "upload")

    text = tmp_path / "notes.png"
    text.write_text("not a picture\n")
    browser.find_element(By.ID, "upload").send_keys(str(text))
    until(browser, lambda b: error.text.startswith("notes.png is not an image"), "the upload refused")
    assert not browser.find_elements(By.CSS_SELECTOR, "#source-list li")

    large = tmp_path / "large.png"
    Image.new("RGB", (256, 256), "white").save(large)  # over the built-in model's pixel limit
    browser.find_element(By.ID, "upload").send_keys(str(large))
    until(browser, lambda b: b.find_element(By.ID, "canvas-frame").is_displayed(), "the large image")
    browser.find_element(By.ID, "go").click()
    until(browser, lambda b: "DIFFSHARD_MAX_PIXELS" in error.text, "the server's refusal")
    assert browser.find_element(By.ID, "progress-text").text == "Not started."
    assert browser.find_element(By.ID, "go").is_enabled()


def test_a_model_that_edits_by_reference_gets_the_image_alone(
    browser: WebDriver, tiny_folder, tmp_path: Path
) -> None:
    """FLUX.3 [distilled] (edits by reference, as FLUX.1 Kontext and Qwen-Image 2.1): no mask to
    paint, no strength; the Size field in edit mode, empty by default. The edit sends the image
    and the prompt, no mask, strength or size, and its image is the one the API answers."""
    picture = tmp_path / "picture.png"
    Image.new("RGB", (40, 24), "red").save(picture)
    with live_server("--model", str(tiny_folder("flux3-distilled"))) as flux3:
        open_page(browser, flux3.url)
        until(browser, lambda b: not b.find_element(By.ID, "strength").is_displayed(), "no strength")
        browser.execute_script(RECORD_SENT)
        browser.find_element(By.CSS_SELECTOR, 'label[for="mode-edit"]').click()
        browser.find_element(By.ID, "upload").send_keys(str(picture))
        until(browser, lambda b: b.find_element(By.ID, "canvas-frame").is_displayed(), "the upload")
        assert not browser.find_element(By.ID, "mask").is_displayed()
        assert not browser.find_element(By.ID, "brush").is_displayed()
        assert browser.find_element(By.ID, "size").is_displayed()
        assert "edits by reference" in browser.find_element(By.ID, "edit-help").text
        fill(browser, prompt="make it blue", seed="5", num_inference_steps="2")
        browser.find_element(By.ID, "go").click()
        [edited] = final_images(browser, 1)
        [request] = sent(browser)
        assert set(form_files(request)) == {"image"}
        assert not {"mask", "strength", "size"} & set(form_fields(request))
        expected = api_edit(flux3, request)
        assert np.array_equal(shown_pixels(browser, edited), expected)
