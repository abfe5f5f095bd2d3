"""Decoded images → PNG, JPEG or WebP bytes. Encoding takes milliseconds of pure CPU per image,
so the service runs it in a worker thread (`encode_async`), never on the event loop."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import torch
from PIL import Image


def to_uint8(image: torch.Tensor | np.ndarray) -> np.ndarray:
    """[H, W, 3] floats in [0, 1] → uint8, rounded as diffusers' numpy_to_pil rounds (a copy)."""
    array = image.numpy() if isinstance(image, torch.Tensor) else image
    if array.dtype == np.uint8:  # already pixels (a stream's partial image)
        return array
    return (array * 255).round().astype(np.uint8)


def encode_png(image: torch.Tensor | np.ndarray) -> bytes:
    """Deterministic PNG bytes (no timestamps or other metadata)."""
    out = io.BytesIO()
    Image.fromarray(to_uint8(image)).save(out, format="PNG")
    return out.getvalue()


FORMATS = ("png", "jpeg", "webp")
DEFAULT_COMPRESSION = 100  # OpenAI's default for jpeg and webp: the best quality


def encode(
    image: torch.Tensor | np.ndarray, output_format: str = "png", compression: int | None = None
) -> bytes:
    """`image` as `output_format`; for jpeg and webp, `compression` 0-100 is the encoder's quality
    (lower: smaller files), as OpenAI's `output_compression`."""
    if output_format == "png":
        return encode_png(image)
    quality = DEFAULT_COMPRESSION if compression is None else compression
    out = io.BytesIO()
    Image.fromarray(to_uint8(image)).save(out, format=output_format.upper(), quality=quality)
    return out.getvalue()


async def encode_async(
    image: torch.Tensor | np.ndarray, output_format: str = "png", compression: int | None = None
) -> bytes:
    return await asyncio.to_thread(encode, image, output_format, compression)
