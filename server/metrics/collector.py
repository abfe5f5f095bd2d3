"""The families Prometheus reads at scrape time, from one `Snapshot`, and the live HTTP ones."""

from __future__ import annotations

import resource
from collections.abc import Callable, Iterator
from importlib.metadata import version

import torch
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client import Counter as PromCounter
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)

from server import __version__
from server.engine.hardware.memory import resident_bytes
from server.engine.runtime.pool import PoolStats
from server.metrics.catalog import CATALOG, DEVICE_LABELS, PREFIX, help_of
from server.requests import KINDS
from server.serving.jobs import PRIORITIES
from server.serving.outbox import ENDINGS
from server.serving.stats import CACHE_OUTCOMES, CALLS, DeviceView, Distribution, LoopStats, Snapshot
from server.serving.videostore import STATUSES
from server.serving.webhooks import RESULTS, WebhookFigures

REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class Metrics:
    """Every diffshard family on `registry`, reading `snapshot()` (and `webhooks()`: the webhook
    deliverer's figures, None without one) at scrape time."""

    def __init__(
        self,
        registry: CollectorRegistry,
        snapshot: Callable[[], Snapshot],
        *,
        inject_faults: bool = False,
        webhooks: Callable[[], WebhookFigures | None] = lambda: None,
    ) -> None:
        self.registry = registry
        self.snapshot = snapshot
        self.webhooks = webhooks
        self.inject_faults = inject_faults  # shown in build_info: a server failing on purpose says so
        self.http_requests = PromCounter(
            f"{PREFIX}_http_requests",
            "HTTP requests answered",
            ("route", "method", "code"),
            registry=registry,
        )
        self.http_duration = Histogram(
            f"{PREFIX}_http_request_duration_seconds",
            "time to answer a request",
            ("route",),
            buckets=REQUEST_BUCKETS,
            registry=registry,
        )
        registry.register(_Collector(self))


class _Collector:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return []  # families are built at scrape time; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        snapshot = self.metrics.snapshot()
        yield from self._build(snapshot)
        yield from self._serving(snapshot)
        yield from self._devices(snapshot.devices)
        yield from self._pool(snapshot.pool)
        yield from self._process()
        yield from self._webhooks(self.metrics.webhooks() or WebhookFigures())

    def _build(self, snapshot: Snapshot) -> Iterator[Metric]:
        info = InfoMetricFamily(f"{PREFIX}_build", help_of("build"))
        info.add_metric(
            [],
            {
                "version": __version__,
                "torch": torch.__version__,
                "diffusers": version("diffusers"),
                "model": snapshot.model,
                "dtype": snapshot.dtype,
                "quantization": snapshot.quantization,
                "threads": "" if snapshot.threads is None else str(snapshot.threads),
                "inject_faults": str(self.metrics.inject_faults).lower(),
            },
        )
        yield info
        yield GaugeMetricFamily(f"{PREFIX}_ready", help_of("ready"), float(snapshot.ready))
        if snapshot.last_step_at is not None:
            yield GaugeMetricFamily(
                f"{PREFIX}_last_step_timestamp_seconds",
                help_of("last_step_timestamp_seconds"),
                snapshot.last_step_at,
            )
        if snapshot.load_seconds is not None:
            yield GaugeMetricFamily(
                f"{PREFIX}_model_load_duration_seconds",
                "time to load and place the model",
                snapshot.load_seconds,
            )

    def _serving(self, snapshot: Snapshot) -> Iterator[Metric]:
        stats = snapshot.loop or LoopStats()  # zeros while the model loads
        gauges = {
            "queue_depth": stats.queue_depth,
            "queue_capacity": snapshot.queue_capacity,
            "running_requests": stats.active_jobs,
            "running_rows": stats.active_rows,
        }
        for name, value in gauges.items():
            yield GaugeMetricFamily(f"{PREFIX}_{name}", help_of(name), value)
        yield from self._priorities(stats)
        rejections = CounterMetricFamily(
            f"{PREFIX}_rejections", help_of("rejections_total"), labels=["reason"]
        )
        for reason, n in snapshot.rejected.items():
            rejections.add_metric([reason], n)
        yield rejections
        yield CounterMetricFamily(
            f"{PREFIX}_images_generated", help_of("images_generated_total"), stats.images_completed
        )
        for name, value in (("slow_steps_total", stats.slow_calls), ("stuck_steps_total", stats.stuck_calls)):
            yield CounterMetricFamily(f"{PREFIX}_{name.removesuffix('_total')}", help_of(name), value)
        yield from self._workers(snapshot)
        yield from self._adapters(snapshot, stats)
        yield from self._videos(snapshot)
        kinds = CounterMetricFamily(
            f"{PREFIX}_images_admitted", help_of("images_admitted_total"), labels=["kind"]
        )
        for kind in KINDS:
            kinds.add_metric([kind], stats.images_by_kind[kind])
        yield kinds
        cached = CounterMetricFamily(
            f"{PREFIX}_step_cache_rows", help_of("step_cache_rows_total"), labels=["outcome"]
        )
        for outcome in CACHE_OUTCOMES:
            cached.add_metric([outcome], stats.cache_rows[outcome])
        yield cached
        yield GaugeMetricFamily(f"{PREFIX}_step_cache_bytes", help_of("step_cache_bytes"), stats.cached_bytes)
        called = CounterMetricFamily(
            f"{PREFIX}_pipeline_call_seconds", help_of("pipeline_call_seconds_total"), labels=["call"]
        )
        for call in CALLS:
            called.add_metric([call], stats.call_seconds[call])
        yield called
        calls = help_of("denoiser_calls_total")
        paths = CounterMetricFamily(f"{PREFIX}_denoiser_calls", calls, labels=["path"])
        for path in ("compiled", "padded", "eager"):
            paths.add_metric([path], snapshot.denoiser_calls.get(path, 0))
        yield paths
        if snapshot.loop is not None:
            yield _histogram("queue_wait_seconds", stats.queue_wait_seconds)
            yield _histogram("step_duration_seconds", stats.step_seconds)
            yield _histogram("batch_rows", stats.rows_per_step)

    def _priorities(self, stats: LoopStats) -> Iterator[Metric]:
        """Each priority class's waiting requests, admitted rows and rows stepped (every class
        always, 0 until it has work)."""
        for name, counts, kind in (
            ("queue_depth_by_priority", stats.queue_depth_by_priority, GaugeMetricFamily),
            ("running_rows_by_priority", stats.active_rows_by_priority, GaugeMetricFamily),
            ("rows_stepped_total", stats.rows_by_priority, CounterMetricFamily),
        ):
            family = kind(f"{PREFIX}_{name.removesuffix('_total')}", help_of(name), labels=["priority"])
            for priority in PRIORITIES:
                family.add_metric([priority], counts[priority])
            yield family

    def _videos(self, snapshot: Snapshot) -> Iterator[Metric]:
        """A video model's: its jobs by state (the store's, so equal on replicas sharing one), the
        seconds of video this replica made and the runs it started (more runs than jobs: reruns)."""
        if snapshot.video_seconds is None:
            return
        made = CounterMetricFamily(f"{PREFIX}_video_seconds", help_of("video_seconds_total"))
        made.add_metric([], snapshot.video_seconds)
        yield made
        runs = CounterMetricFamily(f"{PREFIX}_video_runs", help_of("video_runs_total"))
        runs.add_metric([], snapshot.video_runs)
        yield runs
        if snapshot.video_jobs is not None:
            jobs = GaugeMetricFamily(f"{PREFIX}_video_jobs", help_of("video_jobs"), labels=["state"])
            for state in STATUSES:
                jobs.add_metric([state], snapshot.video_jobs.get(state, 0))
            yield jobs

    def _webhooks(self, figures: WebhookFigures) -> Iterator[Metric]:
        """This replica's POSTs and ended events (zeros without --webhook); the outbox's backlog
        (shared by the replicas of a Redis store; absent while it does not answer)."""
        posts = CounterMetricFamily(
            f"{PREFIX}_webhook_requests", help_of("webhook_requests_total"), labels=["result"]
        )
        for result in RESULTS:
            posts.add_metric([result], figures.posts.get(result, 0))
        yield posts
        events = CounterMetricFamily(
            f"{PREFIX}_webhook_events", help_of("webhook_events_total"), labels=["outcome"]
        )
        for outcome in ENDINGS:
            events.add_metric([outcome], figures.events.get(outcome, 0))
        yield events
        if figures.pending is not None:
            yield GaugeMetricFamily(
                f"{PREFIX}_webhook_pending_events", help_of("webhook_pending_events"), figures.pending
            )
        if figures.lag_s is not None:
            yield GaugeMetricFamily(
                f"{PREFIX}_webhook_lag_seconds", help_of("webhook_lag_seconds"), figures.lag_s
            )

    def _adapters(self, snapshot: Snapshot, stats: LoopStats) -> Iterator[Metric]:
        """Per LoRA adapter served (labels bounded to them: requests name only loaded ones)."""
        for name, counts in (
            ("lora_requests_total", stats.adapter_requests),
            ("lora_rows_total", stats.adapter_rows),
        ):
            family = CounterMetricFamily(
                f"{PREFIX}_{name.removesuffix('_total')}", help_of(name), labels=["adapter"]
            )
            for adapter in snapshot.adapters:
                family.add_metric([adapter], counts[adapter])
            yield family
        placed = GaugeMetricFamily(f"{PREFIX}_lora_bytes", help_of("lora_bytes"), labels=["device"])
        for device in dict.fromkeys([*snapshot.devices, *snapshot.adapter_bytes]):
            placed.add_metric([device], snapshot.adapter_bytes.get(device, 0))
        yield placed

    def _workers(self, snapshot: Snapshot) -> Iterator[Metric]:
        for name, seconds in (
            ("device_busy_seconds_total", snapshot.busy_seconds),
            ("pipeline_bubble_seconds_total", snapshot.bubble_seconds),
        ):
            family = CounterMetricFamily(
                f"{PREFIX}_{name.removesuffix('_total')}", help_of(name), labels=["device"]
            )
            for worker, value in seconds.items():
                family.add_metric([worker], value)
            yield family
        yield GaugeMetricFamily(
            f"{PREFIX}_micro_batches_in_flight",
            help_of("micro_batches_in_flight"),
            snapshot.micro_batches_in_flight,
        )

    def _devices(self, devices: dict[str, DeviceView]) -> Iterator[Metric]:
        if not devices:
            return
        families = {
            f.name: GaugeMetricFamily(f"{PREFIX}_{f.name}", f.help, labels=DEVICE_LABELS)
            for f in CATALOG
            if f.labels == DEVICE_LABELS
        }
        for device, view in devices.items():
            labels, memory = _device_labels(device), view.memory
            families["shard_parameter_bytes"].add_metric(labels, memory.shard_bytes)
            families["shard_blocks"].add_metric(labels, len(view.blocks))
            if memory.allocated is not None:  # CUDA
                families["device_allocated_bytes"].add_metric(labels, memory.allocated)
                families["device_reserved_bytes"].add_metric(labels, memory.reserved or 0)
                families["device_peak_allocated_bytes"].add_metric(labels, memory.peak or 0)
            families["device_free_bytes"].add_metric(labels, memory.free or 0)
            families["device_total_bytes"].add_metric(labels, memory.total or 0)
        yield from families.values()

    def _pool(self, pool: dict[str, PoolStats]) -> Iterator[Metric]:
        pooled = GaugeMetricFamily(
            f"{PREFIX}_pool_pooled_bytes", help_of("pool_pooled_bytes"), labels=["device"]
        )
        in_use = GaugeMetricFamily(
            f"{PREFIX}_pool_in_use_bytes", help_of("pool_in_use_bytes"), labels=["device"]
        )
        rents = CounterMetricFamily(
            f"{PREFIX}_pool_rents", help_of("pool_rents_total"), labels=["device", "result"]
        )
        evictions = CounterMetricFamily(
            f"{PREFIX}_pool_evictions", help_of("pool_evictions_total"), labels=["device"]
        )
        for device, stats in pool.items():
            pooled.add_metric([device], stats.bytes_pooled)
            in_use.add_metric([device], stats.bytes_in_use)
            rents.add_metric([device, "hit"], stats.hits)
            rents.add_metric([device, "miss"], stats.misses)
            evictions.add_metric([device], stats.evictions)
        yield from (pooled, in_use, rents, evictions)

    def _process(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            f"{PREFIX}_process_resident_bytes", help_of("process_resident_bytes"), resident_bytes()
        )
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux reports KiB
        yield GaugeMetricFamily(
            f"{PREFIX}_process_peak_resident_bytes", help_of("process_peak_resident_bytes"), peak_kib * 1024
        )


def _histogram(name: str, distribution: Distribution) -> HistogramMetricFamily:
    cumulative, buckets = 0, []
    for bound, count in zip((*distribution.bounds, float("inf")), distribution.counts, strict=True):
        cumulative += count
        buckets.append((_bound(bound), cumulative))
    return HistogramMetricFamily(
        f"{PREFIX}_{name}", help_of(name), buckets=buckets, sum_value=distribution.total
    )


def _bound(value: float) -> str:
    return "+Inf" if value == float("inf") else repr(float(value))


def _device_labels(device: str) -> list[str]:
    dev = torch.device(device)
    if dev.type != "cuda":
        return [device, "", ""]
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", ""))
    return [device, str(index), f"GPU-{uuid}" if uuid and not uuid.startswith("GPU-") else uuid]
