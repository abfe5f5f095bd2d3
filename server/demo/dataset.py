"""Procedural, unlimited images of one colored shape on a dark background, with captions.

Each image is 64x64 RGB: one upright, unrotated `circle`, `square` or `triangle` in one of
six saturated colors, at a random size and position, captioned "a {color} {shape}".
Drawing is vectorised in torch so training never waits for data.

`NEW_SHAPES` are drawn only when asked for (`sample_batch(..., shapes=...)`): shapes the
built-in model never saw, for adapters to teach it (`train_lora.py`). They are not in `SHAPES`,
so the tokenizer's vocabulary, and every default batch, stay exactly as the model was trained.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

SIZE = 64
SHAPES = ("circle", "square", "triangle")
NEW_SHAPES = ("diamond",)  # a square turned 45°
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (225, 35, 35),
    "green": (40, 200, 50),
    "blue": (40, 80, 235),
    "yellow": (235, 215, 40),
    "purple": (165, 45, 215),
    "white": (240, 240, 240),
}
COLOR_JITTER = 12  # per channel, in 0..255
BACKGROUND_MAX = 28  # the background is a uniform gray in 0..BACKGROUND_MAX
MIN_EXTENT, MAX_EXTENT = 18, 44  # pixels: side (square, triangle), diameter (circle), diagonal (diamond)


def caption(color: str, shape: str) -> str:
    return f"a {color} {shape}"


def all_prompts() -> list[tuple[str, str, str]]:
    """(color, shape, caption) for every one of the 18 combinations."""
    return [(c, s, caption(c, s)) for c in COLORS for s in SHAPES]


@dataclass
class Batch:
    images: torch.Tensor  # (b, 3, 64, 64) float in [-1, 1]
    colors: list[str]
    shapes: list[str]

    @property
    def captions(self) -> list[str]:
        return [caption(c, s) for c, s in zip(self.colors, self.shapes, strict=True)]


def sample_batch(batch: int, generator: torch.Generator, shapes: Sequence[str] = SHAPES) -> Batch:
    """`batch` random images of `shapes` (any of SHAPES and NEW_SHAPES, each equally likely);
    the same generator state and shapes give the same images."""
    unknown = [s for s in shapes if s not in (*SHAPES, *NEW_SHAPES)]
    if unknown or not shapes:
        raise ValueError(f"shapes must be among {SHAPES + NEW_SHAPES}, got {tuple(shapes)}")
    g = generator
    color_idx = torch.randint(len(COLORS), (batch,), generator=g)
    shape_idx = torch.randint(len(shapes), (batch,), generator=g)
    extent = torch.randint(MIN_EXTENT, MAX_EXTENT + 1, (batch,), generator=g).float()
    # top-left corner so that the shape lies fully inside the image
    left = (torch.rand(batch, generator=g) * (SIZE - extent)).floor()
    top = (torch.rand(batch, generator=g) * (SIZE - extent)).floor()

    ys, xs = torch.meshgrid(torch.arange(SIZE) + 0.5, torch.arange(SIZE) + 0.5, indexing="ij")
    x = (xs - left[:, None, None]) / extent[:, None, None]  # (b, 64, 64), shape box = [0, 1]^2
    y = (ys - top[:, None, None]) / extent[:, None, None]
    inside_box = (x >= 0) & (x <= 1) & (y >= 0) & (y <= 1)
    drawn = {
        "circle": (x - 0.5) ** 2 + (y - 0.5) ** 2 <= 0.25,
        "square": inside_box,
        "triangle": inside_box & (y >= 2 * (x - 0.5).abs()),  # apex at the top middle
        "diamond": (x - 0.5).abs() + (y - 0.5).abs() <= 0.5,  # corners at the middles of the sides
    }
    masks = torch.stack([drawn[shape] for shape in shapes])[shape_idx, torch.arange(batch)]

    palette = torch.tensor(list(COLORS.values()), dtype=torch.float32)
    fg = palette[color_idx] + (torch.rand(batch, 3, generator=g) * 2 - 1) * COLOR_JITTER
    bg = torch.rand(batch, 1, generator=g).expand(batch, 3) * BACKGROUND_MAX
    pixels = torch.where(masks[:, None], fg[:, :, None, None], bg[:, :, None, None])
    images = (pixels.clamp(0, 255) / 127.5 - 1).contiguous()
    names = list(COLORS)
    return Batch(images, [names[i] for i in color_idx], [shapes[i] for i in shape_idx])


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """(b, 3, h, w) in [-1, 1] → (b, h, w, 3) uint8."""
    return ((images.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1)
