"""Tensor parallelism: a group of devices shares each DiT block, each device holding a slice of
the block's Linear layers and every token (Megatron's split of a transformer block).

How a layer splits (`TensorSplit.layers`, by dotted pattern inside the split blocks, `*` for a
block's index; diffusers declares most of it as a model's `_tp_plan`):

- **column**: its output features are cut: q, k and v (each rank its heads ÷ D: the attention
  modules it feeds get `heads` ÷ D), an MLP's first projection;
- **row**: its input features are cut, as the column layers before it left them; the partial
  outputs are summed over the ranks (an all-reduce), then its bias added once: the attention's
  output projection, an MLP's second;
- **packed row**: a row layer whose input concatenates several column-split parts (FLUX.1's single
  block: attention and MLP outputs side by side), each part's slice of the inputs taken;
- **gathered**: a column layer whose slices are gathered whole again on every rank: a block's
  AdaLN modulation (6 · dim² weights in a FLUX.1 block, a sixth of it; its output a few vectors a
  row), so norms keep the full vector while each rank holds a slice of the weights.

Norms, rotary embeddings, the embedding and output blocks are whole on every rank. The ranks
are threads of this process over an in-process exchange (`sequence.Group`, as sequence groups'):
every rank reads the same call plan, runs the same blocks on the same rows, and sums partial
outputs in rank order, so every rank holds the same values after each reduction.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from server.engine.denoisers.blocks import PACKED, Cut, Flow, TensorSplit, map_rows
from server.engine.runtime.call import CallPlan, CallResult
from server.engine.runtime.sequence import Group, Rank, Submit, chunks, run_ranks
from server.errors import PlanError


class RankSlot:
    """Where the rank running a split block leaves itself for the block's split layers (row and
    gathered ones exchange through it), as `RowsSlot` holds a stage's adapter rows: a slot per
    split block of a rank's module tree, and a block runs one call at a time (its stage's gate)."""

    def __init__(self) -> None:
        self._rank: Any = None

    @property
    def rank(self) -> Any:
        if self._rank is None:
            raise RuntimeError("a tensor-split layer ran outside its tensor group's call")
        return self._rank

    @contextmanager
    def holding(self, rank: Any) -> Iterator[None]:
        """The block's split layers exchange through `rank` meanwhile: anything with `all_reduce`
        and `gather` (a `TensorRank`; `benchmarks.parallel.tensor`'s rank of a `torch.distributed` group)."""
        self._rank = rank
        try:
            yield
        finally:
            self._rank = None


def rank_slots(model: nn.Module) -> dict[str, RankSlot]:
    """The slots `split_model` gave `model`'s split blocks, by block."""
    slots = getattr(model, "rank_slots", None)
    if slots is None:
        raise PlanError("this model was not split for a tensor group (split_model)")
    return slots


class RowLinear(nn.Linear):
    """A row-split Linear: this rank's inputs' slice of the weights; partial outputs summed over
    the ranks, then the (whole) bias added."""

    slot: RankSlot

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.slot.rank.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class GatheredLinear(nn.Linear):
    """A column-split Linear whose every rank gets the whole output back (gathered in order)."""

    slot: RankSlot

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.slot.rank.gather(F.linear(x, self.weight, self.bias))
        here = x.device
        return torch.cat([p.to(here) for p in parts], dim=-1)


def _bounds(length: int, parts: Sequence[int], index: int, size: int) -> list[int]:
    """The indices rank `index` of `size` takes of `length` features made of `parts` (shares)."""
    unit, taken, at = length // sum(parts), [], 0
    for share in parts:
        width = share * unit
        if width % size:
            raise PlanError(f"a tensor group of {size} cannot split a layer part of {width} features evenly")
        step = width // size
        taken += range(at + index * step, at + (index + 1) * step)
        at += width
    return taken


def split_layer(
    layer: nn.Linear, cut: Cut, index: int, size: int, slot: RankSlot, parts: tuple[int, ...] = (1,)
) -> nn.Linear:
    """Rank `index`'s part of `layer` (of a group of `size`): a new Linear holding its slice (a
    copy: the whole weight is no longer referenced once every rank has its part); a row or
    gathered one exchanges through `slot`'s rank."""
    weight, bias = layer.weight.detach(), None if layer.bias is None else layer.bias.detach()
    if cut in (Cut.COLUMN, Cut.PACKED_COLUMN, Cut.GATHERED):
        keep = _bounds(weight.shape[0], parts, index, size)
        weight, bias = weight[keep], None if bias is None else bias[keep]
        cls, dim = (GatheredLinear, None) if cut == Cut.GATHERED else (nn.Linear, 0)
    else:
        keep = _bounds(weight.shape[1], parts, index, size)
        weight, cls, dim = weight[:, keep], RowLinear, 1
    out = cls(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    out.weight = nn.Parameter(weight.clone(), requires_grad=False)
    if bias is not None:
        out.bias = nn.Parameter(bias.clone(), requires_grad=False)
    out.rank_part = RankPart(dim, keep, tuple(layer.weight.shape))
    if cls is not nn.Linear:
        out.slot = slot
    return out


@dataclass(frozen=True)
class RankPart:
    """What of a whole layer a split one holds (`rank_part` on it): its output features (`dim`
    0), its input features (1), or, gathered, all of its output (None); and the whole's shape."""

    dim: int | None
    keep: list[int]
    whole: tuple[int, int]

    def of_adapter(self, down: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A LoRA pair of the whole layer, as this rank's part of it: B's rows for a column cut,
        A's columns for a row cut (its delta then partial: summed over the ranks), whole when the
        output is gathered."""
        if self.dim == 0:
            return down, up[self.keep]
        if self.dim == 1:
            return down[:, self.keep], up
        return down, up


def split_model(model: nn.Module, split: TensorSplit, index: int, size: int) -> dict[str, RankSlot]:
    """Replace, in place, every layer of `split`'s blocks that it cuts by rank `index`'s part,
    and (`rank_heads`) give the attention modules fed by column-split queries their share of the
    heads; a group that does not divide them is refused before anything changes. Each block's
    split layers exchange through its slot (returned by block, and `rank_slots(model)`)."""
    cut_layers, slots = [], {block: RankSlot() for block in split.blocks}
    for block in split.blocks:
        for name, layer in model.get_submodule(block).named_modules():
            cut = split.cut_of(f"{block}.{name}")
            if cut is not None and isinstance(layer, nn.RMSNorm if cut == Cut.NORM else nn.Linear):
                cut_layers.append((block, f"{block}.{name}", layer, cut))
    attentions = {path.rpartition(".")[0] for _, path, _, _ in cut_layers if path.endswith(".to_q")}
    for path in sorted(attentions):
        heads = model.get_submodule(path).heads
        if heads % size:
            raise PlanError(f"a tensor group of {size} must divide the attention heads ({heads} in {path})")
    for block, path, layer, cut in cut_layers:
        parts = split.parts_of(path) if cut in PACKED else (1,)
        parent, _, child = path.rpartition(".")
        part = (
            RankRMSNorm(layer, index, size, slots[block])
            if cut == Cut.NORM
            else split_layer(layer, cut, index, size, slots[block], parts)
        )
        setattr(model.get_submodule(parent), child, part)
    for path in attentions if split.rank_heads else ():
        model.get_submodule(path).heads //= size
    model.rank_slots = slots
    return slots


class RankRMSNorm(nn.Module):
    """`torch.nn.RMSNorm` over every head's features (Wan's `rms_norm_across_heads`) on a rank's
    slice of them: the squares' sum over the ranks, each scaling its own features."""

    def __init__(self, norm: nn.RMSNorm, index: int, size: int, slot: RankSlot) -> None:
        super().__init__()
        self.features, self.eps, self.slot = int(norm.normalized_shape[-1]), norm.eps, slot
        keep = _bounds(self.features, (1,), index, size)
        weight = None if norm.weight is None else nn.Parameter(norm.weight.detach()[keep].clone(), False)
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        squares = self.slot.rank.all_reduce(x.float().pow(2).sum(-1, keepdim=True))
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        out = (x.float() * torch.rsqrt(squares / self.features + eps)).type_as(x)
        return out if self.weight is None else out * self.weight


class TensorRank(Rank):
    """A rank's place in one call's tensor group (`Rank`'s exchanges): the walker runs the split
    blocks with the whole flow (`cut` and `join` leave it as it is) and its tree's split layers
    exchange through it (left in the block's slot while it runs)."""

    def __init__(self, group: Group, index: int, split: TensorSplit, slots: dict[str, RankSlot]) -> None:
        super().__init__(group, index, split)  # type: ignore[arg-type]  # only `blocks` is read
        self.slots = slots

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `partial`, in rank order (the same values on every rank),
        added in float32 and rounded once to the partials' dtype (bf16 sums rounded each part)."""
        parts = self.gather(partial)
        here = partial.device
        total = parts[0].to(here, torch.float32, copy=True)
        for part in parts[1:]:
            total += part.to(here)
        return total.to(partial.dtype)

    def cut(self, flow: Flow) -> Flow:
        """The whole flow, but entries made per head (`TensorSplit.head_rows`): this rank's heads."""
        rows = dict(flow.rows)
        for key, dim in self.split.head_rows.items():  # type: ignore[attr-defined]
            first = rows.get(key)
            first = first[0] if isinstance(first, tuple) else first
            if first is not None:
                start, stop = chunks(first.shape[dim], self.size)[self.index]
                rows[key] = map_rows(rows[key], lambda t, d=dim, s=start, n=stop - start: t.narrow(d, s, n))
        return Flow(rows, flow.shared)

    def join(self, flow: Flow, shared: dict[str, Any]) -> Flow:
        return flow

    @contextmanager
    def attention(self, block: str) -> Iterator[None]:  # type: ignore[override]  # "while `block` runs"
        with self.slots[block].holding(self):
            yield


def run_tensor(
    shards: Sequence[Any], split: TensorSplit, inputs: Any, plan: CallPlan, submit: Submit
) -> CallResult:
    """One call of `plan` over a tensor group (`shards`: rank k's holds its parts of the split
    layers), rank 0 on this thread; rank 0's result (`sequence.run_ranks`)."""
    slots = [rank_slots(shard.model) for shard in shards]
    return run_ranks(
        shards, lambda group, index: TensorRank(group, index, split, slots[index]), inputs, plan, submit
    )
