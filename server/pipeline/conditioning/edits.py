"""Image edits: a request that starts from an image (img2img) and may repaint only a masked region
(inpainting), as diffusers' `StableDiffusionImg2ImgPipeline` / `StableDiffusionInpaintPipeline`
(and their SDXL and SD3 versions) run them on a regular denoiser.

An edit is a generation that starts late: the image is encoded by the VAE (a sample of its
posterior, drawn with the request's generator), noised to the timestep `strength` selects, and
denoised for the remaining steps. Each row carries its own timestep, so an edit shares every
denoiser call with generations of its size. Inpainting keeps the image's latents, its noise and
the mask: after each step the unmasked region is put back, noised to the next step's level. Once
decoded, the unmasked pixels are the image's own again (`keep_unmasked`), as diffusers'
`apply_overlay` composites them: the VAE's round trip alone shifts a kept region's colours.

The generator is drawn from in diffusers' order (image posterior, noise, then the masked image's
posterior, which a 4-channel denoiser never reads: drawn and dropped), so schedulers that draw
noise at each step (Euler ancestral) give diffusers' image too.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import torch
from diffusers.image_processor import VaeImageProcessor
from PIL import Image

from server.engine.runtime.pool import PoolScope
from server.pipeline.families import Family
from server.requests.edit import Edit

LATENT_DTYPE = torch.float32  # as pipeline.py: scheduler arithmetic in float32


@dataclass
class Inpainting:
    """What an inpainting request keeps between steps (rented from its scope)."""

    image_latents: torch.Tensor  # [1, C, h, w]: the image, encoded and scaled
    noise: torch.Tensor  # [1, C, h, w]: the noise its latents started from
    mask: torch.Tensor  # [1, 1, h, w]: 1 where the region is repainted


@cache
def _frame_processor(scale: int, resample: str) -> VaeImageProcessor:
    """A first frame's processor (image-to-video): its pipeline's resampling (LTX-2's bilinear)."""
    return VaeImageProcessor(vae_scale_factor=scale, resample=resample)


@cache
def _processors(scale: int) -> tuple[VaeImageProcessor, VaeImageProcessor]:
    image = VaeImageProcessor(vae_scale_factor=scale)
    mask = VaeImageProcessor(
        vae_scale_factor=scale, do_normalize=False, do_binarize=True, do_convert_grayscale=True
    )
    return image, mask


@dataclass
class Start:
    """A request's first latents and what its steps need beside them."""

    latents: torch.Tensor  # [1, C, h, w], rented
    inpainting: Inpainting | None = None  # a regular denoiser's inpainting
    conditioning: torch.Tensor | None = None  # an inpainting denoiser's extra channels: mask, masked image
    first_frame: torch.Tensor | None = None  # latents pasted over the first latent frame (Wan 2.2 TI2V)


def first_latents(
    edit: Edit | None,
    *,
    family: Family,
    vae: torch.nn.Module,
    scheduler,
    first_t: torch.Tensor,
    generator: torch.Generator,
    scope: PoolScope,
    width: int,
    height: int,
    device: torch.device,
    dtype: torch.dtype,
    frames: int | None = None,
    reference: Image.Image | None = None,
    shape: tuple[int, ...] | None = None,
) -> Start:
    """Noise for a generation; for an edit, its image noised to `first_t`, the first timestep it
    runs. An inpainting denoiser (9 input channels) sees every request as inpainting: without a
    mask the whole image is repainted, without an image it starts from black, at strength 1.
    Image-to-video (a `reference`): noise, and the first frame's channels beside it. The noise
    is drawn in the dtype its diffusers pipeline draws it in (`family.noise_dtype` of the model's
    `dtype`), then held in float32. `shape`: the request's (`Family.request_shape`), if not its
    VAE's latents'."""
    shape = shape or family.latent_shape(width, height, frames)
    drawn = family.noise_dtype(dtype, edit is not None)
    if reference is not None:  # as WanImageToVideoPipeline: the noise drawn, the frame resized
        noise = torch.empty(shape, dtype=drawn)
        family.draw_noise(noise, generator, shape)
        noise = noise.to(LATENT_DTYPE)
        noise.mul_(family.init_noise_sigma(scheduler))
        frame = family.conditioning_frame(reference.convert("RGB"))
        processor = _frame_processor(family.vae_scale_factor, family.frame_resample)
        pixels = processor.preprocess(frame, height=height, width=width)
        condition = family.first_frame(vae, pixels.to(torch.float32), frames or 1)
        latents, condition = _kept(scope, device, noise.to(device), condition.to(device))
        if family.pastes_first_frame:  # the frame's latents stand in for the first latent frame's
            if family.still_every_step:  # and are the latents' from the start (LTX-2's)
                family.hold_first_frame(latents, condition)
            return Start(latents, first_frame=condition)
        return Start(latents, conditioning=condition)
    conditioned = family.inpainting_channels > 0
    if edit is None and not conditioned:
        noise = scope.rent(shape, drawn, "cpu", pinned=device.type == "cuda")
        family.draw_noise(noise, generator, shape)
        latents = scope.rent(shape, LATENT_DTYPE, device)
        latents.copy_(noise)
        latents.mul_(family.init_noise_sigma(scheduler))
        scope.give_back(noise)
        return Start(latents)
    if edit is None:
        edit = Edit(Image.new("RGB", (width, height)), None, 1.0)
    image_processor, mask_processor = _processors(family.vae_scale_factor)
    pixels = image_processor.preprocess(edit.image, height=height, width=width).to(torch.float32)
    mask = None if edit.mask is None else mask_processor.preprocess(edit.mask, height=height, width=width)
    if mask is None and conditioned:
        mask = torch.ones(1, 1, height, width)
    full = mask is not None and edit.strength == 1.0  # inpainting at full strength starts from noise
    # as diffusers' pipelines draw from the generator: the image's posterior (unless an inpainting
    # denoiser starts from noise), the noise, then the masked image's posterior
    # Every tensor is moved to `device` (the latents') before they meet: the VAE may sit on another
    # device, and the CPU generator's draws are on the CPU (as diffusers' randn_tensor draws them).
    clean = None if conditioned and full else _encode(vae, family, pixels, generator).to(device)
    noise = torch.randn(shape, generator=generator, dtype=drawn).to(device, LATENT_DTYPE)
    latents = scope.rent(shape, LATENT_DTYPE, device)
    if full:
        latents.copy_(noise)
        latents.mul_(family.init_noise_sigma(scheduler))
    else:
        latents.copy_(family.noised(scheduler, clean, noise, first_t.reshape(1)))
    if mask is None:
        return Start(latents)
    small = torch.nn.functional.interpolate(mask, size=shape[-2:]).to(device)
    if conditioned:
        masked = _encode(vae, family, pixels * (mask < 0.5), generator).to(device)
        conditioning = torch.cat([small, masked], dim=1)
        return Start(latents, conditioning=_kept(scope, device, conditioning)[0])
    torch.randn(shape, generator=generator, dtype=vae.dtype)  # the masked image's posterior draw, unused
    return Start(latents, Inpainting(*_kept(scope, device, clean, noise, small)))


def _encode(
    vae: torch.nn.Module, family: Family, pixels: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """A sample of the VAE's posterior for `pixels` ([1, 3, H, W] in [-1, 1]), scaled as the
    denoiser takes latents; drawn as diffusers' `retrieve_latents` draws it."""
    vae_device = next(vae.parameters()).device
    posterior = vae.encode(family.vae_pixels(pixels.to(vae_device, vae.dtype))).latent_dist
    draw = torch.randn(posterior.mean.shape, generator=generator, dtype=posterior.mean.dtype)
    return family.scale_latents(posterior.mean + posterior.std * draw.to(vae_device)).to(LATENT_DTYPE)


def _kept(scope: PoolScope, device: torch.device, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Copies of `tensors` rented from the request's scope on `device`."""
    kept = [scope.rent(t.shape, LATENT_DTYPE, device) for t in tensors]
    for target, value in zip(kept, tensors, strict=True):
        target.copy_(value)
    return kept


def blend(
    family: Family, scheduler, latents: torch.Tensor, kept: Inpainting, next_t: torch.Tensor | None
) -> None:
    """After a step: the unmasked region back to the image, noised to the next step's level (the
    image itself after the last step), as diffusers' inpainting loop does."""
    known = kept.image_latents
    if next_t is not None:
        known = family.noised(scheduler, known, kept.noise, next_t.reshape(1))
    latents.copy_((1 - kept.mask) * known + kept.mask * latents)


def keep_unmasked(image: torch.Tensor, edit: Edit | None) -> None:
    """An inpainting's decoded `image` ([H, W, 3] in [0, 1], in place) with the edit's image put
    back where the mask keeps it, as diffusers' `VaeImageProcessor.apply_overlay(mask, image,
    inpainted)` composites: the mask as given weighs the model's pixels (white: the model's, black:
    the image's). An image of another size than the output is resized first, as the pipeline's
    preprocessing resized what the model saw (PIL's Lanczos, diffusers' default)."""
    if edit is None or edit.mask is None or not edit.keep_unmasked:
        return
    height, width = image.shape[:2]
    source, mask = edit.image.convert("RGB"), edit.mask.convert("L")
    if source.size != (width, height):
        source = source.resize((width, height), Image.Resampling.LANCZOS)
        mask = mask.resize((width, height), Image.Resampling.LANCZOS)
    # made on the decoded image's device; weights exactly 0 and 1 give each side's pixels unchanged
    kept = torch.as_tensor(np.asarray(source, dtype=np.float32) / 255, device=image.device)
    weight = torch.as_tensor(np.asarray(mask, dtype=np.float32)[..., None] / 255, device=image.device)
    image.mul_(weight).add_(kept.mul_(1 - weight))
