"""Decoded images → PNG, JPEG or WebP bytes. Encoding takes milliseconds of pure CPU per image,
so the service runs it in a worker thread (`encode_async`), never on the event loop.

An image is [H, W, 3] (RGB) or [H, W, 4] (RGBA, straight alpha: a family whose VAE decodes an
alpha channel); PNG and WebP keep the alpha, JPEG has none: it gets the image over white."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import torch
from PIL import Image

FORMATS = ("png", "jpeg", "webp")
ALPHA_FORMATS = ("png", "webp")  # the formats that keep an alpha channel
DEFAULT_COMPRESSION = 100  # OpenAI's default for jpeg and webp: the best quality


def _array(image: torch.Tensor | np.ndarray) -> np.ndarray:
    return image.numpy() if isinstance(image, torch.Tensor) else image


def has_alpha(image: torch.Tensor | np.ndarray) -> bool:
    """Whether `image` ([H, W, C]) carries an alpha channel."""
    return image.shape[-1] == 4


def to_uint8(image: torch.Tensor | np.ndarray) -> np.ndarray:
    """[H, W, 3 or 4] floats in [0, 1] → uint8, rounded as diffusers' numpy_to_pil rounds (a copy)."""
    array = _array(image)
    if array.dtype == np.uint8:  # already pixels (a stream's partial image)
        return array
    return (array * 255).round().astype(np.uint8)


def over_white(image: torch.Tensor | np.ndarray) -> np.ndarray:
    """An RGBA image composited over white, [H, W, 3] (`rgb * a + (1 - a)`: PIL's `alpha_composite`
    onto white, or a paste with the alpha as mask, to the level); an RGB one as it is. Floats stay
    floats in [0, 1], uint8 pixels stay uint8."""
    array = _array(image)
    if not has_alpha(array):
        return array
    pixels = array.dtype == np.uint8
    floats = array.astype(np.float32) / 255 if pixels else array
    rgb, alpha = floats[..., :3], floats[..., 3:]
    flat = rgb * alpha + (1 - alpha)
    return (flat * 255).round().astype(np.uint8) if pixels else flat


def _pil(image: torch.Tensor | np.ndarray, output_format: str, opaque: bool) -> Image.Image:
    """The PIL image to save: over white where the output is opaque or the format has no alpha."""
    keeps_alpha = not opaque and output_format in ALPHA_FORMATS
    return Image.fromarray(to_uint8(image if keeps_alpha else over_white(image)))


def encode_png(image: torch.Tensor | np.ndarray, opaque: bool = False) -> bytes:
    """Deterministic PNG bytes (no timestamps or other metadata); RGBA unless `opaque`."""
    out = io.BytesIO()
    _pil(image, "png", opaque).save(out, format="PNG")
    return out.getvalue()


def encode(
    image: torch.Tensor | np.ndarray,
    output_format: str = "png",
    compression: int | None = None,
    opaque: bool = False,
) -> bytes:
    """`image` as `output_format`; for jpeg and webp, `compression` 0-100 is the encoder's quality
    (lower: smaller files), as OpenAI's `output_compression`. An RGBA image keeps its alpha in png
    and webp unless `opaque` (then, and always in jpeg, it is composited over white)."""
    if output_format == "png":
        return encode_png(image, opaque)
    quality = DEFAULT_COMPRESSION if compression is None else compression
    out = io.BytesIO()
    _pil(image, output_format, opaque).save(out, format=output_format.upper(), quality=quality)
    return out.getvalue()


async def encode_async(
    image: torch.Tensor | np.ndarray,
    output_format: str = "png",
    compression: int | None = None,
    opaque: bool = False,
) -> bytes:
    return await asyncio.to_thread(encode, image, output_format, compression, opaque)
