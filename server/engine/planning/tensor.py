"""The planner's tensor axis: a tensor group's step, predicted from counted costs plus the bytes
its all-reduces move (`runtime/tensor.py` runs it).

A group of T ranks runs each split block with 1/T of its heads and MLP features: its matmuls and
attention are 1/T each, so a split block costs its seconds times the share of its weights a rank
holds (`tensor_shares`: ≈ 1/T for a DiT block, whose norms are a sliver of it; most of a UNet
block, whose convolutions run whole on every rank). On top, each exchange the block's cuts make
(`tensor_exchanges`, counted from the spec: FLUX.1's double block 4 row cuts and 2 gathers, Wan's
3 row cuts and 5 norms): the runtime sums a row cut's partials by gathering every rank's whole
partial, (T-1) of the tokens' bytes a rank (not a ring's 2 · (T-1)/T), a gathered output moves
(T-1)/T of them, a norm's sum of squares next to nothing; each waits for the slowest rank
(`Link.sync_s`), and nothing overlaps the compute. The tokens' bytes are half of what the block
reads and writes (the meta trace's `block_io_bytes`), as for sequence groups. Blocks that do not
split run whole on every rank at once (no faster than one device). The links are the sequence
groups' (`Link`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property, partial
from typing import Any

import torch
from torch import nn

from server.engine.denoisers.blocks import Cut, TensorSplit, part, tensor_bytes
from server.engine.denoisers.specs import spec_for
from server.engine.hardware.devices import separate_memories
from server.engine.planning.parallel import Candidate, ParallelPlan
from server.engine.planning.plan import ShardPlan, plan_shards
from server.engine.planning.sequence import GroupSteps, Link
from server.errors import PlanError


@dataclass(frozen=True)
class Exchanges:
    """A split block's exchanges in one call: row cuts' partial sums, gathered outputs, norms."""

    sums: int = 0
    gathers: int = 0
    norms: int = 0

    def seconds(self, tokens: float, degree: int, link: Link) -> float:
        moved = tokens * (degree - 1) * (self.sums + self.gathers / degree)
        return moved / link.bytes_per_s + (self.sums + self.gathers + self.norms) * link.sync_s


def tensor_exchanges(model: nn.Module, split: TensorSplit) -> dict[str, Exchanges]:
    """Each split block's exchanges, from the cuts its modules have."""
    counted = {}
    for block in split.blocks:
        cuts = [split.cut_of(f"{block}.{name}") for name, _ in part(model, block).named_modules()]
        counted[block] = Exchanges(
            sum(c in (Cut.ROW, Cut.PACKED_ROW) for c in cuts), cuts.count(Cut.GATHERED), cuts.count(Cut.NORM)
        )
    return counted


def tensor_step_s(
    plan: ShardPlan,
    costs: Mapping[str, float],
    degree: int,
    shares: Mapping[str, float],
    exchanges: Mapping[str, Exchanges],
    io_bytes: Mapping[str, int],
    share: float,
    link: Link,
) -> tuple[float, float]:
    """Seconds of one step through a rank's `plan` as a tensor group of `degree` ranks, and the
    exchanges' part of them (`shares`: the split blocks' part a rank holds; `exchanges`: theirs;
    `costs`, `io_bytes`, `share`: as `sequence.group_step_s` takes them)."""
    compute = exchange = 0.0
    for stage in plan.stages:
        for block in stage.blocks:
            if block in shares:
                compute += costs[block] * shares[block]
                exchange += exchanges[block].seconds(io_bytes.get(block, 0) * share / 2, degree, link)
            else:
                compute += costs[block]
    return compute + exchange, exchange


def tensor_shares(model: nn.Module, split: TensorSplit, size: int, dtype: torch.dtype) -> dict[str, float]:
    """The part of each split block one rank of a tensor group of `size` holds: its cut layers'
    weights ÷ size (a column cut's bias too; a row cut's bias stays whole), the rest whole."""
    shares = {}
    for block in split.blocks:
        root = part(model, block)
        whole, cut = tensor_bytes(root, dtype), 0
        for name, layer in root.named_modules():
            kind = split.cut_of(f"{block}.{name}")
            if kind is not None and isinstance(layer, nn.Linear):
                cut += layer.weight.numel() * dtype.itemsize
                if layer.bias is not None and kind in (Cut.COLUMN, Cut.GATHERED):
                    cut += layer.bias.numel() * dtype.itemsize
        shares[block] = (whole - cut + cut / size) / max(1, whole)
    return shares


class TensorAxis(GroupSteps):
    """The planner's search (`planner._Search`), its tensor groups' part: `--layout`, `--parallel
    tensor` and the R × S × T candidates auto weighs. Reads the search's model, devices,
    options, costs and links."""

    spread = 0  # the text encoders' bytes in options' resident (`plan_parallel`'s `spread`)

    def layout(self, layout: str, costs_note: str) -> ParallelPlan:
        """--layout RxSxT: R replicas of S stages, each stage a tensor group of T devices, as asked."""
        replicas, stages, degree = (int(n) for n in layout.split("x"))
        count = replicas * stages * degree
        if self.devices != ["cpu"] and len(self.devices) != count:
            raise PlanError(f"--layout {layout} takes {count} devices; --devices names {len(self.devices)}")
        if degree > 1 and self.tensor_split is None:
            raise PlanError(f"--layout {layout}: {type(self.model).__name__} declares no split of its blocks")
        candidate = (
            self.add_tensor(replicas, degree, stages) if degree > 1 else self.add_shape(replicas, stages)
        )
        if candidate.rows_per_s is None:
            raise PlanError(f"--layout {layout}: {candidate.note}")
        return self.plan_of(candidate, f"--layout {layout} asked for {candidate.label}", costs_note)

    def tensor_group(self, costs_note: str) -> ParallelPlan:
        """--parallel tensor: one tensor group over every device (`add_tensor`)."""
        size = len(self.devices)
        if self.tensor_split is None or size < 2:
            why = (
                f"{type(self.model).__name__} declares no split of its blocks (every family diffshard "
                "serves does: a new one declares it in its spec): use replicas, pipeline or sequence"
                if self.tensor_split is None
                else "it splits every block over two or more devices: --devices cpu,cpu or cuda:0,cuda:1"
            )
            raise PlanError(f"--parallel tensor: {why}")
        candidate = self.add_tensor(1, size)
        if candidate.rows_per_s is None:
            raise PlanError(f"--parallel tensor over {size} devices: {candidate.note}")
        reason = (
            f"--parallel tensor: every block's heads and MLPs split over {size} devices, each holding "
            f"{max(self.tensor_shares(size).values()):.0%} of a split block; every call on all of them"
        )
        return self.plan_of(candidate, reason, costs_note)

    def add_tensor(self, replicas: int, degree: int, stages: int = 1) -> Candidate:
        """`replicas` pipelines of `stages` stages, each stage a tensor group of `degree` devices
        (in order: a replica's devices stage by stage, a stage's ranks consecutive). Rank k of a
        replica holds its share of the split blocks (`tensor_shares`) over its device of each
        stage; a lane per replica, its stages in turn, as `tensor_step_s` predicts it (under
        load each replica batches its share of the rows)."""
        workers = replicas * stages * degree
        devices = self.devices * workers if self.devices == ["cpu"] else self.devices[:workers]
        threads = max(1, self.quota // workers) if self.all_cpu else 1
        if undivided := sorted(h for h in self.tensor_heads() if h % degree):
            why = f"{degree} does not divide the attention heads ({undivided[0]})"
            return self.add(Candidate(replicas, stages, None, why, tensor=degree))
        shares = self.tensor_shares(degree)
        lanes = [devices[r * stages * degree : (r + 1) * stages * degree] for r in range(replicas)]
        ranks_devices = [
            [lane[s * degree + k] for s in range(stages)] for lane in lanes for k in range(degree)
        ]
        try:
            ranks = tuple(
                plan_shards(
                    self.model,
                    mine,
                    self.strategy,
                    **self._rank_options(ranks_devices, shares, index, degree),
                )
                for index, mine in enumerate(ranks_devices)
            )
        except PlanError as err:
            return self.add(Candidate(replicas, stages, None, str(err), tensor=degree))
        rows = self._lane_rows(replicas)
        step_s = self._tensor_s(ranks[0], threads, rows, degree) * self._stretch(workers, threads)
        lone_s = self._tensor_s(ranks[0], threads, self.lone_rows, degree)
        cpu_threads = threads if self.all_cpu else None
        note = self._note(workers, cpu_threads, len(devices))
        rate = replicas * rows / step_s
        candidate = Candidate(replicas, stages, rate, note, lone_s, cpu_threads, tensor=degree)
        self.plans[id(candidate)] = (ranks, 1)
        return self.add(candidate)

    def _rank_options(
        self, ranks: list[list[str]], shares: Mapping[str, float], index: int, degree: int
    ) -> dict[str, Any]:
        """Rank `index`'s `plan_shards` options: its devices' budgets and its share of the blocks;
        the VAE with the first rank, the text encoders too, or on separate GPUs a share of them on
        each of the first group's ranks (`parts.spread_encoder` places their layers so)."""
        firsts = [devices[0] for devices in ranks[:degree]]
        spread = self.spread if separate_memories(firsts) else 0
        whole = self.options.get("resident", 0) - spread
        held = (whole if index == 0 else 0) + (spread // degree if index < degree else 0)
        return self._options(ranks[index]) | {"shares": shares, "resident": held}

    def tensor_shares(self, degree: int) -> dict[str, float]:
        assert self.tensor_split is not None
        return tensor_shares(self.model, self.tensor_split, degree, self.dtype)

    def tensor_heads(self) -> set[int]:
        """The head counts of the attention modules a tensor group splits by their queries."""
        split = self.tensor_split
        assert split is not None
        return {
            module.heads
            for block in split.blocks
            for name, module in self.model.get_submodule(block).named_modules()
            if hasattr(module, "heads") and split.cut_of(f"{block}.{name}.to_q")
        }

    def _tensor_s(self, plan: ShardPlan, threads: int, rows: int, degree: int) -> float:
        """Seconds of one step of `rows` rows through a rank's `plan` as a tensor group of `degree`."""
        assert self.tensor_split is not None
        exchanges = tensor_exchanges(self.model, self.tensor_split)
        step = partial(tensor_step_s, shares=self.tensor_shares(degree), exchanges=exchanges)
        return self._ranks_s(plan, threads, rows, degree, step)

    @cached_property
    def tensor_split(self) -> TensorSplit | None:
        """What the model's spec splits in a tensor group (None: it declares nothing)."""
        spec = spec_for(self.model)
        return spec.tensor(self.model) if hasattr(spec, "tensor") else None

    def add_tensor_shapes(self) -> None:
        """Auto's tensor candidates: every replicas × stages × tensor degree using all the devices."""
        count = len(self.devices)
        for degree in (t for t in range(2, count + 1) if count % t == 0) if self.tensor_split else ():
            for stages in (s for s in range(1, count // degree + 1) if count // degree % s == 0):
                self.add_tensor(count // degree // stages, degree, stages)
