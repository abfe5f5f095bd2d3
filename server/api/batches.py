"""/v1/batches: OpenAI's Batch API over the Images API. POST makes a batch of a `/v1/files` input
(in progress at once: its lines were checked at upload), GET polls it (`request_counts`), cancel
stops it (queued lines never start, running ones are cancelled; what completed is its output),
GET lists them (paged). The lines run at background priority on whichever replica sharing the job
store takes them (`serving/batches.py`); each line's result is the answer its endpoint would have
given: `translate` and `refusal` below are that endpoint's own checks, and its errors' envelope.

A line of `/v1/images/edits` is JSON, as OpenAI's JSON form of an edit: `images` a list of
{"image_url": "data:image/png;base64,..."} and `mask` one, decoded within the upload bounds."""

from __future__ import annotations

import base64
import binascii
import json
import logging
import math
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from server.api.auth import require_key
from server.api.editing import check_fidelity, edits_of
from server.api.errors import APIError, domain_response, envelope, internal_message, validation_message
from server.api.files import ENDPOINTS, RunnerDep, batch_lines, not_found, own_file
from server.api.schemas import (
    ImageEditRequest,
    ImageGenerationRequest,
    generation_requests,
    image_background,
    images_response,
    read_controls,
)
from server.api.uploads import DATA_URL, MASK_FORMATS, mask_to_repaint, read_image
from server.errors import DiffshardError, InvalidRequest
from server.media.images import encode
from server.requests import GenerationRequest
from server.serving import Service
from server.serving.batches import BatchRunner, Respond
from server.serving.batchstore import Batch, new_id
from server.serving.videostore import read_whole

log = logging.getLogger("diffshard")
router = APIRouter(prefix="/v1", dependencies=[Depends(require_key)], tags=["batches"])
WINDOWS = ("24h",)  # OpenAI's one completion window
MAX_LIST = 100
MAX_METADATA = (16, 64, 512)  # OpenAI's: pairs, a key's characters, a value's


class OutputExpiry(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    anchor: str
    seconds: int


class BatchCreateRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    input_file_id: str
    endpoint: str = Field(description=" or ".join(ENDPOINTS))
    completion_window: str = Field(description="24h (its length here: DIFFSHARD_BATCH_WINDOW_S)")
    metadata: dict[str, str] | None = None
    output_expires_after: OutputExpiry | None = None


def own_batch(runner: BatchRunner, request: Request, batch_id: str) -> Batch:
    batch = runner.store.get_batch(batch_id)
    owner = request.state.owner
    if batch is None or (owner is not None and not request.state.admin and batch.owner != owner):
        raise not_found("batch", batch_id)
    return batch


def check_create(body: BatchCreateRequest) -> None:
    if body.completion_window not in WINDOWS:
        raise InvalidRequest("completion_window", f"must be 24h, got {body.completion_window!r}")
    if body.endpoint not in ENDPOINTS:
        raise InvalidRequest("endpoint", f"must be one of {', '.join(ENDPOINTS)}, got {body.endpoint!r}")
    pairs, key_chars, value_chars = MAX_METADATA
    metadata = body.metadata or {}
    if len(metadata) > pairs or any(len(k) > key_chars or len(v) > value_chars for k, v in metadata.items()):
        message = f"at most {pairs} pairs, keys of {key_chars} characters and values of {value_chars}"
        raise InvalidRequest("metadata", message)
    expiry = body.output_expires_after
    if expiry is not None and (expiry.anchor != "created_at" or not 3600 <= expiry.seconds <= 2592000):
        raise InvalidRequest("output_expires_after", "anchor created_at, seconds 3600 to 2592000")


@router.post("/batches")
async def create_batch(body: BatchCreateRequest, request: Request, runner: RunnerDep) -> dict:
    check_create(body)
    settings = request.app.state.batch_settings
    source = await runner.ask(own_file, runner, request, body.input_file_id)
    if source.purpose != "batch":
        raise InvalidRequest("input_file_id", f"is a {source.purpose} file; a batch reads a batch file")
    data = await runner.ask(read_whole, await runner.ask(runner.store.file_content, source.id))
    if data is None:
        raise not_found("file", body.input_file_id)
    lines = await runner.ask(batch_lines, data, settings.batch_max_lines, settings.batch_line_bytes)
    now = int(time.time())
    batch = Batch(
        new_id("batch_"),
        request.state.owner or "",
        runner.service.name,
        body.endpoint,
        source.id,
        body.completion_window,
        now,
        now + settings.batch_window_s,
        in_progress_at=now,
        total=len(lines),
        metadata=body.metadata,
        output_expires_s=body.output_expires_after.seconds if body.output_expires_after else None,
    )
    if errors := mismatched(lines, body.endpoint):  # as OpenAI: the batch is made, and failed
        batch.status, batch.failed_at, batch.in_progress_at, batch.errors = "failed", now, None, errors
        runner.announce("batch.failed", batch.id)
    if not await runner.ask(runner.store.add_batch, batch, lines, settings.batch_max_per_key):
        message = (
            f"this API key has {settings.batch_max_per_key} batches unfinished, its most "
            "(DIFFSHARD_BATCH_MAX_PER_KEY): wait for one to end, or cancel one"
        )
        raise APIError(429, message, code="rate_limit_exceeded")
    runner.wake()
    return batch.public()


def mismatched(lines: list, endpoint: str) -> list[dict[str, Any]]:
    """The lines whose url is not the batch's endpoint (the first ten), as OpenAI's batch errors."""
    return [
        {
            "code": "invalid_url",
            "line": number,
            "message": f"the url {line.url} is not the batch's endpoint, {endpoint}",
            "param": "url",
        }
        for number, line in enumerate(lines, start=1)
        if line.url != endpoint
    ][:10]


@router.get("/batches/{batch_id}")
async def retrieve_batch(batch_id: str, request: Request, runner: RunnerDep) -> dict:
    return (await runner.ask(own_batch, runner, request, batch_id)).public()


@router.post("/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request, runner: RunnerDep) -> dict:
    """Cancelling, then cancelled once its running lines have stopped (within a second or so)."""
    batch = await runner.ask(own_batch, runner, request, batch_id)
    if batch.finished:
        raise APIError(
            409, f"batch {batch_id!r} is {batch.status}: it cannot be cancelled", code="batch_ended"
        )
    stopped = await runner.ask(runner.store.stop, batch.id, "cancel", int(time.time()))
    return (stopped or batch).public()


@router.get("/batches")
async def list_batches(
    request: Request,
    runner: RunnerDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIST)] = 20,
) -> dict:
    owner = None if request.state.admin else request.state.owner
    batches, more = await runner.ask(runner.store.page_batches, owner, after, limit, "desc")
    data = [batch.public() for batch in batches]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": more}


# What a line runs: the endpoint's checks and answers, for the runner.


def endpoints(service: Service) -> tuple[Any, Any]:
    """`translate(url, body text)` and `refusal(error, request_id)` for `service`'s lines."""

    def translate(url: str, text: str) -> tuple[list[GenerationRequest], Respond]:
        if url == "/v1/images/edits":
            body, edits = edit_body(text, service)
        else:
            body, edits = ImageGenerationRequest.model_validate_json(text), None
        if body.stream:
            raise InvalidRequest(
                "stream", "a batch's lines answer whole responses: send stream false or none"
            )
        controls = read_controls(body.control, service.limits)
        requests = generation_requests(body, service.name, service.limits.max_n, edits, controls)
        background = image_background(body, service.alpha)

        def respond(resolved: list[GenerationRequest], images: list[Any]) -> dict[str, Any]:
            encoded = [
                encode(image, body.output_format, body.output_compression, background == "opaque")
                for image in images
            ]
            steps = service.recommended_steps
            return images_response(body, resolved, encoded, steps, background).model_dump(mode="json")

        return requests, respond

    def refusal(err: Exception, request_id: str) -> tuple[int, dict[str, Any]]:
        if isinstance(err, ValidationError):
            edit = any(e.get("loc", ())[:1] == ("images",) for e in err.errors())
            fields = (ImageEditRequest if edit else ImageGenerationRequest).model_fields
            message, param, code = validation_message(list(err.errors()), "application/json", fields)
            answer = envelope(400, message, param, code)
        elif isinstance(err, DiffshardError):
            answer = domain_response(err, request_id)
        elif isinstance(err, APIError):
            answer = envelope(err.status, err.message, err.param, err.code)
        else:  # a bug: the line fails, its details in the log
            log.error("batch line %s: %s", request_id, err, exc_info=err)
            answer = envelope(
                500, internal_message("internal server error", request_id), code="internal_error"
            )
        return answer.status_code, json.loads(answer.body)

    return translate, refusal


class EditImages(BaseModel):
    """OpenAI's JSON form of an edit's images: {"image_url": a data URL}; file ids are not served."""

    model_config = ConfigDict(strict=True, extra="forbid")

    image_url: str


class EditBody(ImageEditRequest):
    """`/v1/images/edits` as JSON (a batch's line): the form's fields, typed as JSON types them."""

    model_config = ConfigDict(strict=True, extra="forbid")

    images: list[EditImages]
    mask: EditImages | None = None


def edit_body(text: str, service: Service) -> tuple[ImageEditRequest, list]:
    """An edit's JSON body: its fields and one Edit per image, as the multipart route makes them."""
    body = EditBody.model_validate_json(text)
    limits = service.limits
    if not 1 <= len(body.images) <= limits.max_edit_images:
        message = f"send 1 to {limits.max_edit_images} images, got {len(body.images)}"
        raise InvalidRequest("images", message, "DIFFSHARD_MAX_EDIT_IMAGES")
    fidelity = body.input_fidelity
    if fidelity not in (None, "low", "high"):
        raise InvalidRequest("input_fidelity", f"must be low or high, got {fidelity!r}")
    check_fidelity(fidelity, body.keep_unmasked, masked=body.mask is not None)
    bounds = {"max_bytes": limits.max_image_bytes, "max_pixels": limits.max_image_pixels}
    images = [
        data_image(image.image_url, f"images[{i}].image_url", bounds) for i, image in enumerate(body.images)
    ]
    mask = None
    if body.mask is not None:
        read = data_image(body.mask.image_url, "mask.image_url", bounds, MASK_FORMATS)
        mask = mask_to_repaint(read, images[0].size)
    fields = ImageEditRequest.model_validate(body.model_dump(exclude={"images", "mask"}))
    together, alpha = service.edits_by_reference, service.alpha
    return fields, edits_of(fields, images, mask, together=together, alpha=alpha)


def data_image(text: str, field: str, bounds: dict[str, int], formats: tuple[str, ...] | None = None) -> Any:
    """An image sent as a data URL (or bare base64): its length bounded before it is decoded,
    then the upload checks (uploads.py)."""
    encoded = text[found.end() :] if (found := DATA_URL.match(text)) else text
    if len(encoded) > 4 * math.ceil(bounds["max_bytes"] / 3):
        message = f"is over {bounds['max_bytes']} bytes once decoded; the limit is {bounds['max_bytes']}"
        raise InvalidRequest(field, message, "DIFFSHARD_MAX_IMAGE_BYTES")
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(field, "is not a data:image/png;base64,... URL") from None
    return read_image(data, field, **bounds, **({"formats": formats} if formats else {}))
