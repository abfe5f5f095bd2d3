"""HTTP metrics: an ASGI middleware that counts and times every request by route template."""

from __future__ import annotations

import time
from collections import Counter

from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.metrics.collector import Metrics

# The `method` label's values: any other method a client sends counts as "other", so a client
# cannot mint a series per made-up method name.
METHODS = frozenset(("GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"))


class HttpMetrics:
    """ASGI middleware: count and time every HTTP request by route template (not raw path)."""

    def __init__(self, app: ASGIApp, metrics: Metrics, rejected: Counter) -> None:
        self.app = app
        self.metrics = metrics
        self.rejected = rejected  # refusals only HTTP sees: the runtime's, which /v1/stats shows too

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
            route = route_template(scope)  # bounded label values
            method = scope["method"] if scope["method"] in METHODS else "other"
            self.metrics.http_requests.labels(route, method, str(status)).inc()
            self.metrics.http_duration.labels(route).observe(time.perf_counter() - started)
            if status in (400, 413, 422):
                self.rejected["invalid"] += 1
            elif status == 401:
                self.rejected["unauthorized"] += 1


def route_template(scope: Scope) -> str:
    """The template of the route a request is for, also when it was answered before routing (a
    body refused for its size) or by a route FastAPI adds itself (/openapi.json); "unmatched" for
    paths no route takes, so clients cannot mint a label value per path."""
    route = scope.get("route")
    if route is None:
        partial = None
        for candidate in getattr(scope.get("app"), "routes", ()):
            match, _ = candidate.matches(scope)
            if match is Match.FULL:
                route = candidate
                break
            partial = partial or (candidate if match is Match.PARTIAL else None)  # another method
        route = route or partial
    return getattr(route, "path", "unmatched")
