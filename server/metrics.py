"""Prometheus metrics: device memory, the activation pool and serving, on a registry passed in.

Nothing is global: `Metrics(registry, snapshot)` registers
- live HTTP families (requests by route and status, request duration), updated by
  `HttpMetrics`, an ASGI middleware;
- one collector that reads everything else when Prometheus scrapes: per-device memory (the
  CUDA allocator, the device, the shard's weights; on CPU the host and the process), the
  pool's counters and the step loop's plain stats (queue, rows, step times, rejections), all
  from one `Snapshot` that `snapshot()` returns (the serving layer's plain data).

`CATALOG` lists every family (docs/metrics.md is its table; a test keeps the two in step).
"""

from __future__ import annotations

import resource
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
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
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server import __version__
from server.engine.memory import resident_bytes
from server.engine.pool import PoolStats
from server.serving.stats import DeviceView, Distribution, LoopStats, Snapshot

PREFIX = "diffshard"
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# Rejection reasons, always exported (0 until one happens) so dashboards and alerts see them.
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
LOOP_REASONS = {"deadline": "timeout", "out_of_memory": "oom"}  # step loop stats key → label
DEVICE_LABELS = ("device", "gpu", "UUID")  # gpu and UUID as DCGM names them (empty on CPU)
# The `method` label's values: any other method a client sends counts as "other", so a client
# cannot mint a series per made-up method name.
METHODS = frozenset(("GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"))


@dataclass(frozen=True)
class MetricSpec:
    name: str
    type: str
    unit: str
    labels: tuple[str, ...]
    help: str
    cuda_only: bool = False


CATALOG = (
    MetricSpec(
        "device_allocated_bytes",
        "gauge",
        "bytes",
        DEVICE_LABELS,
        "bytes in live tensors (allocator)",
        True,
    ),
    MetricSpec(
        "device_reserved_bytes", "gauge", "bytes", DEVICE_LABELS, "bytes the CUDA allocator holds", True
    ),
    MetricSpec(
        "device_peak_allocated_bytes", "gauge", "bytes", DEVICE_LABELS, "highest allocated since start", True
    ),
    MetricSpec(
        "device_free_bytes", "gauge", "bytes", DEVICE_LABELS, "free device memory (on CPU: available RAM)"
    ),
    MetricSpec(
        "device_total_bytes", "gauge", "bytes", DEVICE_LABELS, "device memory (on CPU: the host's RAM)"
    ),
    MetricSpec(
        "shard_parameter_bytes", "gauge", "bytes", DEVICE_LABELS, "weights and buffers the shard placed"
    ),
    MetricSpec(
        "shard_blocks", "gauge", "blocks", DEVICE_LABELS, "denoiser blocks the shard placed on the device"
    ),
    MetricSpec("process_resident_bytes", "gauge", "bytes", (), "the server process's resident memory"),
    MetricSpec("process_peak_resident_bytes", "gauge", "bytes", (), "the process's highest resident memory"),
    MetricSpec(
        "pool_pooled_bytes", "gauge", "bytes", ("device",), "bytes the activation pool holds, idle or rented"
    ),
    MetricSpec("pool_in_use_bytes", "gauge", "bytes", ("device",), "bytes rented out by the activation pool"),
    MetricSpec("pool_rents_total", "counter", "rents", ("device", "result"), "rents by result: hit or miss"),
    MetricSpec(
        "pool_evictions_total", "counter", "buffers", ("device",), "idle buffers evicted for the byte budget"
    ),
    MetricSpec(
        "http_requests_total", "counter", "requests", ("route", "method", "code"), "HTTP requests answered"
    ),
    MetricSpec(
        "http_request_duration_seconds", "histogram", "seconds", ("route",), "time to answer a request"
    ),
    MetricSpec(
        "queue_wait_seconds",
        "histogram",
        "seconds",
        (),
        "arrival to admission (or to leaving the queue)",
    ),
    MetricSpec(
        "step_duration_seconds",
        "histogram",
        "seconds",
        (),
        "one batched denoising step (denoiser + schedulers)",
    ),
    MetricSpec("batch_rows", "histogram", "rows", (), "denoiser rows per batched step (2 per guided image)"),
    MetricSpec("queue_depth", "gauge", "requests", (), "requests waiting for a place"),
    MetricSpec("queue_capacity", "gauge", "requests", (), "the queue's bound (DIFFSHARD_MAX_QUEUE)"),
    MetricSpec("running_requests", "gauge", "requests", (), "requests being denoised"),
    MetricSpec("running_rows", "gauge", "rows", (), "denoiser rows of the running requests"),
    MetricSpec(
        "rejections_total", "counter", "requests", ("reason",), f"requests refused or ended early: {REASONS}"
    ),
    MetricSpec("images_generated_total", "counter", "images", (), "images returned"),
    MetricSpec(
        "slow_steps_total",
        "counter",
        "calls",
        (),
        "calls past their deadline (the step timeout scaled by their work): /readyz failed meanwhile",
    ),
    MetricSpec(
        "stuck_steps_total",
        "counter",
        "calls",
        (),
        "calls far past their deadline: /livez failed and waiting requests were answered 503",
    ),
    MetricSpec("model_load_duration_seconds", "gauge", "seconds", (), "time to load and place the model"),
    MetricSpec(
        "build",
        "info",
        "",
        ("version", "torch", "diffusers", "model", "dtype", "threads", "inject_faults"),
        "versions, the model, torch's threads, and whether fault injection is on",
    ),
    MetricSpec(
        "device_busy_seconds_total",
        "counter",
        "seconds",
        ("device",),
        "seconds a worker (a stage or replica on its device) ran a forward; rate() is its utilisation",
    ),
    MetricSpec(
        "pipeline_bubble_seconds_total",
        "counter",
        "seconds",
        ("device",),
        "seconds a worker sat idle while its model had a forward in flight",
    ),
    MetricSpec("micro_batches_in_flight", "gauge", "micro-batches", (), "forwards running in the shards now"),
    MetricSpec("ready", "gauge", "", (), "1 while /readyz answers 200, else 0"),
    MetricSpec(
        "last_step_timestamp_seconds", "gauge", "seconds", (), "unix time the step loop last finished a call"
    ),
)


def metric_name(family: MetricSpec) -> str:
    return f"{PREFIX}_{family.name}" + ("_info" if family.type == "info" else "")


class Metrics:
    """Every diffshard family on `registry`, reading `snapshot()` at scrape time."""

    def __init__(
        self, registry: CollectorRegistry, snapshot: Callable[[], Snapshot], *, inject_faults: bool = False
    ) -> None:
        self.registry = registry
        self.snapshot = snapshot
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
        # refusals only the HTTP layer sees; keys exist up front so a scrape never copies a growing dict
        self.http_rejections: Counter[str] = Counter(invalid=0, unauthorized=0)
        registry.register(_Collector(self))


class HttpMetrics:
    """ASGI middleware: count and time every HTTP request by route template (not raw path)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, status = time.perf_counter(), 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")  # bounded label values
            method = scope["method"] if scope["method"] in METHODS else "other"
            self.metrics.http_requests.labels(route, method, str(status)).inc()
            self.metrics.http_duration.labels(route).observe(time.perf_counter() - started)
            if status in (400, 413, 422):
                self.metrics.http_rejections["invalid"] += 1
            elif status == 401:
                self.metrics.http_rejections["unauthorized"] += 1


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

    def _build(self, snapshot: Snapshot) -> Iterator[Metric]:
        info = InfoMetricFamily(f"{PREFIX}_build", _help("build"))
        info.add_metric(
            [],
            {
                "version": __version__,
                "torch": torch.__version__,
                "diffusers": version("diffusers"),
                "model": snapshot.model,
                "dtype": snapshot.dtype,
                "threads": "" if snapshot.threads is None else str(snapshot.threads),
                "inject_faults": str(self.metrics.inject_faults).lower(),
            },
        )
        yield info
        yield GaugeMetricFamily(f"{PREFIX}_ready", _help("ready"), float(snapshot.ready))
        if snapshot.last_step_at is not None:
            yield GaugeMetricFamily(
                f"{PREFIX}_last_step_timestamp_seconds",
                _help("last_step_timestamp_seconds"),
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
            yield GaugeMetricFamily(f"{PREFIX}_{name}", _help(name), value)
        rejections = CounterMetricFamily(f"{PREFIX}_rejections", _help("rejections_total"), labels=["reason"])
        counts = Counter(self.metrics.http_rejections)
        for reason, n in stats.rejected.items():
            counts[LOOP_REASONS.get(reason, reason)] += n
        for reason in dict.fromkeys((*REASONS, *counts)):
            rejections.add_metric([reason], counts[reason])
        yield rejections
        yield CounterMetricFamily(
            f"{PREFIX}_images_generated", _help("images_generated_total"), stats.images_completed
        )
        for name, value in (("slow_steps_total", stats.slow_calls), ("stuck_steps_total", stats.stuck_calls)):
            yield CounterMetricFamily(f"{PREFIX}_{name.removesuffix('_total')}", _help(name), value)
        yield from self._workers(snapshot)
        if snapshot.loop is not None:
            yield _histogram("queue_wait_seconds", stats.queue_wait_seconds)
            yield _histogram("step_duration_seconds", stats.step_seconds)
            yield _histogram("batch_rows", stats.rows_per_step)

    def _workers(self, snapshot: Snapshot) -> Iterator[Metric]:
        for name, seconds in (
            ("device_busy_seconds_total", snapshot.busy_seconds),
            ("pipeline_bubble_seconds_total", snapshot.bubble_seconds),
        ):
            family = CounterMetricFamily(
                f"{PREFIX}_{name.removesuffix('_total')}", _help(name), labels=["device"]
            )
            for worker, value in seconds.items():
                family.add_metric([worker], value)
            yield family
        yield GaugeMetricFamily(
            f"{PREFIX}_micro_batches_in_flight",
            _help("micro_batches_in_flight"),
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
            f"{PREFIX}_pool_pooled_bytes", _help("pool_pooled_bytes"), labels=["device"]
        )
        in_use = GaugeMetricFamily(
            f"{PREFIX}_pool_in_use_bytes", _help("pool_in_use_bytes"), labels=["device"]
        )
        rents = CounterMetricFamily(
            f"{PREFIX}_pool_rents", _help("pool_rents_total"), labels=["device", "result"]
        )
        evictions = CounterMetricFamily(
            f"{PREFIX}_pool_evictions", _help("pool_evictions_total"), labels=["device"]
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
            f"{PREFIX}_process_resident_bytes", _help("process_resident_bytes"), resident_bytes()
        )
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux reports KiB
        yield GaugeMetricFamily(
            f"{PREFIX}_process_peak_resident_bytes", _help("process_peak_resident_bytes"), peak_kib * 1024
        )


def _help(name: str) -> str:
    return next(f.help for f in CATALOG if f.name == name)


def _histogram(name: str, distribution: Distribution) -> HistogramMetricFamily:
    cumulative, buckets = 0, []
    for bound, count in zip((*distribution.bounds, float("inf")), distribution.counts, strict=True):
        cumulative += count
        buckets.append((_bound(bound), cumulative))
    return HistogramMetricFamily(
        f"{PREFIX}_{name}", _help(name), buckets=buckets, sum_value=distribution.total
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
