"""FLUX.1 ControlNets over HTTP: the tiny FLUX.1-dev folder served by uvicorn with two random
`FluxControlNetModel`s (tests/support/controlnets.py) saved in diffusers' format and named by
`--controlnet`. Through OpenAI's SDK each image equals diffusers' FluxControlNetPipeline's with the
nets loaded from those folders (one net, two at once, a start/end window), and /v1/models lists the
nets with their family. The pipeline's own FLUX.1 ControlNet tests, with the other DiT families',
are in tests/test_controlnet_families.py (this module starts a server: it is a `live` one)."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from diffusers import FluxControlNetModel, FluxControlNetPipeline, FluxMultiControlNetModel
from PIL import Image

from server.requests import GenerationRequest
from server.requests.control import Control
from tests.support.controlnets import ASKED, diffusers_dit_controlled, flux_controlnet, wire
from tests.support.live import LiveServer, live_server

REQUEST = GenerationRequest("a red circle", seed=3, steps=4, guidance_scale=3.5, width=32, height=32)


@pytest.fixture(scope="module")
def flux_served(
    flux_folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LiveServer, Path]]:
    """The tiny FLUX.1-dev folder served by uvicorn with nets "a" and "b" saved in diffusers' format."""
    root = tmp_path_factory.mktemp("flux-controlnets")
    for seed, name in enumerate("ab", start=1):
        flux_controlnet(flux_folder, seed).save_pretrained(root / name, safe_serialization=True)
    flags = [f for name in "ab" for f in ("--controlnet", f"{name}={root / name}")]
    with live_server("--model", str(flux_folder), "--devices", "cpu", "--threads", "1", *flags) as server:
        yield server, root


@pytest.mark.parametrize("asked", list(ASKED.values()), ids=list(ASKED))
def test_over_http_images_equal_diffusers_flux_controlnet_pipeline(
    flux_served, flux_folder: Path, asked: list[Control]
) -> None:
    """The served image equals diffusers' for the same request and nets within 2/255 (a PNG's rounding)."""
    import openai

    server, root = flux_served
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    body = {"seed": REQUEST.seed, "num_inference_steps": REQUEST.steps, "guidance_scale": 3.5}
    answer = client.images.generate(
        prompt=REQUEST.prompt, size="32x32", extra_body={**body, "control": [wire(c) for c in asked]}
    )
    ours = np.asarray(Image.open(io.BytesIO(base64.b64decode(answer.data[0].b64_json))), np.float32) / 255
    loaded = {name: FluxControlNetModel.from_pretrained(root / name) for name in "ab"}
    reference = diffusers_dit_controlled(
        FluxControlNetPipeline,
        FluxMultiControlNetModel,
        flux_folder,
        [loaded[c.model] for c in asked],
        asked,
        REQUEST,
        negative_prompt=REQUEST.negative_prompt,
        guidance_scale=REQUEST.guidance_scale,
    )
    assert np.abs(ours - reference).max() <= 2 / 255


def test_models_lists_the_flux_controlnets_with_their_family(flux_served) -> None:
    """/v1/models names each served net with its class and the family it fits."""
    import httpx

    server, _ = flux_served
    listed = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["controlnets"]
    assert [(n["name"], n["class"], n["family"]) for n in listed] == [
        ("a", "FluxControlNetModel", "flux"),
        ("b", "FluxControlNetModel", "flux"),
    ]
