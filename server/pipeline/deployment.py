"""Where a pipeline's denoiser runs, built once from its plan and read-only after: a shard per
replica, the lanes that step requests through them (each with its helper threads, started
once), the intra-op threads each lane runs, and whether a lone request's rows split over idle
replicas."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import nn

from server.engine import ModelShard, ParallelPlan, ShardPlan, Workers, build_shards

Spare = Callable[[], Sequence[ModelShard]]  # the other replicas' shards with nothing to do now


def no_spare() -> Sequence[ModelShard]:
    return ()


@dataclass(frozen=True)
class Lane:
    """One step loop's way through the denoiser: its replica's shard, the helper threads that
    run its micro-batches, and where it finds idle replicas to split a call's rows over."""

    shard: ModelShard
    workers: Workers | None = None
    spare: Spare = no_spare


@dataclass(frozen=True)
class Deployment:
    replicas: tuple[ModelShard, ...]
    lanes_per_replica: int = 1
    threads: int | None = None  # intra-op threads each lane's thread runs (None: the process's)
    splits_lone: bool = False  # the plan predicts splitting a lone request's rows pays

    @classmethod
    def of(cls, model: nn.Module, plan: ShardPlan | ParallelPlan) -> Deployment:
        """Shards for every replica of `plan` (one for a ShardPlan)."""
        if isinstance(plan, ShardPlan):
            return cls((ModelShard(model, plan),))
        shards = build_shards(model, plan)
        return cls(tuple(shards), plan.lanes_per_replica, plan.threads, plan.splits_lone)

    def lanes(self, spare: Callable[[int], Spare] | None = None) -> list[Lane]:
        """A lane per replica × lanes_per_replica. `spare(i)`: where lane i finds idle replicas
        (the Service's view of the other lanes' loads); given, each lane gets helper threads
        for the micro-batches it sends them."""
        shards = [shard for shard in self.replicas for _ in range(self.lanes_per_replica)]
        if spare is None or len(self.replicas) < 2:
            return [Lane(shard) for shard in shards]
        helpers = len(self.replicas) - 1
        return [Lane(s, Workers(helpers, self.threads), spare(i)) for i, s in enumerate(shards)]
