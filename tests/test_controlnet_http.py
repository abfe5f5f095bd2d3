"""ControlNets served over HTTP (issue 54): `--controlnet NAME=FOLDER` on the tiny SD-1.5 folder,
through uvicorn and OpenAI's SDK (`control` in `extra_body`). Each image equals diffusers'
StableDiffusionControlNetPipeline within 2/255 (one control, two at once, a start/end window);
an inpainting edit with a control equals StableDiffusionControlNetInpaintPipeline's; /v1/models
lists the ControlNets with the family they fit; bad controls are refused naming the field and its
limit, and the server goes on serving; a bad folder stops the start, named."""

from __future__ import annotations

import base64
import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
from PIL import Image
from pydantic import ValidationError

from server.errors import ConfigError
from server.pipeline.loading.folder import read_family
from server.requests.control import Control
from server.settings import Settings
from server.startup import plan_for
from tests.support.controlnets import (
    ASKED,
    EDIT_PIPELINES,
    EDITED,
    GUIDED,
    diffusers_controlled,
    folder_controlnet,
    png_base64,
    png_bytes,
    wire,
)
from tests.support.images import drawn
from tests.support.live import LiveServer, live_server
from tests.support.tiny_pipelines import IMAGE_SIZE


@pytest.fixture(scope="module")
def nets(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """ControlNets "a" and "b" for the tiny SD-1.5 folder, saved in diffusers' format."""
    root = tmp_path_factory.mktemp("controlnets")
    for name, seed in (("a", 1), ("b", 2)):
        folder_controlnet(folders["sd15"], seed).save_pretrained(root / name, safe_serialization=True)
    return {name: root / name for name in "ab"}


@pytest.fixture(scope="module")
def served(folders: dict[str, Path], nets: dict[str, Path]) -> Iterator[LiveServer]:
    flags = [f for name, path in nets.items() for f in ("--controlnet", f"{name}={path}")]
    with live_server("--model", str(folders["sd15"]), "--devices", "cpu", "--threads", "1", *flags) as server:
        server.nets = list(nets.values())  # type: ignore[attr-defined]
        yield server


def generate(server: LiveServer, **extra: object) -> np.ndarray:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    body = {"seed": GUIDED.seed, "num_inference_steps": GUIDED.steps, "guidance_scale": GUIDED.guidance_scale}
    answer = client.images.generate(
        prompt=GUIDED.prompt,
        size=f"{IMAGE_SIZE}x{IMAGE_SIZE}",
        extra_body={"negative_prompt": GUIDED.negative_prompt, **body, **extra},
    )
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(answer.data[0].b64_json))), np.float32) / 255


@pytest.mark.parametrize("asked", list(ASKED.values()), ids=list(ASKED))
def test_over_http_images_equal_diffusers_controlnet_pipelines(
    served: LiveServer, folders: dict[str, Path], nets: dict[str, Path], asked: list[Control]
) -> None:
    from diffusers import ControlNetModel

    ours = generate(served, control=[wire(c, data_url=i == 0) for i, c in enumerate(asked)])
    loaded = {n: ControlNetModel.from_pretrained(path, use_safetensors=True) for n, path in nets.items()}
    theirs = diffusers_controlled(folders["sd15"], [loaded[c.model] for c in asked], asked)
    assert np.abs(ours - theirs).max() <= 2 / 255
    assert np.abs(ours - generate(served)).max() > 0.02  # the control steered the image (5/255; a window too)


@pytest.fixture(scope="module")
def sdxl_served(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The tiny SDXL folder serving ControlNet "a", made from its UNet (text-time embeddings too)."""
    path = tmp_path_factory.mktemp("sdxl-controlnet") / "a"
    folder_controlnet(folders["sdxl"], 1).save_pretrained(path, safe_serialization=True)
    flags = ("--devices", "cpu", "--threads", "1", "--controlnet", f"a={path}")
    with live_server("--model", str(folders["sdxl"]), *flags) as server:
        server.nets = [path]  # type: ignore[attr-defined]
        yield server


def test_over_http_an_sdxl_image_equals_diffusers_sdxl_controlnet_pipeline(
    sdxl_served: LiveServer, folders: dict[str, Path]
) -> None:
    from diffusers import ControlNetModel, StableDiffusionXLControlNetPipeline

    asked = [Control("a", drawn("circle"), 0.8, start=0.0, end=0.75)]
    ours = generate(sdxl_served, control=[wire(c) for c in asked])
    net = ControlNetModel.from_pretrained(sdxl_served.nets[0], use_safetensors=True)
    theirs = diffusers_controlled(folders["sdxl"], [net], asked, StableDiffusionXLControlNetPipeline)
    assert np.abs(ours - theirs).max() <= 2 / 255
    assert np.abs(ours - generate(sdxl_served)).max() > 0.05  # the control steered the image


def test_models_and_shards_list_the_controlnets_and_bad_controls_are_named(
    served: LiveServer, folders: dict[str, Path]
) -> None:
    import httpx

    listed = httpx.get(f"{served.url}/v1/models", timeout=10).json()["data"][0]["controlnets"]
    assert [(n["name"], n["class"], n["family"]) for n in listed] == [
        ("a", "ControlNetModel", "sd"),
        ("b", "ControlNetModel", "sd"),
    ]
    assert all(n["bytes"] > 0 for n in listed)
    shards = httpx.get(f"{served.url}/v1/shards", timeout=10).json()
    first = shards["plan"]["stages"][0]["device"]
    assert [(n["name"], n["device"], n["bytes"]) for n in shards["controlnets"]] == [
        (n["name"], first, n["bytes"]) for n in listed
    ]
    sd15, nets = folders["sd15"], [f"{n['name']}={path}" for n, path in zip(listed, served.nets, strict=True)]
    beside = [  # the plan `serve` makes, without and with them
        plan_for(Settings(model=sd15, devices="cpu", threads=1, controlnet=c), read_family(sd15), folder=sd15)
        for c in ([], nets)
    ]
    beside = [plan.replicas[0] for plan in beside]
    assert shards["plan"]["devices"][0]["other_bytes"] == beside[1].devices[0].other_bytes
    counted = beside[1].devices[0].other_bytes - beside[0].devices[0].other_bytes
    assert counted == sum(n["bytes"] for n in listed)  # the plan counts them where they run
    circle, gif = png_base64(drawn("circle")), base64.b64encode(b"GIF89a").decode()
    cases = [
        ({"model": "aa", "image": circle}, "control", "did you mean 'a'"),
        ({"model": "a", "image": circle, "scale": 3.0}, "control", "scale must be from 0 to 2.0"),
        ({"model": "a", "image": circle, "start": 0.9, "end": 0.1}, "control", "start < end"),
        ({"model": "a", "image": "not base64!"}, "control[0].image", "is not base64"),
        ({"model": "a", "image": gif}, "control[0].image", "not a png or jpeg or webp image"),
    ]
    for control, field, says in cases:
        with pytest.raises(openai.BadRequestError, match=says) as caught:
            generate(served, control=[control])
        assert caught.value.param == field, caught.value.body
    five = [{"model": "a", "image": circle}] * 5
    with pytest.raises(openai.BadRequestError, match="at most 4 controls"):
        generate(served, control=five)
    generate(served, control=[{"model": "a", "image": circle}])  # still serving


def test_over_http_an_inpainting_edit_with_a_control_equals_diffusers_pipeline(
    served: LiveServer, folders: dict[str, Path], nets: dict[str, Path]
) -> None:
    """`control` on /v1/images/edits (JSON text in the form, as the SDK sends `extra_body`): the
    image StableDiffusionControlNetInpaintPipeline draws; bad controls named as on generations."""
    from diffusers import ControlNetModel

    edit, asked = EDITED["inpainting"]
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    alpha = np.where(np.asarray(edit.mask) == 255, 0, 255).astype(np.uint8)  # OpenAI's: clear repaints
    mask = Image.fromarray(np.dstack([np.zeros((*alpha.shape, 3), np.uint8), alpha]), "RGBA")
    extra = {
        "negative_prompt": GUIDED.negative_prompt,
        "seed": GUIDED.seed,
        "num_inference_steps": GUIDED.steps,
        "guidance_scale": GUIDED.guidance_scale,
        "strength": edit.strength,
        "keep_unmasked": False,
    }

    def edited(control: object) -> np.ndarray:
        answer = client.images.edit(
            image=("source.png", png_bytes(edit.image)),
            mask=("mask.png", png_bytes(mask)),
            prompt=GUIDED.prompt,
            extra_body={**extra, "control": control},
        )
        return np.asarray(Image.open(io.BytesIO(base64.b64decode(answer.data[0].b64_json))), np.float32) / 255

    ours = edited(json.dumps([wire(c) for c in asked]))
    net = ControlNetModel.from_pretrained(nets[asked[0].model], use_safetensors=True)
    theirs = diffusers_controlled(
        folders["sd15"],
        [net],
        asked,
        EDIT_PIPELINES["inpainting"],
        image=edit.image,
        mask_image=edit.mask,
        strength=edit.strength,
    )
    assert np.abs(ours - theirs).max() <= 2 / 255
    for control, says in (
        ("[{not json", "is not valid JSON: send a list"),
        (json.dumps([{"model": "aa", "image": png_base64(asked[0].image)}]), "did you mean 'a'"),
        ([wire(asked[0])], "send it as one field of JSON text"),  # the SDK flattens a list: control[][model]
    ):
        with pytest.raises(openai.BadRequestError, match=says) as caught:
            edited(control)
        assert caught.value.param == "control", caught.value.body
    assert np.abs(edited(json.dumps([wire(c) for c in asked])) - ours).max() == 0  # still serving
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 256, (128, 128, 4), np.uint8))
    large = json.dumps([wire(Control("a", noise))])
    assert len(large) > Settings().max_body_bytes  # a control image takes its image bound, not the body's
    assert edited(large).shape == (IMAGE_SIZE, IMAGE_SIZE, 3)


def test_a_bad_controlnet_folder_stops_the_start_naming_it(tmp_path: Path, nets: dict[str, Path]) -> None:
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    (weightless / "config.json").write_text((nets["a"] / "config.json").read_text())
    for value, says in (
        (f"edges={tmp_path / 'missing'}", "is not a ControlNet folder"),
        (f"edges={weightless}", "holds no .safetensors weights"),
        (f"a={nets['a']},a={nets['b']}", "two ControlNets are named 'a'"),
        ("=nowhere", "write NAME=PATH"),
    ):
        with pytest.raises(ValidationError, match=says):
            Settings(controlnet=value)
    assert Settings(controlnet=f"edges={nets['a']}").controlnet == {"edges": nets["a"]}
    # --controlnet-dir: every subfolder served, named by it, after --controlnet's
    (shelf := tmp_path / "shelf").mkdir()
    shutil.copytree(nets["b"], shelf / "b")
    assert Settings(controlnet=f"a={nets['a']}", controlnet_dir=shelf).controlnets == {
        "a": nets["a"],
        "b": shelf / "b",
    }
    with pytest.raises(ConfigError, match=r"two ControlNets are named 'b' \(--controlnet and"):
        _ = Settings(controlnet=f"b={nets['a']}", controlnet_dir=shelf).controlnets
    shutil.copytree(weightless, shelf / "weightless")
    with pytest.raises(ConfigError, match=r"--controlnet-dir: .*weightless holds no \.safetensors weights"):
        _ = Settings(controlnet_dir=shelf).controlnets
    with pytest.raises(ValidationError, match="is not a folder"):
        Settings(controlnet_dir=nets["a"] / "config.json")


def test_a_controlnet_for_another_model_stops_the_start(folders: dict[str, Path], nets: dict) -> None:
    """The SDXL folder's server is handed the SD-1.5 ControlNet (the same class): it exits, naming
    what differs."""
    flags = ("--model", str(folders["sdxl"]), "--devices", "cpu", "--controlnet", f"a={nets['a']}")
    with pytest.raises(RuntimeError, match="was made for another model"), live_server(*flags):
        pass
