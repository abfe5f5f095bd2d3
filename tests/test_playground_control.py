"""The playground's ControlNet (issue 54), in the real headless Chromium of tests/test_playground.py,
against the shared `make run` server: the built-in model with its trained `silhouette` ControlNet
(server/demo/train_controlnet.py).

A silhouette drawn where the base model does not put its shape (a small circle in a corner) is
uploaded as the control image: the request carries it as a data URL with the ControlNet's name
and scale, the card shows it beside the result, the result is the API's image for that very body,
and its shape sits on the silhouette (intersection over union), where the plain image's does not.
Edit mode keeps the control: an edit's form sends it as JSON text, and the page shows the API's image.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.expected_conditions import staleness_of
from selenium.webdriver.support.ui import Select

from server.demo.train_controlnet import silhouettes
from tests.support.browser import (
    RECORD_REQUESTS,
    RECORD_SENT,
    api_edit,
    api_pixels,
    fill,
    final_images,
    form_fields,
    open_page,
    sent,
    shown_pixels,
    until,
)
from tests.support.live import LiveServer

SIDE = 64  # the built-in model's images
BOX = (6, 6, 30, 30)  # a 24-pixel circle in the top-left corner


def shape_of(pixels: np.ndarray) -> np.ndarray:
    """An image's shape as a boolean mask (the training's silhouette rule)."""
    image = torch.from_numpy(pixels).permute(2, 0, 1)[None].float() / 127.5 - 1
    return silhouettes(image)[0, 0].numpy() > 0.5


def overlap(a: np.ndarray, b: np.ndarray) -> float:
    return float((a & b).sum() / max(1, (a | b).sum()))


def test_a_control_upload_makes_an_image_that_follows_it(
    browser: WebDriver, server: LiveServer, tmp_path: Path
) -> None:
    browser.get_log("browser")  # drop what earlier pages logged (the browser is the session's)
    control = Image.new("RGB", (SIDE, SIDE))
    ImageDraw.Draw(control).ellipse(BOX, fill="white")
    upload = tmp_path / "corner-circle.png"
    control.save(upload)
    wanted = np.asarray(control)[..., 0] > 127

    open_page(browser, server.url)
    until(browser, lambda b: b.find_element(By.ID, "control").is_displayed(), "the ControlNet section")
    choice = Select(browser.find_element(By.ID, "control-model"))
    assert [o.text for o in choice.options] == ["off", "silhouette"]
    fill(browser, prompt="a red circle", seed="3")
    choice.select_by_value("silhouette")
    browser.find_element(By.ID, "go").click()  # no image yet: said before anything is sent
    error = browser.find_element(By.ID, "error")
    until(browser, lambda b: error.text.startswith("Choose a control image"), "the missing image")

    browser.execute_script(RECORD_REQUESTS)
    browser.find_element(By.ID, "control-image").send_keys(str(upload))
    until(browser, lambda b: b.find_element(By.ID, "control-preview").is_displayed(), "the preview")
    browser.find_element(By.ID, "go").click()
    [image] = final_images(browser, 1)
    controlled = shown_pixels(browser, image)
    beside = browser.find_element(By.CSS_SELECTOR, ".card .control-image img")
    assert beside.get_attribute("alt") == "Control image (silhouette)"
    caption = browser.find_element(By.CSS_SELECTOR, ".card .control-image figcaption")
    assert caption.text == "Control: silhouette at 1.00"

    choice.select_by_value("")  # off: the same request, no control
    browser.find_element(By.ID, "go").click()
    until(browser, staleness_of(image), "the plain image")
    [plain_image] = final_images(browser, 1)
    plain = shown_pixels(browser, plain_image)

    with_control, without = browser.execute_script("return window.sent")
    [control_sent] = with_control["control"]
    assert (control_sent["model"], control_sent["scale"]) == ("silhouette", 1)
    assert control_sent["image"].startswith("data:image/png;base64,")
    assert base64.b64decode(control_sent["image"].split(",", 1)[1]) == upload.read_bytes()  # as uploaded
    assert "control" not in without
    streamed = ("stream", "stream_progress", "partial_images")
    body = {k: v for k, v in with_control.items() if k not in streamed}
    np.testing.assert_array_equal(controlled, api_pixels(server, **body))

    follows, ignores = overlap(shape_of(controlled), wanted), overlap(shape_of(plain), wanted)
    assert follows > 0.5 and follows > ignores + 0.2, (follows, ignores)

    # the plain image edited with the control on: its form carries the same list as JSON text
    choice.select_by_value("silhouette")
    browser.execute_script(RECORD_SENT)
    browser.find_element(By.CSS_SELECTOR, ".card .edit-this").click()
    until(browser, lambda b: b.find_element(By.ID, "canvas-frame").is_displayed(), "the editor")
    assert browser.find_element(By.ID, "control").is_displayed()
    browser.find_element(By.ID, "go").click()
    until(browser, staleness_of(plain_image), "the edit")
    [edited] = final_images(browser, 1)
    [edit] = [s for s in sent(browser) if "path" in s]  # RECORD_REQUESTS's entry beside it: none
    assert edit["path"] == "/v1/images/edits"
    assert json.loads(form_fields(edit)["control"]) == [control_sent]
    np.testing.assert_array_equal(shown_pixels(browser, edited), api_edit(server, edit))
    caption = browser.find_element(By.CSS_SELECTOR, ".card .control-image figcaption")
    assert caption.text == "Control: silhouette at 1.00"
    assert not [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
