"""Qwen-Image 2.1 and its Turbo (issue 72), on the tiny modular folders `tests/support/tiny_qwen21.py`
builds as published (a `modular_model_index.json`, a Qwen3VLProcessor, the RGBA VAE at 16x), each
held to its diffusers modular pipeline: text to image, alone and batched with another prompt of
another length (guided, its negative row another length again); the prefix KV cache (kept after a
request's first call) equal to recomputing it, and the pipeline's cache on and off; an edit with
two RGBA images; two stages and a sequence group; a LoRA row; a first-block-cached row; the PNG's
alpha and `background` over the openai SDK; what is refused."""

from __future__ import annotations

import base64
import io
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import openai
import pytest
import torch
from diffusers import QwenImage21Transformer2DModel
from PIL import Image

from server.engine.denoisers.qwenimage21 import HELD, PREFIX_KV, PREFIX_MASK
from server.errors import InvalidRequest, ModelFolderError
from server.pipeline import Pipeline
from server.pipeline.conditioning.lora_keys import read_adapter
from server.pipeline.loading.folder import read_family
from server.pipeline.steps.state import group_states
from server.requests import GenerationRequest
from server.requests.edit import Edit
from server.requests.step_cache import StepCache
from tests.support.denoisers import sequence_lane
from tests.support.live import live_server
from tests.support.lora import random_transformer_lora
from tests.support.tiny_qwen21 import TURBO_SIGMAS, condition_images, load_reference, reference_image

WIDE, TALL = 64, 32  # 4×2 tokens a side... 8 target tokens
LONG = "a red circle beside a blue square on a wooden table in the morning light"


@pytest.fixture(scope="module", params=["qwen-image-2.1", "qwen-image-2.1-turbo"])
def folder(request, tiny_folder) -> Path:
    return tiny_folder(request.param)


@pytest.fixture(scope="module")
def turbo(folder: Path) -> bool:
    return folder.name.endswith("turbo")


@pytest.fixture(scope="module")
def pipeline(folder: Path) -> Pipeline:
    return Pipeline.load(folder, devices="cpu")


@pytest.fixture(scope="module")
def reference(folder: Path, turbo: bool):
    return load_reference(folder, "turbo" if turbo else "base")


def ask(prompt: str, seed: int, steps: int, turbo: bool, **more) -> GenerationRequest:
    """A request at WIDE×TALL; on the Turbo its fixed sigmas' count and no guidance."""
    if turbo:
        more.pop("guidance_scale", None), more.pop("negative_prompt", None)
    return GenerationRequest(
        prompt, seed=seed, steps=len(TURBO_SIGMAS) if turbo else steps, width=WIDE, height=TALL, **more
    )


def theirs(reference, request: GenerationRequest, turbo: bool, **more) -> np.ndarray:
    """The modular pipeline's RGBA image for `request`."""
    if request.edit is not None:
        more["images"] = list(request.edit.images)
        more["output_resolution"] = int(np.sqrt(request.width * request.height))
    if not turbo and request.guidance_scale != 1:
        more |= {"guidance_scale": request.guidance_scale, "negative_prompt": request.negative_prompt}
    return reference_image(
        reference,
        request.prompt,
        height=request.height,
        width=request.width,
        steps=request.steps,
        seed=request.seed,
        **more,
    )


def close(mine: np.ndarray, other: np.ndarray) -> bool:
    return mine.shape == other.shape and np.abs(mine - other).max() * 255 <= 2


@pytest.mark.parametrize("steps", [3, 20])
def test_text_to_image_equals_the_modular_pipeline_alone_and_batched(
    pipeline, reference, turbo, steps
) -> None:
    """A short prompt and a long guided one (base: CFG 4 against a negative prompt, three rows of
    three lengths) share every call, their prefixes padded and masked; each within 2/255 of the
    pipeline's RGBA image, and the short one the same alone."""
    short = pipeline.resolve(ask("a red circle", 3, steps, turbo))
    long = pipeline.resolve(ask(LONG, 4, steps, turbo, guidance_scale=4.0, negative_prompt="blurry"))
    states = pipeline.start([short, long])
    try:
        pipeline.step(states)  # the first call: every row's prefix run and kept
        assert all(PREFIX_KV in s.extras for s in states)
        assert len(group_states(states)) == 1  # kept at one padded length: they keep sharing calls
    finally:
        for state in states:
            state.close()
    images = pipeline.generate([short, long])
    for image, request in zip(images, (short, long), strict=True):
        assert image.shape == (TALL, WIDE, 4)
        assert close(image, theirs(reference, request, turbo))
    assert np.abs(images[0] - pipeline.generate([short])[0]).max() < 1e-3


def test_the_kept_prefix_equals_recomputing_it_and_the_pipelines_cache_on_and_off(
    pipeline, reference, turbo
) -> None:
    """At a request's second step, the call on its kept prefix keys and values predicts what a
    call recomputing the prefix predicts (float32, 1e-5); and our image is the pipeline's with its
    KV cache on and with it off."""
    request = pipeline.resolve(ask(LONG, 5, 4, turbo, guidance_scale=3.0, negative_prompt="dull"))
    (state,) = pipeline.start([request])
    try:
        pipeline.step([state])
        with torch.inference_mode(), pipeline.pool.scope() as batch:
            cached = pipeline.stacked([state], batch)
            fresh = replace(
                cached, conditioning={k: v for k, v in cached.conditioning.items() if k not in HELD}
            )
            plan = pipeline.call_plan([state])
            assert PREFIX_MASK in cached.conditioning and PREFIX_KV not in fresh.conditioning
            kept, recomputed = (pipeline.forward(x, plan).out for x in (cached, fresh))
        assert (kept - recomputed).abs().max() < 1e-5
    finally:
        state.close()
    (mine,) = pipeline.generate([request])
    for on in (True, False):
        assert close(mine, theirs(reference, request, turbo, use_kv_cache=on))


def test_an_edit_with_two_rgba_images_equals_the_pipelines(pipeline, reference, turbo) -> None:
    """Two RGBA images (a disc, a strip fading to transparent): over white for Qwen3-VL, RGBA for
    the VAE, their latent tokens in their vision slots; at the requested size's area."""
    disc, strip = condition_images()
    edit = pipeline.resolve(ask("make it blue", 6, 3, turbo, edit=Edit(disc, more=(strip,))))
    (image,) = pipeline.generate([edit])
    assert close(image, theirs(reference, edit, turbo))
    unsized = pipeline.resolve(GenerationRequest("make it blue", edit=Edit(disc, more=(strip,))))
    assert (unsized.width, unsized.height) == (1440, 736)  # the last image (2:1) at 1024², in 32s


def test_two_stages_and_a_sequence_group_equal_one_device(pipeline, folder, turbo) -> None:
    """A guided prompt (rows of two prefix lengths) and an edit: the first call whole, the cached
    ones with the target's tokens and the prefix's keys split over the group."""
    disc, strip = condition_images()
    requests = [
        pipeline.resolve(ask(LONG, 3, 3, turbo, guidance_scale=4.0, negative_prompt="blurry")),
        pipeline.resolve(ask("make it blue", 6, 3, turbo, edit=Edit(disc, more=(strip,)))),
    ]
    mine = [pipeline.generate([r])[0] for r in requests]
    two = Pipeline.load(folder, devices="cpu,cpu", strategy="even")
    assert len(two.shard.plan.stages) == 2
    lane = sequence_lane(folder)
    for other in (two, lane):
        for request, image in zip(requests, mine, strict=True):
            assert np.abs(other.generate([request])[0] - image).max() * 255 <= 2
    assert lane.lane.groups.calls > 0  # the cached calls ran as a sequence group


def test_a_lora_row_and_a_first_block_cached_row_beside_plain_ones(
    pipeline, reference, folder, turbo, tmp_path
) -> None:
    """A rank-4 LoRA on every block's attention (its prefix keys and values made with it), asked by
    one row beside a plain one, within 2/255 of the pipeline after load_lora_weights; a
    first-block-cached row steps beside a plain one as alone, reusing steps."""
    style = random_transformer_lora(QwenImage21Transformer2DModel, folder, tmp_path / "style.safetensors")
    pipeline.add_adapter(read_adapter("style", style, pipeline.family))
    styled = pipeline.resolve(ask("a red circle", 3, 3, turbo, lora=(("style", 0.8),)))
    plain = pipeline.resolve(ask(LONG, 4, 3, turbo))
    mine, beside = pipeline.generate([styled, plain])
    assert np.abs(beside - pipeline.generate([plain])[0]).max() < 1e-3
    assert np.abs(mine - pipeline.generate([replace(styled, lora=())])[0]).max() * 255 > 2  # it adapts
    reference.load_lora_weights(style, adapter_name="style")
    reference.set_adapters(["style"], [0.8])
    try:
        assert close(mine, theirs(reference, styled, turbo))
    finally:
        reference.delete_adapters(["style"])

    base = ask("a red circle", 7, 8, turbo)
    cached = pipeline.resolve(replace(base, step_cache=StepCache("first_block", threshold=100.0)))
    other = pipeline.resolve(replace(base, prompt=LONG, seed=8))
    alone = [pipeline.generate([r])[0] for r in (cached, other)]
    states, reused = pipeline.start([cached, other]), 0
    try:
        while not states[0].done:
            pipeline.step(states)
            reused += states[0].cache.last == "reused"
        pipeline.decode(states)
        together = [s.image.numpy() for s in states]
    finally:
        for state in states:
            state.close()
    assert reused > 0
    for one, two in zip(alone, together, strict=True):
        assert np.abs(one - two).max() < 1e-3


def test_the_served_png_keeps_the_alpha_and_opaque_composites_over_white(folder, reference, turbo) -> None:
    """Over the openai SDK: `images.generate` gives an RGBA PNG within 2/255 of the pipeline's
    RGBA; `background: "opaque"` gives RGB, the same over white; a two-image edit equals the
    pipeline's; JPEG with `transparent` is refused naming the field."""
    request = ask("a red circle", 3, 3, turbo)
    expected = theirs(reference, request, turbo)
    disc, strip = condition_images()
    edit = ask("make it blue", 6, 3, turbo, edit=Edit(disc, more=(strip,)))
    expected_edit = theirs(reference, edit, turbo)
    extra = {"seed": request.seed, "num_inference_steps": request.steps}
    with live_server("--model", str(folder)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        size = f"{WIDE}x{TALL}"
        made = client.images.generate(prompt=request.prompt, size=size, extra_body=extra)
        opaque = client.images.generate(
            prompt=request.prompt, size=size, background="opaque", extra_body=extra
        )
        files = []
        for image in (disc, strip):
            data = io.BytesIO()
            image.save(data, format="PNG")
            files.append(("image.png", data.getvalue(), "image/png"))
        edited = client.images.edit(
            image=files,
            prompt=edit.prompt,
            size=size,
            extra_body={"seed": 6, "num_inference_steps": edit.steps},
        )
        with pytest.raises(openai.BadRequestError) as refused:
            client.images.generate(prompt="x", size=size, background="transparent", output_format="jpeg")
        models = client.models.list().data
    assert made.background == "transparent" and opaque.background == "opaque"
    served = _png(made)
    assert served.shape == (TALL, WIDE, 4)
    assert np.abs(served - (expected * 255).round()).max() <= 2
    white = expected[..., :3] * expected[..., 3:] + (1 - expected[..., 3:])
    assert _png(opaque).shape == (TALL, WIDE, 3)
    assert np.abs(_png(opaque) - (white * 255).round()).max() <= 2
    assert np.abs(_png(edited) - (expected_edit * 255).round()).max() <= 2
    assert refused.value.body["param"] == "background"
    assert models  # the service answered throughout


def _png(response) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(response.data[0].b64_json)))).astype(float)


def test_refusals(pipeline, folder, turbo, tmp_path) -> None:
    """A mask (edits by reference), more image tokens than the prompt holds, the Turbo's other
    step counts, and a transformer without `causal_condition` (no prefix to keep) at load."""
    disc, _ = condition_images()
    with pytest.raises(InvalidRequest) as masked:
        pipeline.resolve(ask("x", 1, 3, turbo, edit=Edit(disc, mask=Image.new("L", disc.size, 255))))
    assert masked.value.field == "mask"
    many = GenerationRequest("x", width=1024, height=1024, edit=Edit(disc, more=(disc,) * 3))
    with pytest.raises(InvalidRequest, match="3584") as crowded:  # 4 × 1024 vision tokens at 1024²
        pipeline.resolve(replace(many, steps=len(TURBO_SIGMAS) if turbo else 3))
    assert crowded.value.field == "image"
    if turbo:
        with pytest.raises(InvalidRequest) as steps:
            pipeline.resolve(replace(ask("x", 1, 3, turbo), steps=len(TURBO_SIGMAS) + 1))
        assert steps.value.field == "steps"
        return
    changed = tmp_path / "changed"
    changed.mkdir()
    for part in folder.iterdir():
        (changed / part.name).symlink_to(part)
    (changed / "transformer").unlink()
    (changed / "transformer").mkdir()
    config = json.loads((folder / "transformer" / "config.json").read_text()) | {"causal_condition": False}
    (changed / "transformer" / "config.json").write_text(json.dumps(config))
    for weights in (folder / "transformer").glob("*.safetensors"):
        (changed / "transformer" / weights.name).symlink_to(weights)
    with pytest.raises(ModelFolderError, match="causal_condition"):
        read_family(changed).check_configs(str(changed))
