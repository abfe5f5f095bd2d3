"""Probes: /livez answers while the process runs (it touches no device); /readyz answers 200
once the model is loaded and until the server starts draining, 503 otherwise."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from server.api.deps import RuntimeDep
from server.api.errors import envelope

router = APIRouter(tags=["health"])


@router.get("/livez")
async def livez() -> dict[str, str]:
    return {"status": "alive"}


@router.get("/readyz", response_model=None)
async def readyz(runtime: RuntimeDep) -> dict[str, str] | JSONResponse:
    if not runtime.serving:
        return envelope(503, runtime.status_message(), code=runtime.status)
    return {"status": "ready", "model": runtime.model_name}
