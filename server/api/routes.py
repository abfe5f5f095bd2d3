"""/v1: OpenAI's Images API, the model list, the shard and engine views. Routes stay thin:
checks live in schemas.py, generation in the engine loop (server/pipeline/batcher.py)."""

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
from server.pipeline.batcher import DeadlineExceeded, Draining, Job, Overloaded, StepFailed
from server.pipeline.denoise import RequestError
from server.pipeline.images import encode_png_async

router = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])


def _runtime(request: Request, *, admitting: bool = True) -> Any:
    """The runtime, once the model is loaded; `admitting`: and not draining either."""
    runtime = request.app.state.runtime
    if runtime.engine is None or (admitting and not runtime.serving):
        if runtime.status == "draining":
            request.app.state.metrics.http_rejections["draining"] += 1
        raise APIError(503, runtime.status_message(), code=runtime.status)
    return runtime


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body is read by now, so receive waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _outcome(job: Job, request: Request, engine: Any) -> list:
    """The job's images; a client that leaves first has its job cancelled at the next step."""
    result = asyncio.wrap_future(job.future)
    gone = asyncio.create_task(_client_gone(request))
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not result.done():
        engine.cancel(job)  # dropped at the next step boundary, its buffers returned
        result.add_done_callback(lambda f: f.cancelled() or f.exception())  # its end is nobody's news
        raise APIError(499, "the client disconnected", code="cancelled")  # uvicorn drops it: no one listens
    try:
        return result.result()
    except Draining as err:
        raise _draining(err) from None
    except DeadlineExceeded as err:
        timeout = request.app.state.runtime.settings.request_timeout_s
        raise APIError(504, f"{err}: {timeout:g} s (DIFFSHARD_REQUEST_TIMEOUT_S)", code="timeout") from None
    except StepFailed as err:
        if err.out_of_memory:  # retrying the same request would fail the same way
            raise APIError(503, str(err), code="out_of_memory", headers={"x-should-retry": "false"}) from None
        raise APIError(500, f"{err}; the server log has the details", code="generation_failed") from None


def _overloaded(err: Overloaded) -> APIError:
    return APIError(503, str(err), code="overloaded", headers={"retry-after": str(err.retry_after)})


def _draining(err: Draining) -> APIError:
    return APIError(503, str(err), code="draining")


def _pool_stats(pipeline: Any) -> dict[str, dict[str, Any]]:
    return {device: asdict(s) | {"hit_rate": s.hit_rate} for device, s in pipeline.pool.stats().items()}


@router.post("/images/generations", response_model=ImagesResponse)
async def generate_images(body: ImageGenerationRequest, request: Request) -> ImagesResponse:
    runtime = _runtime(request)
    settings, engine = runtime.settings, runtime.engine
    requests, size = generation_requests(body, settings, engine.pipeline.defaults, settings.served_name)
    try:
        job = engine.submit(requests, settings.request_timeout_s)
    except RequestError as err:
        raise APIError(400, str(err), param=err.field, code="invalid_value") from None
    except Overloaded as err:
        raise _overloaded(err) from None
    except Draining as err:
        raise _draining(err) from None
    images = await _outcome(job, request, engine)
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
    pipeline = _runtime(request, admitting=False).engine.pipeline
    shard, memory = pipeline.shard, pipeline.shard.memory()
    return {
        "plan": shard.plan.to_dict(),
        "devices": {
            device: {"blocks": list(shard.blocks_on(device)), "memory": asdict(memory[device])}
            for device in shard.devices
        },
        "pool": _pool_stats(pipeline),
        "text": str(shard),
    }


@router.get("/stats")
async def stats(request: Request) -> dict[str, Any]:
    """The engine's counters and each active request's progress, and the pool's per device."""
    engine = _runtime(request, admitting=False).engine
    return {"engine": engine.stats().to_dict(), "pool": _pool_stats(engine.pipeline)}
