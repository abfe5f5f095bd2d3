"""Building a parallel plan's shards, and running one call's rows across them.

`build_shards` gives every replica of a `ParallelPlan` its `ModelShard`; `run_micro_batches`
cuts one call's rows (and its call plan) into micro-batches that run at once, one per shard
(and, through one pipelined shard, one after another through its stage gates): how a lone
request uses every idle replica. The helper threads are a lane's own `Workers`, started once.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch import nn

from server.engine.denoisers.blocks import DenoiserInputs, part
from server.engine.denoisers.specs import layout_of, spec_for
from server.engine.hardware.devices import device_set
from server.engine.hardware.threads import set_intra_op_threads
from server.engine.planning.parallel import ParallelPlan
from server.engine.planning.plan import ShardPlan
from server.engine.runtime.call import CallPlan, CallResult
from server.engine.runtime.sequence import first_failure
from server.engine.runtime.shard import ModelShard
from server.engine.runtime.tensor import split_model
from server.errors import WorkerLost


def build_shards(
    model: nn.Module, plan: ParallelPlan, placed: Callable[[nn.Module, str], object] | None = None
) -> list[ModelShard]:
    """A ModelShard per replica, each with a module tree of its own (its adapter hooks read its
    own stages' slots). Single-stage CPU replicas share the model's weights where the model
    stays on the CPU; the others get their own copy, made on their devices from the model's
    tensors, and the model itself (replica 0) is placed last: host memory holds one copy of the
    weights however many replicas there are (it held one per replica: FLUX.1-dev as 2 GPU
    replicas ~54 GiB). A tensor group's ranks
    (`plan.tensor`) each keep their share of the split blocks' layers (`tensor.split_model`), the
    rest shared until placed. `placed`: as ModelShard's."""
    if plan.tensor > 1:
        return tensor_ranks(model, plan, placed)

    def on_cpu(replica: ShardPlan) -> bool:
        return len(replica.stages) == 1 and replica.stages[0].device == "cpu"

    names, start = [], 0
    for replica in plan.replicas:
        names.append(list(plan.workers[start : start + len(replica.stages)]))
        start += len(replica.stages)
    shares = on_cpu(plan.replicas[0])  # a shared Parameter moves with the model that holds it
    shards: dict[int, ModelShard] = {}
    for index in [*range(1, len(plan.replicas)), 0]:
        replica = plan.replicas[index]
        weights = (
            model
            if index == 0
            else sharing_weights(model)
            if shares and on_cpu(replica)
            else placed_copy(model, replica)
        )
        shards[index] = ModelShard(weights, replica, names[index], placed)
    return [shards[index] for index in range(len(plan.replicas))]


def placed_copy(model: nn.Module, replica: ShardPlan) -> nn.Module:
    """A copy of `model` whose blocks' tensors are made straight on the devices `replica` puts
    them, tensor by tensor: host memory never holds a second copy of the weights."""
    layout = layout_of(model)
    memo: dict[int, Any] = {}
    for stage in replica.stages:
        for block in stage.blocks:
            for path in layout.blocks[layout.names.index(block)].modules:
                held = part(model, path)
                tensors = [*held.parameters(), *held.buffers()] if isinstance(held, nn.Module) else [held]
                for t in tensors:
                    moved = t.detach().to(stage.device, copy=True)
                    memo[id(t)] = (
                        nn.Parameter(moved, t.requires_grad) if isinstance(t, nn.Parameter) else moved
                    )
    return copy.deepcopy(model, memo)


def tensor_ranks(
    model: nn.Module, plan: ParallelPlan, placed: Callable[[nn.Module, str], object] | None = None
) -> list[ModelShard]:
    """Tensor groups' ranks (`plan.tensor` consecutive replicas a group): rank k's module tree
    holds its part of every split layer (copied out of the whole one, which no rank keeps) and
    the same tensors as the others elsewhere; on a device each rank gets Parameters of its own
    before placing, so moving one never moves another's."""
    split = spec_for(model).tensor(model)  # read before any layer is split (packed layers' parts)
    ranks = [model if k == 0 else sharing_weights(model) for k in range(len(plan.replicas))]
    names, shards = iter(plan.workers), []
    for index, (rank, replica) in enumerate(zip(ranks, plan.replicas, strict=True)):
        split_model(rank, split, index % plan.tensor, plan.tensor)  # groups of `tensor` consecutive ranks
        if replica.stages[0].device != "cpu":
            own_parameters(rank)
        shard = ModelShard(rank, replica, [next(names) for _ in replica.stages], placed)
        shard.tensor = split
        shards.append(shard)
    return shards


def own_parameters(model: nn.Module) -> None:
    """Fresh Parameter objects over the same tensors: placing this tree swaps only its own."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                module._parameters[name] = nn.Parameter(param.data, requires_grad=param.requires_grad)


def sharing_weights(model: nn.Module) -> nn.Module:
    """A copy of `model`'s modules holding the very same parameters and buffers."""
    memo: dict[int, Any] = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


class WorkerDied(BaseException):
    """A helper thread died (injected by `Workers.kill_next`, as a crash would): escapes every
    `except Exception`."""


class Workers:
    """A lane's helper threads for micro-batches and sequence ranks, each running `threads`
    intra-op threads: started once with the lane (a thread started per step pays for it, and
    each new thread builds its OpenMP team).

    A helper that dies (`WorkerDied`) leaves its pool unusable: `lost` says why until
    `restart` replaces the pool with fresh threads (`restarts` counts them)."""

    def __init__(self, count: int, threads: int | None = None) -> None:
        self.count, self.threads = max(1, count), threads
        self.lost: str | None = None
        self.restarts = 0
        self._kill_next = threading.Event()  # fault injection: the next task's thread dies
        self._pool = self._start()

    def _start(self) -> ThreadPoolExecutor:
        def init() -> None:
            if self.threads is not None:
                set_intra_op_threads(self.threads)

        return ThreadPoolExecutor(self.count, thread_name_prefix="diffshard-micro", initializer=init)

    def submit(self, fn: Any, *args: Any) -> Future:
        if self.lost is not None:  # until `restart`: the call fails (503), the loop goes on
            raise WorkerLost("a helper thread of this lane died; it is being restarted: retry")
        return self._pool.submit(self._run, fn, *args)

    def _run(self, fn: Any, *args: Any) -> Any:
        try:
            if self._kill_next.is_set():
                self._kill_next.clear()
                raise WorkerDied("injected fault [[kill-worker]]")
            return fn(*args)
        except WorkerDied as err:
            self.lost = f"a helper thread died ({err})"
            raise

    def kill_next(self) -> None:
        """Test-only (`[[kill-worker]]`): the next task's thread dies instead of running it."""
        self._kill_next.set()

    def restart(self) -> None:
        """Replace the pool (its threads, one possibly dead) with fresh ones."""
        self._pool.shutdown(wait=False)
        self._pool = self._start()
        self.lost = None
        self.restarts += 1

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def run_micro_batches(
    shards: Sequence[ModelShard],
    inputs: DenoiserInputs,
    micro_batches: int,
    plan: CallPlan | None = None,
    workers: Workers | None = None,
) -> CallResult:
    """One call of `plan` (default: plain rows) on `inputs`, its rows cut into `micro_batches`
    that run at once:
    micro-batch m goes to shard m mod R (the first on the calling thread, the others on
    `workers`), and within a pipelined shard the stage gates pipeline them. Equals the unsplit
    call up to the last bits of a GEMM."""
    plan = plan or CallPlan.plain(inputs.sample.shape[0])
    plans = plan.split(micro_batches)
    bounds, at = [], 0
    for piece in plans:
        bounds.append((at, at + piece.rows))
        at += piece.rows
    parts = [cut_rows(inputs, start, stop) for start, stop in bounds]

    def run(index: int) -> CallResult:
        shard = shards[index % len(shards)]
        with device_set(shard.device):
            return shard.run(parts[index], plans[index])

    if len(parts) == 1:
        return run(0)
    own = workers or Workers(len(parts) - 1)
    try:
        others = [own.submit(run, index) for index in range(1, len(parts))]
        errors: list[BaseException] = []
        try:
            first = run(0)
        except BaseException as err:
            errors.append(err)
        finally:  # nothing of this call runs on after it ends (or failed)
            errors += [e for e in (f.exception() for f in others) if e is not None]
        if errors:
            raise first_failure(errors)
        results = [f.result() for f in others]
        return CallResult.joined(list(zip(plans, [first, *results], strict=True)), plan, shards[0].device)
    finally:
        if workers is None:
            own.close()


def cut_rows(inputs: DenoiserInputs, start: int, stop: int) -> DenoiserInputs:
    """Rows [start, stop) of every per-row tensor of `inputs`."""
    rows = inputs.sample.shape[0]

    def cut(obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.dim() > 0 and obj.shape[0] == rows:
            return obj[start:stop]
        if isinstance(obj, dict):
            return {key: cut(value) for key, value in obj.items()}
        if isinstance(obj, tuple | list):  # a ControlNet's residuals
            return type(obj)(cut(value) for value in obj)
        return obj

    return DenoiserInputs(*(cut(value) for value in vars(inputs).values()))
