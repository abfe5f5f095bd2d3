"""Decoded images → PNG bytes. Encoding takes milliseconds of pure CPU per image, so the
service runs it in a worker thread (`encode_png_async`), never on the event loop."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import torch
from PIL import Image


def to_uint8(image: torch.Tensor | np.ndarray) -> np.ndarray:
    """[H, W, 3] floats in [0, 1] → uint8, rounded as diffusers' numpy_to_pil rounds."""
    array = image.numpy() if isinstance(image, torch.Tensor) else image
    return (array * 255).round().astype(np.uint8)


def encode_png(image: torch.Tensor | np.ndarray) -> bytes:
    """Deterministic PNG bytes (no timestamps or other metadata)."""
    out = io.BytesIO()
    Image.fromarray(to_uint8(image)).save(out, format="PNG")
    return out.getvalue()


async def encode_png_async(image: torch.Tensor | np.ndarray) -> bytes:
    return await asyncio.to_thread(encode_png, image)
