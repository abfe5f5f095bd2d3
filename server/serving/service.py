"""What the HTTP layer sees of serving: a `Service` (the loaded model, its step loop, its views)
and the `Runtime` that holds it through its life (loading → ready → draining, or → failed).

Routes call these and nothing below them: they never touch the pipeline, the shard or torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from server.errors import NotReady
from server.pipeline import GenerationRequest, Pipeline
from server.serving.jobs import Job
from server.serving.limits import Limits, check_limits, fit_defaults
from server.serving.loop import StepLoop
from server.serving.stats import DeviceView, LoopStats, Snapshot

STATUS = {
    "loading": "the model is loading; retry shortly",
    "ready": "ready",
    "draining": "the server is shutting down",
    "failed": "the model failed to load",
}


class Service:
    """A loaded pipeline behind a step loop, with the service's limits."""

    def __init__(
        self,
        pipeline: Pipeline,
        name: str,
        limits: Limits | None = None,
        *,
        max_queue: int = 64,
        max_batch: int = 16,
        step_timeout_s: float = 120.0,
        failures_unready: int = 3,
        inject_faults: bool = False,
        on_idle: Callable[[], None] | None = None,
        threads: int | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.threads = threads if threads is not None else torch.get_num_threads()
        self.name = name  # the model's id, as clients know it
        self.limits = limits or Limits()
        self.failures_unready = failures_unready
        pipeline.defaults = fit_defaults(pipeline.defaults, self.limits, pipeline.family)
        self.loop = StepLoop(
            pipeline,
            max_queue=max_queue,
            max_batch=max_batch,
            step_timeout_s=step_timeout_s,
            inject_faults=inject_faults,
            on_idle=on_idle,
        )

    def submit(self, requests: list[GenerationRequest], request_id: str | None = None) -> Job:
        """Resolve and check the requests (InvalidRequest), then queue them as one job
        (Overloaded or Draining when the loop cannot take it)."""
        filled = [self.pipeline.with_defaults(r) for r in requests]
        check_limits(filled, self.limits)  # policy first: its message names the setting to change
        resolved = [self.pipeline.resolve(r) for r in filled]
        rows = sum(self.pipeline.rows(r) for r in resolved)
        job = Job(resolved, rows, self.limits.request_timeout_s)
        if request_id is not None:  # the loop's log lines name the job: the request's own id
            job.id = request_id
        return self.loop.submit(job)

    def cancel(self, job: Job) -> None:
        self.loop.cancel(job)

    # Views.

    def stats(self) -> LoopStats:
        return self.loop.stats()

    def pool(self) -> dict[str, dict[str, Any]]:
        return {
            device: asdict(s) | {"hit_rate": s.hit_rate} for device, s in self.pipeline.pool.stats().items()
        }

    def devices(self) -> dict[str, DeviceView]:
        shard = self.pipeline.shard
        return {device: DeviceView(shard.blocks_on(device), m) for device, m in shard.memory().items()}

    def shards(self) -> dict[str, Any]:
        """The plan, each device's blocks and live memory: where every block and byte is."""
        shard = self.pipeline.shard
        return {
            "plan": shard.plan.to_dict(),
            "devices": {
                device: {"blocks": list(view.blocks), "memory": asdict(view.memory)}
                for device, view in self.devices().items()
            },
            "pool": self.pool(),
            "text": str(shard),
        }

    # Health and lifecycle.

    def problem(self) -> str | None:
        """Why this service should not get traffic: its loop is dead, stuck or on a broken device,
        or its last steps all failed."""
        failures = self.loop.heartbeat.failures_in_a_row
        if problem := self.loop.problem():
            return problem
        return f"the last {failures} steps failed" if failures >= self.failures_unready else None

    def drain(self, timeout_s: float) -> bool:
        """Refuse new jobs; wait up to `timeout_s` for those in flight. True if they all ended."""
        self.loop.stop_admitting()
        return self.loop.wait_idle(timeout_s)

    def close(self) -> None:
        self.loop.close()


@dataclass
class Runtime:
    """The service through its life; what health probes, routes and metrics ask."""

    model_name: str
    dtype: str
    queue_capacity: int
    service: Service | None = None
    status: str = "loading"  # loading → ready → draining, or loading → failed
    error: str | None = None
    load_seconds: float | None = None
    started: int = field(default_factory=lambda: int(time.time()))

    @property
    def problem(self) -> str | None:
        """Why the service cannot take requests now (for /readyz); None when it can."""
        if self.status != "ready" or self.service is None:
            return STATUS[self.status]  # the load error itself (paths and all) is in the log only
        return self.service.problem()

    @property
    def serving(self) -> bool:
        return self.problem is None

    @property
    def code(self) -> str:
        """The error code /readyz answers: loading, draining, failed, or unhealthy."""
        return self.status if self.status != "ready" else "unhealthy"

    @property
    def live_problem(self) -> str | None:
        """Why the process should be restarted (for /livez): its step loop is dead, stuck or on a
        broken device. Loading, draining and a failed load are alive: they end by themselves."""
        return None if self.service is None else self.service.loop.problem()

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

    def snapshot(self) -> Snapshot:
        service = self.service
        return Snapshot(
            model=self.model_name,
            dtype=self.dtype,
            queue_capacity=self.queue_capacity,
            loop=service.stats() if service else None,
            devices=service.devices() if service else {},
            pool=service.pipeline.pool.stats() if service else {},
            load_seconds=self.load_seconds,
            threads=service.threads if service else None,
            ready=self.serving,
            last_step_at=service.loop.heartbeat.last_beat if service else None,
        )
