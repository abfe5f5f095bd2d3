"""Every device busy at once: what a parallel plan is (pure values, and the shapes weighed:
`weighed_shapes`, `fill_cores`; `planner.py` chooses one, `replicas.py` builds and runs it).

Split by layers alone, a model runs one device at a time. Three ways keep them all working:

- **replicas**: the whole denoiser on each device (or group of devices); requests are shared
  out between them, and a lone request's rows are split across the idle ones (for a guided
  image: its two guidance halves, CFG-parallel);
- **pipelined stages**: one split model, several lanes (step loops) in it at once; stage gates
  (`gates.py`) let stage k run one lane's rows while stage k-1 runs the next lane's;
- **sequence groups** (DiTs): the replicas share each block of one call, each on a slice of its
  tokens (`runtime/sequence.py`): a lone request's tokens split over the idle replicas where
  that is predicted quicker than its rows, or every call's (`--parallel sequence`, one lane).

A `ParallelPlan` holds R replicas of S stages each (pure replicas, a pure pipeline, or a hybrid
such as 2 × 2 on 4 GPUs), how many lanes feed each replica (one per stage keeps every stage
busy), and the intra-op threads each CPU worker runs. Words: a *lane* is a step loop with its
own requests; a *micro-batch* is a slice of one step's rows (`replicas.run_micro_batches`).

CPU workers are the testbed: `cpu,cpu` is two workers sharing the host's cores, named `cpu:0`
and `cpu:1`; CPU replicas share one copy of the weights, so replicas cost no memory there. One
GPU listed twice (`cuda:0,cuda:0`: workers `cuda:0#0` and `cuda:0#1`) runs the same code paths
on one card; its replicas each hold their own weights, within that card's one budget
(`shared_budgets`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from server.engine.hardware.devices import default_budget, worker_names
from server.engine.planning.plan import ShardPlan


class Parallel(StrEnum):
    AUTO = "auto"  # the fastest predicted configuration
    REPLICAS = "replicas"  # the whole model on every device
    PIPELINE = "pipeline"  # one split, every stage busy with its own lane
    SEQUENCE = "sequence"  # one lane; every call's tokens split over every replica (DiTs)
    EXPERTS = "experts"  # a model's experts each on its own devices (Wan 2.2 A14B)
    TENSOR = "tensor"  # one lane; every DiT block's Linear layers split over every device
    OFF = "off"  # one split, one lane: the least memory


PARALLEL_MODES = tuple(p.value for p in Parallel)


@dataclass(frozen=True)
class Candidate:
    replicas: int
    stages: int
    rows_per_s: float | None  # predicted throughput; None when it does not fit or is not allowed
    note: str = ""
    lone_step_s: float | None = None  # predicted seconds of one step of a lone guided image
    threads: int | None = None  # per worker, on CPU workers
    splits_lone: bool = False  # a lone request goes to the idle replicas too (predicted quicker)
    sequence: int = 1  # > 1: it goes there as a sequence group of this many ranks (its tokens split)
    grouped: bool = False  # every call is a sequence group over every replica (one lane)
    tensor: int = 1  # > 1: each replica a tensor group of this many devices

    @property
    def label(self) -> str:
        replicas = f"{self.replicas} replica{'s' if self.replicas > 1 else ''}"
        if self.grouped:
            replicas = f"a sequence group of {self.replicas}"
        tensor = f" × {self.tensor}-way tensor" if self.tensor > 1 else ""
        return f"{replicas} × {self.stages} stage{'s' if self.stages > 1 else ''}{tensor}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "replicas": self.replicas,
            "stages": self.stages,
            "threads_per_worker": self.threads,
            "predicted_rows_per_s": self.rows_per_s,
            "predicted_lone_step_s": self.lone_step_s,
            "splits_lone_requests": self.splits_lone,
            "sequence_degree": self.sequence,
            "sequence_every_call": self.grouped,
            "tensor_degree": self.tensor,
            "note": self.note,
        }

    def __str__(self) -> str:
        if self.rows_per_s is None:
            return f"{self.label}: {self.note or 'does not fit'}"
        threads = f", {self.threads} thread{'s' * (self.threads != 1)} each" if self.threads else ""
        lone = f", a lone image {self.lone_step_s * 1e3:.4g} ms a step" if self.lone_step_s else ""
        if self.splits_lone:
            lone += (
                f" (its tokens split {self.sequence} ways)"
                if self.sequence > 1
                else " split over the replicas"
            )
        note = f" ({self.note})" if self.note else ""
        return f"{self.label}{threads}: {self.rows_per_s:.3g} rows/s under load{lone}{note}"


@dataclass(frozen=True)
class ParallelPlan:
    replicas: tuple[ShardPlan, ...]  # each replica's split (its stages on its devices)
    lanes_per_replica: int  # step loops feeding each replica
    threads: int | None = None  # intra-op threads per lane (CPU workers); None: leave torch's
    candidates: tuple[Candidate, ...] = ()
    reason: str = ""
    workers: tuple[str, ...] = field(default=())  # a name per stage of every replica
    costs: str = ""  # where the predictions came from: counted or measured, and on what
    splits_lone: bool = False  # see Candidate
    sequence: int = 1  # see Candidate
    grouped: bool = False  # see Candidate
    experts_apart: bool = False  # replica k holds expert k alone (Wan 2.2 A14B), not every expert
    tensor: int = 1  # > 1: the replicas are one tensor group's ranks, each its share of the split blocks

    @property
    def stages(self) -> int:
        return len(self.replicas[0].stages)

    @property
    def lanes(self) -> int:
        if self.tensor > 1:  # a lane per tensor group
            return len(self.replicas) // self.tensor
        one = self.grouped or self.experts_apart
        return 1 if one else len(self.replicas) * self.lanes_per_replica

    @property
    def kind(self) -> str:
        if self.experts_apart:
            return "experts"
        if self.tensor > 1:
            return "tensor"
        if self.grouped:
            return "sequence"
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
            "lanes": self.lanes,
            "threads_per_worker": self.threads,
            "workers": list(self.workers),
            "reason": self.reason,
            "costs": self.costs,
            "splits_lone_requests": self.splits_lone,
            "sequence_degree": self.sequence,
            "experts_apart": self.experts_apart,
            "tensor_degree": self.tensor,
            "candidates": [c.to_dict() for c in self.candidates],
            "replica_devices": [[s.device for s in plan.stages] for plan in self.replicas],
            "replica_bytes": [sum(s.param_bytes for s in plan.stages) for plan in self.replicas],
            # each replica's (rank's) text encoders and VAE: a tensor group may spread them
            "replica_other_bytes": [sum(d.other_bytes for d in plan.devices) for plan in self.replicas],
        }
        return {**self.replicas[0].to_dict(), "parallel": parallel}

    @property
    def headline(self) -> str:
        """What runs where, why, and the candidates weighed (the plan's first lines)."""
        threads = f", {self.threads} thread{'s' * (self.threads != 1)} per worker" if self.threads else ""
        each = "expert" if self.experts_apart else "rank" if self.tensor > 1 else "replica"
        lines = [
            f"parallel: {self.kind}: {len(self.replicas)} {each}(s) × {self.stages} stage(s), "
            f"{self.lanes} lane(s){threads}; workers {', '.join(self.workers)}"
        ]
        if self.reason:
            lines.append(f"  why: {self.reason}")
        if self.costs:
            lines.append(f"  costs: {self.costs}")
        lines += [f"  {c}" for c in self.candidates]
        return "\n".join(lines)

    def __str__(self) -> str:
        lines = [self.headline]
        if len(self.replicas) == 1:
            lines.append(str(self.replicas[0]))
        else:
            name = "expert" if self.experts_apart else "rank" if self.tensor > 1 else "replica"
            for index, plan in enumerate(self.replicas):
                lines += [f"{name} {index}:", str(plan)]
        return "\n".join(lines)


def single(plan: ShardPlan, threads: int | None = None, **details: Any) -> ParallelPlan:
    """One lane through `plan`: a single device, or the layer split (one stage busy at a time)."""
    workers = tuple(worker_names([s.device for s in plan.stages]))
    return ParallelPlan((plan,), 1, threads, workers=workers, **details)


def shared_budgets(
    groups: Sequence[Sequence[str]], budgets: Mapping[str, int], resident: int = 0
) -> list[dict[str, int]]:
    """Each replica's budgets (`groups`: its stages' devices) where replicas share a GPU: its
    stages' part of that GPU's one budget (`budgets`' or the default), less the `resident` bytes
    (encoders and VAE) the first replica's first device keeps, which stay with that replica; so
    two replicas on `cuda:0` never count its memory twice. Other devices keep their budgets
    whole: a replica's own GPU, and the CPU, whose single-stage replicas share one copy of the
    weights (`replicas.build_shards`)."""
    everyone = Counter(d for group in groups for d in group)
    out = []
    for index, group in enumerate(groups):
        mine = Counter(group)
        own = {d: b for d, b in budgets.items() if d in mine}
        for device, count in mine.items():
            if device == "cpu" or count == everyone[device]:
                continue
            total = budgets[device] if device in budgets else default_budget(device)
            if total is None:
                continue
            held = resident if device == groups[0][0] else 0
            own[device] = max(0, total - held) * count // everyone[device] + (held if index == 0 else 0)
        out.append(own)
    return out


def weighed_shapes(count: int, parallel: Parallel, quota: int | None = None) -> list[tuple[int, int]]:
    """The replicas × stages weighed over `count` devices, in order: for each stage count, as many
    replicas as the devices hold (fewer replicas of the same stages are never faster). CPU workers
    (`quota`: the cores) use at most `quota` of the devices; with more devices than cores, the
    shapes over all of them are weighed too, to be shown (predicted, never picked by auto)."""
    if parallel == Parallel.REPLICAS:
        return [(count, 1)]
    if parallel == Parallel.PIPELINE:
        return [(1, count)]
    if parallel == Parallel.SEQUENCE:  # a group of every replica: the fewest stages that fit first
        return [(count // s, s) for s in range(1, count // 2 + 1) if count % s == 0]
    usable = min(count, quota) if quota else count
    shapes = [(usable // s, s) for s in range(1, usable + 1)]
    if usable < count:  # every divisor shape of all the devices, as the user wrote them
        shapes += [(r, count // r) for r in range(count, 0, -1) if count % r == 0]
    shapes = [s for s in dict.fromkeys(shapes) if s[0] * s[1] > 1]  # one worker: the baselines
    return sorted(shapes, key=lambda s: (-s[0] * s[1], -s[0]))


def fill_cores(candidates: Sequence[Candidate], quota: int) -> list[Candidate]:
    """The CPU candidates that keep every core busy: each worker runs its share of the `quota`
    cores (an uneven split's remainder aside: threads are the same on every worker)."""
    return [c for c in candidates if (c.threads or quota) >= quota // (c.replicas * c.stages)]
