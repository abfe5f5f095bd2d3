"""/v1/files: OpenAI's Files API, for the Batch API: a batch's JSONL input (purpose `batch`),
uploaded as the SDK's multipart form and checked line by line before it is kept (each line a
request of `/v1/images/generations` or `/v1/images/edits`; a malformed one refuses the file,
naming its line); a batch's output and error files, downloaded by `GET /v1/files/{id}/content`.
Files live in the job store (`serving/batchstore.py`) and belong to the caller's key."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import FileResponse, Response, StreamingResponse

from server.api.auth import require_key
from server.api.errors import APIError
from server.api.multipart import FormLimits, read_form
from server.errors import InvalidRequest, NotReady
from server.serving.batches import BatchRunner
from server.serving.batchstore import LineInput, StoredFile, new_id
from server.serving.videostore import Content

router = APIRouter(prefix="/v1", dependencies=[Depends(require_key)], tags=["batches"])
ENDPOINTS = ("/v1/images/generations", "/v1/images/edits")  # what a batch's lines may call
LINE_KEYS = {"custom_id", "method", "url", "body"}
MAX_LIST = 10000  # OpenAI's bound on a files page
MAX_FORM_TEXT = 4096  # the form's text fields: purpose and expires_after
INSUFFICIENT_STORAGE = 507
FORM_FIELDS = {"purpose", "expires_after[anchor]", "expires_after[seconds]"}
# the multipart reader keeps no file names: an input is named for what it holds
INPUT_NAME = "batch_input.jsonl"


def runner_of(request: Request) -> BatchRunner:
    """The batch runner, once the model has loaded (503 while it loads, as the images' routes)."""
    runner = getattr(request.app.state, "batches", None)
    if runner is None:
        runtime = request.app.state.runtime
        raise NotReady(runtime.status, runtime.status_message())
    return runner


RunnerDep = Annotated[BatchRunner, Depends(runner_of)]


def not_found(what: str, given: str) -> APIError:
    return APIError(404, f"no {what} {given!r} (it expired, was deleted, or is not yours)", code="not_found")


def own_file(runner: BatchRunner, request: Request, file_id: str) -> StoredFile:
    """The file, if it exists and is the caller's (another key's is as unknown as a missing one)."""
    file = runner.store.get_file(file_id)
    owner = request.state.owner
    if file is None or (owner is not None and not request.state.admin and file.owner != owner):
        raise not_found("file", file_id)
    return file


def batch_lines(data: bytes, max_lines: int, max_line_bytes: int) -> list[LineInput]:
    """A batch file's lines, each checked as OpenAI's batch input says it is shaped (JSON, a
    unique custom_id, POST, an images endpoint, a body object), or InvalidRequest naming the
    line. What a body holds is its endpoint's to check, when the line runs."""
    lines: list[LineInput] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        if len(raw) > max_line_bytes:
            message = f"line {number}: is {len(raw)} bytes; the limit is {max_line_bytes}"
            raise InvalidRequest("file", message, "DIFFSHARD_BATCH_LINE_BYTES")
        if len(lines) == max_lines:
            message = f"holds more than {max_lines} requests, the limit a batch"
            raise InvalidRequest("file", message, "DIFFSHARD_BATCH_MAX_LINES")
        lines.append(checked_line(raw, number, seen))
    if not lines:
        raise InvalidRequest("file", "holds no requests: one JSON object a line")
    return lines


def checked_line(raw: bytes, number: int, seen: dict[str, int]) -> LineInput:
    try:
        line = json.loads(raw)
    except RecursionError:
        raise InvalidRequest("file", f"line {number}: is nested too deeply to parse") from None
    except ValueError as err:
        raise InvalidRequest("file", f"line {number}: is not valid JSON ({err})") from None
    if not isinstance(line, dict):
        raise InvalidRequest(
            "file", f"line {number}: must be a JSON object with custom_id, method, url, body"
        )
    if unknown := sorted(line.keys() - LINE_KEYS):
        raise InvalidRequest(
            "file", f"line {number}: unknown field {unknown[0]!r} (a line has {sorted(LINE_KEYS)})"
        )
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise InvalidRequest("file", f"line {number}: custom_id must be a non-empty string")
    if custom_id in seen:
        raise InvalidRequest(
            "file", f"line {number}: custom_id {custom_id!r} is on line {seen[custom_id]} too"
        )
    seen[custom_id] = number
    if line.get("method") != "POST":
        raise InvalidRequest("file", f"line {number}: method must be POST, got {line.get('method')!r}")
    if line.get("url") not in ENDPOINTS:
        raise InvalidRequest(
            "file", f"line {number}: url must be one of {', '.join(ENDPOINTS)}, got {line.get('url')!r}"
        )
    if not isinstance(line.get("body"), dict):
        raise InvalidRequest(
            "file", f"line {number}: body must be a JSON object, the endpoint's request body"
        )
    return LineInput(custom_id, line["url"], json.dumps(line["body"]))


@router.post(
    "/files",
    openapi_extra={
        "requestBody": {
            "content": {
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "required": ["file", "purpose"],
                        "properties": {
                            "file": {"type": "string", "format": "binary"},
                            "purpose": {"type": "string", "enum": ["batch"]},
                        },
                    }
                }
            },
            "required": True,
        }
    },
)
async def upload_file(request: Request, runner: RunnerDep) -> dict:
    """A batch's input, as the SDK's `client.files.create(file=..., purpose="batch")` sends it."""
    settings = request.app.state.batch_settings
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        message = f"send a file as multipart/form-data (file, purpose), not {content_type!r}"
        raise APIError(400, message, code="invalid_content_type")
    # the body limit (DIFFSHARD_BATCH_FILE_BYTES beside the form's text) stops a larger file first
    limit = settings.batch_file_bytes + MAX_FORM_TEXT
    form = await read_form(request, FormLimits(limit, ((("file",), 1, None),), MAX_FORM_TEXT, 8))
    purpose = form.fields.get("purpose")
    if purpose != "batch":
        raise InvalidRequest("purpose", f"must be batch (the Batch API's input), got {purpose!r}")
    if unknown := sorted(set(form.fields) - FORM_FIELDS):
        raise InvalidRequest(unknown[0], "unknown field (a file takes file, purpose and expires_after)")
    uploads = form.files.get("file")
    if not uploads:
        raise InvalidRequest("file", "is required: the batch's requests, one JSON object a line")
    data = uploads[0]
    if len(data) > settings.batch_file_bytes:
        message = f"is {len(data)} bytes; the limit is {settings.batch_file_bytes}"
        raise InvalidRequest("file", message, "DIFFSHARD_BATCH_FILE_BYTES")
    await asyncio.to_thread(batch_lines, data, settings.batch_max_lines, settings.batch_line_bytes)
    now = int(time.time())
    expiry = expires_after(form.fields, settings.batch_file_expiry_s)
    owner = request.state.owner or ""
    file = StoredFile(new_id("file-"), owner, INPUT_NAME, "batch", len(data), now, now + expiry)
    if not await runner.ask(runner.store.add_file, file, data, settings.batch_store_bytes):
        message = (
            f"the files kept are near {settings.batch_store_bytes} bytes, the most "
            "(DIFFSHARD_BATCH_STORE_BYTES): delete files you no longer need, or wait for them to expire"
        )
        raise APIError(INSUFFICIENT_STORAGE, message, code="insufficient_storage")
    return file.public()


def expires_after(fields: dict[str, str], default_s: int) -> int:
    """OpenAI's `expires_after` (anchor created_at, 3600 s to 30 days), within the server's keeping."""
    seconds = fields.get("expires_after[seconds]")
    if seconds is None:
        return default_s
    if fields.get("expires_after[anchor]") != "created_at":
        raise InvalidRequest("expires_after", "anchor must be created_at")
    if not seconds.isdigit() or not 3600 <= int(seconds) <= 2592000:
        raise InvalidRequest("expires_after", f"seconds must be 3600 to 2592000, got {seconds!r}")
    return min(int(seconds), default_s)


@router.get("/files")
async def list_files(
    request: Request,
    runner: RunnerDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=MAX_LIST)] = 10000,
    order: Literal["asc", "desc"] = "desc",
    purpose: str | None = None,
) -> dict:
    owner = None if request.state.admin else request.state.owner
    files, more = await runner.ask(runner.store.page_files, owner, after, limit, order, purpose)
    data = [file.public() for file in files]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return {"object": "list", "data": data, "first_id": first, "last_id": last, "has_more": more}


@router.get("/files/{file_id}")
async def retrieve_file(file_id: str, request: Request, runner: RunnerDep) -> dict:
    return (await runner.ask(own_file, runner, request, file_id)).public()


@router.get("/files/{file_id}/content", response_model=None)
async def file_content(file_id: str, request: Request, runner: RunnerDep) -> Response:
    file = await runner.ask(own_file, runner, request, file_id)
    content = await runner.ask(runner.store.file_content, file.id)
    if content is None:
        raise not_found("file", file_id)
    media = "application/jsonl"
    if isinstance(content, Path):
        return FileResponse(content, media_type=media, filename=file.filename)
    headers = {
        "Content-Disposition": f'attachment; filename="{file.filename}"',
        "Content-Length": str(content.size),
    }
    return StreamingResponse(pieces_of(runner, content), media_type=media, headers=headers)


async def pieces_of(runner: BatchRunner, content: Content):
    """A file from the store a piece at a time (uvicorn waits while the client's socket is full)."""
    pieces = content.pieces()
    while (piece := await runner.ask(next, pieces, None)) is not None:
        yield piece


@router.delete("/files/{file_id}")
async def delete_file(file_id: str, request: Request, runner: RunnerDep) -> dict:
    file = await runner.ask(own_file, runner, request, file_id)
    await runner.ask(runner.store.delete_file, file.id)
    return {"id": file.id, "object": "file", "deleted": True}
