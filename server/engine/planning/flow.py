"""Which activations flow between blocks, and how many bytes, measured on the meta device.

One forward of a weightless twin of the model records, for every tensor a block receives,
the block that made it and the blocks that read it. Skip residuals, the timestep embedding
and the text context all show up as tensors read far from where they were made. Glue code
between blocks (e.g. `emb + aug_emb`) is credited to the block that ran last.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from server.engine.denoisers.blocks import block_modules, walk_plain
from server.engine.denoisers.specs import spec_for

INPUT = "input"  # producer of the denoiser's own inputs


@dataclass(frozen=True)
class TensorFlow:
    nbytes: int
    producer: str  # a block name, or INPUT
    consumers: frozenset[str]


@dataclass(frozen=True)
class Flow:
    tensors: tuple[TensorFlow, ...]
    block_io_bytes: dict[str, int]  # bytes a block reads plus bytes it writes

    def crossing(self, before: set[str]) -> list[TensorFlow]:
        """Tensors made by `before` (or inputs) and read by some block after it."""
        return [
            t for t in self.tensors if (t.producer in before or t.producer == INPUT) and t.consumers - before
        ]


def meta_twin(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The same architecture with no weights: built from config on the meta device."""
    if hasattr(model, "config"):
        with torch.device("meta"):
            model = type(model).from_config(model.config)
    else:  # a plain nn.Module: copy it, then drop the copy's weights
        model = copy.deepcopy(model).to("meta")
    return as_loaded(model, dtype)


def as_loaded(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model` in `dtype` but for the modules diffusers' from_pretrained keeps in float32
    (`_keep_in_fp32_modules`: FLUX.3's q/k norms, Wan's time embedder), as a folder loads it.
    nn.Module.to, not diffusers' override, which warns about the dtypes it keeps."""
    model = nn.Module.to(model, dtype)
    kept = getattr(model, "_keep_in_fp32_modules", None) or ()
    for name, module in model.named_modules():
        if any(k in name.split(".") for k in kept):
            module.float()
    return model


class _CreditProducers(TorchFunctionMode):
    """Credits every tensor an op makes to the block running (or that ran last) at that moment."""

    def __init__(self, made: dict[int, tuple[torch.Tensor, str, set[str]]], running: list[str]) -> None:
        super().__init__()
        self.made, self.running = made, running

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            self.made.setdefault(id(t), (t, self.running[0], set()))
        return out


_TRACED: weakref.WeakKeyDictionary[nn.Module, dict[tuple, Flow]] = weakref.WeakKeyDictionary()


def trace_flow(model: nn.Module, batch: int, latent_size: int, dtype: torch.dtype) -> Flow:
    """The flow of one forward, traced once per model and shape: a planner weighing several
    splits of one model plans them all from one trace (seconds each for an SD-sized model)."""
    traced = _TRACED.setdefault(model, {})
    key = (batch, latent_size, dtype)
    if key not in traced:
        traced[key] = _trace_flow(model, batch, latent_size, dtype)
    return traced[key]


def _trace_flow(model: nn.Module, batch: int, latent_size: int, dtype: torch.dtype) -> Flow:
    twin = meta_twin(model, dtype)
    spec = spec_for(twin)
    made: dict[int, tuple[torch.Tensor, str, set[str]]] = {}  # id → (tensor, producer, readers)
    io_bytes: dict[str, int] = {}
    running = [INPUT]

    def before(name: str):
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            for t in _tensors((args, kwargs)):
                _, producer, readers = made.setdefault(id(t), (t, running[0], set()))
                if producer != name:
                    readers.add(name)
                    io_bytes[name] = io_bytes.get(name, 0) + _nbytes(t)
            running[0] = name

        return hook

    def after(name: str):
        def hook(_module: nn.Module, _args: tuple, _kwargs: dict, output: Any) -> None:
            io_bytes[name] = io_bytes.get(name, 0) + sum(_nbytes(t) for t in _tensors(output))

        return hook

    handles = []
    for name, module in block_modules(twin, spec.layout(twin)):
        handles.append(module.register_forward_pre_hook(before(name), with_kwargs=True))
        handles.append(module.register_forward_hook(after(name), with_kwargs=True))
    try:
        inputs = spec.example_inputs(twin, batch, latent_size, dtype, torch.device("meta"))
        for t in _tensors((inputs.sample, inputs.timestep, inputs.context, inputs.conditioning)):
            made[id(t)] = (t, INPUT, set())
        with torch.no_grad(), _CreditProducers(made, running):
            walk_plain(spec, twin, inputs)
    finally:
        for handle in handles:
            handle.remove()
    tensors = tuple(
        TensorFlow(_nbytes(t), producer, frozenset(readers))
        for t, producer, readers in made.values()
        if readers
    )
    return Flow(tensors, io_bytes)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)
