"""Prometheus metrics: device memory, the activation pool and serving, on a registry passed in.

Nothing is global: `Metrics(registry, snapshot)` registers
- live HTTP families (requests by route and status, request duration), updated by
  `HttpMetrics`, an ASGI middleware;
- one collector that reads everything else when Prometheus scrapes: per-device memory (the
  CUDA allocator, the device, the shard's weights; on CPU the host and the process), the
  pool's counters and the step loop's plain stats (queue, rows, step times, rejections), all
  from one `Snapshot` that `snapshot()` returns (the serving layer's plain data).

`CATALOG` (catalog.py) lists every family: docs/metrics.md is its table, a test keeps the two
in step. The scrape-time collector is collector.py's, the HTTP middleware http.py's.
"""

from server.metrics.catalog import CATALOG, PREFIX, MetricSpec, metric_name
from server.metrics.collector import Metrics
from server.metrics.http import HttpMetrics

__all__ = ["CATALOG", "PREFIX", "HttpMetrics", "MetricSpec", "Metrics", "metric_name"]
