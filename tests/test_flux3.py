"""FLUX.3 and FLUX.3 distilled (issue 72), on the tiny modular folders `tests/support/tiny_flux3.py`
builds as published (a `modular_model_index.json` under the Hub's id, a Qwen3VLProcessor, no
scheduler or guider: the blocks make theirs), each held to its diffusers modular pipeline (the
prompt upsampler popped, as served): text to image with true CFG, alone and batched with another
prompt whose rows have prompts of other lengths; the flow map's target timesteps; an edit with one
reference (its canvas cropped back) and with two; two stages and a sequence group; over the openai
SDK; a LoRA row; a folder whose index loads a part from elsewhere refused at load."""

from __future__ import annotations

import base64
import io
import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from diffusers import Flux3Transformer2DModel
from PIL import Image

from server.errors import InvalidRequest, ModelFolderError
from server.pipeline import Pipeline
from server.pipeline.conditioning.lora_keys import read_adapter
from server.pipeline.loading.folder import read_family
from server.requests import GenerationRequest
from server.requests.edit import Edit
from server.requests.step_cache import StepCache
from tests.support.denoisers import sequence_lane
from tests.support.images import first_frame, left_half_mask
from tests.support.live import live_server
from tests.support.lora import random_transformer_lora
from tests.support.tiny_flux3 import load_reference, reference_image

SIZE = 32  # 8×8 noise tokens
LONG = " ".join(
    ["a red circle beside a blue square"] * 12
)  # past 80 tokens: 160 beside the empty prompt's 80


@pytest.fixture(scope="module", params=["flux3", "flux3-distilled"])
def folder(request, tiny_folder) -> Path:
    return tiny_folder(request.param)


@pytest.fixture(scope="module")
def pipeline(folder: Path) -> Pipeline:
    return Pipeline.load(folder, devices="cpu")


@pytest.fixture(scope="module")
def reference(folder: Path):
    return load_reference(folder)


def theirs(reference, request: GenerationRequest, sized: bool = True) -> np.ndarray:
    """The modular pipeline's image for `request` (its guider set to the request's scale)."""
    more: dict = {"height": request.height, "width": request.width} if sized else {}
    if request.edit is not None:
        images = [request.edit.image, *request.edit.more]
        more["image"] = images if len(images) > 1 else images[0]
    if "guider" in reference.component_names:  # the base model: true CFG by its guider
        guider = reference.get_component_spec("guider")
        reference.update_components(guider=guider.create(guidance_scale=request.guidance_scale))
        more["negative_prompt"] = request.negative_prompt
    return reference(
        prompt=request.prompt,
        num_inference_steps=request.steps,
        generator=torch.Generator("cpu").manual_seed(request.seed),
        output_type="np",
        output="images",
        **more,
    )[0]


def close(mine: np.ndarray, other: np.ndarray) -> bool:
    return mine.shape == other.shape and np.abs(mine - other).max() * 255 <= 2


@pytest.mark.parametrize("steps", [3, 20])
def test_text_to_image_equals_the_modular_pipeline_alone_and_batched(pipeline, reference, steps) -> None:
    """A short prompt (CFG 3.5 on the base model: its 80-token rows) and a long one (160 tokens
    beside the empty negative prompt's 80: masked) share every call; each within 2/255 of the
    pipeline's, and the first the same alone."""
    short = pipeline.resolve(GenerationRequest("a red circle", seed=3, steps=steps, width=SIZE, height=SIZE))
    long = pipeline.resolve(GenerationRequest(LONG, seed=4, steps=steps, width=SIZE, height=SIZE))
    images = pipeline.generate([short, long])
    for image, request in zip(images, (short, long), strict=True):
        assert close(image, theirs(reference, request))
    assert np.abs(images[0] - pipeline.generate([short])[0]).max() < 1e-3
    assert pipeline.family.default_steps == (16 if pipeline.family.flow_map else 50)


def test_edits_with_one_and_two_references_equal_the_pipelines(pipeline, reference) -> None:
    """One 48-px reference: made at its 64-px canvas (reflect-padded) and cropped back to 48×48;
    two: each cropped to the grid, the output the first's size; a size named: no crop."""
    one = pipeline.resolve(GenerationRequest("make it blue", seed=5, steps=3, edit=Edit(reference_image())))
    assert (one.width, one.height, one.output_size) == (64, 64, "48x48")
    two = pipeline.resolve(
        GenerationRequest("both", seed=6, steps=3, edit=Edit(reference_image(64), more=(first_frame(),)))
    )
    sized = pipeline.resolve(
        GenerationRequest(
            "make it blue", seed=7, steps=3, width=SIZE, height=SIZE, edit=Edit(reference_image())
        )
    )
    assert sized.crop is None
    for request, by_size in ((one, False), (two, False), (sized, True)):
        (image,) = pipeline.generate([request])
        assert close(image, theirs(reference, request, sized=by_size))


def test_two_stages_and_a_sequence_group_equal_one_device(pipeline, folder) -> None:
    """Prompts of two lengths (a masked row) and a reference edit: every mode's tokens split."""
    requests = [
        pipeline.resolve(GenerationRequest(LONG, seed=3, steps=3, width=SIZE, height=SIZE)),
        pipeline.resolve(GenerationRequest("make it blue", seed=5, steps=3, edit=Edit(reference_image()))),
    ]
    mine = [pipeline.generate([r])[0] for r in requests]
    two = Pipeline.load(folder, devices="cpu,cpu", strategy="even")
    assert len(two.shard.plan.stages) == 2
    for other in (two, sequence_lane(folder)):
        for request, image in zip(requests, mine, strict=True):
            assert np.abs(other.generate([request])[0] - image).max() * 255 <= 2


def test_a_first_block_cached_edit_beside_a_plain_row_and_int8_still_draw_the_image(pipeline, folder) -> None:
    """A first-block-cached edit (the image tokens' first block decides; the references' and joint
    blocks are reused with it) steps beside a plain one, each as alone (1e-3), reusing
    steps, a little off its uncached image; the transformer and Qwen3-VL in int8 stay within a few
    255ths of float32's."""
    edit = GenerationRequest("make it blue", seed=5, steps=8, edit=Edit(reference_image()))
    plain = pipeline.resolve(replace(edit, prompt="make it green", seed=4))
    cached = pipeline.resolve(replace(edit, step_cache=StepCache("first_block", threshold=1.0)))
    alone = [pipeline.generate([r])[0] for r in (plain, cached)]
    states, reused = pipeline.start([plain, cached]), 0
    try:
        while active := [s for s in states if not s.done]:
            pipeline.step(active)
            reused += states[1].cache.last == "reused"
    finally:
        for state in states:
            state.close()
    together = pipeline.generate([plain, cached])
    assert reused >= 1
    for mine, expected in zip(together, alone, strict=True):
        assert np.abs(mine - expected).max() < 1e-3
    drift = np.abs(together[1] - pipeline.generate([pipeline.resolve(edit)])[0]).mean() * 255
    assert 0 < drift < 5, drift

    setting = "denoiser=int8-dynamic,text_encoder=int8-dynamic"
    quantized = Pipeline.load(folder, devices="cpu", quantize=setting)
    drift = np.abs(quantized.generate([plain])[0] - alone[0])
    assert float(drift.mean()) > 0 and float(drift.max()) < 24 / 255, float(drift.max())


def test_a_mask_and_the_distilled_models_guidance_are_refused_naming_the_field(pipeline) -> None:
    request = GenerationRequest("a cat", edit=Edit(first_frame(), left_half_mask(40)))
    with pytest.raises(InvalidRequest) as refused:
        pipeline.resolve(request)
    assert refused.value.field == "mask"
    guided = GenerationRequest("a cat", guidance_scale=5.0)
    if pipeline.family.flow_map:  # it samples without guidance
        with pytest.raises(InvalidRequest) as refused:
            pipeline.resolve(guided)
        assert refused.value.field == "guidance_scale" and "leave it unset" in refused.value.message
    else:
        assert pipeline.family.rows(pipeline.resolve(guided)) == 2


def test_a_part_loaded_from_elsewhere_is_refused_at_load(folder, tmp_path) -> None:
    """The index's text encoder in another repository, absent here: refused, saying where to put it."""
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    shutil.rmtree(copy / "text_encoder")
    with pytest.raises(ModelFolderError, match="not in this folder: download"):
        read_family(copy)
    index = json.loads((copy / "modular_model_index.json").read_text())
    index["text_encoder"][2]["subfolder"] = "encoders/qwen3-vl"
    (copy / "modular_model_index.json").write_text(json.dumps(index))
    with pytest.raises(ModelFolderError, match="own text_encoder/"):
        read_family(copy)


def test_an_edit_over_the_sdk_and_a_lora_row_equal_the_pipelines(folder, reference, tmp_path) -> None:
    """`client.images.edit` on a FLUX.3 server (one reference, no size: the cropped 48×48) within
    2/255 of the pipeline's PNG, its `size` the crop's; a rank-4 LoRA on every block's attention,
    asked by one row beside a plain one, within 2/255 of the pipeline after load_lora_weights."""
    data = io.BytesIO()
    reference_image().save(data, format="PNG")
    with live_server("--model", str(folder)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        made = client.images.edit(
            image=("picture.png", data.getvalue(), "image/png"),
            prompt="make it blue",
            extra_body={"seed": 5, "num_inference_steps": 3},
        )
    served = np.asarray(Image.open(io.BytesIO(base64.b64decode(made.data[0].b64_json)))).astype(int)
    pipeline = Pipeline.load(folder, devices="cpu")
    asked = pipeline.resolve(GenerationRequest("make it blue", seed=5, steps=3, edit=Edit(reference_image())))
    expected = theirs(reference, asked, sized=False)
    assert made.size == "48x48" and served.shape == expected.shape
    assert int(np.abs(served - (expected * 255).round().astype(int)).max()) <= 2

    style = random_transformer_lora(Flux3Transformer2DModel, folder, tmp_path / "style.safetensors")
    pipeline.add_adapter(read_adapter("style", style, pipeline.family))
    styled = pipeline.resolve(
        GenerationRequest("a red circle", seed=3, steps=3, width=SIZE, height=SIZE, lora=(("style", 0.8),))
    )
    plain = pipeline.resolve(GenerationRequest(LONG, seed=4, steps=3, width=SIZE, height=SIZE))
    mine, beside = pipeline.generate([styled, plain])
    assert np.abs(beside - pipeline.generate([plain])[0]).max() < 1e-3
    assert np.abs(mine - pipeline.generate([replace(styled, lora=())])[0]).max() * 255 > 2  # it adapts
    reference.load_lora_weights(style, adapter_name="style")
    reference.set_adapters(["style"], [0.8])
    try:
        expected = theirs(reference, styled)
    finally:
        reference.delete_adapters(["style"])
    assert close(mine, expected)
