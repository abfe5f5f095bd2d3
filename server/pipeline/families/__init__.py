"""The model families diffshard serves, and how a folder or a name finds its family.

This registry is the one place that lists families by name: everything else asks it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from server.errors import ModelFolderError, PlanError
from server.pipeline.families.base import Family, ModelConfig, TextEmbeddings
from server.pipeline.families.flux import Flux
from server.pipeline.families.flux2 import Flux2, Flux2Klein
from server.pipeline.families.flux3 import Flux3, Flux3Distilled
from server.pipeline.families.hunyuan15 import HunyuanVideo15, HunyuanVideo15I2V
from server.pipeline.families.kontext import FluxKontext
from server.pipeline.families.ltx2 import LTX2, LTX2I2V
from server.pipeline.families.qwenimage import QwenImage, QwenImageEdit
from server.pipeline.families.qwenimage21 import QwenImage21, QwenImage21Turbo
from server.pipeline.families.sd import SD
from server.pipeline.families.sd3 import SD3
from server.pipeline.families.sdxl import SDXL
from server.pipeline.families.wan import Wan, WanI2V
from server.pipeline.families.zimage import ZImage

FAMILIES: tuple[type[Family], ...] = (
    SD,
    SDXL,
    SD3,
    Flux,
    FluxKontext,
    Flux2,
    Flux2Klein,
    Flux3,
    Flux3Distilled,
    Wan,
    WanI2V,
    HunyuanVideo15,
    HunyuanVideo15I2V,
    LTX2,
    LTX2I2V,
    QwenImage,
    QwenImageEdit,
    QwenImage21,
    QwenImage21Turbo,
    ZImage,
)
SD_VAE = {"block_out_channels": (128, 256, 512, 512), "layers_per_block": 2}  # every reference's 8x VAE


def pipeline_classes() -> tuple[str, ...]:
    return tuple(name for family in FAMILIES for name in family.pipeline_classes)


def family_class(index: dict[str, Any]) -> type[Family]:
    """The family serving a folder whose model_index.json is `index`."""
    name = index.get("_class_name")
    for family in FAMILIES:
        if name in family.pipeline_classes:
            return family
    raise ModelFolderError(f"the folder holds a {name}; diffshard serves {', '.join(pipeline_classes())}")


def reference_names() -> tuple[str, ...]:
    return tuple(sorted(name for family in FAMILIES for name in family.reference_configs))


def reference_family(name: str) -> Family:
    """The family of a well-known architecture (`plan --config NAME`), with its denoiser's config."""
    for family in FAMILIES:
        if name in family.reference_configs:
            config = dict(family.reference_configs[name])
            vae = config.pop("_vae", None) or family.reference_vae or SD_VAE  # a config's own VAE
            more = config.pop("_index", {})  # what its model_index.json says beyond the class
            with torch.device("meta"):  # a config with every default filled in
                model = family.denoiser_class.from_config(config)
            index = {"_class_name": family.pipeline_classes[0], **more}
            return family(ModelConfig(index, dict(model.config), vae))
    raise PlanError(f"unknown architecture {name!r}: choose one of {', '.join(reference_names())}")


def reference_parts(family: Family) -> dict[str, nn.Module]:
    """A reference architecture's encoders and VAE built on the meta device (seconds, no
    weights); none for a family that declares none."""
    with torch.device("meta"):
        return {name: build() for name, build in family.reference_parts.items()}


def meta_denoiser(family: Family) -> nn.Module:
    """The family's denoiser built from its config on the meta device: no weights, seconds to make."""
    with torch.device("meta"):
        return family.denoiser_class.from_config(family.config.denoiser)


__all__ = ["FAMILIES", "Family", "ModelConfig", "TextEmbeddings", "family_class", "meta_denoiser"]
