"""SD3 ControlNets (block residuals) per row: tiny `SD3ControlNetModel`s built from the tiny SD3
folder's transformer (2 layers against its 3 blocks: sample int(i / 1.5) for block i, none for
the last, as forward adds them; their zero layers drawn at random). Our pipeline, over two
stages, equals diffusers' StableDiffusion3ControlNetPipeline within 2/255 for one net, two at
once and a window.

diffusers samples a control image's VAE posterior from torch's global generator, unseeded, and
we take its mode (a seed draws one image): the folder's VAE here has a narrow posterior (its
log-variance channels biased to -30, as a trained VAE's are narrow), so the two agree."""

from __future__ import annotations

import copy
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import (
    AutoencoderKL,
    SD3ControlNetModel,
    SD3MultiControlNetModel,
    SD3Transformer2DModel,
    StableDiffusion3ControlNetPipeline,
)

from server.pipeline import Pipeline
from server.pipeline.conditioning.controlnets import ControlNets
from server.requests import GenerationRequest
from server.requests.control import Control
from tests.support.images import drawn
from tests.support.tiny_pipelines import diffusers_image

TOLERANCE = 2 / 255
REQUEST = GenerationRequest("a red circle", seed=3, steps=3, guidance_scale=4.0, width=32, height=32)


def sd3_controlnet(folder: Path, seed: int) -> SD3ControlNetModel:
    """As `SD3ControlNetModel.from_transformer` makes one (which writes into the transformer's
    frozen config), with 2 layers and no extra conditioning channels."""
    transformer = SD3Transformer2DModel.from_pretrained(folder / "transformer")
    net = SD3ControlNetModel.from_config(
        {**transformer.config, "num_layers": 2, "extra_conditioning_channels": 0}
    )
    for part in ("pos_embed", "time_text_embed", "context_embedder"):
        getattr(net, part).load_state_dict(getattr(transformer, part).state_dict())
    net.transformer_blocks.load_state_dict(transformer.transformer_blocks.state_dict(), strict=False)
    torch.manual_seed(seed)
    for zero in [*net.controlnet_blocks, net.pos_embed_input.proj]:
        torch.nn.init.normal_(zero.weight, std=0.3)
    return net.eval()


@pytest.fixture(scope="module")
def sd3_controlled(sd3_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Pipeline, dict]:
    """The tiny SD3 folder with a narrow VAE posterior; our pipeline over two stages serving "a", "b"."""
    folder = tmp_path_factory.mktemp("sd3-control") / "sd3"
    shutil.copytree(sd3_folder, folder)
    vae = AutoencoderKL.from_pretrained(folder / "vae")
    with torch.no_grad():
        vae.encoder.conv_out.bias[vae.config.latent_channels :] = -30.0  # log-variance: std e⁻¹⁵
    vae.save_pretrained(folder / "vae", safe_serialization=True)
    nets = {"a": sd3_controlnet(folder, 1), "b": sd3_controlnet(folder, 2)}
    pipeline = Pipeline.load(folder, devices="cpu,cpu", strategy="even")
    for name, net in nets.items():
        pipeline.controlnets.add(name, copy.deepcopy(net))
    return folder, pipeline, nets


ASKED = {
    "one": [Control("a", drawn("circle"), 0.8)],
    "two at once": [Control("a", drawn("circle"), 0.5), Control("b", drawn("square"), 1.0)],
    "a window": [Control("b", drawn("square"), 1.0, start=0.25, end=0.75)],
}


@pytest.mark.parametrize("asked", list(ASKED.values()), ids=list(ASKED))
def test_images_equal_diffusers_sd3_controlnet_pipeline(sd3_controlled, asked: list[Control]) -> None:
    folder, pipeline, nets = sd3_controlled
    request = pipeline.resolve(replace(REQUEST, control=tuple(asked)))
    ours = pipeline.generate([request])[0]
    one = len(asked) == 1
    net = nets[asked[0].model] if one else SD3MultiControlNetModel([nets[c.model] for c in asked])
    absent = dict.fromkeys(("text_encoder_3", "tokenizer_3", "image_encoder", "feature_extractor"))
    pipe = StableDiffusion3ControlNetPipeline.from_pretrained(
        folder, controlnet=net, **absent, local_files_only=True
    )
    pipe.set_progress_bar_config(disable=True)
    reference = diffusers_image(
        pipe, request,
        control_image=asked[0].image if one else [c.image for c in asked],
        controlnet_conditioning_scale=asked[0].scale if one else [c.scale for c in asked],
        control_guidance_start=asked[0].start if one else [c.start for c in asked],
        control_guidance_end=asked[0].end if one else [c.end for c in asked],
    )  # fmt: skip
    plain = pipeline.generate([pipeline.resolve(REQUEST)])[0]
    assert np.abs(ours - reference).max() < TOLERANCE
    assert np.abs(ours - plain).max() > 0.05  # the control steered the image
    assert float(ours.std()) > 0.05, "a flat image would hide differences"


def test_sd3_controlnets_that_cannot_run_are_refused_naming_why(sd3_controlled) -> None:
    _, pipeline, nets = sd3_controlled
    controlnets = ControlNets(
        pipeline.family, torch.device("cpu"), torch.float32, pipeline.shard.model.config
    )
    config = dict(nets["a"].config)
    cases = {
        "extra conditioning channels": {**config, "extra_conditioning_channels": 1},
        "without a position embedding": {**config, "use_pos_embed": False},
        "blocks are 64 wide": {**config, "num_attention_heads": 8},
        "its pooled_projection_dim": {**config, "pooled_projection_dim": 7},
    }
    for says, bad in cases.items():
        with pytest.raises(ValueError, match=says):
            controlnets._fits("x", "SD3ControlNetModel", bad)
