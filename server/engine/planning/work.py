"""The work each block does in one forward, counted on the meta device: no weights, no timing.

A plan must be readable before anything loads, so its costs are counted, not timed: one forward
of the weightless model under a dispatch mode that sees every aten op, attributing each to the
block running it. Per block:

- FLOPs of matrix products (mm, bmm, addmm, linear), convolutions and attention, apart: each
  class runs at its own speed (`calibrate.py`);
- bytes read and written by every other op (norms, activations, adds, copies): those are bound
  by memory bandwidth, not arithmetic;
- the number of ops: a small model is bound by dispatch overhead (Python, aten, kernel launch),
  which its FLOPs do not show.

Counting an SD-1.5 UNet at 2 rows of 32² latents takes about a second.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry, sdpa_flop_count

from server.engine.denoisers.blocks import block_modules, walk_plain
from server.engine.denoisers.specs import spec_for
from server.engine.planning.flow import as_loaded

aten = torch.ops.aten
MATMUL = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}
CONV = {aten.convolution, aten._convolution, aten.convolution_overrideable, aten._slow_conv2d_forward}
# ops that only describe a tensor differently: no kernel runs, next to no time
METADATA = {
    aten.view,
    aten._unsafe_view,
    aten.reshape,
    aten.expand,
    aten.permute,
    aten.transpose,
    aten.t,
    aten.unsqueeze,
    aten.squeeze,
    aten.slice,
    aten.select,
    aten.split,
    aten.split_with_sizes,
    aten.chunk,
    aten.unbind,
    aten.alias,
    aten.detach,
    aten.as_strided,
    aten.unflatten,
    aten.flatten,
    aten.sym_size,
    aten.sym_stride,
    aten.sym_numel,
    aten.is_same_size,
}


KINDS = ("matmul", "conv", "attention", "memory")


class Op(NamedTuple):
    kind: str
    flops: float
    bytes: float
    rows: int  # M of the GEMM a matmul or convolution is (output pixels × batch for a conv)
    weight_bytes: float = 0.0  # of `bytes`, the parameters' and buffers': the same at any rows

    def scaled(self, share: float) -> Op:
        """The op for `share` of its rows: FLOPs and activations scale, weights do not."""
        activations = self.bytes - self.weight_bytes
        rows = max(1, round(self.rows * share)) if self.rows else 0
        return Op(
            self.kind, self.flops * share, activations * share + self.weight_bytes, rows, self.weight_bytes
        )


@dataclass
class BlockWork:
    """One block's work in one forward: a row per op that runs a kernel, `Op(kind, FLOPs, bytes,
    rows)`: `kind` one of KINDS, bytes read and written (weights included), and for a matrix
    product or convolution the rows of its GEMM (small ones run far below peak)."""

    ops: list[Op] = field(default_factory=list)
    views: int = 0  # metadata-only ops: counted apart, next to free

    def flops(self, kind: str | None = None) -> float:
        return sum(op.flops for op in self.ops if kind is None or op.kind == kind)

    @property
    def bytes(self) -> float:
        return sum(op.bytes for op in self.ops)


@dataclass(frozen=True)
class ModelWork:
    rows: int
    latent_size: int
    dtype: str
    blocks: dict[str, BlockWork] = field(default_factory=dict)

    @property
    def flops(self) -> float:
        return sum(b.flops() for b in self.blocks.values())

    def at_rows(self, rows: int) -> ModelWork:
        """The same forward for `rows` rows (a lone image's split, say): counted once, scaled."""
        share = rows / self.rows
        blocks = {
            name: BlockWork([op.scaled(share) for op in b.ops], b.views) for name, b in self.blocks.items()
        }
        return ModelWork(rows, self.latent_size, self.dtype, blocks)


class _Counter(TorchDispatchMode):
    def __init__(self, model: nn.Module | None = None) -> None:
        super().__init__()
        # The model's weights, and views of them (a linear runs as addmm on its weight's t()),
        # kept alive so that their ids stay theirs.
        self.weights: list[torch.Tensor] = (
            [*model.parameters(), *model.buffers()] if model is not None else []
        )
        self.weight_ids = {id(t) for t in self.weights}
        self.block: str | None = None
        self.work: dict[str, BlockWork] = defaultdict(BlockWork)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func._overloadpacket
        if packet not in flop_registry and packet is not aten.scaled_dot_product_attention:
            with self:  # count what a composite op (linear, conv2d, group_norm) runs as
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        if self.block is None:
            return out
        work = self.work[self.block]
        if packet in METADATA:
            work.views += 1
            if any(id(t) in self.weight_ids for t in tree_flatten(args)[0]):
                for view in tree_flatten(out)[0]:
                    self.weights.append(view)
                    self.weight_ids.add(id(view))
            return out
        if packet is aten.scaled_dot_product_attention:  # one fused kernel, whichever backend runs it
            query, key, value = args[:3]
            kind, flops = "attention", float(sdpa_flop_count(query.shape, key.shape, value.shape))
        elif packet in flop_registry:
            kind = "matmul" if packet in MATMUL else "conv" if packet in CONV else "attention"
            flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
        else:
            kind, flops = "memory", 0.0
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        weights = sum(_nbytes(t) for t in tensors if id(t) in self.weight_ids)
        work.ops.append(
            Op(kind, flops, float(sum(map(_nbytes, tensors))), _gemm_rows(kind, out), float(weights))
        )
        return out


def _gemm_rows(kind: str, out: Any) -> int:
    if kind == "matmul":  # [..., M, N]
        return out.numel() // out.shape[-1]
    if kind == "conv":  # [N, C, H, W]: one GEMM row per output pixel
        return out.numel() // out.shape[1]
    return 0


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def count_ops(run: Callable[[], object]) -> BlockWork:
    """The work of whatever `run()` computes (on any device), as one block."""
    counter = _Counter()
    counter.block = "all"
    with torch.inference_mode(), counter:
        run()
    return counter.work["all"]


def count_work(model: nn.Module, rows: int, latent_size: int, dtype: torch.dtype) -> ModelWork:
    """Each block's work for one forward of `rows` rows of `latent_size`² latents in `dtype`,
    counted on a weightless copy of `model` (built from its config on the meta device)."""
    with torch.device("meta"):
        twin = type(model).from_config(model.config)
    twin = as_loaded(twin, dtype).eval()
    spec = spec_for(twin)
    counter = _Counter(twin)

    def enter(name: str):
        def hook(_module: nn.Module, _args: tuple) -> None:
            counter.block = name

        return hook

    handles = [
        module.register_forward_pre_hook(enter(name))
        for name, module in block_modules(twin, spec.layout(twin))
    ]
    try:
        inputs = spec.example_inputs(twin, rows, latent_size, dtype, torch.device("meta"))
        with torch.inference_mode(), counter:
            walk_plain(spec, twin, inputs)
    finally:
        for handle in handles:
            handle.remove()
    names = spec.layout(twin).names
    return ModelWork(
        rows, latent_size, str(dtype).removeprefix("torch."), {n: counter.work[n] for n in names}
    )
