"""Stable Diffusion 1.x/2.x: the base family as it stands (one CLIP encoder, a UNet)."""

from __future__ import annotations

from typing import Any, ClassVar

from server.pipeline.families.base import Family

_SD_DOWN = ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D")
_SD_UP = ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D")


class SD(Family):
    # a folder saved by any SD pipeline; an inpainting one's UNet takes the mask and masked image too
    pipeline_classes: ClassVar[tuple[str, ...]] = (
        "StableDiffusionPipeline",
        "StableDiffusionImg2ImgPipeline",
        "StableDiffusionInpaintPipeline",
    )
    controlnets: ClassVar[tuple[str, ...]] = ("ControlNetModel",)
    reference_configs: ClassVar[dict[str, dict[str, Any]]] = {
        "sd15": {
            "sample_size": 64,
            "down_block_types": _SD_DOWN,
            "up_block_types": _SD_UP,
            "block_out_channels": (320, 640, 1280, 1280),
            "cross_attention_dim": 768,
            "attention_head_dim": 8,
        },
        "sd21": {
            "sample_size": 96,
            "down_block_types": _SD_DOWN,
            "up_block_types": _SD_UP,
            "block_out_channels": (320, 640, 1280, 1280),
            "cross_attention_dim": 1024,
            "attention_head_dim": (5, 10, 20, 20),
            "use_linear_projection": True,
        },
    }

    def pipeline_scheduler(self, scheduler: Any) -> Any:
        """As StableDiffusionPipeline (and its img2img and inpainting twins) sets an outdated config
        right when it is built: `steps_offset` 1 and no `clip_sample` (a DDIM folder saved with
        clip_sample true is stepped without it)."""
        config = scheduler.config
        fixes = {"steps_offset": 1} if config.get("steps_offset", 1) != 1 else {}
        if config.get("clip_sample", False) is True:
            fixes["clip_sample"] = False
        return type(scheduler).from_config({**config, **fixes}) if fixes else scheduler
