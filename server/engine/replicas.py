"""Building a parallel plan's shards, and running one step's rows across them.

`build_shards` gives every replica of a `ParallelPlan` its `ModelShard`; `run_micro_batches`
cuts one forward's rows into micro-batches that run at once, one per shard (and, through one
pipelined shard, one after another through its stage gates): how a lone request uses every
idle replica.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

import torch
from torch import nn

from server.engine.blocks import DenoiserInputs
from server.engine.parallel import ParallelPlan
from server.engine.plan import ShardPlan
from server.engine.shard import ModelShard


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
    """One forward of `inputs`, its rows cut into `micro_batches` that run at once: micro-batch m
    goes to shard m mod R (the first on the calling thread, the others each on a thread of
    their own with `threads` intra-op threads), and within a pipelined shard the stage gates
    pipeline them. Equals the unsplit forward up to the last bits of a GEMM."""
    parts = split_rows(inputs, micro_batches)

    def run(index: int) -> torch.Tensor:
        if index and threads is not None:
            torch.set_num_threads(threads)
        part, shard = parts[index], shards[index % len(shards)]
        with torch.inference_mode():  # thread-local: a helper thread enters it itself
            return shard(part.sample, part.timestep, part.context, **part.conditioning).to(shards[0].device)

    if len(parts) == 1:
        return run(0)
    others = [_helpers(len(parts) - 1).submit(run, index) for index in range(1, len(parts))]
    try:
        first = run(0)
    except BaseException:
        wait(others)  # as a `with` executor did: nothing of this step runs on after it failed
        raise
    return torch.cat([first, *(future.result() for future in others)])


_lane = threading.local()  # each calling (lane) thread's helpers: lanes never queue behind each other


def _helpers(workers: int) -> ThreadPoolExecutor:
    """The calling thread's helper threads, at least `workers` of them: made once, not per step
    (a step that starts and joins threads pays for it, and each new thread builds its OpenMP team)."""
    pool: ThreadPoolExecutor | None = getattr(_lane, "pool", None)
    if pool is None or _lane.workers < workers:
        if pool is not None:
            pool.shutdown(wait=False)  # idle: this thread waited for its last step's helpers
        pool = _lane.pool = ThreadPoolExecutor(workers, thread_name_prefix="diffshard-micro")
        _lane.workers = workers
    return pool
