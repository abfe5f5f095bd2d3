"""FLUX.1 ControlNets (block residuals) per row: tiny `FluxControlNetModel`s built from the tiny
FLUX.1-dev folder's transformer (1 double and 2 single layers against its 2 and 3 blocks, so a
sample feeds several blocks as forward spreads them; their zero layers drawn at random: zeros
would prove nothing). Our pipeline, over two stages, equals diffusers' FluxControlNetPipeline
(one net, two at once, a start/end window), and a batch of controlled and plain rows gives each
row's image alone; a sequence group cuts the residuals with the tokens; over HTTP the same three
images as diffusers'."""

from __future__ import annotations

import base64
import copy
import io
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import (
    FluxControlNetModel,
    FluxControlNetPipeline,
    FluxMultiControlNetModel,
    FluxTransformer2DModel,
)
from PIL import Image

from server.pipeline import Pipeline
from server.pipeline.conditioning.controlnets import ControlNets
from server.requests import GenerationRequest
from server.requests.control import Control
from tests.support.controlnets import wire
from tests.support.images import drawn
from tests.support.live import LiveServer, live_server
from tests.support.tiny_pipelines import diffusers_image

TOLERANCE = 2 / 255
REQUEST = GenerationRequest("a red circle", seed=3, steps=4, guidance_scale=3.5, width=32, height=32)


def flux_controlnet(folder: Path, seed: int) -> FluxControlNetModel:
    transformer = FluxTransformer2DModel.from_pretrained(folder / "transformer")
    config = transformer.config
    net = FluxControlNetModel.from_transformer(
        transformer, num_layers=1, num_single_layers=2,
        attention_head_dim=config.attention_head_dim, num_attention_heads=config.num_attention_heads,
    )  # fmt: skip
    torch.manual_seed(seed)
    for zero in [*net.controlnet_blocks, *net.controlnet_single_blocks, net.controlnet_x_embedder]:
        torch.nn.init.normal_(zero.weight, std=0.2)
    return net.eval()


@pytest.fixture(scope="module")
def flux_controlled(flux_folder: Path) -> tuple[Path, Pipeline, dict]:
    """The tiny FLUX.1-dev folder (the session's); our pipeline over two stages serving nets "a" and "b"."""
    folder = flux_folder
    nets = {"a": flux_controlnet(folder, 1), "b": flux_controlnet(folder, 2)}
    pipeline = Pipeline.load(folder, devices="cpu,cpu", strategy="even")
    for name, net in nets.items():
        pipeline.controlnets.add(name, copy.deepcopy(net))
    return folder, pipeline, nets


def theirs(folder: Path, nets: list[FluxControlNetModel], controls: list[Control], request) -> np.ndarray:
    one = len(controls) == 1
    net = nets[0] if one else FluxMultiControlNetModel(nets)
    pipe = FluxControlNetPipeline.from_pretrained(folder, controlnet=net, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return diffusers_image(
        pipe, request,
        control_image=controls[0].image if one else [c.image for c in controls],
        controlnet_conditioning_scale=controls[0].scale if one else [c.scale for c in controls],
        control_guidance_start=controls[0].start if one else [c.start for c in controls],
        control_guidance_end=controls[0].end if one else [c.end for c in controls],
    )  # fmt: skip


ASKED = {
    "one": [Control("a", drawn("circle"), 0.8)],
    "two at once": [Control("a", drawn("circle"), 0.5), Control("b", drawn("square"), 1.0)],
    "a window": [Control("b", drawn("square"), 1.0, start=0.25, end=0.75)],
}


@pytest.mark.parametrize("asked", list(ASKED.values()), ids=list(ASKED))
def test_images_equal_diffusers_flux_controlnet_pipeline(flux_controlled, asked: list[Control]) -> None:
    folder, pipeline, nets = flux_controlled
    request = pipeline.resolve(replace(REQUEST, control=tuple(asked)))
    ours = pipeline.generate([request])[0]
    reference = theirs(folder, [nets[c.model] for c in asked], asked, request)
    plain = pipeline.generate([pipeline.resolve(REQUEST)])[0]
    assert np.abs(ours - reference).max() < TOLERANCE
    assert np.abs(ours - plain).max() > 0.05  # the control steered the image
    assert float(ours.std()) > 0.05, "a flat image would hide differences"


def test_controlled_and_plain_rows_in_one_call_each_give_their_image_alone(flux_controlled) -> None:
    """Control "a" at 0.5, "b" at 1.0 and a plain request stepped together: each its image alone
    within 1e-3; each step one transformer call of all rows, each net one call of its rows."""
    _, pipeline, _ = flux_controlled
    three = [
        pipeline.resolve(replace(REQUEST, control=(Control("a", drawn("circle"), 0.5),))),
        pipeline.resolve(replace(REQUEST, seed=4, control=(Control("b", drawn("square"), 1.0),))),
        pipeline.resolve(replace(REQUEST, seed=5)),
    ]
    alone = [pipeline.generate([request])[0] for request in three]
    rows: dict[str, list[int]] = {"transformer": [], "a": [], "b": []}
    nets = pipeline.controlnets.loaded
    modules = {"transformer": pipeline.shard.model.x_embedder, **{n: n_.x_embedder for n, n_ in nets.items()}}
    hooks = [m.register_forward_pre_hook(lambda _m, args, n=n: rows[n].append(args[0].shape[0]))
             for n, m in modules.items()]  # fmt: skip
    try:
        together = pipeline.generate(three)
    finally:
        for hook in hooks:
            hook.remove()
    for mine, alone_image in zip(together, alone, strict=True):
        assert np.abs(mine - alone_image).max() < 1e-3
    assert rows == {"transformer": [3] * REQUEST.steps, "a": [1] * REQUEST.steps, "b": [1] * REQUEST.steps}


def test_a_sequence_group_cuts_the_residuals_with_the_image_tokens(flux_controlled) -> None:
    """A group of two (every call: `--parallel sequence`) cuts a ControlNet's residuals with the
    image tokens they add to: the controlled image of one worker, every step a group call."""
    from server.engine import ParallelPlan, plan_shards
    from server.pipeline.families import meta_denoiser
    from server.pipeline.loading.folder import read_family

    folder, pipeline, nets = flux_controlled
    request = pipeline.resolve(replace(REQUEST, control=tuple(ASKED["two at once"])))
    one = plan_shards(meta_denoiser(read_family(folder)), "cpu", "memory")
    plan = ParallelPlan(
        (one, one), 1, 1, workers=("cpu:0", "cpu:1"), splits_lone=True, sequence=2, grouped=True
    )
    lane = Pipeline.load(folder, plan=plan).lanes()[0]
    for name, net in nets.items():
        lane.controlnets.add(name, copy.deepcopy(net))
    grouped = lane.generate([request])[0]
    assert float(np.abs(grouped - pipeline.generate([request])[0]).max()) * 255 <= 2
    assert lane.lane.groups.calls == REQUEST.steps


def test_flux_controlnets_another_model_cannot_run_are_refused_naming_why(flux_controlled) -> None:
    _, pipeline, nets = flux_controlled
    controlnets = ControlNets(
        pipeline.family, torch.device("cpu"), torch.float32, pipeline.shard.model.config
    )
    config = dict(nets["a"].config)
    cases = {
        "XLabs-style": {**config, "conditioning_embedding_channels": 16},
        "union FLUX ControlNet": {**config, "num_mode": 4},
        "blocks are 64 wide": {**config, "num_attention_heads": 4},
        "its joint_attention_dim": {**config, "joint_attention_dim": 7},
    }
    for says, bad in cases.items():
        with pytest.raises(ValueError, match=says):
            controlnets._fits("x", "FluxControlNetModel", bad)
    with pytest.raises(ValueError, match="a flux model takes FluxControlNetModel"):
        controlnets._fits("x", "ControlNetModel", config)


@pytest.fixture(scope="module")
def flux_served(
    flux_controlled, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LiveServer, Path]]:
    """The tiny FLUX.1-dev folder served by uvicorn with nets "a" and "b" saved in diffusers' format."""
    folder, _, nets = flux_controlled
    root = tmp_path_factory.mktemp("flux-controlnets")
    for name, net in nets.items():
        net.save_pretrained(root / name, safe_serialization=True)
    flags = [f for name in nets for f in ("--controlnet", f"{name}={root / name}")]
    with live_server("--model", str(folder), "--devices", "cpu", "--threads", "1", *flags) as server:
        yield server, root


@pytest.mark.parametrize("asked", list(ASKED.values()), ids=list(ASKED))
def test_over_http_images_equal_diffusers_flux_controlnet_pipeline(
    flux_served, flux_controlled, asked: list[Control]
) -> None:
    import openai

    (server, root), (folder, _, _) = flux_served, flux_controlled
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    body = {"seed": REQUEST.seed, "num_inference_steps": REQUEST.steps, "guidance_scale": 3.5}
    answer = client.images.generate(
        prompt=REQUEST.prompt, size="32x32", extra_body={**body, "control": [wire(c) for c in asked]}
    )
    ours = np.asarray(Image.open(io.BytesIO(base64.b64decode(answer.data[0].b64_json))), np.float32) / 255
    loaded = {name: FluxControlNetModel.from_pretrained(root / name) for name in "ab"}
    reference = theirs(folder, [loaded[c.model] for c in asked], asked, REQUEST)
    assert np.abs(ours - reference).max() <= 2 / 255


def test_models_lists_the_flux_controlnets_with_their_family(flux_served) -> None:
    import httpx

    server, _ = flux_served
    listed = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["controlnets"]
    assert [(n["name"], n["class"], n["family"]) for n in listed] == [
        ("a", "FluxControlNetModel", "flux"),
        ("b", "FluxControlNetModel", "flux"),
    ]
