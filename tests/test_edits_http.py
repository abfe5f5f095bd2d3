"""/v1/images/edits over real HTTP on the built-in model, driven by the official openai SDK as
users drive it (multipart: image, mask, prompt, extensions in extra_body), streamed or not; every
bad input answers 400 naming its field and the server keeps serving. A masked edit keeps the
pixels the mask leaves opaque (issue 36): inside the mask, the model's image (diffusers' there,
as test_edits.py shows on the tiny folders), unless `keep_unmasked` is false."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from PIL import Image

from server.demo.dataset import sample_batch, to_uint8
from tests.support.live import LiveServer, live_server

EXTRA = {"seed": 3, "num_inference_steps": 12, "strength": 0.8}
MAX_IMAGE_BYTES = 20_000


def red_circle() -> Image.Image:
    """A dataset image of a red circle (64x64)."""
    batch = sample_batch(64, torch.Generator().manual_seed(0), shapes=("circle",))
    first = batch.colors.index("red")
    return Image.fromarray(to_uint8(batch.images[first : first + 1])[0].numpy())


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def left_half_transparent(size: int = 64) -> Image.Image:
    """OpenAI's mask: alpha 0 on the left half (repaint), opaque on the right."""
    alpha = np.full((size, size), 255, np.uint8)
    alpha[:, : size // 2] = 0
    return Image.fromarray(np.dstack([np.zeros((size, size, 3), np.uint8), alpha]), "RGBA")


def pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64)))).astype(int)


def bomb_png(side: int = 20_000) -> bytes:
    """A valid PNG header declaring side x side RGB pixels, with a few bytes of data: what a
    decoder that trusts the header would allocate 1.2 GB for."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


def peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM")


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server("--max-image-bytes", str(MAX_IMAGE_BYTES), "--max-edit-images", "2") as running:
        yield running


@pytest.fixture
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_the_sdk_edits_with_a_mask_and_streams_the_same_image(client: openai.OpenAI, tmp_path: Path) -> None:
    (tmp_path / "circle.png").write_bytes(png(red_circle()))
    (tmp_path / "mask.png").write_bytes(png(left_half_transparent()))
    with open(tmp_path / "circle.png", "rb") as image, open(tmp_path / "mask.png", "rb") as mask:
        plain = client.images.edit(
            image=image, mask=mask, prompt="a blue circle", size="64x64", extra_body=EXTRA
        )
    assert len(plain.data) == 1 and pixels(plain.data[0].b64_json).shape == (64, 64, 3)
    with open(tmp_path / "circle.png", "rb") as image, open(tmp_path / "mask.png", "rb") as mask:
        events = list(
            client.images.edit(
                image=image,
                mask=mask,
                prompt="a blue circle",
                size="64x64",
                stream=True,
                partial_images=2,
                extra_body=EXTRA,
            )
        )
    assert [e.type for e in events] == ["image_edit.partial_image"] * 2 + ["image_edit.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    assert base64.b64decode(events[-1].b64_json) == base64.b64decode(plain.data[0].b64_json)
    # the opaque (right) half is the image as sent; the repainted one the model's whole image's
    with open(tmp_path / "circle.png", "rb") as image, open(tmp_path / "mask.png", "rb") as mask:
        extra = {**EXTRA, "keep_unmasked": False}
        unkept = client.images.edit(image=image, mask=mask, prompt="a blue circle", extra_body=extra)
    source, repaint = np.asarray(red_circle()).astype(int), np.asarray(left_half_transparent())[..., 3] == 0
    kept, whole = pixels(plain.data[0].b64_json), pixels(unkept.data[0].b64_json)
    assert np.abs(kept - source)[~repaint].max() <= 2 and np.abs(kept - whole)[repaint].max() <= 2
    assert np.abs(whole - source)[~repaint].mean() > 2  # the VAE's round trip moved the opaque half


def test_img2img_without_a_mask_and_several_images(client: openai.OpenAI) -> None:
    source = png(red_circle())
    restyled = client.images.edit(image=("a.png", source), prompt="a blue circle", extra_body=EXTRA)
    image = pixels(restyled.data[0].b64_json)
    assert image.shape == (64, 64, 3)  # the image's own size when none is asked
    assert float(np.abs(image - np.asarray(red_circle()).astype(int)).mean()) > 5  # it was edited
    several = client.images.edit(
        image=[("a.png", source), ("b.png", source)], prompt="a blue circle", n=2, extra_body=EXTRA
    )
    assert len(several.data) == 4
    # the SDK sends an object in a form as one field a key (lora[name]=scale): read as JSON's
    with pytest.raises(openai.BadRequestError) as refused_lora:
        client.images.edit(image=("a.png", source), prompt="a cat", extra_body={"lora": {"nope": 1}})
    assert "lora: no adapter named 'nope'" in str(refused_lora.value), refused_lora.value
    assert [d.model_extra["seed"] for d in several.data] == [3, 4, 5, 6]


def edit(server: LiveServer, files: dict, **fields) -> httpx.Response:
    data = {"prompt": "a blue circle", "num_inference_steps": "4", **fields}
    return httpx.post(f"{server.url}/v1/images/edits", files=files, data=data, timeout=60)


def refused(response: httpx.Response, param: str, *words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert all(word in error["message"] for word in words), error


def test_bad_inputs_answer_400_naming_the_field_and_the_server_keeps_serving(server: LiveServer) -> None:
    image = ("circle.png", png(red_circle()), "image/png")
    mask = ("mask.png", png(left_half_transparent()), "image/png")
    gif = io.BytesIO()
    red_circle().save(gif, format="GIF")
    big = Image.fromarray(np.random.default_rng(0).integers(0, 255, (120, 120, 3), np.uint8))
    refused(edit(server, {"image": ("a.txt", b"not an image", "text/plain")}), "image", "not a png")
    refused(edit(server, {"image": ("a.gif", gif.getvalue(), "image/gif")}), "image", "not a png")
    refused(edit(server, {"image": ("big.png", png(big), "image/png")}), "image", "DIFFSHARD_MAX_IMAGE_BYTES")
    refused(
        edit(server, {"image": ("wide.png", png(Image.new("RGB", (300, 300))), "image/png")}),
        "image",
        "pixels",
    )
    refused(
        edit(server, {"image": image, "mask": ("m.png", png(left_half_transparent(32)), "image/png")}),
        "mask",
        "64x64",
    )
    opaque = png(Image.new("RGBA", (64, 64), (0, 0, 0, 255)))
    refused(edit(server, {"image": image, "mask": ("m.png", opaque, "image/png")}), "mask", "transparent")
    refused(
        edit(server, {"image": image, "mask": ("m.png", png(red_circle()), "image/png")}), "mask", "alpha"
    )
    for strength in ("0", "1.5", "nan"):
        refused(edit(server, {"image": image}, strength=strength), "strength")
    three = [("image[]", image)] * 3
    refused(edit(server, three), "image", "DIFFSHARD_MAX_EDIT_IMAGES")
    refused(edit(server, {"image": image}, strenght="0.5"), "strenght", "strength")
    refused(edit(server, {"image": image}, lora="{not json"), "lora")
    refused(edit(server, {"mask": mask}), "image", "required")
    refused(edit(server, {"image": image, "mask": mask}, input_fidelity="medium"), "input_fidelity", "high")
    refused(edit(server, {"image": image}, input_fidelity="high"), "input_fidelity", "mask", "strength")
    both = {"input_fidelity": "high", "keep_unmasked": "false"}
    refused(edit(server, {"image": image, "mask": mask}, **both), "keep_unmasked", "input_fidelity")
    refused(edit(server, {"image": image, "mask": mask}, keep_unmasked="maybe"), "keep_unmasked")
    broken = httpx.post(
        f"{server.url}/v1/images/edits", content=b"x", headers={"content-type": "multipart/form-data"}
    )
    assert broken.status_code == 400 and "multipart/form-data body" in broken.json()["error"]["message"]
    form = edit(server, {})  # no file: httpx sends a urlencoded form
    assert form.status_code == 400 and "multipart/form-data" in form.json()["error"]["message"]
    as_json = httpx.post(f"{server.url}/v1/images/edits", json={"prompt": "a red circle"}, timeout=10)
    assert as_json.status_code == 400 and "multipart/form-data" in as_json.json()["error"]["message"]
    # the next request succeeds
    ok = edit(server, {"image": image, "mask": mask}, input_fidelity="high")
    assert ok.status_code == 200 and len(ok.json()["data"]) == 1


def test_a_decompression_bomb_is_refused_without_allocating_it(server: LiveServer) -> None:
    data = bomb_png()
    assert len(data) < 200
    before = peak_rss_kib(server.process.pid)
    refused(edit(server, {"image": ("bomb.png", data, "image/png")}), "image", "pixels")
    refused(
        edit(
            server,
            {"image": ("a.png", png(red_circle()), "image/png"), "mask": ("bomb.png", data, "image/png")},
        ),
        "mask",
        "pixels",
    )
    assert peak_rss_kib(server.process.pid) - before < 100 * 1024  # 1.2 GB were never allocated
    assert edit(server, {"image": ("a.png", png(red_circle()), "image/png")}).status_code == 200
