"""The serving layer's numbers as plain data: what /v1/stats shows and the metrics collectors read.

Nothing here knows Prometheus: `Distribution` keeps fixed buckets as a histogram would, and a
`Snapshot` is everything one scrape needs, taken at once.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from server.engine import DeviceMemory
from server.engine.runtime.pool import PoolStats
from server.serving.jobs import PRIORITIES

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
CACHE_OUTCOMES = ("refreshed", "reused")
# The step loop's calls into the pipeline: `start` (prompts encoded, first noise drawn), `step`
# (one batched denoising step), `decode` (the VAE)
CALLS = ("start", "step", "decode")
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# Why requests were refused or ended early, as /v1/stats and the metrics both name them: always
# shown (0 until one happens), so dashboards and alerts see them.
REASONS = (
    "queue_full",
    "key_queue_full",
    "timeout",
    "cancelled",
    "oom",
    "invalid",
    "unauthorized",
    "failed",
    "draining",
)
LOOP_REASONS = {"deadline": "timeout", "out_of_memory": "oom"}  # a step loop's outcome → its reason


def rejections(loop: Counter, http: Counter) -> dict[str, int]:
    """Every reason's count: the step loop's refusals and endings, and those only HTTP sees
    (invalid bodies, missing keys). The one sum both /v1/stats and /metrics show."""
    counts = Counter(http)
    for reason, n in loop.items():
        counts[LOOP_REASONS.get(reason, reason)] += n
    return {reason: counts[reason] for reason in dict.fromkeys((*REASONS, *counts))}


@dataclass
class Distribution:
    """Observations counted into fixed buckets (upper bounds), as a Prometheus histogram keeps them."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bound, not cumulative; the last: above all
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))] += 1
        self.total += value
        self.count += 1

    def copy(self) -> Distribution:
        return Distribution(self.bounds, list(self.counts), self.total, self.count)

    def __add__(self, other: Distribution) -> Distribution:
        counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        return Distribution(self.bounds, counts, self.total + other.total, self.count + other.count)


@dataclass
class LoopStats:
    """The step loop's counters."""

    queue_depth: int = 0
    active_jobs: int = 0
    active_images: int = 0
    active_rows: int = 0
    batch_rows: Counter = field(default_factory=Counter)  # rows per call → calls
    rows_per_step: Distribution = field(default_factory=lambda: Distribution(ROW_BUCKETS))
    step_seconds: Distribution = field(default_factory=lambda: Distribution(STEP_BUCKETS))
    queue_wait_seconds: Distribution = field(default_factory=lambda: Distribution(WAIT_BUCKETS))
    jobs_completed: int = 0
    images_completed: int = 0
    rejected: Counter = field(default_factory=Counter)  # reason → jobs
    progress: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # active job → per image
    owners: dict[str, str | None] = field(default_factory=dict)  # queued or active job → its owner
    adapter_requests: Counter = field(default_factory=Counter)  # LoRA adapter → requests admitted with it
    adapter_rows: Counter = field(default_factory=Counter)  # LoRA adapter → denoiser rows stepped with it
    images_by_kind: Counter = field(
        default_factory=Counter
    )  # generation, img2img, inpainting → images admitted
    cache_rows: Counter = field(default_factory=Counter)  # step caching: refreshed, reused → rows
    cached_bytes: int = 0  # what running requests keep for step caching
    slow_calls: int = 0  # calls that ran past their deadline
    stuck_calls: int = 0  # calls that ran far past it
    call_seconds: Counter = field(default_factory=Counter)  # CALLS → seconds, each to its device work's end
    # By priority class (PRIORITIES): jobs waiting, rows admitted (stepping or parked), and a
    # counter of the denoiser rows stepped; /v1/stats shows every class, 0 until it has work.
    queue_depth_by_priority: Counter = field(default_factory=Counter)
    active_rows_by_priority: Counter = field(default_factory=Counter)
    rows_by_priority: Counter = field(default_factory=Counter)

    @property
    def steps(self) -> int:
        """Batched denoiser calls."""
        return self.rows_per_step.count

    @property
    def rows_total(self) -> int:
        return int(self.rows_per_step.total)

    def copy(self) -> LoopStats:
        def copied(value: Any) -> Any:
            if isinstance(value, Counter | dict):
                return type(value)(value)
            return value.copy() if isinstance(value, Distribution) else value

        return LoopStats(**{name: copied(value) for name, value in vars(self).items()})

    def __add__(self, other: LoopStats) -> LoopStats:
        """Two lanes' counters as one loop's."""

        def added(value: Any, more: Any) -> Any:
            return value | more if type(value) is dict else value + more  # progress, owners: per job

        return LoopStats(**{name: added(value, getattr(other, name)) for name, value in vars(self).items()})

    def to_dict(self) -> dict[str, Any]:
        return {
            "queue_depth": self.queue_depth,
            "active_jobs": self.active_jobs,
            "active_images": self.active_images,
            "active_rows": self.active_rows,
            "steps": self.steps,
            "step_seconds_total": round(self.step_seconds.total, 6),
            "queue_wait_seconds_total": round(self.queue_wait_seconds.total, 6),
            "rows_total": self.rows_total,
            "batch_rows": {str(rows): calls for rows, calls in sorted(self.batch_rows.items())},
            "jobs_completed": self.jobs_completed,
            "images_completed": self.images_completed,
            "rejected": dict(self.rejected),
            "step_cache_rows": {outcome: self.cache_rows[outcome] for outcome in CACHE_OUTCOMES},
            "step_cache_bytes": self.cached_bytes,
            "slow_calls": self.slow_calls,
            "stuck_calls": self.stuck_calls,
            "call_seconds_total": {call: round(self.call_seconds[call], 6) for call in CALLS},
            "progress": {job: [list(p) for p in steps] for job, steps in self.progress.items()},
            "priorities": {
                priority: {
                    "queue_depth": self.queue_depth_by_priority[priority],
                    "active_rows": self.active_rows_by_priority[priority],
                    "rows_total": self.rows_by_priority[priority],
                }
                for priority in PRIORITIES
            },
        }

    def count_rows(self, states: Any) -> None:
        """One step of `states`: the rows each LoRA adapter was applied to, and the rows that
        refreshed or reused their step cache."""
        for state in states:
            self.adapter_rows.update(dict.fromkeys((name for name, _ in state.request.lora), state.rows))
            if state.cache.last is not None:
                self.cache_rows[state.cache.last] += state.rows

    def seen_by(self, owner: str | None) -> LoopStats:
        """These counters with only `owner`'s jobs in `progress` (None: the operator sees all)."""
        mine = self.copy()
        if owner is not None:
            mine.progress = {j: p for j, p in self.progress.items() if self.owners.get(j) == owner}
        return mine


@dataclass(frozen=True)
class DeviceView:
    """One device as the shard placed it: its blocks and a live memory reading."""

    blocks: tuple[str, ...]
    memory: DeviceMemory


@dataclass(frozen=True)
class Snapshot:
    """Everything the metrics read, at one moment. Model fields are None until it has loaded."""

    model: str
    dtype: str
    queue_capacity: int
    quantization: str = "off"
    loop: LoopStats | None = None
    devices: dict[str, DeviceView] = field(default_factory=dict)
    pool: dict[str, PoolStats] = field(default_factory=dict)
    load_seconds: float | None = None
    threads: int | None = None  # torch's intra-op threads
    ready: bool = False  # what /readyz answers
    last_step_at: float | None = None  # unix time the step loop last finished a call
    busy_seconds: dict[str, float] = field(default_factory=dict)  # per worker: stage/replica held
    bubble_seconds: dict[str, float] = field(default_factory=dict)  # per worker: idle, forwards in flight
    micro_batches_in_flight: int = 0
    rejected: dict[str, int] = field(default_factory=dict)  # reason → requests: rejections()
    adapters: tuple[str, ...] = ()  # the LoRA adapters served (their counters start at 0)
    adapter_bytes: dict[str, int] = field(default_factory=dict)  # per device: the adapters' weights
    denoiser_calls: dict[str, int] = field(default_factory=dict)  # compiled, padded (to a bucket), eager
    video_jobs: dict[str, int] | None = None  # a video model's jobs by state, from the job store
    video_seconds: float | None = None  # of video this replica made (None: not a video model)
    video_runs: int = 0  # video job runs this replica started (a job run again counts again)
