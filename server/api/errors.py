"""One error envelope for every failure, OpenAI's: {"error": {"message", "type", "param", "code"}},
and one table from diffshard's error tree (`server/errors.py`) to HTTP.

The official SDKs turn the status into an exception class (400 BadRequestError, 401
AuthenticationError, ...) and show `message`, so every message names the field and the limit.
"""

from __future__ import annotations

import difflib
import json
import logging
import secrets
from collections.abc import Iterable
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from server.errors import (
    Cancelled,
    DeadlineExceeded,
    DiffshardError,
    Draining,
    InvalidRequest,
    KeyOverloaded,
    NotReady,
    OutOfMemory,
    Overloaded,
    StepFailed,
    StoreUnavailable,
    Unavailable,
    WorkerLost,
)

log = logging.getLogger("diffshard")

# The pipeline's names for request fields, as the Images API calls them.
WIRE_NAMES = {"steps": "num_inference_steps"}

# error class → (HTTP status, code); the first class in an error's MRO found here wins.
STATUS: dict[type[DiffshardError], tuple[int, str | None]] = {
    InvalidRequest: (400, "invalid_value"),
    NotReady: (503, None),  # the code is the status: loading, failed (to load) or unhealthy
    KeyOverloaded: (429, "rate_limit_exceeded"),  # this key's share of the line: others still get in
    Overloaded: (503, "overloaded"),
    Draining: (503, "draining"),
    OutOfMemory: (503, "out_of_memory"),
    WorkerLost: (503, "worker_lost"),
    DeadlineExceeded: (504, "timeout"),
    Cancelled: (499, "cancelled"),  # nobody listens: uvicorn drops it
    StepFailed: (500, "generation_failed"),
    Unavailable: (503, "unavailable"),
}


class APIError(Exception):
    """An HTTP-only failure (auth, routing) that has no place in the domain tree."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def envelope(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """OpenAI's error body; every answer has a code (by default the status, e.g. bad_request)."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    code = code or _status_code_name(status)
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def internal_message(what: str, request_id: str) -> str:
    """Fixed text for a failure whose details may name internals (paths, devices, other
    processes): those go to the log under the request id, which the client can quote."""
    return f"{what}; request id {request_id}, the server log has the details"


def domain_response(err: DiffshardError, request_id: str) -> JSONResponse:
    """The envelope for an error of diffshard's tree, by the table above."""
    mapped = next((STATUS[c] for c in type(err).__mro__ if c in STATUS), None)
    if mapped is None:  # e.g. a ConfigError raised while serving: a bug, not the client's doing
        _log_details(request_id, err, logging.ERROR)
        return envelope(500, internal_message("internal server error", request_id), code="internal_error")
    status, code = mapped
    message, param, headers = str(err), None, None
    if isinstance(err, InvalidRequest):
        param = WIRE_NAMES.get(err.field, err.field)
        message = f"{param}:{message.split(':', 1)[1]}" if ":" in message else message
    elif isinstance(err, NotReady):
        code = err.status
        if err.status == "failed":  # a load error names files and devices: for the log only
            _log_details(request_id, err, logging.WARNING)
            message = internal_message("the server cannot serve: the model failed to load", request_id)
    elif isinstance(err, Overloaded | StoreUnavailable):
        headers = {"retry-after": str(err.retry_after)}
    elif isinstance(err, OutOfMemory):  # torch's text names device capacity and other processes
        _log_details(request_id, err, logging.WARNING)
        message = internal_message("the device ran out of memory during generation", request_id)
        headers = {"x-should-retry": "false"}  # retrying the same request would fail the same way
    elif isinstance(err, StepFailed):
        _log_details(request_id, err, logging.ERROR)
        message = internal_message("the generation failed", request_id)
    return envelope(status, message, param, code, headers)


def _log_details(request_id: str, err: BaseException, level: int) -> None:
    cause = err.__cause__ or err.__context__
    log.log(
        level,
        "request %s: %s: %s",
        request_id,
        type(err).__name__,
        err,
        exc_info=cause,
        extra={"request_id": request_id},
    )


def _status_code_name(status: int) -> str:
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")
    except ValueError:
        return f"http_{status}"


# pydantic's error types → what the field must be, in the API's words (its own text never reaches a client)
KINDS = {
    "int": "an integer",
    "float": "a number",
    "string": "a string",
    "bool": "true or false",
    "dict": "a JSON object",
    "list": "a JSON array",
}


def validation_message(
    errors: list[dict[str, Any]], content_type: str, fields: Iterable[str]
) -> tuple[str, str | None, str]:
    """FastAPI's validation errors as one (message, param, code), in the API's words. A field the
    body does not know goes first: a misspelt required field is the cause of its "missing"."""
    unknown = [e for e in errors if e.get("type") == "extra_forbidden"]
    error = (unknown or errors)[0]
    loc = [str(part) for part in error.get("loc", ()) if part != "body"]
    kind = error.get("type", "")
    if kind == "json_invalid":
        reason = error.get("ctx", {}).get("error", "parse error")
        return f"the request body is not valid JSON: {reason}", None, "invalid_json"
    if not loc:
        if "json" not in content_type:  # FastAPI reads a body as JSON only when it says it is
            message = f"send the body as JSON with Content-Type: application/json, not {content_type!r}"
            return message, None, "invalid_content_type"
        return "the request body must be a JSON object with at least a prompt", None, "invalid_body"
    param = ".".join(loc)
    if kind == "extra_forbidden":
        missing = [e["loc"][-1] for e in errors if e.get("type") == "missing"]
        return f"{param}: unknown field{_did_you_mean(loc[-1], fields, missing)}", param, "unknown_parameter"
    if kind == "missing":
        return f"{param}: is required", param, "missing_parameter"
    return f"{param}: {_must_be(error)}", param, "invalid_value"


def _must_be(error: dict[str, Any]) -> str:
    """What a value of the wrong type or form must be, and what came."""
    kind, ctx = error.get("type", ""), error.get("ctx") or {}
    if kind == "value_error" and "error" in ctx:  # our own validators' words
        return str(ctx["error"])
    if kind == "int_from_float":
        return f"must be a whole number, got {_shown(error.get('input'))}"
    expected = KINDS.get(kind.removesuffix("_type").removesuffix("_parsing"))
    if expected is None:
        return f"has an invalid value: {_shown(error.get('input'))} (see /openapi.json)"
    return f"must be {expected}, got {_shown(error.get('input'))}"


def _shown(value: object) -> str:
    """A client's value as JSON would spell it, with its type, cut short."""
    kinds = {str: "string", bool: "boolean", int: "number", float: "number", dict: "object", list: "array"}
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    text = text if len(text) <= 40 else text[:37] + "..."
    return f"{kinds.get(type(value), 'value')} {text}" if value is not None else "null"


def _did_you_mean(field: str, fields: Iterable[str], missing: list[str]) -> str:
    """A hint for an unknown field: the required field it may be meant as, or the closest field."""
    close = difflib.get_close_matches(field, missing, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {close[0]!r}? {close[0]} is required"
    close = difflib.get_close_matches(field, fields, n=1, cutoff=0.75)
    return f"; did you mean {close[0]!r}?" if close else " (see /openapi.json for the fields)"


def install_error_handlers(app: FastAPI) -> None:
    """Handlers for the errors routes raise; anything else is `RequestContext`'s (a 500)."""

    @app.exception_handler(DiffshardError)
    async def domain_error(request: Request, err: DiffshardError) -> JSONResponse:
        return domain_response(err, getattr(request.state, "request_id", None) or secrets.token_hex(8))

    @app.exception_handler(APIError)
    async def api_error(_request: Request, err: APIError) -> JSONResponse:
        return envelope(err.status, err.message, err.param, err.code, err.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        # the bodies' fields, for "did you mean": imported here, so the error table alone imports
        # no schema (and through it, no torch)
        from server.api.schemas import ImageEditRequest, ImageGenerationRequest

        edit = request.url.path.endswith("/edits")
        fields = getattr(request.state, "body_fields", None)  # a route validating its own body says whose
        fields = fields or (ImageEditRequest if edit else ImageGenerationRequest).model_fields
        content_type = request.headers.get("content-type", "")
        message, param, code = validation_message(list(err.errors()), content_type, fields)
        return envelope(400, message, param, code)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        headers = dict(err.headers or {})  # a 405's Allow among them
        if err.status_code == 404:
            return envelope(404, f"no route {request.url.path}", code="not_found", headers=headers)
        if err.status_code == 405:
            allowed = headers.get("Allow", "")
            message = f"{request.method} is not allowed on {request.url.path}; it takes {allowed}"
            return envelope(405, message, code="method_not_allowed", headers=headers)
        if err.status_code == 400:  # the body could not be parsed at all (not UTF-8, a broken form)
            form = request.headers.get("content-type", "").startswith("multipart/")
            how = "a multipart/form-data body, as OpenAI's SDKs send" if form else "UTF-8 JSON"
            message = f"the request body cannot be parsed ({err.detail}): send it as {how}"
            return envelope(400, message, code="invalid_body", headers=headers)
        return envelope(err.status_code, str(err.detail), headers=headers)
