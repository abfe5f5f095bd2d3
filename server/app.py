"""The FastAPI application: `create_app(settings)` wires routes and error handlers; its lifespan
loads the model in a worker thread, so /livez answers and /readyz says 503 while weights load.

Nothing is built at import time: `python -m server serve` validates the settings, plans the
split on the meta device (a plan that cannot fit fails before any weight loads), then runs
this app under uvicorn.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, start_http_server

from server import __version__
from server.api import health, routes
from server.api.errors import install_error_handlers
from server.api.limits import BodyLimit
from server.config import Settings, read_api_keys
from server.engine.memory import retain_freed_host_memory
from server.metrics import HttpMetrics, Metrics
from server.pipeline.batcher import Engine
from server.pipeline.denoise import Pipeline

log = logging.getLogger("diffshard")

STATUS = {
    "loading": "the model is loading; retry shortly",
    "ready": "ready",
    "draining": "the server is shutting down",
    "failed": "the model failed to load",
}


@dataclass
class Runtime:
    """What the routes read: settings, keys and, once loaded, the engine that owns the pipeline."""

    settings: Settings
    api_keys: frozenset[str] | None
    engine: Engine | None = None
    status: str = "loading"  # loading → ready → draining, or loading → failed
    error: str | None = None
    load_seconds: float | None = None
    started: int = field(default_factory=lambda: int(time.time()))
    on_fatal: Callable[[], None] | None = None  # `serve` sets it: stop the server

    @property
    def serving(self) -> bool:
        """Loaded, not draining, and the engine loop alive."""
        if self.status == "ready" and self.engine is not None and not self.engine.alive:
            self.status, self.error = "failed", "the engine loop stopped; the server log says why"
        return self.status == "ready"

    def status_message(self) -> str:
        return STATUS[self.status] + (f": {self.error}" if self.error else "")

    def drain(self, timeout_s: float) -> bool:
        """Stop admitting (readyz and new requests say 503); wait for in-flight requests to end."""
        if self.status == "ready":
            self.status = "draining"
        if self.engine is None:
            return True
        self.engine.stop_admitting()
        return self.engine.wait_idle(timeout_s)


def load_engine(settings: Settings) -> Engine:
    retain_freed_host_memory()
    pipeline = Pipeline.load(
        settings.model,
        devices=settings.devices,
        strategy=settings.strategy,
        dtype=settings.torch_dtype,
        max_memory=settings.max_memory,
    )
    return Engine(
        pipeline,
        max_queue=settings.max_queue,
        max_batch=settings.max_batch,
        inject_faults=settings.inject_faults,
    )


async def _load(runtime: Runtime) -> None:
    started = time.perf_counter()
    try:
        engine = await asyncio.to_thread(load_engine, runtime.settings)
    except Exception as err:
        runtime.status, runtime.error = "failed", f"{type(err).__name__}: {err}"
        log.error("cannot serve %s: %s", runtime.settings.model, runtime.error)
        if runtime.on_fatal is not None:
            runtime.on_fatal()
        return
    runtime.engine, runtime.load_seconds = engine, time.perf_counter() - started
    if runtime.status == "loading":  # not draining already
        runtime.status = "ready"
    log.info(
        "ready: %s loaded in %.1f s\n%s",
        runtime.settings.served_name,
        runtime.load_seconds,
        engine.pipeline.shard,
    )


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    runtime: Runtime = app.state.runtime
    settings = runtime.settings
    exporter = None
    if settings.metrics_port:  # Prometheus scrapes its own port, apart from the API
        try:
            exporter, _ = start_http_server(settings.metrics_port, settings.host, app.state.metrics.registry)
        except OSError as err:
            log.error("cannot serve metrics on port %d: %s (set --metrics-port)", settings.metrics_port, err)
            raise
        log.info("metrics on http://%s:%d/metrics", settings.host, settings.metrics_port)
    loading = asyncio.create_task(_load(runtime))
    try:
        yield
    finally:
        if exporter is not None:
            exporter.shutdown()
        runtime.status = "draining" if runtime.status != "failed" else runtime.status
        await asyncio.shield(loading)  # a load in flight cannot be interrupted; let it end
        if runtime.engine is not None:
            await asyncio.to_thread(runtime.engine.close)


def create_app(settings: Settings, registry: CollectorRegistry | None = None) -> FastAPI:
    """The app; its metrics go on `registry` (a fresh one by default), served on the metrics port."""
    keys = read_api_keys(settings.api_key_file) if settings.api_key_file else None
    app = FastAPI(title="diffshard", version=__version__, lifespan=lifespan)
    app.state.runtime = runtime = Runtime(settings, keys)
    app.state.metrics = metrics = Metrics(registry or CollectorRegistry(), runtime)
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(routes.router)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(HttpMetrics, metrics=metrics)  # outermost: it sees the 413s too
    return app
