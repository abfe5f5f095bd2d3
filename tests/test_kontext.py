"""FLUX.1 Kontext [dev] (issue 72), on the tiny folder `tests/support/tiny_pipelines.py` builds as
published (FLUX.1-dev's scheduler and parts, `FluxKontextPipeline`'s index): an edit by
instruction equal to the pipeline's (the image resized to its preferred resolution, its tokens
after the noise's at position index 1), with embedded guidance and with true CFG, alone and
batched with another prompt's row, over two stages and in a sequence group, over the openai SDK,
with a LoRA row; a request without an image, with a mask or with too small an image, refused
naming the field."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
from diffusers import FluxKontextPipeline, FluxTransformer2DModel
from PIL import Image

from server.errors import InvalidRequest
from server.pipeline import Pipeline
from server.pipeline.conditioning.lora_keys import read_adapter
from server.requests import GenerationRequest
from server.requests.edit import Edit
from tests.support.denoisers import sequence_lane
from tests.support.images import first_frame, left_half_mask
from tests.support.live import live_server
from tests.support.lora import random_transformer_lora

SIZE = 128  # 4×4 latents of the 32× VAE: 2×2 noise tokens beside the image's 19×13


def picture():
    """A 200×136 gradient: 3:2 after the pipeline's rounding to 64, so it takes the 1248×832
    preferred resolution (1216×832 at a multiple of 64)."""
    return first_frame().resize((200, 136))


@pytest.fixture(scope="module")
def folder(tiny_folder) -> Path:
    return tiny_folder("flux-kontext")


@pytest.fixture(scope="module")
def pipeline(folder: Path) -> Pipeline:
    return Pipeline.load(folder, devices="cpu")


@pytest.fixture(scope="module")
def reference(folder: Path) -> FluxKontextPipeline:
    pipe = FluxKontextPipeline.from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def edit(prompt: str, seed: int, steps: int, **more) -> GenerationRequest:
    return GenerationRequest(
        prompt, seed=seed, steps=steps, width=SIZE, height=SIZE, edit=Edit(picture()), **more
    )


def kontexts(reference: FluxKontextPipeline, request: GenerationRequest) -> np.ndarray:
    """FluxKontextPipeline's image for `request` (its max_area the request's size, as served)."""
    cfg = {"negative_prompt": request.negative_prompt, "true_cfg_scale": request.true_cfg_scale or 1.0}
    return reference(
        image=request.edit.image,
        prompt=request.prompt,
        height=request.height,
        width=request.width,
        max_area=request.height * request.width,
        guidance_scale=request.guidance_scale,
        num_inference_steps=request.steps,
        generator=torch.Generator("cpu").manual_seed(request.seed),
        output_type="np",
        **cfg,
    ).images[0]


@pytest.mark.parametrize("steps", [3, 20])
def test_an_edit_equals_flux_kontext_pipelines_alone_and_batched(pipeline, reference, steps) -> None:
    """An instruction edit (embedded guidance 2.5) and another prompt's edit with true CFG (a
    negative row) share every call; each within 2/255 of FluxKontextPipeline's image."""
    one = pipeline.resolve(edit("make it red", 3, steps, guidance_scale=2.5))
    other = pipeline.resolve(edit("a cat", 4, steps, negative_prompt="blurry", true_cfg_scale=2.0))
    images = pipeline.generate([one, other])
    for image, request in zip(images, (one, other), strict=True):
        theirs = kontexts(reference, request)
        assert image.shape == theirs.shape == (SIZE, SIZE, 3)
        assert np.abs(image - theirs).max() * 255 <= 2
    assert np.abs(images[0] - pipeline.generate([one])[0]).max() < 1e-3


def test_two_stages_and_a_sequence_group_equal_one_device(pipeline, folder) -> None:
    request = pipeline.resolve(edit("make it red", 3, 3))
    (mine,) = pipeline.generate([request])
    two = Pipeline.load(folder, devices="cpu,cpu", strategy="even")
    assert len(two.shard.plan.stages) == 2
    for other in (two, sequence_lane(folder)):
        assert np.abs(other.generate([request])[0] - mine).max() * 255 <= 2


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (GenerationRequest("a cat", width=SIZE, height=SIZE), "image"),
        (
            GenerationRequest("a cat", width=SIZE, height=SIZE, edit=Edit(picture(), left_half_mask(136))),
            "mask",
        ),
        (GenerationRequest("a cat", width=SIZE, height=SIZE, edit=Edit(first_frame())), "image"),  # 48×40
    ],
    ids=["no image", "a mask", "too small"],
)
def test_what_kontext_cannot_do_is_refused_naming_the_field(pipeline, request_, field) -> None:
    with pytest.raises(InvalidRequest) as refused:
        pipeline.resolve(request_)
    assert refused.value.field == field


def test_an_edit_over_the_sdk_and_a_lora_row_equal_the_pipelines(folder, reference, tmp_path) -> None:
    """`client.images.edit` on a Kontext server within 2/255 of FluxKontextPipeline's image (the
    PNG the API serves); a generation without an image answered 400 naming `image`. A rank-4 LoRA
    on the transformer's attention, asked by one row beside a plain one: within 2/255 of the
    pipeline after load_lora_weights at that scale."""
    data = io.BytesIO()
    picture().save(data, format="PNG")
    with live_server("--model", str(folder)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        made = client.images.edit(
            image=("picture.png", data.getvalue(), "image/png"),
            prompt="make it red",
            size=f"{SIZE}x{SIZE}",
            extra_body={"seed": 3, "num_inference_steps": 3, "guidance_scale": 2.5},
        )
        refused = httpx.post(
            f"{server.url}/v1/images/generations", json={"prompt": "a cat", "size": "128x128"}
        )
    served = np.asarray(Image.open(io.BytesIO(base64.b64decode(made.data[0].b64_json)))).astype(int)
    theirs = kontexts(reference, edit("make it red", 3, 3, guidance_scale=2.5))
    assert int(np.abs(served - (theirs * 255).round().astype(int)).max()) <= 2
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "image"

    style = random_transformer_lora(FluxTransformer2DModel, folder, tmp_path / "style.safetensors")
    pipeline = Pipeline.load(folder, devices="cpu")
    pipeline.add_adapter(read_adapter("style", style, pipeline.family))
    styled = pipeline.resolve(edit("make it red", 3, 3, lora=(("style", 0.8),)))
    plain = pipeline.resolve(edit("a cat", 4, 3))
    mine, alone = pipeline.generate([styled, plain])[0], pipeline.generate([plain])[0]
    assert np.abs(pipeline.generate([styled, plain])[1] - alone).max() < 1e-3
    reference.load_lora_weights(style, adapter_name="style")
    reference.set_adapters(["style"], [0.8])
    try:
        theirs = kontexts(reference, styled)
    finally:
        reference.delete_adapters(["style"])
    assert np.abs(mine - theirs).max() * 255 <= 2
