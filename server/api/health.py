"""Probes. /livez answers 200 while the process can serve or will be able to (loading, draining,
a failed load all end by themselves) and 503 when its step loop is dead, stuck or on a broken
device, so Kubernetes restarts it. /readyz answers 200 once the model is loaded and healthy,
503 otherwise. Neither answers before the port listens: `serve` plans first (seconds, on the meta
device) and connections are refused until then, which the startup probe (on /readyz) allows for.

Probe answers are public: they say what state the server is in (`code`: loading, draining,
failed, unhealthy) in fixed words; what went wrong in detail (a load error's text, with file
paths) is in the server log only.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from server.api.deps import RuntimeDep
from server.api.errors import envelope

router = APIRouter(tags=["health"])


@router.get("/livez", response_model=None)
async def livez(runtime: RuntimeDep) -> dict[str, str] | JSONResponse:
    problem = runtime.live_problem
    if problem is not None:
        return envelope(503, problem, code="unhealthy")
    return {"status": "alive"}


@router.get("/readyz", response_model=None)
async def readyz(runtime: RuntimeDep) -> dict[str, str] | JSONResponse:
    problem = runtime.problem
    if problem is not None:
        return envelope(503, problem, code=runtime.code)
    return {"status": "ready", "model": runtime.model_name}
