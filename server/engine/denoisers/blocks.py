"""A denoiser as an ordered list of blocks, the unit the planner places on devices.

A block is one or more of the model's modules that forward runs together. Blocks are
listed in *execution* order, not registration order: `UNet2DConditionModel.named_children()`
lists `up_blocks` before `mid_block`, but forward runs the mid block first.

Supporting another denoiser means declaring its blocks (a `DenoiserSpec`, registered in
`specs.py`), not editing the planner or the shard: `unet.py` declares diffusers' UNet,
`dit.py` diffusers' MMDiT (`SD3Transformer2DModel`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from fnmatch import fnmatchcase
from typing import Any, Protocol

import torch
from torch import nn

from server.engine.quantize import stored_bytes


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


# A conditioning entry: [rows, text tokens], 1 where a row's prompt has a token, for denoisers whose
# rows' prompts are zero-padded to one length (Qwen-Image, Z-Image, FLUX.2): the padding is masked
TEXT_MASK = "encoder_hidden_states_mask"
# A call of such rows takes the text columns its longest prompt uses, rounded up to this (one shape
# for similar prompts: a compiled graph's): cut on the host, where each prompt's length is known
TEXT_BUCKET = 64
# An edit's images as tokens joined after the noise's (FLUX.2, Qwen-Image-Edit): [rows, tokens,
# features], packed as the noise is, the same on every row of a request; and where they sit:
# FLUX.2's 4-axis position ids [rows, tokens, 4], Qwen-Image-Edit's (height, width) in tokens of
# each image [rows, images, 2] (a request's rows, and a call's, share them)
REFERENCES = "reference_tokens"
REFERENCE_IDS = "reference_ids"
REFERENCE_SHAPES = "reference_shapes"
# A flow map's (a step-distilled FLUX.3's) timestep each row's step jumps to: [rows], 0 at the last
TARGET_TIMESTEP = "target_timestep"
# Qwen-Image 2.1's [rows, text tokens]: 1 where a prompt's token is a slot of an edit's image; cut
# with the context as TEXT_MASK is
IMAGE_SLOTS = "image_slots"
TEXT_ALIGNED = (TEXT_MASK, IMAGE_SLOTS)


@dataclass
class DenoiserInputs:
    """One conditional forward's inputs: `model(sample, timestep, context, **conditioning)`."""

    sample: torch.Tensor
    timestep: torch.Tensor | float | int
    context: torch.Tensor
    conditioning: dict[str, Any] = field(default_factory=dict)


@dataclass
class Flow:
    """What crosses block boundaries in one forward: `rows`, per-row tensors (or tuples of them,
    [rows, ...] each: a row subset selects them), and `shared`, the same for every row (rotary
    embeddings, sizes, flags), set before the first block and read-only after."""

    rows: dict[str, Any]
    shared: dict[str, Any] = field(default_factory=dict)

    def select(self, index: torch.Tensor) -> Flow:
        """The flow of the rows in `index` (on the rows' device)."""
        rows = {k: map_rows(v, lambda t: t.index_select(0, index.to(t.device))) for k, v in self.rows.items()}
        return Flow(rows, self.shared)


def map_rows(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`fn` on every tensor of a flow entry (a tensor, or a tuple or list of them)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple | list):
        return type(value)(map_rows(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: map_rows(v, fn) for k, v in value.items()}
    return value


BlockFn = Callable[[nn.Module, dict[str, Any], dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class BlockCall:
    """How the walker runs one block: `fn(owner, rows, shared)` returns the new per-row flow.
    `fn` is a module-level function (a compiled graph names it); `owner` is the module it
    reads, so blocks that repeat (a DiT's) share one compiled graph."""

    owner: nn.Module
    fn: BlockFn
    # a rows entry the block works on: where a call has none (FLUX.3's reference blocks without
    # references) the block has nothing to do, and the walker passes the flow on untouched
    needs: str | None = None


@dataclass(frozen=True)
class CacheBoundary:
    """Where step caching cuts a denoiser: the deep blocks `deep` (first, last) run only on
    refreshing rows; `first` (if any) is the block whose residual of `carry` measures change
    (First-Block-Cache); `keep` is what a refreshing row keeps of `carry` over the deep blocks:
    their "output" (DeepCache) or their "residual" (added to the carry when reused). `stack`
    names a per-row tuple the deep blocks pop (a UNet's skip residuals) and how many entries they
    leave of it; `after`, the rows the blocks after the deep ones read. `more`: other streams the
    deep blocks carry beside `carry` (LTX-2's audio beside its video), kept and reused alike; the
    change is measured on `carry` alone."""

    deep: tuple[str, str]
    carry: str
    keep: str  # "output" | "residual"
    first: str | None = None  # a boundary with a first block serves `first_block`, else `deep`
    stack: tuple[str, int] | None = None
    after: tuple[str, ...] | None = None  # the rows the blocks after the deep ones read (None: all)
    more: tuple[str, ...] = ()

    @property
    def carried(self) -> tuple[str, ...]:
        return (self.carry, *self.more)


@dataclass(frozen=True)
class SequenceSplit:
    """Where a denoiser's tokens may be split across a sequence group (`runtime/sequence.py`):
    the `blocks` that run on a slice of the tokens (a DiT's transformer blocks: everything they
    do is per token except attention, which the group exchanges), the per-row entries cut along
    their token dimension (`tokens`: key → dim), and `shared(shared, cuts)`, the shared values of
    a rank's slice (FLUX.1's rotary embeddings; `cuts`: key → (start, stop, length)). `splits`:
    whether a call's inputs may be split at all (None: always; Qwen-Image 2.1's first calls, whose
    attention masks pairs of tokens, run whole)."""

    blocks: frozenset[str]
    tokens: dict[str, int]
    shared: Callable[[dict[str, Any], dict[str, tuple[int, int, int]]], dict[str, Any]] | None = None
    splits: Callable[[DenoiserInputs], bool] | None = None

    def takes(self, inputs: DenoiserInputs) -> bool:
        return self.splits is None or self.splits(inputs)


# What a tensor group splits (`runtime/tensor.py`): how each Linear layer of the split blocks is cut.


class Cut(StrEnum):
    COLUMN = "column"  # output features cut
    PACKED_COLUMN = "packed_column"  # a column cut of an output made of several parts (fused q/k/v/MLP)
    ROW = "row"  # input features cut, partial outputs summed over the ranks
    PACKED_ROW = "packed_row"  # a row cut of an input made of several column-cut parts
    GATHERED = "gathered"  # output features cut, then gathered whole on every rank
    NORM = "norm"  # an RMSNorm over every head's features (Wan's): its mean of squares summed over the ranks


PACKED = (Cut.PACKED_COLUMN, Cut.PACKED_ROW)
# diffusers' `_tp_plan` styles
STYLES = {
    "colwise": Cut.COLUMN,
    "rowwise": Cut.ROW,
    "PackedColwiseParallel": Cut.PACKED_COLUMN,
    "PackedRowwiseParallel": Cut.PACKED_ROW,
}


@dataclass(frozen=True)
class TensorSplit:
    """What a tensor group splits: the `blocks` (a DiT's transformer blocks), each Linear layer's
    cut by pattern (`layers`: inside a block, `*` for its index), and a packed layer's parts
    (`packed`: pattern → the parts' shares of its features, e.g. (1, 4): attention, then MLP;
    each part is cut alike). `rank_heads`: the attention modules' `heads` become a rank's share,
    for processors that reshape by the count (the MMDiT's, Wan's); diffusers' tensor-parallel-ready ones
    reshape by head size and read the whole count (Qwen-Image's derives the head size from it).
    `head_rows`: per-row entries made per head (LTX-2's rotary embeddings, [rows, heads, tokens,
    d]), key → their heads' dim: each rank takes its heads' share, as its attention modules do."""

    blocks: frozenset[str]
    layers: Mapping[str, Cut]
    packed: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    rank_heads: bool = True
    head_rows: Mapping[str, int] = field(default_factory=dict)

    def cut_of(self, path: str) -> Cut | None:
        return next((cut for pattern, cut in self.layers.items() if fnmatchcase(path, pattern)), None)

    def parts_of(self, path: str) -> tuple[int, ...]:
        return next(parts for pattern, parts in self.packed.items() if fnmatchcase(path, pattern))


def diffusers_split(
    model: nn.Module, blocks: frozenset[str], more: Mapping[str, Cut] | None = None
) -> TensorSplit:
    """The model's own `_tp_plan` (diffusers' declaration: colwise, rowwise and packed styles,
    a packed layer's parts from the style or the layer's `_tp_packed_*_blocks`), with `more` cuts."""
    cuts, packed = {}, {}
    for pattern, style in model._tp_plan.items():
        cut = STYLES[style if isinstance(style, str) else type(style).__name__]
        cuts[pattern] = cut
        if cut in PACKED:
            layer = next(m for n, m in model.named_modules() if fnmatchcase(n, pattern))
            kind = "col" if cut == Cut.PACKED_COLUMN else "row"
            packed[pattern] = tuple(
                getattr(style, "blocks", None) or getattr(layer, f"_tp_packed_{kind}_blocks")
            )
    return TensorSplit(blocks, cuts | dict(more or {}), packed, rank_heads=False)


class DenoiserSpec(Protocol):
    """What the engine needs to know about one kind of denoiser: its blocks, and how to run
    them one by one (`begin`, each block's call, `end`: the block walker runs them)."""

    def layout(self, model: nn.Module) -> Layout: ...

    def example_inputs(
        self, model: nn.Module, batch: int, latent_size: int, dtype: torch.dtype, device: torch.device
    ) -> DenoiserInputs: ...

    def begin(self, model: nn.Module, inputs: DenoiserInputs) -> Flow: ...

    def calls(self, model: nn.Module) -> dict[str, BlockCall]: ...

    def end(self, model: nn.Module, flow: Flow, inputs: DenoiserInputs) -> torch.Tensor: ...

    def boundary(self, model: nn.Module) -> CacheBoundary | None: ...

    def sequence(self, model: nn.Module) -> SequenceSplit | None: ...


def flow_timesteps(batch: int, device: torch.device | str) -> torch.Tensor:
    """A flow-matching model's example timesteps, one per row: sigma·1000, float32 as its
    scheduler makes them (not the model's dtype), spread so rows differ."""
    return torch.linspace(1000.0, 1.0, batch, device=device)


def stacked_layout(
    model: nn.Module, embed: tuple[str, ...], streams: tuple[str, ...], out: tuple[str, ...]
) -> Layout:
    """A DiT's layout: the embedding modules as one block, every block of each stream in order
    (`stream.i`, a block each: the walker's unit, and the compiled graph blocks that repeat share),
    then the output modules as one block."""
    blocks = [Block("embed", embed)]
    for stream in streams:
        blocks += [Block(f"{stream}.{i}", (f"{stream}.{i}",)) for i in range(len(getattr(model, stream)))]
    blocks.append(Block("out", out))
    return Layout(tuple(blocks))


def present(model: nn.Module, names: tuple[str, ...]) -> tuple[str, ...]:
    """Those of `names` the model has (optional parts: class embeddings, IP-Adapter projections)."""
    return tuple(n for n in names if getattr(model, n, None) is not None)


class TensorPart(nn.Module):
    """A parameter or buffer a block owns outside any submodule (Wan's root `scale_shift_table`),
    as a module: it holds the very tensor, so `.to(device)` moves the model's own (in place)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        super().__init__()
        if isinstance(tensor, nn.Parameter):
            self.register_parameter("tensor", tensor)
        else:
            self.register_buffer("tensor", tensor)


def part(model: nn.Module, path: str) -> nn.Module:
    """What a block's `modules` entry names: a submodule, or a parameter or buffer (`TensorPart`)."""
    parent, _, name = path.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    found = owner._parameters.get(name)
    if found is None:
        found = owner._buffers.get(name)
    return TensorPart(found) if found is not None else model.get_submodule(path)


def block_modules(model: nn.Module, layout: Layout) -> Iterator[tuple[str, nn.Module]]:
    """(block name, module) for every module each block owns, in execution order."""
    for block in layout.blocks:
        for path in block.modules:
            yield block.name, part(model, path)


def tensor_bytes(module: nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of `module`'s parameters and buffers (quantized ones: what they hold); with `dtype`,
    floating ones counted at its size."""
    total = 0
    for _, t in tensors_of(module):
        cast = dtype is not None and t.is_floating_point()
        total += t.numel() * dtype.itemsize if cast else stored_bytes(t)
    return total


def tensors_of(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters()
    yield from module.named_buffers()


def walk_plain(spec: DenoiserSpec, model: nn.Module, inputs: DenoiserInputs) -> torch.Tensor:
    """Every block of a model on one device, eagerly, nothing else: what `--compile full`
    compiles, and what the planner counts, traces and times blocks by."""
    flow = spec.begin(model, inputs)
    for call in spec.calls(model).values():
        flow = Flow(call.fn(call.owner, flow.rows, flow.shared), flow.shared)
    return spec.end(model, flow, inputs)
