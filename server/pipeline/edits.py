"""Image edits: a request that starts from an image (img2img) and may repaint only a masked region
(inpainting), as diffusers' `StableDiffusionImg2ImgPipeline` / `StableDiffusionInpaintPipeline`
(and their SDXL and SD3 versions) run them on a regular denoiser.

An edit is a generation that starts late: the image is encoded by the VAE (a sample of its
posterior, drawn with the request's generator), noised to the timestep `strength` selects, and
denoised for the remaining steps. Each row carries its own timestep, so an edit shares every
denoiser call with generations of its size. Inpainting keeps the image's latents, its noise and
the mask: after each step the unmasked region is put back, noised to the next step's level.

The generator is drawn from in diffusers' order (image posterior, noise, then the masked image's
posterior, which a 4-channel denoiser never reads: drawn and dropped), so schedulers that draw
noise at each step (Euler ancestral) give diffusers' image too.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
from diffusers.image_processor import VaeImageProcessor
from PIL import Image

from server.engine.pool import PoolScope
from server.pipeline.families import Family

LATENT_DTYPE = torch.float32  # as denoise.py: scheduler arithmetic in float32


@dataclass(frozen=True, eq=False)
class Edit:
    """What an edit starts from. `mask` is diffusers' `mask_image`: white (255) marks the region
    to repaint (the API turns OpenAI's transparent pixels into it)."""

    image: Image.Image  # RGB
    mask: Image.Image | None = None  # L, the image's size
    strength: float = 0.8


@dataclass
class Inpainting:
    """What an inpainting request keeps between steps (rented from its scope)."""

    image_latents: torch.Tensor  # [1, C, h, w]: the image, encoded and scaled
    noise: torch.Tensor  # [1, C, h, w]: the noise its latents started from
    mask: torch.Tensor  # [1, 1, h, w]: 1 where the region is repainted


@cache
def _processors(scale: int) -> tuple[VaeImageProcessor, VaeImageProcessor]:
    image = VaeImageProcessor(vae_scale_factor=scale)
    mask = VaeImageProcessor(
        vae_scale_factor=scale, do_normalize=False, do_binarize=True, do_convert_grayscale=True
    )
    return image, mask


def start_latents(
    edit: Edit,
    *,
    family: Family,
    vae: torch.nn.Module,
    scheduler,
    first_t: torch.Tensor,
    generator: torch.Generator,
    scope: PoolScope,
    shape: tuple[int, ...],
    width: int,
    height: int,
    device: torch.device,
) -> tuple[torch.Tensor, Inpainting | None]:
    """The edit's first latents (rented on `device`), noised to `first_t`, the first timestep it
    runs; with a mask, what inpainting keeps."""
    image_processor, mask_processor = _processors(family.vae_scale_factor)
    pixels = image_processor.preprocess(edit.image, height=height, width=width).to(torch.float32)
    vae_device = next(vae.parameters()).device
    posterior = vae.encode(pixels.to(vae_device, vae.dtype)).latent_dist
    draw = torch.randn(posterior.mean.shape, generator=generator, dtype=posterior.mean.dtype)
    clean = family.scale_latents(posterior.mean + posterior.std * draw.to(vae_device)).to(LATENT_DTYPE)
    noise = torch.randn(shape, generator=generator, dtype=LATENT_DTYPE)
    latents = scope.rent(shape, LATENT_DTYPE, device)
    if edit.mask is None:
        latents.copy_(family.noised(scheduler, clean, noise, first_t.reshape(1)))
        return latents, None
    torch.randn(shape, generator=generator, dtype=posterior.mean.dtype)  # the masked image's draw
    if edit.strength == 1.0:  # inpainting at full strength starts from pure noise
        latents.copy_(noise)
        latents.mul_(family.init_noise_sigma(scheduler))
    else:
        latents.copy_(family.noised(scheduler, clean, noise, first_t.reshape(1)))
    mask = mask_processor.preprocess(edit.mask, height=height, width=width)
    mask = torch.nn.functional.interpolate(mask, size=shape[-2:])
    kept = Inpainting(*(scope.rent(t.shape, LATENT_DTYPE, device) for t in (clean, noise, mask)))
    for target, value in zip((kept.image_latents, kept.noise, kept.mask), (clean, noise, mask), strict=True):
        target.copy_(value)
    return latents, kept


def blend(
    family: Family, scheduler, latents: torch.Tensor, kept: Inpainting, next_t: torch.Tensor | None
) -> None:
    """After a step: the unmasked region back to the image, noised to the next step's level (the
    image itself after the last step), as diffusers' inpainting loop does."""
    known = kept.image_latents
    if next_t is not None:
        known = family.noised(scheduler, known, kept.noise, next_t.reshape(1))
    latents.copy_((1 - kept.mask) * known + kept.mask * latents)
