"""HTTP metrics: an ASGI middleware that counts and times every request by route template."""

from __future__ import annotations

import time
from collections import Counter

from starlette.routing import Match, Route
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
    """The template of the route a request is for. FastAPI names only its own routes in the scope:
    the routes it adds as Starlette's (/openapi.json) are matched here, and a request answered
    before routing (a body refused for its size or pace) takes the documented path it asked for
    (the API's routes take no path parameters). "unmatched" for any other path, so clients
    cannot mint a label value per path."""
    route = scope.get("route")
    if route is not None:
        return route.path
    app = scope.get("app")
    for candidate in getattr(app, "routes", ()):
        if isinstance(candidate, Route) and candidate.matches(scope)[0] is not Match.NONE:
            return candidate.path
    paths = app.openapi().get("paths", {}) if hasattr(app, "openapi") else {}  # built once, cached
    return scope["path"] if scope["path"] in paths else "unmatched"
