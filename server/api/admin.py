"""/v1 routes an operator uses at runtime (admin keys only): LoRA adapters from --lora-dir and
ControlNets from --controlnet-dir loaded and unloaded between steps. A client names a file or
folder of the operator's, never a server path; one in use stays until its last request ends."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from server.api.auth import require_key
from server.api.deps import ServiceDep
from server.api.errors import APIError

router = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])


class AdapterLoad(BaseModel):
    """An adapter to serve from now on: a file of the server's --lora-dir, by its name there."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="what requests call it (`lora`); letters, digits, _ . -")
    file: str | None = Field(
        None, description="the .safetensors file in --lora-dir (default: NAME.safetensors)"
    )


class ControlNetLoad(BaseModel):
    """A ControlNet to serve from now on: a folder of the server's --controlnet-dir, by its name there."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="what requests call it (`control[].model`); letters, digits, _ . -")
    folder: str | None = Field(
        None, description="its folder in --controlnet-dir, diffusers' format (default: NAME)"
    )


ENVELOPE = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}


def _errors(what: str, source: str, setting: str) -> dict[int | str, dict[str, Any]]:
    return {
        400: {"description": f"a bad name or {source}, one that does not fit the model", "content": ENVELOPE},
        403: {"description": f"not an admin key; no admin keys or no {setting}", "content": ENVELOPE},
        404: {"description": f"no {what} of that name is served", "content": ENVELOPE},
        409: {"description": f"a {what} of that name is served (or unloading)", "content": ENVELOPE},
    }


ADAPTER_ERRORS = _errors("LoRA adapter", "file", "--lora-dir")
CONTROLNET_ERRORS = _errors("ControlNet", "folder", "--controlnet-dir")


def _admin(request: Request, what: str) -> None:
    """403 unless an admin key came. Without admin keys every caller would count as one
    (auth.py), so runtime changes stay off: a server with no keys is open to anyone on its
    network, and an adapter or a ControlNet, though code-free, changes every image its users get."""
    if not request.app.state.admin_keys:
        message = f"{what} change at runtime only on a server with admin keys (--admin-key-file)"
        raise APIError(403, message, code="permission_denied")
    if not request.state.admin:
        raise APIError(403, f"loading and unloading {what} takes an admin key", code="permission_denied")


def _admin_folder(request: Request, what: str, folder: Path | None, setting: str) -> Path:
    """The folder runtime `what` come from, for an admin; 403 otherwise."""
    _admin(request, what)
    if folder is None:
        message = f"{what} load at runtime from {setting} only, and this server has none"
        raise APIError(403, message, code="permission_denied")
    return folder


def _not_served(what: str, name: str) -> APIError:
    return APIError(404, f"no {what} named {name!r} is served (GET /v1/models)", code="not_found")


def _unloading(name: str, users: int) -> dict[str, Any]:
    return {"name": name, "status": "unloading" if users else "unloaded", "requests": users}


@router.post("/adapters", responses=ADAPTER_ERRORS)
async def load_adapter(body: AdapterLoad, request: Request, service: ServiceDep) -> dict[str, Any]:
    """Serve a LoRA file of --lora-dir from the next request on (admin keys only): it attaches
    between two steps, running requests unchanged. Answers what /v1/models lists for it."""
    settings = request.app.state.model_settings
    folder = _admin_folder(request, "adapters", settings.lora_dir, "--lora-dir")
    if service.attached.serves_adapter(body.name):
        raise APIError(409, f"an adapter named {body.name!r} is served (or still unloading)", code="conflict")
    file = body.file or f"{body.name}.safetensors"
    return await asyncio.to_thread(service.attached.load_adapter, body.name, file, folder)


@router.delete("/adapters/{name}", responses=ADAPTER_ERRORS)
async def unload_adapter(name: str, request: Request, service: ServiceDep) -> dict[str, Any]:
    """Stop serving an adapter (admin keys only): requests asking for it get 400 from now on;
    those running finish with it, and it is detached after the last (`status`: unloading until
    then, `requests` of them; unloaded when none used it)."""
    _admin(request, "adapters")
    try:
        users = await asyncio.to_thread(service.attached.unload_adapter, name)
    except KeyError:
        raise _not_served("adapter", name) from None
    return _unloading(name, users)


@router.post("/controlnets", responses=CONTROLNET_ERRORS)
async def load_controlnet(body: ControlNetLoad, request: Request, service: ServiceDep) -> dict[str, Any]:
    """Serve a ControlNet folder of --controlnet-dir from the next request on (admin keys only).
    Answers what /v1/models lists for it; its bytes are beside the plan's, not planned."""
    settings = request.app.state.model_settings
    folder = _admin_folder(request, "ControlNets", settings.controlnet_dir, "--controlnet-dir")
    if service.attached.serves_controlnet(body.name):
        message = f"a ControlNet named {body.name!r} is served (or still unloading)"
        raise APIError(409, message, code="conflict")
    load = service.attached.load_controlnet
    return await asyncio.to_thread(load, body.name, body.folder or body.name, folder)


@router.delete("/controlnets/{name}", responses=CONTROLNET_ERRORS)
async def unload_controlnet(name: str, request: Request, service: ServiceDep) -> dict[str, Any]:
    """Stop serving a ControlNet (admin keys only), as an adapter: new requests naming it get 400,
    those running finish with it, and it goes after the last."""
    _admin(request, "ControlNets")
    try:
        users = await asyncio.to_thread(service.attached.unload_controlnet, name)
    except KeyError:
        raise _not_served("ControlNet", name) from None
    return _unloading(name, users)
