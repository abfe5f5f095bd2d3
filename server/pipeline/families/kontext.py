"""FLUX.1 Kontext [dev] (`FluxKontextPipeline`): FLUX.1-dev's transformer, encoders, VAE and
schedule, editing by instruction. The edit's image conditions every step as tokens of its own:
resized as the pipeline resizes it by default (to the preferred ~1 MP resolution nearest its
aspect, then to a multiple of 16), encoded by the VAE (its posterior's mode), shifted and scaled,
packed as the noise is and appended after the noise's tokens at positions whose first index is 1
(`server/engine/denoisers/flux.py`); the prediction is the noise's tokens alone. Guidance is
embedded (`guidance_scale`, one row), true CFG a second row with a negative prompt.

The output's size is the request's (`size`): the pipeline's `max_area` follows height × width,
so its rescaling to that area leaves the size as asked; a request that names none gets the
pipeline's default, 1024². Every request edits an image: generation without one is refused.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from diffusers.image_processor import VaeImageProcessor
from torch import nn

from server.engine.denoisers.blocks import REFERENCE_IDS, REFERENCES
from server.engine.denoisers.flux import image_ids, pack
from server.errors import InvalidRequest
from server.pipeline.families.flux import FLUX1, Flux


class FluxKontext(Flux):
    name: ClassVar[str] = "flux-kontext"
    pipeline_classes: ClassVar[tuple[str, ...]] = ("FluxKontextPipeline",)
    edits_by_reference: ClassVar[bool] = True
    controlnets: ClassVar[tuple[str, ...]] = ()  # a ControlNet's residuals would meet the image's tokens
    reference_configs: ClassVar[dict[str, dict[str, Any]]] = {
        "flux-kontext-dev": {**FLUX1, "guidance_embeds": True},  # black-forest-labs/FLUX.1-Kontext-dev
    }

    def edit_size(self, edit: Any) -> tuple[int, int]:
        """The pipeline's default output, whatever the image: its default sample size, square."""
        return self.native_size, self.native_size

    def check_request(self, request: Any) -> None:
        if request.edit is None:
            raise InvalidRequest(
                "image",
                "FLUX.1 Kontext edits an image by instruction: send one to /v1/images/edits",
            )
        if request.edit.more:
            raise InvalidRequest("image", "FLUX.1 Kontext edits one image a request")
        if request.edit.mask is not None:
            raise InvalidRequest("mask", "FLUX.1 Kontext edits by instruction: it takes no mask")
        side = self.vae_scale_factor * 2  # the pipeline rounds the image down to it (0: a 0/0 aspect)
        if min(request.edit.image.size) < side:
            raise InvalidRequest("image", f"must be at least {side} pixels a side for FLUX.1 Kontext")

    def references(self, vae: nn.Module, request: Any, rows: int) -> tuple[dict[str, torch.Tensor], tuple]:
        """FluxKontextPipeline's image latents: the image at the preferred resolution nearest its
        aspect (its `_auto_resize`), to a multiple of 16, encoded (mode), shifted and scaled,
        packed, at positions (1, row, column); the same on every row."""
        # imported here: the pipeline's module imports CLIP's image processor, which warns without
        # torchvision, at every start of every family
        from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

        if request.edit is None:
            return {}, ()
        multiple = self.vae_scale_factor * 2
        processor = VaeImageProcessor(vae_scale_factor=multiple)
        image = request.edit.image
        height, width = processor.get_default_height_width(image)
        aspect = width / height
        _, width, height = min((abs(aspect - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
        width, height = width // multiple * multiple, height // multiple * multiple
        pixels = processor.preprocess(processor.resize(image, height, width), height, width)
        device = next(vae.parameters()).device
        latents = self.scale_latents(vae.encode(pixels.to(device, vae.dtype)).latent_dist.mode())
        h, w = latents.shape[-2:]
        ids = image_ids(h, w, latents.device, torch.float32)
        ids[:, 0] = 1  # the image's positions: the noise's, their first index 1
        conditioning = {REFERENCES: pack(latents), REFERENCE_IDS: ids[None]}
        return {k: v.expand(rows, -1, -1) for k, v in conditioning.items()}, ((h, w),)
