"""The metrics port: Prometheus' /metrics and the probes /livez and /readyz, served by a small
threaded WSGI server of its own, apart from the API's connections (api/health.py says why the
probes are here). It listens from before planning, so a busy port fails the start at once.

It has no auth: it must stay inside the cluster (deploy/k8s's NetworkPolicy admits Prometheus
only; compose binds it to 127.0.0.1). /livez here also asks the API's event loop to answer: a
loop that is blocked would leave the API dead while this thread still answered.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http import HTTPStatus
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from server.api.health import PROBES, failed, probe
from server.serving import Runtime

LOOP_ANSWER_S = 2.0  # the API's event loop must run a no-op within this (kubelet's timeout: 5 s)
IDLE_CONNECTION_S = 10.0  # a connection that sends nothing is closed: it holds a thread
NOSNIFF = ("x-content-type-options", "nosniff")


@dataclass
class ProbeTarget:
    """What the probes read: filled in by `serve` once the app exists and uvicorn runs."""

    runtime: Runtime | None = None
    loop: asyncio.AbstractEventLoop | None = None

    def loop_problem(self) -> str | None:
        loop = self.loop
        if loop is None or loop.is_closed():
            return None
        answered = threading.Event()
        try:
            loop.call_soon_threadsafe(answered.set)
        except RuntimeError:  # the loop closed meanwhile: shutting down
            return None
        if not answered.wait(LOOP_ANSWER_S):
            return f"the API's event loop did not answer within {LOOP_ANSWER_S:g} s"
        return None


def metrics_port_app(registry: CollectorRegistry, target: ProbeTarget) -> Callable[..., Iterable[bytes]]:
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path not in PROBES:
            return metrics(environ, lambda s, h, e=None: start_response(s, [*h, NOSNIFF], e))
        status, body = probe(path, target.runtime)
        if path == "/livez" and status == 200 and (stuck := target.loop_problem()):
            status, body = failed(stuck, "unhealthy")
        data = json.dumps(body).encode()
        headers = [("content-type", "application/json"), ("content-length", str(len(data))), NOSNIFF]
        start_response(f"{status} {HTTPStatus(status).phrase}", [*headers, ("cache-control", "no-store")])
        return [] if environ.get("REQUEST_METHOD") == "HEAD" else [data]

    return app


class _Quiet(WSGIRequestHandler):
    timeout = IDLE_CONNECTION_S
    server_version, sys_version = "diffshard", ""  # no Python version in the Server header

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape every few seconds: no access line


def start_metrics_port(host: str, port: int, registry: CollectorRegistry, target: ProbeTarget) -> WSGIServer:
    """The server, serving in a daemon thread; OSError if the port cannot be bound."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True  # a scrape in flight never holds the process at exit
        address_family = family

    server = make_server(host, port, metrics_port_app(registry, target), Server, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="diffshard-metrics", daemon=True).start()
    return server
