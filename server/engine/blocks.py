"""A denoiser as an ordered list of blocks, the unit the planner places on devices.

A block is one or more of the model's modules that forward runs together. Blocks are
listed in *execution* order, not registration order: `UNet2DConditionModel.named_children()`
lists `up_blocks` before `mid_block`, but forward runs the mid block first.

Supporting another denoiser means declaring its blocks (a `DenoiserSpec`, registered in
`specs.py`), not editing the planner or the shard: `unet.py` declares diffusers' UNet,
`dit.py` diffusers' MMDiT (`SD3Transformer2DModel`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
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


def block_modules(model: nn.Module, layout: Layout) -> Iterator[tuple[str, nn.Module]]:
    """(block name, module) for every module each block owns, in execution order."""
    for block in layout.blocks:
        for path in block.modules:
            yield block.name, model.get_submodule(path)


def tensor_bytes(module: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of `module`'s parameters and buffers; with `dtype`, floating ones counted at its size."""
    total = 0
    for _, t in tensors_of(module):
        itemsize = dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size()
        total += t.numel() * itemsize
    return total


def tensors_of(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters()
    yield from module.named_buffers()
