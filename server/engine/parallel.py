"""Every device busy at once: replicas and pipelined stages, and the planner that picks them.

Split by layers alone, a model runs one device at a time. Two ways keep them all working:

- **replicas**: the whole denoiser on each device (or group of devices); rows are split
  between them. For a guided request that is CFG-parallel.
- **pipelined stages**: one split model, several micro-batches in it at once; stage gates
  (`gates.py`) let stage k run micro-batch m while stage k-1 runs micro-batch m+1.

A `ParallelPlan` holds R replicas of S stages each (pure replicas, a pure pipeline, or a hybrid
such as 2 × 2 on 4 GPUs) and how many lanes (micro-batch streams) feed each replica: one lane
per stage keeps every stage busy. `plan_parallel` proposes one: it measures every block's
forward time with the threads a worker would have, predicts each candidate's throughput
(rows per second: replicas × rows / slowest stage, boundary copies included) and takes the
fastest that fits the memory budgets, saying why.

CPU workers are the testbed: `cpu,cpu` is two workers sharing the host's cores, each running
its lane with its share of the intra-op threads, named `cpu:0` and `cpu:1`. CPU replicas share
one copy of the weights (the same memory), so replicas cost no memory there.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch
from torch import nn

from server.engine.blocks import DenoiserInputs
from server.engine.devices import resolve_devices
from server.engine.gates import worker_names
from server.engine.plan import ShardPlan, Strategy, plan_shards
from server.engine.profile import profile_block_costs
from server.engine.shard import ModelShard
from server.errors import PlanError

# Bytes per second a stage boundary moves between two GPUs: PCIe 4.0 x16 in practice. An
# estimate (NVLink is faster); on one host's CPU workers a boundary moves nothing.
BOUNDARY_BYTES_PER_S = 16e9


class Parallel(StrEnum):
    AUTO = "auto"  # the fastest predicted configuration
    REPLICAS = "replicas"  # the whole model on every device
    PIPELINE = "pipeline"  # one split, every stage busy with its own micro-batch
    OFF = "off"  # one split, one micro-batch at a time: the least memory


PARALLEL_MODES = tuple(p.value for p in Parallel)


@dataclass(frozen=True)
class Candidate:
    replicas: int
    stages: int
    rows_per_s: float | None  # predicted; None when it does not fit
    note: str = ""

    @property
    def label(self) -> str:
        replicas = f"{self.replicas} replica{'s' if self.replicas > 1 else ''}"
        return f"{replicas} × {self.stages} stage{'s' if self.stages > 1 else ''}"


@dataclass(frozen=True)
class ParallelPlan:
    replicas: tuple[ShardPlan, ...]  # each replica's split (its stages on its devices)
    lanes_per_replica: int  # micro-batch streams feeding each replica
    threads: int | None = None  # intra-op threads per lane (CPU workers); None: leave torch's
    candidates: tuple[Candidate, ...] = ()
    reason: str = ""
    workers: tuple[str, ...] = field(default=())  # a name per stage of every replica

    @property
    def stages(self) -> int:
        return len(self.replicas[0].stages)

    @property
    def lanes(self) -> int:
        return len(self.replicas) * self.lanes_per_replica

    @property
    def kind(self) -> str:
        if len(self.replicas) > 1:
            return "hybrid" if self.stages > 1 else "replicas"
        if self.stages > 1:
            return "pipeline" if self.lanes_per_replica > 1 else "layer split"
        return "single"

    def to_dict(self) -> dict[str, Any]:
        """The first replica's plan (every replica's has the same shape), with `parallel` beside it."""
        parallel = {
            "kind": self.kind,
            "replicas": len(self.replicas),
            "stages": self.stages,
            "micro_batches": self.lanes,
            "threads_per_worker": self.threads,
            "workers": list(self.workers),
            "reason": self.reason,
            "candidates": [
                {
                    "replicas": c.replicas,
                    "stages": c.stages,
                    "predicted_rows_per_s": c.rows_per_s,
                    "note": c.note,
                }
                for c in self.candidates
            ],
            "replica_devices": [[s.device for s in plan.stages] for plan in self.replicas],
        }
        return {**self.replicas[0].to_dict(), "parallel": parallel}

    @property
    def headline(self) -> str:
        """What runs where, why, and the candidates weighed (the plan's first lines)."""
        threads = f", {self.threads} thread{'s' * (self.threads != 1)} per worker" if self.threads else ""
        lines = [
            f"parallel: {self.kind}: {len(self.replicas)} replica(s) × {self.stages} stage(s), "
            f"{self.lanes} micro-batch lane(s){threads}; workers {', '.join(self.workers)}"
        ]
        if self.reason:
            lines.append(f"  why: {self.reason}")
        for c in self.candidates:
            predicted = f"{c.rows_per_s:.1f} rows/s predicted" if c.rows_per_s is not None else "does not fit"
            lines.append(f"  {c.label}: {predicted}{f' ({c.note})' if c.note else ''}")
        return "\n".join(lines)

    def __str__(self) -> str:
        lines = [self.headline]
        if len(self.replicas) == 1:
            lines.append(str(self.replicas[0]))
        else:
            for index, plan in enumerate(self.replicas):
                lines += [f"replica {index}:", str(plan)]
        return "\n".join(lines)


def single(plan: ShardPlan, threads: int | None = None) -> ParallelPlan:
    """One lane through `plan`: today's layer split (or a single device)."""
    return ParallelPlan((plan,), 1, threads, workers=tuple(worker_names([s.device for s in plan.stages])))


def plan_parallel(
    model: nn.Module,
    devices: str | Sequence[str],
    parallel: str = Parallel.AUTO,
    strategy: str = Strategy.MEMORY,
    *,
    threads: int = 1,
    rows: int = 2,
    profile_latent_size: int | None = None,
    block_costs: Callable[[str, int], Mapping[str, float]] | None = None,
    **plan_options: Any,
) -> ParallelPlan:
    """Replicas × stages over `devices` (see the module's docstring).

    `threads` is the CPU's intra-op threads in all (CPU workers share them). Throughput is
    predicted for `rows` rows per micro-batch of `profile_latent_size`² latents (default: the
    plan's), from `block_costs(device, threads)` (seconds per block; default: measured with
    `profile_block_costs`). `plan_options` go to `plan_shards` (dtype, latent_size, batch,
    max_memory, resident).
    """
    if parallel not in PARALLEL_MODES:
        raise PlanError(f"unknown parallel mode {parallel!r}: choose one of {', '.join(PARALLEL_MODES)}")
    device_list = resolve_devices(devices)
    count = len(device_list)
    if parallel == Parallel.OFF or count == 1:
        plan = plan_shards(model, device_list, strategy, **plan_options)
        return single(plan, threads if device_list[0] == "cpu" else None)
    all_cpu = all(d == "cpu" for d in device_list)
    worker_threads = max(1, threads // count) if all_cpu else None
    shapes = {
        Parallel.REPLICAS: [(count, 1)],
        Parallel.PIPELINE: [(1, count)],
        Parallel.AUTO: [(r, count // r) for r in range(count, 0, -1) if count % r == 0],
    }[Parallel(parallel)]
    if block_costs is None and not _fits_one(model, device_list[0], plan_options):
        # Measuring builds the whole model on one device: without room for it, replicas cannot
        # fit either, and lanes through the split still keep every stage busy.
        return _unmeasured(model, device_list, parallel, strategy, worker_threads, plan_options)
    measure = block_costs or _profiler(model, rows, profile_latent_size, plan_options)
    candidates, plans = [], {}
    for replicas, stages in shapes:
        groups = [device_list[i * stages : (i + 1) * stages] for i in range(replicas)]
        costs = measure(groups[0][0], worker_threads or 1)
        try:
            split = [_split(model, group, strategy, costs, stages, plan_options) for group in groups]
        except PlanError as err:
            candidates.append(Candidate(replicas, stages, None, str(err)))
            continue
        predicted = replicas * rows / _slowest_stage_s(split[0], costs)
        plans[(replicas, stages)] = split
        candidates.append(Candidate(replicas, stages, predicted))
    baseline = _baseline(model, device_list, strategy, measure, threads, rows, plan_options, all_cpu)
    if baseline is not None:
        candidates.append(baseline)
    fitting = [c for c in candidates if c.rows_per_s is not None and (c.replicas, c.stages) in plans]
    if not fitting:
        raise PlanError(
            f"no {parallel} configuration over {device_list} fits: " + "; ".join(c.note for c in candidates)
        )
    best = max(fitting, key=lambda c: c.rows_per_s or 0)
    reason = f"{best.label} is predicted fastest ({best.rows_per_s:.1f} rows/s at {rows} rows per micro-batch"
    if baseline is not None and baseline.rows_per_s:
        reason += f"; {best.rows_per_s / baseline.rows_per_s:.2f}× one worker with all {threads} threads"
    reason += ")" if parallel == Parallel.AUTO else f"; --parallel {parallel} asked for it)"
    split = plans[(best.replicas, best.stages)]
    workers = tuple(worker_names([s.device for plan in split for s in plan.stages]))
    return ParallelPlan(tuple(split), best.stages, worker_threads, tuple(candidates), reason, workers)


def _fits_one(model: nn.Module, device: str, options: Mapping[str, Any]) -> bool:
    try:
        plan_shards(model, [device], Strategy.MEMORY, **options)
    except PlanError:
        return False
    return True


def _unmeasured(model, device_list, parallel, strategy, worker_threads, options) -> ParallelPlan:
    """The model does not fit one device: a pipeline over all of them, split by `strategy`."""
    if parallel == Parallel.REPLICAS:
        raise PlanError(f"replicas need the whole model on each device, and it does not fit {device_list[0]}")
    plan = plan_shards(model, device_list, strategy, **options)
    reason = (
        "the model does not fit one device, so no replicas, and its blocks cannot be timed there: "
        f"{len(device_list)} pipelined stages split by {strategy}, a lane per stage"
    )
    candidate = Candidate(1, len(device_list), None, "not measured")
    workers = tuple(worker_names(device_list))
    return ParallelPlan((plan,), len(plan.stages), worker_threads, (candidate,), reason, workers)


def _profiler(model: nn.Module, rows: int, latent_size: int | None, options: Mapping[str, Any]):
    measured: dict[tuple[str, int], Mapping[str, float]] = {}

    def costs(device: str, threads: int) -> Mapping[str, float]:
        if (device, threads) not in measured:
            dtype = options.get("dtype") or next(model.parameters()).dtype
            latent = latent_size or options.get("latent_size") or int(model.config.sample_size)
            before = torch.get_num_threads()
            torch.set_num_threads(threads)
            try:
                # five timed runs: a 2-core host's timings of a small model jitter
                measured[(device, threads)] = profile_block_costs(
                    model, rows, latent, dtype, device, repeats=5
                )
            finally:
                torch.set_num_threads(before)
        return measured[(device, threads)]

    return costs


def _split(
    model: nn.Module,
    group: list[str],
    strategy: str,
    costs: Mapping[str, float],
    stages: int,
    options: Mapping[str, Any],
) -> ShardPlan:
    """One replica's plan over `group`: a pipeline balances measured time (its slowest stage sets
    the pace), a single stage just has to fit."""
    if stages > 1:
        return plan_shards(model, group, Strategy.COST, block_costs=costs, **options)
    return plan_shards(model, group, strategy, **options)


def _slowest_stage_s(plan: ShardPlan, costs: Mapping[str, float]) -> float:
    """Seconds of the slowest stage for one micro-batch, its incoming boundary copy included."""
    slowest = 0.0
    for index, stage in enumerate(plan.stages):
        seconds = sum(costs[block] for block in stage.blocks)
        moves_between_devices = index > 0 and plan.stages[index - 1].device != stage.device
        if moves_between_devices:
            seconds += plan.boundaries[index - 1].bytes / BOUNDARY_BYTES_PER_S
        slowest = max(slowest, seconds)
    return slowest


def _baseline(model, device_list, strategy, measure, threads, rows, options, all_cpu) -> Candidate | None:
    """Today's one worker: on CPU workers, one lane with all the threads (what `--devices cpu`
    runs); on GPUs, the layer split with one micro-batch (every stage in turn)."""
    if all_cpu:
        costs = measure("cpu", threads)
        return Candidate(1, 1, rows / sum(costs.values()), f"one worker, {threads} threads: today's default")
    try:
        plan = plan_shards(model, device_list, strategy, **options)
    except PlanError:
        return None
    costs = measure(device_list[0], 1)
    total = sum(sum(costs[b] for b in s.blocks) for s in plan.stages)
    return Candidate(1, len(device_list), rows / total, "one micro-batch at a time: the layer split")


# Building and running a plan.


def build_shards(model: nn.Module, plan: ParallelPlan) -> list[ModelShard]:
    """A ModelShard per replica. Single-stage CPU replicas share the model's weights (they need
    no hooks); the others get their own copy, made before any shard hooks or moves the model."""

    def shares(replica: ShardPlan) -> bool:
        return len(replica.stages) == 1 and replica.stages[0].device == "cpu"

    weights = [
        model if index == 0 or shares(replica) else copy.deepcopy(model)
        for index, replica in enumerate(plan.replicas)
    ]
    names = iter(plan.workers)
    return [
        ModelShard(copy_, replica, [next(names) for _ in replica.stages])
        for copy_, replica in zip(weights, plan.replicas, strict=True)
    ]


def split_rows(inputs: DenoiserInputs, parts: int) -> list[DenoiserInputs]:
    """`inputs` cut into `parts` micro-batches of consecutive rows (fewer if there are fewer rows)."""
    rows = inputs.sample.shape[0]
    bounds = torch.arange(rows).tensor_split(min(parts, rows))

    def cut(obj: Any, index: torch.Tensor) -> Any:
        if isinstance(obj, torch.Tensor) and obj.dim() > 0 and obj.shape[0] == rows:
            return obj[int(index[0]) : int(index[-1]) + 1]
        if isinstance(obj, dict):
            return {key: cut(value, index) for key, value in obj.items()}
        return obj

    return [
        DenoiserInputs(
            cut(inputs.sample, i),
            cut(inputs.timestep, i),
            cut(inputs.context, i),
            cut(inputs.conditioning, i),
        )
        for i in bounds
    ]


def run_micro_batches(
    shards: Sequence[ModelShard], inputs: DenoiserInputs, micro_batches: int, threads: int | None = None
) -> torch.Tensor:
    """One forward of `inputs`, its rows cut into `micro_batches` that run at once, each on its
    own thread: micro-batch m goes to replica m mod R, and within a replica the stage gates
    pipeline them. Equals the unsplit forward up to the last bits of a GEMM."""
    parts = split_rows(inputs, micro_batches)

    def run(index: int) -> torch.Tensor:
        if threads is not None:
            torch.set_num_threads(threads)
        part = parts[index]
        shard = shards[index % len(shards)]
        return shard(part.sample, part.timestep, part.context, **part.conditioning).to(shards[0].device)

    with ThreadPoolExecutor(len(parts), thread_name_prefix="diffshard-micro") as pool:
        return torch.cat(list(pool.map(run, range(len(parts)))))
