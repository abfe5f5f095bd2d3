"""One ControlNet a request asks for: which served net, its image, its scale and its step window
(`server/pipeline/conditioning/controlnets.py` runs it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from PIL import Image

MAX_CONTROLS = 4  # controls one request may ask for (each a ControlNet call on its rows a step)
MAX_SCALE = 2.0  # a control's scale, from 0 (as A1111's slider)


@dataclass(frozen=True)
class Control:
    """One control a request asks for: diffusers' `controlnet_conditioning_scale` and
    `control_guidance_start`/`_end` for one ControlNet and its image."""

    model: str
    image: Image.Image = field(compare=False, repr=False)
    scale: float = 1.0
    start: float = 0.0  # the share of the steps before it takes effect
    end: float = 1.0  # the share after which it stops

    def on_at(self, index: int, steps: int) -> bool:
        """Whether it acts at step `index` of `steps` (diffusers' `controlnet_keep`)."""
        return not (index / steps < self.start or (index + 1) / steps > self.end)
