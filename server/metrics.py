"""Prometheus metrics: device memory, the activation pool and serving, on a registry passed in.

Nothing is global: `Metrics(registry, runtime)` registers
- live HTTP families (requests by route and status, request duration), updated by
  `HttpMetrics`, an ASGI middleware;
- one collector that reads everything else when Prometheus scrapes: per-device memory (the
  CUDA allocator, the device, the shard's weights; on CPU the host and the process), the
  pool's counters and the engine's plain stats (queue, rows, step times, rejections).

`CATALOG` lists every family (docs/metrics.md is its table; a test keeps the two in step).
"""

from __future__ import annotations

import os
import resource
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.metadata import version
from typing import TYPE_CHECKING

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
from server.pipeline.batcher import Distribution

if TYPE_CHECKING:
    from server.app import Runtime

PREFIX = "diffshard"
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# Rejection reasons, always exported (0 until one happens) so dashboards and alerts see them.
REASONS = ("queue_full", "timeout", "cancelled", "oom", "invalid", "unauthorized", "failed", "draining")
ENGINE_REASONS = {"deadline": "timeout", "out_of_memory": "oom"}  # engine stats key → label
DEVICE_LABELS = ("device", "gpu", "UUID")  # gpu and UUID as DCGM names them (empty on CPU)


@dataclass(frozen=True)
class Family:
    name: str
    type: str
    unit: str
    labels: tuple[str, ...]
    help: str
    cuda_only: bool = False


CATALOG = (
    Family(
        "device_allocated_bytes",
        "gauge",
        "bytes",
        DEVICE_LABELS,
        "bytes in live tensors (allocator)",
        True,
    ),
    Family("device_reserved_bytes", "gauge", "bytes", DEVICE_LABELS, "bytes the CUDA allocator holds", True),
    Family(
        "device_peak_allocated_bytes", "gauge", "bytes", DEVICE_LABELS, "highest allocated since start", True
    ),
    Family(
        "device_free_bytes", "gauge", "bytes", DEVICE_LABELS, "free device memory (on CPU: available RAM)"
    ),
    Family("device_total_bytes", "gauge", "bytes", DEVICE_LABELS, "device memory (on CPU: the host's RAM)"),
    Family("shard_parameter_bytes", "gauge", "bytes", DEVICE_LABELS, "weights and buffers the shard placed"),
    Family("shard_blocks", "gauge", "blocks", DEVICE_LABELS, "UNet blocks the shard placed on the device"),
    Family("process_resident_bytes", "gauge", "bytes", (), "the server process's resident memory"),
    Family("process_peak_resident_bytes", "gauge", "bytes", (), "the process's highest resident memory"),
    Family(
        "pool_pooled_bytes", "gauge", "bytes", ("device",), "bytes the activation pool holds, idle or rented"
    ),
    Family("pool_in_use_bytes", "gauge", "bytes", ("device",), "bytes rented out by the activation pool"),
    Family("pool_rents_total", "counter", "rents", ("device", "result"), "rents by result: hit or miss"),
    Family(
        "pool_evictions_total", "counter", "buffers", ("device",), "idle buffers evicted for the byte budget"
    ),
    Family(
        "http_requests_total", "counter", "requests", ("route", "method", "code"), "HTTP requests answered"
    ),
    Family("http_request_duration_seconds", "histogram", "seconds", ("route",), "time to answer a request"),
    Family(
        "queue_wait_seconds",
        "histogram",
        "seconds",
        (),
        "arrival to admission (or to leaving the queue)",
    ),
    Family(
        "step_duration_seconds", "histogram", "seconds", (), "one batched denoising step (UNet + schedulers)"
    ),
    Family("batch_rows", "histogram", "rows", (), "UNet rows per batched step (2 per guided image)"),
    Family("queue_depth", "gauge", "requests", (), "requests waiting for a place"),
    Family("queue_capacity", "gauge", "requests", (), "the queue's bound (DIFFSHARD_MAX_QUEUE)"),
    Family("running_requests", "gauge", "requests", (), "requests being denoised"),
    Family("running_rows", "gauge", "rows", (), "UNet rows of the running requests"),
    Family(
        "rejections_total", "counter", "requests", ("reason",), f"requests refused or ended early: {REASONS}"
    ),
    Family("images_generated_total", "counter", "images", (), "images returned"),
    Family("model_load_duration_seconds", "gauge", "seconds", (), "time to load and place the model"),
    Family(
        "build", "info", "", ("version", "torch", "diffusers", "model", "dtype"), "versions and the model"
    ),
)


def metric_name(family: Family) -> str:
    return f"{PREFIX}_{family.name}" + ("_info" if family.type == "info" else "")


class Metrics:
    """Every diffshard family on `registry`, reading `runtime` (settings, engine) at scrape time."""

    def __init__(self, registry: CollectorRegistry, runtime: Runtime) -> None:
        self.registry = registry
        self.runtime = runtime
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
        self.http_rejections: Counter[str] = Counter(invalid=0, unauthorized=0, draining=0)
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
            self.metrics.http_requests.labels(route, scope["method"], str(status)).inc()
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
        runtime = self.metrics.runtime
        yield from self._build(runtime)
        engine = runtime.engine
        yield from self._serving(runtime, engine)
        if engine is not None:
            yield from self._devices(engine.pipeline)
            yield from self._pool(engine.pipeline.pool)
        yield from self._process()

    def _build(self, runtime: Runtime) -> Iterator[Metric]:
        info = InfoMetricFamily(f"{PREFIX}_build", "versions and the model")
        settings = runtime.settings
        info.add_metric(
            [],
            {
                "version": __version__,
                "torch": torch.__version__,
                "diffusers": version("diffusers"),
                "model": settings.served_name,
                "dtype": str(settings.torch_dtype).removeprefix("torch."),
            },
        )
        yield info
        if runtime.load_seconds is not None:
            yield GaugeMetricFamily(
                f"{PREFIX}_model_load_duration_seconds",
                "time to load and place the model",
                runtime.load_seconds,
            )

    def _serving(self, runtime: Runtime, engine) -> Iterator[Metric]:
        stats = engine.stats() if engine is not None else None
        gauges = {
            "queue_depth": stats.queue_depth if stats else 0,
            "queue_capacity": runtime.settings.max_queue,
            "running_requests": stats.active_jobs if stats else 0,
            "running_rows": stats.active_rows if stats else 0,
        }
        for name, value in gauges.items():
            yield GaugeMetricFamily(f"{PREFIX}_{name}", _help(name), value)
        rejections = CounterMetricFamily(f"{PREFIX}_rejections", _help("rejections_total"), labels=["reason"])
        counts = Counter(self.metrics.http_rejections)
        for reason, n in stats.rejected.items() if stats else ():
            counts[ENGINE_REASONS.get(reason, reason)] += n
        for reason in dict.fromkeys((*REASONS, *counts)):
            rejections.add_metric([reason], counts[reason])
        yield rejections
        yield CounterMetricFamily(
            f"{PREFIX}_images_generated",
            _help("images_generated_total"),
            stats.images_completed if stats else 0,
        )
        if stats is not None:
            yield _histogram("queue_wait_seconds", stats.queue_wait_seconds)
            yield _histogram("step_duration_seconds", stats.step_seconds)
            yield _histogram("batch_rows", stats.rows_per_step)

    def _devices(self, pipeline) -> Iterator[Metric]:
        shard = pipeline.shard
        families = {
            f.name: GaugeMetricFamily(f"{PREFIX}_{f.name}", f.help, labels=DEVICE_LABELS)
            for f in CATALOG
            if f.labels == DEVICE_LABELS
        }
        for device, memory in shard.memory().items():
            labels = _device_labels(device)
            families["shard_parameter_bytes"].add_metric(labels, memory.shard_bytes)
            families["shard_blocks"].add_metric(labels, len(shard.blocks_on(device)))
            if memory.allocated is not None:  # CUDA
                families["device_allocated_bytes"].add_metric(labels, memory.allocated)
                families["device_reserved_bytes"].add_metric(labels, memory.reserved or 0)
                families["device_peak_allocated_bytes"].add_metric(labels, memory.peak or 0)
                families["device_free_bytes"].add_metric(labels, memory.free or 0)
                families["device_total_bytes"].add_metric(labels, memory.total or 0)
            else:
                free, total = _host_memory()
                families["device_free_bytes"].add_metric(labels, free)
                families["device_total_bytes"].add_metric(labels, total)
        yield from families.values()

    def _pool(self, pool) -> Iterator[Metric]:
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
        for device, stats in pool.stats().items():
            pooled.add_metric([device], stats.bytes_pooled)
            in_use.add_metric([device], stats.bytes_in_use)
            rents.add_metric([device, "hit"], stats.hits)
            rents.add_metric([device, "miss"], stats.misses)
            evictions.add_metric([device], stats.evictions)
        yield from (pooled, in_use, rents, evictions)

    def _process(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            f"{PREFIX}_process_resident_bytes", _help("process_resident_bytes"), _resident_bytes()
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


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _host_memory() -> tuple[int, int]:
    """(available, total) bytes of the host's RAM, from /proc/meminfo."""
    fields = {}
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0]) * 1024
    return fields.get("MemAvailable", 0), fields.get("MemTotal", 0)
