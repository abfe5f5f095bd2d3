"""ControlNets (block residuals) per row on the DiT families, FLUX.1, Qwen-Image and SD3, each a
row of `CASES`: tiny random nets of the family's class ("a" and "b", tests/support/controlnets.py)
beside its tiny folder, served by our pipeline over two stages. Each family's images equal its
diffusers ControlNet pipeline's for each of its `asked` (one net, two at once, a start/end window);
controlled and plain rows in one call each give their image alone, each net run on its rows only;
nets another model cannot run are refused naming why. FLUX.1 alone: a sequence group cuts the
residuals with the image tokens (its HTTP tests, which start a server, are in
tests/test_controlnet_flux.py).

Qwen-Image runs true CFG: its pipeline's negative pass reuses the positive pass's residuals, and
so do ours; its Multi-ControlNet takes a single union net, so two controls at once are one net's.
SD3's pipeline samples a control image's VAE posterior from torch's global generator, unseeded,
where we take its mode (a seed draws one image): its folder here gets a narrow posterior (the VAE's
log-variance channels biased to -30, as a trained VAE's are narrow), so the two agree."""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import (
    AutoencoderKL,
    FluxControlNetPipeline,
    FluxMultiControlNetModel,
    QwenImageControlNetModel,
    QwenImageControlNetPipeline,
    QwenImageMultiControlNetModel,
    QwenImageTransformer2DModel,
    SD3MultiControlNetModel,
    StableDiffusion3ControlNetPipeline,
)
from torch import nn

from server.pipeline import Pipeline
from server.pipeline.conditioning.controlnets import ControlNets
from server.requests import GenerationRequest
from server.requests.control import Control
from tests.support.controlnets import (
    ASKED,
    diffusers_dit_controlled,
    flux_controlnet,
    qwen_image_controlnet,
    sd3_controlnet,
)
from tests.support.images import drawn

Config = Mapping[str, Any]
Refusals = Callable[[Path, Config], dict[str, Config]]  # (its folder, net "a"'s config)


@dataclass(frozen=True)
class Case:
    """A DiT family's ControlNet setup and what it is held to."""

    folder: Callable[[pytest.FixtureRequest], Path]  # its tiny folder, from conftest's fixtures
    net: Callable[[Path, int], nn.Module]  # a random net of its class for the folder, by seed
    reference: type  # diffusers' ControlNet pipeline
    multi: Callable[[list[nn.Module]], nn.Module]  # diffusers' Multi-ControlNet over several nets
    knobs: Callable[[GenerationRequest], dict[str, Any]]  # the reference's guidance arguments
    request: GenerationRequest
    asked: dict[str, list[Control]]  # the controls each image comparison asks for
    together: tuple[GenerationRequest, ...]  # stepped in one call: "a", "b" and plain rows
    rows: dict[str, int]  # the rows each one of those calls gives the transformer and each net
    entry: str  # the first layer of its transformer and nets, which sees a call's rows
    refused: Refusals  # configs it refuses, by what the refusal says
    takes: str  # what refusing a UNet ControlNet says
    loads: Mapping[str, Any] = field(default_factory=dict)  # the reference's from_pretrained extras
    tolerance: float = 2 / 255


def narrow_posterior(request: pytest.FixtureRequest) -> Path:
    """conftest's tiny SD3 folder, copied with its VAE's posterior narrowed (log-variance -30)."""
    folder = request.getfixturevalue("tmp_path_factory").mktemp("sd3-control") / "sd3"
    shutil.copytree(request.getfixturevalue("sd3_folder"), folder)
    vae = AutoencoderKL.from_pretrained(folder / "vae")
    with torch.no_grad():
        vae.encoder.conv_out.bias[vae.config.latent_channels :] = -30.0  # log-variance: std e⁻¹⁵
    vae.save_pretrained(folder / "vae", safe_serialization=True)
    return folder


def one_union_net(nets: list[nn.Module]) -> nn.Module:
    """QwenImageMultiControlNetModel takes one (union) net for all its controls."""
    assert len({id(n) for n in nets}) == 1, "QwenImageMultiControlNetModel takes one net"
    return QwenImageMultiControlNetModel(nets[:1])


def qwen_image_refused(folder: Path, config: Config) -> dict[str, Config]:
    """Nets diffusers builds from the transformer: an inpainting one (mask channels) and a narrow one."""
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
    return {
        "an inpainting Qwen-Image ControlNet": inpainting.config,
        "its blocks are 32 wide, the transformer's 64": narrow.config,
    }


def guided(r: GenerationRequest) -> dict[str, Any]:
    return {"negative_prompt": r.negative_prompt, "guidance_scale": r.guidance_scale}


FLUX = GenerationRequest("a red circle", seed=3, steps=4, guidance_scale=3.5, width=32, height=32)
QWEN_IMAGE = GenerationRequest(
    "a red circle", negative_prompt="blurry", true_cfg_scale=3.0, seed=3, steps=4, width=32, height=32
)
SD3 = GenerationRequest("a red circle", seed=3, steps=3, guidance_scale=4.0, width=32, height=32)
CIRCLE, SQUARE = drawn("circle"), drawn("square")
CASES = {
    "flux": Case(
        folder=lambda request: request.getfixturevalue("flux_folder"),
        net=flux_controlnet,
        reference=FluxControlNetPipeline,
        multi=FluxMultiControlNetModel,
        knobs=guided,
        request=FLUX,
        asked=ASKED,
        together=(
            replace(FLUX, control=(Control("a", CIRCLE, 0.5),)),
            replace(FLUX, seed=4, control=(Control("b", SQUARE, 1.0),)),
            replace(FLUX, seed=5),
        ),
        rows={"transformer": 3, "a": 1, "b": 1},
        entry="x_embedder",
        refused=lambda _folder, config: {
            "XLabs-style": {**config, "conditioning_embedding_channels": 16},
            "union FLUX ControlNet": {**config, "num_mode": 4},
            "blocks are 64 wide": {**config, "num_attention_heads": 4},
            "its joint_attention_dim": {**config, "joint_attention_dim": 7},
        },
        takes="a flux model takes FluxControlNetModel",
    ),
    "qwen-image": Case(
        folder=lambda request: request.getfixturevalue("tiny_folder")("qwen-image"),
        net=qwen_image_controlnet,
        reference=QwenImageControlNetPipeline,
        multi=one_union_net,
        knobs=lambda r: {"negative_prompt": r.negative_prompt, "true_cfg_scale": r.true_cfg_scale},
        request=QWEN_IMAGE,
        asked={**ASKED, "two at once": [Control("a", CIRCLE, 0.5), Control("a", SQUARE, 1.0)]},
        together=(  # a guided row with "a" (run on its positive row alone), an unguided one with "b"
            replace(QWEN_IMAGE, control=(Control("a", CIRCLE, 0.8),)),
            replace(QWEN_IMAGE, seed=4, negative_prompt=None, control=(Control("b", SQUARE, 1.0),)),
            replace(QWEN_IMAGE, seed=5),
        ),
        rows={"transformer": 5, "a": 1, "b": 1},
        entry="img_in",
        refused=qwen_image_refused,
        takes="a qwen-image model takes QwenImageControlNetModel",
    ),
    "sd3": Case(
        folder=narrow_posterior,
        net=sd3_controlnet,
        reference=StableDiffusion3ControlNetPipeline,
        multi=SD3MultiControlNetModel,
        knobs=guided,
        request=SD3,
        asked=ASKED,
        together=(  # a guided row with "a" (run on both rows of its pair), an unguided one with "b"
            replace(SD3, control=(Control("a", CIRCLE, 0.5),)),
            replace(SD3, seed=4, guidance_scale=1.0, control=(Control("b", SQUARE, 1.0),)),
            replace(SD3, seed=5),
        ),
        rows={"transformer": 5, "a": 2, "b": 1},
        entry="pos_embed",
        refused=lambda _folder, config: {
            "extra conditioning channels": {**config, "extra_conditioning_channels": 1},
            "without a position embedding": {**config, "use_pos_embed": False},
            "blocks are 64 wide": {**config, "num_attention_heads": 8},
            "its pooled_projection_dim": {**config, "pooled_projection_dim": 7},
        },
        takes="a sd3 model takes SD3ControlNetModel",
        loads=dict.fromkeys(("text_encoder_3", "tokenizer_3", "image_encoder", "feature_extractor")),
    ),
}


@dataclass(frozen=True)
class Controlled:
    """A family's folder, our pipeline over two stages serving its nets "a" and "b", and the nets."""

    case: Case
    folder: Path
    pipeline: Pipeline
    nets: dict[str, nn.Module]


@pytest.fixture(scope="module")
def made() -> dict[str, Controlled]:
    """Each family's `Controlled`, built the first time a test of the module asks for it."""
    return {}


def controlled(name: str, request: pytest.FixtureRequest, made: dict[str, Controlled]) -> Controlled:
    if name not in made:
        case = CASES[name]
        folder = case.folder(request)
        nets = {"a": case.net(folder, 1), "b": case.net(folder, 2)}
        pipeline = Pipeline.load(folder, devices="cpu,cpu", strategy="even")
        for net_name, net in nets.items():
            pipeline.controlnets.add(net_name, copy.deepcopy(net))
        made[name] = Controlled(case, folder, pipeline, nets)
    return made[name]


@pytest.fixture(scope="module", params=sorted(CASES))
def family(request: pytest.FixtureRequest, made: dict[str, Controlled]) -> Controlled:
    return controlled(request.param, request, made)


@pytest.fixture(scope="module")
def flux(request: pytest.FixtureRequest, made: dict[str, Controlled]) -> Controlled:
    return controlled("flux", request, made)


@pytest.mark.parametrize(
    ("family", "asked"),
    [
        pytest.param(name, asked, id=f"{name}-{asked}")
        for name in sorted(CASES)
        for asked in CASES[name].asked
    ],
    indirect=["family"],
)
def test_images_equal_diffusers_controlnet_pipeline(family: Controlled, asked: str) -> None:
    """Our image for each of the family's `asked` equals diffusers' within the tolerance, and is one
    the control steered (far from the plain image) and not flat (the comparison means something)."""
    case, pipeline = family.case, family.pipeline
    controls = case.asked[asked]
    request = pipeline.resolve(replace(case.request, control=tuple(controls)))
    ours = pipeline.generate([request])[0]
    nets = [family.nets[c.model] for c in controls]
    reference = diffusers_dit_controlled(
        case.reference, case.multi, family.folder, nets, controls, request, case.loads, **case.knobs(request)
    )
    plain = pipeline.generate([pipeline.resolve(case.request)])[0]
    assert np.abs(ours - reference).max() < case.tolerance, np.abs(ours - reference).max()
    assert np.abs(ours - plain).max() > 0.05  # the control steered the image
    assert float(ours.std()) > 0.05, "a flat image would hide differences"


def test_controlled_and_plain_rows_in_one_call_each_give_their_image_alone(family: Controlled) -> None:
    """A row with "a", one with "b" and a plain one, stepped together: each its image alone within
    1e-3; each step one transformer call of all rows, each net one call of its rows (the `rows` of
    its case: a guided pair's both, or its positive row where the family reuses them)."""
    case, pipeline = family.case, family.pipeline
    three = [pipeline.resolve(r) for r in case.together]
    alone = [pipeline.generate([r])[0] for r in three]
    modules = {"transformer": pipeline.shard.model, **pipeline.controlnets.loaded}
    rows: dict[str, list[int]] = {name: [] for name in case.rows}
    hooks = [
        getattr(modules[name], case.entry).register_forward_pre_hook(
            lambda _m, args, name=name: rows[name].append(args[0].shape[0])
        )
        for name in rows
    ]
    try:
        together = pipeline.generate(three)
    finally:
        for hook in hooks:
            hook.remove()
    for mine, alone_image in zip(together, alone, strict=True):
        assert np.abs(mine - alone_image).max() < 1e-3
    assert rows == {name: [n] * case.request.steps for name, n in case.rows.items()}, rows


def test_controlnets_another_model_cannot_run_are_refused_naming_why(family: Controlled) -> None:
    """Each of the family's `refused` configs is refused saying why, a UNet's ControlNet naming the
    class the family takes; a net of its own class made for the folder is added."""
    case, pipeline = family.case, family.pipeline
    controlnets = ControlNets(
        pipeline.family, torch.device("cpu"), torch.float32, pipeline.shard.model.config
    )
    config = dict(family.nets["a"].config)
    net_class = type(family.nets["a"]).__name__
    for says, bad in case.refused(family.folder, config).items():
        with pytest.raises(ValueError, match=says):
            controlnets._fits("x", net_class, bad)
    with pytest.raises(ValueError, match=case.takes):
        controlnets._fits("x", "ControlNetModel", config)
    controlnets.add("fine", copy.deepcopy(family.nets["a"]).to(torch.float32))
    assert list(controlnets.loaded) == ["fine"]


def test_a_flux_sequence_group_cuts_the_residuals_with_the_image_tokens(flux: Controlled) -> None:
    """A group of two (every call: `--parallel sequence`) cuts a ControlNet's residuals with the
    image tokens they add to: the controlled image of one worker, every step a group call."""
    from tests.support.denoisers import sequence_lane

    request = flux.pipeline.resolve(replace(FLUX, control=tuple(ASKED["two at once"])))
    lane = sequence_lane(flux.folder)
    for name, net in flux.nets.items():
        lane.controlnets.add(name, copy.deepcopy(net))
    grouped = lane.generate([request])[0]
    assert float(np.abs(grouped - flux.pipeline.generate([request])[0]).max()) * 255 <= 2
    assert lane.lane.groups.calls == FLUX.steps
