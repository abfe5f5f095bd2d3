"""ControlNets for the tiny folders, saved as diffusers saves them, and diffusers' own controlled
image to compare with: the UNet families' (SD-1.5, SDXL) and the DiTs' (FLUX.1, Qwen-Image, SD3), whose
nets are built from the folder's transformer with fewer layers than its blocks, so a sample feeds
several blocks as forward spreads them, and their zero layers drawn at random: zeros would prove
nothing."""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import (
    ControlNetModel,
    FluxControlNetModel,
    FluxTransformer2DModel,
    MultiControlNetModel,
    QwenImageControlNetModel,
    QwenImageTransformer2DModel,
    SD3ControlNetModel,
    SD3Transformer2DModel,
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
        pipe,
        replace(GUIDED, width=IMAGE_SIZE, height=IMAGE_SIZE),
        **images,
        **edit,
        controlnet_conditioning_scale=controls[0].scale if one else [c.scale for c in controls],
        control_guidance_start=controls[0].start if one else [c.start for c in controls],
        control_guidance_end=controls[0].end if one else [c.end for c in controls],
    )


def flux_controlnet(folder: Path, seed: int) -> FluxControlNetModel:
    """1 double and 2 single layers against the tiny FLUX.1 transformer's 2 and 3 blocks."""
    transformer = FluxTransformer2DModel.from_pretrained(folder / "transformer")
    config = transformer.config
    net = FluxControlNetModel.from_transformer(
        transformer,
        num_layers=1,
        num_single_layers=2,
        attention_head_dim=config.attention_head_dim,
        num_attention_heads=config.num_attention_heads,
    )
    torch.manual_seed(seed)
    for zero in [*net.controlnet_blocks, *net.controlnet_single_blocks, net.controlnet_x_embedder]:
        torch.nn.init.normal_(zero.weight, std=0.2)
    return net.eval()


def qwen_image_controlnet(folder: Path, seed: int) -> QwenImageControlNetModel:
    """1 layer against the tiny Qwen-Image transformer's 2 blocks: its one sample feeds both."""
    transformer = QwenImageTransformer2DModel.from_pretrained(folder / "transformer")
    config = transformer.config
    net = QwenImageControlNetModel.from_transformer(
        transformer,
        num_layers=1,
        attention_head_dim=config.attention_head_dim,
        num_attention_heads=config.num_attention_heads,
    )
    torch.manual_seed(seed)
    for zero in [*net.controlnet_blocks, net.controlnet_x_embedder]:
        torch.nn.init.normal_(zero.weight, std=0.2)
    return net.eval()


def sd3_controlnet(folder: Path, seed: int) -> SD3ControlNetModel:
    """2 layers against the tiny SD3 transformer's 3 blocks (sample int(i / 1.5) for block i, none
    for the last), as `SD3ControlNetModel.from_transformer` makes one (which writes into the
    transformer's frozen config), with no extra conditioning channels."""
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


def diffusers_dit_controlled(
    reference: type,
    multi: Callable[[list[Any]], Any],
    folder: Path,
    nets: Sequence[Any],
    controls: Sequence[Control],
    request: GenerationRequest,
    loads: Mapping[str, Any] | None = None,
    **knobs: Any,
) -> np.ndarray:
    """What diffusers' DiT ControlNet pipeline `reference` draws for `request` with `controls`, the
    nets each control names (`nets`, in order; several as `multi`, the family's Multi-ControlNet,
    takes them); `loads` go to its `from_pretrained`, `knobs` (its guidance arguments) to its call."""
    one = len(controls) == 1
    net = nets[0] if one else multi(list(nets))
    pipe = reference.from_pretrained(folder, controlnet=net, **(loads or {}), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        prompt=request.prompt,
        num_inference_steps=request.steps,
        width=request.width,
        height=request.height,
        generator=torch.Generator("cpu").manual_seed(request.seed),
        output_type="np",
        **knobs,
        control_image=controls[0].image if one else [c.image for c in controls],
        controlnet_conditioning_scale=controls[0].scale if one else [c.scale for c in controls],
        control_guidance_start=controls[0].start if one else [c.start for c in controls],
        control_guidance_end=controls[0].end if one else [c.end for c in controls],
    ).images[0]


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
