"""ControlNets for the tiny folders, saved as diffusers saves them, and diffusers' own controlled
image to compare with."""

from __future__ import annotations

import base64
import io
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import (
    ControlNetModel,
    MultiControlNetModel,
    StableDiffusionControlNetImg2ImgPipeline,
    StableDiffusionControlNetInpaintPipeline,
    StableDiffusionControlNetPipeline,
    UNet2DConditionModel,
)
from PIL import Image

from server.requests import GenerationRequest
from server.requests.control import Control
from server.requests.edit import Edit
from tests.support.images import drawn, left_half_mask, source_image
from tests.support.tiny_pipelines import IMAGE_SIZE, diffusers_image

# The pipeline: images against diffusers' ControlNet pipelines on the tiny SD-1.5 folder (its VAE
# halves the size: the ControlNet's conditioning embedding downsamples by 2).
GUIDED = GenerationRequest("a red circle", negative_prompt="blue", seed=3, steps=4, guidance_scale=4.0)


def folder_controlnet(folder: Path, seed: int) -> ControlNetModel:
    unet = UNet2DConditionModel.from_pretrained(folder / "unet")
    torch.manual_seed(seed)
    net = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(8, 16)).eval()
    for zero in [*net.controlnet_down_blocks, net.controlnet_mid_block]:
        torch.nn.init.normal_(zero.weight, std=0.3)
    return net


def diffusers_controlled(
    folder: Path,
    nets: list[ControlNetModel],
    controls: list[Control],
    kind=StableDiffusionControlNetPipeline,
    **edit: Any,
) -> np.ndarray:
    """What diffusers' ControlNet pipeline `kind` draws for GUIDED with `controls` (and `edit`:
    an edit pipeline's image, mask and strength, its control image as `control_image`)."""
    net = nets[0] if len(nets) == 1 else MultiControlNetModel(nets)
    pipe = kind.from_pretrained(
        folder, controlnet=net, local_files_only=True, use_safetensors=True, safety_checker=None
    )
    pipe.set_progress_bar_config(disable=True)
    one = len(controls) == 1
    control = controls[0].image if one else [c.image for c in controls]
    images = {"image": edit.pop("image"), "control_image": control} if edit else {"image": control}
    return diffusers_image(
        pipe, replace(GUIDED, width=IMAGE_SIZE, height=IMAGE_SIZE), **images, **edit,
        controlnet_conditioning_scale=controls[0].scale if one else [c.scale for c in controls],
        control_guidance_start=controls[0].start if one else [c.start for c in controls],
        control_guidance_end=controls[0].end if one else [c.end for c in controls],
    )  # fmt: skip


ASKED = {  # what the pipeline tests and the HTTP ones each compare with diffusers
    "one": [Control("a", drawn("circle"), 0.8)],
    "two at once": [Control("a", drawn("circle"), 0.5), Control("b", drawn("square"), 1.0)],
    "a window": [Control("b", drawn("square"), 1.0, start=0.25, end=0.75)],
}


EDITED = {  # control with an edit: img2img (a window over the steps its strength leaves), inpainting
    "img2img": (Edit(source_image(), None, 0.75, keep_unmasked=False), ASKED["a window"]),
    "inpainting": (Edit(source_image(), left_half_mask(), 0.75, keep_unmasked=False), ASKED["one"]),
}


EDIT_PIPELINES = {
    "img2img": StableDiffusionControlNetImg2ImgPipeline,
    "inpainting": StableDiffusionControlNetInpaintPipeline,
}


def png_bytes(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def png_base64(image: Image.Image) -> str:
    return base64.b64encode(png_bytes(image)).decode()


def wire(control: Control, data_url: bool = False) -> dict:
    image = png_base64(control.image)
    return {
        "model": control.model,
        "image": f"data:image/png;base64,{image}" if data_url else image,
        "scale": control.scale,
        "start": control.start,
        "end": control.end,
    }
