"""Qwen-Image ControlNets (block residuals) per row: tiny `QwenImageControlNetModel`s built from the
tiny Qwen-Image folder's transformer (1 layer against its 2 blocks, so one sample feeds both, as
forward spreads it; their zero layers drawn at random: zeros would prove nothing). Our pipeline,
over two stages, equals diffusers' QwenImageControlNetPipeline with true CFG on (its negative pass
reuses the positive pass's residuals: so do ours), for one net, two controls at once (of one net:
diffusers' Multi-ControlNet for Qwen-Image takes a single union net) and a start/end window; a
batch of controlled and plain rows gives each row's image alone."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import (
    QwenImageControlNetModel,
    QwenImageControlNetPipeline,
    QwenImageMultiControlNetModel,
    QwenImageTransformer2DModel,
)

from server.pipeline import Pipeline
from server.pipeline.conditioning.controlnets import ControlNets
from server.requests import GenerationRequest
from server.requests.control import Control
from tests.support.images import drawn

TOLERANCE = 2 / 255
REQUEST = GenerationRequest(
    "a red circle", negative_prompt="blurry", true_cfg_scale=3.0, seed=3, steps=4, width=32, height=32
)


def qwen_controlnet(folder: Path, seed: int) -> QwenImageControlNetModel:
    transformer = QwenImageTransformer2DModel.from_pretrained(folder / "transformer")
    config = transformer.config
    net = QwenImageControlNetModel.from_transformer(
        transformer, num_layers=1, attention_head_dim=config.attention_head_dim,
        num_attention_heads=config.num_attention_heads,
    )  # fmt: skip
    torch.manual_seed(seed)
    for zero in [*net.controlnet_blocks, net.controlnet_x_embedder]:
        torch.nn.init.normal_(zero.weight, std=0.2)
    return net.eval()


@pytest.fixture(scope="module")
def qwen_controlled(tiny_folder: Callable[[str], Path]) -> tuple[Path, Pipeline, dict]:
    """The tiny Qwen-Image folder (the session's); our pipeline over two stages serving nets "a" and "b"."""
    folder = tiny_folder("qwen-image")
    nets = {"a": qwen_controlnet(folder, 1), "b": qwen_controlnet(folder, 2)}
    pipeline = Pipeline.load(folder, devices="cpu,cpu", strategy="even")
    for name, net in nets.items():
        pipeline.controlnets.add(name, copy.deepcopy(net))
    return folder, pipeline, nets


def theirs(folder: Path, nets: list, controls: list[Control], request: GenerationRequest) -> np.ndarray:
    """diffusers' image; several controls as its Multi-ControlNet takes them: one net's, summed."""
    one = len(controls) == 1
    assert one or len({id(n) for n in nets}) == 1, "QwenImageMultiControlNetModel takes one net"
    net = nets[0] if one else QwenImageMultiControlNetModel(nets[:1])
    pipe = QwenImageControlNetPipeline.from_pretrained(folder, controlnet=net, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        prompt=request.prompt, negative_prompt=request.negative_prompt, true_cfg_scale=request.true_cfg_scale,
        num_inference_steps=request.steps, width=request.width, height=request.height,
        generator=torch.Generator("cpu").manual_seed(request.seed), output_type="np",
        control_image=controls[0].image if one else [c.image for c in controls],
        controlnet_conditioning_scale=controls[0].scale if one else [c.scale for c in controls],
        control_guidance_start=controls[0].start if one else [c.start for c in controls],
        control_guidance_end=controls[0].end if one else [c.end for c in controls],
    ).images[0]  # fmt: skip


ASKED = {
    "one": [Control("a", drawn("circle"), 0.8)],
    "two at once": [Control("a", drawn("circle"), 0.5), Control("a", drawn("square"), 1.0)],
    "a window": [Control("b", drawn("square"), 1.0, start=0.25, end=0.75)],
}


@pytest.mark.parametrize("asked", list(ASKED.values()), ids=list(ASKED))
def test_images_equal_diffusers_qwen_image_controlnet_pipeline(qwen_controlled, asked: list[Control]) -> None:
    folder, pipeline, nets = qwen_controlled
    request = pipeline.resolve(replace(REQUEST, control=tuple(asked)))
    ours = pipeline.generate([request])[0]
    reference = theirs(folder, [nets[c.model] for c in asked], asked, request)
    plain = pipeline.generate([replace(request, control=())])[0]
    assert np.abs(ours - reference).max() < TOLERANCE, np.abs(ours - reference).max()
    assert np.abs(ours - plain).max() > 0.05  # the control steered the image
    assert float(ours.std()) > 0.05  # not a flat image: the comparison means something


def test_controlled_and_plain_rows_in_one_call_each_give_their_image_alone(qwen_controlled) -> None:
    """A guided request with "a", an unguided one with "b" and a plain one, stepped together:
    each draws its image alone within 1e-3, and "a" runs on its positive row only."""
    _, pipeline, _ = qwen_controlled
    three = [
        replace(REQUEST, control=(Control("a", drawn("circle"), 0.8),)),
        replace(REQUEST, seed=4, negative_prompt=None, control=(Control("b", drawn("square"), 1.0),)),
        replace(REQUEST, seed=5),
    ]
    alone = [pipeline.generate([request])[0] for request in three]
    rows: dict[str, list[int]] = {"a": [], "b": []}
    hooks = [
        pipeline.controlnets.loaded[n].register_forward_pre_hook(
            lambda _m, args, kwargs, n=n: rows[n].append(kwargs["hidden_states"].shape[0]), with_kwargs=True
        )
        for n in rows
    ]
    try:
        together = pipeline.generate(three)
    finally:
        for hook in hooks:
            hook.remove()
    for mine, theirs_alone in zip(together, alone, strict=True):
        assert np.abs(mine - theirs_alone).max() < 1e-3
    assert rows == {"a": [1] * REQUEST.steps, "b": [1] * REQUEST.steps}, rows


def test_qwen_controlnets_another_model_cannot_run_are_refused_naming_why(qwen_controlled) -> None:
    folder, pipeline, nets = qwen_controlled
    transformer = QwenImageTransformer2DModel.from_pretrained(folder / "transformer")
    inpainting = QwenImageControlNetModel.from_transformer(
        transformer, num_layers=1, attention_head_dim=16, num_attention_heads=4, extra_condition_channels=4
    )
    narrow = QwenImageControlNetModel.from_transformer(
        transformer,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=4,
        load_weights_from_transformer=False,
    )
    fresh = ControlNets(pipeline.family, torch.device("cpu"), torch.float32, pipeline.family.config.denoiser)
    for net, says in (
        (inpainting, "an inpainting Qwen-Image ControlNet"),
        (narrow, "its blocks are 32 wide, the transformer's 64"),
        (copy.deepcopy(nets["a"]).to(torch.float32), None),
    ):
        if says is None:
            fresh.add("fine", net)
            continue
        with pytest.raises(ValueError, match=says):
            fresh.add("x", net)
