"""What routes depend on, as FastAPI dependencies: the runtime, and the loaded service."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from server.serving import Runtime, Service


async def get_runtime(request: Request) -> Runtime:
    return request.app.state.runtime


async def loaded_service(runtime: Annotated[Runtime, Depends(get_runtime)]) -> Service:
    """The service once the model has loaded; 503 (NotReady) while it loads or if loading failed."""
    return runtime.loaded()


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]
ServiceDep = Annotated[Service, Depends(loaded_service)]
