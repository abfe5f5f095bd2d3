"""FLUX.1 as a family (issue 25), on tiny dev- and schnell-shaped folders built from config under
fixed seeds: our pipeline equals diffusers' FluxPipeline (embedded guidance, true CFG), unsharded
and split over 2 and 3 stages; requests joining at different steps give the images they give
alone."""

from __future__ import annotations

import base64
import io
import json
import time
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from diffusers import FluxImg2ImgPipeline, FluxInpaintPipeline, FluxPipeline
from PIL import Image

from server.errors import InvalidRequest
from server.pipeline import Pipeline
from server.requests import Edit, GenerationRequest
from tests.conftest import Cli
from tests.support.images import left_half_mask, source_image
from tests.support.live import live_server
from tests.support.tiny_pipelines import diffusers_image

TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def flux_folders(flux_folder, tiny_folder) -> dict[str, Path]:
    """The shared tiny folders (conftest's)."""
    return {"dev": flux_folder, "schnell": tiny_folder("flux-schnell")}


def theirs(folder: Path, request: GenerationRequest) -> np.ndarray:
    pipe = FluxPipeline.from_pretrained(folder, local_files_only=True, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    return diffusers_image(pipe, request, true_cfg_scale=request.true_cfg_scale or 1.0)  # unset: off


CASES = {
    "dev": GenerationRequest("a red circle", seed=3, steps=4, guidance_scale=3.5, width=32, height=32),
    "dev-wide": GenerationRequest("a green square", seed=5, steps=3, guidance_scale=5.0, width=48, height=32),
    "true-cfg": GenerationRequest(
        "a red circle", negative_prompt="blue", true_cfg_scale=4.0, seed=3, steps=3, width=32, height=32
    ),
    "schnell": GenerationRequest("a blue triangle", seed=7, steps=3, guidance_scale=0.0, width=32, height=32),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("devices", ["cpu", "cpu,cpu", "cpu,cpu,cpu"])
def test_our_pipeline_equals_flux_pipeline(flux_folders, case: str, devices: str) -> None:
    folder = flux_folders["schnell" if case == "schnell" else "dev"]
    pipeline = Pipeline.load(folder, devices=devices, strategy="even")
    assert len(pipeline.shard.plan.stages) == len(devices.split(","))
    request = pipeline.resolve(CASES[case])
    mine = pipeline.generate([request])[0]
    reference = theirs(folder, request)
    assert mine.shape == reference.shape == (request.height, request.width, 3)
    assert float(np.abs(mine - reference).max()) < TOLERANCE
    assert float(mine.std()) > 0.05  # not a flat image: the comparison means something


def test_requests_joining_at_different_steps_give_the_images_they_give_alone(flux_folders) -> None:
    pipeline = Pipeline.load(flux_folders["dev"], devices="cpu,cpu", strategy="even")
    first = GenerationRequest("a red circle", seed=1, steps=5, guidance_scale=2.0, width=32, height=32)
    later = GenerationRequest("a blue square", seed=2, steps=3, guidance_scale=4.0, width=32, height=32)
    alone = [pipeline.generate([r])[0] for r in (first, later)]
    states = pipeline.start([pipeline.resolve(first)])
    rows_per_call = []
    try:
        pipeline.step(states)
        pipeline.step(states)
        states += pipeline.start([pipeline.resolve(later)])
        while active := [s for s in states if not s.done]:
            rows_per_call.append(sum(s.rows for s in active))
            pipeline.step(active)
        together = [pipeline.decode([s])[0].numpy().copy() for s in states]
    finally:
        for state in states:
            state.close()
    assert rows_per_call[:3] == [2, 2, 2]  # one row each (embedded guidance), in one call
    for one, joined in zip(alone, together, strict=True):
        assert float(np.abs(one - joined).max()) < TOLERANCE


def test_sizes_and_true_cfg_are_checked_by_family(flux_folders, sd3_folder) -> None:
    flux = Pipeline.load(flux_folders["dev"], devices="cpu")
    with pytest.raises(InvalidRequest) as refused:  # 2x2 packing of a 2x VAE: multiples of 4
        flux.resolve(GenerationRequest("a red circle", width=30, height=32))
    assert refused.value.field == "size"
    assert flux.rows(flux.resolve(GenerationRequest("a red circle", guidance_scale=7.0))) == 1
    sd3 = Pipeline.load(sd3_folder, devices="cpu")
    with pytest.raises(InvalidRequest) as refused:
        sd3.resolve(GenerationRequest("a red circle", true_cfg_scale=3.0))
    assert refused.value.field == "true_cfg_scale"


@pytest.mark.parametrize(("mask", "strength"), [(False, 0.6), (True, 0.75), (True, 1.0)])
def test_edits_equal_flux_img2img_and_inpaint_pipelines(flux_folders, mask: bool, strength: float) -> None:
    folder = flux_folders["dev"]
    pipeline = Pipeline.load(folder, devices="cpu,cpu", strategy="even")
    # the model's whole image, as diffusers' pipelines return it (test_edits checks the kept pixels)
    edit = Edit(source_image(), left_half_mask() if mask else None, strength, keep_unmasked=False)
    request = pipeline.resolve(
        GenerationRequest("a red circle", seed=4, steps=6, guidance_scale=3.5, edit=edit)
    )
    mine = pipeline.generate([request])[0]
    reference_class = FluxInpaintPipeline if mask else FluxImg2ImgPipeline
    pipe = reference_class.from_pretrained(folder, local_files_only=True, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    reference = pipe(
        prompt=request.prompt,
        image=edit.image,
        strength=strength,
        generator=torch.Generator("cpu").manual_seed(request.seed),
        num_inference_steps=request.steps,
        guidance_scale=request.guidance_scale,
        height=request.height,
        width=request.width,
        output_type="np",
        **({"mask_image": edit.mask} if mask else {}),
    ).images[0]
    assert float(np.abs(mine - reference).max()) < TOLERANCE


def test_the_openai_sdk_generates_and_streams_from_a_tiny_flux_folder(flux_folders) -> None:
    folder = flux_folders["dev"]
    extra = {"seed": 3, "num_inference_steps": 4, "guidance_scale": 3.5}
    with live_server("--model", str(folder)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        plain = client.images.generate(prompt="a red circle", size="32x32", extra_body=extra)
        events = list(
            client.images.generate(
                prompt="a red circle", size="32x32", stream=True, partial_images=2, extra_body=extra
            )
        )
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert base64.b64decode(events[-1].b64_json) == base64.b64decode(plain.data[0].b64_json)
    served = np.asarray(Image.open(io.BytesIO(base64.b64decode(plain.data[0].b64_json)))).astype(int)
    request = GenerationRequest("a red circle", seed=3, steps=4, guidance_scale=3.5, width=32, height=32)
    reference = (theirs(folder, request) * 255).round().astype(int)
    assert int(np.abs(served - reference).max()) <= 2  # the PNG within 2/255 of diffusers


FLUX_PLAN = ("plan", "--config", "flux-dev", "--dtype", "bfloat16")
TWO_4090S = ("--devices", "cuda:0,cuda:1", "--max-memory", "cuda:0=24GiB,cuda:1=24GiB")


def test_flux_dev_plans_for_two_24_gib_gpus_without_one_and_refuses_one_naming_the_shortfall(
    run_cli: Cli,
) -> None:
    """Two stages (auto takes a two-way tensor group there, T5 spread over both: test_tensor.py)."""
    started = time.monotonic()
    done = run_cli(*FLUX_PLAN, *TWO_4090S, "--parallel", "pipeline", "--json")
    seconds = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert seconds < 20
    plan = json.loads(done.stdout)
    assert len(plan["stages"]) == 2 and all(len(stage["blocks"]) > 1 for stage in plan["stages"])
    assert sum(len(stage["blocks"]) for stage in plan["stages"]) == 1 + 19 + 38 + 1
    for device in plan["devices"]:  # weights, activations and (cuda:0) T5, CLIP and the VAE within budget
        used = device["param_bytes"] + device["activation_reserve"] + device["other_bytes"]
        assert used <= device["budget"], device
    assert plan["devices"][0]["other_bytes"] > 9e9  # T5-XXL's encoder (9.5 GB) sits with the first stage
    assert plan["boundaries"][0]["tensors"] == 5 and plan["boundaries"][0]["bytes"] > 0
    one = run_cli(*FLUX_PLAN, "--devices", "cuda:0", "--max-memory", "cuda:0=24GiB")
    assert one.returncode == 2 and "GiB short" in one.stderr and "cuda:0" in one.stderr
    unbudgeted = run_cli(*FLUX_PLAN, "--devices", "cuda:0,cuda:1")
    assert unbudgeted.returncode == 2 and "--max-memory cuda:0=" in unbudgeted.stderr
