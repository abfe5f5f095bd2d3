"""Output formats and OpenAI's other fields, over HTTP: jpeg and webp decode at the asked size,
`output_compression` trades bytes for quality monotonically, the fields this service cannot honour
answer 400 naming the field, and those it honours answer as OpenAI's do."""

from __future__ import annotations

import base64
import io

import httpx
import pytest
from PIL import Image

from tests.support.live import LiveServer

BODY = {"prompt": "a red circle", "seed": 3, "num_inference_steps": 6, "size": "64x48"}


@pytest.fixture(scope="module")
def server(served: LiveServer) -> LiveServer:
    return served


def generate(server: LiveServer, **fields) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/images/generations", json={**BODY, **fields}, timeout=60)


def image_bytes(response: httpx.Response) -> bytes:
    assert response.status_code == 200, response.text
    return base64.b64decode(response.json()["data"][0]["b64_json"])


@pytest.mark.parametrize(
    ("output_format", "pillow_format"), [("jpeg", "JPEG"), ("webp", "WEBP"), ("png", "PNG")]
)
def test_each_format_decodes_at_the_asked_size(
    server: LiveServer, output_format: str, pillow_format: str
) -> None:
    response = generate(server, output_format=output_format)
    image = Image.open(io.BytesIO(image_bytes(response)))
    assert (image.format, image.size) == (pillow_format, (64, 48))
    body = response.json()
    assert (body["output_format"], body["size"], body["quality"], body["background"]) == (
        output_format,
        "64x48",
        "low",  # the quality used: 6 of the model's 25 steps
        "opaque",
    )


@pytest.mark.parametrize("output_format", ["jpeg", "webp"])
def test_output_compression_trades_bytes_monotonically(server: LiveServer, output_format: str) -> None:
    sizes = [
        len(image_bytes(generate(server, output_format=output_format, output_compression=c)))
        for c in (5, 50, 95)
    ]
    assert sizes == sorted(sizes) and len(set(sizes)) == 3, sizes


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"output_format": "gif"}, "output_format"),
        ({"output_format": "jpeg", "output_compression": 101}, "output_compression"),
        ({"output_compression": 50}, "output_compression"),  # png is lossless
        ({"background": "transparent"}, "background"),
        ({"quality": "hd"}, "quality"),
        ({"style": "vivid"}, "style"),
        ({"moderation": "auto"}, "moderation"),
    ],
)
def test_fields_that_would_change_the_images_are_refused_by_name(server: LiveServer, fields, param) -> None:
    response = generate(server, **fields)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param
    assert generate(server).status_code == 200  # and the service goes on


def test_honoured_values_give_the_default_image(server: LiveServer) -> None:
    plain = image_bytes(generate(server))
    honoured = generate(server, quality="auto", background="opaque", moderation="low", user="someone")
    assert image_bytes(honoured) == plain
