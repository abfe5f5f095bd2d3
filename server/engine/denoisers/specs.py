"""Which `DenoiserSpec` describes a model: the registry the planner, the trace and the shard ask."""

from __future__ import annotations

from collections.abc import Callable

from diffusers import (
    Flux2Transformer2DModel,
    Flux3Transformer2DModel,
    FluxTransformer2DModel,
    HunyuanVideo15Transformer3DModel,
    LTX2VideoTransformer3DModel,
    QwenImage21Transformer2DModel,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    UNet2DConditionModel,
    WanTransformer3DModel,
    ZImageTransformer2DModel,
)
from torch import nn

from server.engine.denoisers.blocks import DenoiserSpec, Layout, part, tensors_of
from server.engine.denoisers.dit import SD3TransformerSpec
from server.engine.denoisers.flux import FluxTransformerSpec
from server.engine.denoisers.flux2 import Flux2TransformerSpec
from server.engine.denoisers.flux3 import Flux3TransformerSpec
from server.engine.denoisers.hunyuan15 import HunyuanVideo15TransformerSpec
from server.engine.denoisers.ltx2 import LTX2TransformerSpec
from server.engine.denoisers.qwenimage import QwenImageTransformerSpec
from server.engine.denoisers.qwenimage21 import QwenImage21TransformerSpec
from server.engine.denoisers.unet import UNetSpec
from server.engine.denoisers.wan import WanTransformerSpec
from server.engine.denoisers.zimage import ZImageTransformerSpec

_SPECS: list[tuple[type[nn.Module], Callable[[], DenoiserSpec]]] = [
    (UNet2DConditionModel, UNetSpec),
    (SD3Transformer2DModel, SD3TransformerSpec),
    (FluxTransformer2DModel, FluxTransformerSpec),
    (WanTransformer3DModel, WanTransformerSpec),
    (QwenImageTransformer2DModel, QwenImageTransformerSpec),
    (QwenImage21Transformer2DModel, QwenImage21TransformerSpec),
    (ZImageTransformer2DModel, ZImageTransformerSpec),
    (Flux2Transformer2DModel, Flux2TransformerSpec),
    (Flux3Transformer2DModel, Flux3TransformerSpec),
    (HunyuanVideo15Transformer3DModel, HunyuanVideo15TransformerSpec),
    (LTX2VideoTransformer3DModel, LTX2TransformerSpec),
]


def register_spec(model_type: type[nn.Module], spec: Callable[[], DenoiserSpec]) -> None:
    """Teach the engine another denoiser: declare its blocks, inputs and forward call."""
    _SPECS.insert(0, (model_type, spec))


def spec_for(model: nn.Module) -> DenoiserSpec:
    for model_type, spec in _SPECS:
        if isinstance(model, model_type):
            return spec()
    known = ", ".join(t.__name__ for t, _ in _SPECS)
    raise TypeError(f"no block layout for {type(model).__name__} (known: {known}); see register_spec")


def native_latent(model: nn.Module) -> int:
    """The latent side the denoiser was built for: its spec's, else its config's `sample_size`
    (FLUX.1's config has none)."""
    spec = spec_for(model)
    if hasattr(spec, "native_latent"):
        return int(spec.native_latent(model))
    return int(model.config.sample_size)


def layout_of(model: nn.Module) -> Layout:
    """The model's blocks in execution order, checked to own every parameter and buffer once."""
    layout = spec_for(model).layout(model)
    owners: dict[int, str] = {}  # by identity: a block may own a root tensor (`TensorPart`)
    for block in layout.blocks:
        for path in block.modules:
            for name, tensor in tensors_of(part(model, path)):
                if id(tensor) in owners:
                    raise ValueError(f"{path}.{name} is in both {owners[id(tensor)]} and {block.name}")
                owners[id(tensor)] = block.name
    orphans = [name for name, tensor in tensors_of(model) if id(tensor) not in owners]
    if orphans:
        raise ValueError(f"the layout of {type(model).__name__} leaves out {orphans[:5]}")
    return layout
