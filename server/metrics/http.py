"""HTTP metrics: an ASGI middleware that counts and times every request by route template."""

from __future__ import annotations

import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.metrics.collector import Metrics

# The `method` label's values: any other method a client sends counts as "other", so a client
# cannot mint a series per made-up method name.
METHODS = frozenset(("GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"))


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
