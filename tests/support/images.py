"""Small seeded images and masks the edit, ControlNet and video tests start from, and pixels to
compare."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image, ImageDraw

from tests.support.tiny_pipelines import IMAGE_SIZE


def drawn(shape: str) -> Image.Image:
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE))
    box = (4, 6, IMAGE_SIZE - 6, IMAGE_SIZE - 4)
    (ImageDraw.Draw(image).ellipse if shape == "circle" else ImageDraw.Draw(image).rectangle)(
        box, outline="white"
    )
    return image


def source_image(size: int = IMAGE_SIZE) -> Image.Image:
    """Two shapes on a dark ground: a red disc left, a blue square right."""
    image = Image.new("RGB", (size, size), (20, 20, 30))
    draw = ImageDraw.Draw(image)
    draw.ellipse((2, 8, size // 2 - 2, size - 8), fill=(220, 30, 30))
    draw.rectangle((size // 2 + 3, 9, size - 3, size - 9), fill=(30, 40, 220))
    return image


def left_half_mask(size: int = IMAGE_SIZE) -> Image.Image:
    """diffusers' convention: white repaints (the left half)."""
    mask = Image.new("L", (size, size), 0)
    ImageDraw.Draw(mask).rectangle((0, 0, size // 2 - 1, size - 1), fill=255)
    return mask


def pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64)))).astype(int)


def first_frame():
    """A 48×40 gradient: resized to the video's 32×32, as the pipeline resizes it."""
    from PIL import Image

    ys, xs = np.mgrid[0:40, 0:48]
    return Image.fromarray(np.stack([xs * 5, ys * 6, (xs + ys) * 2], -1).astype(np.uint8))
