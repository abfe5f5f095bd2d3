"""Probes. /livez answers 200 while the process can serve or will be able to (loading, draining,
a failed load all end by themselves) and 503 when its step loop is dead, stuck or on a broken
device, so Kubernetes restarts it. /readyz answers 200 once the model is loaded and healthy,
503 otherwise.

Both are answered on the API port and on the metrics port (api/metricsport.py), which is where
Kubernetes probes them: a client holding `--max-connections` idle sockets on the API port gets
new connections refused there, and a probe refused with them would get the pod restarted,
killing the requests in flight. The metrics port has no client traffic (the NetworkPolicy
admits only Prometheus; the kubelet's probes come from the node, which policies always admit).

Probe answers are public: they say what state the server is in (`code`: loading, draining,
failed, unhealthy) in fixed words; what went wrong in detail (a load error's text, with file
paths) is in the server log only.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from server.api.deps import RuntimeDep
from server.serving import Runtime

router = APIRouter(tags=["health"])
PROBES = ("/livez", "/readyz")
STARTING = "the server is starting: it plans the model's split, then loads it; retry shortly"


def probe(path: str, runtime: Runtime | None) -> tuple[int, dict[str, Any]]:
    """A probe's status and body; `runtime` is None while `serve` plans, before the app exists."""
    if path == "/livez":
        problem = runtime.live_problem if runtime is not None else None
        return (200, {"status": "alive"}) if problem is None else failed(problem, "unhealthy")
    if runtime is None:
        return failed(STARTING, "loading")
    if runtime.problem is not None:
        return failed(runtime.problem, runtime.code)
    return 200, {"status": "ready", "model": runtime.model_name}


def failed(message: str, code: str) -> tuple[int, dict[str, Any]]:
    """api/errors.py's envelope, as data (the metrics port is WSGI: no JSONResponse there)."""
    return 503, {"error": {"message": message, "type": "server_error", "param": None, "code": code}}


def _answer(path: str, runtime: Runtime) -> dict[str, Any] | JSONResponse:
    status, body = probe(path, runtime)
    return body if status == 200 else JSONResponse(body, status_code=status)


@router.get("/livez", response_model=None)
async def livez(runtime: RuntimeDep) -> dict[str, Any] | JSONResponse:
    return _answer("/livez", runtime)


@router.get("/readyz", response_model=None)
async def readyz(runtime: RuntimeDep) -> dict[str, Any] | JSONResponse:
    return _answer("/readyz", runtime)
