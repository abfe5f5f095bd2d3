"""Where a pipeline's denoiser runs, built once from its plan and read-only after: a shard per
replica, the lanes that step requests through them (each with its helper threads, started
once), the intra-op threads each lane runs, and how a lone request uses idle replicas: its rows
split over them, or (a DiT) its tokens (`sequence`: a group of that many ranks). `grouped`
(`--parallel sequence`): one lane, every call a sequence group over every replica."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from server.engine import (
    CallPlan,
    CallResult,
    ModelShard,
    ParallelPlan,
    ShardPlan,
    Workers,
    build_shards,
    run_micro_batches,
    run_sequence,
)
from server.engine.denoisers.blocks import DenoiserInputs
from server.engine.hardware.devices import separate_memories
from server.engine.hardware.threads import intra_op_threads
from server.engine.runtime.sequence import SequenceGroup, groups_for
from server.engine.runtime.tensor import run_tensor

log = logging.getLogger("diffshard")

Spare = Callable[[], Sequence[ModelShard]]  # the other replicas' shards with nothing to do now


def no_spare() -> Sequence[ModelShard]:
    return ()


class GroupCalls:
    """The calls run as sequence groups, and their ranks' time in exchanges (rank 0's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.calls, self.exchange_s = 0, 0.0

    def count(self, exchange_s: float, calls: int = 1) -> None:
        with self._lock:
            self.calls += calls
            self.exchange_s += exchange_s

    def view(self) -> dict[str, Any]:
        return {"sequence_calls": self.calls, "sequence_exchange_seconds": round(self.exchange_s, 6)}


class ExpertSteps:
    """A model with several experts (Wan 2.2 A14B): rows each expert ran, and the steps that ran
    rows of more than one (requests on both sides of the boundary, stepped together)."""

    def __init__(self, names: Sequence[str]) -> None:
        self._lock = threading.Lock()
        self.names = tuple(names)
        self.rows = dict.fromkeys(self.names, 0)
        self.mixed_steps = 0

    def count(self, by_expert: Sequence[Sequence[Any]]) -> None:
        """One step: each expert's states (their rows counted)."""
        with self._lock:
            for name, states in zip(self.names, by_expert, strict=True):
                self.rows[name] += sum(s.rows for s in states)
            self.mixed_steps += sum(1 for states in by_expert if states) > 1

    def view(self) -> dict[str, Any]:
        with self._lock:
            return {"parts": list(self.names), "rows": dict(self.rows), "mixed_steps": self.mixed_steps}


def matching(spare: Callable[[int], Spare], first: Deployment, other: Deployment) -> Callable[[int], Spare]:
    """`spare` (lane i's idle replicas of `first`) as `other`'s replicas at the same places: an
    expert's lanes borrow the replicas of the same devices the first expert's lanes would."""
    at = {id(shard): k for k, shard in enumerate(first.replicas)}
    return lambda i: lambda: [other.replicas[at[id(s)]] for s in spare(i)()]


@dataclass(frozen=True)
class Lane:
    """One step loop's way through the denoiser: its replica's shard, the helper threads that
    run its micro-batches and sequence ranks, and where it finds idle replicas to use; as a
    sequence group of up to `sequence` ranks (a DiT's tokens split) or by rows."""

    shard: ModelShard
    workers: Workers | None = None
    spare: Spare = no_spare
    sequence: int = 1
    groups: GroupCalls = field(default_factory=GroupCalls)
    every_call: bool = False  # --parallel sequence: a group even when the rows fill the replicas
    # where this lane's calls last left each GPU stage (`CallResult.fences`), for `Pipeline.synchronize`
    fences: dict[str, torch.cuda.Event] = field(default_factory=dict)

    @property
    def lost(self) -> str | None:
        """Why this lane cannot run calls now, in fixed words for /readyz (None: it can)."""
        if self.workers is None or self.workers.lost is None:
            return None
        return "a helper thread of a lane died; fresh ones are starting"

    def recover(self) -> None:
        """A helper thread that died failed its call (503) and took the lane out of /readyz:
        start fresh ones (the step loop calls this after every turn, work waiting or not)."""
        if self.workers is not None and self.workers.lost is not None:
            log.warning("%s; starting fresh helper threads", self.workers.lost)
            self.workers.restart()

    @contextmanager
    def idle_cores(self, threads: int | None) -> Iterator[bool]:
        """This thread's `threads` (a lane's intra-op threads; None: unchanged) and the idle
        replicas' while it runs, and whether it has more than its own: a lone image's VAE decode is
        one call on one lane, and left at its lane's threads it would keep the other cores idle. A
        compiled decoder runs the threads it was built with (inductor writes their count into its
        kernels): given more, a decode runs eagerly (docs/serving.md has figures, with their host)."""
        spare = len(self.spare()) if threads else 0
        with intra_op_threads(threads * (1 + spare) if threads and spare else None):
            yield bool(threads and spare)

    def devices(self) -> set[str]:
        """The devices this lane's calls use: its shard's and its idle replicas' (ranks too)."""
        return {d for shard in (self.shard, *self.spare()) for d in shard.devices}

    def forward(self, inputs: DenoiserInputs, plan: CallPlan) -> CallResult:
        """One call over this lane's shard and idle replicas (`_run`); where it left each GPU
        stage kept."""
        result = self._run(inputs, plan)
        self.fences.update(result.fences)
        return result

    def _run(self, inputs: DenoiserInputs, plan: CallPlan) -> CallResult:
        """One call over this lane's shard and idle replicas, unless the plan keeps its rows
        together (a deterministic request: its rows' shapes must not depend on what else runs).
        Helper threads lost in an earlier call are replaced first (a batch that failed with one
        is retried job by job: the others must not fail too)."""
        self.recover()
        if self.shard.tensor is not None and self.workers is not None:  # every call: its tensor group's
            ranks = [self.shard, *self.spare()]
            return run_tensor(ranks, self.shard.tensor, inputs, plan, self.workers.submit)
        if not plan.splittable or self.workers is None:  # no helper threads: its rows stay here
            return self.shard.run(inputs, plan)
        spare = self.spare()
        split = self.shard.sequence
        if (
            spare
            and split is not None
            and split.takes(inputs)
            and self.sequence > 1
            and self.workers is not None
        ):
            rows = inputs.sample.shape[0]
            groups = groups_for([self.shard, *spare][: self.sequence], rows, self.every_call)
            if len(groups) == 1:
                result = run_sequence(groups[0], split, inputs, plan, self.workers.submit)
                self.groups.count(result.exchange_s)
                return result
            if groups:  # a part of its rows on each group: guidance in parallel, tokens split
                parts = [SequenceGroup(g, split, self.workers.submit) for g in groups]
                result = run_micro_batches(parts, inputs, len(parts), plan, self.workers)
                self.groups.count(result.exchange_s, len(parts))
                return result
        shards = [self.shard, *spare][: inputs.sample.shape[0]]
        if len(shards) == 1:
            return self.shard.run(inputs, plan)
        return run_micro_batches(shards, inputs, len(shards), plan, self.workers)


@dataclass(frozen=True)
class Deployment:
    replicas: tuple[ModelShard, ...]
    lanes_per_replica: int = 1
    threads: int | None = None  # intra-op threads each lane's thread runs (None: the process's)
    splits_lone: bool = False  # the plan predicts splitting a lone request over idle replicas pays
    sequence: int = 1  # > 1: split its tokens (a sequence group of this many replicas), not its rows
    grouped: bool = False  # one lane; every call's tokens split over every replica
    tensor: int = 1  # > 1: a lane per group of this many replicas (its ranks), every call on all of them

    @classmethod
    def of(
        cls,
        model: nn.Module,
        plan: ShardPlan | ParallelPlan,
        placed: Callable[[nn.Module, str], object] | None = None,
    ) -> Deployment:
        """Shards for every replica of `plan` (one for a ShardPlan); `placed(module, path)` is
        called as each block's module reaches its device (quantizing there, block by block)."""
        if isinstance(plan, ShardPlan):
            return cls((ModelShard(model, plan, placed=placed),))
        shards = build_shards(model, plan, placed)
        return cls(
            tuple(shards),
            plan.lanes_per_replica,
            plan.threads,
            plan.splits_lone,
            plan.sequence,
            plan.grouped,
            plan.tensor,
        )

    def encoder_spread(self) -> list[str]:
        """The devices a tensor group's text encoders spread over (`parts.py`, as `plan` counts
        them): its first group's ranks' first devices, when they are separate GPUs; else none."""
        ranks = [str(shard.device) for shard in self.replicas[: self.tensor]] if self.tensor > 1 else []
        return ranks if separate_memories(ranks) else []

    def first_lane(self) -> Lane:
        """The lane a pipeline steps unless given one: its first replica's, alone; a tensor group's
        ranks together (a rank holds only a share of the split blocks)."""
        return self.lanes()[0] if self.tensor > 1 else Lane(self.replicas[0])

    def lanes(
        self,
        spare: Callable[[int], Spare] | None = None,
        splits: bool = True,
        groups: GroupCalls | None = None,
    ) -> list[Lane]:
        """A lane per replica × lanes_per_replica. `spare(i)`: where lane i finds idle replicas
        (the Service's view of the other lanes' loads); given, each lane gets helper threads
        for the micro-batches it sends them if it `splits` its rows over them (else it only
        takes their cores for a lone decode: `Lane.idle_cores`). Grouped: one lane, the other
        replicas always its; tensor groups: a lane per group (its ranks: `tensor` consecutive
        replicas), every call on all of them. `groups`: where sequence calls are counted (one
        count over every lane, a model's experts' too)."""
        groups = groups or GroupCalls()
        if self.tensor > 1:
            ranks = [self.replicas[i : i + self.tensor] for i in range(0, len(self.replicas), self.tensor)]
            return [
                Lane(
                    group[0],
                    Workers(self.tensor - 1, self.threads),
                    lambda group=group: group[1:],
                    groups=groups,
                )
                for group in ranks
            ]
        if self.grouped:
            others = self.replicas[1:]
            workers = Workers(len(others), self.threads)
            return [Lane(self.replicas[0], workers, lambda: others, self.sequence, groups, True)]
        shards = [shard for shard in self.replicas for _ in range(self.lanes_per_replica)]
        if spare is None or len(self.replicas) < 2:
            return [Lane(shard, groups=groups) for shard in shards]
        helpers = len(self.replicas) - 1
        return [
            Lane(s, Workers(helpers, self.threads) if splits else None, spare(i), self.sequence, groups)
            for i, s in enumerate(shards)
        ]
