"""Well-known UNet architectures, built on the meta device for planning (no download, no weights)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from diffusers import UNet2DConditionModel

_SD_DOWN = ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D")
_SD_UP = ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D")

# The `unet/config.json` of each family's reference checkpoint, trimmed to what differs from defaults.
UNET_CONFIGS: dict[str, dict[str, Any]] = {
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
    "sdxl": {
        "sample_size": 128,
        "down_block_types": ("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        "up_block_types": ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        "block_out_channels": (320, 640, 1280),
        "transformer_layers_per_block": (1, 2, 10),
        "cross_attention_dim": 2048,
        "attention_head_dim": (5, 10, 20),
        "use_linear_projection": True,
        "addition_embed_type": "text_time",
        "addition_time_embed_dim": 256,
        "projection_class_embeddings_input_dim": 2816,
    },
}
VAE_SCALE_FACTOR = 8  # the SD family's VAEs downscale 8x


def meta_unet(name: str) -> UNet2DConditionModel:
    if name not in UNET_CONFIGS:
        raise ValueError(f"unknown architecture {name!r}: choose one of {', '.join(UNET_CONFIGS)}")
    with torch.device("meta"):
        return UNet2DConditionModel(**UNET_CONFIGS[name])


def meta_unet_from_folder(folder: str | Path) -> tuple[UNet2DConditionModel, int]:
    """The UNet of a diffusers folder (pipeline or bare `unet/`) on the meta device, and its VAE scale."""
    root = Path(folder)
    unet_dir = root / "unet" if (root / "unet" / "config.json").is_file() else root
    if not (unet_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"{root} has no unet/config.json: point --model at a diffusers pipeline folder"
        )
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(unet_dir))
    vae_config = root / "vae" / "config.json"
    scale = VAE_SCALE_FACTOR
    if vae_config.is_file():
        scale = 2 ** (len(json.loads(vae_config.read_text())["block_out_channels"]) - 1)
    return unet, scale
