"""/v1: OpenAI's Images API, the model list, and the shard view. Routes stay thin: checks
live in schemas.py, generation in the pipeline's worker thread."""

from __future__ import annotations

import asyncio
import base64
import time
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Depends, Request

from server.api.auth import require_key
from server.api.errors import APIError
from server.api.schemas import ImageData, ImageGenerationRequest, ImagesResponse, generation_requests
from server.pipeline.images import encode_png_async

router = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])


def _runtime(request: Request) -> Any:
    runtime = request.app.state.runtime
    if runtime.status != "ready":
        raise APIError(503, runtime.status_message(), code=runtime.status)
    return runtime


@router.post("/images/generations", response_model=ImagesResponse)
async def generate_images(body: ImageGenerationRequest, request: Request) -> ImagesResponse:
    runtime = _runtime(request)
    settings, defaults = runtime.settings, runtime.worker.pipeline.defaults
    requests, size = generation_requests(body, settings, defaults, settings.served_name)
    images = await runtime.worker.generate(requests)
    pngs = await asyncio.gather(*(encode_png_async(image) for image in images))
    return ImagesResponse(
        created=int(time.time()),
        data=[
            ImageData(b64_json=base64.b64encode(png).decode(), revised_prompt=body.prompt, seed=r.seed)
            for r, png in zip(requests, pngs, strict=True)
        ],
        size=size,
    )


@router.get("/models")
async def models(request: Request) -> dict[str, Any]:
    runtime = request.app.state.runtime
    return {
        "object": "list",
        "data": [
            {
                "id": runtime.settings.served_name,
                "object": "model",
                "created": runtime.started,
                "owned_by": "diffshard",
            }
        ],
    }


@router.get("/shards")
async def shards(request: Request) -> dict[str, Any]:
    """The plan, each device's blocks and live memory: where every block and byte is."""
    pipeline = _runtime(request).worker.pipeline
    shard, memory, pool = pipeline.shard, pipeline.shard.memory(), pipeline.pool.stats()
    return {
        "plan": shard.plan.to_dict(),
        "devices": {
            device: {"blocks": list(shard.blocks_on(device)), "memory": asdict(memory[device])}
            for device in shard.devices
        },
        "pool": {device: asdict(stats) | {"hit_rate": stats.hit_rate} for device, stats in pool.items()},
        "text": str(shard),
    }
