"""A denoiser as an ordered list of blocks, the unit the planner places on devices.

A block is one or more of the model's modules that forward runs together. Blocks are
listed in *execution* order, not registration order: `UNet2DConditionModel.named_children()`
lists `up_blocks` before `mid_block`, but forward runs the mid block first.

Supporting another denoiser means declaring its blocks (a `DenoiserSpec`), not editing
the planner or the shard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from diffusers import UNet2DConditionModel
from torch import nn


@dataclass(frozen=True)
class Block:
    name: str
    modules: tuple[str, ...]  # dotted paths of the model's submodules this block owns


@dataclass(frozen=True)
class SkipEdge:
    """`count` residual tensors made by block `source` and consumed by block `target`."""

    source: str
    target: str
    count: int

    def __str__(self) -> str:
        return f"{self.source}→{self.target}×{self.count}"


@dataclass(frozen=True)
class Layout:
    blocks: tuple[Block, ...]
    skips: tuple[SkipEdge, ...] = ()

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(block.name for block in self.blocks)


@dataclass
class DenoiserInputs:
    """One conditional forward's inputs: `model(sample, timestep, context, **conditioning)`."""

    sample: torch.Tensor
    timestep: torch.Tensor | float | int
    context: torch.Tensor
    conditioning: dict[str, Any] = field(default_factory=dict)


class DenoiserSpec(Protocol):
    """What the engine needs to know about one kind of denoiser."""

    def layout(self, model: nn.Module) -> Layout: ...

    def example_inputs(
        self, model: nn.Module, batch: int, latent_size: int, dtype: torch.dtype, device: torch.device
    ) -> DenoiserInputs: ...

    def forward(self, model: nn.Module, inputs: DenoiserInputs) -> torch.Tensor: ...


class UNetSpec:
    """`diffusers.UNet2DConditionModel`: SD 1.x/2.x, SDXL (`added_cond_kwargs`) and kin."""

    # Modules forward runs before conv_in: timestep, class, added (SDXL) and context embeddings.
    EMBEDDING = (
        "time_proj",
        "time_embedding",
        "class_embedding",
        "add_time_proj",
        "add_embedding",
        "time_embed_act",
        "encoder_hid_proj",
        "position_net",
    )
    OUTPUT = ("conv_norm_out", "conv_act", "conv_out")

    def layout(self, model: nn.Module) -> Layout:
        def present(names: tuple[str, ...]) -> tuple[str, ...]:
            return tuple(n for n in names if getattr(model, n, None) is not None)

        blocks = [Block("embed", present(self.EMBEDDING)), Block("conv_in", ("conv_in",))]
        blocks += [Block(f"down_blocks.{i}", (f"down_blocks.{i}",)) for i in range(len(model.down_blocks))]
        if model.mid_block is not None:
            blocks.append(Block("mid_block", ("mid_block",)))
        blocks += [Block(f"up_blocks.{i}", (f"up_blocks.{i}",)) for i in range(len(model.up_blocks))]
        blocks.append(Block("out", present(self.OUTPUT)))
        return Layout(tuple(blocks), _unet_skips(model))

    def example_inputs(
        self, model: nn.Module, batch: int, latent_size: int, dtype: torch.dtype, device: torch.device
    ) -> DenoiserInputs:
        config = model.config
        if not isinstance(config.cross_attention_dim, int):
            raise ValueError("per-block cross_attention_dim is not supported")
        sample = torch.randn(batch, config.in_channels, latent_size, latent_size, dtype=dtype, device=device)
        timestep = torch.arange(batch, device=device) * 7 + 1  # distinct per-sample timesteps
        context = torch.randn(batch, 77, config.cross_attention_dim, dtype=dtype, device=device)
        conditioning: dict[str, Any] = {}
        if config.addition_embed_type == "text_time":  # SDXL: pooled text embeds + 6 size/crop ids
            text_dim = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
            conditioning["added_cond_kwargs"] = {
                "text_embeds": torch.randn(batch, text_dim, dtype=dtype, device=device),
                "time_ids": torch.randn(batch, 6, dtype=dtype, device=device),
            }
        return DenoiserInputs(sample, timestep, context, conditioning)

    def forward(self, model: nn.Module, inputs: DenoiserInputs) -> torch.Tensor:
        return model(
            inputs.sample,
            inputs.timestep,
            encoder_hidden_states=inputs.context,
            return_dict=False,
            **inputs.conditioning,
        )[0]


def _unet_skips(model: nn.Module) -> tuple[SkipEdge, ...]:
    """Which block made each residual an up block consumes.

    forward stacks conv_in's output, then every down block's per-resnet (and downsampler)
    outputs; each up block pops `len(resnets)` residuals off the top of that stack.
    """
    stack = ["conv_in"]
    for i, block in enumerate(model.down_blocks):
        made = len(block.resnets) + (1 if block.downsamplers is not None else 0)
        stack += [f"down_blocks.{i}"] * made
    edges: list[SkipEdge] = []
    for i, block in enumerate(model.up_blocks):
        want = len(block.resnets)
        if want > len(stack):
            raise ValueError(f"up_blocks.{i} consumes {want} residuals but only {len(stack)} remain")
        taken, stack = stack[-want:], stack[:-want]
        for source in dict.fromkeys(reversed(taken)):  # nearest producer first, as forward pops
            edges.append(SkipEdge(source, f"up_blocks.{i}", taken.count(source)))
    if stack:
        raise ValueError(f"{len(stack)} residuals are never consumed by an up block")
    return tuple(edges)


_SPECS: list[tuple[type[nn.Module], Callable[[], DenoiserSpec]]] = [(UNet2DConditionModel, UNetSpec)]


def register_spec(model_type: type[nn.Module], spec: Callable[[], DenoiserSpec]) -> None:
    """Teach the engine another denoiser: declare its blocks, inputs and forward call."""
    _SPECS.insert(0, (model_type, spec))


def spec_for(model: nn.Module) -> DenoiserSpec:
    for model_type, spec in _SPECS:
        if isinstance(model, model_type):
            return spec()
    known = ", ".join(t.__name__ for t, _ in _SPECS)
    raise TypeError(f"no block layout for {type(model).__name__} (known: {known}); see register_spec")


def layout_of(model: nn.Module) -> Layout:
    """The model's blocks in execution order, checked to own every parameter and buffer once."""
    layout = spec_for(model).layout(model)
    owners: dict[str, str] = {}
    for block in layout.blocks:
        for path in block.modules:
            for name, _ in _tensors(model.get_submodule(path)):
                full = f"{path}.{name}"
                if full in owners:
                    raise ValueError(f"{full} is in both {owners[full]} and {block.name}")
                owners[full] = block.name
    orphans = [name for name, _ in _tensors(model) if name not in owners]
    if orphans:
        raise ValueError(f"the layout of {type(model).__name__} leaves out {orphans[:5]}")
    return layout


def block_modules(model: nn.Module, layout: Layout) -> Iterator[tuple[str, nn.Module]]:
    """(block name, module) for every module each block owns, in execution order."""
    for block in layout.blocks:
        for path in block.modules:
            yield block.name, model.get_submodule(path)


def tensor_bytes(module: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of `module`'s parameters and buffers; with `dtype`, floating ones counted at its size."""
    total = 0
    for _, t in _tensors(module):
        itemsize = dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size()
        total += t.numel() * itemsize
    return total


def _tensors(module: nn.Module):
    yield from module.named_parameters()
    yield from module.named_buffers()
