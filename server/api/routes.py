"""/v1: OpenAI's Images API, the model list, the shard and step-loop views (admin.py: what an
operator loads and unloads at runtime). Routes stay thin: the wire format is schemas.py's, checks
and generation the serving layer's, errors errors.py's."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import StreamingResponse

from server.api.auth import require_key
from server.api.deps import RuntimeDep, ServiceDep
from server.api.editing import read_edit_form
from server.api.errors import APIError
from server.api.schemas import (
    Background,
    ImageGenerationRequest,
    ImagesResponse,
    generation_requests,
    image_background,
    images_response,
    quality_of,
    read_controls,
)
from server.api.streaming import EVENTS, Feed, image_events
from server.media.images import encode_async
from server.serving import Job, Service

router = APIRouter(prefix="/v1", dependencies=[Depends(require_key)])
WARNING_HEADER = "x-diffshard-warning"  # e.g. a size the model was not trained at: said, not refused


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body is read by now, so receive waits for that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _outcome(job: Job, request: Request, service: Service) -> list:
    """The job's images (or its Rejected error); a client that leaves first has its job
    cancelled at the next step."""
    result = asyncio.wrap_future(job.future)
    gone = asyncio.create_task(_client_gone(request))
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not result.done():
        service.cancel(job)  # dropped at the next step boundary, its buffers returned
        result.add_done_callback(lambda f: f.cancelled() or f.exception())  # its end is nobody's news
        raise APIError(499, "the client disconnected", code="cancelled")  # uvicorn drops it: no one listens
    return result.result()


STREAMED = {
    200: {
        "description": "the images; with `stream: true`, server-sent events: partial images (and, with "
        "`stream_progress`, diffshard.progress), then each image",
        "content": {
            "text/event-stream": {
                "schema": {  # one event: its kind, and a JSON object as its data
                    "type": "object",
                    "required": ["event", "data"],
                    "properties": {"event": {"enum": list(EVENTS)}, "data": {"type": "string"}},
                }
            }
        },
    }
}


@router.post("/images/generations", response_model=ImagesResponse, responses=STREAMED)
async def generate_images(
    body: ImageGenerationRequest, request: Request, response: Response, service: ServiceDep
) -> ImagesResponse | StreamingResponse:
    controls = read_controls(body.control, service.limits)
    requests = generation_requests(body, service.name, service.limits.max_n, controls=controls)
    return await _answer(body, requests, request, response, service, "image_generation")


@router.post("/images/edits", response_model=ImagesResponse, responses=STREAMED)
async def edit_images(
    request: Request, response: Response, service: ServiceDep
) -> ImagesResponse | StreamingResponse:
    """OpenAI's image edits: `image` (or several, `image[]`) and an optional `mask` whose fully
    transparent pixels mark what to repaint, as multipart/form-data; img2img without a mask.
    `control` (JSON text) steers the edit as it steers a generation."""
    together, alpha = service.edits_by_reference, service.alpha
    body, edits = await read_edit_form(request, service.limits, together=together, alpha=alpha)
    controls = read_controls(body.control, service.limits)
    requests = generation_requests(body, service.name, service.limits.max_n, edits, controls)
    return await _answer(body, requests, request, response, service, "image_edit")


async def _answer(
    body: ImageGenerationRequest,
    requests: list,
    request: Request,
    response: Response,
    service: Service,
    kind: str,
) -> ImagesResponse | StreamingResponse:
    request_id = request.state.request_id  # one id in every log line
    background = image_background(body, service.alpha)  # checked against the model before any work
    if body.stream:
        return _stream(body, requests, background, request, service, kind)
    job = service.submit(requests, request_id=request_id, owner=request.state.owner, priority=body.priority)
    if job.warning is not None:
        response.headers[WARNING_HEADER] = job.warning
    images = await _outcome(job, request, service)
    opaque = background == "opaque"  # an RGBA image over white
    encoded = await asyncio.gather(
        *(encode_async(image, body.output_format, body.output_compression, opaque) for image in images)
    )
    return images_response(body, job.requests, encoded, service.recommended_steps, background)


def _stream(
    body: ImageGenerationRequest,
    requests: list,
    background: Background,
    request: Request,
    service: Service,
    kind: str,
) -> StreamingResponse:
    """Server-sent events (streaming.py); refusals (limits, a full queue) answer before it starts."""
    feed, request_id = Feed(), request.state.request_id
    on_progress = feed.on_progress if body.stream_progress else None
    job = service.submit(
        requests,
        request_id=request_id,
        on_partial=feed.on_partial,
        on_progress=on_progress,
        owner=request.state.owner,
        priority=body.priority,
    )
    keepalive_s = request.app.state.server_settings.sse_keepalive_s
    first = job.requests[0]
    fields = {
        "size": first.output_size,
        "quality": quality_of(first.steps, service.recommended_steps),
        "background": background,  # image_events composites partial and finished images by it
        "output_format": body.output_format,
    }

    async def events():
        try:
            source = image_events(
                job,
                feed,
                fields,
                body.output_compression,
                request_id,
                with_progress=body.stream_progress,
                keepalive_s=keepalive_s,
                kind=kind,
            )
            async with contextlib.aclosing(source):  # its tasks end with the stream, not at collection
                async for event in source:
                    yield event
        finally:  # the client went away (or the stream ended): a job still running is dropped
            if not job.future.done():
                service.cancel(job)

    headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}  # no proxy may hold events back
    if job.warning is not None:
        headers[WARNING_HEADER] = job.warning
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


@router.get("/models")
async def models(request: Request, runtime: RuntimeDep) -> dict[str, Any]:
    """The model served, with the LoRA adapters a request may ask for (`lora`, an extension)."""
    videos = getattr(request.app.state, "videos", None)
    clips = None  # a video model's (/v1/videos): its default frames, their step, the MP4's rate
    if videos is not None:
        clip, pipeline = videos.service.clip, videos.service.pipeline
        width, height = pipeline.defaults.video_size or (pipeline.defaults.size,) * 2
        clips = {
            "num_frames": clip.frames,
            "frame_multiple": clip.frame_multiple,
            "fps": videos.fps,
            "size": f"{width}x{height}",
            "sound": bool(pipeline.family.sound_parts),  # its MP4 has an audio track (LTX-2)
        }
    model: dict[str, Any] = {
        "id": runtime.model_name,
        "object": "model",
        "created": runtime.started,
        "owned_by": "diffshard",
        "dtype": runtime.dtype,  # extensions: the weights served
        "quantization": runtime.quantization,
        # the compiled path (--compile): what auto picked, and whether its graphs are ready yet
        "compile": {"mode": runtime.compiling.mode, "state": runtime.compiling.state}
        if runtime.compiling is not None
        else None,
        "adapters": runtime.service.attached.adapters() if runtime.service else [],
        "controlnets": runtime.service.attached.controlnets() if runtime.service else [],
        # the words a closed vocabulary knows (the built-in model's), null for a real tokenizer
        "vocabulary": runtime.service.vocabulary() if runtime.service else None,
        "video": clips,  # null: the model makes images only
        # what a request naming none gets (--default-steps, --default-guidance; else the model's)
        "defaults": runtime.service.defaults() if runtime.service else None,
        "family": runtime.service.family() if runtime.service else None,
    }
    return {"object": "list", "data": [model]}


@router.get("/shards")
async def shards(service: ServiceDep) -> dict[str, Any]:
    """The plan, each device's blocks and live memory: where every block and byte is."""
    return service.shards()


@router.get("/stats")
async def stats(request: Request, runtime: RuntimeDep) -> dict[str, Any]:
    """The step loop's counters and the progress of the caller's running requests (an admin key,
    or any caller without keys: everyone's), the pool's per device, the compiled graphs
    (while loading: only their progress), and the attention backend and dtype chosen at startup
    (with `--dtype auto` on a CPU, the model's ops timed in both dtypes)."""
    compiled = runtime.compiling.view() if runtime.compiling is not None else None
    if runtime.service is None and runtime.status == "loading":
        return {"status": "loading", "compile": compiled}
    service = runtime.loaded()
    viewer = None if request.state.admin else request.state.owner
    engine = service.stats().seen_by(viewer).to_dict() | {"rejected": runtime.rejected()}
    return {
        "engine": engine,
        "pool": service.pool(),
        "threads": service.threads,
        "compile": compiled,
        "attention": service.attention,
        "dtype": runtime.dtype_choice,
    }
