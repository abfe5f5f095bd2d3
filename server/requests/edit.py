"""What an image edit starts from: the image, an optional mask of the region to repaint, and how
far back it starts (`server/pipeline/conditioning/edits.py` runs it)."""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image


@dataclass(frozen=True, eq=False)
class Edit:
    """What an edit starts from. `mask` is diffusers' `mask_image`: white (255) marks the region
    to repaint (the API turns OpenAI's transparent pixels into it)."""

    image: Image.Image  # RGB; RGBA for a model with alpha, if the upload had transparency
    mask: Image.Image | None = None  # L, the image's size
    strength: float = 0.8
    keep_unmasked: bool = True  # with a mask: the decoded image composited over the image (below)
    more: tuple[Image.Image, ...] = ()  # further images (image[]) a model editing by reference takes

    @property
    def images(self) -> tuple[Image.Image, ...]:
        return (self.image, *self.more)
