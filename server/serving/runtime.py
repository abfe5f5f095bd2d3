"""The `Runtime`: the service through its life (loading → ready → draining, or loading →
failed), and what health probes, routes, the video runner and metrics ask of it."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from server.engine.runtime.graphs import CompileStats
from server.errors import NotReady
from server.serving.service import Service
from server.serving.stats import Snapshot, rejections

STATUS = {
    "loading": "the model is loading; retry shortly",
    "ready": "ready",
    "draining": "the server is shutting down",
    "failed": "the model failed to load",
}


@dataclass
class Runtime:
    """The service through its life; what health probes, routes and metrics ask."""

    model_name: str
    dtype: str
    queue_capacity: int
    quantization: str = "off"  # --quantize as written (server.app.quantization_of)
    dtype_choice: dict[str, Any] | None = None  # what --dtype auto chose and why (precision.py)
    service: Service | None = None
    status: str = "loading"  # loading → ready → draining, or loading → failed
    error: str | None = None
    load_seconds: float | None = None
    compiling: CompileStats | None = None  # the compiled graphs: progress while loading, then calls
    videos: Any = None  # a video model's VideoRunner (serving/videos.py): its figures() for metrics
    # refusals only HTTP sees (HttpMetrics counts them); keys exist up front: reads copy no growing dict
    http_rejected: Counter = field(default_factory=lambda: Counter(invalid=0, unauthorized=0))
    started: int = field(default_factory=lambda: int(time.time()))

    @property
    def problem(self) -> str | None:
        """Why the service cannot take requests now (for /readyz); None when it can."""
        if self.status != "ready" or self.service is None:
            return STATUS[self.status]  # the load error itself (paths and all) is in the log only
        return self.service.problem()

    @property
    def takes_work(self) -> bool:
        """Ready, and its step loops can take a job now (none dead, stuck, slow or failing)."""
        return self.problem is None

    @property
    def code(self) -> str:
        """The error code /readyz answers: loading, draining, failed, or unhealthy."""
        return self.status if self.status != "ready" else "unhealthy"

    @property
    def live_problem(self) -> str | None:
        """Why the process should be restarted (for /livez): its step loop is dead, stuck or on a
        broken device. Loading, draining and a failed load are alive: they end by themselves."""
        return None if self.service is None else self.service.live_problem()

    def status_message(self) -> str:
        return self.problem or STATUS["ready"]

    def loaded(self) -> Service:
        """The service once the model has loaded (its views stay readable when draining or when
        its loop died; `Service.submit` refuses then); NotReady while loading or if loading failed."""
        if self.service is None:
            raise NotReady(self.status, self.status_message())
        return self.service

    def drain(self, timeout_s: float) -> bool:
        """Stop admitting (readyz and new requests say 503); wait for in-flight requests to end."""
        if self.status == "ready":
            self.status = "draining"
        return True if self.service is None else self.service.drain(timeout_s)

    def rejected(self) -> dict[str, int]:
        """Requests refused or ended early, by reason (what /v1/stats and /metrics both show)."""
        return rejections(self.service.stats().rejected if self.service else Counter(), self.http_rejected)

    def snapshot(self) -> Snapshot:
        service = self.service
        loop = service.stats() if service else None
        return Snapshot(
            model=self.model_name,
            dtype=self.dtype,
            quantization=self.quantization,
            queue_capacity=self.queue_capacity,
            loop=loop,
            devices=service.devices() if service else {},
            pool=service.pipeline.pool.stats() if service else {},
            load_seconds=self.load_seconds,
            threads=service.threads if service else None,
            ready=self.takes_work,
            last_step_at=service.last_step_at if service else None,
            rejected=rejections(loop.rejected if loop else Counter(), self.http_rejected),
            adapters=tuple(service.pipeline.adapters.loaded) if service else (),
            adapter_bytes=service.pipeline.adapters.bytes_on() if service else {},
            denoiser_calls=dict(self.compiling.calls) if self.compiling else {},
            **(service.busy() if service else {}),
            **(self.videos.figures() if self.videos is not None else {}),
        )
