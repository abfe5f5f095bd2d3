"""Shard plans: which contiguous run of blocks each device executes, computed before any weight moves.

A plan is a pure value. `plan_shards` builds one from a model (a weightless one on the meta
device is enough), the devices and a strategy:

- `even`     equal block counts, every device used while blocks remain;
- `memory`   balanced parameter bytes under per-device budgets (accelerate's `max_memory`);
- `cost`     balanced seconds per block (given: counted or measured by `costs.py`): the slowest
             stage is as fast as it can be;
- `explicit` the user's block → device map, validated.

Stages follow execution order, so the activations that cross a boundary are the running
hidden state plus whatever later blocks still need: skip residuals, the timestep embedding
and the text context. Their bytes come from a meta-device trace (`flow.py`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

import torch
from torch import nn

from server.engine.denoisers.blocks import Layout, part, tensor_bytes
from server.engine.denoisers.specs import layout_of, native_latent
from server.engine.hardware.devices import (
    default_budget,
    format_bytes,
    normalize_device,
    parse_memory_map,
    resolve_devices,
)
from server.engine.planning.flow import Flow, trace_flow
from server.engine.planning.partition import even_split, explicit_split, min_max_partition, stages_from_cuts
from server.engine.quantize import Quantization
from server.errors import PlanError


class Strategy(StrEnum):
    EVEN = "even"
    MEMORY = "memory"
    COST = "cost"
    EXPLICIT = "explicit"


STRATEGIES = tuple(s.value for s in Strategy)

# Activations a device must keep free beside its weights, as a multiple of the largest bytes
# one of its blocks reads plus writes: room for the block's own intermediates (attention,
# norms) and the transfer buffers at its boundary. An estimate, not a measurement.
ACTIVATION_HEADROOM = 4


@dataclass(frozen=True)
class Stage:
    device: str
    blocks: tuple[str, ...]
    block_bytes: tuple[int, ...]  # parameter + buffer bytes of each block, in `dtype` (quantized: as held)
    cost_s: float | None = None  # measured seconds per forward (cost strategy only)
    unquantized_bytes: int | None = None  # quantized weights: the stage's bytes without quantizing

    @property
    def param_bytes(self) -> int:
        return sum(self.block_bytes)


@dataclass(frozen=True)
class Boundary:
    after_stage: int
    bytes: int  # activations moved to the next stage's device on one forward
    tensors: int
    skips: tuple[str, ...]  # skip edges crossing it, e.g. "down_blocks.0→up_blocks.3×2"


@dataclass(frozen=True)
class DeviceEstimate:
    device: str
    param_bytes: int
    activation_reserve: int
    budget: int | None  # --max-memory's, else on CUDA the free memory less a margin
    other_bytes: int = 0  # what else sits there beside the shard: text encoders, VAE, ControlNets


@dataclass(frozen=True)
class ShardPlan:
    strategy: str
    dtype: str
    batch: int
    latent_size: int
    stages: tuple[Stage, ...]
    boundaries: tuple[Boundary, ...]
    devices: tuple[DeviceEstimate, ...]
    costs_from: tuple[str, ...] = ()  # cost strategy: ("given",), the costs it balanced

    @property
    def blocks(self) -> tuple[str, ...]:
        return tuple(b for stage in self.stages for b in stage.blocks)

    def device_of(self, block: str) -> str:
        for stage in self.stages:
            if block in stage.blocks:
                return stage.device
        raise KeyError(f"no block {block!r} in this plan")

    def blocks_on(self, device: str) -> tuple[str, ...]:
        device = normalize_device(device)
        return tuple(b for stage in self.stages if stage.device == device for b in stage.blocks)

    def to_dict(self) -> dict[str, Any]:
        plan = asdict(self)
        for stage, raw in zip(self.stages, plan["stages"], strict=True):
            raw["param_bytes"] = stage.param_bytes
        return plan

    def __str__(self) -> str:
        head = (
            f"ShardPlan strategy={self.strategy} dtype={self.dtype} "
            f"batch={self.batch} latent={self.latent_size}x{self.latent_size}"
        )
        if self.costs_from:  # the cost strategy balances given costs (counted or measured by costs.py)
            head += " costs=" + ", ".join(self.costs_from)
        rows: list[tuple[str, ...]] = [("stage", "device", "block", "params", "cost")]
        for i, stage in enumerate(self.stages):
            for j, (block, nbytes) in enumerate(zip(stage.blocks, stage.block_bytes, strict=True)):
                first = j == 0
                cost = f"{stage.cost_s * 1e3:.1f} ms" if first and stage.cost_s is not None else ""
                rows.append(
                    (
                        str(i) if first else "",
                        stage.device if first else "",
                        block,
                        format_bytes(nbytes),
                        cost,
                    )
                )
            if i < len(self.boundaries):
                edge = self.boundaries[i]
                rows.append((f"  ↓ {format_bytes(edge.bytes)} of activations in {edge.tensors} tensors",))
        devices = [("device", "weights", "activation reserve", "encoders and VAE", "budget")]
        for d in self.devices:
            budget = format_bytes(d.budget) if d.budget is not None else "-"
            sizes = (d.param_bytes, d.activation_reserve, d.other_bytes)
            devices.append((d.device, *(format_bytes(n) for n in sizes), budget))
        return "\n".join([head, *_table(rows), "", *_table(devices)])


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    """Left-aligned columns; one-cell rows are notes that span the table."""
    cells = [r for r in rows if len(r) > 1]
    widths = [max(len(r[c]) for r in cells) for c in range(len(cells[0]))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)).rstrip()
        if len(row) > 1
        else row[0]
        for row in rows
    ]


def plan_shards(
    model: nn.Module,
    devices: str | Sequence[str] = "auto",
    strategy: str = Strategy.MEMORY,
    *,
    max_memory: str | Mapping[str, str | int] | None = None,
    device_map: Mapping[str, str] | None = None,
    dtype: torch.dtype | None = None,
    latent_size: int | None = None,
    batch: int = 2,
    block_costs: Mapping[str, float] | Callable[[str], Mapping[str, float]] | None = None,
    resident: int = 0,
    block_bytes: Mapping[str, int] | None = None,
    experts: int = 1,
    shares: Mapping[str, float] | None = None,
) -> ShardPlan:
    """Plan how `model`'s blocks split across `devices`; nothing is loaded or moved.

    `max_memory` bounds each device (`"cuda:0=20GiB,cpu=64GiB"`; a CUDA device without one gets
    its free memory less a margin; a device listed k times gives each stage 1/k of it).
    `device_map`: the `explicit` strategy's block → device map. `block_costs`: the `cost`
    strategy's seconds per block, or a function of the stage's device giving them (`costs.py`).
    Activations are estimated for `batch` latents of `latent_size`²; `resident` counts bytes
    other components (text encoders, VAE) keep on the first stage's device. `block_bytes`: what
    each block holds when its weights are quantized (`server.engine.quantize`; default: its
    tensors in `dtype`). `experts`: models of this architecture split alike, each block's
    copies on one device (Wan 2.2 A14B's two experts: a step runs either, so time is one's and
    bytes are every one's). `shares`: the part of a block this plan's device holds (a tensor
    group's rank: `tensor_shares`; 1 for a block not listed).
    """
    # 1. Check the request before any work.
    strategy, device_list, device_map, budgets = _checked(strategy, devices, device_map, max_memory, batch)

    # 2. Measure the blocks: bytes from parameters, activations from a meta trace.
    layout, dtype = layout_of(model), dtype or next(model.parameters()).dtype
    latent_size = latent_size or native_latent(model)
    share = {n: experts * (shares or {}).get(n, 1.0) for n in layout.names}
    unquantized = {n: round(b * share[n]) for n, b in count_block_bytes(model, layout, dtype).items()}
    quantized = block_bytes is not None
    block_bytes = (
        {n: round(b * share[n]) for n, b in block_bytes.items()} if block_bytes else dict(unquantized)
    )
    flow = trace_flow(model, batch, latent_size, dtype)
    reserve = ACTIVATION_HEADROOM * max(flow.block_io_bytes.values(), default=0)
    capacities = _stage_capacities(device_list, budgets, reserve, {device_list[0]: resident})

    # 3. Assign blocks to devices.
    names, sizes = list(layout.names), [block_bytes[n] for n in layout.names]
    costs = None  # stage device → seconds per block
    if strategy == "cost":
        if block_costs is None:
            raise PlanError(
                "the cost strategy needs block costs: server.engine.planning.costs counts or times them"
            )
        costs = {d: dict(block_costs(d) if callable(block_costs) else block_costs) for d in device_list}
    if strategy == "even":
        stages = even_split(names, device_list)
    elif strategy == "explicit":
        stages = explicit_split(names, device_map or {})
    else:
        weights = (
            [[costs[d].get(n, 0.0) for n in names] for d in device_list]
            if costs is not None
            else [[float(s) for s in sizes]] * len(device_list)
        )
        cuts = min_max_partition(weights, sizes, capacities)
        if cuts is None:
            _raise_no_fit(names, sizes, device_list, capacities, budgets, reserve, resident)
        stages = stages_from_cuts(names, device_list, cuts)

    # 4. Put the numbers on the plan and check it fits.
    plan_stages = tuple(
        Stage(
            device,
            tuple(blocks),
            tuple(block_bytes[b] for b in blocks),
            sum(costs[device].get(b, 0.0) for b in blocks) if costs is not None else None,
            sum(unquantized[b] for b in blocks) if quantized else None,
        )
        for device, blocks in stages
    )
    estimates = _estimates(plan_stages, reserve, budgets, resident)
    _check_budgets(estimates)
    return ShardPlan(
        strategy=strategy,
        dtype=str(dtype).removeprefix("torch."),
        batch=batch,
        latent_size=latent_size,
        stages=plan_stages,
        boundaries=_boundaries(plan_stages, layout, flow),
        devices=estimates,
        costs_from=("given",) if costs is not None else (),
    )


def _estimates(
    stages: tuple[Stage, ...], reserve: int, budgets: dict[str, int], resident: int
) -> tuple[DeviceEstimate, ...]:
    """Per device the plan uses: its blocks' bytes, the activation reserve, its budget and (the
    first stage's device) what other components keep there."""
    return tuple(
        DeviceEstimate(
            device,
            sum(s.param_bytes for s in stages if s.device == device),
            reserve,
            budgets.get(device),
            resident if device == stages[0].device else 0,
        )
        for device in dict.fromkeys(s.device for s in stages)
    )


def _checked(
    strategy: str,
    devices: str | Sequence[str],
    device_map: Mapping[str, str] | None,
    max_memory: str | Mapping[str, str | int] | None,
    batch: int,
) -> tuple[Strategy, list[str], dict[str, str] | None, dict[str, int]]:
    """The strategy, the devices, the explicit map and every device's budget, checked."""
    if strategy not in STRATEGIES:
        raise PlanError(f"unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")
    strategy = Strategy(strategy)
    if strategy == "explicit":
        if not device_map:
            raise PlanError("the explicit strategy needs a device_map of block → device")
        device_map = {block: normalize_device(dev) for block, dev in device_map.items()}
        device_list = list(dict.fromkeys(device_map.values()))
    else:
        device_list = resolve_devices(devices)
    budgets = parse_memory_map(max_memory)
    for device in budgets:
        if device not in device_list:
            raise PlanError(f"max_memory names {device}, which is not among the devices {device_list}")
    if batch < 1:
        raise PlanError(f"batch must be at least 1, got {batch}")
    for device in dict.fromkeys(device_list):
        if device not in budgets and (free := default_budget(device)) is not None:
            budgets[device] = free
    return strategy, device_list, device_map, budgets


def count_block_bytes(
    model: nn.Module, layout: Layout, dtype: torch.dtype | None, quantization: Quantization | None = None
) -> dict[str, int]:
    """Bytes each block holds once cast to `dtype` (floating tensors take `dtype`'s size) and
    quantized by `quantization`, counted from shapes (the meta device will do); without `dtype`,
    what its live tensors hold (quantized ones too)."""
    out = dict.fromkeys(layout.names, 0)
    for block in layout.blocks:
        for path in block.modules:
            module = part(model, path)
            out[block.name] += (
                quantization.bytes(module, dtype, path) if quantization else tensor_bytes(module, dtype)
            )
    return out


def _stage_capacities(
    devices: list[str], budgets: dict[str, int], reserve: int, resident: Mapping[str, int]
) -> list[float]:
    repeats = Counter(devices)
    return [
        (budgets[d] - reserve - resident.get(d, 0)) / repeats[d] if d in budgets else math.inf
        for d in devices
    ]


def _raise_no_fit(
    names: list[str],
    sizes: list[int],
    devices: list[str],
    capacities: list[float],
    budgets: dict[str, int],
    reserve: int,
    resident: int,
) -> None:
    """Say which budget is too small and by how much."""
    repeats = Counter(devices)

    def room(device: str) -> str:
        shared = f", shared by {repeats[device]} stages" if repeats[device] > 1 else ""
        kept = f"{format_bytes(reserve)} kept for activations"
        if device == devices[0] and resident:
            kept += f" and {format_bytes(resident)} for text encoders, VAE and ControlNets"
        return f"{device} (budget {format_bytes(budgets[device])}, {kept}{shared})"

    lower = "lower --max-batch or --max-pixels (the activation reserve), " if reserve else ""
    hint = f"Raise --max-memory, {lower}add devices, use a smaller dtype or quantize (--quantize)."
    big = max(range(len(sizes)), key=sizes.__getitem__)
    roomy = max(range(len(devices)), key=capacities.__getitem__)
    if sizes[big] > capacities[roomy]:
        raise PlanError(
            f"block {names[big]} needs {format_bytes(sizes[big])} but the roomiest stage, on "
            f"{room(devices[roomy])}, has {format_bytes(max(capacities[roomy], 0))}: "
            f"{format_bytes(sizes[big] - max(capacities[roomy], 0))} short. {hint}"
        )
    # Fill stages in order to find the weight left without a place.
    i = 0
    for capacity in capacities:
        load = 0
        while i < len(names) and load + sizes[i] <= capacity:
            load += sizes[i]
            i += 1
    budgeted = ", ".join(room(d) for d in dict.fromkeys(devices) if d in budgets)
    raise PlanError(
        f"the model's {format_bytes(sum(sizes))} of weights do not fit {budgeted}: "
        f"{format_bytes(sum(sizes[i:]))} short, blocks {names[i]}…{names[-1]} have no room. {hint}"
    )


def _check_budgets(estimates: Sequence[DeviceEstimate]) -> None:
    for d in estimates:
        needed = d.param_bytes + d.activation_reserve + d.other_bytes
        if d.budget is not None and needed > d.budget:
            others = f", {format_bytes(d.other_bytes)} of text encoders and VAE" if d.other_bytes else ""
            raise PlanError(
                f"{d.device}: the plan puts {format_bytes(d.param_bytes)} of weights{others} and "
                f"{format_bytes(d.activation_reserve)} of activation reserve on it, over its "
                f"budget of {format_bytes(d.budget)} by {format_bytes(needed - d.budget)}"
            )


def _boundaries(stages: Sequence[Stage], layout: Layout, flow: Flow) -> tuple[Boundary, ...]:
    out = []
    done: set[str] = set()
    for i, stage in enumerate(stages[:-1]):
        done |= set(stage.blocks)
        crossing = flow.crossing(done)
        skips = tuple(str(e) for e in layout.skips if e.source in done and e.target not in done)
        out.append(Boundary(i, sum(t.nbytes for t in crossing), len(crossing), skips))
    return tuple(out)
