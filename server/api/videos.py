"""/v1/videos: OpenAI's Videos API, asynchronous: POST makes a job (queued), GET polls it
(`in_progress` with `progress`, then `completed` or `failed`), `/content` downloads what it made
(`video`: H.264 MP4; `thumbnail`, `spritesheet`: PNG; `frames`: its frames as PNGs in a ZIP, a
lossless variant of ours), `/events` streams its progress (server-sent events), GET lists them
(paged), DELETE removes one. Jobs live in the job store (`serving/videostore.py`): they survive a
restart, any replica sharing the store answers them, and a key sees only its own."""

from __future__ import annotations

import asyncio
import io
import math
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, replace
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, Response, StreamingResponse
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from server.api.auth import require_key
from server.api.deps import ServiceDep
from server.api.editing import form_fields
from server.api.errors import APIError
from server.api.multipart import FormLimits, read_form
from server.api.schemas import MAX_GUIDANCE, RANDOM_SEED, SEED_LIMIT, checked_lora, parse_size
from server.api.streaming import KEEPALIVE, stamped
from server.api.uploads import read_image
from server.errors import InvalidRequest, KeyOverloaded, NotReady, Overloaded
from server.requests import GenerationRequest, frames_for, parse_step_cache, seconds_of
from server.requests.guidance import parse_guidance
from server.serving import Service
from server.serving.videos import VARIANTS, VideoRunner, new_job_id
from server.serving.videostore import Content, VideoJob

router = APIRouter(prefix="/v1", dependencies=[Depends(require_key)], tags=["videos"])
MAX_LIST = 100
RETRY_AFTER_S = 10  # a video takes a while: come back then
MAX_FORM_BYTES, MAX_FORM_FIELDS = 65536, 32  # a form's text fields, as a JSON body's limit
EVENT_POLL_S = (0.05, 1.0)  # the progress stream's store polls: first, and the most between two


class VideoCreateRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    prompt: str
    model: str | None = None
    seconds: str | int | None = Field(None, description="the clip's length; num_frames overrides it")
    size: str | None = Field(None, description='"WIDTHxHEIGHT"; default: the native size')
    input_reference: object = Field(
        None, description="image-to-video models: the first frame, a PNG, JPEG or WebP file (multipart)"
    )
    negative_prompt: str | None = None
    seed: int | None = Field(None, description=f"0 to {SEED_LIMIT - 1}; -1 or none: a random one")
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    guidance_scale_2: float | None = Field(
        None, description="two experts (Wan 2.2 A14B): the low-noise expert's scale; default guidance_scale"
    )
    num_frames: int | None = Field(None, description="the clip's frames (1 + a multiple of 4 for Wan)")
    step_cache: object = Field(None, description='"off", "first_block" or its JSON object')
    lora: dict[str, float] | None = Field(
        None, description="LoRA adapters (GET /v1/models lists them) and their scales, as for images"
    )
    guidance: object = Field(
        None,
        description="a model that makes sound (LTX-2): its other scales, an object of audio_scale, "
        "stg_scale, audio_stg_scale, modality_scale, audio_modality_scale, rescale, audio_rescale "
        "and stg_blocks; each unset one the pipeline's default",
    )


def runner_of(request: Request) -> VideoRunner:
    runner = getattr(request.app.state, "videos", None)
    if runner is not None:
        return runner
    runtime = request.app.state.runtime
    if request.app.state.makes_videos and runtime.service is None:  # a video model, not loaded (yet)
        raise NotReady(runtime.status, runtime.status_message())  # 503: pollers try again
    raise APIError(404, "this server's model makes images: /v1/videos serves video models", code="not_found")


RunnerDep = Annotated[VideoRunner, Depends(runner_of)]


def video_request(body: VideoCreateRequest, service: Service, fps: int) -> tuple[GenerationRequest, str]:
    """The generation a body asks for, and its length in seconds as the Video object says it."""
    reference = body.input_reference  # decoded by video_body; anything else is refused here
    if reference is not None and not isinstance(reference, Image.Image):
        raise InvalidRequest(
            "input_reference",
            "must be an image file (PNG, JPEG or WebP) sent as a multipart upload, "
            "as OpenAI's SDK sends a file; image_url and file_id references are not served",
        )
    if body.model is not None and body.model != service.name:
        raise InvalidRequest("model", f"this server serves {service.name!r}, not {body.model!r}")
    frames = body.num_frames
    if frames is None and body.seconds is not None:
        frames = frames_for(body.seconds, fps)
    if frames is None:
        assert service.clip is not None  # a video model: runner_of found its runner
        frames = service.clip.frames
    for name in ("guidance_scale", "guidance_scale_2"):
        scale = getattr(body, name)
        if scale is not None and not (math.isfinite(scale) and 0 <= scale <= MAX_GUIDANCE):
            raise InvalidRequest(name, f"must be between 0 and {MAX_GUIDANCE:g}, got {scale}")
    if body.seed is not None and not RANDOM_SEED <= body.seed < SEED_LIMIT:
        raise InvalidRequest("seed", f"must be between 0 and {SEED_LIMIT - 1}, or -1, got {body.seed}")
    width, height = parse_size(body.size) if body.size is not None else (None, None)
    request = GenerationRequest(
        body.prompt,
        negative_prompt=body.negative_prompt,
        seed=secrets.randbelow(SEED_LIMIT) if body.seed in (None, RANDOM_SEED) else body.seed,
        steps=body.num_inference_steps,
        guidance_scale=body.guidance_scale,
        guidance_scale_2=body.guidance_scale_2,
        width=width,
        height=height,
        frames=frames,
        step_cache=None if body.step_cache is None else parse_step_cache(body.step_cache),
        lora=checked_lora(body.lora),
        reference=reference,
        fps=fps,
        guidance=None if body.guidance is None else parse_guidance(body.guidance),
    )
    return request, seconds_of(frames, fps)


def stored(request: GenerationRequest) -> dict[str, Any]:
    """A resolved request as the store keeps it in the job's record (JSON); its reference image
    is kept beside it (`reference_png`)."""
    values = asdict(replace(request, reference=None))  # not deep-copied: stored as a PNG
    values.pop("edit", None)
    return values


def reference_png(request: GenerationRequest) -> bytes | None:
    """The first frame as the PNG the store keeps (bounded: as the upload limits bound what was
    decoded). Seconds for a large image: off the event loop."""
    if request.reference is None:
        return None
    png = io.BytesIO()
    request.reference.save(png, format="PNG")
    return png.getvalue()


def own_job(runner: VideoRunner, request: Request, video_id: str) -> VideoJob:
    """The job, if it exists and is the caller's (another key's is as unknown as a missing one)."""
    job = runner.store.get(video_id)
    owner = request.state.owner
    if job is None or (owner is not None and not request.state.admin and job.owner != owner):
        raise APIError(
            404, f"no video {video_id!r} (it expired, was deleted, or is not yours)", code="not_found"
        )
    return job


async def video_body(request: Request) -> VideoCreateRequest:
    """The body as JSON, or (as OpenAI's SDK sends it) a multipart form of text fields and an
    `input_reference` file: the first frame, bounded and decoded as an edit's image is."""
    content_type = request.headers.get("content-type", "")
    try:
        if content_type.startswith("multipart/form-data"):
            bounds = request.app.state.runtime.loaded().limits
            limits = FormLimits(
                bounds.max_image_bytes, ((("input_reference",), 1, None),), MAX_FORM_BYTES, MAX_FORM_FIELDS
            )
            form = await read_form(request, limits)
            body = VideoCreateRequest.model_validate(form_fields(form.fields), strict=False)
            if upload := form.files.get("input_reference"):
                size = {"max_bytes": bounds.max_image_bytes, "max_pixels": bounds.max_image_pixels}
                image = await asyncio.to_thread(read_image, upload[0], "input_reference", **size)
                body.input_reference = image.convert("RGB")
            return body
        return VideoCreateRequest.model_validate_json(await request.body())
    except ValidationError as err:
        request.state.body_fields = VideoCreateRequest.model_fields  # "did you mean" among these
        raise RequestValidationError(err.errors()) from None


@router.post(
    "/videos",
    openapi_extra={
        "requestBody": {
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/VideoCreateRequest"}}},
            "required": True,
        }
    },
)
async def create_video(request: Request, service: ServiceDep, runner: RunnerDep) -> dict:
    body = await video_body(request)
    generation, seconds = video_request(body, service, runner.fps)
    try:
        (resolved,) = service.checked([generation])  # 400s now, not at the job's turn
    except InvalidRequest as err:
        if err.field != "num_frames" or body.num_frames is not None or body.seconds is None:
            raise
        asked = f"{body.seconds} s is {generation.frames} frames at {runner.fps} fps (--video-fps): "
        raise InvalidRequest("seconds", asked + err.message, err.limit) from None
    limits, owner = request.app.state.limit_settings, request.state.owner or ""
    job = VideoJob(
        new_job_id(),
        owner,
        service.name,
        body.prompt,
        f"{resolved.width}x{resolved.height}",
        seconds,
        stored(resolved),
        int(time.time()),
    )
    # one key's share of the line, and the line: counted with the add, in one step
    reference = await asyncio.to_thread(reference_png, resolved)
    refused = await runner.ask(runner.add, job, limits.key_queue_limit, limits.max_queue, reference)
    if refused == "owner":
        raise KeyOverloaded(RETRY_AFTER_S, limits.key_queue_limit)
    if refused is not None:
        raise Overloaded(RETRY_AFTER_S)
    return job.public()


@router.get("/videos/{video_id}")
async def retrieve_video(video_id: str, request: Request, runner: RunnerDep) -> dict:
    return (await runner.ask(own_job, runner, request, video_id)).public()


@router.get("/videos/{video_id}/content", response_model=None)
async def video_content(
    video_id: str,
    request: Request,
    runner: RunnerDep,
    variant: Literal["video", "thumbnail", "spritesheet", "frames", "audio"] = "video",
) -> Response:
    job = await runner.ask(own_job, runner, request, video_id)
    if job.status != "completed":
        raise APIError(
            409,
            f"video {video_id!r} is {job.status}: its content comes once it is completed",
            code="video_not_ready",
        )
    name, media = VARIANTS[variant]
    content = await runner.ask(runner.store.content, job.id, name)
    if content is None:
        gone = "; its model makes none" if variant == "audio" else " any more"
        raise APIError(404, f"video {video_id!r} has no {variant}{gone}", code="not_found")
    if isinstance(content, Path):
        return FileResponse(content, media_type=media, filename=f"{job.id}-{name}")
    headers = {
        "Content-Disposition": f'attachment; filename="{job.id}-{name}"',
        "Content-Length": str(content.size),
    }
    return StreamingResponse(pieces_of(runner, content), media_type=media, headers=headers)


async def pieces_of(runner: VideoRunner, content: Content) -> AsyncIterator[bytes]:
    """A file from the store a piece at a time: a download holds one piece, not the file (each
    sent before the next is read: uvicorn waits while the client's socket is full)."""
    pieces = content.pieces()
    while (piece := await runner.ask(next, pieces, None)) is not None:
        yield piece


@router.get("/videos/{video_id}/events", response_class=StreamingResponse)
async def video_progress_events(video_id: str, request: Request, runner: RunnerDep) -> StreamingResponse:
    """The job's progress as server-sent events, read from the job store (so any replica can
    answer): `diffshard.progress` at each change (status, step of steps), then `video.completed`
    or `video.failed` with the Video object."""
    job = await runner.ask(own_job, runner, request, video_id)
    keepalive_s = request.app.state.server_settings.sse_keepalive_s
    return StreamingResponse(
        video_events(runner, job, request, keepalive_s),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def video_events(
    runner: VideoRunner, job: VideoJob, request: Request, keepalive_s: float
) -> AsyncIterator[str]:
    """Polls the store: every 50 ms while the job moves, backing off to 1 s while it does not."""
    said, wait, quiet = None, EVENT_POLL_S[0], 0.0
    while True:
        status = "running" if job.status == "in_progress" else job.status
        now = {
            "video_id": job.id,
            "status": status,
            "progress": job.progress,
            "step": job.step,
            "steps": job.steps,
        }
        if job.finished:
            yield stamped(f"video.{job.status}", job.public())
            return
        if now != said:
            said, wait, quiet = now, EVENT_POLL_S[0], 0.0
            yield stamped("diffshard.progress", now)
        elif quiet >= keepalive_s:
            quiet = 0.0
            yield KEEPALIVE
        await asyncio.sleep(wait)  # the store has no push: a poll, backing off while nothing moves
        quiet, wait = quiet + wait, min(EVENT_POLL_S[1], wait * 2)
        if await request.is_disconnected():
            return
        fresh = await runner.ask(runner.store.get, job.id)
        if fresh is None:
            gone = {
                "message": f"video {job.id!r} was deleted",
                "type": "invalid_request_error",
                "param": None,
                "code": "not_found",
            }
            yield stamped("error", {"error": gone})
            return
        job = fresh


@router.get("/videos")
async def list_videos(
    request: Request,
    runner: RunnerDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIST)] = 20,
    order: Literal["asc", "desc"] = "desc",
) -> dict:
    owner = None if request.state.admin else request.state.owner
    jobs, more = await runner.ask(runner.store.page, owner, after, limit, order)
    data = [job.public() for job in jobs]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": more}


@router.post("/videos/{video_id}/cancel")
async def cancel_video(video_id: str, request: Request, runner: RunnerDep) -> dict:
    """A queued job never starts; a running one leaves its batch at the next step, on whichever
    replica runs it. Either ends `failed`, its error's code `cancelled`, kept until it expires
    (pollers learn why it ended). A finished job is answered as it is."""
    job = await runner.ask(own_job, runner, request, video_id)
    if not job.finished:
        job = await runner.ask(runner.cancel, job.id) or job
    return job.public()


@router.delete("/videos/{video_id}")
async def delete_video(video_id: str, request: Request, runner: RunnerDep) -> dict:
    """A finished job and its content, deleted. An unfinished one is cancelled instead (as by
    `POST /v1/videos/{id}/cancel`) and kept, failed, until it expires: `deleted: false` says so,
    and a second DELETE deletes it."""
    job = await runner.ask(own_job, runner, request, video_id)
    if not job.finished:
        await runner.ask(runner.cancel, job.id)
        return {"id": job.id, "object": "video.deleted", "deleted": False}
    await runner.ask(runner.store.delete, job.id)
    return {"id": job.id, "object": "video.deleted", "deleted": True}
