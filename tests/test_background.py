"""OpenAI's `background`, and images with an alpha channel: RGBA encoded with its alpha in PNG
and WebP (exactly), composited over white as PIL composites where an opaque image is needed; the
decision per model kind (with alpha: transparent, opaque, auto by format; without: opaque only)
and what the response says; over HTTP on the built-in model (no alpha): opaque and auto answer
RGB PNGs said opaque, transparent and jpeg+transparent answer 400 naming `background`."""

from __future__ import annotations

import asyncio
import base64
import io
import json

import httpx
import numpy as np
import pytest
from PIL import Image

from server.api.editing import edited
from server.api.schemas import ImageGenerationRequest, image_background
from server.api.streaming import Feed, image_events
from server.errors import InvalidRequest
from server.media.images import encode, over_white, to_uint8
from server.requests import GenerationRequest
from server.serving import Job
from tests.support.live import LiveServer, sse

BODY = {"prompt": "a red circle", "seed": 3, "num_inference_steps": 2, "size": "32x32"}


def rgba(height: int = 24, width: int = 32, seed: int = 0) -> np.ndarray:
    """Random straight-alpha RGBA floats in [0, 1], fully transparent and fully opaque pixels
    among them."""
    image = np.random.default_rng(seed).random((height, width, 4), dtype=np.float32)
    image[0, :, 3], image[1, :, 3] = 0.0, 1.0
    return image


def decoded(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data))


# Encoding.


@pytest.mark.parametrize("output_format", ["png", "webp"])
def test_png_and_webp_keep_an_rgba_images_alpha_exactly(output_format: str) -> None:
    image = rgba()
    read = decoded(encode(image, output_format, 50 if output_format == "webp" else None))
    assert (read.mode, read.size) == ("RGBA", (32, 24))
    np.testing.assert_array_equal(np.asarray(read)[..., 3], to_uint8(image)[..., 3])
    if output_format == "png":  # lossless: the colours too
        np.testing.assert_array_equal(np.asarray(read), to_uint8(image))


def test_jpeg_and_an_opaque_output_are_the_image_over_white() -> None:
    image = rgba()
    flat = to_uint8(over_white(image))
    opaque_png = decoded(encode(image, "png", opaque=True))
    assert opaque_png.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(opaque_png), flat)
    assert decoded(encode(image, "webp", opaque=True)).mode == "RGB"
    jpeg = encode(image, "jpeg", 90)
    assert decoded(jpeg).mode == "RGB"
    assert jpeg == encode(flat, "jpeg", 90)  # lossy, but of the image over white


def test_an_rgb_image_is_encoded_as_before() -> None:
    image = rgba()[..., :3]
    assert decoded(encode(image, "png")).mode == "RGB"
    np.testing.assert_array_equal(over_white(image), image)
    np.testing.assert_array_equal(np.asarray(decoded(encode(image, "png", opaque=True))), to_uint8(image))


def test_over_white_matches_pils_compositing_within_a_level() -> None:
    pixels = np.random.default_rng(1).integers(0, 256, (64, 64, 4), dtype=np.uint8)
    source = Image.fromarray(pixels, "RGBA")
    composited = Image.alpha_composite(Image.new("RGBA", source.size, "white"), source).convert("RGB")
    pasted = Image.new("RGB", source.size, "white")
    pasted.paste(source, mask=source.getchannel("A"))  # diffusers' way of flattening an RGBA image
    ours_pixels = over_white(pixels).astype(int)  # uint8 in, uint8 out (a stream's partial image)
    ours_floats = to_uint8(over_white(pixels.astype(np.float32) / 255)).astype(int)
    for ours in (ours_pixels, ours_floats):
        for theirs in (composited, pasted):
            assert np.abs(ours - np.asarray(theirs).astype(int)).max() <= 1


# What `background` decides, per model kind.


@pytest.mark.parametrize(
    ("alpha", "background", "output_format", "expected"),
    [
        (False, None, "png", "opaque"),
        (False, "auto", "webp", "opaque"),
        (False, "opaque", "jpeg", "opaque"),
        (True, None, "png", "transparent"),  # auto keeps the alpha where the format can
        (True, "auto", "webp", "transparent"),
        (True, "auto", "jpeg", "opaque"),
        (True, "opaque", "png", "opaque"),
        (True, "transparent", "png", "transparent"),
        (True, "transparent", "webp", "transparent"),
    ],
)
def test_background_says_what_the_image_is(alpha: bool, background, output_format: str, expected) -> None:
    body = ImageGenerationRequest(prompt="a red circle", background=background, output_format=output_format)
    assert image_background(body, alpha) == expected


@pytest.mark.parametrize(
    ("alpha", "fields", "words"),
    [
        (False, {"background": "transparent"}, "this model makes opaque images"),
        (False, {"background": "transparent", "output_format": "jpeg"}, "no alpha channel; use png or webp"),
        (True, {"background": "transparent", "output_format": "jpeg"}, "no alpha channel; use png or webp"),
        (True, {"background": "clear"}, "must be transparent or opaque or auto"),
    ],
)
def test_a_background_that_cannot_be_honoured_is_refused_by_name(alpha: bool, fields, words: str) -> None:
    body = ImageGenerationRequest(prompt="a red circle", **fields)
    with pytest.raises(InvalidRequest) as refused:
        image_background(body, alpha)
    assert refused.value.field == "background" and words in refused.value.message


def test_an_edits_transparency_reaches_a_model_with_alpha_only() -> None:
    """A model whose VAE takes alpha gets an uploaded RGBA image as sent; the others (and any
    image without transparency) get RGB, as before."""
    pixels = (rgba() * 255).round().astype(np.uint8)
    upload = Image.fromarray(pixels, "RGBA")
    kept = edited(upload, alpha=True)
    assert kept.mode == "RGBA"
    np.testing.assert_array_equal(np.asarray(kept), pixels)
    assert edited(upload, alpha=False).mode == "RGB"
    assert edited(upload.convert("RGB"), alpha=True).mode == "RGB"


# A stream of a model with alpha: each event's image as its `background` says.


def events_of(image: np.ndarray, background: str, output_format: str = "png") -> list[dict]:
    """The events of a job whose one partial image and finished image are `image`, streamed as
    the routes stream them with `background` decided."""

    async def run() -> list[dict]:
        job, feed = Job([GenerationRequest("a red circle", steps=2)], 2, 60.0), Feed()
        fields = {"size": "32x24", "quality": "low", "background": background, "output_format": output_format}
        feed.on_partial(0, 0, image)  # as the step loop hands it over: floats, made uint8
        job.future.set_result([image])
        return [event async for event in image_events(job, feed, fields, None, "r1")]

    return [json.loads(text.split("data: ", 1)[1]) for text in asyncio.run(run())]


@pytest.mark.parametrize(("background", "mode"), [("transparent", "RGBA"), ("opaque", "RGB")])
def test_a_streams_partial_and_completed_images_follow_its_background(background: str, mode: str) -> None:
    image = rgba()
    events = events_of(image, background)
    assert [e["type"] for e in events] == ["image_generation.partial_image", "image_generation.completed"]
    assert all(e["background"] == background for e in events)
    images = [decoded(base64.b64decode(e["b64_json"])) for e in events]
    assert [i.mode for i in images] == [mode, mode]
    expected = to_uint8(image) if mode == "RGBA" else to_uint8(over_white(image))
    np.testing.assert_array_equal(np.asarray(images[1]), expected)  # the finished image: exact
    assert np.abs(np.asarray(images[0]).astype(int) - expected).max() <= 1  # composited from uint8


# Over HTTP, the built-in model (no alpha channel): the shared server.


def generate(server: LiveServer, **fields) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/images/generations", json={**BODY, **fields}, timeout=60)


@pytest.mark.parametrize("fields", [{}, {"background": "auto"}, {"background": "opaque"}])
def test_auto_and_opaque_give_an_rgb_png_said_opaque(server: LiveServer, fields) -> None:
    response = generate(server, **fields)
    assert response.status_code == 200, response.text
    body = response.json()
    image = decoded(base64.b64decode(body["data"][0]["b64_json"]))
    assert (image.format, image.mode, body["background"]) == ("PNG", "RGB", "opaque")


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"background": "transparent"}, "this model makes opaque images"),
        ({"background": "transparent", "output_format": "webp"}, "this model makes opaque images"),
        ({"background": "transparent", "output_format": "jpeg"}, "JPEG has no alpha channel"),
        ({"background": "transparent", "stream": True}, "this model makes opaque images"),
    ],
)
def test_transparent_is_refused_naming_background(server: LiveServer, fields, words: str) -> None:
    response = generate(server, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["type"]) == ("background", "invalid_request_error")
    assert words in error["message"], error["message"]


def test_an_edit_refuses_transparent_by_name(server: LiveServer) -> None:
    image = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(image, format="PNG")
    files = {"image": ("red.png", image.getvalue(), "image/png")}
    data = {"prompt": "a red circle", "background": "transparent", "num_inference_steps": "2"}
    response = httpx.post(f"{server.url}/v1/images/edits", files=files, data=data, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "background"


def test_every_streamed_event_says_opaque(server: LiveServer) -> None:
    body = {**BODY, "stream": True, "partial_images": 1, "background": "auto"}
    url = f"{server.url}/v1/images/generations"
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        assert response.status_code == 200
        events = [data for kind, data in sse(response) if kind != "error"]
    assert [e["type"] for e in events] == ["image_generation.partial_image", "image_generation.completed"]
    assert all(e["background"] == "opaque" for e in events)
    assert all(decoded(base64.b64decode(e["b64_json"])).mode == "RGB" for e in events)


def test_the_model_list_and_the_openapi_document_say_the_model_has_no_alpha(server: LiveServer) -> None:
    model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
    assert model["family"]["supports"]["alpha"] is False
    document = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    background = document["components"]["schemas"]["ImageGenerationRequest"]["properties"]["background"]
    assert [b.get("enum") for b in background["anyOf"] if b.get("type") != "null"] == [["opaque", "auto"]]
